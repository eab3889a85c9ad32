"""Upstream legs: how one ended, as types, and the bookkeeping every leg owes.

A leg is one HTTP request to one instance, prefill or decode. However it ends, four things are
owed exactly once: the instance's in-flight count and breaker (``Outcome``), the error counter
(``FailKind``), and the leg's span. ``LegScope`` owns them, so the stages that run legs only
say what happened.
"""

from __future__ import annotations

import enum
from typing import Any, NamedTuple

from kvdisagg.errors import Abandoned, ConnectError, UpstreamError, UpstreamTimeout
from kvdisagg.proxy.fleet.registry import Instance, Outcome
from kvdisagg.proxy.metrics import Metrics
from kvdisagg.proxy.responses import Refusal
from kvdisagg.proxy.types import Side
from kvdisagg.tracing import end

RETRYABLE_STATUS = frozenset((408, 429))


class FailKind(str, enum.Enum):
    """Why a leg failed; the ``kind`` label of ``kvdisagg_proxy_instance_errors_total``."""

    CONNECT = "connect"  # no connection: the instance never saw the request
    TIMEOUT = "timeout"  # a bound ran out (load, not breakage)
    UNHEALTHY = "unhealthy"  # abandoned: the instance's probes say it is gone
    STREAM = "stream"  # the connection broke while the answer came
    STATUS = "status"  # an error status
    ERROR_EVENT = "error_event"  # a stream whose first event is an error (a failed KV load)
    MISSING_KV_PARAMS = "missing_kv_params"  # prefill answered without kv_transfer_params
    ABORTED = "aborted"  # vLLM aborted the request unanswered (an instance shutting down)


class LegFailure(NamedTuple):
    """Why a leg failed; ``client_error`` goes back to the client unchanged (a 4xx)."""

    kind: FailKind
    message: str
    status: int  # what the client gets if this is the last word
    client_error: Refusal | None = None
    sent: bool = True  # the upstream may have seen the request

    @classmethod
    def of(cls, exc: UpstreamError, message: str) -> LegFailure:
        return cls(kind_of(exc), message, 504 if isinstance(exc, UpstreamTimeout) else 502,
                   sent=exc.sent)


def kind_of(exc: UpstreamError) -> FailKind:
    if isinstance(exc, ConnectError):
        return FailKind.CONNECT
    if isinstance(exc, UpstreamTimeout):
        return FailKind.TIMEOUT
    if isinstance(exc, Abandoned):
        return FailKind.UNHEALTHY
    return FailKind.STREAM


def outcome_of(exc: UpstreamError) -> Outcome:
    """A timeout is load (the instance may be busy with others' work), not breakage."""
    return Outcome.NEUTRAL if isinstance(exc, UpstreamTimeout) else Outcome.BROKEN


def status_outcome(status: int) -> Outcome:
    return Outcome.NEUTRAL if status in RETRYABLE_STATUS else Outcome.BROKEN


class LegScope:
    """One leg's bookkeeping from start to ``close`` (idempotent): the instance's in-flight
    legs and tokens, its breaker, the error counter and the span; for a decode leg that
    computes its prompt itself (``local_tokens``), the instance's local prefills until
    ``prompt_computed`` (its first byte) or the end."""

    __slots__ = ("inst", "side", "tokens", "metrics", "span", "closed", "local_tokens")

    def __init__(self, inst: Instance, side: Side, tokens: int, metrics: Metrics,
                 span: Any = None, local_tokens: int | None = None) -> None:
        self.inst, self.side, self.tokens = inst, side, tokens
        self.metrics, self.span = metrics, span
        self.closed = False
        inst.start(side, tokens)
        self.local_tokens = local_tokens
        if local_tokens is not None:
            inst.local_prefills += 1
            inst.local_prefill_tokens += local_tokens

    def prompt_computed(self) -> None:
        """The leg's prompt is no longer being computed (idempotent)."""
        if self.local_tokens is not None:
            self.inst.local_prefills -= 1
            self.inst.local_prefill_tokens -= self.local_tokens
            self.local_tokens = None

    def fail(self, kind: FailKind, outcome: Outcome) -> None:
        """Count the failure and end the leg."""
        self.metrics.leg_error(self.inst.url, self.side, kind.value)
        self.close(outcome, kind.value)

    def close(self, outcome: Outcome, span_outcome: str | None = None) -> None:
        if self.closed:
            return
        self.closed = True
        self.prompt_computed()
        self.inst.finish(self.side, self.tokens, outcome)
        if self.span is not None:  # (untraced: no label to make)
            end(self.span, outcome=span_outcome or outcome.name.lower())
