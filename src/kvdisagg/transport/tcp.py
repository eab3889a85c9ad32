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
        # One byte view per CPU layer (pages + staging arena), sliced per run: no tensor is
        # made on the data path. A block id past the pages is an arena row.
        self._host = [host_bytes(r.pages) if r.pages.device.type == "cpu" else None
                      for r in regions]
        self._arena = [host_bytes(r.stage) if r.stage_blocks else None for r in regions]

    def _views(self, runs: Sequence[CopyRun], side: str) -> list[memoryview] | None:
        """Each run's bytes in KV memory, or None if the KV is not in host memory."""
        spans: list[list[int]] = []  # [layer, arena, start, end], merged where adjacent
        for run in runs:
            if self._host[run.layer] is None:
                return None
            region = self.regions[run.layer]
            first = run.src if side == "src" else run.dst
            arena = int(first >= region.num_blocks)
            start = (first - region.num_blocks * arena) * region.page_bytes
            last = spans[-1] if spans else None
            if last and last[0] == run.layer and last[1] == arena and last[3] == start:
                last[3] += run.count * region.page_bytes
            else:
                spans.append([run.layer, arena, start, start + run.count * region.page_bytes])
        return [(self._arena if arena else self._host)[layer][start:end]
                for layer, arena, start, end in spans]

    def send(self, peer: Any, sock: socket.socket, runs: Sequence[CopyRun],
             deadline: Deadline, grant: bytes) -> None:
        views = self._views(runs, "src")
        if views is None:
            views = [host_bytes(run_tensor(self.regions, run, "src").cpu()) for run in runs]
        send_views(sock, [memoryview(grant), *views], deadline.left)  # grant + bytes: one call

    def recv(self, peer: Any, sock: socket.socket, runs: Sequence[CopyRun],
             deadline: Deadline) -> None:
        views = self._views(runs, "dst")
        if views is not None:
            recv_into_views(sock, views, deadline.left)
            return
        for run in runs:  # CUDA: stage each run through pinned host memory
            tensor = run_tensor(self.regions, run, "dst")
            staged = tensor.new_empty(tensor.shape, device="cpu", pin_memory=True)
            recv_into_views(sock, [host_bytes(staged)], deadline.left)
            tensor.copy_(staged)
