"""``kvdisagg proxy``: command-line entry of the handoff proxy."""

from __future__ import annotations

import argparse

HELP = "OpenAI-compatible P/D handoff proxy in front of vLLM fleets"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--timeout", type=float, default=60.0,
                   help="bound on each upstream call, seconds (default 60)")


def run(args: argparse.Namespace) -> int:
    from kvdisagg.proxy.app import run_proxy

    run_proxy(args.prefill, args.decode, args.host, args.port, args.timeout)
    return 0
