"""Fault-injecting transports for tests: they speak tcp's wire but damage what they move."""

from __future__ import annotations

import socket
from typing import Any, Sequence

from kvdisagg.layout import CopyRun, run_tensor
from kvdisagg.transport.pull import Deadline
from kvdisagg.transport.tcp import TcpTransport


class CorruptingTcpTransport(TcpTransport):
    """Receives like tcp, then reverses the KV bytes it received in place.

    Proves the end-to-end tests can fail: decode output must change when the moved bytes do.
    Load it with ``"transport": "tests.support.faults:CorruptingTcpTransport"`` on decode.
    """

    name = "tcp"  # prefill serves it as tcp

    def recv(self, peer: Any, sock: socket.socket, runs: Sequence[CopyRun],
             deadline: Deadline) -> None:
        super().recv(peer, sock, runs, deadline)
        for run in runs:
            tensor = run_tensor(self.regions, run, "dst")
            tensor.copy_(tensor.flip(-1))  # same bytes, wrong places: plausible but wrong
