"""vLLM general plugin, loaded in every vLLM process: registers DisaggConnector (idempotent),
where it serves DisaggConnector primes a continuation's detokenizer as the plain instance's
was (compat/_vllm_detokenizer.py),
on CPU hosts left to vLLM's default core binding makes OpenMP wait passively, and works around
two bugs of vLLM 0.32's CPU worker: the pipeline-parallel receive buffer never allocated in eager
mode, and a seeded request whose prompt is computed in chunks killing the engine."""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

logger = logging.getLogger(__name__)

PASSIVE_OMP_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}
"""Set for the engine processes vLLM spawns next, where the user set no OpenMP wait policy.

vLLM's default CPU binding (``VLLM_CPU_OMP_THREADS_BIND`` unset or ``auto``) gives every instance
on a host the same cores. OpenMP threads spin at each barrier by default; two instances' teams
spinning on the same cores wait for each other's time slices at every barrier, and a prefill step
that takes 0.2 s alone took minutes next to a busy decode (docs/operations.md). Passive waiting
costs a futex wake per barrier instead. Instances given their own cores are left alone."""


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(
            "DisaggConnector", "kvdisagg.connector.connector", "DisaggConnector")
    except ValueError:  # "already registered": vLLM loads plugins once per process, or more
        pass
    if serves_disagg_connector(sys.argv):  # a continuation's text as the plain instance's
        from kvdisagg.compat._vllm_detokenizer import prime_continuations

        prime_continuations()
    _passive_omp_on_shared_cores(os.environ, sys.argv)
    _cpu_pp_receive_buffer()
    _cpu_seeded_chunks()
    _gil_friendly_spin(sys.argv)


def serves_disagg_connector(argv: list[str]) -> bool:
    """True when this process's command line configures DisaggConnector
    (``--kv-transfer-config JSON`` or ``=JSON``, with ``kv_connector: DisaggConnector``).

    The plugin runs before vLLM parses its arguments (and in every process vLLM spawns, which
    inherit the command line), so the command line is what it can read."""
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if name.replace("_", "-") != "--kv-transfer-config":
            continue
        if not eq:
            value = argv[i + 1] if i + 1 < len(argv) else ""
        try:
            config = json.loads(value)
        except ValueError:
            return False
        return isinstance(config, dict) and config.get("kv_connector") == "DisaggConnector"
    return False


SPIN_PAUSE_EVERY = 64  # busy-wait polls between two pauses
SPIN_PAUSE_S = 0.0002


def _gil_friendly_spin(argv: list[str]) -> bool:
    """In a DisaggConnector instance on a CPU host, let vLLM's busy-waits hand the GIL over.

    Between steps, vLLM's worker and EngineCore main threads poll their shared-memory queues
    for a second after every message, calling ``os.sched_yield()`` in a loop: the GIL is free
    for the microsecond of each call and taken back at once. kvdisagg's threads in those
    processes (the side channel, the pulls, the lease renewals) wait for it meanwhile, and on
    two cores shared by five ranks they were starved for 10-30 s (Hellos answered after 12 s,
    pulls silent for 30 s, leases run out unrenewed) while the engines stepped on. Every
    SPIN_PAUSE_EVERY polls, the busy-wait sleeps SPIN_PAUSE_S instead, long enough for a
    waiting thread to take the GIL; a new message is seen at most that much later."""
    if not serves_disagg_connector(argv):
        return False
    try:
        import torch

        if torch.cuda.is_available():
            return False
        from vllm.distributed.device_communicators import shm_broadcast
    except ImportError:
        return False
    if getattr(shm_broadcast.sched_yield, "_kvdisagg", False):
        return True
    import itertools
    import time

    polls = itertools.count(1)

    def sched_yield() -> None:
        if next(polls) % SPIN_PAUSE_EVERY:
            os.sched_yield()
        else:
            time.sleep(SPIN_PAUSE_S)

    sched_yield._kvdisagg = True  # type: ignore[attr-defined]
    shm_broadcast.sched_yield = sched_yield
    return True


def _cpu_pp_receive_buffer() -> None:
    """Make vLLM's CPU worker allocate the PP receive buffer of a later stage before serving.

    vLLM 0.32's model runner allocates ``intermediate_tensors`` (where a PP stage after the
    first receives the previous stage's activations) only in ``_dummy_run``. The GPU worker
    always runs one (profiling, warm-up); the CPU worker runs one only to compile or to size the
    KV cache, so with ``--enforce-eager`` (or any eager mode) every stage after the first dies on
    its first forward: ``assert self.intermediate_tensors is not None`` in
    ``sync_and_gather_intermediate_tensors``, and EngineCore with it. After the worker's own
    warm-up, allocate the buffer as ``_dummy_run`` would, where it is still missing."""
    try:
        from vllm.v1.worker.cpu_worker import CPUWorker
    except ImportError:  # a vLLM without a CPU worker
        return
    original = CPUWorker.compile_or_warm_up_model
    if getattr(original, "_kvdisagg", False):
        return

    def compile_or_warm_up_model(self: object, *args: object, **kwargs: object) -> object:
        out = original(self, *args, **kwargs)
        runner: Any = getattr(self, "model_runner", None)
        try:
            from vllm.distributed.parallel_state import get_pp_group

            later_stage = not get_pp_group().is_first_rank
        except (ImportError, AssertionError):  # no PP group: nothing to receive
            later_stage = False
        if later_stage and getattr(runner, "intermediate_tensors", True) is None:
            runner.intermediate_tensors = runner.model.make_empty_intermediate_tensors(
                batch_size=runner.max_num_tokens, dtype=runner.model_config.dtype,
                device=runner.device)
            logger.info("kvdisagg: allocated this pipeline stage's receive buffer (vLLM's CPU "
                        "worker skips the dummy run that does it in eager mode)")
        return out

    compile_or_warm_up_model._kvdisagg = True  # type: ignore[attr-defined]
    CPUWorker.compile_or_warm_up_model = compile_or_warm_up_model


def _cpu_seeded_chunks() -> None:
    """Let vLLM's CPU model runner compute a seeded request's prompt in chunks.

    A step that computes a chunk of a prompt, not its last, samples a token for it and drops
    it. vLLM 0.32 then rewinds the request's generator (``seed``) so that the drop leaves its
    random stream untouched: ``gen.set_offset(gen.get_offset() - 4)``, which only CUDA's Philox
    generators have; a CPU generator raises "CPU Generator does not use offset" and EngineCore
    dies with every request it holds. Any seeded request with a prompt longer than the step's
    token budget left does it, so it happens under load, a plain instance's as much as a P/D
    pair's. Here the rewind is done the CPU way: the generator's state, taken before sampling,
    is put back after it; vLLM's own rewind then skips those generators."""
    try:
        from kvdisagg.compat._vllm_cpu import rewind_dropped_samples_on_cpu
    except ImportError:  # a vLLM without a CPU model runner
        return
    rewind_dropped_samples_on_cpu()


def _passive_omp_on_shared_cores(environ: dict[str, str] | os._Environ, argv: list[str]) -> bool:
    """Set PASSIVE_OMP_ENV in ``environ`` for a DisaggConnector instance on a CPU host with
    vLLM's default binding and no OpenMP wait setting of the user's; True if it did."""
    if not serves_disagg_connector(argv):
        return False
    if environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto") not in ("", "auto"):
        return False
    if any(k in environ for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")):
        return False
    try:
        import torch

        if torch.cuda.is_available():
            return False
    except ImportError:
        return False
    environ.update(PASSIVE_OMP_ENV)
    logger.warning("kvdisagg: vLLM's default CPU binding puts every instance on this host on "
                   "the same cores; OpenMP set to wait passively (OMP_WAIT_POLICY=PASSIVE). "
                   "Give each instance its own cores with VLLM_CPU_OMP_THREADS_BIND for speed.")
    return True
