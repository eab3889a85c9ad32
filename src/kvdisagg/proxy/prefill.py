"""The prefill stage: one prefill leg per try, until one returns ``kv_transfer_params``.

Failure rules (each retry bounded by ``retry.prefill_attempts`` and logged):
- 5xx/408/429, a connect error or a timeout: try another prefill instance; when every try
  failed or no prefill is healthy, decode computes the prompt itself
  (``retry.decode_only_fallback``), counted by reason;
- 200 with ``finish_reason: abort`` (an instance shutting down rejects new requests so): as a
  5xx;
- 200 without ``kv_transfer_params``: an explicit, counted event
  (``kvdisagg_proxy_missing_kv_transfer_params_total``) retried on another prefill, never a
  silent re-prefill on decode; if every try lacks them the client gets 502;
- 4xx: the client's request is bad: relayed as is, no retry.

Only prefills that speak a side-channel protocol version the request's decode speaks are
tried (``registry.pairable``); with none, decode computes the prompt itself
(``no_compatible_prefill``), as with no healthy prefill.

``timeouts.prefill_s`` bounds a leg, queueing included: vLLM sends the headers only when the
prefill is done, so no shorter bound would not be a guess.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, NamedTuple

from aiohttp import web

from kvdisagg.connector.protocol.versions import Versions
from kvdisagg.errors import UpstreamError
from kvdisagg.proxy import body as bodies
from kvdisagg.proxy.legs import (
    RETRYABLE_STATUS,
    FailKind,
    LegFailure,
    LegScope,
    kind_of,
    outcome_of,
    status_outcome,
)
from kvdisagg.proxy.policies import InstanceView, Selection, Verdict
from kvdisagg.proxy.registry import Instance, Outcome, handoff_versions, pairable
from kvdisagg.proxy.responses import error_body, error_response
from kvdisagg.proxy.types import Admission, Side
from kvdisagg.tracing import traceparent_of

if TYPE_CHECKING:
    from kvdisagg.proxy.serving import RequestCtx, Serving

log = logging.getLogger("kvdisagg.proxy")
_now = time.perf_counter


class Prefilled(NamedTuple):
    """What the decode leg carries: prefill's raw ``kv_transfer_params``, or None when decode
    computes the prompt itself (then ``local_reason`` says why)."""

    kv: bytes | None
    local_reason: str = ""
    local_tokens: int = 0
    """Prompt tokens decode computes itself (predicted)."""
    answer: bytes = b""
    """Prefill's whole answer, when its first token may go to the client (first_token.py)."""
    versions: Versions | None = None
    """The protocol versions the prefill of ``kv`` speaks (None: unknown); the decode that
    takes the handoff must speak one of them (decode.py)."""

    @property
    def header(self) -> str:
        """``X-Kvdisagg-Handoff``: ``pd`` or ``decode_only:<reason>``."""
        return "pd" if self.kv is not None else f"decode_only:{self.local_reason}"


class PrefillFailed(NamedTuple):
    """A prefill leg that failed before the retries began (an early handoff's): the retries
    count it as their first try and go to another instance."""

    instance: Instance
    failure: LegFailure


def choose_prefill(s: Serving, ctx: RequestCtx, tried: tuple[Instance, ...] = (),
                   decode: InstanceView | None = None) -> Selection:
    """The prefill holding the longest cached prefix of the prompt (KV events), weighed with
    load; without a prediction, the prefill policy's pick. ``decode``: the decode chosen for the
    request: only prefills it can pull from (a protocol version in common)."""
    cands = s.registry.candidates(Side.PREFILL, tried)
    if isinstance(decode, Instance):
        cands = [p for p in cands if pairable(p, decode)]
    return s.decider.choose(Side.PREFILL, s.prefill_policy, ctx.body.route, cands, ctx.hits)


async def prefill(s: Serving, ctx: RequestCtx, first: Selection | None = None,
                  failed: PrefillFailed | None = None, lead: bool = False,
                  decode: InstanceView | None = None) -> Prefilled | web.Response:
    """kv_transfer_params from some prefill instance, decode-only, or the client's answer.
    ``first``: the prefill already chosen for the first try (a policy picks once per try);
    ``failed``: a first try that already failed (``first`` then goes unused); ``lead``: keep
    prefill's answer, with token ids, for its first token (first_token.py); ``decode``: the
    decode chosen (None: any), whose protocol versions the prefill must speak."""
    cfg, reg = s.cfg, s.registry
    tried = [failed.instance] if failed is not None else []
    failures = [failed.failure] if failed is not None else []
    missing_kv = failed is not None and failed.failure.kind is FailKind.MISSING_KV_PARAMS
    for attempt in range(len(tried), cfg.retry.prefill_attempts):
        if (attempt == 0 and first is not None
                and (first.instance is None or first.instance in reg.candidates(Side.PREFILL))):
            sel = first
        else:
            sel = choose_prefill(s, ctx, tuple(tried), decode)
        inst = sel.instance
        if inst is None:
            break
        assert isinstance(inst, Instance)
        if sel.verdict is Verdict.SLO_MISS and attempt == 0:
            if cfg.slo.admission == Admission.SHED:
                return s.reject(
                    429, "slo_ttft", f"no prefill instance is predicted to meet the TTFT "
                    f"SLO (best {inst.url}: {sel.predicted_s:.3f}s > {cfg.slo.ttft_s}s)",
                    "rate_limit_exceeded")
            if cfg.slo.admission == Admission.COLOCATE:
                return Prefilled(None, "colocate")
        if tried:
            tried[-1].retries[Side.PREFILL] += 1
        res = await prefill_leg(s, ctx, inst, lead=lead)
        if isinstance(res, Prefilled):
            return res
        if res.client_error is not None:
            return res.client_error
        missing_kv |= res.kind is FailKind.MISSING_KV_PARAMS
        failures.append(res)
        tried.append(inst)
        log.warning("request %s: prefill attempt %d/%d failed: %s", ctx.rid, attempt + 1,
                    cfg.retry.prefill_attempts, res.message)
    reason = ("prefill_failed" if tried else
              "no_compatible_prefill" if reg.candidates(Side.PREFILL) else "no_healthy_prefill")
    if cfg.retry.decode_only_fallback and not missing_kv:
        log.warning("request %s: serving decode-only (%s)", ctx.rid, reason)
        return Prefilled(None, reason)
    if not failures:
        what = ("no prefill instance speaks a protocol version the decode instance speaks"
                if reason == "no_compatible_prefill" else "no healthy prefill instance")
        return s.reject(503, reason, f"{what} (and decode-only fallback is off: "
                        "retry.decode_only_fallback)", retry_after_s=cfg.health.interval_s)
    status = 504 if not missing_kv and all(f.status == 504 for f in failures) else 502
    return error_response(status, "prefill failed: " + "; ".join(f.message for f in failures),
                          "upstream_error")


async def prefill_leg(s: Serving, ctx: RequestCtx, inst: Instance,
                      early: dict[str, str] | None = None, lead: bool = False
                      ) -> Prefilled | LegFailure:
    """kv_transfer_params (raw JSON) from one prefill instance, or why not. ``early``: the
    handoff's id and token, decode's leg having gone out already (early.py); ``lead``: keep
    the whole answer, with token ids (first_token.py)."""
    t = s.cfg.timeouts
    span = s.tracer.start("prefill_leg", traceparent_of(ctx.root),
                          attributes={"kvdisagg.instance": inst.url}) if ctx.root else None
    pbody = bodies.prefill_body(ctx.body, traceparent_of(span), early, token_ids=lead)
    start = _now()
    leg = LegScope(inst, Side.PREFILL, ctx.body.route.prompt_tokens, s.metrics, span)
    try:
        resp = await inst.pool.request(b"POST", ctx.path, pbody, ctx.leg_headers(span),
                                       connect_s=min(t.decode_connect_s, t.prefill_s),
                                       headers_s=t.prefill_s)
        data = await resp.read(max(0.001, t.prefill_s - (_now() - start)))
    except UpstreamError as exc:
        leg.fail(kind_of(exc), outcome_of(exc))
        return LegFailure.of(exc, f"prefill {inst.url}: {exc}")
    except asyncio.CancelledError:
        leg.close(Outcome.CANCELLED)
        raise
    status = resp.status
    if 200 <= status < 300:
        kv = bodies.kv_params_of(data)
        if kv is None and bodies.aborted(data):  # retiring (SIGTERM): not a misconfiguration
            leg.fail(FailKind.ABORTED, Outcome.NEUTRAL)
            return LegFailure(FailKind.ABORTED, f"prefill {inst.url} aborted the request "
                              "(shutting down?)", 502)
        if kv is None:
            s.metrics.missing_kv_params(inst.url)
            leg.fail(FailKind.MISSING_KV_PARAMS, Outcome.BROKEN)
            return LegFailure(FailKind.MISSING_KV_PARAMS,
                              f"prefill {inst.url} returned no kv_transfer_params (is it running "
                              "with a kv_producer KV connector?)", 502)
        elapsed = _now() - start
        inst.observe_prefill(elapsed, ctx.body.route.prompt_tokens)
        inst.handoff_params = kv  # what an early handoff from it will look like (early.py)
        versions = handoff_versions(kv)
        if versions is not None:  # what it speaks now (it may have been upgraded)
            inst.protocol = versions
        s.metrics.handoff.observe(elapsed)
        leg.close(Outcome.OK)
        return Prefilled(kv, answer=data if lead else b"", versions=versions)
    msg = f"prefill {inst.url} returned {status}: {data[:300].decode('utf-8', 'replace')}"
    if 400 <= status < 500 and status not in RETRYABLE_STATUS:
        leg.close(Outcome.OK)  # the instance is fine; the request is not
        return LegFailure(FailKind.STATUS, msg, status, relay_error(status, data, msg))
    leg.fail(FailKind.STATUS, status_outcome(status))
    return LegFailure(FailKind.STATUS, msg, 502)


def relay_error(status: int, data: bytes, message: str) -> web.Response:
    """An upstream 4xx: keep its JSON body if it is OpenAI-style, else wrap the text."""
    if data.startswith(b"{") and b'"error"' in data[:200]:
        return web.Response(body=data, status=status, content_type="application/json")
    return web.Response(body=error_body(status, message, "invalid_request_error"),
                        status=status, content_type="application/json")
