"""The decode stage: open a decode leg that answered (with retries); relay.py relays it.

Timeouts bound a dead instance, not a slow generation: decode waits for headers, a non-streamed
body or a stream's first event up to ``timeouts.decode_total_s`` (vLLM sends a non-streamed
answer's headers only when generation is done); health probes are the liveness check in
between (``registry.py`` fails the legs waiting on an instance that turns unhealthy).

Failure rules before the client saw a byte (``DecodeStage.open``): retry on another decode while
``decode_total_s`` (the whole decode phase, retries included) lasts; a refused connection
reuses the handoff (decode never saw it), anything else re-prefills first (the KV may be gone);
a stream whose first event is an error (vLLM's answer to a failed KV load) counts as failing
before the first byte; with no other decode, one that answered (it is alive; its KV source may
have died) gets the retry with a fresh handoff, and a 500 or error event after a handoff does
not open its breaker. Once the client has bytes (relay.py), a decode failure is migrated or
ends the stream with an error event then ``[DONE]``. A client that goes away cancels the
handler, which aborts the upstream connection: vLLM then aborts the request and frees its
blocks.

A handoff goes only to a decode that speaks a side-channel protocol version of its prefill
(``registry.accepts``; the handoff's params say which, ``Handoff.versions``): the decision
chose one already, unless what the proxy knew of an instance's versions was stale (a pod
replaced between probes). Then another decode that does takes it; with none, decode computes
the prompt itself (``no_compatible_decode``) and the handoff expires on prefill a lease later.
Which decode each try goes to is the decider's (``Decider.retry_decode``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import NamedTuple

from kvdisagg.errors import UpstreamError
from kvdisagg.proxy.fleet.registry import Instance, Outcome
from kvdisagg.proxy.fleet.upstream import Response
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
from kvdisagg.proxy.handoff.prefill import Handoff, PrefillStage
from kvdisagg.proxy.responses import Refusal
from kvdisagg.proxy.routing import body as bodies
from kvdisagg.proxy.routing.decide import takes_migration
from kvdisagg.proxy.routing.policies import Selection
from kvdisagg.proxy.types import Admission, Side
from kvdisagg.tracing import traceparent_of

log = logging.getLogger("kvdisagg.proxy")
_now = time.perf_counter  # uvloop's loop.time() has 1 ms resolution: too coarse for TPOT


def first_error(chunk: bytes) -> bytes | None:
    """The error the first event of ``chunk`` carries, if it is one."""
    if not chunk.startswith(b"data: "):
        return None
    end = chunk.find(b"\n\n")
    return bodies.error_of(chunk[6:end if end >= 0 else len(chunk)])


class Opened(NamedTuple):
    """A decode leg that answered and whose answer nobody has seen yet. ``head``: the whole
    body (not streamed, or an error status) or the stream's first chunk (None: it ended at
    once). The leg stays open (``leg``) until the relay closes it."""

    inst: Instance
    resp: Response
    leg: LegScope
    head: bytes | None
    sent_at: float  # when the leg was sent
    pre: Handoff  # the handoff this leg carries (the last one, after re-prefills)

    @property
    def ok(self) -> bool:
        """A 2xx answer (else an error status, its body in ``head``)."""
        return 200 <= self.resp.status < 300


class Failed(NamedTuple):
    """A decode leg that failed before its first byte, and what a retry must do."""

    failure: LegFailure
    answered: bool  # the instance answered over HTTP: alive, may take a retry
    reprefill: bool  # the handoff may be gone: prefill again before retrying


class DecodeStage:
    """The decode legs of one exchange, with retries: ``open`` ends with a leg that answered
    (``Opened``) or raises ``Refusal``."""

    __slots__ = ("x",)

    def __init__(self, x: Exchange) -> None:
        self.x = x

    async def open(self, pre: Handoff, first: Selection[Instance] | None = None,
                   avoid: tuple[Instance, ...] = ()) -> Opened:
        """A decode leg that answered. ``first``: the decode the decision chose (used for the
        first try); ``avoid``: instances to try only when no other is left."""
        x = self.x
        cfg, reg = x.cfg, x.registry
        deadline = _now() + cfg.timeouts.decode_total_s  # the decode phase, retries included
        tried: list[Instance] = []
        answered: list[Instance] = []
        failures: list[LegFailure] = []
        for tries in range(cfg.retry.decode_attempts):
            if deadline - _now() <= 0:
                break
            # The decision's pick, unless it stopped being routable meanwhile (drained,
            # removed, unhealthy while the prefill leg ran).
            if (tries == 0 and first is not None and first.instance is not None
                    and first.instance in reg.candidates(Side.DECODE)):
                sel = first
            else:
                choice = x.decider.retry_decode(x.body.route, tried, answered, avoid,
                                                pre.kv is not None, pre.versions)
                if choice.alone is not None:
                    log.warning("request %s: no decode left speaks protocol %s of the "
                                "handoff's prefill; decode computes the prompt itself",
                                x.rid, pre.versions)
                    pre = Handoff.decode_alone(choice.alone, x.body.route.prompt_tokens)
                sel = choice.selection
            inst = sel.instance
            if inst is None:
                break
            if x.decider.admission(sel, tries == 0) is Admission.SHED:
                raise x.reject(429, "slo_tpot", f"no decode instance is predicted to meet the "
                               f"TPOT SLO (best {inst.url}: {sel.predicted_s:.4f}s > "
                               f"{cfg.slo.tpot_s}s)", "rate_limit_exceeded")
            if tried:
                tried[-1].retries[Side.DECODE] += 1
            res = await self.attempt(inst, pre, deadline)
            if isinstance(res, Opened):
                return res
            failures.append(res.failure)
            tried.append(inst)
            if res.answered:
                answered.append(inst)
            log.warning("request %s: decode attempt %d/%d failed: %s", x.rid, tries + 1,
                        cfg.retry.decode_attempts, res.failure.message)
            if (res.reprefill and pre.kv is not None and tries + 1 < cfg.retry.decode_attempts
                    and deadline > _now()):
                pre = await PrefillStage(x).run()
        if not failures:
            raise x.reject(503, "no_healthy_decode", "no healthy decode instance",
                           retry_after_s=cfg.health.interval_s)
        status = 504 if all(f.status == 504 for f in failures) else 502
        raise Refusal.error(status, "decode failed: " + "; ".join(f.message for f in failures),
                            "upstream_error")

    async def attempt(self, inst: Instance, pre: Handoff, deadline: float) -> Opened | Failed:
        """One decode leg until its first byte (its first event when streamed)."""
        x = self.x
        t = x.cfg.timeouts
        stream = x.body.stream
        span = x.leg_span("decode_leg", inst.url, pre.header)
        dbody = bodies.decode_body(x.body, pre.kv, traceparent_of(span),
                                   token_ids=takes_migration(x.cfg, x.body))
        sent_at = _now()
        # Until its first byte, a streamed decode-only leg is a prompt decode computes
        # (decide.py; a whole answer's first byte comes at its end: counted as a stream
        # throughout).
        local = pre.local_tokens if pre.kv is None and stream else None
        leg = LegScope(inst, Side.DECODE, x.body.route.max_tokens, x.metrics, span, local)
        try:
            # Headers may come only when generation is done (vLLM, not streamed).
            left = deadline - sent_at
            resp = await inst.pool.request(b"POST", x.path, dbody, x.leg_headers(span),
                                           connect_s=min(t.decode_connect_s, left),
                                           headers_s=left)
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
                # vLLM answers 500 to a failed KV load, which may be the prefill's fault:
                # counted, but not held against this decode's breaker.
                neutral = resp.status == 500 and pre.kv is not None
                leg.fail(FailKind.STATUS, Outcome.NEUTRAL if neutral
                         else status_outcome(resp.status))
                return Failed(LegFailure(FailKind.STATUS, f"decode {inst.url} returned "
                                         f"{resp.status}: "
                                         f"{data[:300].decode('utf-8', 'replace')}", 502),
                              True, True)
            ok = 200 <= resp.status < 300
            if not stream or not ok:
                head: bytes | None = await resp.read(max(0.001, deadline - _now()))
            else:
                head = await resp.next_chunk(max(0.001, deadline - _now()))
            if head is not None and ok and bodies.aborted(head):
                # vLLM aborted it unanswered: an engine shutting down (SIGTERM) rejects new
                # requests so, before the probes see the instance retiring.
                resp.close()
                leg.fail(FailKind.ABORTED, Outcome.NEUTRAL)
                return Failed(LegFailure(FailKind.ABORTED, f"decode {inst.url} aborted the "
                                         "request (shutting down?)", 502), True, True)
            if stream and ok and head is not None and (error := first_error(head)) is not None:
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
