"""Fault-injecting transports for tests: they speak tcp's wire but damage what they move."""

from __future__ import annotations

import socket
from typing import Any

from kvdisagg.layout import span_tensor, spans
from kvdisagg.transport.pull import Deadline, PullPlan
from kvdisagg.transport.tcp import TcpTransport


class CorruptingTcpTransport(TcpTransport):
    """Receives like tcp, then reverses the KV bytes it received in place.

    Proves the end-to-end tests can fail: decode output must change when the moved bytes do.
    Load it with ``"transport": "tests.support.faults:CorruptingTcpTransport"`` on decode.
    """

    name = "tcp"  # prefill serves it as tcp

    def recv(self, peer: Any, sock: socket.socket, plan: PullPlan, deadline: Deadline) -> None:
        super().recv(peer, sock, plan, deadline)
        for span in spans(self.regions, plan.slices, plan.runs, "dst"):
            tensor = span_tensor(self.regions, span)
            tensor.copy_(tensor.flip(-1))  # same bytes, wrong places: plausible but wrong
