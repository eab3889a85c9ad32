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
(``no_compatible_prefill``), as with no healthy prefill. Which prefill each try goes to, and
when decode serves the request alone instead, the decider says (decide.py); this stage runs
the legs.

``timeouts.prefill_s`` bounds a leg, queueing included: vLLM sends the headers only when the
prefill is done, so no shorter bound would not be a guess.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import NamedTuple

from kvdisagg.connector.protocol.versions import Versions
from kvdisagg.errors import UpstreamError
from kvdisagg.proxy.fleet.registry import Instance, Outcome, handoff_versions
from kvdisagg.proxy.handoff.exchange import Exchange
from kvdisagg.proxy.handoff.legs import (
    RETRYABLE_STATUS,
    FailKind,
    LegFailure,
    LegScope,
    kind_of,
    outcome_of,
    status_outcome,
)
from kvdisagg.proxy.responses import Refusal
from kvdisagg.proxy.routing import body as bodies
from kvdisagg.proxy.routing.decide import Reason
from kvdisagg.proxy.routing.policies import Selection
from kvdisagg.proxy.types import Admission, Side
from kvdisagg.tracing import traceparent_of

log = logging.getLogger("kvdisagg.proxy")
_now = time.perf_counter


class Handoff(NamedTuple):
    """What the decode leg carries: prefill's raw ``kv_transfer_params``, or None when decode
    computes the prompt itself (then ``alone`` says why)."""

    kv: bytes | None
    alone: Reason | None = None
    local_tokens: int = 0
    """Prompt tokens decode computes itself (predicted)."""
    answer: bytes = b""
    """Prefill's whole answer, when its first token may go to the client (first_token.py)."""
    versions: Versions | None = None
    """The protocol versions the prefill of ``kv`` speaks (None: unknown); the decode that
    takes the handoff must speak one of them (decide.py)."""

    @classmethod
    def decode_alone(cls, reason: Reason, local_tokens: int = 0) -> Handoff:
        return cls(None, reason, local_tokens)

    @property
    def header(self) -> str:
        """``X-Kvdisagg-Handoff``: ``pd`` or ``decode_only:<reason>``."""
        if self.kv is not None or self.alone is None:
            return "pd"
        return f"decode_only:{self.alone.value}"


class PrefillFailed(NamedTuple):
    """A prefill leg that failed before the retries began (an early handoff's): the retries
    count it as their first try and go to another instance."""

    instance: Instance
    failure: LegFailure


class PrefillStage:
    """The prefill legs of one exchange, with retries; ``run`` ends with a ``Handoff`` or
    raises ``Refusal``."""

    __slots__ = ("x",)

    def __init__(self, x: Exchange) -> None:
        self.x = x

    async def run(self, first: Selection[Instance] | None = None,
                  failed: PrefillFailed | None = None, lead: bool = False,
                  decode: Instance | None = None) -> Handoff:
        """kv_transfer_params from some prefill instance, or decode alone. ``first``: the
        prefill already chosen for the first try (a policy picks once per try); ``failed``: a
        first try that already failed (``first`` then goes unused); ``lead``: keep prefill's
        answer, with token ids, for its first token (first_token.py); ``decode``: the decode
        chosen (None: any), whose protocol versions the prefill must speak."""
        x = self.x
        cfg, reg, decider = x.cfg, x.registry, x.decider
        tried = [failed.instance] if failed is not None else []
        failures = [failed.failure] if failed is not None else []
        missing_kv = failed is not None and failed.failure.kind is FailKind.MISSING_KV_PARAMS
        for attempt in range(len(tried), cfg.retry.prefill_attempts):
            if (attempt == 0 and first is not None
                    and (first.instance is None
                         or first.instance in reg.candidates(Side.PREFILL))):
                sel = first
            else:
                sel = decider.choose_prefill(x.body.route.with_hits(x.hits), tuple(tried),
                                             decode)
            inst = sel.instance
            if inst is None:
                break
            match decider.admission(sel, attempt == 0):
                case Admission.SHED:
                    raise x.reject(
                        429, "slo_ttft", f"no prefill instance is predicted to meet the TTFT "
                        f"SLO (best {inst.url}: {sel.predicted_s:.3f}s > {cfg.slo.ttft_s}s)",
                        "rate_limit_exceeded")
                case Admission.COLOCATE:
                    return Handoff.decode_alone(Reason.COLOCATE)
            if tried:
                tried[-1].retries[Side.PREFILL] += 1
            res = await self.leg(inst, lead=lead)
            if isinstance(res, Handoff):
                return res
            if res.client_error is not None:
                raise res.client_error
            missing_kv |= res.kind is FailKind.MISSING_KV_PARAMS
            failures.append(res)
            tried.append(inst)
            log.warning("request %s: prefill attempt %d/%d failed: %s", x.rid, attempt + 1,
                        cfg.retry.prefill_attempts, res.message)
        fallback = decider.after_prefill(bool(tried), missing_kv)
        if fallback.decode_alone:
            log.warning("request %s: serving decode-only (%s)", x.rid, fallback.reason.value)
            return Handoff.decode_alone(fallback.reason)
        if not failures:
            what = ("no prefill instance speaks a protocol version the decode instance speaks"
                    if fallback.reason is Reason.NO_COMPATIBLE_PREFILL
                    else "no healthy prefill instance")
            raise x.reject(503, fallback.reason.value, f"{what} (and decode-only fallback is "
                           "off: retry.decode_only_fallback)", retry_after_s=cfg.health.interval_s)
        status = 504 if not missing_kv and all(f.status == 504 for f in failures) else 502
        raise Refusal.error(status, "prefill failed: " + "; ".join(f.message for f in failures),
                            "upstream_error")

    async def leg(self, inst: Instance, early: dict[str, str] | None = None,
                  lead: bool = False) -> Handoff | LegFailure:
        """kv_transfer_params (raw JSON) from one prefill instance, or why not. ``early``: the
        handoff's id and token, decode's leg having gone out already (early.py); ``lead``: keep
        the whole answer, with token ids (first_token.py)."""
        x = self.x
        t = x.cfg.timeouts
        span = x.leg_span("prefill_leg", inst.url)
        pbody = bodies.prefill_body(x.body, traceparent_of(span), early, token_ids=lead)
        start = _now()
        leg = LegScope(inst, Side.PREFILL, x.body.route.prompt_tokens, x.metrics, span)
        try:
            resp = await inst.pool.request(b"POST", x.path, pbody, x.leg_headers(span),
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
                x.metrics.missing_kv_params(inst.url)
                leg.fail(FailKind.MISSING_KV_PARAMS, Outcome.BROKEN)
                return LegFailure(FailKind.MISSING_KV_PARAMS,
                                  f"prefill {inst.url} returned no kv_transfer_params (is it "
                                  "running with a kv_producer KV connector?)", 502)
            elapsed = _now() - start
            inst.observe_prefill(elapsed, x.body.route.prompt_tokens)
            inst.handoff_params = kv  # what an early handoff from it will look like (early.py)
            versions = handoff_versions(kv)
            if versions is not None:  # what it speaks now (it may have been upgraded)
                inst.protocol = versions
            x.metrics.handoff.observe(elapsed)
            leg.close(Outcome.OK)
            return Handoff(kv, answer=data if lead else b"", versions=versions)
        msg = f"prefill {inst.url} returned {status}: {data[:300].decode('utf-8', 'replace')}"
        if 400 <= status < 500 and status not in RETRYABLE_STATUS:
            leg.close(Outcome.OK)  # the instance is fine; the request is not
            return LegFailure(FailKind.STATUS, msg, status, Refusal.relayed(status, data, msg))
        leg.fail(FailKind.STATUS, status_outcome(status))
        return LegFailure(FailKind.STATUS, msg, 502)
