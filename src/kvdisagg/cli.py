"""``kvdisagg``: one subcommand per capability, each defined in its own module.

A command module exposes ``HELP``, ``add_arguments(parser)`` and ``run(args) -> int`` and keeps
its heavy imports inside ``run`` so that ``kvdisagg --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS: dict[str, str] = {
    "proxy": "kvdisagg.proxy.cli",
    "admin": "kvdisagg.proxy.admin_cli",
    "demo": "kvdisagg.demo",
    "tiny-model": "kvdisagg.testing.tiny_model",
    "bench": "kvdisagg.bench.cli",
    "profile": "kvdisagg.bench.profile_cli",
    "plan": "kvdisagg.planner.plan_cli",
    "simulate": "kvdisagg.planner.simulate_cli",
    "doctor": "kvdisagg.doctor",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvdisagg", description="Prefill/decode disaggregated serving for vLLM."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for name, module_path in COMMANDS.items():
        module = importlib.import_module(module_path)
        modules[name] = module
        module.add_arguments(sub.add_parser(name, help=module.HELP, description=module.HELP))
    args = parser.parse_args(argv)
    return modules[args.command].run(args) or 0


if __name__ == "__main__":
    sys.exit(main())
