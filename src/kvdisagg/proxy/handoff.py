"""One client request: pick instances, run the prefill leg and the decode leg, with failover.

Timeouts bound a dead instance, not a slow generation: decode waits for headers, a non-streamed
body or a stream's first event up to ``timeouts.decode_total_s`` (vLLM sends a non-streamed
answer's headers only when generation is done), and health probes are the liveness check in
between (``registry.py`` fails the legs waiting on an instance that turns unhealthy). Breakers
count refused connections and 5xx, never timeouts (``Outcome``).

Failure rules (each retry bounded by ``retry.*`` and logged):
- prefill 5xx/429, connect error or timeout: retry on another prefill instance; when all tries
  fail or no prefill is healthy, serve decode-only (decode recomputes the prompt) if
  ``retry.decode_only_fallback``, counted in ``kvdisagg_proxy_decode_only_total``;
- prefill 200 without ``kv_transfer_params``: an explicit, counted event
  (``kvdisagg_proxy_missing_kv_transfer_params_total``), retried on another prefill, never
  a silent re-prefill on decode; if every try lacks them the client gets 502;
- prefill or decode 4xx: the client's request is bad; relayed as is, no retry;
- decode failure before the first byte: retry on another decode while ``decode_total_s`` (which
  bounds the decode phase, retries included) lasts; a refused connection reuses
  the handoff (decode never saw it), anything else re-prefills first (the KV may be gone);
  a stream whose first event is an error (vLLM's answer to a failed KV load) counts as failing
  before the first byte, since the client has seen nothing yet; with no other decode, one that
  answered (it is alive; its KV source may have died) gets the retry with a fresh handoff, and
  a 500 or error event after a handoff does not open its breaker;
- decode failure mid-stream: an error event then ``[DONE]`` ends the stream;
- client disconnect: the handler is cancelled and the upstream connection aborted, which
  makes vLLM abort the request and free its blocks;
- turned away before any leg (``max_in_flight`` reached, slo_aware shedding, nothing routable,
  shutting down): 429/503 with ``Retry-After``, counted in ``kvdisagg_proxy_rejected_total``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import re
import time
import uuid
from typing import NamedTuple

from aiohttp import web

from kvdisagg.proxy import body as bodies
from kvdisagg.proxy.config import Admission, ProxyConfig
from kvdisagg.proxy.errors import error_body, error_event, error_response
from kvdisagg.proxy.metrics import Metrics
from kvdisagg.proxy.policies import Policy, Side, Verdict
from kvdisagg.proxy.registry import Instance, Outcome, Registry
from kvdisagg.proxy.upstream import (Abandoned, ConnectError, Response, UpstreamError,
                                     UpstreamTimeout)
from kvdisagg.tracing import Tracer, end, event, traceparent_of, valid_traceparent

log = logging.getLogger("kvdisagg.proxy")

_RID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
_RETRYABLE = frozenset((408, 429))
_CLIENT_HIGH_WATER = 1 << 20  # client write buffer that pauses reading the decode stream
_now = time.perf_counter  # uvloop's loop.time() has 1 ms resolution: too coarse for TPOT
_ERROR_EVENT = b'data: {"error"'  # vLLM's streamed error, e.g. after a failed KV load


class LegFailure(NamedTuple):
    """Why a leg failed; ``client_error`` responses go back to the client unchanged."""

    kind: str  # connect | timeout | unhealthy | status | missing_kv_params | stream | error_event
    message: str
    status: int  # what the client gets if this is the last word
    client_error: web.Response | None = None
    sent: bool = True  # the upstream may have seen the request


class Prefilled(NamedTuple):
    kv: bytes | None  # None: decode-only
    mode: str  # "pd" or "decode_only:<reason>"


def _kind(exc: UpstreamError) -> str:
    if isinstance(exc, ConnectError):
        return "connect"
    if isinstance(exc, UpstreamTimeout):
        return "timeout"
    if isinstance(exc, Abandoned):
        return "unhealthy"
    return "stream"


def _failure(exc: UpstreamError, message: str) -> LegFailure:
    timeout = isinstance(exc, UpstreamTimeout)
    return LegFailure(_kind(exc), message, 504 if timeout else 502, sent=exc.sent)


def _outcome(exc: UpstreamError) -> Outcome:
    """A timeout is load (the instance may be busy with others' work), not breakage."""
    return Outcome.NEUTRAL if isinstance(exc, UpstreamTimeout) else Outcome.BROKEN


def _status_outcome(status: int) -> Outcome:
    return Outcome.NEUTRAL if status in _RETRYABLE else Outcome.BROKEN


class Handoff:
    def __init__(self, cfg: ProxyConfig, registry: Registry, metrics: Metrics,
                 prefill_policy: Policy, decode_policy: Policy,
                 tracer: Tracer = Tracer.disabled()) -> None:
        self.cfg = cfg
        self.tracer = tracer
        self.registry = registry
        self.metrics = metrics
        self.prefill_policy = prefill_policy
        self.decode_policy = decode_policy
        self.idle = asyncio.Event()
        self.idle.set()
        self.shutting_down = False
        # Unique request ids without uuid4 per request: a random per-process prefix + a counter.
        self._rid_prefix = f"kvd-{uuid.uuid4().hex[:12]}-"
        self._rid_seq = itertools.count(1)

    # request headers for both legs
    def _headers(self, request: web.Request, rid: str) -> bytes:
        auth = (f"Bearer {self.cfg.api_key}" if self.cfg.api_key
                else request.headers.get("Authorization"))
        h = f"Content-Type: application/json\r\nX-Request-Id: {rid}\r\n"
        if auth:
            h += f"Authorization: {auth}\r\n"
        return h.encode("latin-1", "replace")

    async def serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        m = self.metrics
        endpoint = "chat" if chat else "completions"
        if self.shutting_down:  # a kept-alive client after the listener closed: go elsewhere
            m.request_done(endpoint, "shed")
            resp = self._reject(503, "shutting_down", "proxy is shutting down")
            resp.headers["Connection"] = "close"
            return resp
        limit = self.cfg.max_in_flight
        if limit and m.in_flight >= limit:
            m.request_done(endpoint, "shed")
            return self._reject(503, "max_in_flight", f"proxy is serving its max_in_flight "
                                f"({limit}) requests; retry shortly")
        t0 = _now()
        m.in_flight += 1
        self.idle.clear()
        outcome = "error"
        # The request's trace: joins the client's (W3C traceparent header) when it sent one.
        root = self.tracer.start("kvdisagg.request", valid_traceparent(
            request.headers.get("traceparent")), server=True,
            attributes={"http.route": request.path}) if self.tracer.enabled else None
        try:
            resp, outcome = await self._serve(request, chat, t0, root)
            return resp
        except asyncio.CancelledError:
            outcome = "client_disconnect"
            raise
        except ConnectionResetError:
            outcome = "client_disconnect"
            raise
        finally:
            end(root, outcome=outcome)
            m.in_flight -= 1
            m.request_done(endpoint, outcome)
            if not m.in_flight:
                self.idle.set()

    def _reject(self, status: int, reason: str, message: str,
                type_: str = "service_unavailable", retry_after_s: float = 1.0) -> web.Response:
        """Turned away before any leg: counted by reason, with a Retry-After to come back."""
        self.metrics.rejected(reason)
        return error_response(status, message, type_,
                              {"Retry-After": str(max(1, math.ceil(retry_after_s)))})

    async def _serve(self, request: web.Request, chat: bool, t0: float,
                     root: object) -> tuple[web.StreamResponse, str]:
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return error_response(413, f"request body over {self.cfg.max_body_bytes} bytes"), "error"
        try:
            body = bodies.parse(raw, chat, self.cfg.policy.prefix_block_chars)
        except bodies.BodyError as exc:
            return error_response(400, str(exc)), "error"
        rid = request.headers.get("X-Request-Id", "")
        if not _RID.fullmatch(rid):
            rid = f"{self._rid_prefix}{next(self._rid_seq):x}"
        headers = self._headers(request, rid)
        path = request.path
        if root is not None:
            root.set_attribute("kvdisagg.request_id", rid)

        pre = await self._prefill(body, path, headers, rid, root)
        if isinstance(pre, web.Response):
            return pre, ("shed" if pre.status == 429 else "error")
        return await self._decode(request, body, path, headers, rid, pre, t0, root)

    # prefill
    async def _prefill(self, body: bodies.ClientBody, path: str, headers: bytes,
                       rid: str, root: object) -> Prefilled | web.Response:
        cfg, reg = self.cfg, self.registry
        tried: list[Instance] = []
        failures: list[LegFailure] = []
        missing_kv = False
        for attempt in range(cfg.retry.prefill_attempts):
            sel = self.prefill_policy.select(body.route, reg.candidates(Side.PREFILL, tuple(tried)),
                                             Side.PREFILL)
            inst = sel.instance
            if inst is None:
                break
            if sel.verdict is Verdict.SLO_MISS and attempt == 0:
                if cfg.slo.admission == Admission.SHED:
                    return self._reject(
                        429, "slo_ttft", f"no prefill instance is predicted to meet the TTFT "
                        f"SLO (best {inst.url}: {sel.predicted_s:.3f}s > {cfg.slo.ttft_s}s)",
                        "rate_limit_exceeded")
                if cfg.slo.admission == Admission.COLOCATE:
                    self.metrics.served_decode_only("colocate")
                    return Prefilled(None, "decode_only:colocate")
            if tried:
                tried[-1].retries[Side.PREFILL] += 1
            res = await self._prefill_leg(inst, path, body, headers, root)
            if isinstance(res, bytes):
                return Prefilled(res, "pd")
            if res.client_error is not None:
                return res.client_error
            self.metrics.leg_error(inst.url, Side.PREFILL, res.kind)
            missing_kv |= res.kind == "missing_kv_params"
            failures.append(res)
            tried.append(inst)
            log.warning("request %s: prefill attempt %d/%d failed: %s", rid, attempt + 1,
                        cfg.retry.prefill_attempts, res.message)
        reason = "prefill_failed" if tried else "no_healthy_prefill"
        if cfg.retry.decode_only_fallback and not missing_kv:
            log.warning("request %s: serving decode-only (%s)", rid, reason)
            self.metrics.served_decode_only(reason)
            return Prefilled(None, f"decode_only:{reason}")
        if not failures:
            return self._reject(503, "no_healthy_prefill", "no healthy prefill instance (and "
                                "decode-only fallback is off: retry.decode_only_fallback)",
                                retry_after_s=cfg.health.interval_s)
        status = 504 if not missing_kv and all(f.status == 504 for f in failures) else 502
        return error_response(status, "prefill failed: " + "; ".join(f.message for f in failures),
                              "upstream_error")

    async def _prefill_leg(self, inst: Instance, path: str, body: bodies.ClientBody,
                           headers: bytes, root: object) -> bytes | LegFailure:
        """kv_transfer_params (raw JSON) from one prefill instance, or why not.

        ``prefill_s`` bounds the leg, queueing behind other prefills included; headers come
        only when the prefill is done, so there is no shorter bound that is not a guess.
        """
        t = self.cfg.timeouts
        tokens = body.route.prompt_tokens
        leg = None if root is None else self.tracer.start(
            "prefill_leg", traceparent_of(root), attributes={"kvdisagg.instance": inst.url})
        pbody = bodies.prefill_body(body, traceparent_of(leg))
        headers = _traced(headers, leg)
        start = _now()
        inst.start(Side.PREFILL, tokens)
        outcome = Outcome.BROKEN
        try:
            resp = await inst.pool.request(b"POST", path, pbody, headers,
                                           connect_s=min(t.decode_connect_s, t.prefill_s),
                                           headers_s=t.prefill_s)
            data = await resp.read(max(0.001, t.prefill_s - (_now() - start)))
            status = resp.status
            if 200 <= status < 300:
                kv = bodies.kv_params_of(data)
                if kv is None:
                    self.metrics.missing_kv_params(inst.url)
                    return LegFailure("missing_kv_params",
                                      f"prefill {inst.url} returned no kv_transfer_params (is it "
                                      "running with a kv_producer KV connector?)", 502)
                outcome = Outcome.OK
                elapsed = _now() - start
                inst.observe_prefill(elapsed, tokens)
                self.metrics.handoff.observe(elapsed)
                return kv
            msg = f"prefill {inst.url} returned {status}: {data[:300].decode('utf-8', 'replace')}"
            if 400 <= status < 500 and status not in _RETRYABLE:
                outcome = Outcome.OK  # the instance is fine; the request is not
                return LegFailure("status", msg, status, _relay_error(status, data, msg))
            outcome = _status_outcome(status)
            return LegFailure("status", msg, 502)
        except UpstreamError as exc:
            outcome = _outcome(exc)
            return _failure(exc, f"prefill {inst.url}: {exc}")
        except asyncio.CancelledError:
            outcome = Outcome.CANCELLED
            raise
        finally:
            inst.finish(Side.PREFILL, tokens, outcome)
            end(leg, outcome=outcome.name.lower())

    # decode
    async def _decode(self, request: web.Request, body: bodies.ClientBody, path: str,
                      headers: bytes, rid: str, pre: Prefilled, t0: float,
                      root: object) -> tuple[web.StreamResponse, str]:
        cfg, reg, m = self.cfg, self.registry, self.metrics
        t = cfg.timeouts
        tokens = body.route.max_tokens
        deadline = _now() + t.decode_total_s  # the decode phase, retries included
        tried: list[Instance] = []
        answered: list[Instance] = []  # failed with an HTTP answer: alive, may take a retry
        failures: list[LegFailure] = []
        for attempt in range(cfg.retry.decode_attempts):
            left = deadline - _now()
            if left <= 0:
                break
            cands = reg.candidates(Side.DECODE, tuple(tried))
            if not cands and answered:
                # No other decode: one that answered with an error (typically a KV load that
                # failed because its prefill died) gets the retry, with a fresh handoff.
                cands = [i for i in reg.candidates(Side.DECODE) if i in answered]
            sel = self.decode_policy.select(body.route, cands, Side.DECODE)
            inst = sel.instance
            if inst is None:
                break
            if (sel.verdict is Verdict.SLO_MISS and attempt == 0
                    and cfg.slo.admission == Admission.SHED):
                return self._reject(
                    429, "slo_tpot", f"no decode instance is predicted to meet the TPOT SLO "
                    f"(best {inst.url}: {sel.predicted_s:.4f}s > {cfg.slo.tpot_s}s)",
                    "rate_limit_exceeded"), "shed"
            if tried:
                tried[-1].retries[Side.DECODE] += 1
            leg = None if root is None else self.tracer.start(
                "decode_leg", traceparent_of(root),
                attributes={"kvdisagg.instance": inst.url, "kvdisagg.mode": pre.mode})
            dbody = bodies.decode_body(body, pre.kv, traceparent_of(leg))
            leg_start = _now()
            inst.start(Side.DECODE, tokens)
            try:
                # Headers may come only when generation is done (vLLM, not streamed).
                resp = await inst.pool.request(b"POST", path, dbody, _traced(headers, leg),
                                               connect_s=min(t.decode_connect_s, left),
                                               headers_s=left)
            except UpstreamError as exc:
                inst.finish(Side.DECODE, tokens, _outcome(exc))
                m.leg_error(inst.url, Side.DECODE, _kind(exc))
                failure = _failure(exc, f"decode {inst.url}: {exc}")
                reprefill = exc.sent  # a refused connection: decode never saw the handoff
            except asyncio.CancelledError:
                inst.finish(Side.DECODE, tokens, Outcome.CANCELLED)
                end(leg, outcome="cancelled")
                raise
            else:
                if resp.status >= 500 or resp.status in _RETRYABLE:
                    try:
                        data = await resp.read(max(0.001, min(t.decode_idle_s,
                                                              deadline - _now())))
                    except UpstreamError:
                        data = b""
                    # vLLM answers 500 to a failed KV load, which may be the prefill's fault:
                    # counted, but not held against this decode's breaker.
                    neutral = resp.status == 500 and pre.kv is not None
                    inst.finish(Side.DECODE, tokens,
                                Outcome.NEUTRAL if neutral else _status_outcome(resp.status))
                    m.leg_error(inst.url, Side.DECODE, "status")
                    failure = LegFailure("status", f"decode {inst.url} returned {resp.status}: "
                                         f"{data[:300].decode('utf-8', 'replace')}", 502)
                else:
                    try:
                        relayed = await self._relay(request, body, resp, inst, rid, pre, t0,
                                                    deadline, leg, leg_start)
                    except BaseException:
                        end(leg, outcome="cancelled")
                        raise
                    if not isinstance(relayed, LegFailure):
                        end(leg, outcome=relayed[1])
                        return relayed
                    failure = relayed  # nothing reached the client yet
                answered.append(inst)
                reprefill = True
            end(leg, outcome=failure.kind)
            failures.append(failure)
            tried.append(inst)
            log.warning("request %s: decode attempt %d/%d failed: %s", rid, attempt + 1,
                        cfg.retry.decode_attempts, failure.message)
            if (reprefill and pre.kv is not None and attempt + 1 < cfg.retry.decode_attempts
                    and deadline > _now()):
                again = await self._prefill(body, path, headers, rid, root)
                if isinstance(again, web.Response):
                    return again, "error"
                pre = again
        if not failures:
            return self._reject(503, "no_healthy_decode", "no healthy decode instance",
                                retry_after_s=cfg.health.interval_s), "error"
        status = 504 if all(f.status == 504 for f in failures) else 502
        return error_response(status, "decode failed: " + "; ".join(f.message for f in failures),
                              "upstream_error"), "error"

    async def _relay(self, request: web.Request, body: bodies.ClientBody, resp: Response,
                     inst: Instance, rid: str, pre: Prefilled, t0: float, deadline: float,
                     span: object, leg_start: float
                     ) -> tuple[web.StreamResponse, str] | LegFailure:
        """Pass decode's answer to the client byte for byte, timing it on the way.

        Until the client has seen a byte, a failure goes back to ``_decode`` (which may retry):
        a non-streamed body that breaks, a stream that breaks before its first event or whose
        first event is an error (vLLM's answer to a failed KV load). The whole body, or a
        stream's first event, may take as long as generation: only ``deadline`` bounds it.
        """
        t, m = self.cfg.timeouts, self.metrics
        tokens = body.route.max_tokens
        ctype = (resp.header(b"content-type") or b"application/json").decode("latin-1")
        out_headers = {"Content-Type": ctype, "X-Request-Id": rid, "X-Kvdisagg-Handoff": pre.mode}
        if not body.stream or not 200 <= resp.status < 300:
            try:
                data = await resp.read(max(0.001, deadline - _now()))
            except UpstreamError as exc:
                inst.finish(Side.DECODE, tokens, _outcome(exc))
                m.leg_error(inst.url, Side.DECODE, _kind(exc))
                return _failure(exc, f"decode {inst.url}: {exc}")
            except asyncio.CancelledError:
                inst.finish(Side.DECODE, tokens, Outcome.CANCELLED)
                raise
            inst.finish(Side.DECODE, tokens, Outcome.OK)
            if 200 <= resp.status < 300:
                e2e = _now() - t0
                m.e2e.observe(e2e)
                m.judge(inst.url, e2e, None, None, bodies.completion_tokens(data))
            return (web.Response(body=data, status=resp.status, headers=out_headers),
                    "ok" if resp.status < 400 else "error")

        try:
            head = await resp.next_chunk(max(0.001, deadline - _now()))
        except UpstreamError as exc:
            inst.finish(Side.DECODE, tokens, _outcome(exc))
            m.leg_error(inst.url, Side.DECODE, _kind(exc))
            return _failure(exc, f"decode {inst.url} failed before the first event: {exc}")
        except asyncio.CancelledError:
            inst.finish(Side.DECODE, tokens, Outcome.CANCELLED)
            raise
        if head is not None and head.startswith(_ERROR_EVENT):
            resp.close()
            # After a handoff the KV source may be at fault (a dead prefill): count the
            # error, but do not open this decode's breaker for it.
            inst.finish(Side.DECODE, tokens,
                        Outcome.BROKEN if pre.kv is None else Outcome.NEUTRAL)
            m.leg_error(inst.url, Side.DECODE, "error_event")
            return LegFailure("error_event", f"decode {inst.url} answered with an error event: "
                              f"{head[6:300].decode('utf-8', 'replace').strip()}", 502)
        out = _Stream(status=resp.status, headers=out_headers)
        out.headers["Cache-Control"] = "no-cache"
        chunked = request.version >= (1, 1)
        if chunked:
            out.enable_chunked_encoding()
        first = _now()
        m.decode_first_token.observe(first - leg_start)
        event(span, "first_token")
        stats = [0, first]  # SSE events seen, time of the last one
        outcome, leg = "error", Outcome.BROKEN
        try:
            await out.prepare(request)
            try:
                if head is not None:
                    stats[0] = head.count(b"data:")
                    await out.write(head)  # with the headers, through aiohttp's writer
                    event(span, "first_byte")
                    transport = request.transport
                    if transport is None:
                        raise ConnectionResetError("client went away")

                    def sink(data: bytes) -> bool:
                        """Runs in the upstream's data_received: write through, no task switch."""
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
                    await resp.relay(sink, request.writer.drain, t.decode_idle_s,
                                     max(0.001, deadline - _now()))
                outcome, leg = "ok", Outcome.OK
            except UpstreamError as exc:
                leg = _outcome(exc)
                m.leg_error(inst.url, Side.DECODE, _kind(exc))
                log.warning("request %s: decode %s failed mid-stream: %s", rid, inst.url, exc)
                await out.write(error_event(504 if isinstance(exc, UpstreamTimeout) else 502,
                                            f"decode {inst.url} failed mid-stream: {exc}"))
            await out.write_eof()
        except (asyncio.CancelledError, ConnectionResetError):
            leg = Outcome.CANCELLED
            resp.close()
            raise
        finally:
            inst.finish(Side.DECODE, tokens, leg)
        events, last = stats
        if leg is Outcome.OK:
            e2e = _now() - t0
            m.e2e.observe(e2e)
            ttft = (first or _now()) - t0
            m.ttft.observe(ttft)
            n_tokens = events - 1  # the final [DONE]
            # Events that arrived together (one read) count as delivered at once: TPOT 0.
            tpot = (last - first) / (n_tokens - 1) if n_tokens >= 2 else None
            if tpot is not None:
                m.tpot.observe(tpot)
                inst.observe_tpot(tpot)
            m.judge(inst.url, e2e, ttft, tpot, None)
        return out, outcome


def _traced(headers: bytes, leg: object) -> bytes:
    """A leg's headers with its W3C ``traceparent``: vLLM's own tracing (``--otlp-traces-
    endpoint``) then nests its request span under the leg."""
    if leg is None:
        return headers
    return headers + b"traceparent: %s\r\n" % traceparent_of(leg).encode()


class _Stream(web.StreamResponse):
    """Headers go out with the first chunk (one write, not two); aiohttp's ``web.Response``
    does the same for whole bodies. The relay only prepares once it holds that chunk."""

    _send_headers_immediately = False


def _relay_error(status: int, data: bytes, message: str) -> web.Response:
    """An upstream 4xx: keep its JSON body if it is OpenAI-style, else wrap the text."""
    if data.startswith(b"{") and b'"error"' in data[:200]:
        return web.Response(body=data, status=status, content_type="application/json")
    return web.Response(body=error_body(status, message, "invalid_request_error"),
                        status=status, content_type="application/json")
