"""Socket helpers of the side channel and of the transports that move KV over sockets: read
exactly n bytes, and gather-write / scatter-read many buffers per system call, each call bounded
by what is left of the operation's time."""

from __future__ import annotations

import socket
from collections.abc import Callable

from kvdisagg.errors import TransferFailed


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_into_exact(sock, memoryview(buf))
    return bytes(buf)


def recv_into_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        k = sock.recv_into(view[got:])
        if k == 0:
            raise TransferFailed("peer closed the connection mid-message")
        got += k


IOV_MAX = 1024  # buffers per sendmsg/recvmsg_into call (Linux UIO_MAXIOV)
IOV_BYTES = 4 << 20  # ... and about this many bytes: more than a call moves on loopback


TimeLeft = Callable[[], float]  # seconds left of an operation's bound; raises when none


def send_views(sock: socket.socket, views: list[memoryview], left: TimeLeft) -> None:
    """Gather-write every byte of ``views`` in order: many buffers per system call, so
    scattered KV blocks cost one call per few MiB, not one per block. Each call gets what is
    left of the bound, so a peer that trickles bytes cannot stretch it."""
    views, i = list(views), 0
    while i < len(views):
        sock.settimeout(left())
        sent = sock.sendmsg(_batch(views, i))
        i = _advance(views, i, sent)


def recv_into_views(sock: socket.socket, views: list[memoryview], left: TimeLeft) -> None:
    """Scatter-read exactly ``sum(len(v))`` bytes into ``views`` in order (bounded as
    send_views).

    Measured and not kept: ``MSG_WAITALL`` on a blocking socket bounded by ``SO_RCVTIMEO``
    (one call per batch instead of one per ~64 KiB the kernel has ready) moved 1-16 MiB no
    faster on loopback; the two copies through the kernel dominate, not the Python loop."""
    views, i = list(views), 0
    while i < len(views):
        sock.settimeout(left())
        got = sock.recvmsg_into(_batch(views, i))[0]
        if got == 0:
            raise TransferFailed("peer closed the connection mid-message")
        i = _advance(views, i, got)


def _batch(views: list[memoryview], i: int) -> list[memoryview]:
    """The buffers from ``i`` for one call: a call converts every buffer it is given, so give
    it about as many as it can fill."""
    end, nbytes = i, 0
    while end < len(views) and end - i < IOV_MAX and nbytes < IOV_BYTES:
        nbytes += len(views[end])
        end += 1
    return views[i:end]


def _advance(views: list[memoryview], i: int, done: int) -> int:
    """Skip ``done`` bytes from ``views[i]`` on; return the first index not finished."""
    while i < len(views) and done >= len(views[i]):
        done -= len(views[i])
        i += 1
    if done:
        views[i] = views[i][done:]
    return i
