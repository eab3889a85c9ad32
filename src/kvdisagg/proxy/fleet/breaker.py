"""Circuit breaker per instance, fed by request outcomes (the passive half of health).

Closed -> Open after ``failure_threshold`` consecutive failures; Open -> HalfOpen after
``open_s``; HalfOpen lets one trial request through, whose outcome closes or reopens it. Every
transition is logged, so an operator can see why an instance stopped getting traffic.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable

log = logging.getLogger("kvdisagg.proxy")


class BreakerState(str, enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    def __init__(self, name: str, failure_threshold: int = 3, open_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.failure_threshold = failure_threshold
        self.open_s = open_s
        self.clock = clock
        self.state = BreakerState.CLOSED
        self.failures = 0
        self.opened_at = 0.0
        self.trial_in_flight = False

    def _to(self, state: BreakerState) -> None:
        if state is not self.state:
            log.warning("circuit breaker %s: %s -> %s", self.name, self.state.value, state.value)
            self.state = state

    def can_execute(self) -> bool:
        """Whether a request may go to this instance now (does not reserve the trial)."""
        if self.state is BreakerState.OPEN and self.clock() - self.opened_at >= self.open_s:
            self._to(BreakerState.HALF_OPEN)
            self.trial_in_flight = False
        if self.state is BreakerState.HALF_OPEN:
            return not self.trial_in_flight
        return self.state is BreakerState.CLOSED

    def on_start(self) -> None:
        if self.state is BreakerState.HALF_OPEN:
            self.trial_in_flight = True

    def on_success(self) -> None:
        self.failures = 0
        self.trial_in_flight = False
        self._to(BreakerState.CLOSED)

    def on_failure(self) -> None:
        self.failures += 1
        self.trial_in_flight = False
        if self.state is BreakerState.HALF_OPEN or self.failures >= self.failure_threshold:
            self.opened_at = self.clock()
            self._to(BreakerState.OPEN)

    def reset(self) -> None:
        """An active probe succeeded after the instance was down: forget old failures."""
        self.failures = 0
        self.trial_in_flight = False
        self._to(BreakerState.CLOSED)
