"""In-process harness: vLLM's real v1 ``Scheduler`` driving DisaggConnector's scheduler side.

No processes, no model, no KV bytes. The worker side is emulated: every step feeds the scheduler a
``ModelRunnerOutput`` (one sampled token per request whose prompt is complete) carrying whatever
``KVConnectorOutput`` the test says the workers reported (``finished_sending``,
``finished_recving``, ``failed_recving``), the way vLLM's tests/v1/kv_connector/unit/utils.py
does for NixlConnector.

Usage::

    h = SchedulerHarness("kv_consumer")
    req = h.add_request(40, kv_transfer_params=remote_prefill_params(h, 40))
    s = h.step()                      # schedule() + build_connector_meta + update_from_output
    (load,) = s.meta.loads
    h.step(finished_recving={req.request_id})
    h.run_until(lambda s: req.is_finished())
    h.assert_no_leak()

Each ``step`` returns a ``Step`` (the SchedulerOutput, the DisaggMetadata it carried and the
EngineCoreOutputs by request id); ``h.history`` keeps them all, and ``h.sends()``/``h.loads()``
list every SendSpec/LoadSpec emitted so far. To drive several steps:

- ``h.run(n, **report)``: n steps, each with the same report (e.g. none: transfers in flight);
- ``h.feed([report, ...])``: one step per report;
- ``h.run_until(predicate, **report)`` / ``h.drain()``;
- ``h.step_with(EmulatedWorkers(...))``: the report comes from an emulation of the workers that
  answers each LoadSpec/SendSpec a few steps later (done, failed, never).

A report is ``finished_sending``/``finished_recving``/``failed_recving`` (sets of request ids),
``eos`` (requests that sample EOS) and ``worker_meta`` (the aggregated worker metadata).
``SchedulerHarness(handshake_extra=...)`` adds fields to the workers' WorkerHandshake.
``SchedulerHarness(async_scheduling=True)`` builds the scheduler vLLM picks with async scheduling
on, ``AsyncScheduler`` (vLLM's default on GPUs; CPU instances force it off), whose steps the
harness runs one after the other (each step's output before the next schedule); with
``overlap=True`` too, ``step`` is one turn of EngineCore's ``step_with_batch_queue`` instead: it
schedules the next batch while the previous one is still out (two in flight), and hands a batch's
output to the scheduler only when the queue is full or nothing more can be scheduled. A report
given to a turn that hands no output back is kept for the next one that does.
``h.assert_no_leak()`` checks the scheduler (queues, blocks, ref counts) and the connector: every
non-empty container attribute of DisaggScheduler (but CONNECTOR_STATE_EXEMPT) and every handoff
its lease keeper still holds count as leftovers, so a new per-request container is covered without
touching this file. Decode's lease renewals go to a loopback port where nothing listens
(``closed_port``): they fail fast and are retried, which changes nothing in the scheduler.
``cleanup_model_dir()`` removes the temporary directory holding the model's config.json (one
per process, shared by every harness; also removed at interpreter exit).
"""

from __future__ import annotations

import collections.abc
import functools
import inspect
import itertools
import json
import socket
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from kvdisagg.connector.connector import DisaggConnector
from kvdisagg.connector.metadata import DisaggMetadata, LoadSpec, SendSpec, WorkerHandshake
from kvdisagg.connector.protocol.params import handoff_params
from kvdisagg.connector.scheduler import DisaggScheduler

_VLLM_SCHEDULER = Scheduler
EOS_TOKEN_ID = 2
SAMPLED_TOKEN_ID = 7  # what the fake model runner "samples" (never EOS)
HANDSHAKE_PORT = 47000  # advertised by the fake TP-rank-0 worker (nothing listens)
KV_LAYOUT = "L"
TRANSPORT = "tcp"

# DisaggScheduler attributes that are containers but not per-request state.
CONNECTOR_STATE_EXEMPT = frozenset({
    "ports",  # from the handshake
    "_free_slots",  # prefill's free staging-arena blocks (not per request)
    "shape",  # this instance's TP and PP stages (from the handshake)
    "versions",  # the side-channel protocol versions this instance speaks (from its config)
})

# A config.json is all vLLM's ModelConfig needs (skip_tokenizer_init): Llama shape of
# kvdisagg.local.tiny_model, without generating weights.
_MODEL_CONFIG = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=256,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_hidden_layers=2,
    intermediate_size=512, vocab_size=512, max_position_embeddings=4096, rms_norm_eps=1e-5,
    torch_dtype="float32", bos_token_id=1, eos_token_id=EOS_TOKEN_ID,
)


_model_tmp: tempfile.TemporaryDirectory[str] | None = None


def _model_dir() -> str:
    """The directory holding the harness's config.json: one per process (or until
    ``cleanup_model_dir``), removed by ``cleanup_model_dir`` or, at the latest, when the
    interpreter exits (TemporaryDirectory's finalizer)."""
    global _model_tmp
    if _model_tmp is None:
        _model_tmp = tempfile.TemporaryDirectory(prefix="kvdisagg-harness-model-")
        (Path(_model_tmp.name) / "config.json").write_text(json.dumps(_MODEL_CONFIG))
    return _model_tmp.name


def cleanup_model_dir() -> None:
    """Remove the model directory now (a later harness makes a new one). Call it once no
    harness is in use any more, e.g. from a module- or session-scoped fixture."""
    global _model_tmp
    if _model_tmp is not None:
        _model_tmp.cleanup()
        _model_tmp = None


@functools.cache
def _init_hashing() -> None:
    init_none_hash(sha256)


def make_vllm_config(kv_role: str, *, block_size: int = 16, max_num_seqs: int = 16,
                     max_num_batched_tokens: int = 512, max_model_len: int = 2048,
                     enable_prefix_caching: bool = True,
                     kv_load_failure_policy: str = "fail",
                     extra_config: dict[str, Any] | None = None,
                     engine_id: str | None = None,
                     async_scheduling: bool = False) -> VllmConfig:
    model_config = ModelConfig(model=_model_dir(), skip_tokenizer_init=True, dtype="float32",
                               seed=0, max_model_len=max_model_len)
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len, enable_chunked_prefill=True, is_encoder_decoder=False,
        async_scheduling=async_scheduling)
    cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching)
    kv_transfer_config = KVTransferConfig(
        kv_connector="DisaggConnector", kv_connector_module_path="kvdisagg.connector",
        kv_role=kv_role, kv_connector_extra_config=dict(extra_config or {}),
        kv_load_failure_policy=kv_load_failure_policy, engine_id=engine_id)
    return VllmConfig(model_config=model_config, scheduler_config=scheduler_config,
                      cache_config=cache_config, kv_transfer_config=kv_transfer_config,
                      device_config=DeviceConfig("cpu"))


@dataclass
class Step:
    """One engine step: what was scheduled, the connector metadata, what the client got."""

    index: int
    sched_out: SchedulerOutput
    meta: DisaggMetadata
    outputs: dict[str, list[EngineCoreOutput]] = field(default_factory=dict)
    stats: Any = None  # vLLM's SchedulerStats of the step (log_stats is on)

    @property
    def scheduled(self) -> dict[str, int]:
        return dict(self.sched_out.num_scheduled_tokens)

    def output(self, req_id: str) -> EngineCoreOutput | None:
        """The (last) output for ``req_id`` this step, or None."""
        outs = self.outputs.get(req_id)
        return outs[-1] if outs else None


class SchedulerHarness:
    def __init__(self, kv_role: str = "kv_consumer", *, block_size: int = 16,
                 num_blocks: int = 64, max_num_seqs: int = 16,
                 max_num_batched_tokens: int = 512, enable_prefix_caching: bool = True,
                 kv_load_failure_policy: str = "fail", extra_config: dict[str, Any] | None = None,
                 ports: Iterable[int] = (HANDSHAKE_PORT,), kv_layout: str = KV_LAYOUT,
                 transport: str = TRANSPORT, engine_id: str | None = None,
                 handshake: bool = True, handshake_extra: dict[str, Any] | None = None,
                 async_scheduling: bool = False, overlap: bool = False) -> None:
        _init_hashing()
        self.block_size = block_size
        self.vllm_config = make_vllm_config(
            kv_role, block_size=block_size, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching,
            kv_load_failure_policy=kv_load_failure_policy, extra_config=extra_config,
            engine_id=engine_id, async_scheduling=async_scheduling)
        # The CPU platform forces async scheduling off when the config is built; a GPU host
        # keeps vLLM's default, on: set it back as it would be there.
        self.vllm_config.scheduler_config.async_scheduling = async_scheduling
        kv_cache_config = KVCacheConfig(
            num_blocks=num_blocks, kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["layer"], FullAttentionSpec(
                block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32))])
        self.vllm_config.cache_config.num_gpu_blocks = num_blocks
        # What vLLM builds: the class of --scheduler-cls (Scheduler here unless a test patches
        # it), or AsyncScheduler with async scheduling on and no class given.
        cls = AsyncScheduler if async_scheduling and Scheduler is _VLLM_SCHEDULER else Scheduler
        self.scheduler = cls(
            vllm_config=self.vllm_config, kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(self.vllm_config),
            block_size=block_size, log_stats=True)
        assert isinstance(self.scheduler.connector, DisaggConnector), self.scheduler.connector
        self.connector: DisaggConnector = self.scheduler.connector
        assert isinstance(self.connector._scheduler, DisaggScheduler)
        self.ports = list(ports)
        if handshake:
            # What EngineCore does once the workers registered their KV caches.
            self.connector.set_xfer_handshake_metadata_pp_aware({
                (0, tp): WorkerHandshake(port=port, kv_layout=kv_layout, transport=transport,
                                         **(handshake_extra or {}))
                for tp, port in enumerate(self.ports)})
        self.initial_free_blocks = self.free_blocks()
        self.history: list[Step] = []
        self._ids = itertools.count(1)
        self.overlap = overlap
        self._queue: collections.deque[tuple[Step, set[str]]] = collections.deque()
        self._report: dict[str, Any] = {}
        self.most_in_flight = 0  # overlap: the most batches scheduled and not yet answered

    def close(self) -> None:
        """Scheduler.shutdown (the connector stops its threads)."""
        self.scheduler.shutdown()

    def __enter__(self) -> SchedulerHarness:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- introspection ----
    @property
    def side(self) -> DisaggScheduler:
        """The connector's scheduler side (DisaggScheduler)."""
        return self.connector._scheduler  # type: ignore[return-value]

    @property
    def engine_id(self) -> str:
        return self.vllm_config.kv_transfer_config.engine_id  # type: ignore[union-attr]

    def free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def used_blocks(self) -> int:
        return self.initial_free_blocks - self.free_blocks()

    def block_ids(self, req_id: str) -> list[int]:
        """The blocks the KV cache manager holds for ``req_id`` (single KV-cache group)."""
        (ids,) = self.scheduler.kv_cache_manager.get_block_ids(req_id)
        return list(ids)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def sends(self, req_id: str | None = None) -> list[SendSpec]:
        """Every SendSpec emitted so far (for ``req_id`` if given)."""
        return [s for st in self.history for s in st.meta.sends
                if req_id is None or s.req_id == req_id]

    def loads(self, req_id: str | None = None) -> list[LoadSpec]:
        """Every LoadSpec emitted so far (for ``req_id`` if given)."""
        return [ld for st in self.history for ld in st.meta.loads
                if req_id is None or ld.req_id == req_id]

    def outputs(self, req_id: str) -> list[EngineCoreOutput]:
        return [o for st in self.history for o in st.outputs.get(req_id, [])]

    def final_output(self, req_id: str) -> EngineCoreOutput:
        """The output that carried ``req_id``'s finish reason."""
        finals = [o for o in self.outputs(req_id) if o.finish_reason is not None]
        assert len(finals) == 1, f"{req_id}: {len(finals)} final outputs"
        return finals[0]

    # ---- driving ----
    def make_request(self, num_tokens: int, *, max_tokens: int = 1,
                     kv_transfer_params: dict[str, Any] | None = None,
                     req_id: str | None = None, prompt: list[int] | None = None,
                     abort_immediately: bool = False, **sampling: Any) -> Request:
        """A request with a deterministic prompt (distinct per request unless ``prompt``).
        ``sampling``: more SamplingParams (e.g. prompt_logprobs=1)."""
        n = next(self._ids)
        req_id = req_id or f"req-{n}"
        if prompt is None:
            prompt = [(n * 37 + i) % 500 + 3 for i in range(num_tokens)]  # distinct first token
        assert len(prompt) == num_tokens
        params = SamplingParams(max_tokens=max_tokens, **sampling)
        params.update_from_generation_config({}, EOS_TOKEN_ID)
        req = Request(request_id=req_id, prompt_token_ids=list(prompt), sampling_params=params,
                      pooling_params=None, abort_immediately=abort_immediately,
                      block_hasher=get_request_block_hasher(self.block_size, sha256))
        # vLLM puts sampling_params.extra_args["kv_transfer_params"] here (request.py).
        req.kv_transfer_params = kv_transfer_params
        return req

    def add_request(self, num_tokens: int, **kw: Any) -> Request:
        req = self.make_request(num_tokens, **kw)
        self.add(req)
        return req

    def add(self, req: Request) -> None:
        """What EngineCore.add_request does (a pre-aborted request is aborted at once: vLLM's
        way to run request_finished for a decode request rejected before the engine)."""
        self.scheduler.add_request(req)
        if req.abort_immediately:
            self.abort(req.request_id)

    def abort(self, *req_ids: str) -> list[Request]:
        """What EngineCore does for a client abort."""
        return self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)

    def step(self, *, finished_sending: Iterable[str] = (), finished_recving: Iterable[str] = (),
             failed_recving: Iterable[str] = (), eos: Iterable[str] = (),
             worker_meta: Any = None) -> Step:
        """schedule(), then the emulated workers' output for that step, as vLLM's
        KVOutputAggregator hands it to the scheduler (every worker agreed on each id).

        A failed load must be reported in both sets (vLLM's contract): ``failed_recving`` ids are
        added to ``finished_recving`` here. ``eos``: these requests sample EOS this step.
        ``worker_meta``: the aggregated KVConnectorWorkerMetadata (build_connector_worker_meta).
        """
        if self.overlap:
            return self._batch_queue_turn(dict(finished_sending=finished_sending,
                                               finished_recving=finished_recving,
                                               failed_recving=failed_recving, eos=eos,
                                               worker_meta=worker_meta))
        sched_out = self.scheduler.schedule()
        meta = sched_out.kv_connector_metadata
        assert isinstance(meta, DisaggMetadata), meta
        failed = set(failed_recving)
        kv_out = KVConnectorOutput(finished_sending=set(finished_sending) or None,
                                   finished_recving=(set(finished_recving) | failed) or None,
                                   failed_recving=failed, kv_connector_worker_meta=worker_meta)
        runner_out = self._runner_output(sched_out, kv_out, set(eos))
        engine_outs = self.scheduler.update_from_output(sched_out, runner_out)
        outputs: dict[str, list[EngineCoreOutput]] = {}
        stats = None
        for eco in engine_outs.values():
            stats = eco.scheduler_stats or stats
            for out in eco.outputs:
                outputs.setdefault(out.request_id, []).append(out)
        step = Step(len(self.history), sched_out, meta, outputs, stats)
        self.history.append(step)
        return step

    def _batch_queue_turn(self, report: dict[str, Any]) -> Step:
        """One turn of vLLM's step_with_batch_queue (queue of 2), as ``step`` (see the module's
        docstring). Returns the step scheduled this turn, else the one whose output came back."""
        for key, value in report.items():
            if key == "worker_meta":
                if value is not None:
                    old = self._report.get(key)
                    self._report[key] = value if old is None else old.aggregate(value)
            elif value:
                self._report.setdefault(key, set()).update(value)
        scheduled = None
        if self.scheduler.has_requests():
            sched_out = self.scheduler.schedule()
            meta = sched_out.kv_connector_metadata
            assert isinstance(meta, DisaggMetadata), meta
            scheduled = Step(len(self.history), sched_out, meta)
            self.history.append(scheduled)
            self._queue.appendleft((scheduled, self._sampling(sched_out)))
            self.most_in_flight = max(self.most_in_flight, len(self._queue))
            if len(self._queue) < 2 and (sched_out.total_num_scheduled_tokens > 0
                                         or self.scheduler.has_requests()):
                return scheduled
        elif not self._queue:
            return self.history[-1] if self.history else scheduled  # type: ignore[return-value]
        step, sampling = self._queue.pop()
        report, self._report = self._report, {}
        failed = set(report.get("failed_recving", ()))
        kv_out = KVConnectorOutput(
            finished_sending=set(report.get("finished_sending", ())) or None,
            finished_recving=(set(report.get("finished_recving", ())) | failed) or None,
            failed_recving=failed, kv_connector_worker_meta=report.get("worker_meta"))
        eos = set(report.get("eos", ()))
        runner_out = self._runner_output(step.sched_out, kv_out, eos, sampling)
        for eco in self.scheduler.update_from_output(step.sched_out, runner_out).values():
            step.stats = eco.scheduler_stats or step.stats
            for out in eco.outputs:
                step.outputs.setdefault(out.request_id, []).append(out)
        return scheduled or step

    def _sampling(self, sched_out: SchedulerOutput) -> set[str]:
        """Requests of a just scheduled batch whose prompt it completes (they sample a token);
        a chunk that does not finish the prompt samples nothing (the runner drops it)."""
        return {rid for rid in sched_out.num_scheduled_tokens
                if (req := self.scheduler.requests[rid]).num_computed_tokens >= req.num_tokens}

    def _runner_output(self, sched_out: SchedulerOutput, kv_out: KVConnectorOutput,
                       eos: set[str], sampling: set[str] | None = None) -> ModelRunnerOutput:
        req_ids = list(sched_out.num_scheduled_tokens)
        if sampling is None:
            sampling = self._sampling(sched_out)
        sampled = []
        for rid in req_ids:
            done = rid in sampling
            sampled.append([EOS_TOKEN_ID if rid in eos else SAMPLED_TOKEN_ID] if done else [])
        return ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={},
            pooler_output=None, kv_connector_output=kv_out)

    def step_with(self, workers: EmulatedWorkers) -> Step:
        """One step whose worker report comes from ``workers``, which then sees its metadata."""
        step = self.step(**workers.due(len(self.history)))
        workers.observe(step)
        return step

    def run(self, n: int, **report: Iterable[str]) -> list[Step]:
        """``n`` steps, each reporting ``report`` (e.g. nothing: transfers still in flight)."""
        return [self.step(**report) for _ in range(n)]

    def feed(self, reports: Iterable[dict[str, Iterable[str]]]) -> list[Step]:
        """One step per report dict (keys as in ``step``)."""
        return [self.step(**r) for r in reports]

    def run_until(self, done: Callable[[Step], bool], max_steps: int = 200,
                  **report: Iterable[str]) -> list[Step]:
        steps = []
        for _ in range(max_steps):
            steps.append(self.step(**report))
            if done(steps[-1]):
                return steps
        raise AssertionError(f"condition not met in {max_steps} steps")

    def drain(self, max_steps: int = 200) -> list[Step]:
        """Step until the scheduler holds no request that could still be scheduled (and, with
        ``overlap``, no batch is still out)."""
        return self.run_until(lambda s: not self.scheduler.has_unfinished_requests()
                              and not self._queue, max_steps)

    # ---- leak checks ----
    def assert_blocks_free(self) -> None:
        assert self.free_blocks() == self.initial_free_blocks, (
            f"{self.used_blocks()} blocks still in use")

    def assert_scheduler_empty(self) -> None:
        s = self.scheduler
        assert not s.requests, f"scheduler still holds {sorted(s.requests)}"
        assert len(s.waiting) == 0 and len(s.running) == 0
        assert len(s.kv_holding_waiting) == 0
        assert not s.finished_recving_kv_req_ids and not s.failed_recving_kv_req_ids
        assert not s._inflight_prefills
        manager = s.kv_cache_manager.coordinator.single_type_managers[0]
        assert not manager.req_to_blocks
        assert all(b.ref_cnt == 0 for b in s.kv_cache_manager.block_pool.blocks
                   if not b.is_null)
        self.assert_blocks_free()

    def connector_state(self) -> dict[str, Any]:
        """Per-request state the connector's scheduler side still keeps: every non-empty
        container attribute of DisaggScheduler (but CONNECTOR_STATE_EXEMPT), and the handoffs
        its lease keeper (decode) still holds."""
        leftovers: dict[str, Any] = {}
        for name, value in vars(self.side).items():
            if name in CONNECTOR_STATE_EXEMPT or isinstance(value, (str, bytes)):
                continue
            if isinstance(value, collections.abc.Collection) and len(value):
                leftovers[name] = value
        leases = getattr(self.side, "leases", None)
        if leases is not None and leases.held():
            leftovers["leases.held()"] = leases.held()
        return leftovers

    def assert_connector_empty(self) -> None:
        assert not self.connector_state(), f"connector state left: {self.connector_state()}"

    def assert_no_leak(self) -> None:
        self.assert_scheduler_empty()
        self.assert_connector_empty()


@functools.cache
def closed_port() -> int:
    """A loopback port nothing listens on: decode's lease renewals to the fake prefill fail fast
    (connection refused) instead of hanging on an unroutable address."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def remote_prefill_params(h: SchedulerHarness, num_tokens: int, *,
                          block_ids: list[int] | None = None, ports: list[int] | None = None,
                          request_id: str = "prefill-req", token: str = "tok",
                          host: str = "127.0.0.1", engine_id: str = "prefill-engine",
                          lease_s: float = 30.0) -> dict[str, Any]:
    """kv_transfer_params as a prefill instance returns them
    (kvdisagg.connector.protocol.params.handoff_params): ``num_tokens`` prompt tokens in
    ``block_ids`` (default: as many blocks as they need)."""
    if block_ids is None:
        block_ids = list(range(100, 100 + h.blocks_for(num_tokens)))
    if ports is None:
        ports = [closed_port()] * h.vllm_config.parallel_config.tensor_parallel_size
    lease = inspect.signature(handoff_params).parameters
    lease_kw: dict[str, float] = (
        {"lease_s": lease_s} if "lease_s" in lease else {"lease_expires": time.time() + lease_s})
    return handoff_params(
        engine_id=engine_id, request_id=request_id, block_ids=block_ids, host=host, ports=ports,
        num_tokens=num_tokens, transport=TRANSPORT, kv_layout=KV_LAYOUT, token=token, **lease_kw)


class EmulatedWorkers:
    """Answers the connector metadata the way the worker side would, a few steps later.

    Loads are reported done ``load_delay`` steps after their LoadSpec (failed for ids in
    ``fail``, never for ids in ``hang``; a LoadSpec with an error fails at the next step, a
    release-only one is never reported). Paged sends are reported finished ``send_delay`` steps
    after their SendSpec (never for ids in ``hold``). Staged sends (``stage_from``) are reported
    freed through ``staged_release`` (req_ids -> KVConnectorWorkerMetadata), if given.
    """

    def __init__(self, *, load_delay: int = 1, send_delay: int = 1, fail: Iterable[str] = (),
                 hang: Iterable[str] = (), hold: Iterable[str] = (),
                 staged_release: Callable[[set[str]], Any] | None = None) -> None:
        self.load_delay, self.send_delay = load_delay, send_delay
        self.fail, self.hang, self.hold = set(fail), set(hang), set(hold)
        self.staged_release = staged_release
        self._due: dict[int, dict[str, set[str]]] = {}

    def _at(self, index: int, key: str, req_id: str) -> None:
        self._due.setdefault(index, {}).setdefault(key, set()).add(req_id)

    def observe(self, step: Step) -> None:
        for load in step.meta.loads:
            if load.release_only or load.req_id in self.hang:
                continue
            if load.error:
                self._at(step.index + 1, "failed_recving", load.req_id)
            elif load.req_id in self.fail:
                self._at(step.index + self.load_delay, "failed_recving", load.req_id)
            else:
                self._at(step.index + self.load_delay, "finished_recving", load.req_id)
        for send in step.meta.sends:
            if send.req_id in self.hold:
                continue
            staged = bool(getattr(send, "stage_from", ()))
            if staged and self.staged_release is None:
                continue
            self._at(step.index + self.send_delay, "staged" if staged else "finished_sending",
                     send.req_id)

    def due(self, index: int) -> dict[str, Any]:
        """The report for step ``index`` (and any overdue one)."""
        report: dict[str, Any] = {}
        for i in sorted(k for k in self._due if k <= index):
            for key, ids in self._due.pop(i).items():
                report.setdefault(key, set()).update(ids)
        staged = report.pop("staged", None)
        if staged:
            assert self.staged_release is not None
            report["worker_meta"] = self.staged_release(staged)
        return report

    def idle(self) -> bool:
        return not self._due


def is_blocked_on_kv(req: Request) -> bool:
    return req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
