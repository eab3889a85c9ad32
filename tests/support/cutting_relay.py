"""A TCP relay in front of a real vLLM instance that breaks chosen streams mid-way.

The proxy sees a real broken connection, as when a decode dies, at an exact point: a request
whose ``X-Request-Id`` starts with ``cut<k>-`` has its first response stream cut right after
its ``k``-th server-sent event (k 0: after the headers, before any event), one starting with
``cutend-`` right after the event that carries its finish reason (the last token: vLLM may
merge events under load, so a count could miss it); the same request's later legs (the
migration's continuation) pass whole. Every response is marked
``Connection: close`` so that one connection carries one request (the proxy's pool then never
reuses a connection whose request the relay has not seen).
"""

from __future__ import annotations

import re
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_CUT = re.compile(rb"\r\nx-request-id:\s*cut(\d+|end)-([^\r\n]*)", re.IGNORECASE)
_FINISH = b'"finish_reason":"'
AT_FINISH = -1  # cut_after: after the event with a finish reason


class CuttingRelay:
    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.cut: list[str] = []  # request ids whose stream was cut, in order
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
            cut_after = None
            if (m := _CUT.search(head[:head.index(b"\r\n\r\n") + 2])) is not None:
                with self._lock:
                    if m.group(2) not in self._seen:
                        self._seen.add(m.group(2))
                        cut_after = (AT_FINISH if m.group(1).lower() == b"end"
                                     else int(m.group(1)))
            upstream.sendall(head)
            threading.Thread(target=_pump, args=(client, upstream), daemon=True).start()
            self._answer(upstream, client, cut_after, m.group(0).decode() if m else "")
        except OSError:
            pass
        finally:
            for s in (client, upstream):
                try:  # shutdown first: it wakes the pump thread blocked in recv on it
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def _answer(self, upstream: socket.socket, client: socket.socket, cut_after: int | None,
                rid: str) -> None:
        """The response to the client, marked Connection: close, cut after ``cut_after``
        events (counted by their ``\\n\\n`` ends) when set."""
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
        if cut_after is None or b" 200 " not in buf[:status_end]:
            client.sendall(head + body)
            _pump(upstream, client)
            return
        client.sendall(head)
        events, finished = 0, False
        while True:
            while (events < cut_after or cut_after == AT_FINISH and not finished) and (
                    i := body.find(b"\n\n")) >= 0:
                events += 1
                finished = _FINISH in body[:i]
                # through the end of the chunk that carries this event's end
                j = body.find(b"\r\n", i + 2)
                j = j + 2 if j >= 0 else i + 2
                client.sendall(body[:j])
                body = body[j:]
            if (events >= cut_after >= 0) or finished:
                self.cut.append(rid)
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
