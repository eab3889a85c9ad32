"""The default transport: KV bytes inline on the side-channel TCP connection.

No staging copy on CPU: the sender writes straight from vLLM's paged KV memory and the receiver
reads straight into its blocks (``recv_into``). One range per run of consecutive blocks.
"""

from __future__ import annotations

import socket
from typing import ClassVar, Sequence

from kvdisagg.protocol import recv_into_exact


class TcpTransport:
    name: ClassVar[str] = "tcp"

    def send(self, sock: socket.socket, views: Sequence[memoryview]) -> None:
        for view in views:
            sock.sendall(view)

    def recv(self, sock: socket.socket, views: Sequence[memoryview]) -> None:
        for view in views:
            recv_into_exact(sock, view)
