"""Where a run's time goes, per test module (set-up, calls and teardown together: a module's
fleet start-up is in its first test's set-up). Printed at the end of every run, after pytest's
``--durations``; docs/testing.md keeps the table of a full run."""

from __future__ import annotations

from collections import defaultdict

import pytest

_SECONDS: dict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _SECONDS[report.nodeid.split("::", 1)[0]] += report.duration


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _SECONDS:
        return
    total = sum(_SECONDS.values())
    terminalreporter.section("time per test module")
    for module, seconds in sorted(_SECONDS.items(), key=lambda kv: -kv[1]):
        if seconds >= 1.0:
            terminalreporter.write_line(f"{seconds:8.1f}s  {module}")
    terminalreporter.write_line(f"{total:8.1f}s  in all ({len(_SECONDS)} modules)")
