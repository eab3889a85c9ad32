"""``kvdisagg``: one subcommand per capability, each defined in its own module.

A command module exposes ``add_arguments(parser)`` and ``run(args) -> int``; its one-line help
lives here, so ``kvdisagg --help`` imports no command and ``kvdisagg CMD`` imports only CMD's
module (which keeps its heavy imports inside ``run``).

Where the commands live: a command that is one part's front end lives in that part (``proxy``
and ``admin`` in proxy/, ``bench`` and ``profile`` in bench/, ``plan`` and ``simulate`` in
planner/, ``tiny-model`` in local/). The commands that serve no one part but check or show them
together live here, beside the dispatcher: ``demo.py`` (the local fleet, the proxy and bench's
parsing, end to end), ``doctor.py`` (vLLM, the plugin, the connector's config and transports, a
fleet) and ``gpu_check.py`` (the transports' CUDA data paths). One package for the command
line rather than a ``tools/`` beside this module: they are commands and nothing else, so they
sit with the table that names them. Run it as ``kvdisagg`` or ``python -m kvdisagg.cli``.

Every failure ends as one line on stderr, ``kvdisagg CMD: what went wrong``, and a non-zero exit
(``EXIT``), never a traceback: a ``KvDisaggError`` (its message names the fix), an ``OSError``
(a file, a socket), a package of an extra that is not installed (``EXTRAS``: the line names the
extra), Ctrl-C, or a command's own ``SystemExit("kvdisagg CMD: ...")``. Anything
else is a bug: one line saying so, and the traceback with ``kvdisagg --debug CMD`` (or
``KVDISAGG_DEBUG=1``), which also shows the traceback of an expected error.
"""

from __future__ import annotations

import argparse
import enum
import importlib
import os
import sys
from typing import NamedTuple

DEBUG_ENV = "KVDISAGG_DEBUG"
"""Set (to anything but ``""`` or ``0``): a traceback for every failure, as ``--debug``."""


class Exit(enum.IntEnum):
    """The exit statuses of a failure (a command's own statuses are in its docs)."""

    FAILED = 1  # an error while running (an unreachable endpoint, a failed check)
    USAGE = 2  # bad arguments or config (argparse's own status for a bad flag)
    INTERRUPTED = 130  # Ctrl-C (128 + SIGINT)


class Command(NamedTuple):
    module: str
    help: str


EXTRAS = {"numpy": "planner", "rich": "bench", "matplotlib": "bench"}
"""Packages some commands import that the base install leaves out (the proxy's host does not
need them), and the extra of pyproject.toml that installs each: ``plan``, ``simulate`` and
``profile``'s fit need numpy, ``bench`` and ``profile`` rich, ``bench``'s plots matplotlib."""


COMMANDS: dict[str, Command] = {
    "proxy": Command(
        "kvdisagg.proxy.cli",
        "OpenAI-compatible P/D proxy and global scheduler in front of vLLM fleets"),
    "admin": Command(
        "kvdisagg.proxy.admin_cli",
        "call the proxy's admin API: list, add, drain, undrain, remove instances"),
    "demo": Command(
        "kvdisagg.cli.demo",
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
        "kvdisagg.cli.doctor",
        "preflight checks: vLLM and the plugin, connector config, transport, side channel, fleet"),
    "gpu-check": Command(
        "kvdisagg.cli.gpu_check",
        "check the CUDA data paths of a pull (tcp staging, nccl gather/scatter and sync) on "
        "one GPU"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="kvdisagg",
                                     description="Prefill/decode disaggregated serving for vLLM.")
    parser.add_argument("--debug", action="store_true",
                        help=f"show the traceback of a failure (also {DEBUG_ENV}=1)")
    sub = parser.add_subparsers(dest="command", required=True)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, command in COMMANDS.items():
        p = sub.add_parser(name, help=command.help, description=command.help)
        if name == chosen:
            importlib.import_module(command.module).add_arguments(p)
    args = parser.parse_args(argv)
    debug = args.debug or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    try:
        return importlib.import_module(COMMANDS[args.command].module).run(args) or 0
    except Exception as exc:
        if debug:
            raise
        return _failed(args.command, exc)
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"kvdisagg {args.command}: interrupted", file=sys.stderr)
        return Exit.INTERRUPTED


def _failed(command: str, exc: Exception) -> int:
    """One line on stderr for a failure of ``command``, and its exit status."""
    from kvdisagg.errors import ConfigError, KvDisaggError

    if isinstance(exc, BrokenPipeError):  # the reader went away (``kvdisagg plan | head``)
        # Nothing left to say there: point stdout at /dev/null so the flush at exit is quiet.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return Exit.FAILED
    name = exc.name if isinstance(exc, ModuleNotFoundError) else None
    missing = (name or "").partition(".")[0]
    if missing in EXTRAS:
        message = f"{missing} is not installed: pip install 'kvdisagg[{EXTRAS[missing]}]'"
        status = Exit.FAILED
    elif isinstance(exc, KvDisaggError | OSError):
        message = str(exc) or type(exc).__name__
        status = Exit.USAGE if isinstance(exc, ConfigError) else Exit.FAILED
    else:
        message = (f"unexpected error, a bug ({type(exc).__name__}: {exc}); "
                   f"`kvdisagg --debug {command} ...` shows its traceback")
        status = Exit.FAILED
    print(f"kvdisagg {command}: {message}", file=sys.stderr)
    return status

