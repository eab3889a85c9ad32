"""The decode stage: open a decode leg that answered (with retries), then relay it.

Timeouts bound a dead instance, not a slow generation: decode waits for headers, a non-streamed
body or a stream's first event up to ``timeouts.decode_total_s`` (vLLM sends a non-streamed
answer's headers only when generation is done); health probes are the liveness check in
between (``registry.py`` fails the legs waiting on an instance that turns unhealthy).

Failure rules before the client saw a byte (``open_decode``): retry on another decode while
``decode_total_s`` (the whole decode phase, retries included) lasts; a refused connection
reuses the handoff (decode never saw it), anything else re-prefills first (the KV may be gone);
a stream whose first event is an error (vLLM's answer to a failed KV load) counts as failing
before the first byte; with no other decode, one that answered (it is alive; its KV source may
have died) gets the retry with a fresh handoff, and a 500 or error event after a handoff does
not open its breaker. Once the client has bytes (``relay_stream``), a decode failure ends the
stream with an error event then ``[DONE]``. A client that goes away cancels the handler, which
aborts the upstream connection: vLLM then aborts the request and frees its blocks.

A handoff goes only to a decode that speaks a side-channel protocol version of its prefill
(``registry.accepts``; the handoff's params say which, ``Prefilled.versions``): the decision
chose one already, unless what the proxy knew of an instance's versions was stale (a pod
replaced between probes). Then another decode that does takes it; with none, decode computes
the prompt itself (``no_compatible_decode``) and the handoff expires on prefill a lease later.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any, NamedTuple

from aiohttp import web

from kvdisagg.compat._aiohttp import HeadersWithFirstChunk
from kvdisagg.errors import UpstreamError, UpstreamTimeout
from kvdisagg.proxy import body as bodies
from kvdisagg.proxy.first_token import Led
from kvdisagg.proxy.legs import (
    RETRYABLE_STATUS,
    FailKind,
    LegFailure,
    LegScope,
    kind_of,
    outcome_of,
    status_outcome,
)
from kvdisagg.proxy.migrate import Tap, continuation, ending, include_usage, wants_token_ids
from kvdisagg.proxy.policies import Selection, Verdict
from kvdisagg.proxy.prefill import Prefilled, prefill
from kvdisagg.proxy.registry import Instance, Outcome, accepts
from kvdisagg.proxy.responses import error_event, error_response
from kvdisagg.proxy.types import Admission, Side
from kvdisagg.proxy.upstream import Response
from kvdisagg.tracing import event, traceparent_of

if TYPE_CHECKING:
    from kvdisagg.proxy.serving import RequestCtx, Serving

log = logging.getLogger("kvdisagg.proxy")
_now = time.perf_counter  # uvloop's loop.time() has 1 ms resolution: too coarse for TPOT


def first_error(chunk: bytes) -> bytes | None:
    """The error the first event of ``chunk`` carries, if it is one."""
    if not chunk.startswith(b"data: "):
        return None
    end = chunk.find(b"\n\n")
    return bodies.error_of(chunk[6:end if end >= 0 else len(chunk)])


_CLIENT_HIGH_WATER = 1 << 20  # client write buffer that pauses reading the decode stream


class Opened(NamedTuple):
    """A decode leg that answered and whose answer nobody has seen yet. ``head``: the whole
    body (not streamed, or an error status) or the stream's first chunk (None: it ended at
    once). The leg stays open (``leg``) until the relay closes it."""

    inst: Instance
    resp: Response
    leg: LegScope
    head: bytes | None
    sent_at: float  # when the leg was sent
    pre: Prefilled  # the handoff this leg carries (the last one, after re-prefills)


class Failed(NamedTuple):
    """A decode leg that failed before its first byte, and what a retry must do."""

    failure: LegFailure
    answered: bool  # the instance answered over HTTP: alive, may take a retry
    reprefill: bool  # the handoff may be gone: prefill again before retrying


def migratable(s: Serving, body: bodies.ClientBody) -> bool:
    """A stream the proxy can move to another decode if its decode fails (migrate.py): the
    contract allows it (contract.py) and migrations are on."""
    return (body.paths.migration is None and not body.one_of_many
            and s.cfg.retry.migrations > 0)


def handoff_decode(s: Serving, ctx: RequestCtx, pre: Prefilled, first: Selection,
                   avoid: tuple[Instance, ...] = ()) -> tuple[Prefilled, Selection]:
    """The decode to take ``pre``'s handoff: ``first`` when it speaks a protocol version of
    the handoff's prefill, else the pick among the decodes that do; with none, ``first``
    computing the prompt itself (``no_compatible_decode``)."""
    decode = first.instance
    if pre.kv is None or not isinstance(decode, Instance) or accepts(decode, pre.versions):
        return pre, first
    reg = s.registry
    cands = [c for c in (reg.candidates(Side.DECODE, avoid) or reg.candidates(Side.DECODE))
             if accepts(c, pre.versions)]
    if cands:
        return pre, s.decider.choose_decode(ctx.body, cands)
    log.warning("request %s: no decode speaks protocol %s of the handoff's prefill; decode "
                "computes the prompt itself", ctx.rid, pre.versions)
    return Prefilled(None, "no_compatible_decode", ctx.body.route.prompt_tokens), first


async def open_decode(s: Serving, ctx: RequestCtx, pre: Prefilled,
                      first: Selection | None = None,
                      avoid: tuple[Instance, ...] = ()) -> Opened | web.Response:
    """A decode leg that answered, or the client's error. ``first``: the decode the decision
    chose (used for the first try); ``avoid``: instances to try only when no other is left."""
    cfg, reg = s.cfg, s.registry
    deadline = _now() + cfg.timeouts.decode_total_s  # the decode phase, retries included
    tried: list[Instance] = []
    answered: list[Instance] = []
    failures: list[LegFailure] = []
    for tries in range(cfg.retry.decode_attempts):
        if deadline - _now() <= 0:
            break
        # The decision's pick, unless it stopped being routable meanwhile (drained, removed,
        # unhealthy while the prefill leg ran).
        if (tries == 0 and first is not None and first.instance is not None
                and first.instance in reg.candidates(Side.DECODE)):
            sel = first
        else:
            cands = (reg.candidates(Side.DECODE, (*tried, *avoid))
                     or reg.candidates(Side.DECODE, tuple(tried)))
            if not cands and answered:
                # No other decode: one that answered with an error (typically a KV load that
                # failed because its prefill died) gets the retry, with a fresh handoff.
                cands = [i for i in reg.candidates(Side.DECODE) if i in answered]
            if pre.kv is not None and cands:  # only decodes that can pull this handoff
                fit = [c for c in cands if accepts(c, pre.versions)]
                if not fit:
                    log.warning("request %s: no decode left speaks protocol %s of the "
                                "handoff's prefill; decode computes the prompt itself",
                                ctx.rid, pre.versions)
                    pre = Prefilled(None, "no_compatible_decode", ctx.body.route.prompt_tokens)
                cands = fit or cands
            sel = s.decider.choose_decode(ctx.body, cands)
        inst = sel.instance
        if inst is None:
            break
        assert isinstance(inst, Instance)
        if (sel.verdict is Verdict.SLO_MISS and tries == 0
                and cfg.slo.admission == Admission.SHED):
            return s.reject(429, "slo_tpot", f"no decode instance is predicted to meet the "
                            f"TPOT SLO (best {inst.url}: {sel.predicted_s:.4f}s > "
                            f"{cfg.slo.tpot_s}s)", "rate_limit_exceeded")
        if tried:
            tried[-1].retries[Side.DECODE] += 1
        res = await attempt(s, ctx, inst, pre, deadline)
        if isinstance(res, Opened):
            return res
        failures.append(res.failure)
        tried.append(inst)
        if res.answered:
            answered.append(inst)
        log.warning("request %s: decode attempt %d/%d failed: %s", ctx.rid, tries + 1,
                    cfg.retry.decode_attempts, res.failure.message)
        if (res.reprefill and pre.kv is not None and tries + 1 < cfg.retry.decode_attempts
                and deadline > _now()):
            again = await prefill(s, ctx)
            if isinstance(again, web.Response):
                return again
            pre = again
    if not failures:
        return s.reject(503, "no_healthy_decode", "no healthy decode instance",
                        retry_after_s=cfg.health.interval_s)
    status = 504 if all(f.status == 504 for f in failures) else 502
    return error_response(status, "decode failed: " + "; ".join(f.message for f in failures),
                          "upstream_error")


async def attempt(s: Serving, ctx: RequestCtx, inst: Instance, pre: Prefilled,
                  deadline: float) -> Opened | Failed:
    """One decode leg until its first byte (its first event when streamed)."""
    t = s.cfg.timeouts
    span = s.tracer.start("decode_leg", traceparent_of(ctx.root), attributes={
        "kvdisagg.instance": inst.url, "kvdisagg.mode": pre.header}) if ctx.root else None
    dbody = bodies.decode_body(ctx.body, pre.kv, traceparent_of(span),
                               token_ids=migratable(s, ctx.body))
    sent_at = _now()
    # Until its first byte, a streamed decode-only leg is a prompt decode computes (decide.py;
    # a whole answer's first byte comes at its end: counted as a stream throughout).
    local = pre.local_tokens if pre.kv is None and ctx.body.stream else None
    leg = LegScope(inst, Side.DECODE, ctx.body.route.max_tokens, s.metrics, span, local)
    try:
        # Headers may come only when generation is done (vLLM, not streamed).
        left = deadline - sent_at
        resp = await inst.pool.request(b"POST", ctx.path, dbody, ctx.leg_headers(span),
                                       connect_s=min(t.decode_connect_s, left), headers_s=left)
    except UpstreamError as exc:
        leg.fail(kind_of(exc), outcome_of(exc))
        # A refused connection: decode never saw the handoff, which can be used again.
        return Failed(LegFailure.of(exc, f"decode {inst.url}: {exc}"), False, exc.sent)
    except asyncio.CancelledError:
        leg.close(Outcome.CANCELLED, "cancelled")
        raise
    try:
        if resp.status >= 500 or resp.status in RETRYABLE_STATUS:
            try:
                data = await resp.read(max(0.001, min(t.decode_idle_s, deadline - _now())))
            except UpstreamError:
                data = b""
            # vLLM answers 500 to a failed KV load, which may be the prefill's fault: counted,
            # but not held against this decode's breaker.
            neutral = resp.status == 500 and pre.kv is not None
            leg.fail(FailKind.STATUS, Outcome.NEUTRAL if neutral
                     else status_outcome(resp.status))
            return Failed(LegFailure(FailKind.STATUS, f"decode {inst.url} returned "
                                      f"{resp.status}: {data[:300].decode('utf-8', 'replace')}",
                                      502), True, True)
        if not ctx.body.stream or not 200 <= resp.status < 300:
            head: bytes | None = await resp.read(max(0.001, deadline - _now()))
        else:
            head = await resp.next_chunk(max(0.001, deadline - _now()))
        if head is not None and 200 <= resp.status < 300 and bodies.aborted(head):
            # vLLM aborted it unanswered: an engine shutting down (SIGTERM) rejects new
            # requests so, before the probes see the instance retiring.
            resp.close()
            leg.fail(FailKind.ABORTED, Outcome.NEUTRAL)
            return Failed(LegFailure(FailKind.ABORTED, f"decode {inst.url} aborted the "
                                      "request (shutting down?)", 502), True, True)
        if ctx.body.stream and 200 <= resp.status < 300:
            if head is not None and (error := first_error(head)) is not None:
                resp.close()
                # After a handoff the KV source may be at fault (a dead prefill): counted,
                # but not against this decode's breaker.
                leg.fail(FailKind.ERROR_EVENT,
                         Outcome.BROKEN if pre.kv is None else Outcome.NEUTRAL)
                return Failed(LegFailure(
                    FailKind.ERROR_EVENT, f"decode {inst.url} answered with an error event: "
                    f"{error[:300].decode('utf-8', 'replace')}", 502), True, True)
    except UpstreamError as exc:
        leg.fail(kind_of(exc), outcome_of(exc))
        return Failed(LegFailure.of(exc, f"decode {inst.url} failed before the first "
                                     f"byte: {exc}"), True, True)
    except BaseException:
        leg.close(Outcome.CANCELLED, "cancelled")
        resp.close()
        raise
    leg.prompt_computed()
    return Opened(inst, resp, leg, head, sent_at, pre)


def out_headers(ctx: RequestCtx, opened: Opened, handoff: str) -> dict[str, str]:
    ctype = (opened.resp.header(b"content-type") or b"application/json").decode("latin-1")
    return {"Content-Type": ctype, "X-Request-Id": ctx.rid, "X-Kvdisagg-Handoff": handoff}


def finish_body(s: Serving, ctx: RequestCtx, opened: Opened) -> tuple[web.Response, str]:
    """A whole (non-streamed or error) answer: close the leg, account, hand it over."""
    opened.leg.close(Outcome.OK)
    status = opened.resp.status
    data = opened.head or b""
    if 200 <= status < 300:
        e2e = _now() - ctx.t0
        s.metrics.e2e.observe(e2e)
        s.metrics.judge(opened.inst.url, e2e, None, None, bodies.completion_tokens(data))
    return (web.Response(body=data, status=status,
                         headers=out_headers(ctx, opened, opened.pre.header)),
            "ok" if status < 400 else "error")


async def relay_stream(s: Serving, request: web.Request, ctx: RequestCtx,
                       opened: Opened) -> tuple[web.StreamResponse, str]:
    """Pass decode's stream to the client, timing it on the way; a decode that fails mid-way
    hands the rest of the answer to another one (migrate.py) up to ``retry.migrations``
    times. Only ``decode_total_s`` bounds a leg (a stream may take as long as generation),
    and ``decode_idle_s`` the silence between chunks."""
    out = _stream_response(request, out_headers(ctx, opened, opened.pre.header),
                           opened.resp.status)
    first = _now()
    s.metrics.decode_first_token.observe(first - opened.sent_at)
    event(opened.leg.span, "first_token")
    tap = (Tap(ctx.body.chat, strip=not wants_token_ids(ctx.body.fields))
           if migratable(s, ctx.body) else None)
    return await _relay(s, request, ctx, out, opened, tap, ctx.body, [0, first], False)


async def relay_led(s: Serving, request: web.Request, ctx: RequestCtx,
                    led: Led) -> tuple[web.StreamResponse, str]:
    """A stream whose first token prefill gave (first_token.py): that token to the client at
    once, then the decode leg that continues it, relayed as ``relay_stream`` does. A decode
    leg that cannot be opened (every retry failed) ends the stream with an error event."""
    out = _stream_response(request, {"Content-Type": "text/event-stream; charset=utf-8",
                                     "X-Request-Id": ctx.rid,
                                     "X-Kvdisagg-Handoff": led.pre.header}, 200)
    await out.prepare(request)
    await out.write(led.events)
    first = _now()
    event(ctx.root, "first_token_from_prefill")
    if led.body is None:  # prefill's token ended the answer
        await out.write_eof()
        e2e = first - ctx.t0
        s.metrics.e2e.observe(e2e)
        s.metrics.ttft.observe(e2e)
        s.metrics.judge(led.decode.instance.url if isinstance(led.decode.instance, Instance)
                        else "", e2e, e2e, None, None)
        return out, "ok"
    opened = await open_decode(s, ctx.with_body(led.body), led.pre, led.decode, led.avoid)
    if isinstance(opened, web.Response) or not 200 <= opened.resp.status < 300:
        if isinstance(opened, Opened):  # an error status: its body says why
            opened.leg.close(Outcome.OK)
            status = opened.resp.status
            why = (opened.head or b"")[:300].decode("utf-8", "replace")
        else:
            status, why = opened.status, (opened.text or "")[:300]
        await out.write(error_event(status, f"decode failed after the first token: {why}"))
        await out.write_eof()
        return out, "error"
    s.metrics.decode_first_token.observe(_now() - opened.sent_at)
    event(opened.leg.span, "first_token")
    tap = Tap(ctx.body.chat, led.tap.strip, resumed=led.tap)
    stats = [led.events.count(b"data:"), first]
    return await _relay(s, request, ctx, out, opened, tap, led.body, stats, True)


def _stream_response(request: web.Request, headers: dict[str, str], status: int
                     ) -> web.StreamResponse:
    out = HeadersWithFirstChunk(status=status, headers=headers)
    out.headers["Cache-Control"] = "no-cache"
    if request.version >= (1, 1):
        out.enable_chunked_encoding()
    return out


async def _relay(s: Serving, request: web.Request, ctx: RequestCtx, out: web.StreamResponse,
                 opened: Opened, tap: Tap | None, body: bodies.ClientBody, stats: list[Any],
                 prepared: bool) -> tuple[web.StreamResponse, str]:
    """``opened``'s stream to the client (``out``, headers sent when ``prepared``), with
    migrations; ``stats``: SSE events the client got so far and when the first came."""
    m = s.metrics
    first = stats[1]
    chunked = request.version >= (1, 1)
    outcome, result = "error", Outcome.BROKEN
    leg, moves = opened, 0
    decode_events, decode_first = stats  # decode's first event: its count and time, below
    try:
        head = await _first_events(leg, tap, s.cfg.timeouts.decode_idle_s)
        if not prepared:
            await out.prepare(request)
        if head:
            stats[0] += head.count(b"data:")
            if prepared:
                stats[1] = _now()
            await out.write(head)  # with the headers, through aiohttp's writer
            event(leg.leg.span, "first_byte")
        decode_events, decode_first = stats
        while True:
            try:
                await _pipe(s, request, leg, tap, chunked, stats)
                if tap is not None and tap.failure is not None:
                    raise UpstreamError(f"its engine ended the stream: {tap.failure}")
                outcome, result = "ok", Outcome.OK
                break
            except UpstreamError as exc:
                leg.leg.fail(kind_of(exc), outcome_of(exc))
                log.warning("request %s: decode %s failed mid-stream: %s", ctx.rid,
                            leg.inst.url, exc)
                if tap is not None and tap.finished:
                    # The answer was whole (its finish_reason delivered): only its usage
                    # event and [DONE] are missing. A continuation would generate past it.
                    await out.write(ending(tap, include_usage(ctx.body.fields)))
                    s.metrics.migration("finished")
                    outcome, result = "ok", Outcome.OK
                    break
                moved = await _migrate(s, ctx, leg, tap, body, moves)
                if not isinstance(moved, tuple):
                    await out.write(error_event(504 if isinstance(exc, UpstreamTimeout)
                                                else 502, f"decode {leg.inst.url} failed "
                                                f"mid-stream: {exc}{moved}"))
                    break
                leg, tap, body = moved
                moves += 1
                if (more := await _first_events(leg, tap, s.cfg.timeouts.decode_idle_s)):
                    await out.write(more)
        await out.write_eof()
    except (asyncio.CancelledError, ConnectionResetError):
        result, outcome = Outcome.CANCELLED, "cancelled"
        leg.resp.close()
        raise
    finally:
        leg.leg.close(result, outcome)
    events, last = stats
    if result is Outcome.OK:
        e2e = _now() - ctx.t0
        m.e2e.observe(e2e)
        ttft = first - ctx.t0
        m.ttft.observe(ttft)
        n_tokens = events - 1  # the final [DONE]
        # Events that arrived together (one read) count as delivered at once: TPOT 0.
        tpot = (last - first) / (n_tokens - 1) if n_tokens >= 2 else None
        if tpot is not None:
            m.tpot.observe(tpot)
        # Decode's own pace (what the decision predicts TPOT from): after a first token from
        # prefill the handoff lies before decode's first event, not between its tokens.
        paced = events - decode_events - 1  # decode's later events, [DONE] aside
        pace = tpot if not prepared else (
            (last - decode_first) / paced if paced >= 1 else None)
        if pace is not None:
            leg.inst.observe_tpot(pace)
        m.judge(leg.inst.url, e2e, ttft, tpot, None)
    return out, outcome


async def _first_events(leg: Opened, tap: Tap | None, idle_s: float) -> bytes:
    """The leg's first chunk as the client gets it: whole events (more is read if the first
    chunk holds only part of one)."""
    head = leg.head or b""
    if tap is None:
        return head
    out = tap.feed(head)
    while not out and leg.head is not None:
        chunk = await leg.resp.next_chunk(idle_s)
        if chunk is None:
            break
        out = tap.feed(chunk)
    return out


async def _pipe(s: Serving, request: web.Request, leg: Opened, tap: Tap | None,
                chunked: bool, stats: list[Any]) -> None:
    """The rest of ``leg``'s stream, from the upstream's data callback straight to the
    client's transport (no task switch per event); raises UpstreamError if the leg fails."""
    if leg.head is None:
        return  # the stream ended with its first chunk
    t = s.cfg.timeouts
    transport = request.transport
    if transport is None:
        raise ConnectionResetError("client went away")

    def sink(data: bytes) -> bool:
        """Runs in the upstream's data_received: write through, no task switch."""
        if tap is not None and not (data := tap.feed(data)):
            return False
        n = data.count(b"data:")
        if n:
            stats[0] += n
            if n > 1 or not data.startswith(b"data: [DONE]"):
                stats[1] = _now()  # a lone [DONE] carries no token
        if transport.is_closing():
            return True  # the relay's drain() then raises
        if chunked:  # the framing aiohttp's writer would add, in one write
            transport.write(b"%x\r\n%b\r\n" % (len(data), data))
        else:
            transport.write(data)
        return transport.get_write_buffer_size() > _CLIENT_HIGH_WATER

    # request.writer.drain() waits until the client's transport drains
    await leg.resp.relay(sink, request.writer.drain, t.decode_idle_s,
                         max(0.001, leg.sent_at + t.decode_total_s - _now()))


async def _migrate(s: Serving, ctx: RequestCtx, leg: Opened, tap: Tap | None,
                   body: bodies.ClientBody, moves: int
                   ) -> tuple[Opened, Tap, bodies.ClientBody] | str:
    """The continuation of a broken stream on another decode, or why there is none (a
    suffix for the client's error message)."""
    if tap is None:
        return ""
    if moves >= s.cfg.retry.migrations:
        s.metrics.migration("exhausted")
        return f" (after {moves} migrations)"
    nxt = continuation(body, tap, s.cfg.policy.prefix_block_chars)
    if nxt is None:
        s.metrics.migration("impossible")
        return ""
    opened = await s.open(ctx.with_body(nxt), avoid=(leg.inst,))
    if not isinstance(opened, Opened) or not 200 <= opened.resp.status < 300:
        if isinstance(opened, Opened):
            opened.leg.close(Outcome.OK)
        s.metrics.migration("failed")
        return "; migrating it failed too"
    s.metrics.migration("ok")
    event(ctx.root, "migrated")
    log.warning("request %s: migrated after %d tokens from %s to %s", ctx.rid, len(tap.ids),
                leg.inst.url, opened.inst.url)
    return opened, Tap(ctx.body.chat, tap.strip, resumed=tap), nxt


