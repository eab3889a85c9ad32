"""A TCP relay in front of a real vLLM instance that breaks chosen streams mid-way.

The proxy sees a real broken connection, as when a decode dies, at an exact point: a request
whose ``X-Request-Id`` starts with ``cut<k>-`` has its first response stream cut right after
its ``k``-th server-sent event (k 0: after the headers, before any event), one starting with
``cutt<t>-`` right after the event whose ``token_ids`` bring the stream's token count to ``t``
or more (the leg must carry token ids: the proxy asks for them on a stream it may migrate),
one starting with ``cutend-`` right after the event that carries its finish reason (vLLM may
merge events under load, so a count could miss it); the same request's later legs (the
migration's continuation) pass whole. What each broken stream delivered is recorded
(``CuttingRelay.cut``: its token ids, whether its finish reason passed), so a test can check
that the break fell where it meant it to. Every response is marked ``Connection: close`` so
that one connection carries one request (the proxy's pool then never reuses a connection
whose request the relay has not seen).
"""

from __future__ import annotations

import json
import re
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

_CUT = re.compile(rb"\r\nx-request-id:\s*cut(\d+|end|t\d+)-([^\r\n]*)", re.IGNORECASE)
_FINISH = b'"finish_reason":"'
_TOKEN_IDS = re.compile(rb'"token_ids":(\[[0-9, ]*\])')  # not prompt_token_ids: a quote first


class Cut(NamedTuple):
    """Where a stream breaks: after ``events`` events, once ``tokens`` token ids passed, or
    (both None) after the event with a finish reason."""

    events: int | None = None
    tokens: int | None = None

    def reached(self, events: int, tokens: int, finished: bool) -> bool:
        if self.events is not None:
            return events >= self.events
        if self.tokens is not None:
            return tokens >= self.tokens
        return finished


class Broken(NamedTuple):
    """A stream the relay broke: its request id header, and what passed before the break."""

    rid: str  # its X-Request-Id
    events: int
    token_ids: list[int]
    finished: bool  # the event with the finish reason passed


class CuttingRelay:
    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.cut: list[Broken] = []  # the streams broken, in order
        self._seen: set[bytes] = set()
        self._lock = threading.Lock()
        self._closed = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def serve(self) -> None:
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._closed = True
        self.listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(client,), daemon=True).start()

    def _one(self, client: socket.socket) -> None:
        upstream = socket.create_connection(self.upstream, timeout=600)
        client.settimeout(600)
        try:
            head = b""
            while b"\r\n\r\n" not in head:
                data = client.recv(65536)
                if not data:
                    return
                head += data
            cut = None
            if (m := _CUT.search(head[:head.index(b"\r\n\r\n") + 2])) is not None:
                with self._lock:
                    if m.group(2) not in self._seen:
                        self._seen.add(m.group(2))
                        where = m.group(1).lower()
                        cut = (Cut() if where == b"end" else
                               Cut(tokens=int(where[1:])) if where.startswith(b"t")
                               else Cut(events=int(where)))
            upstream.sendall(head)
            threading.Thread(target=_pump, args=(client, upstream), daemon=True).start()
            rid = (b"cut%s-%s" % (m.group(1), m.group(2))).decode() if m else ""
            self._answer(upstream, client, cut, rid)
        except OSError:
            pass
        finally:
            for s in (client, upstream):
                try:  # shutdown first: it wakes the pump thread blocked in recv on it
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def _answer(self, upstream: socket.socket, client: socket.socket, cut: Cut | None,
                rid: str) -> None:
        """The response to the client, marked Connection: close, broken where ``cut`` says
        (events counted by their ``\\n\\n`` ends) when set."""
        buf = b""
        while b"\r\n\r\n" not in buf:
            data = upstream.recv(65536)
            if not data:
                client.sendall(buf)
                return
            buf += data
        end = buf.index(b"\r\n\r\n")
        status_end = buf.index(b"\r\n")
        head = buf[:status_end] + b"\r\nConnection: close" + buf[status_end:end + 4]
        body = buf[end + 4:]
        if cut is None or b" 200 " not in buf[:status_end]:
            client.sendall(head + body)
            _pump(upstream, client)
            return
        client.sendall(head)
        events, finished, ids = 0, False, list[int]()
        while True:
            while not cut.reached(events, len(ids), finished) and (
                    i := body.find(b"\n\n")) >= 0:
                events += 1
                finished = finished or _FINISH in body[:i]
                for m in _TOKEN_IDS.finditer(body[:i]):
                    ids += json.loads(m.group(1))
                # through the end of the chunk that carries this event's end
                j = body.find(b"\r\n", i + 2)
                j = j + 2 if j >= 0 else i + 2
                client.sendall(body[:j])
                body = body[j:]
            if cut.reached(events, len(ids), finished):
                self.cut.append(Broken(rid, events, ids, finished))
                return  # both sockets shut down: the stream breaks here
            data = upstream.recv(65536)
            if not data:
                client.sendall(body)
                return
            body += data


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass


@contextmanager
def cutting_relay(upstream_url: str) -> Iterator[CuttingRelay]:
    host, port = upstream_url.rsplit("//", 1)[1].rsplit(":", 1)
    relay = CuttingRelay(host, int(port))
    relay.serve()
    try:
        yield relay
    finally:
        relay.close()
