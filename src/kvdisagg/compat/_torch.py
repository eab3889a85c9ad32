"""A two-rank process group of kvdisagg's own, built directly (torch 2.13).

vLLM owns the default process group of each worker; ``torch.distributed.new_group`` derives from
it, so a pair of prefill and decode workers cannot use it. The backends' classes can be built on
any Store, but their options are private for gloo (``ProcessGroupGloo._Options`` with
``_timeout`` and ``_devices``: the interface that reaches the peer) and the timeout is private
for NCCL (``Options._timeout``).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any


def pair_group(store: Any, rank: int, backend: str, timeout_s: float, hostname: str) -> Any:
    """A 2-rank ``ProcessGroupNCCL`` or ``ProcessGroupGloo`` on ``store`` (gloo binds
    ``hostname``), each wait bounded by ``timeout_s``."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, 2, opts)
    gloo = dist.ProcessGroupGloo._Options()
    gloo._timeout = timeout
    gloo._devices = [dist.ProcessGroupGloo.create_device(hostname=hostname)]
    return dist.ProcessGroupGloo(store, rank, 2, gloo)
