"""The circuit breaker of one instance (proxy/fleet/breaker.py) on a hand-driven clock: only
consecutive failures open it, it stays open for exactly ``open_s``, lets one trial through
half-open, and logs each transition (and only transitions). The basic cycle is also in
test_policies.py."""

from __future__ import annotations

import logging

import pytest

from kvdisagg.proxy.fleet.breaker import BreakerState, CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def breaker(threshold: int = 3, open_s: float = 5.0) -> tuple[CircuitBreaker, Clock]:
    clock = Clock()
    return CircuitBreaker("http://d0:8000", failure_threshold=threshold, open_s=open_s,
                          clock=clock), clock


def test_only_consecutive_failures_open_it() -> None:
    b, _ = breaker(threshold=3)
    for _ in range(5):
        b.on_failure()
        b.on_failure()
        b.on_success()  # a success in between starts the count again
    assert b.state is BreakerState.CLOSED and b.failures == 0 and b.can_execute()
    for _ in range(2):
        b.on_failure()
    assert b.state is BreakerState.CLOSED and b.can_execute()
    b.on_failure()
    assert b.state is BreakerState.OPEN and not b.can_execute()


def test_open_for_exactly_open_s_from_the_failure_that_opened_it() -> None:
    b, clock = breaker(threshold=1, open_s=5.0)
    b.on_failure()
    clock.now += 4.999
    assert not b.can_execute() and b.state is BreakerState.OPEN
    clock.now += 0.001
    assert b.can_execute() and b.state is BreakerState.HALF_OPEN


def test_half_open_lets_one_trial_through_and_can_execute_reserves_nothing() -> None:
    b, clock = breaker(threshold=1)
    b.on_failure()
    clock.now += 5
    assert b.can_execute() and b.can_execute()  # asking twice reserves nothing
    b.on_start()
    assert not b.can_execute()  # the trial is out: no second request
    b.on_success()
    assert b.state is BreakerState.CLOSED and b.can_execute()
    b.on_start()  # closed: starts reserve nothing either
    b.on_start()
    assert b.can_execute() and not b.trial_in_flight


def test_a_failed_trial_reopens_at_once_for_another_open_s() -> None:
    b, clock = breaker(threshold=5, open_s=2.0)
    for _ in range(5):
        b.on_failure()
    clock.now += 2
    assert b.can_execute()
    b.on_start()
    b.on_failure()  # one failure is enough half-open, whatever the threshold
    assert b.state is BreakerState.OPEN
    clock.now += 1.9
    assert not b.can_execute()
    clock.now += 0.1
    assert b.can_execute() and not b.trial_in_flight  # a new trial, not the old one's slot


def test_reset_closes_and_forgets_failures() -> None:
    b, _ = breaker(threshold=2)
    b.on_failure()
    b.on_failure()
    assert b.state is BreakerState.OPEN
    b.reset()  # an active probe succeeded
    assert b.state is BreakerState.CLOSED and b.failures == 0 and b.can_execute()
    b.on_failure()
    assert b.state is BreakerState.CLOSED  # the old failures do not count towards the next


def test_each_transition_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    b, clock = breaker(threshold=1, open_s=1.0)
    with caplog.at_level(logging.WARNING, logger="kvdisagg.proxy"):
        b.on_success()  # closed -> closed: nothing to say
        b.on_failure()
        b.on_failure()  # open -> open: nothing either
        clock.now += 1
        b.can_execute()
        b.can_execute()
        b.on_start()
        b.on_success()
    assert [r.getMessage() for r in caplog.records] == [
        "circuit breaker http://d0:8000: closed -> open",
        "circuit breaker http://d0:8000: open -> half_open",
        "circuit breaker http://d0:8000: half_open -> closed",
    ]
