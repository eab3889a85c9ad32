"""Decode keeps alive the handoffs it holds: pulls are paced by decode, as in DistServe.

A handoff is held from the moment decode's engine accepts its request (``on_new_request``, before
the request is scheduled) until its pull is reported, done or failed, or the request finishes.
While held, one thread renews it on every prefill worker that keeps it (a Renew frame per
worker, batching every handoff there) every third of its lease, over one control connection per
prefill worker. So a request may wait in decode's queue as long as decode is busy; prefill frees
its KV early only when this decode stopped renewing (it died, or dropped the request). A request
that goes away before its pull releases the handoff at once (Done) instead.

Runs in vLLM's EngineCore process: no torch, no transport, only the side channel's frames.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass

from kvdisagg.connector.layout import KvGeometry
from kvdisagg.connector.protocol.frames import (
    Done,
    HandoffRef,
    Hello,
    Message,
    Renew,
    Reply,
    recv_frame,
    send_frame,
)
from kvdisagg.connector.protocol.versions import PROTOCOL_VERSION
from kvdisagg.connector.threads import start_thread
from kvdisagg.errors import KvDisaggError

logger = logging.getLogger(__name__)

MIN_INTERVAL_S = 0.2
_Peer = tuple[str, int, int]  # a prefill worker's (host, port) and the version spoken with it


@dataclass(frozen=True)
class Held:
    """A handoff that decode holds, and where prefill keeps it (one port per prefill rank)."""

    handoff_id: str
    token: str
    host: str
    ports: tuple[int, ...]
    lease_s: float
    version: int = PROTOCOL_VERSION
    """The side-channel version spoken with this prefill (protocol.Versions.common)."""


class LeaseKeeper:
    def __init__(self, kv_layout: str, transport: str, timeout_s: float,
                 geometry: KvGeometry | None = None) -> None:
        self.kv_layout, self.transport, self.timeout_s = kv_layout, transport, timeout_s
        self.geometry = geometry
        self._held: dict[str, Held] = {}  # decode request id -> its handoff
        self._fresh: list[Held] = []  # held since the last round: renewed at once
        self._releases: list[Held] = []
        self._conns: dict[_Peer, socket.socket] = {}  # one control connection per peer
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        self.renewals = 0  # Renew frames sent (tests, logs)
        self.renewed = 0  # handoff renewals sent (a Renew frame renews many): for metrics

    def hold(self, req_id: str, held: Held) -> None:
        with self._cond:
            self._held[req_id] = held
            self._fresh.append(held)
            if self._thread is None:
                self._thread = start_thread(self._run, "kvdisagg-leases")
            self._cond.notify()

    def drop(self, req_id: str, release: bool) -> None:
        """Stop renewing ``req_id``'s handoff; with ``release``, tell prefill to free it now."""
        with self._cond:
            held = self._held.pop(req_id, None)
            if held is not None and release:
                self._releases.append(held)
                self._cond.notify()

    def held(self) -> dict[str, Held]:
        with self._cond:
            return dict(self._held)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        for sock in list(self._conns.values()):
            sock.close()

    # ---- the renewal thread -------------------------------------------------------------
    def _run(self) -> None:
        next_round = 0.0
        while True:
            with self._cond:
                while not (self._closed or self._fresh or self._releases
                           or (self._held and time.monotonic() >= next_round)):
                    wait = next_round - time.monotonic() if self._held else None
                    self._cond.wait(wait)
                if self._closed:
                    return
                releases, self._releases = self._releases, []
                if time.monotonic() >= next_round:
                    renew = list(self._held.values())
                    interval = min(h.lease_s for h in renew) / 3 if renew else 1.0
                    next_round = time.monotonic() + max(interval, MIN_INTERVAL_S)
                else:
                    renew = self._fresh
                self._fresh = []
            self._send(renew, releases)

    def _send(self, renew: list[Held], releases: list[Held]) -> None:
        frames: dict[_Peer, list[Message]] = {}
        refs: dict[_Peer, list[HandoffRef]] = {}
        for held in renew:
            for port in held.ports:
                refs.setdefault((held.host, port, held.version), []).append(
                    HandoffRef(held.handoff_id, held.token))
        for key, batch in refs.items():
            frames.setdefault(key, []).append(Renew(handoffs=batch))
        for held in releases:
            for port in held.ports:
                frames.setdefault((held.host, port, held.version), []).append(
                    Done(handoff_id=held.handoff_id, token=held.token, ok=False))
        for key, messages in frames.items():
            try:
                sock = self._connection(key)
                for msg in messages:
                    send_frame(sock, msg)
                renews = [m for m in messages if isinstance(m, Renew)]
                self.renewals += len(renews)
                self.renewed += sum(len(m.handoffs) for m in renews)
            except (OSError, ValueError, KvDisaggError) as exc:
                # Prefill unreachable: its pulls fail on their own; retry next round.
                logger.warning("kvdisagg: lease renewal to %s:%d (protocol %d) failed: %s",
                               *key, exc)
                if (dead := self._conns.pop(key, None)) is not None:
                    dead.close()

    def _connection(self, key: _Peer) -> socket.socket:
        if (sock := self._conns.get(key)) is not None:
            return sock
        host, port, version = key
        sock = socket.create_connection((host, port), timeout=self.timeout_s)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            send_frame(sock, Hello(version=version, kv_layout=self.kv_layout,
                                   transport=self.transport, control=True,
                                   geometry=self.geometry))
            reply = recv_frame(sock)
            if not isinstance(reply, Reply) or not reply.ok:
                raise ValueError(f"prefill refused the control connection: "
                                 f"{getattr(reply, 'error', reply)!r}")
        except BaseException:
            sock.close()
            raise
        self._conns[key] = sock
        return sock
