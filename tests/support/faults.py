"""Fault-injecting transports for tests: they speak their transport's wire, then damage one
byte of what landed in decode's blocks, as a link or a stray write would; or cut the side
channel's TCP connection in the middle of a pull (``CuttingTcpTransport``).

Load one on decode with ``"transport": "tests.support.faults:Corrupting<Name>Transport"``
(``Tcp``, ``Nccl``, ``Mooncake``, ``LMCache``); prefill serves it as its plain transport. With
``kv_checksum`` on (the default) decode must fail the load (ChecksumMismatch); with it off the
corruption goes through, which proves the end-to-end tests can fail.
"""

from __future__ import annotations

import importlib
import os
import socket
from typing import Any

from kvdisagg.connector.layout import LayerRegion, span_tensor, spans
from kvdisagg.connector.protocol.sockets import recv_into_views
from kvdisagg.transport.pull import Deadline, PullPlan
from kvdisagg.transport.tcp import TcpTransport


def flip_one_byte(regions: list[LayerRegion], plan: PullPlan) -> None:
    """Flip one bit of the middle byte of the first span that landed in decode's blocks."""
    first = spans(regions, plan.slices, plan.runs, "dst")[0]
    flat = span_tensor(regions, first)
    flat[flat.numel() // 2] ^= 0x10


class _CorruptsPulls:
    """Mixin for pull transports: the received bytes, then one flipped."""

    regions: list[LayerRegion]

    def recv(self, peer: Any, sock: socket.socket, plan: PullPlan,
             deadline: Deadline) -> None:
        super().recv(peer, sock, plan, deadline)  # type: ignore[misc]
        if plan.runs:
            flip_one_byte(self.regions, plan)


class CorruptingTcpTransport(_CorruptsPulls, TcpTransport):
    pass


CUT_ARM_ENV = "KVDISAGG_TEST_CUT_ARM"
"""Names a file; while it exists, the next pull of a ``CuttingTcpTransport`` takes it (one pull
per arming, whichever instance and thread gets there first) and is cut."""


def _take_arm() -> bool:
    path = os.environ.get(CUT_ARM_ENV)
    if not path:
        return False
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


class CuttingTcpTransport(TcpTransport):
    """The plain TCP transport, except that an armed pull (``CUT_ARM_ENV``) reads half of its
    first run's bytes and then cuts the connection (shutdown both ways: the peer sees it
    closed): the pull fails mid-transfer, as on a link that drops."""

    def recv(self, peer: Any, sock: socket.socket, plan: PullPlan,
             deadline: Deadline) -> None:
        if plan.runs and _take_arm():
            views = self._views(plan, "dst")
            first = views[0] if views else None
            if first is not None and len(first) > 1:
                recv_into_views(sock, [first[:len(first) // 2]], deadline.left)
            sock.shutdown(socket.SHUT_RDWR)
        super().recv(peer, sock, plan, deadline)


_LAZY = {  # their dependencies are imported only when a test asks for them
    "CorruptingNcclTransport": ("kvdisagg.transport.nccl", "NcclTransport"),
    "CorruptingMooncakeTransport": ("kvdisagg.transport.mooncake", "MooncakeTransport"),
}


def _corrupting_lmcache() -> type:
    from kvdisagg.transport.lmcache import LMCacheTransport

    class CorruptingLMCacheTransport(LMCacheTransport):
        def _receive(self, client: Any, chunk: Any, parts: list[memoryview],
                     deadline: Deadline, failed: Any) -> None:
            super()._receive(client, chunk, parts, deadline, failed)
            first = parts[0]  # a page of the chunk (the last part is the checksum trailer)
            first[len(first) // 2] ^= 0x10

    return CorruptingLMCacheTransport


def __getattr__(name: str) -> type:
    if name == "CorruptingLMCacheTransport":
        cls = _corrupting_lmcache()
    elif name in _LAZY:
        module, base = _LAZY[name]
        cls = type(name, (_CorruptsPulls, getattr(importlib.import_module(module), base)), {})
    else:
        raise AttributeError(name)
    globals()[name] = cls
    return cls
