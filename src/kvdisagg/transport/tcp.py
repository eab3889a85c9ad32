"""The default transport: KV bytes inline on the side-channel connection (no dependency).

No staging copy on CPU: the sender gathers straight from vLLM's paged KV memory and the receiver
scatters straight into its blocks (``sendmsg``/``recvmsg_into`` over up to a thousand ranges per
call). CUDA KV goes through a host copy per run (use nccl or mooncake between GPUs).
"""

from __future__ import annotations

import socket
from typing import Any, ClassVar, Sequence

from kvdisagg.layout import CopyRun, LayerRegion, run_tensor
from kvdisagg.protocol import recv_into_views, send_views
from kvdisagg.transport.pull import Deadline, PullTransport


def host_bytes(tensor: Any) -> memoryview:
    """A byte view of a contiguous tensor's memory (on CPU: the memory itself)."""
    return memoryview(tensor.numpy()).cast("B")


class TcpTransport(PullTransport):
    name: ClassVar[str] = "tcp"

    def attach(self, regions: Sequence[LayerRegion], is_producer: bool) -> None:
        # One byte view per CPU layer, sliced per run: no tensor is made on the data path.
        self._host = [host_bytes(r.pages) if r.pages.device.type == "cpu" else None
                      for r in regions]

    def _views(self, runs: Sequence[CopyRun], side: str) -> list[memoryview] | None:
        """Each run's bytes in KV memory, or None if the KV is not in host memory."""
        spans: list[list[int]] = []  # [layer, start, end], merged where adjacent in memory
        for run in runs:
            if self._host[run.layer] is None:
                return None
            size = self.regions[run.layer].page_bytes
            start = (run.src if side == "src" else run.dst) * size
            if spans and spans[-1][0] == run.layer and spans[-1][2] == start:
                spans[-1][2] += run.count * size
            else:
                spans.append([run.layer, start, start + run.count * size])
        return [self._host[layer][start:end] for layer, start, end in spans]

    def send(self, peer: Any, sock: socket.socket, runs: Sequence[CopyRun],
             deadline: Deadline, grant: bytes) -> None:
        sock.settimeout(deadline.left())
        views = self._views(runs, "src")
        if views is None:
            views = [host_bytes(run_tensor(self.regions, run, "src").cpu()) for run in runs]
        send_views(sock, [memoryview(grant), *views])  # the grant and the bytes: one call

    def recv(self, peer: Any, sock: socket.socket, runs: Sequence[CopyRun],
             deadline: Deadline) -> None:
        sock.settimeout(deadline.left())
        views = self._views(runs, "dst")
        if views is not None:
            recv_into_views(sock, views)
            return
        for run in runs:  # CUDA: stage each run through pinned host memory
            tensor = run_tensor(self.regions, run, "dst")
            staged = tensor.new_empty(tensor.shape, device="cpu", pin_memory=True)
            recv_into_views(sock, [host_bytes(staged)])
            tensor.copy_(staged)
