"""vLLM general plugin, loaded in every vLLM process: registers DisaggConnector (idempotent),
and on CPU hosts left to vLLM's default core binding, makes OpenMP wait passively."""

from __future__ import annotations

import logging
import os
import sys

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

    if "DisaggConnector" not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(
            "DisaggConnector", "kvdisagg.connector.connector", "DisaggConnector")
    _passive_omp_on_shared_cores(os.environ, sys.argv)


def _passive_omp_on_shared_cores(environ: dict[str, str] | os._Environ, argv: list[str]) -> bool:
    """Set PASSIVE_OMP_ENV in ``environ`` for a DisaggConnector instance on a CPU host with
    vLLM's default binding and no OpenMP wait setting of the user's; True if it did."""
    if "DisaggConnector" not in " ".join(argv):
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
