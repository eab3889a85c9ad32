"""``kvdisagg``: proxy | demo | tiny-model."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvdisagg", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("proxy", help="OpenAI-compatible P/D handoff proxy")
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--timeout", type=float, default=60.0,
                   help="bound on each upstream call, seconds (default 60)")

    d = sub.add_parser("demo", help="P/D serving on a generated tiny model, with a report")
    d.add_argument("--requests", type=int, default=8)
    d.add_argument("--log-dir", default="out/demo")

    t = sub.add_parser("tiny-model", help="generate (or find cached) the tiny test model")
    t.add_argument("--seed", type=int, default=0)

    args = parser.parse_args(argv)
    if args.command == "proxy":
        from kvdisagg.proxy.app import run_proxy

        run_proxy(args.prefill, args.decode, args.host, args.port, args.timeout)
    elif args.command == "demo":
        from kvdisagg.demo import run_demo

        return run_demo(args.requests, args.log_dir)
    elif args.command == "tiny-model":
        from kvdisagg.testing.tiny_model import ensure_tiny_model

        print(ensure_tiny_model(seed=args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
