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
from collections.abc import AsyncIterator, Sequence
from typing import Any

import msgspec
from aiohttp import web

from kvdisagg.errors import UpstreamError, UpstreamTimeout
from kvdisagg.proxy.fleet.registry import Outcome
from kvdisagg.proxy.handoff.decode import Opened
from kvdisagg.proxy.handoff.exchange import Exchange
from kvdisagg.proxy.handoff.legs import FailKind, kind_of, outcome_of
from kvdisagg.proxy.handoff.pipeline import Pipeline
from kvdisagg.proxy.handoff.relay import Served, out_headers
from kvdisagg.proxy.responses import Refusal, error_event
from kvdisagg.proxy.routing import body as bodies

log = logging.getLogger("kvdisagg.proxy")
_now = time.perf_counter
_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode
_USAGE_SUMS = ("prompt_tokens", "completion_tokens", "total_tokens")


class FanOut:
    """A several-prompt exchange: one exchange per prompt, their answers merged into one."""

    __slots__ = ("x", "request", "out", "first_id", "usage_chunks")

    def __init__(self, x: Exchange, request: web.Request) -> None:
        self.x, self.request = x, request
        self.first_id: str | None = None  # the first event's id: the merged stream's
        self.usage_chunks: list[dict[str, Any]] = []  # each prompt's final usage event

    async def serve(self) -> Served:
        x = self.x
        body = x.body
        assert body.prompts is not None
        subs = [x.with_body(bodies.with_prompt(body, p, x.cfg.policy.prefix_block_chars))
                for p in body.prompts]
        tasks = [asyncio.ensure_future(Pipeline(sub).open()) for sub in subs]
        try:
            opened = await _all_opened(tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            raise
        if body.stream:
            return await self._merge_streams(opened)
        return self._merge_bodies(opened)

    def _merge_bodies(self, opened: list[Opened]) -> Served:
        x = self.x
        n = x.body.n
        merged: dict[str, Any] | None = None
        usages = []
        for i, o in enumerate(opened):
            o.leg.close(Outcome.OK)
            try:
                doc = _decode(o.head or b"")
            except msgspec.DecodeError:
                raise Refusal(502, o.head or b"", content_type=None) from None
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
        e2e = _now() - x.t0
        x.metrics.e2e.observe(e2e)
        x.metrics.judge(opened[0].inst.url, e2e, None, None,
                        merged.get("usage", {}).get("completion_tokens"))
        return Served(web.Response(body=_encode(merged), status=200,
                                   headers=out_headers(x.rid, opened[0], _handoffs(opened))),
                      "ok")

    async def _merge_streams(self, opened: list[Opened]) -> Served:
        x = self.x
        out = self.out = web.StreamResponse(
            status=200, headers=out_headers(x.rid, opened[0], _handoffs(opened)))
        out.headers["Cache-Control"] = "no-cache"
        await out.prepare(self.request)
        tasks = [asyncio.ensure_future(self._relay(i, o)) for i, o in enumerate(opened)]
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
        failure = next((task.exception() for task in done if task.exception() is not None),
                       None)
        if isinstance(failure, _StreamFailed):
            await out.write(failure.event)
            await out.write_eof()
            return Served(out, "error")
        if failure is not None:
            raise failure
        if self.usage_chunks:
            final = self.usage_chunks[-1]
            final["usage"] = _sum_usage([u["usage"] for u in self.usage_chunks])
            await out.write(b"data: " + _encode(final) + b"\n\n")
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        e2e = _now() - x.t0
        x.metrics.e2e.observe(e2e)
        x.metrics.judge(opened[0].inst.url, e2e, None, None, None)
        return Served(out, "ok")

    async def _chunks(self, o: Opened) -> AsyncIterator[bytes]:
        t = self.x.cfg.timeouts
        if o.head is not None:
            yield o.head
        deadline = o.sent_at + t.decode_total_s
        async for c in o.resp.iter_chunks(t.decode_idle_s, max(0.001, deadline - _now())):
            yield c

    async def _relay(self, i: int, o: Opened) -> None:
        """Prompt ``i``'s stream into the merged one: one id throughout, its choices
        re-indexed, its usage kept for the sum."""
        x = self.x
        n = x.body.n
        events = _Events()
        try:
            async for chunk in self._chunks(o):
                for payload in events.feed(chunk):
                    if payload == b"[DONE]":
                        continue
                    doc = _decode(payload)
                    if "error" in doc:
                        raise _StreamFailed(b"data: " + payload + b"\n\ndata: [DONE]\n\n")
                    if self.first_id is None:
                        self.first_id = doc.get("id", "")
                    doc["id"] = self.first_id  # one id throughout, as one vLLM request has
                    choices = doc.get("choices")
                    if not choices and isinstance(doc.get("usage"), dict):
                        self.usage_chunks.append(doc)  # summed at the end
                        continue
                    _reindex(choices or [], i, n)
                    await self.out.write(b"data: " + _encode(doc) + b"\n\n")
        except UpstreamError as exc:
            o.leg.fail(kind_of(exc), outcome_of(exc))
            log.warning("request %s: decode %s failed mid-stream: %s", x.rid, o.inst.url, exc)
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


async def _all_opened(tasks: Sequence[asyncio.Future[Opened]]) -> list[Opened]:
    """Every prompt's decode leg; or the first error raised (the others closed)."""
    pending = set(tasks)
    error: Refusal | None = None
    while pending and error is None:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for t in done:
            exc = t.exception()
            if isinstance(exc, Refusal):
                error = error or exc
                continue
            if exc is not None:
                raise exc
            res = t.result()
            if not res.ok:
                error = error or Refusal(res.resp.status, res.head or b"")
    if error is None:
        return [t.result() for t in tasks]
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for t in tasks:
        if t.done() and not t.cancelled() and t.exception() is None:
            o = t.result()
            o.resp.close()
            o.leg.close(Outcome.CANCELLED, "cancelled")
    raise error


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


__all__ = ["FanOut"]
