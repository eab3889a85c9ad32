"""The answer to the client: a whole body, or a stream relayed as it comes, moved to another
decode when its decode fails mid-way (migrate.py).

Only ``timeouts.decode_total_s`` bounds a streamed leg (a stream may take as long as
generation), and ``decode_idle_s`` the silence between chunks. Once the client has bytes, a
decode failure is migrated (``retry.migrations`` times at most, streams the contract allows:
``takes_migration``) or ends the stream with an error event then ``[DONE]``; a stream that broke
after its last token only gets the usage event and ``[DONE]`` it is owed. A stream that
prefill's first token started (first_token.py) gets that token at once, then the decode leg
that continues it. Each relayed request is timed here (TTFT, TPOT, end to end) and judged
against the SLO.

Imports the stages it continues (decode.py, pipeline.py for a migration); nothing but the
front door and fan-out imports it.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from typing import NamedTuple

from aiohttp import web

from kvdisagg.compat._aiohttp import HeadersWithFirstChunk
from kvdisagg.errors import UpstreamError, UpstreamTimeout
from kvdisagg.proxy.fleet.registry import Outcome
from kvdisagg.proxy.handoff.decode import DecodeStage, Opened
from kvdisagg.proxy.handoff.exchange import Exchange
from kvdisagg.proxy.handoff.first_token import Led
from kvdisagg.proxy.handoff.legs import kind_of, outcome_of
from kvdisagg.proxy.handoff.migrate import Tap, continuation, ending, include_usage, wants_token_ids
from kvdisagg.proxy.handoff.pipeline import Pipeline
from kvdisagg.proxy.responses import Refusal, error_event
from kvdisagg.proxy.routing import body as bodies
from kvdisagg.proxy.routing.decide import takes_migration
from kvdisagg.tracing import event

log = logging.getLogger("kvdisagg.proxy")
_now = time.perf_counter  # uvloop's loop.time() has 1 ms resolution: too coarse for TPOT
_CLIENT_HIGH_WATER = 1 << 20  # client write buffer that pauses reading the decode stream


class Served(NamedTuple):
    """The client's response, and how the request ended: the ``outcome`` label of
    ``kvdisagg_proxy_requests_total`` (``ok``, ``error``, ``shed``, ``cancelled``)."""

    response: web.StreamResponse
    outcome: str


class Unmoved(enum.Enum):
    """Why a stream whose decode failed was not moved to another decode."""

    NOT_MIGRATABLE = "not_migratable"  # the contract declines it, or migrations are off
    EXHAUSTED = "exhausted"  # retry.migrations used up
    IMPOSSIBLE = "impossible"  # no continuation (prompt ids unknown, nothing left)
    FAILED = "failed"  # the continuation found no decode that answered


def out_headers(rid: str, opened: Opened, handoff: str) -> dict[str, str]:
    ctype = (opened.resp.header(b"content-type") or b"application/json").decode("latin-1")
    return {"Content-Type": ctype, "X-Request-Id": rid, "X-Kvdisagg-Handoff": handoff}


def whole(x: Exchange, opened: Opened) -> Served:
    """A whole (non-streamed or error) answer: close the leg, account, hand it over (no
    ``Relay``: it keeps a stream's state, which a whole answer has none of)."""
    opened.leg.close(Outcome.OK)
    status = opened.resp.status
    data = opened.head or b""
    if 200 <= status < 300:
        e2e = _now() - x.t0
        x.metrics.e2e.observe(e2e)
        x.metrics.judge(opened.inst.url, e2e, None, None, bodies.completion_tokens(data))
    return Served(web.Response(body=data, status=status,
                               headers=out_headers(x.rid, opened, opened.pre.header)),
                  "ok" if status < 400 else "error")


def _stream_response(request: web.Request, headers: dict[str, str], status: int
                     ) -> web.StreamResponse:
    out = HeadersWithFirstChunk(status=status, headers=headers)
    out.headers["Cache-Control"] = "no-cache"
    if request.version >= (1, 1):
        out.enable_chunked_encoding()
    return out


class Relay:
    """One exchange's answer to its client. For a stream, its state as it goes: the leg being
    relayed, the tap reading its token ids (None: not migratable), the request that leg serves
    (the client's, or a continuation), the events the client got and when the first and the
    last came, and how many times it moved."""

    __slots__ = ("x", "request", "out", "leg", "tap", "body", "events", "first", "last",
                 "moves", "led", "chunked", "transport")
    out: web.StreamResponse  # set when the answer starts
    leg: Opened  # the leg being relayed
    transport: asyncio.Transport  # the client's, while a leg is piped to it

    def __init__(self, x: Exchange, request: web.Request) -> None:
        self.x, self.request = x, request
        self.body = x.body
        self.tap: Tap | None = None
        self.events = 0  # SSE events the client got so far ([DONE] included)
        self.first = self.last = 0.0  # when the first and the last of them came
        self.moves = 0
        self.led = False  # prefill gave the first token (the headers are sent already)
        self.chunked = request.version >= (1, 1)

    async def stream(self, opened: Opened) -> Served:
        """Pass decode's stream to the client, timing it on the way; a decode that fails
        mid-way hands the rest of the answer to another one."""
        x = self.x
        self.out = _stream_response(self.request, out_headers(x.rid, opened, opened.pre.header),
                                    opened.resp.status)
        self.first = self.last = _now()
        x.metrics.decode_first_token.observe(self.first - opened.sent_at)
        event(opened.leg.span, "first_token")
        if takes_migration(x.cfg, x.body):
            self.tap = Tap(x.body.chat, strip=not wants_token_ids(x.body.fields))
        return await self._relay(opened)

    async def stream_led(self, led: Led) -> Served:
        """A stream whose first token prefill gave (first_token.py): that token to the client
        at once, then the decode leg that continues it, relayed as ``stream`` does. A decode
        leg that cannot be opened (every retry failed) ends the stream with an error event."""
        x, request = self.x, self.request
        out = self.out = _stream_response(
            request, {"Content-Type": "text/event-stream; charset=utf-8",
                      "X-Request-Id": x.rid, "X-Kvdisagg-Handoff": led.pre.header}, 200)
        await out.prepare(request)
        await out.write(led.events)
        self.first = self.last = _now()
        event(x.root, "first_token_from_prefill")
        if led.body is None:  # prefill's token ended the answer
            await out.write_eof()
            e2e = self.first - x.t0
            x.metrics.e2e.observe(e2e)
            x.metrics.ttft.observe(e2e)
            decode = led.decode.instance
            x.metrics.judge(decode.url if decode is not None else "", e2e, e2e, None, None)
            return Served(out, "ok")
        try:
            opened = await DecodeStage(x.with_body(led.body)).open(led.pre, led.decode,
                                                                   led.avoid)
        except Refusal as refusal:
            return await self._failed_after_first(refusal.status, refusal.text[:300])
        if not opened.ok:  # an error status: its body says why
            opened.leg.close(Outcome.OK)
            return await self._failed_after_first(
                opened.resp.status, (opened.head or b"")[:300].decode("utf-8", "replace"))
        x.metrics.decode_first_token.observe(_now() - opened.sent_at)
        event(opened.leg.span, "first_token")
        self.tap = Tap(x.body.chat, led.tap.strip, resumed=led.tap)
        self.body = led.body
        self.events = led.events.count(b"data:")
        self.led = True
        return await self._relay(opened)

    async def _failed_after_first(self, status: int, why: str) -> Served:
        await self.out.write(error_event(status, f"decode failed after the first token: {why}"))
        await self.out.write_eof()
        return Served(self.out, "error")

    async def _relay(self, opened: Opened) -> Served:
        """``opened``'s stream to the client (its headers sent already when ``led``), with
        migrations."""
        x, out, request = self.x, self.out, self.request
        m = x.metrics
        first = self.first
        outcome, result = "error", Outcome.BROKEN
        self.leg = opened
        decode_events, decode_first = self.events, self.last  # decode's first event, below
        try:
            head = await self._first_events()
            if not self.led:
                await out.prepare(request)
            if head:
                self.events += head.count(b"data:")
                if self.led:
                    self.last = _now()
                await out.write(head)  # with the headers, through aiohttp's writer
                event(opened.leg.span, "first_byte")
            decode_events, decode_first = self.events, self.last
            while True:
                try:
                    await self._pipe()
                    if self.tap is not None:
                        self.tap.end()
                    if self.tap is not None and self.tap.failure is not None:
                        raise UpstreamError(f"its engine ended the stream: {self.tap.failure}")
                    outcome, result = "ok", Outcome.OK
                    break
                except UpstreamError as exc:
                    leg = self.leg
                    leg.leg.fail(kind_of(exc), outcome_of(exc))
                    log.warning("request %s: decode %s failed mid-stream: %s", x.rid,
                                leg.inst.url, exc)
                    if self.tap is not None and self.tap.finished:
                        # The answer was whole (its finish_reason delivered): only its usage
                        # event and [DONE] are missing. A continuation would generate past it.
                        await out.write(ending(self.tap, include_usage(x.body.fields)))
                        m.migration("finished")
                        outcome, result = "ok", Outcome.OK
                        break
                    unmoved = await self._move()
                    if unmoved is not None:
                        await out.write(error_event(
                            504 if isinstance(exc, UpstreamTimeout) else 502,
                            f"decode {leg.inst.url} failed mid-stream: {exc}"
                            f"{self._why(unmoved)}"))
                        break
                    if more := await self._first_events():
                        await out.write(more)
            await out.write_eof()
        except (asyncio.CancelledError, ConnectionResetError):
            result, outcome = Outcome.CANCELLED, "cancelled"
            self.leg.resp.close()
            raise
        finally:
            self.leg.leg.close(result, outcome)
        if result is Outcome.OK:
            events, last = self.events, self.last
            e2e = _now() - x.t0
            m.e2e.observe(e2e)
            ttft = first - x.t0
            m.ttft.observe(ttft)
            n_tokens = events - 1  # the final [DONE]
            # Events that arrived together (one read) count as delivered at once: TPOT 0.
            tpot = (last - first) / (n_tokens - 1) if n_tokens >= 2 else None
            if tpot is not None:
                m.tpot.observe(tpot)
            # Decode's own pace (what the decision predicts TPOT from): after a first token
            # from prefill the handoff lies before decode's first event, not between its
            # tokens.
            paced = events - decode_events - 1  # decode's later events, [DONE] aside
            pace = tpot if not self.led else (
                (last - decode_first) / paced if paced >= 1 else None)
            if pace is not None:
                self.leg.inst.observe_tpot(pace)
            m.judge(self.leg.inst.url, e2e, ttft, tpot, None)
        return Served(out, outcome)

    async def _first_events(self) -> bytes:
        """The leg's first chunk as the client gets it: whole events (more is read if the
        first chunk holds only part of one)."""
        leg, tap = self.leg, self.tap
        head = leg.head or b""
        if tap is None:
            return head
        out = tap.feed(head)
        try:
            while not out and leg.head is not None:
                chunk = await leg.resp.next_chunk(self.x.cfg.timeouts.decode_idle_s)
                if chunk is None:
                    break
                out = tap.feed(chunk)
        except UpstreamError as exc:  # the relay's loop migrates the rest (tap.failure)
            if tap.failure is None:
                tap.failure = str(exc)
        return out

    async def _pipe(self) -> None:
        """The rest of the leg's stream, from the upstream's data callback straight to the
        client's transport (no task switch per event); raises UpstreamError if the leg
        fails."""
        leg = self.leg
        if leg.head is None:
            return  # the stream ended with its first chunk
        t = self.x.cfg.timeouts
        transport = self.request.transport
        if transport is None:
            raise ConnectionResetError("client went away")
        self.transport = transport
        # request.writer.drain() waits until the client's transport drains
        await leg.resp.relay(self._sink, self.request.writer.drain, t.decode_idle_s,
                             max(0.001, leg.sent_at + t.decode_total_s - _now()))

    def _sink(self, data: bytes) -> bool:
        """Runs in the upstream's data_received: write through, no task switch."""
        tap = self.tap
        if tap is not None and not (data := tap.feed(data)):
            return False
        n = data.count(b"data:")
        if n:
            self.events += n
            if n > 1 or not data.startswith(b"data: [DONE]"):
                self.last = _now()  # a lone [DONE] carries no token
        transport = self.transport
        if transport.is_closing():
            return True  # the relay's drain() then raises
        if self.chunked:  # the framing aiohttp's writer would add, in one write
            transport.write(b"%x\r\n%b\r\n" % (len(data), data))
        else:
            transport.write(data)
        return transport.get_write_buffer_size() > _CLIENT_HIGH_WATER

    async def _move(self) -> Unmoved | None:
        """The rest of a broken stream's answer on another decode (the relay's leg, tap and
        body then the continuation's); or why not."""
        x, tap, leg = self.x, self.tap, self.leg
        if tap is None:
            return Unmoved.NOT_MIGRATABLE
        if self.moves >= x.cfg.retry.migrations:
            x.metrics.migration("exhausted")
            return Unmoved.EXHAUSTED
        nxt = continuation(self.body, tap, x.cfg.policy.prefix_block_chars)
        if nxt is None:
            x.metrics.migration("impossible")
            return Unmoved.IMPOSSIBLE
        try:
            opened: Opened | None = await Pipeline(x.with_body(nxt)).open((leg.inst,))
        except Refusal:
            opened = None
        if opened is None or not opened.ok:
            if opened is not None:
                opened.leg.close(Outcome.OK)
            x.metrics.migration("failed")
            return Unmoved.FAILED
        x.metrics.migration("ok")
        event(x.root, "migrated")
        log.warning("request %s: migrated after %d tokens from %s to %s", x.rid, len(tap.ids),
                    leg.inst.url, opened.inst.url)
        self.leg, self.tap, self.body = opened, Tap(x.body.chat, tap.strip, resumed=tap), nxt
        self.moves += 1
        return None

    def _why(self, unmoved: Unmoved) -> str:
        """What the client's error event adds about the migration that did not happen."""
        if unmoved is Unmoved.EXHAUSTED:
            return f" (after {self.moves} migrations)"
        if unmoved is Unmoved.FAILED:
            return "; migrating it failed too"
        return ""
