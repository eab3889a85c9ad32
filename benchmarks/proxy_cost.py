"""Proxy CPU per request, counted rather than timed: a figure a shared, loaded machine leaves
alone.

benchmarks/proxy.py times the proxy process (utime+stime), which moves by 10-15% between runs
on a busy 2-core box and by ~5-10% with the order of the targets in its interleave. This runs
the same fake backends (``tests.support.fake_vllm``) and the same closed-loop load, one tree
after the other, and counts instead:

- ``--mode callgrind`` (default): the proxy under ``valgrind --tool=callgrind``, instrumented
  only while the measured requests run (``callgrind_control -i on/off``): instructions (Ir) per
  request, repeatable to ~0.5%;
- ``--mode ops``: Python bytecodes and frames (calls and coroutine resumptions) per request
  and per function (``sys.settrace`` with ``f_trace_opcodes``): where a difference comes from.

Each tree is another checkout's ``src`` (``NAME=DIR``), as ``proxy.py --baseline`` runs one::

    PYTHONPATH=$PWD/src .venv/bin/python benchmarks/proxy_cost.py \\
        --trees after=$PWD before=/tmp/wt-before --requests 600 --out out/proxy-cost

Health probes are put off (``--health-interval 600``) so that only requests are counted.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvdisagg.local.servers import stop_processes

sys.path.insert(0, str(Path(__file__).resolve().parent))

OPS: dict[tuple[str, int, str], list[int]] = {}


def _tracer(frame: Any, event: str, arg: Any) -> Any:
    if event != "call":
        return None
    frame.f_trace_opcodes = True
    co = frame.f_code
    ent = OPS.setdefault((co.co_filename, co.co_firstlineno, co.co_name), [0, 0])
    ent[1] += 1

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "opcode":
            ent[0] += 1
        return local

    return local


def wrapped(out: str, argv: list[str]) -> int:
    """``kvdisagg proxy ARGV``; SIGUSR1 starts counting bytecodes, SIGUSR2 writes ``out``."""
    def on1(*_: Any) -> None:
        sys.settrace(_tracer)

    def on2(*_: Any) -> None:
        sys.settrace(None)
        Path(out).write_text(json.dumps([[*k, *v] for k, v in OPS.items()]))

    signal.signal(signal.SIGUSR1, on1)
    signal.signal(signal.SIGUSR2, on2)
    from kvdisagg.cli import main
    return main(["proxy", *argv])


def callgrind_total(path: Path) -> int:
    text = subprocess.run(["callgrind_annotate", str(path)], capture_output=True, text=True,
                          check=True).stdout
    line = next(x for x in text.splitlines() if "PROGRAM TOTALS" in x)
    return int(line.split()[0].replace(",", ""))


def ops_summary(path: Path, n: int, top: int) -> str:
    rows = json.loads(path.read_text())
    ops = sum(r[3] for r in rows) / n
    frames = sum(r[4] for r in rows) / n
    lines = [f"  {ops:.0f} bytecodes, {frames:.1f} frames per request; top functions:"]
    for fn, _, name, o, c in sorted(rows, key=lambda r: -r[3])[:top]:
        lines.append(f"    {o / n:7.1f} ops {c / n:5.2f} frames  {fn.rsplit('/', 2)[-1]}:{name}")
    return "\n".join(lines)


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--wrapped":
        return wrapped(sys.argv[2], sys.argv[3:])
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trees", nargs="+", required=True, metavar="NAME=DIR")
    p.add_argument("--mode", choices=["callgrind", "ops"], default="callgrind")
    p.add_argument("--workload", default="completions",
                   choices=["completions", "completions-stream", "chat-stream"])
    p.add_argument("--short", action="store_true",
                   help="the proxy's default decision (decode alone for this prompt), not "
                   "--always-disaggregate")
    p.add_argument("--requests", type=int, default=600)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--top", type=int, default=25, help="--mode ops: functions listed")
    p.add_argument("--out", default="out/proxy-cost")
    args = p.parse_args()
    import proxy as bench  # benchmarks/proxy.py: its backends, load and target plumbing
    import uvloop

    from kvdisagg.local.servers import free_port
    uvloop.install()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        ports = {r: free_port() for r in ("prefill", "decode")}
        for role, port in ports.items():
            procs.append(bench.spawn([sys.executable, "-m", "tests.support.fake_vllm", "--port",
                                      str(port), "--tokens", "16", "--name", role],
                                     out / f"fake-{role}.log"))
        pre, dec = (f"http://127.0.0.1:{ports[r]}" for r in ("prefill", "decode"))
        for u in (pre, dec):
            bench.wait_http(u + "/health")
        for spec in args.trees:
            name, root = spec.split("=", 1)
            port = free_port()
            env = {**os.environ, "PYTHONPATH": str(Path(root).resolve() / "src")}
            flags = ([] if args.short else ["--always-disaggregate"]) + [
                "--prefill", pre, "--decode", dec, "--port", str(port),
                "--health-interval", "600"]
            cg = out / f"{name}.cg"
            ops = out / f"{name}.ops.json"
            cmd = ([sys.executable, "-m", "kvdisagg.cli", "proxy", *flags]
                   if args.mode == "callgrind" else
                   [sys.executable, __file__, "--wrapped", str(ops), *flags])
            if args.mode == "callgrind":
                cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no",
                       f"--callgrind-out-file={cg}", *cmd]
            proc = bench.spawn(cmd, out / f"{name}-proxy.log", env)
            procs.append(proc)
            url = f"http://127.0.0.1:{port}"
            bench.wait_http(url + "/readiness", 600)
            t = bench.Target(name, url, proc.pid)
            bench.measure(t, args.workload, args.concurrency, args.warmup, 0)
            if args.mode == "callgrind":
                subprocess.run(["callgrind_control", "-i", "on", str(proc.pid)], check=True,
                               capture_output=True)
            else:
                os.kill(proc.pid, signal.SIGUSR1)
                time.sleep(0.2)
            cell = bench.measure(t, args.workload, args.concurrency, args.requests, 0)
            n = args.requests
            if args.mode == "callgrind":
                subprocess.run(["callgrind_control", "-i", "off", str(proc.pid)], check=True,
                               capture_output=True)
                subprocess.run(["callgrind_control", "-d", str(proc.pid)], check=True,
                               capture_output=True)
                dump = Path(f"{cg}.1")
                print(f"{name}: {callgrind_total(dump) / n:,.0f} Ir per request "
                      f"({cell.errors} errors)", flush=True)
            else:
                os.kill(proc.pid, signal.SIGUSR2)
                for _ in range(100):
                    if ops.exists() and ops.stat().st_size:
                        break
                    time.sleep(0.1)
                time.sleep(0.5)
                print(f"{name} ({cell.errors} errors):\n{ops_summary(ops, n, args.top)}",
                      flush=True)
            proc.terminate()
    finally:
        stop_processes(procs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
