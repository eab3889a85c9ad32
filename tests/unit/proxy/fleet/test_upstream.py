"""The proxy's HTTP/1.1 client (proxy/fleet/upstream.py) against a scripted server on loopback: the
bytes it sends, keep-alive reuse and the one resend on a stale connection, every bound (connect,
headers, body, silence mid-stream), the errors each failure gives, and that a request it gives
up on is aborted, so the server sees its connection close."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from kvdisagg.errors import Abandoned, ConnectError, UpstreamError, UpstreamTimeout
from kvdisagg.local.servers import free_port
from kvdisagg.proxy.fleet.upstream import Pool

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class Server:
    """A loopback TCP server that runs ``handler`` per connection and records what it read."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[tuple[bytes, bytes]] = []  # (head, body) as received
        self.closed_by_client = asyncio.Event()
        self.server: asyncio.Server | None = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def read_request(self, reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        body = await reader.readexactly(length)
        self.requests.append((head, body))
        return head, body

    async def wait_closed_by_client(self, reader: asyncio.StreamReader) -> None:
        """Read until the client closes or aborts the connection."""
        with contextlib.suppress(ConnectionError):
            while await reader.read(65536):
                pass
        self.closed_by_client.set()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"


@contextlib.asynccontextmanager
async def serving(handler: Handler, prefix: str = "") -> AsyncIterator[tuple[Server, Pool]]:
    srv = Server(handler)
    srv.server = await asyncio.start_server(srv._serve, "127.0.0.1", 0)
    pool = Pool(srv.url + prefix)
    try:
        yield srv, pool
    finally:
        pool.close()
        srv.server.close()


def ok(body: bytes, extra: bytes = b"") -> bytes:
    return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%b\r\n%b"
            % (len(body), extra, body))


async def answer_each(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      srv: Server) -> None:
    """Keep-alive: answer every request on the connection with its own body, echoed."""
    while True:
        try:
            _, body = await srv.read_request(reader)
        except asyncio.IncompleteReadError:
            return
        writer.write(ok(b'{"echo":' + body + b"}"))
        await writer.drain()


def run(coro: Awaitable[None]) -> None:
    asyncio.run(coro)  # type: ignore[arg-type]


T = {"connect_s": 2.0, "headers_s": 2.0}


def test_request_bytes_status_headers_and_body() -> None:
    async def t() -> None:
        srv: Server

        async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await answer_each(r, w, srv)

        async with serving(handler, prefix="/base/") as (srv, pool):
            resp = await pool.request(b"POST", "/v1/completions", b'{"a":1}',
                                      b"Authorization: Bearer k\r\nX-Request-Id: r1\r\n", **T)
            assert resp.status == 200
            assert resp.header(b"content-type") == b"application/json"  # any case
            assert resp.header(b"X-Missing") is None
            assert await resp.read(2.0) == b'{"echo":{"a":1}}'
            head, body = srv.requests[0]
            port = srv.url.rsplit(":", 1)[1]
            assert head == (b"POST /base/v1/completions HTTP/1.1\r\nHost: 127.0.0.1:%b\r\n"
                            b"Content-Length: 7\r\nAuthorization: Bearer k\r\n"
                            b"X-Request-Id: r1\r\n\r\n" % port.encode())
            assert body == b'{"a":1}'
    run(t())


def test_keep_alive_reuses_one_connection_and_a_large_body_arrives_whole() -> None:
    async def t() -> None:
        srv: Server

        async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await answer_each(r, w, srv)

        async with serving(handler) as (srv, pool):
            big = b'"' + b"x" * 200_000 + b'"'  # written apart from the head (>= 64 KiB)
            for body in (b"1", big, b"2"):
                resp = await pool.request(b"POST", "/", body, **T)
                assert await resp.read(2.0) == b'{"echo":' + body + b"}"
            assert srv.connections == 1
            assert [b for _, b in srv.requests] == [b"1", big, b"2"]
    run(t())


def test_connection_close_answer_is_not_reused() -> None:
    async def t() -> None:
        srv: Server

        async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await srv.read_request(r)
            w.write(ok(b"{}", b"Connection: close\r\n"))
            await w.drain()

        async with serving(handler) as (srv, pool):
            for _ in range(2):
                assert await (await pool.request(b"POST", "/", b"{}", **T)).read(2.0) == b"{}"
            assert srv.connections == 2
    run(t())


def test_stale_keep_alive_connection_is_resent_once_on_a_fresh_one() -> None:
    """A kept-alive connection that the server closes without answering (it timed the
    connection out as the request went out) gets the request again on a new connection; one the
    server closed while it was idle is not used again."""
    async def t() -> None:
        srv: Server

        async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            n = srv.connections
            await srv.read_request(r)
            w.write(ok(b"{}"))  # kept alive: HTTP/1.1's default
            await w.drain()
            await srv.read_request(r)
            if n == 1:
                return  # closed without a byte of an answer
            w.write(ok(b"{}"))
            await w.drain()
            await asyncio.sleep(0.05)  # then closed while idle

        async with serving(handler) as (srv, pool):
            for body in (b"1", b"2", b"3", b"4"):
                if body == b"4":
                    await asyncio.sleep(0.3)  # the idle close has reached the pool
                resp = await pool.request(b"POST", "/", body, **T)
                assert await resp.read(2.0) == b"{}"
            # connection 1: 1, 2 (unanswered); connection 2: 2 again, 3; connection 3: 4
            assert [b for _, b in srv.requests] == [b"1", b"2", b"2", b"3", b"4"]
            assert srv.connections == 3
    run(t())


def test_connect_refused_is_a_connect_error_never_sent() -> None:
    async def t() -> None:
        pool = Pool(f"http://127.0.0.1:{free_port()}")
        with pytest.raises(ConnectError, match="cannot connect to 127.0.0.1") as err:
            await pool.request(b"POST", "/", b"{}", **T)
        assert err.value.sent is False
    run(t())


def test_only_http_urls() -> None:
    for url in ("https://a:1", "ftp://a", "http://", "a:1"):
        with pytest.raises(ValueError, match="only http://host:port"):
            Pool(url)
    assert Pool("http://h.example").port == 80


def test_no_headers_in_time_is_a_timeout_and_aborts_the_connection() -> None:
    async def t() -> None:
        srv: Server

        async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await srv.read_request(r)
            await srv.wait_closed_by_client(r)  # never answers

        async with serving(handler) as (srv, pool):
            with pytest.raises(UpstreamTimeout, match="no response headers within 0.2s"):
                await pool.request(b"POST", "/", b"{}", connect_s=2.0, headers_s=0.2)
            await asyncio.wait_for(srv.closed_by_client.wait(), 5)  # vLLM learns: abandoned
    run(t())


@pytest.mark.parametrize("sent, error", [
    (b"", "connection closed before responding"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc", "connection closed mid-response"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n", "malformed HTTP response"),
])
def test_upstream_failures_are_named(sent: bytes, error: str) -> None:
    async def t() -> None:
        srv: Server

        async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await srv.read_request(r)
            w.write(sent)
            await w.drain()
            await asyncio.sleep(0.05)

        async with serving(handler) as (srv, pool):
            with pytest.raises(UpstreamError, match=error) as err:
                resp = await pool.request(b"POST", "/", b"{}", **T)
                await resp.read(2.0)
            assert err.value.sent is True
            assert type(err.value) is UpstreamError
    run(t())


def test_body_not_complete_in_time_times_out() -> None:
    async def t() -> None:
        srv: Server

        async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await srv.read_request(r)
            w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
            await srv.wait_closed_by_client(r)

        async with serving(handler) as (srv, pool):
            resp = await pool.request(b"POST", "/", b"{}", **T)
            with pytest.raises(UpstreamTimeout, match="body not complete after 0.2s"):
                await resp.read(0.2)
            await asyncio.wait_for(srv.closed_by_client.wait(), 5)
    run(t())


def chunked(*parts: bytes) -> bytes:
    return b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in parts)


def test_stream_chunks_then_silence_mid_stream_is_an_idle_timeout() -> None:
    async def t() -> None:
        srv: Server

        async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await srv.read_request(r)
            w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                    + chunked(b"data: 1\n\n"))
            await w.drain()
            await asyncio.sleep(0.1)
            w.write(chunked(b"data: 2\n\n"))
            await w.drain()
            await srv.wait_closed_by_client(r)  # then silent

        async with serving(handler) as (srv, pool):
            resp = await pool.request(b"POST", "/", b"{}", **T)
            got = []
            with pytest.raises(UpstreamTimeout, match="no data for 0.3s mid-stream"):
                async for chunk in resp.iter_chunks(idle_s=0.3, total_s=10):
                    got.append(chunk)
            assert b"".join(got) == b"data: 1\n\ndata: 2\n\n"
            await asyncio.wait_for(srv.closed_by_client.wait(), 5)
    run(t())


def test_stream_over_its_total_bound_times_out_though_never_idle() -> None:
    async def t() -> None:
        srv: Server

        async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await srv.read_request(r)
            w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            while True:
                w.write(chunked(b"x"))
                await w.drain()
                await asyncio.sleep(0.05)

        async with serving(handler) as (srv, pool):
            resp = await pool.request(b"POST", "/", b"{}", **T)
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            with pytest.raises(UpstreamTimeout, match="stream not finished after 0.5s"):
                async for _ in resp.iter_chunks(idle_s=0.3, total_s=0.5):
                    pass
            assert loop.time() - t0 < 2.0
    run(t())


def test_next_chunk_and_relay_deliver_the_body_then_return_the_connection() -> None:
    async def t() -> None:
        srv: Server

        async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            while True:
                await srv.read_request(r)
                w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
                for part in (b"a", b"b", b"c"):
                    w.write(chunked(part))
                    await w.drain()
                    await asyncio.sleep(0.02)
                w.write(b"0\r\n\r\n")
                await w.drain()

        async with serving(handler) as (srv, pool):
            resp = await pool.request(b"POST", "/", b"{}", **T)
            got = b""
            while (chunk := await resp.next_chunk(2.0)) is not None:
                got += chunk
            assert got == b"abc"

            relayed: list[bytes] = []
            drains = 0

            async def drain() -> None:
                nonlocal drains
                drains += 1

            resp = await pool.request(b"POST", "/", b"{}", **T)
            # the sink reports itself backed up each time: the relay waits on drain, then reads on
            await resp.relay(lambda data: relayed.append(data) or True, drain, 2.0, 10.0)
            assert b"".join(relayed) == b"abc" and drains >= 1
            assert srv.connections == 1  # both bodies read to the end: kept alive
    run(t())


def test_a_body_read_to_its_end_relays_nothing_though_its_connection_serves_another() -> None:
    """next_chunk returned None (the body ended, its connection back in the pool); the
    connection then carries another request. Relaying the ended body returns at once and sees
    none of the other answer's bytes (it waited out its idle bound on a connection that was no
    longer its own, with the other request's body going to its sink: a decode stream that
    ended early hung 60 s while the proxy's probes used its connection)."""
    async def t() -> None:
        srv: Server

        async with serving(lambda r, w: answer_each(r, w, srv)) as (srv, pool):
            ended = await pool.request(b"POST", "/", b"1", **T)
            assert await ended.next_chunk(2.0) == b'{"echo":1}'
            assert await ended.next_chunk(2.0) is None
            other = await pool.request(b"POST", "/", b"2", **T)  # the same connection
            assert srv.connections == 1
            relayed: list[bytes] = []

            async def drain() -> None:
                pass

            await asyncio.wait_for(ended.relay(relayed.append, drain, 5.0, 5.0), 1.0)
            assert [c async for c in ended.iter_chunks(5.0, 5.0)] == []
            assert await other.read(2.0) == b'{"echo":2}' and relayed == []
    run(t())


def test_fail_waiting_abandons_requests_waiting_for_an_answer_only() -> None:
    async def t() -> None:
        srv: Server
        streaming = asyncio.Event()

        async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            head, _ = await srv.read_request(r)
            if b"/stream" in head:
                w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked(b"a"))
                await w.drain()
                streaming.set()
                await asyncio.sleep(0.5)
                w.write(chunked(b"b") + b"0\r\n\r\n")
                await w.drain()
            await srv.wait_closed_by_client(r)

        async with serving(handler) as (srv, pool):
            stream = await pool.request(b"POST", "/stream", b"{}", **T)
            relayed: list[bytes] = []

            async def drain() -> None:
                pass

            relay = asyncio.create_task(stream.relay(lambda d: relayed.append(d) or False, drain,
                                                     5.0, 10.0))
            waiting = asyncio.create_task(pool.request(b"POST", "/wait", b"{}", connect_s=2.0,
                                                       headers_s=30.0))
            await streaming.wait()
            while len(srv.requests) < 2:
                await asyncio.sleep(0.01)
            assert pool.fail_waiting("instance unhealthy") == 1
            with pytest.raises(Abandoned, match="instance unhealthy"):
                await waiting
            await relay  # the stream being relayed has its own bound: it finishes
            assert b"".join(relayed) == b"ab"
            assert pool.fail_waiting("again") == 0
    run(t())


# -- what a failed leg says about whether its request reached the server (UpstreamError.sent):
# decode.py reuses a handoff only for a request that never did

RAW_OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: text/plain\r\n\r\nok"


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head + (await reader.readexactly(length) if length else b"")


def test_server_gone_after_reading_a_request_on_a_reused_connection_may_have_seen_it() -> None:
    """A server that answered once on a keep-alive connection, then read the next request and
    died without a byte (a decode killed mid-generation of a non-streamed answer): the pool
    resends once on a fresh connection (the reused one might just have been stale), which is
    refused. The failure must say the request may have been seen (``sent``): the server did
    read it, and may have pulled the handoff it carried."""
    async def t() -> None:
        seen: list[bytes] = []
        writers: list[asyncio.StreamWriter] = []

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writers.append(writer)
            while True:
                try:
                    seen.append(await _read_request(reader))
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                if len(seen) == 1:
                    writer.write(RAW_OK)
                    await writer.drain()
                else:  # read, then die: stop listening and drop the connection
                    server.close()
                    writer.transport.abort()
                    return

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        pool = Pool(f"http://127.0.0.1:{port}")
        try:
            resp = await pool.request(b"POST", "/v1/completions", b"{}", connect_s=2,
                                      headers_s=2)
            assert resp.status == 200 and await resp.read(2) == b"ok"
            with pytest.raises(UpstreamError) as info:
                await pool.request(b"POST", "/v1/completions", b'{"n":2}', connect_s=2,
                                   headers_s=2)
            assert len(seen) == 2 and seen[1].endswith(b'{"n":2}')
            assert isinstance(info.value, ConnectError)  # the resend was refused
            assert info.value.sent, "the server read the request: it may have acted on it"
        finally:
            pool.close()
            server.close()

    asyncio.run(t())


def test_refused_first_connection_never_reached_the_server() -> None:
    async def t() -> None:
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        pool = Pool(f"http://127.0.0.1:{port}")
        with pytest.raises(ConnectError) as info:
            await pool.request(b"POST", "/", b"{}", connect_s=2, headers_s=2)
        assert not info.value.sent
        pool.close()

    asyncio.run(t())
