"""Scheduler side of DisaggConnector (runs in vLLM's EngineCore process).

Prefill (producer): ``request_finished`` of a ``do_remote_decode`` request hands its KV over under
a lease and returns the handoff's kv_transfer_params. Where the workers have a staging arena with
room, the KV is copied there (first thing in the next step) and vLLM frees the paged blocks at
once, so an engine holding only handoffs goes idle; otherwise the request keeps its paged blocks
until decode has pulled them (vLLM then keeps stepping). Decode (consumer): a
``do_remote_prefill`` request is held from its arrival (the LeaseKeeper renews its lease), claims
its whole prompt as loadable asynchronously, and the worker pulls it. With a store transport,
prefill also claims the leading chunks of any prompt that the store already holds
(``prefix_lookup``), and the worker loads them instead of computing them.

A decode request with ``n > 1`` reaches the engine as n sibling requests that share one
``kv_transfer_params``: one handoff. The first sibling admitted owns it and pulls it; the
others wait (``get_num_new_matched_tokens`` -> None: "ask again", without blocking the queue)
until that load has landed, then take the prompt's full blocks from decode's prefix cache and
compute only the tail, exactly as n siblings do on a plain instance. So the KV moves once, the
handoff is read once and released once. If the owner's load failed, every sibling's load is
reported failed too (``kv_load_failure_policy`` then applies to each).

A decode request that arrived with a handoff but computed its prompt itself (its load failed
under ``kv_load_failure_policy=recompute``, its params were unusable, or vLLM read no cached KV
for it: prompt logprobs) looks exactly like a disaggregated one from outside, only slower and
with prefill's work wasted: each is counted once it finishes, by reason
(``vllm:kvdisagg_recomputed_prompts_total{reason}``, stats.RECOMPUTED).

Must not import torch or kvdisagg.transport: all byte movement is the worker's.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from kvdisagg.connector.config import ConnectorConfig
from kvdisagg.connector.leases import Held, LeaseKeeper
from kvdisagg.connector.metadata import (
    DisaggMetadata,
    DisaggWorkerMeta,
    LoadSpec,
    SendSpec,
    WorkerHandshake,
)
from kvdisagg.connector.protocol.params import (
    EARLY_PARAMS_KEY,
    EarlyHandoff,
    RemotePrefill,
    handoff_params,
)
from kvdisagg.connector.protocol.versions import (
    EARLY_HANDOFF_VERSION,
    PROTOCOL_VERSION,
    Versions,
    spoken,
)
from kvdisagg.connector.retire import Retirement
from kvdisagg.connector.sharding import Shape, check, plan
from kvdisagg.connector.stats import DisaggStats
from kvdisagg.tracing import TRACE_PARAMS_KEY, Tracer, end, traceparent_of, valid_traceparent

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


EARLY_IDLE_S = 0.001  # an idle engine's pause per step while early loads wait (see above)

PrefixLookup = Callable[[Sequence[int], str, Shape], int]  # (prompt, kv_layout, shape) -> tokens
HandoffKey = tuple[str, str, str]  # (remote_engine_id, remote_request_id, token)


@dataclasses.dataclass
class _Incoming:
    """A decode request that arrived with a handoff: its kv_transfer_params converted once, at
    arrival (vLLM's ``on_new_request``), and what became of it."""

    handoff: RemotePrefill | None  # None: unusable params, ``error`` says why
    error: str = ""
    trace: str = ""  # the proxy leg's traceparent, validated ('' when none or malformed)
    # Why it computes its prompt itself ('' while it does not, as far as is known).
    recomputed: str = ""
    version: int = PROTOCOL_VERSION  # the side-channel version spoken with its prefill

    @classmethod
    def of(cls, params: dict[str, Any], mine: Versions) -> _Incoming:
        """``mine``: the protocol versions this decode speaks; params of a prefill with none
        in common (the proxy pairs instances that have one) are unusable."""
        trace = valid_traceparent(params.get(TRACE_PARAMS_KEY))
        try:
            handoff = msgspec.convert(params, RemotePrefill)
        except msgspec.ValidationError as exc:
            return cls(None, error=f"invalid kv_transfer_params: {exc}", trace=trace)
        theirs = handoff.kvdisagg.versions()
        version = mine.common(theirs)
        if version is None:
            return cls(None, trace=trace, error=(
                f"prefill {handoff.remote_host} speaks side-channel protocol {theirs}, this "
                f"decode {mine}: no version in common (instances of releases too far apart; "
                "the proxy pairs only instances with one, docs/operations.md#rolling-upgrades)"))
        if handoff.kvdisagg.early and version < EARLY_HANDOFF_VERSION:
            return cls(None, trace=trace, error=(
                f"an early handoff needs protocol {EARLY_HANDOFF_VERSION} on both sides; "
                f"prefill {handoff.remote_host} and this decode speak {version}"))
        return cls(handoff, trace=trace, version=version)

    @property
    def key(self) -> HandoffKey | None:
        """Which handoff it names (siblings of ``n > 1`` share one)."""
        h = self.handoff
        return None if h is None else (h.remote_engine_id, h.remote_request_id,
                                       h.kvdisagg.token)


@dataclasses.dataclass
class _Shared:
    """One handoff that several decode requests (siblings) carry."""

    refs: int = 0  # requests carrying it that have not finished
    owner: str = ""  # the request whose load pulls it
    landed: bool = False  # the owner's load is done: the blocks are in decode's prefix cache
    failed: bool = False  # the owner's load failed


class DisaggScheduler:
    def __init__(self, vllm_config: VllmConfig, config: ConnectorConfig,
                 prefix_lookup: PrefixLookup | None = None) -> None:
        kv = vllm_config.kv_transfer_config
        assert kv is not None
        self.config = config
        self.engine_id: str = kv.engine_id or ""
        self.is_producer, self.is_consumer = kv.is_kv_producer, kv.is_kv_consumer
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.shape = Shape(self.tp_size)  # this instance's TP and PP stages (from the handshake)
        model = vllm_config.model_config
        self.kv_heads, self.num_layers = (model.get_total_num_kv_heads(),
                                          model.get_total_num_hidden_layers())
        self.block_size = vllm_config.cache_config.block_size
        self.versions = spoken(config.protocol_version_override)  # side-channel versions
        if config.protocol_version_override is not None:
            logger.warning("kvdisagg: protocol_version_override=%d (a test setting): this "
                           "instance announces side-channel protocol %s only",
                           config.protocol_version_override, self.versions)
        self.prefix_lookup = prefix_lookup
        self._stored: dict[str, int] = {}  # memo of prefix_lookup per waiting request
        self.ports: list[int] = []
        self.transport_name = ""  # the wire name the workers' transport reports
        self.kv_layout = ""
        self.keyed_by_tokens = False
        self._pulled: set[str] = set()  # decode requests whose load was already planned
        # Decode requests that arrived with a handoff, until they finish.
        self._incoming: dict[str, _Incoming] = {}
        self._key_of: dict[str, HandoffKey] = {}  # decode request -> the handoff it carries
        self._shared: dict[HandoffKey, _Shared] = {}
        self._sends: list[SendSpec] = []
        self._loads: list[LoadSpec] = []
        self._early: dict[str, EarlyHandoff] = {}  # prefill requests naming their handoff
        self._early_waiting: set[str] = set()  # decode: early loads planned, not yet reported
        self._expects: list[tuple[str, str]] = []
        self._forgets: list[tuple[str, str]] = []
        self.leases: LeaseKeeper | None = None  # decode: keeps held handoffs alive
        self._renewed_seen = 0
        self._stats = DisaggStats()  # the scheduler's own, until vLLM takes them
        self.tracer = (Tracer.otlp(config.otlp_traces_endpoint, "kvdisagg-decode-scheduler")
                       if self.is_consumer else Tracer.disabled())  # spans of planned loads
        self._load_started: dict[str, tuple[float, Any]] = {}  # planned loads: (time, span)
        # Prefill's staging arena: free arena block ids, and those of each staged handoff
        # until every worker has freed it.
        self._free_slots: list[int] = []
        self._staged: dict[str, tuple[int, ...]] = {}
        self._staged_freed: dict[str, int] = {}
        self.retirement = Retirement(  # SIGTERM: serve the handoffs held, then exit (retire.py)
            config.lease_seconds + config.transfer_timeout_seconds if self.is_producer else 0,
            getattr(vllm_config, "shutdown_timeout", 0))
        self.retirement.arm()

    def set_handshake(self, metadata: dict[tuple[int, int], Any]) -> None:
        """Learn every rank's side-channel port (PP-major: ``pp * tp_size + tp``), the PP stages
        and the layout fingerprint (once, at start)."""
        ranks = sorted((key, m) for key, m in metadata.items()
                       if isinstance(m, WorkerHandshake))
        self.ports = [m.port for _, m in ranks]
        if ranks:
            self.shape = Shape(self.tp_size, tuple(ranks[0][1].stages))
        self.kv_layout = ranks[0][1].kv_layout if ranks else ""
        self.transport_name = ranks[0][1].transport if ranks else ""
        self.keyed_by_tokens = bool(ranks and ranks[0][1].keyed_by_tokens)
        if ranks and self.is_producer:
            base = ranks[0][1].num_blocks
            self._free_slots = list(range(base, base + min(m.stage_blocks for _, m in ranks)))
        if self.is_consumer and not self.keyed_by_tokens:
            self.leases = LeaseKeeper(self.kv_layout, self.transport_name,
                                      self.config.transfer_timeout_seconds,
                                      geometry=ranks[0][1].geometry if ranks else None)

    def on_new_request(self, request: Request) -> None:
        """Decode: convert the request's handoff params once and hold the handoff from now on
        (renewed while it waits). Prefill: a request naming its early handoff has the workers
        expect it (an early Read waits for it meanwhile)."""
        params = request.kv_transfer_params
        if self.is_producer and params and (early := params.get(EARLY_PARAMS_KEY)):
            try:
                named = msgspec.convert(early, EarlyHandoff)
            except msgspec.ValidationError as exc:  # served as an ordinary handoff
                logger.warning("kvdisagg: request %s: ignoring invalid %s: %s",
                               request.request_id, EARLY_PARAMS_KEY, exc)
            else:
                self._early[request.request_id] = named
                self._expects.append((named.handoff_id, named.token))
        if not self.is_consumer or not (params and params.get("do_remote_prefill")):
            return
        incoming = self._incoming[request.request_id] = _Incoming.of(params, self.versions)
        if (key := incoming.key) is not None:
            self._key_of[request.request_id] = key
            self._shared.setdefault(key, _Shared()).refs += 1
        if self.leases is None or (p := incoming.handoff) is None:
            return  # unusable params are refused when its load is planned
        self.leases.hold(request.request_id, Held(
            p.remote_request_id, p.kvdisagg.token, p.remote_host, tuple(p.kvdisagg.ports),
            p.kvdisagg.lease_s, incoming.version))

    def update_connector_output(self, finished_recving: set[str], failed_recving: set[str],
                                worker_meta: DisaggWorkerMeta | None) -> None:
        """A reported load ends the hold (a failed one also releases prefill's KV); staged
        handoffs freed on every worker give their arena blocks back."""
        for req_id in finished_recving:
            self._early_waiting.discard(req_id)
            incoming = self._incoming.get(req_id)
            if req_id in failed_recving and incoming is not None and not incoming.recomputed:
                incoming.recomputed = "load_failed"  # recomputed if the request then finishes
            if self.leases is not None:
                self.leases.drop(req_id, release=req_id in failed_recving)
            shared = self._shared.get(self._key_of.get(req_id))  # type: ignore[arg-type]
            if shared is not None and shared.owner == req_id:
                shared.landed = req_id not in failed_recving
                shared.failed = not shared.landed
            if (started := self._load_started.pop(req_id, None)) is not None:
                self._stats.observe(load=time.perf_counter() - started[0])
                end(started[1], failed=req_id in failed_recving)
        for req_id, n in (worker_meta.released.items() if worker_meta else ()):
            self._staged_freed[req_id] = self._staged_freed.get(req_id, 0) + n
            if self._staged_freed[req_id] >= self.shape.world:
                del self._staged_freed[req_id]
                self._free_slots.extend(self._staged.pop(req_id, ()))

    def take_stats(self) -> DisaggStats | None:
        """Decode: lease renewals sent and loads seen finished since the last call (vLLM
        adds them to the workers')."""
        if self.retirement.retiring and not self.retirement.announced:
            self.retirement.announced = True
            self._stats.add(retiring=1)
        if self.leases is not None and self.leases.renewed != self._renewed_seen:
            self._stats.add(lease_renewals=self.leases.renewed - self._renewed_seen)
            self._renewed_seen = self.leases.renewed
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, DisaggStats()
        return stats

    def has_pending_work(self) -> bool:
        """Offers not yet handed to the workers need one more step, even with no request; while
        retiring, so do staged handoffs until every worker freed them (retire.py)."""
        return (bool(self._sends or self._expects or self._forgets)
                or self.retirement.holds(len(self._staged)))

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        """Side-effect free. The whole rest of the prompt is loadable; vLLM recomputes the last
        token itself (it sets computed = prompt - 1 after the load)."""
        if request.request_id in self._pulled:
            return 0, False
        shared = self._sibling_of(request.request_id)
        if shared is not None and not shared.failed:
            # A sibling pulls this handoff: wait for it, then use decode's prefix cache.
            return (0, False) if shared.landed else (None, False)  # type: ignore[return-value]
        if (incoming := self._incoming.get(request.request_id)) is not None:
            # Never claim past what prefill computed (a handoff of another, shorter prompt);
            # unusable params are refused when the load is planned.
            end = request.num_prompt_tokens
            if incoming.handoff is not None and not incoming.handoff.kvdisagg.early:
                end = min(end, incoming.handoff.remote_num_tokens)
            count = end - num_computed_tokens
            return (count, True) if count > 0 else (0, False)
        if self.prefix_lookup is not None and self.kv_layout:
            count = self._stored_tokens(request) - num_computed_tokens
            return (count, True) if count > 0 else (0, False)
        return 0, False

    def _sibling_of(self, req_id: str) -> _Shared | None:
        """The shared handoff of ``req_id`` when another request owns its load."""
        shared = self._shared.get(self._key_of.get(req_id))  # type: ignore[arg-type]
        return shared if shared is not None and shared.owner not in ("", req_id) else None

    def _stored_tokens(self, request: Request) -> int:
        """Leading prompt tokens the store holds, short of the whole prompt (vLLM must compute
        at least the last token to sample)."""
        if request.request_id not in self._stored:
            assert self.prefix_lookup is not None  # the caller checked
            stored = self.prefix_lookup(request.prompt_token_ids, self.kv_layout, self.shape)
            chunk = self.config.lmcache_chunk_tokens
            while stored >= request.num_prompt_tokens:
                stored -= chunk
            self._stored[request.request_id] = max(stored, 0)
        return self._stored[request.request_id]

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        stored = self._stored.pop(request.request_id, 0)
        if request.request_id in self._pulled:
            return
        if (incoming := self._incoming.get(request.request_id)) is None:
            if num_external_tokens > 0 and stored:
                self._pulled.add(request.request_id)
                self._loads.append(self._plan_prefix_load(request, blocks, num_external_tokens,
                                                          stored))
            return
        self._pulled.add(request.request_id)  # never pull twice (recompute, preemption)
        if request.skip_reading_prefix_cache:
            incoming.recomputed = "not_read"  # vLLM claimed nothing of the load
        if (shared := self._sibling_of(request.request_id)) is not None:
            if self.leases is not None:  # the owner's load reads and releases the handoff
                self.leases.drop(request.request_id, release=False)
            if shared.failed and num_external_tokens > 0:
                self._loads.append(LoadSpec(req_id=request.request_id, error=(
                    f"the load of handoff {shared.owner!r}, shared with this request, failed")))
            return
        if (key := self._key_of.get(request.request_id)) is not None:
            self._shared[key].owner = request.request_id
            self._shared[key].landed = num_external_tokens == 0  # nothing to pull: cached
        local = blocks.get_unhashed_block_ids() if num_external_tokens > 0 else []
        # The unhashed blocks follow the local prefix-cache hit: they hold prompt blocks
        # first.. (by position), whatever prefill offered beyond the prompt.
        first = len(blocks.get_block_ids()[0]) - len(local) if local else 0
        local = local[:-(-num_external_tokens // self.block_size)] if local else []
        load = self._plan_load(request.request_id, incoming, local, first)
        if load.error and not incoming.recomputed:
            incoming.recomputed = "invalid_params"
        if (load.error or load.release_only) and self.leases is not None:
            self.leases.drop(request.request_id, release=False)  # the worker reports no load
        if self.keyed_by_tokens and not load.error and incoming.handoff is not None:
            # Keyed by the tokens prefill stored: decode's prompt may extend them (a
            # continuation after prefill's first token, proxy/handoff/first_token.py).
            tokens = request.prompt_token_ids
            if not incoming.handoff.kvdisagg.early:
                tokens = tokens[:incoming.handoff.remote_num_tokens]
            load = dataclasses.replace(load, prompt_token_ids=tuple(tokens))
        if not (load.error or load.release_only):
            if load.early:
                self._early_waiting.add(request.request_id)
            span = self.tracer.start("kvdisagg.load", incoming.trace,
                                     attributes={"kvdisagg.blocks": len(local)})
            self._load_started[request.request_id] = (time.perf_counter(), span)
            load = dataclasses.replace(load, trace=traceparent_of(span))
        self._loads.append(load)

    def _plan_prefix_load(self, request: Request, blocks: KVCacheBlocks,
                          num_external_tokens: int, stored: int) -> LoadSpec:
        """Prefill: load stored chunks into the blocks after the local prefix-cache hit."""
        local = blocks.get_unhashed_block_ids()[:num_external_tokens // self.block_size]
        first = (stored - num_external_tokens) // self.block_size  # blocks hit locally
        return LoadSpec(req_id=request.request_id, handoff_id=f"prefix-{request.request_id}",
                        transport=self.transport_name, kv_layout=self.kv_layout,
                        local_block_ids=tuple(local), first_block=first,
                        prompt_token_ids=tuple(request.prompt_token_ids))

    def _plan_load(self, req_id: str, incoming: _Incoming, local: list[int],
                   first: int = 0) -> LoadSpec:
        """Pull prompt blocks ``first..`` (by position) of the handoff into ``local``."""
        if (p := incoming.handoff) is None:
            return LoadSpec(req_id=req_id, error=incoming.error)
        # Any TP and PP on either side: each decode rank reads its heads and layers from the
        # prefill ranks holding them (sharding.py).
        prefill = Shape(p.tp_size, tuple(p.kvdisagg.stages))
        if len(p.kvdisagg.ports) != prefill.world:
            return LoadSpec(req_id=req_id, error=f"prefill advertises {len(p.kvdisagg.ports)} "
                            f"side-channel ports for its {prefill.world} ranks "
                            f"({prefill.describe()})")
        if why := check(prefill, self.shape, kv_heads=self.kv_heads, num_layers=self.num_layers):
            return LoadSpec(req_id=req_id, error=f"cannot pull from prefill {prefill.describe()} "
                            f"into decode {self.shape.describe()}: {why}")
        early = p.kvdisagg.early  # prefill names its blocks when it grants the Read
        if not early and len(p.remote_block_ids) < first + len(local):
            return LoadSpec(req_id=req_id, error=f"prefill offers {len(p.remote_block_ids)} "
                            f"blocks, decode needs {first + len(local)}")
        remote = () if early else p.remote_block_ids[first:first + len(local)]
        return LoadSpec(req_id=req_id, host=p.remote_host, ports=tuple(p.kvdisagg.ports),
                        prefill=prefill,
                        parts=plan(prefill, self.shape, self.kv_heads, self.num_layers),
                        handoff_id=p.remote_request_id, token=p.kvdisagg.token,
                        transport=p.kvdisagg.transport, early=early,
                        kv_layout=p.kvdisagg.kv_layout, remote_block_ids=tuple(remote),
                        local_block_ids=tuple(local), first_block=first,
                        release_only=not local, version=incoming.version)

    def build_connector_meta(self, idle: bool = False) -> DisaggMetadata:
        """The step's metadata. ``idle``: the step computes nothing. vLLM's engine loop spins
        while a request waits for its KV; an early handoff's wait lasts prefill's whole compute
        (not a pull's few ms), so an engine with nothing else to do pauses EARLY_IDLE_S per
        empty step instead of taking a core from everything else on the host."""
        if idle and self._early_waiting:
            time.sleep(EARLY_IDLE_S)
        meta = DisaggMetadata(sends=self._sends, loads=self._loads, expects=self._expects,
                              forgets=self._forgets)
        self._sends, self._loads, self._expects, self._forgets = [], [], [], []
        return meta

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        self._pulled.discard(request.request_id)
        self._stored.pop(request.request_id, None)
        self._early_waiting.discard(request.request_id)
        finished = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED,
                                      RequestStatus.FINISHED_STOPPED)
        incoming = self._incoming.pop(request.request_id, None)
        if incoming is not None and incoming.recomputed and finished:
            self._stats.recomputed(incoming.recomputed)  # answered, from a prompt computed here
        if (key := self._key_of.pop(request.request_id, None)) is not None:
            shared = self._shared[key]
            if shared.owner == request.request_id and not shared.landed:
                shared.failed = True  # gone before its load landed: the siblings cannot share it
            shared.refs -= 1
            if shared.refs <= 0:
                del self._shared[key]
        if (started := self._load_started.pop(request.request_id, None)) is not None:
            end(started[1], abandoned=True)  # finished before its load was reported
        if self.leases is not None:  # gone before its pull was reported: free prefill's KV
            self.leases.drop(request.request_id, release=True)
        params = request.kv_transfer_params
        if (self.is_consumer and self.keyed_by_tokens and finished and block_ids
                and self.config.lmcache_store_decoded):
            return self._store_decoded(request, block_ids), None
        early = self._early.pop(request.request_id, None)
        if (not self.is_producer or not params or not params.get("do_remote_decode")
                or not block_ids or not finished):
            if early is not None:  # the decode reading it early gets a refusal, not a wait
                self._forgets.append((early.handoff_id, f"not offered: prefill's request "
                                      f"ended {request.status.name}"))
            return False, None
        token = early.token if early is not None else secrets.token_urlsafe(16)
        handoff_id = early.handoff_id if early is not None else request.request_id
        self.retirement.offered()
        tokens = tuple(request.prompt_token_ids) if self.keyed_by_tokens else ()
        stage_from: tuple[int, ...]
        offered, stage_from = tuple(block_ids), ()
        if len(block_ids) <= len(self._free_slots):
            offered, stage_from = tuple(self._free_slots[:len(block_ids)]), tuple(block_ids)
            del self._free_slots[:len(block_ids)]
            self._staged[request.request_id] = offered
        self._sends.append(SendSpec(request.request_id, token, offered,
                                    self.config.lease_seconds, tokens, stage_from,
                                    valid_traceparent(params.get(TRACE_PARAMS_KEY)),
                                    handoff_id if early is not None else ""))
        return not stage_from, handoff_params(
            engine_id=self.engine_id, request_id=handoff_id, block_ids=list(offered),
            host=self.config.side_channel_host, ports=self.ports,
            num_tokens=request.num_computed_tokens, transport=self.transport_name,
            kv_layout=self.kv_layout, token=token, lease_s=self.config.lease_seconds,
            stages=list(self.shape.stages), versions=self.versions)

    def _store_decoded(self, request: Request, block_ids: list[int]) -> bool:
        """Decode with a store transport: the finished request's KV, prompt and answer, goes to
        the store in whole chunks (the next turn's prompt starts with them); its blocks are
        held until stored. True if there was anything to store."""
        chunk = self.config.lmcache_chunk_tokens
        tokens = [*request.prompt_token_ids, *request.output_token_ids][
            :request.num_computed_tokens]  # the last sampled token has no KV yet
        tokens = tokens[:len(tokens) // chunk * chunk]
        if not tokens:
            return False
        blocks = tuple(block_ids[:len(tokens) // self.block_size])
        self._sends.append(SendSpec(request.request_id, "", blocks, self.config.lease_seconds,
                                    tuple(tokens)))
        return True

    def shutdown(self) -> None:
        if self.leases is not None:
            self.leases.close()
        self.tracer.shutdown()
