"""The proxy's upstream pool against a raw loopback server: what a failed leg says about whether
its request may have reached the server (``UpstreamError.sent``), which decides whether a
decode retry may reuse the handoff (decode.py) or needs a fresh prefill."""

from __future__ import annotations

import asyncio

import pytest

from kvdisagg.errors import ConnectError, UpstreamError
from kvdisagg.proxy.upstream import Pool

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: text/plain\r\n\r\nok"


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
                    writer.write(OK)
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
