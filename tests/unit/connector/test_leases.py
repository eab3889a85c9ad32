"""Decode's leases (connector/leases.py) on handoffs it waits for, driven by vLLM's real Scheduler
(tests/support/vllm_harness.py), against a listening socket standing in for prefill's side
channel: renewed from arrival until the load is reported, released (Done ok=False) on abort."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

import pytest

pytest.importorskip("vllm")

from vllm.v1.request import RequestStatus

from kvdisagg.connector.leases import Held
from kvdisagg.connector.protocol.frames import (
    Done,
    Hello,
    Message,
    Renew,
    Reply,
    recv_frame,
    send_frame,
)
from tests.support.vllm_harness import KV_LAYOUT, TRANSPORT, remote_prefill_params


class FakePrefill:
    """A loopback listener in place of prefill's side channel: accepts connections, answers each
    Hello with Reply(ok=True) and records every frame it receives."""

    def __init__(self) -> None:
        self._server = socket.create_server(("127.0.0.1", 0))
        self._server.settimeout(0.1)
        self.port: int = self._server.getsockname()[1]
        self._lock = threading.Lock()
        self._frames: list[Message] = []
        self._conns: list[socket.socket] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(None)
            with self._lock:
                self._conns.append(conn)
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            while True:
                try:
                    msg = recv_frame(conn)
                except Exception:  # peer closed, or we are shutting down
                    return
                with self._lock:
                    self._frames.append(msg)
                if isinstance(msg, Hello):
                    send_frame(conn, Reply(ok=True))

    def frames(self) -> list[Message]:
        with self._lock:
            return list(self._frames)

    def renewals(self, handoff_id: str, token: str) -> int:
        """Renew frames naming this handoff (with its token)."""
        return sum(any((ref.handoff_id, ref.token) == (handoff_id, token) for ref in f.handoffs)
                   for f in self.frames() if isinstance(f, Renew))

    def dones(self, handoff_id: str) -> list[Done]:
        return [f for f in self.frames() if isinstance(f, Done) and f.handoff_id == handoff_id]

    def close(self) -> None:
        self._stop.set()
        self._server.close()
        with self._lock:
            for conn in self._conns:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        for thread in self._threads:
            thread.join(timeout=5)


@pytest.fixture
def fake_prefill():
    prefill = FakePrefill()
    yield prefill
    prefill.close()


def wait_for(cond: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    """Poll ``cond`` until true or ``timeout_s`` passed (generous: the machine may be loaded)."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_decode_holds_handoff_from_arrival_until_reported(make, fake_prefill):
    """Decode renews a handoff from the request's arrival (before any step) until its load is
    reported, then stops; a request aborted while waiting for KV releases its handoff at once."""
    prefill = fake_prefill
    h = make("kv_consumer")
    params = remote_prefill_params(h, 40, ports=[prefill.port], request_id="handoff-a",
                                   token="tok-a", lease_s=0.6)
    assert params["kvdisagg"]["lease_s"] == 0.6
    a = h.add_request(40, kv_transfer_params=params, max_tokens=2)
    arid = a.request_id
    assert h.side.leases.held() == {
        arid: Held("handoff-a", "tok-a", "127.0.0.1", (prefill.port,), 0.6)}

    # Renewed every third of the lease (0.2 s): two rounds well within 1.5 s, polled up to 5 s.
    assert wait_for(lambda: prefill.renewals("handoff-a", "tok-a") >= 2), prefill.frames()
    hello = prefill.frames()[0]
    assert isinstance(hello, Hello) and hello.control
    assert (hello.kv_layout, hello.transport) == (KV_LAYOUT, TRANSPORT)
    assert sum(isinstance(f, Hello) for f in prefill.frames()) == 1  # one control connection

    s = h.step()
    (load,) = s.meta.loads
    assert load.handoff_id == "handoff-a" and load.ports == (prefill.port,)
    assert arid in h.side.leases.held()  # still held while the pull is in flight
    h.step(finished_recving={arid})
    assert arid not in h.side.leases.held()
    time.sleep(0.5)  # a round already under way may still land
    settled = prefill.renewals("handoff-a", "tok-a")
    time.sleep(1.0)  # five rounds' worth
    assert prefill.renewals("handoff-a", "tok-a") == settled
    assert prefill.dones("handoff-a") == []  # a pulled handoff is the worker's to finish

    params = remote_prefill_params(h, 40, ports=[prefill.port], request_id="handoff-b",
                                   token="tok-b", lease_s=0.6)
    b = h.add_request(40, kv_transfer_params=params)
    brid = b.request_id
    assert brid in h.side.leases.held()
    h.step()
    assert b.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    h.abort(brid)
    assert brid not in h.side.leases.held()
    assert wait_for(lambda: prefill.dones("handoff-b")), prefill.frames()
    assert prefill.dones("handoff-b") == [Done(handoff_id="handoff-b", token="tok-b", ok=False)]
    time.sleep(0.5)
    settled = prefill.renewals("handoff-b", "tok-b")
    time.sleep(1.0)
    assert prefill.renewals("handoff-b", "tok-b") == settled

    h.step(finished_recving={brid})  # the aborted load is reported: its blocks are freed
    h.drain()
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED
    h.assert_no_leak()
    assert prefill.dones("handoff-a") == []
