"""A lean keep-alive HTTP/1.1 client for the upstream legs.

Why not aiohttp's ClientSession: per request it builds URL objects, cookie jars, trace hooks and
timeout contexts, which made it the largest CPU cost of a proxied request (docs/benchmarks.md).
The proxy only ever POSTs a JSON body to a known host and reads the answer, so this client is an
``asyncio.Protocol`` with the httptools (llhttp) parser, a per-instance pool of idle connections,
and timers instead of ``wait_for`` tasks. Every wait is bounded; ``close()`` aborts the
connection, which is how vLLM learns that a request was abandoned.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from urllib.parse import urlsplit

import httptools

from kvdisagg.errors import Abandoned, ConnectError, UpstreamError, UpstreamTimeout

__all__ = ["UpstreamError", "ConnectError", "UpstreamTimeout", "Abandoned", "Response", "Pool"]

_PAUSE_AT = 1 << 20  # bytes buffered before we stop reading the upstream socket


class _Conn(asyncio.Protocol):
    """One connection; at most one request on it at a time."""

    __slots__ = ("pool", "transport", "parser", "closed", "status", "headers", "chunks",
                 "buffered", "done", "waiter", "error", "paused", "got_bytes", "keep_alive",
                 "sink", "last_data", "blocked")

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._reset()

    def _reset(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.done = False
        self.waiter: asyncio.Future[None] | None = None
        self.error: UpstreamError | None = None
        self.paused = False
        self.got_bytes = False
        self.keep_alive = False
        self.sink: Callable[[bytes], bool] | None = None  # relay mode: body goes straight here
        self.last_data = 0.0
        self.blocked = False  # the sink asked to stop reading until its client drains

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:  # pragma: no cover - upstreams never upgrade
            self._fail(UpstreamError("upstream tried to upgrade the connection"))
        except httptools.HttpParserError as exc:
            self._fail(UpstreamError(f"malformed HTTP response: {exc}"))
        sink = self.sink
        if sink is not None:
            if self.chunks:
                self._flush(sink)
        elif self.buffered > _PAUSE_AT and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool._busy.discard(self)
        if not self.done:
            what = "before responding" if not self.got_bytes else "mid-response"
            self._fail(UpstreamError(f"connection closed {what}", sent=True))

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        if self.sink is None:
            self.buffered += len(body)
            self._wake()

    def _flush(self, sink: Callable[[bytes], bool]) -> None:
        """Relay mode: what one read brought goes to the sink in one piece, no task switch."""
        chunks = self.chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self.last_data = self.pool.loop.time()
        if sink(data) and not self.blocked and self.transport is not None:
            self.blocked = True
            self.transport.pause_reading()
            self._wake()

    def on_message_complete(self) -> None:
        self.done = True
        self._wake()

    # internals
    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _fail(self, err: UpstreamError) -> None:
        if self.error is None:
            self.error = err
        self._wake()
        if self.transport is not None and not self.closed:
            self.transport.abort()

    async def wait(self, timeout: float, what: str) -> None:
        """Wait for the next parser event, at most ``timeout`` seconds."""
        if self.error is not None:
            raise self.error
        loop = self.pool.loop
        w = self.waiter = loop.create_future()
        handle = loop.call_later(timeout, _expire, w)
        try:
            await w
        except asyncio.CancelledError:
            self.abort()
            raise
        finally:
            handle.cancel()
            self.waiter = None
        if self.error is not None:
            raise self.error

    def abort(self) -> None:
        self.done = True
        self.closed = True
        self.pool._busy.discard(self)
        if self.transport is not None:
            self.transport.abort()

    def resume(self) -> None:
        """Read the socket again after ``data_received`` paused it (1 MiB buffered)."""
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()


def _expire(w: asyncio.Future[None]) -> None:
    if not w.done():
        w.set_exception(TimeoutError())


class Response:
    """Status, headers and a body that is read once, either whole or chunk by chunk."""

    __slots__ = ("_conn", "status", "headers", "_released")

    def __init__(self, conn: _Conn) -> None:
        self._conn = conn
        self.status = conn.status
        self.headers = conn.headers
        self._released = False

    def header(self, name: bytes) -> bytes | None:
        name = name.lower()
        for k, v in self.headers:
            if k.lower() == name:
                return v
        return None

    async def read(self, timeout: float) -> bytes:
        """The whole body, within ``timeout`` seconds."""
        c = self._conn
        loop = c.pool.loop
        deadline = loop.time() + timeout
        parts: list[bytes] = []
        while True:
            # Taken out of the buffer, so reading (paused past 1 MiB) goes on: read() wants it all.
            parts += c.chunks
            c.chunks.clear()
            c.buffered = 0
            c.resume()
            if c.done:
                break
            left = deadline - loop.time()
            if left <= 0:
                self.close()
                raise UpstreamTimeout(f"body not complete after {timeout:.1f}s")
            try:
                await c.wait(left, "body")
            except TimeoutError:
                self.close()
                raise UpstreamTimeout(f"body not complete after {timeout:.1f}s") from None
        if c.error is not None:
            self.close()
            raise c.error
        self._release()
        return b"".join(parts)

    async def iter_chunks(self, idle_s: float, total_s: float) -> AsyncIterator[bytes]:
        """Body chunks as they arrive; silence over ``idle_s`` or a total over ``total_s`` fails.

        Chunks that arrived together are yielded joined, so a relay writes them to its client
        in one call (one syscall instead of one per SSE event when the upstream runs ahead).
        """
        if self._released:
            return
        c = self._conn
        loop = c.pool.loop
        deadline = loop.time() + total_s
        try:
            while True:
                while c.chunks:
                    if len(c.chunks) == 1:
                        chunk = c.chunks.popleft()
                    else:
                        chunk = b"".join(c.chunks)
                        c.chunks.clear()
                    c.buffered -= len(chunk)
                    if c.buffered < _PAUSE_AT // 2:
                        c.resume()
                    yield chunk
                if c.done:
                    if c.error is not None:
                        raise c.error
                    break
                left = deadline - loop.time()
                if left <= 0:
                    raise UpstreamTimeout(f"stream not finished after {total_s:.1f}s")
                try:
                    await c.wait(min(idle_s, left), "chunk")
                except TimeoutError:
                    if left <= idle_s:
                        raise UpstreamTimeout(f"stream not finished after {total_s:.1f}s") from None
                    raise UpstreamTimeout(f"no data for {idle_s:.1f}s mid-stream") from None
        except BaseException:
            self.close()
            raise
        self._release()

    async def next_chunk(self, timeout: float) -> bytes | None:
        """The body bytes buffered now (joined) or the next to arrive; None at the body's end."""
        if self._released:  # read to its end already: the connection is the pool's again
            return None
        c = self._conn
        try:
            while not c.chunks:
                if c.done:
                    if c.error is not None:
                        raise c.error
                    self._release()
                    return None
                try:
                    await c.wait(timeout, "chunk")
                except TimeoutError:
                    raise UpstreamTimeout(f"no data for {timeout:.1f}s") from None
        except BaseException:
            self.close()
            raise
        chunk = c.chunks.popleft() if len(c.chunks) == 1 else b"".join(c.chunks)
        c.chunks.clear()
        c.buffered = 0
        c.resume()
        return chunk

    async def relay(self, sink: Callable[[bytes], bool], drain: Callable[[], Awaitable[None]],
                    idle_s: float, total_s: float) -> None:
        """Hand the rest of the body to ``sink`` from the protocol callback as it arrives.

        Why: awaiting each chunk costs a future, a timer and a task switch per SSE event, the
        largest Python cost of relaying a stream (docs/benchmarks.md). ``sink`` must not raise;
        it returns True when its client is backed up, which pauses reading the upstream until
        ``await drain()`` returns. Silence over ``idle_s`` (checked by one timer per interval,
        not per chunk) or a total over ``total_s`` fails; so does an upstream error. A body
        already read to its end (``next_chunk`` returned None) has nothing left to relay: its
        connection went back to the pool and may carry another request by now (a probe's),
        whose bytes must not reach this sink.
        """
        if self._released:
            return
        c = self._conn
        loop = c.pool.loop
        deadline = loop.time() + total_s
        try:
            c.sink = sink
            c.buffered = 0
            if c.chunks:
                c._flush(sink)
            if c.paused and c.transport is not None:
                c.paused = False
                if not c.blocked:
                    c.transport.resume_reading()
            c.last_data = loop.time()
            while True:
                if c.blocked:
                    left = deadline - loop.time()
                    try:
                        async with asyncio.timeout(max(0.0, left)):
                            await drain()
                    except TimeoutError:
                        raise UpstreamTimeout(f"stream not finished after {total_s:.1f}s") from None
                    c.blocked = False
                    if c.transport is not None and not c.closed:
                        c.transport.resume_reading()
                    c.last_data = loop.time()
                if c.done:
                    if c.error is not None:
                        raise c.error
                    break
                now = loop.time()
                left = deadline - now
                if left <= 0:
                    raise UpstreamTimeout(f"stream not finished after {total_s:.1f}s")
                try:
                    await c.wait(max(0.001, min(idle_s - (now - c.last_data), left)), "chunk")
                except TimeoutError:
                    if c.done or c.blocked:
                        continue
                    if loop.time() - c.last_data >= idle_s:
                        raise UpstreamTimeout(f"no data for {idle_s:.1f}s mid-stream") from None
        except BaseException:
            c.sink = None
            self.close()
            raise
        c.sink = None
        self._release()

    def _release(self) -> None:
        if not self._released:
            self._released = True
            self._conn.pool._put(self._conn)

    def close(self) -> None:
        """Abort the connection unless the body was fully read (then it returns to the pool)."""
        if self._released:
            return
        self._released = True
        c = self._conn
        if not c.done or c.error is not None:
            c.abort()
        else:
            c.pool._put(c)


class Pool:
    """Idle keep-alive connections to one ``http://host:port`` origin."""

    def __init__(self, base_url: str, max_idle: int = 256) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"upstream {base_url!r}: only http://host:port URLs are supported")
        self.host = parts.hostname
        self.port = parts.port or 80
        self.prefix = parts.path.rstrip("/")
        self._host_header = f"Host: {parts.netloc}\r\n".encode()
        self.max_idle = max_idle
        self._idle: list[_Conn] = []
        self._busy: set[_Conn] = set()  # connections with a request on them
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]  # set on use
        self._closed = False

    def _put(self, conn: _Conn) -> None:
        self._busy.discard(conn)
        if (conn.closed or not conn.keep_alive or conn.error is not None or self._closed
                or len(self._idle) >= self.max_idle):
            conn.abort()
            return
        conn._reset()
        self._idle.append(conn)

    async def _connect(self, timeout: float) -> _Conn:
        try:
            async with asyncio.timeout(timeout):
                _, conn = await self.loop.create_connection(
                    lambda: _Conn(self), self.host, self.port)
        except TimeoutError:
            raise ConnectError(f"connect to {self.host}:{self.port} timed out "
                               f"after {timeout:.1f}s") from None
        except OSError as exc:
            raise ConnectError(f"cannot connect to {self.host}:{self.port}: "
                               f"{exc.strerror or exc}") from None
        return conn

    async def request(self, method: bytes, path: str, body: bytes = b"",
                      headers: bytes = b"", *, connect_s: float,
                      headers_s: float) -> Response:
        """Send one request and wait for the response headers.

        ``headers`` is pre-encoded ``Name: value\\r\\n`` lines. A request on a reused connection
        that the server had already closed (no byte came back) is resent once on a fresh one.
        If that resend cannot connect, the failure still says ``sent``: the closed connection
        may have been a server that read the request and died (a decode killed while it
        generated a non-streamed answer), not a stale one, and it may have acted on it (pulled
        the handoff the request carried).
        """
        if self.loop is None:
            self.loop = asyncio.get_running_loop()
        head = b"".join((method, b" ", (self.prefix + path).encode(), b" HTTP/1.1\r\n",
                         self._host_header, b"Content-Length: ", str(len(body)).encode(),
                         b"\r\n", headers, b"\r\n"))
        for attempt in (0, 1):
            reused = False
            conn: _Conn | None = None
            while self._idle:
                c = self._idle.pop()
                if not c.closed:
                    conn, reused = c, True
                    break
            if conn is None:
                try:
                    conn = await self._connect(connect_s)
                except ConnectError as exc:
                    exc.sent = attempt > 0  # the first copy went out on a reused connection
                    raise
            assert conn.transport is not None
            self._busy.add(conn)
            conn.transport.write(head + body if len(body) < 65536 else head)
            if len(body) >= 65536:
                conn.transport.write(body)
            try:
                while not conn.status:
                    await conn.wait(headers_s, "headers")
            except TimeoutError:
                conn.abort()
                raise UpstreamTimeout(f"no response headers within {headers_s:.1f}s") from None
            except UpstreamError as exc:
                if (reused and not conn.got_bytes and attempt == 0
                        and not isinstance(exc, Abandoned)):
                    continue  # stale keep-alive connection; the server never read it
                raise
            return Response(conn)
        raise AssertionError("unreachable")  # pragma: no cover

    def fail_waiting(self, reason: str, streams: bool = False) -> int:
        """Fail every request still waiting for its answer with ``Abandoned(reason)``.

        Streams already being relayed (they have their own idle bound) are left alone unless
        ``streams``; finished bodies always. Returns how many were failed.
        """
        waiting = [c for c in self._busy if (streams or c.sink is None) and not c.done]
        for c in waiting:
            c._fail(Abandoned(reason))
        return len(waiting)

    def close(self) -> None:
        self._closed = True
        for c in self._idle:
            c.abort()
        self._idle.clear()
