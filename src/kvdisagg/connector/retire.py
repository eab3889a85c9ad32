"""Graceful retirement: what an instance does between SIGTERM and its exit (scheduler side, in
vLLM's EngineCore process).

vLLM 0.32 on SIGTERM with ``--shutdown-timeout T`` (T > 0): the API server stops its engine
client; EngineCore rejects every new request (the client sees it aborted) and keeps stepping
while it has work; the API server kills it after T seconds. With T = 0 (vLLM's default) it
aborts everything and is killed at once: nothing can drain.

What counts as work is vLLM's: running requests (a decode's streams finish), and requests that
finished but still hold their paged blocks for a handoff (a prefill's unstaged handoffs stay
until pulled or expired). A *staged* handoff (copied into the worker's arena, its paged blocks
freed) is invisible to vLLM, so while retiring the connector reports it as pending push work
(``has_pending_push_work``), which keeps the engine stepping until every worker freed it:
pulled, released by its decode, or expired. The wait is bounded: ``lease_seconds +
transfer_timeout_seconds`` after the last handoff offered (an unread lease runs out by then,
and a pull started before it ends within the transfer timeout); a decode that keeps renewing a
handoff past that bound loses it (its load fails and ``kv_load_failure_policy`` applies).

``Retirement`` chains a handler in front of vLLM's SIGTERM handler; while retiring the
instance exports ``vllm:kvdisagg_retiring`` 1, which the proxy reads as "draining": no new
prompts or streams go there, legs in flight finish.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


class Retirement:
    """Whether this instance is retiring, and until when it waits for its staged handoffs."""

    def __init__(self, hold_s: float, shutdown_timeout_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.hold_s = hold_s  # how long an offered handoff may still be read (0: offers none)
        self.shutdown_timeout_s = shutdown_timeout_s  # vLLM's --shutdown-timeout
        self._clock = clock
        self.since: float | None = None
        self._last_offer = 0.0
        self.announced = False  # the gauge went out in the stats
        self.gave_up = False  # the hold bound passed with handoffs unread

    @property
    def retiring(self) -> bool:
        return self.since is not None

    def begin(self) -> None:
        if self.since is not None:
            return
        self.since = self._clock()
        if not self.hold_s:  # holds no handoffs (decode)
            logger.warning("kvdisagg: retiring: no new requests; running ones go on for vLLM's "
                           "--shutdown-timeout (%ds)", self.shutdown_timeout_s)
            return
        cut = (f", but vLLM's --shutdown-timeout {self.shutdown_timeout_s:.0f}s cuts it short"
               if self.shutdown_timeout_s < self.hold_s else "")
        logger.warning(
            "kvdisagg: retiring: the engine keeps stepping until the handoffs it holds are "
            "pulled or expire (at most %.0fs after the last one offered)%s", self.hold_s, cut)

    def offered(self) -> None:
        self._last_offer = self._clock()

    def holds(self, staged: int) -> bool:
        """Keep the engine stepping for ``staged`` handoffs still held?"""
        if self.since is None or not staged or self.gave_up:
            return False
        if self._clock() < max(self.since, self._last_offer) + self.hold_s:
            return True
        logger.warning("kvdisagg: retiring: giving up %d handoff(s) not pulled within %.0fs",
                       staged, self.hold_s)
        self.gave_up = True  # for good: the engine exits
        return False

    def arm(self) -> bool:
        """Chain in front of the process's SIGTERM handler (vLLM's EngineCore installs it before
        it builds the scheduler); True if armed. Only from the main thread, and only where a
        Python handler is installed (not in a test, nor in an engine that dies on SIGTERM)."""
        if threading.current_thread() is not threading.main_thread():
            return False
        prev = signal.getsignal(signal.SIGTERM)
        if not callable(prev):
            return False
        signal.signal(signal.SIGTERM, self._chain(prev))
        if self.shutdown_timeout_s < self.hold_s:
            logger.warning(
                "kvdisagg: vLLM's --shutdown-timeout is %ds: on SIGTERM the engine is killed "
                "before the handoffs it holds can be pulled (they may need %.0fs); set "
                "--shutdown-timeout to at least that (docs/operations.md, Retirement)",
                self.shutdown_timeout_s, self.hold_s)
        return True

    def _chain(self, prev: Callable[[int, Any], Any]) -> Callable[[int, Any], Any]:
        def handler(signum: int, frame: Any) -> Any:
            self.begin()
            return prev(signum, frame)
        return handler
