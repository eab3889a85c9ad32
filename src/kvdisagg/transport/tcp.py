"""The default transport: KV bytes inline on the side-channel connection (no dependency).

No staging copy on CPU: the sender gathers straight from vLLM's paged KV memory and the receiver
scatters straight into its blocks (``sendmsg``/``recvmsg_into`` over up to a thousand ranges per
call). A pull of some of a block's heads (another TP on the other side) sends that window of
each block. CUDA KV goes through a host copy per span (use nccl or mooncake between GPUs).
"""

from __future__ import annotations

import socket
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

from kvdisagg.connector.layout import LayerRegion, span_tensor, spans
from kvdisagg.connector.protocol.sockets import recv_into_views, send_views
from kvdisagg.transport.pull import Deadline, PullPlan, PullTransport


def host_bytes(tensor: Any) -> memoryview:
    """A byte view of a contiguous tensor's memory (on CPU: the memory itself)."""
    return memoryview(tensor.numpy()).cast("B")


class TcpTransport(PullTransport):
    name: ClassVar[str] = "tcp"

    def attach(self, regions: Sequence[LayerRegion], is_producer: bool) -> None:
        # One byte view per CPU layer (pages + staging arena), sliced per span: no tensor is
        # made on the data path. A block id past the pages is an arena row.
        self._layers = [(r.page_bytes, r.num_blocks,
                         host_bytes(r.pages) if r.pages.device.type == "cpu" else None,
                         host_bytes(r.stage) if r.stage_blocks else None) for r in regions]

    def _views(self, plan: PullPlan, side: str) -> list[memoryview] | None:
        """Each run's bytes in KV memory, merged where adjacent, or None if the KV is not in
        host memory. Runs once per pull per side over every run (a thousand for 16 MiB of
        scattered blocks), before any byte moves: hence locals and one slice per span."""
        layers, on_src, slices = self._layers, side == "src", plan.slices
        views: list[memoryview] = []
        buf: memoryview | None = None  # the open span: buf[start:end]
        start = end = 0
        for layer, src, dst, count in plan.runs:
            region, offset, nbytes = slices[layer]
            page, num_blocks, host, arena = layers[region]
            if host is None:
                return None
            first = src if on_src else dst
            here = host
            if first >= num_blocks:
                if arena is None:  # check_blocks refuses such ids before any pull
                    raise ValueError(f"block {first} is past layer {layer}'s pages, no arena")
                here, first = arena, first - num_blocks
            if nbytes == page:  # whole pages: the run is one range
                pieces: Iterable[tuple[int, int]] = ((first * page, count * page),)
            else:  # a window of each block (some of its heads)
                pieces = ((b * page + offset, nbytes) for b in range(first, first + count))
            for at, length in pieces:
                if here is buf and at == end:
                    end += length
                    continue
                if buf is not None:
                    views.append(buf[start:end])
                buf, start, end = here, at, at + length
        if buf is not None:
            views.append(buf[start:end])
        return views

    def send(self, peer: Any, sock: socket.socket, plan: PullPlan, deadline: Deadline,
             grant: bytes) -> None:
        views = self._views(plan, "src")
        if views is None:
            views = [host_bytes(span_tensor(self.regions, span).cpu())
                     for span in spans(self.regions, plan.slices, plan.runs, "src")]
        send_views(sock, [memoryview(grant), *views], deadline.left)  # grant + bytes: one call

    def recv(self, peer: Any, sock: socket.socket, plan: PullPlan, deadline: Deadline) -> None:
        views = self._views(plan, "dst")
        if views is not None:
            recv_into_views(sock, views, deadline.left)
            return
        for span in spans(self.regions, plan.slices, plan.runs, "dst"):  # CUDA: via the host
            tensor = span_tensor(self.regions, span)
            staged = tensor.new_empty(tensor.shape, device="cpu", pin_memory=True)
            recv_into_views(sock, [host_bytes(staged)], deadline.left)
            tensor.copy_(staged)
