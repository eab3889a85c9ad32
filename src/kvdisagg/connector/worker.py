"""Worker side of DisaggConnector (runs in each vLLM worker process).

Prefill: registers the KV memory (and a staging arena) with the transport and offers each finished
request's blocks, first copying them into the arena where the scheduler staged them. Freed
handoffs go back to vLLM as ``finished_sending`` (paged blocks vLLM still holds) or to the
scheduler in worker metadata (arena blocks). Decode: runs each planned fetch on a thread pool
straight into the request's blocks, and reports every load exactly once, done or failed, so
vLLM's kv_load_failure_policy decides. A load is one fetch per Part of this worker's rank
(sharding.py): the heads and layers it holds, from each prefill rank holding them.

Must not import connector/scheduler.py.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from kvdisagg.connector.config import ConnectorConfig
from kvdisagg.connector.layout import (
    LayerRegion,
    geometry_of,
    layer_regions,
    stage_into,
    with_arena,
)
from kvdisagg.connector.metadata import DisaggMetadata, DisaggWorkerMeta, LoadSpec, WorkerHandshake
from kvdisagg.connector.sharding import Shape
from kvdisagg.connector.stats import DisaggStats
from kvdisagg.connector.threads import unbind_current_thread
from kvdisagg.errors import ChecksumMismatch, KvDisaggError
from kvdisagg.tracing import Tracer, end, now_ns, traceparent_of
from kvdisagg.transport import Fetch, Offer, PullTiming, load_transport

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)


class DisaggWorker:
    def __init__(self, vllm_config: VllmConfig, config: ConnectorConfig) -> None:
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        kv = vllm_config.kv_transfer_config
        assert kv is not None
        self.vllm_config, self.config = vllm_config, config
        self.is_producer = kv.is_kv_producer
        self.tp_rank = get_tensor_model_parallel_rank()
        self.shape = instance_shape(vllm_config)
        self.rank = self.shape.rank(get_pp_group().rank_in_group, self.tp_rank)
        self.transport = load_transport(config, self.tp_rank)
        self.tracer = Tracer.otlp(config.otlp_traces_endpoint,
                                  f"kvdisagg-{'prefill' if self.is_producer else 'decode'}")
        self.transport.instrument(self.tracer, self._observe)
        self.kv_layout = ""
        self.port = 0
        self.regions: list[LayerRegion] = []
        self.stats = DisaggStats()
        # An early pull waits on its thread while prefill computes (the proxy sends them only
        # to an idle prefill, so a few at a time): room for those beside ready pulls.
        self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="kvdisagg-pull",
                                        initializer=unbind_current_thread)
        self._inflight: dict[str, Future[int]] = {}
        self._offered: DisaggMetadata | None = None  # the step's metadata already offered
        self._paged: set[str] = set()  # offered handoffs that hold vLLM's paged blocks
        self._staged: set[str] = set()  # offered handoffs held in the arena
        self._released_unseen: set[str] = set()  # freed on our side, not yet finished in vLLM
        self._finished_seen: set[str] = set()  # finished in vLLM, handoff still held
        self._staged_freed: set[str] = set()  # for the next worker metadata
        self._expired_seen = 0
        self._req_of: dict[str, str] = {}  # early handoff id -> its vLLM request id
        self._released_early: set[str] = set()  # offers refused: free their blocks at once
        self._lock = threading.Lock()

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        model = self.vllm_config.model_config
        block_size = self.vllm_config.cache_config.block_size
        heads = model.get_num_kv_heads(self.vllm_config.parallel_config)
        self.regions = layer_regions(kv_caches, heads)
        first = next(iter(kv_caches.values()), None)
        self.geometry = geometry_of(
            self.regions, model=model.model, dtype=str(model.dtype),
            kv_dtype=str(first.dtype) if first is not None else "", block_size=block_size,
            head_size=model.get_head_size(), kv_heads=model.get_total_num_kv_heads(),
            layers=model.get_total_num_hidden_layers())
        self.kv_layout = self.geometry.fingerprint()
        if self.is_producer and (arena := self._arena_blocks()):
            self.regions = with_arena(self.regions, arena)
        self.port = self.transport.register(self.regions, kv_layout=self.kv_layout,
                                            block_size=block_size, is_producer=self.is_producer,
                                            geometry=self.geometry, rank=self.rank,
                                            shape=self.shape)
        logger.info("kvdisagg: %s transport on rank %d of %s, layers %s (layout %s, side "
                    "channel %s:%d)", self.transport.name, self.rank, self.shape.describe(),
                    _span([r.layer for r in self.regions]), self.kv_layout,
                    self.config.side_channel_host, self.port)

    def _arena_blocks(self) -> int:
        """Staging arena size (config ``staging_blocks``); store transports copy out anyway."""
        if self.transport.keyed_by_tokens or not self.regions:
            return 0
        if self.config.staging_blocks >= 0:
            return self.config.staging_blocks
        first = self.regions[0]
        return first.num_blocks // 2 if first.pages.device.type == "cpu" else 0

    def handshake(self) -> WorkerHandshake:
        return WorkerHandshake(port=self.port, kv_layout=self.kv_layout,
                               transport=self.transport.name, geometry=self.geometry,
                               stages=self.shape.stages,
                               keyed_by_tokens=self.transport.keyed_by_tokens,
                               num_blocks=self.regions[0].num_blocks if self.regions else 0,
                               stage_blocks=self.regions[0].stage_blocks if self.regions else 0)

    def offer(self, meta: DisaggMetadata) -> None:
        """Offer the step's finished handoffs, staging those the scheduler put in the arena.
        Must run before the step's forward (vLLM may have given their paged blocks away):
        vLLM calls it first in a step (handle_preemptions), start_load_kv only makes sure."""
        if meta is self._offered:
            return
        self._offered = meta
        self.transport.step(True)  # a step began: Reads waiting for their handoff see progress
        for handoff_id, token in meta.expects:
            self.transport.expect(handoff_id, token)
        for handoff_id, why in meta.forgets:
            self.transport.forget(handoff_id, why)
        for send in meta.sends:
            if send.stage_from:
                start_ns = now_ns()
                stage_into(self.regions, send.stage_from, send.block_ids)
                end_ns = now_ns()
                self._observe("stage", (end_ns - start_ns) / 1e9)
                self.tracer.record("kvdisagg.stage", send.trace, start_ns, end_ns,
                                   {"kvdisagg.blocks": len(send.block_ids)})
            handoff_id = send.handoff_id or send.req_id
            if not self.transport.offer(Offer(handoff_id, send.token, send.block_ids,
                                              send.lease_s, send.prompt_token_ids, send.trace)):
                handoff_id = send.req_id  # refused: freed at once, as if released
                self._released_early.add(handoff_id)
            elif send.handoff_id:
                self._req_of[handoff_id] = send.req_id
            (self._staged if send.stage_from else self._paged).add(send.req_id)
        if meta.sends and self.is_producer:
            with self._lock:
                self.stats.add(handoffs_offered=len(meta.sends),
                               handoffs_staged=sum(bool(s.stage_from) for s in meta.sends))
        elif meta.sends:  # decode: finished requests stored for the next turn (lmcache)
            with self._lock:
                self.stats.add(decoded_stored=len(meta.sends))

    def start_load_kv(self, meta: DisaggMetadata) -> None:
        self.offer(meta)
        for load in meta.loads:
            future = self._pool.submit(self._fetch, load, now_ns())
            if not load.release_only:
                self._inflight[load.req_id] = future

    def _observe(self, phase: str, seconds: float) -> None:
        with self._lock:
            self.stats.observe(**{phase: seconds})

    def _fetch(self, load: LoadSpec, submitted_ns: int) -> int:
        if load.error:
            raise KvDisaggError(load.error)
        if load.transport != self.transport.name:
            raise KvDisaggError(f"prefill uses transport {load.transport!r}, this decode "
                                f"instance {self.transport.name!r}")
        start_ns = now_ns()
        span = self.tracer.start("kvdisagg.pull", load.trace, submitted_ns,
                                 {"kvdisagg.handoff": load.handoff_id,
                                  "kvdisagg.blocks": len(load.local_block_ids)})
        # This rank's Parts: one fetch per prefill rank it reads (or only releases).
        parts = load.parts[self.rank] if load.parts else (None,)
        timings: list[PullTiming] = []
        nbytes = 0
        try:
            for part in parts:
                src = self.rank if part is None else part.src
                # Phases back to back: each part's clock starts where the last phase ended.
                begin = timings[-1].marks[-1][1] if timings and timings[-1].marks else start_ns
                timings.append(PullTiming(begin))
                nbytes += self.transport.fetch(Fetch(
                    handoff_id=load.handoff_id, token=load.token, host=load.host,
                    port=load.ports[src] if src < len(load.ports) else 0,
                    kv_layout=load.kv_layout, remote_block_ids=load.remote_block_ids,
                    local_block_ids=load.local_block_ids,
                    prompt_token_ids=load.prompt_token_ids, first_block=load.first_block,
                    part=part, prefill=load.prefill, early=load.early,
                    version=load.version),
                    self.config.transfer_timeout_seconds, timings[-1])
        except Exception as exc:
            with self._lock:
                self.stats.add(pull_failures=1,
                               checksum_failures=int(isinstance(exc, ChecksumMismatch)))
            end(span, error=str(exc)[:200])
            raise
        elapsed = (now_ns() - start_ns) / 1e9
        phases = [("queue", submitted_ns, start_ns)]
        for timing in timings:
            phases += timing.phases()
        observed: dict[str, float] = {}
        for p, s, e in phases:
            observed[p] = observed.get(p, 0.0) + (e - s) / 1e9
        with self._lock:
            self.stats.add(pulls=1, pulled_bytes=nbytes, pull_seconds=elapsed,
                           pulled_blocks=len(load.local_block_ids))
            self.stats.observe(**observed)
        parent = traceparent_of(span)
        for phase, s, e in phases:
            self.tracer.record(phase, parent, s, e)
        end(span, None, **{"kvdisagg.bytes": nbytes, "kvdisagg.sources": len(parts),
                           "kvdisagg.connection_reused": all(t.reused for t in timings)})
        logger.info("kvdisagg: pulled %d blocks (%d bytes) for %s from %d prefill rank(s) in "
                    "%.1f ms", len(load.local_block_ids), nbytes, load.req_id, len(parts),
                    elapsed * 1e3)
        return nbytes

    def take_stats(self) -> DisaggStats | None:
        with self._lock:
            if self.stats.is_empty():
                return None
            out, self.stats = self.stats, DisaggStats()
            return out

    def take_worker_meta(self) -> DisaggWorkerMeta | None:
        if not self._staged_freed:
            return None
        meta = DisaggWorkerMeta({req_id: 1 for req_id in self._staged_freed})
        self._staged_freed = set()
        return meta

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving). Never blocks. Ends the step."""
        if self._offered is not None:
            self.transport.step(False)
        released = {self._req_of.pop(h, h) for h in self.transport.take_released()}
        released |= self._released_early
        self._released_early = set()
        expired = self.transport.expired_unread() - self._expired_seen
        if (released and self.is_producer) or expired:
            with self._lock:
                self.stats.add(handoffs_freed=len(released), handoffs_expired=expired)
            self._expired_seen += expired
        self._staged_freed |= released & self._staged
        self._staged -= released
        self._released_unseen |= released & self._paged
        self._finished_seen |= finished_req_ids & self._paged
        # vLLM only accepts a finished send once it has itself finished the request.
        sending = self._released_unseen & self._finished_seen
        self._released_unseen -= sending
        self._finished_seen -= sending
        self._paged -= sending
        recving, failed = set(), set()
        for req_id, future in list(self._inflight.items()):
            if not future.done():
                continue
            del self._inflight[req_id]
            recving.add(req_id)
            if (exc := future.exception()) is not None:
                failed.add(req_id)
                logger.error("kvdisagg: KV load of %s failed: %s", req_id, exc)
        return sending, recving, failed

    def shutdown(self) -> None:
        self.transport.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.tracer.shutdown()


def instance_shape(vllm_config: VllmConfig) -> Shape:
    """This instance's TP size and PP stages, as vLLM splits the layers (``get_pp_indices``,
    which honours ``VLLM_PP_LAYER_PARTITION``): the same in every process of the instance."""
    from vllm.distributed.utils import get_pp_indices

    parallel = vllm_config.parallel_config
    layers = vllm_config.model_config.get_total_num_hidden_layers()
    pp = parallel.pipeline_parallel_size
    return Shape(parallel.tensor_parallel_size,
                 tuple(get_pp_indices(layers, rank, pp)[0] for rank in range(pp)))


def _span(ids: list[int]) -> str:
    return f"{min(ids)}..{max(ids)}" if ids else "none"
