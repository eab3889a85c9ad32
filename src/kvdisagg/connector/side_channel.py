"""The side channel between a prefill worker and the decode workers that pull from it.

Prefill side: a threaded TCP server holding the handoff table (what may be read, by whom, until
when). Decode side: ``pull()``, one connection per handoff: Hello (layout check), Read (blocks,
then the KV bytes through the transport), Done (prefill may free).

Clients never control what memory is read: a Read names a handoff, proves it holds the handoff's
random token, and may only list blocks of that handoff; prefill maps them to memory itself.
Reads of an expired or acknowledged handoff are refused, and a handoff being read is pinned so
its lease cannot expire under the reader.
"""

from __future__ import annotations

import hmac
import logging
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

from kvdisagg.connector.layout import LayerRegion, block_views, stream_bytes
from kvdisagg.errors import (IncompatiblePeerError, PeerUnreachable, TransferFailed,
                             TransferTimeout)
from kvdisagg.protocol import (PROTOCOL_VERSION, Done, Hello, Read, Reply, recv_frame,
                               send_frame)
from kvdisagg.transport.base import Transport

logger = logging.getLogger(__name__)

# A Read may arrive before the worker has learnt of its handoff (that reaches the worker in the
# next step's connector metadata); wait this long for it before refusing.
REGISTRATION_GRACE_S = 5.0


@dataclass
class _Handoff:
    token: str
    block_ids: frozenset[int]
    deadline: float
    readers: int = 0
    done: bool = False


@dataclass
class HandoffTable:
    """Handoffs a prefill worker holds blocks for, keyed by vLLM request id. Thread-safe."""

    _items: dict[str, _Handoff] = field(default_factory=dict)
    _cond: threading.Condition = field(default_factory=threading.Condition)

    def add(self, req_id: str, token: str, block_ids: Sequence[int], lease_s: float) -> None:
        with self._cond:
            self._items[req_id] = _Handoff(token, frozenset(block_ids), time.monotonic() + lease_s)
            self._cond.notify_all()

    def pin(self, req_id: str, token: str, block_ids: Sequence[int], wait_s: float) -> str:
        """Check a Read and pin the handoff; return '' if granted, else why not."""
        with self._cond:
            self._cond.wait_for(lambda: req_id in self._items, timeout=wait_s)
            h = self._items.get(req_id)
            if h is None:
                return f"unknown handoff {req_id!r}"
            if not hmac.compare_digest(h.token, token):
                return f"wrong token for handoff {req_id!r}"
            if h.done or time.monotonic() > h.deadline:
                return f"handoff {req_id!r} expired or already released"
            outside = set(block_ids) - h.block_ids
            if outside:
                return f"blocks {sorted(outside)[:8]} are not part of handoff {req_id!r}"
            h.readers += 1
            return ""

    def unpin(self, req_id: str) -> None:
        with self._cond:
            self._items[req_id].readers -= 1

    def release(self, req_id: str, token: str) -> bool:
        with self._cond:
            h = self._items.get(req_id)
            if h is None or not hmac.compare_digest(h.token, token):
                return False
            h.done = True
            return True

    def take_finished(self) -> set[str]:
        """Ids acknowledged, or whose lease ran out while nobody reads them; removed."""
        now = time.monotonic()
        with self._cond:
            out = {rid for rid, h in self._items.items()
                   if h.readers == 0 and (h.done or now > h.deadline)}
            for rid in out:
                expired = not self._items.pop(rid).done
                if expired:
                    logger.warning("kvdisagg: handoff %s lease expired unread; freeing", rid)
            return out

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)


class SideChannelServer:
    """Serves Hello/Read/Done for one prefill worker on ``host:port`` (0 = a free port)."""

    def __init__(self, host: str, port: int, *, kv_layout: str, regions: list[LayerRegion],
                 transport: Transport, table: HandoffTable, timeout_s: float) -> None:
        self.kv_layout, self.regions, self.transport = kv_layout, regions, transport
        self.table, self.timeout_s = table, timeout_s
        self._sock = socket.create_server((host, port), backlog=64)
        self.port: int = self._sock.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept_loop, name="kvdisagg-side-channel",
                         daemon=True).start()

    def close(self) -> None:
        # shutdown() wakes the thread blocked in accept(); close() alone leaves the
        # listening socket alive (and accepting) until that call returns.
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(self.timeout_s)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            with conn:
                while True:
                    self._handle(conn, recv_frame(conn))
        except (OSError, TransferFailed):
            pass  # peer went away or spoke garbage: drop the connection, nothing is held

    def _handle(self, conn: socket.socket, msg: object) -> None:
        match msg:
            case Hello(version=version, kv_layout=layout):
                if version != PROTOCOL_VERSION:
                    error = f"protocol version {version} != prefill's {PROTOCOL_VERSION}"
                elif layout != self.kv_layout:
                    error = (f"kv_layout differs: prefill {self.kv_layout}, decode {layout} "
                             "(model, dtype, block size, TP and CPU kind must match)")
                else:
                    error = ""
                send_frame(conn, Reply(ok=not error, error=error, kv_layout=self.kv_layout))
            case Read(handoff_id=rid, token=token, block_ids=block_ids):
                if any(b >= r.num_blocks for r in self.regions for b in block_ids):
                    send_frame(conn, Reply(ok=False, error="block id out of range"))
                    return
                error = self.table.pin(rid, token, block_ids, REGISTRATION_GRACE_S)
                if error:
                    send_frame(conn, Reply(ok=False, error=error))
                    return
                try:
                    send_frame(conn, Reply(ok=True, nbytes=stream_bytes(self.regions,
                                                                        len(block_ids))))
                    self.transport.send(conn, block_views(self.regions, block_ids))
                finally:
                    self.table.unpin(rid)
            case Done(handoff_id=rid, token=token):
                ok = self.table.release(rid, token)
                send_frame(conn, Reply(ok=ok, error="" if ok else f"unknown handoff {rid!r}"))
            case _:
                send_frame(conn, Reply(ok=False, error=f"unexpected message {type(msg).__name__}"))


def pull(*, host: str, port: int, handoff_id: str, token: str, kv_layout: str,
         remote_block_ids: Sequence[int], local_regions: list[LayerRegion],
         local_block_ids: Sequence[int], transport: Transport, timeout_s: float) -> int:
    """Decode worker: copy remote blocks into local blocks, then release them on prefill.

    Blocking, bounded by ``timeout_s`` overall; returns bytes moved. Raises TransportError.
    An empty block list only releases the handoff (decode had the whole prompt cached).
    """
    deadline = time.monotonic() + timeout_s

    def remaining() -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransferTimeout(f"pull of handoff {handoff_id} from {host}:{port} "
                                  f"exceeded {timeout_s:.1f}s")
        return left

    try:
        sock = socket.create_connection((host, port), timeout=remaining())
    except OSError as exc:
        raise PeerUnreachable(f"prefill side channel {host}:{port} unreachable: {exc}") from None
    try:
        with sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

            def call(msg: Hello | Read | Done) -> Reply:
                sock.settimeout(remaining())
                send_frame(sock, msg)
                reply = recv_frame(sock)
                if not isinstance(reply, Reply):
                    raise TransferFailed(f"prefill {host}:{port} answered {reply!r}")
                return reply

            reply = call(Hello(kv_layout=kv_layout))
            if not reply.ok:
                raise IncompatiblePeerError(f"prefill {host}:{port} refused: {reply.error}")
            nbytes = 0
            if remote_block_ids:
                reply = call(Read(handoff_id=handoff_id, token=token,
                                  block_ids=list(remote_block_ids)))
                if not reply.ok:
                    raise TransferFailed(f"prefill {host}:{port} refused the read: {reply.error}")
                views = block_views(local_regions, local_block_ids)
                nbytes = sum(len(v) for v in views)
                if nbytes != reply.nbytes:
                    raise IncompatiblePeerError(
                        f"prefill sends {reply.nbytes} bytes, decode expects {nbytes}")
                sock.settimeout(remaining())
                transport.recv(sock, views)
            call(Done(handoff_id=handoff_id, token=token))
            return nbytes
    except socket.timeout:
        raise TransferTimeout(f"pull of handoff {handoff_id} from {host}:{port} "
                              f"exceeded {timeout_s:.1f}s") from None
    except OSError as exc:
        raise TransferFailed(f"pull from {host}:{port} broke: {exc}") from None
