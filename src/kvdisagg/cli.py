"""``kvdisagg``: one subcommand per capability, each defined in its own module.

A command module exposes ``add_arguments(parser)`` and ``run(args) -> int``; its one-line help
lives here, so ``kvdisagg --help`` imports no command and ``kvdisagg CMD`` imports only CMD's
module (which keeps its heavy imports inside ``run``).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import NamedTuple


class Command(NamedTuple):
    module: str
    help: str


COMMANDS: dict[str, Command] = {
    "proxy": Command(
        "kvdisagg.proxy.cli",
        "OpenAI-compatible P/D proxy and global scheduler in front of vLLM fleets"),
    "admin": Command(
        "kvdisagg.proxy.admin_cli",
        "call the proxy's admin API: list, add, drain, undrain, remove instances"),
    "demo": Command(
        "kvdisagg.demo",
        "P/D serving on a generated tiny model, with a report"),
    "tiny-model": Command(
        "kvdisagg.local.tiny_model",
        "generate (or find cached) the tiny test model and print its path"),
    "bench": Command(
        "kvdisagg.bench.cli",
        "measure TTFT/TPOT, SLO attainment and goodput of OpenAI endpoints under open-loop load"),
    "profile": Command(
        "kvdisagg.bench.profile_cli",
        "measure prefill/decode batch latency of a live vLLM instance and fit a planner profile"),
    "plan": Command(
        "kvdisagg.planner.plan_cli",
        "find the placement (prefill/decode parallelism and counts) with the best goodput per GPU"),
    "simulate": Command(
        "kvdisagg.planner.simulate_cli",
        "simulate one placement: goodput per GPU, or attainment and tightest SLO scale at --rate"),
    "doctor": Command(
        "kvdisagg.doctor",
        "preflight checks: vLLM and the plugin, connector config, transport, side channel, fleet"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="kvdisagg",
                                     description="Prefill/decode disaggregated serving for vLLM.")
    sub = parser.add_subparsers(dest="command", required=True)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, command in COMMANDS.items():
        p = sub.add_parser(name, help=command.help, description=command.help)
        if name == chosen:
            importlib.import_module(command.module).add_arguments(p)
    args = parser.parse_args(argv)
    return importlib.import_module(COMMANDS[args.command].module).run(args) or 0


if __name__ == "__main__":
    sys.exit(main())
