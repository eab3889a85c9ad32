"""``kvdisagg profile``: fit a latency model (the planner's profile file) from a live instance."""

from __future__ import annotations

import argparse

HELP = "measure prefill/decode batch latency of a live vLLM instance and fit a planner profile"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True)


def run(args: argparse.Namespace) -> int:
    raise SystemExit("kvdisagg profile: not built yet")
