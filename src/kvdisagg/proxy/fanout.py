"""A completions request with several prompts: one request (one handoff) per prompt, merged.

vLLM answers ``prompt: [p0, p1, ...]`` as one response whose choices run prompt by prompt
(choice ``index`` = prompt index * n + sample index) and whose usage sums the prompts (its
``prompt_tokens_details`` is the last prompt's). A handoff carries one prompt's KV, and decode
takes one ``kv_transfer_params`` per request, so the proxy serves each prompt as a request of
its own (decided, prefilled and decoded on its own) and merges the answers into the one vLLM
would have given: non-streamed, one body; streamed, the events interleaved as they come, each
choice re-indexed, one id throughout, one summed usage chunk at the end (when asked for) and
one ``[DONE]``. If any prompt's request fails before the client saw a byte, the client gets
that failure (a 4xx as vLLM would give it) and the other requests are abandoned.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from kvdisagg.errors import UpstreamError, UpstreamTimeout
from kvdisagg.proxy import body as bodies
from kvdisagg.proxy.decode import Opened, out_headers
from kvdisagg.proxy.legs import FailKind, kind_of, outcome_of
from kvdisagg.proxy.registry import Outcome
from kvdisagg.proxy.responses import error_event

if TYPE_CHECKING:
    from kvdisagg.proxy.serving import RequestCtx, Serving

log = logging.getLogger("kvdisagg.proxy")
_now = time.perf_counter
_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode
_USAGE_SUMS = ("prompt_tokens", "completion_tokens", "total_tokens")


async def serve_prompts(s: Serving, request: web.Request,
                        ctx: RequestCtx) -> tuple[web.StreamResponse, str]:
    body = ctx.body
    assert body.prompts is not None
    subs = [ctx.with_body(bodies.with_prompt(body, p, s.cfg.policy.prefix_block_chars))
            for p in body.prompts]
    tasks = [asyncio.ensure_future(s.open(sub)) for sub in subs]
    try:
        opened = await _all_opened(tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        raise
    if isinstance(opened, web.Response):
        return opened, ("shed" if opened.status == 429 else "error")
    if body.stream:
        return await _merge_streams(s, request, ctx, opened)
    return _merge_bodies(s, ctx, opened)


async def _all_opened(tasks: Sequence[asyncio.Future[Any]]) -> list[Opened] | web.Response:
    """Every prompt's decode leg, or the first error (the others closed)."""
    pending = set(tasks)
    error: web.Response | None = None
    while pending and error is None:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for t in done:
            res = t.result()
            if isinstance(res, web.Response):
                error = error or res
            elif not 200 <= res.resp.status < 300:
                error = error or web.Response(body=res.head or b"", status=res.resp.status,
                                              content_type="application/json")
    if error is None:
        return [t.result() for t in tasks]
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for t in tasks:
        if t.done() and not t.cancelled() and isinstance(t.result(), Opened):
            o = t.result()
            o.resp.close()
            o.leg.close(Outcome.CANCELLED, "cancelled")
    return error


def _handoffs(opened: list[Opened]) -> str:
    return ",".join(o.pre.header for o in opened)


def _reindex(choices: list[Any], prompt: int, n: int) -> None:
    for c in choices:
        if isinstance(c, dict) and isinstance(c.get("index"), int):
            c["index"] += prompt * n


def _sum_usage(usages: list[dict[str, Any]]) -> dict[str, Any]:
    out = dict(usages[-1])  # prompt_tokens_details: the last prompt's, as vLLM reports it
    for k in _USAGE_SUMS:
        if all(isinstance(u.get(k), int) for u in usages):
            out[k] = sum(u[k] for u in usages)
    return out


def _merge_bodies(s: Serving, ctx: RequestCtx,
                  opened: list[Opened]) -> tuple[web.Response, str]:
    n = ctx.body.n
    merged: dict[str, Any] | None = None
    usages = []
    for i, o in enumerate(opened):
        o.leg.close(Outcome.OK)
        try:
            doc = _decode(o.head or b"")
        except msgspec.DecodeError:
            return web.Response(status=502, body=o.head or b""), "error"
        _reindex(doc.get("choices") or [], i, n)
        if isinstance(doc.get("usage"), dict):
            usages.append(doc["usage"])
        if merged is None:
            merged = doc
        else:
            merged["choices"].extend(doc.get("choices") or [])
    assert merged is not None
    if usages:
        merged["usage"] = _sum_usage(usages)
    if "metrics" in merged:
        merged["metrics"] = None  # vLLM gives per-request metrics for one prompt only
    e2e = _now() - ctx.t0
    s.metrics.e2e.observe(e2e)
    s.metrics.judge(opened[0].inst.url, e2e, None, None,
                    merged.get("usage", {}).get("completion_tokens"))
    return (web.Response(body=_encode(merged), status=200,
                         headers=out_headers(ctx, opened[0], _handoffs(opened))), "ok")


class _Events:
    """Splits an SSE byte stream into ``data:`` payloads."""

    def __init__(self) -> None:
        self.buf = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        self.buf += chunk
        *events, self.buf = self.buf.split(b"\n\n")
        return [e[6:] for e in (e.strip() for e in events) if e.startswith(b"data: ")]


class _StreamFailed(Exception):
    """One prompt's stream failed; ``event`` is the error event the client gets."""

    def __init__(self, event: bytes) -> None:
        super().__init__(event)
        self.event = event


async def _merge_streams(s: Serving, request: web.Request, ctx: RequestCtx,
                         opened: list[Opened]) -> tuple[web.StreamResponse, str]:
    t = s.cfg.timeouts
    n = ctx.body.n
    out = web.StreamResponse(status=200, headers=out_headers(ctx, opened[0], _handoffs(opened)))
    out.headers["Cache-Control"] = "no-cache"
    await out.prepare(request)
    first_id: list[str] = []
    usage_chunks: list[dict[str, Any]] = []

    async def chunks(o: Opened) -> Any:
        if o.head is not None:
            yield o.head
        deadline = o.sent_at + t.decode_total_s
        async for c in o.resp.iter_chunks(t.decode_idle_s, max(0.001, deadline - _now())):
            yield c

    async def relay(i: int, o: Opened) -> None:
        events = _Events()
        try:
            async for chunk in chunks(o):
                for payload in events.feed(chunk):
                    if payload == b"[DONE]":
                        continue
                    doc = _decode(payload)
                    if "error" in doc:
                        raise _StreamFailed(b"data: " + payload + b"\n\ndata: [DONE]\n\n")
                    if not first_id:
                        first_id.append(doc.get("id", ""))
                    doc["id"] = first_id[0]  # one id throughout, as one vLLM request has
                    choices = doc.get("choices")
                    if not choices and isinstance(doc.get("usage"), dict):
                        usage_chunks.append(doc)  # each prompt's final usage: summed at the end
                        continue
                    _reindex(choices or [], i, n)
                    await out.write(b"data: " + _encode(doc) + b"\n\n")
        except UpstreamError as exc:
            o.leg.fail(kind_of(exc), outcome_of(exc))
            log.warning("request %s: decode %s failed mid-stream: %s", ctx.rid, o.inst.url, exc)
            raise _StreamFailed(
                error_event(504 if isinstance(exc, UpstreamTimeout) else 502,
                            f"decode {o.inst.url} failed mid-stream: {exc}")) from exc
        except _StreamFailed:
            o.resp.close()
            o.leg.fail(FailKind.ERROR_EVENT, Outcome.BROKEN)
            raise
        except BaseException:  # the client went away, or another prompt's stream failed
            o.resp.close()
            o.leg.close(Outcome.CANCELLED, "cancelled")
            raise
        o.leg.close(Outcome.OK)

    tasks = [asyncio.ensure_future(relay(i, o)) for i, o in enumerate(opened)]
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    failure = next((task.exception() for task in done if task.exception() is not None), None)
    if isinstance(failure, _StreamFailed):
        await out.write(failure.event)
        await out.write_eof()
        return out, "error"
    if failure is not None:
        raise failure
    if usage_chunks:
        final = usage_chunks[-1]
        final["usage"] = _sum_usage([u["usage"] for u in usage_chunks])
        await out.write(b"data: " + _encode(final) + b"\n\n")
    await out.write(b"data: [DONE]\n\n")
    await out.write_eof()
    e2e = _now() - ctx.t0
    s.metrics.e2e.observe(e2e)
    s.metrics.judge(opened[0].inst.url, e2e, None, None, None)
    return out, "ok"


__all__ = ["serve_prompts"]
