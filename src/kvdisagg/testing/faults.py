"""Fault-injecting transports for tests: they speak tcp's wire but damage what they move."""

from __future__ import annotations

import socket
from typing import Sequence

from kvdisagg.transport.tcp import TcpTransport


class CorruptingTcpTransport(TcpTransport):
    """Receives like tcp, then overwrites the KV it received with garbage.

    Proves the end-to-end tests can fail: decode output must change when the moved bytes do.
    Load it with ``"transport": "kvdisagg.testing.faults:CorruptingTcpTransport"`` on decode.
    """

    def recv(self, sock: socket.socket, views: Sequence[memoryview]) -> None:
        super().recv(sock, views)
        for view in views:
            view[:] = bytes(reversed(view))  # same bytes, wrong places: plausible but wrong
