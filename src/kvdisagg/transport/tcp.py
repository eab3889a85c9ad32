"""The default transport: KV bytes inline on the side-channel connection (no dependency).

No staging copy on CPU: the sender writes straight from vLLM's paged KV memory and the receiver
reads straight into its blocks (``recv_into``), one range per CopyRun. CUDA KV goes through a
host copy per run (use nccl or mooncake between GPUs).
"""

from __future__ import annotations

import socket
from typing import Any, ClassVar, Sequence

from kvdisagg.layout import CopyRun, run_tensor
from kvdisagg.protocol import recv_into_exact
from kvdisagg.transport.pull import Deadline, PullTransport


def host_bytes(tensor: Any) -> memoryview:
    """A byte view of a contiguous tensor's memory (on CPU: the memory itself)."""
    return memoryview(tensor.numpy()).cast("B")


class TcpTransport(PullTransport):
    name: ClassVar[str] = "tcp"

    def send(self, peer: Any, sock: socket.socket, runs: Sequence[CopyRun],
             deadline: Deadline) -> None:
        for run in runs:
            tensor = run_tensor(self.regions, run, "src")
            sock.settimeout(deadline.left())
            sock.sendall(host_bytes(tensor if tensor.device.type == "cpu" else tensor.cpu()))

    def recv(self, peer: Any, sock: socket.socket, runs: Sequence[CopyRun],
             deadline: Deadline) -> None:
        for run in runs:
            tensor = run_tensor(self.regions, run, "dst")
            staged = tensor if tensor.device.type == "cpu" else tensor.new_empty(
                tensor.shape, device="cpu", pin_memory=True)
            sock.settimeout(deadline.left())
            recv_into_exact(sock, host_bytes(staged))
            if staged is not tensor:
                tensor.copy_(staged)
