"""A lossy link for KV event tests: a thread that forwards a real ZMQ publisher's messages to
subscribers (SUB -> PUB, real sockets on loopback) and drops the next ``drop`` of them on request,
so a subscriber sees a genuine sequence gap while the publisher's replay buffer stays intact."""

from __future__ import annotations

import threading

import zmq


class LossyRelay:
    def __init__(self, upstream: str) -> None:
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(upstream)
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        port = self._pub.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self._lock = threading.Lock()
        self._drop = 0
        self.forwarded = 0
        self.dropped = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lossy-relay", daemon=True)
        self._thread.start()

    def drop_next(self, n: int) -> None:
        with self._lock:
            self._drop += n

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._sub.poll(50):
                continue
            frames = self._sub.recv_multipart()
            with self._lock:
                if self._drop:
                    self._drop -= 1
                    self.dropped += 1
                    continue
            self._pub.send_multipart(frames)
            self.forwarded += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sub.close(0)
        self._pub.close(0)
        self._ctx.term()
