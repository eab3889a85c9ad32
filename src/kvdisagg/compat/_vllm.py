"""vLLM's private scheduler state that SloScheduler uses (vLLM 0.32).

``Scheduler.set_pause_state`` is the public setter, but it logs at INFO on every call; the
scheduler plugin pauses new prompts for single schedule() calls (backpressure), which would
write a log line per engine step. So the plugin sets ``_pause_state`` (what the setter sets)
directly, here and nowhere else.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from vllm.v1.core.sched.interface import PauseState


@contextlib.contextmanager
def paused_new(scheduler: Any) -> Iterator[bool]:
    """vLLM's PAUSED_NEW for the body (requests holding KV run, new ones wait), restored after;
    yields False, changing nothing, when the scheduler is already paused some other way."""
    if scheduler.pause_state != PauseState.UNPAUSED:
        yield False
        return
    scheduler._pause_state = PauseState.PAUSED_NEW
    try:
        yield True
    finally:
        scheduler._pause_state = PauseState.UNPAUSED
