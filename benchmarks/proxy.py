"""Proxy overhead, one run: kvdisagg proxy vs vllm-router 0.1.17 vs direct to decode.

Fast fake prefill/decode backends (``tests.support.fake_vllm``, one process each, uvloop)
on loopback; the same closed-loop load against each target, cell by cell (targets interleaved
per cell, so drift on a shared machine hits all of them alike): streaming completions,
streaming chat, non-streaming completions, at each concurrency. Reported per cell: req/s,
p50/p99 latency and the latency the proxy *adds* over direct, and the proxy process's CPU time
per request (utime+stime deltas from ``/proc/<pid>/stat``, all threads), which is the figure
that survives a shared 2-core machine. vllm-router runs as the peer document says
(``--vllm-pd-disaggregation --policy round_robin``) from its own venv::

    .venv/bin/python benchmarks/proxy.py --router /work/venvs/router/bin/vllm-router \\
        --requests 3000 --concurrency 32 128 --out out/proxy-bench

Targets: ``direct`` (decode itself), ``kvdisagg`` (``--always-disaggregate``: two legs per
request, as vllm-router), ``kvdisagg-short`` (the proxy's default decision: the 64-word prompt
is short, so decode serves it alone, one leg: "a short prompt through the proxy" against the
same prompt sent to decode directly), ``vllm-router``. ``--baseline DIR`` also runs each
kvdisagg target from another checkout's ``src/`` (``DIR``, e.g. a ``git worktree`` of an older
commit), named ``...@base``, interleaved with the rest in every cell: before and after a change
on the same machine at the same time.

The load generator is the proxy's own lean HTTP client (``proxy.upstream.Pool``) on uvloop in
this process, so the client costs as little CPU as the machine allows.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

from kvdisagg.local.servers import free_port, stop_processes
from kvdisagg.proxy.fleet.upstream import Pool

CLK_TCK = os.sysconf("SC_CLK_TCK")
WORKLOADS = {
    "completions-stream": ("/v1/completions", {"prompt": "hello " * 64, "stream": True}),
    "chat-stream": ("/v1/chat/completions",
                    {"messages": [{"role": "user", "content": "hello " * 64}], "stream": True}),
    "completions": ("/v1/completions", {"prompt": "hello " * 64, "stream": False}),
}
HEADERS = b"Content-Type: application/json\r\n"


class Target(NamedTuple):
    name: str
    url: str
    pid: int | None  # the process whose CPU is measured (None: direct)


class Cell(NamedTuple):
    target: str
    workload: str
    concurrency: int
    requests: int
    errors: int
    seconds: float
    rps: float
    p50_ms: float
    p99_ms: float
    cpu_us_per_req: float | None


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` (every thread), seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def spawn(cmd: list[str], log: Path,
          env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    with open(log, "wb") as f:
        # cwd: the repository root, where ``-m tests.support.fake_vllm`` is found
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                cwd=Path(__file__).resolve().parents[1], env=env)


def wait_http(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} not up after {timeout_s:.0f}s")
        time.sleep(0.2)


async def run_cell(pool: Pool, path: str, body: bytes, stream: bool, n: int,
                   concurrency: int) -> tuple[list[float], int, float]:
    """``n`` requests, ``concurrency`` at a time; per-request latency (to the last byte)."""
    lat: list[float] = []
    errors = 0
    left = n
    clock = time.perf_counter  # uvloop's loop.time() has 1 ms resolution

    async def worker() -> None:
        nonlocal left, errors
        while left > 0:
            left -= 1
            t0 = clock()
            try:
                resp = await pool.request(b"POST", path, body, HEADERS, connect_s=10,
                                          headers_s=30)
                if stream:
                    async for _ in resp.iter_chunks(30, 60):
                        pass
                else:
                    await resp.read(60)
                if resp.status != 200:
                    errors += 1
                    continue
            except Exception:
                errors += 1
                continue
            lat.append(clock() - t0)

    t0 = clock()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return lat, errors, clock() - t0


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def measure(t: Target, workload: str, concurrency: int, n: int, warmup: int) -> Cell:
    path, fields = WORKLOADS[workload]
    body = json.dumps({"model": "tiny", "max_tokens": 16, "temperature": 0.7, **fields}).encode()
    stream = bool(fields["stream"])

    async def both() -> tuple[list[float], int, float, float | None]:
        pool = Pool(t.url, max_idle=concurrency)  # warm-up opens the connections reused after
        await run_cell(pool, path, body, stream, max(warmup, concurrency), concurrency)
        cpu0 = cpu_seconds(t.pid) if t.pid else 0.0
        lat, errors, elapsed = await run_cell(pool, path, body, stream, n, concurrency)
        cpu = (cpu_seconds(t.pid) - cpu0) if t.pid else None
        pool.close()
        return lat, errors, elapsed, cpu

    lat, errors, elapsed, cpu = asyncio.run(both())
    return Cell(t.name, workload, concurrency, n, errors, elapsed, len(lat) / elapsed,
                1e3 * pct(lat, 0.50), 1e3 * pct(lat, 0.99),
                None if cpu is None else 1e6 * cpu / n)


def profile(pid: int, py_spy: str, seconds: float, out: Path) -> str:
    """py-spy samples of ``pid`` for ``seconds``: the top functions by own and total time."""
    raw = out.with_suffix(".txt")
    subprocess.run([py_spy, "record", "--pid", str(pid), "--duration", str(int(seconds)),
                    "--rate", "250", "--format", "raw", "--nonblocking", "-o", str(raw)],
                   check=True, capture_output=True)
    own: dict[str, int] = {}
    incl: dict[str, int] = {}
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        frames = [f.split(" (")[0] + " (" + f.split(" (")[1].split(":")[0].rsplit("/", 1)[-1]
                  + ")" if " (" in f else f for f in stack.split(";")]
        k = int(n)
        total += k
        own[frames[-1]] = own.get(frames[-1], 0) + k
        for f in set(frames):
            incl[f] = incl.get(f, 0) + k
    lines = [f"{total} samples; own time (top 25):"]
    lines += [f"  {100 * v / total:5.1f}%  {f}" for f, v in
              sorted(own.items(), key=lambda kv: -kv[1])[:25]]
    lines += ["total time (top 25):"]
    lines += [f"  {100 * v / total:5.1f}%  {f}" for f, v in
              sorted(incl.items(), key=lambda kv: -kv[1])[:25]]
    text = "\n".join(lines)
    out.write_text(text + "\n")
    return text


def median_cell(runs: list[Cell]) -> Cell:
    """Per-field median over rounds of one (target, workload, concurrency) cell."""
    med = statistics.median
    cpu = [r.cpu_us_per_req for r in runs if r.cpu_us_per_req is not None]
    r0 = runs[0]
    return r0._replace(requests=sum(r.requests for r in runs),
                       errors=sum(r.errors for r in runs),
                       seconds=sum(r.seconds for r in runs), rps=med(r.rps for r in runs),
                       p50_ms=med(r.p50_ms for r in runs), p99_ms=med(r.p99_ms for r in runs),
                       cpu_us_per_req=med(cpu) if cpu else None)


def table(cells: list[Cell]) -> str:
    direct = {(c.workload, c.concurrency): c for c in cells if c.target == "direct"}
    rows = ["| workload | conc | target | req/s | p50 ms | p99 ms | added p50 ms | added p99 ms "
            "| proxy CPU µs/req | errors |", "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for c in cells:
        d = direct.get((c.workload, c.concurrency))
        add50 = f"{c.p50_ms - d.p50_ms:.2f}" if d and c.target != "direct" else "-"
        add99 = f"{c.p99_ms - d.p99_ms:.2f}" if d and c.target != "direct" else "-"
        cpu = f"{c.cpu_us_per_req:.0f}" if c.cpu_us_per_req is not None else "-"
        rows.append(f"| {c.workload} | {c.concurrency} | {c.target} | {c.rps:.0f} | "
                    f"{c.p50_ms:.2f} | {c.p99_ms:.2f} | {add50} | {add99} | {cpu} | {c.errors} |")
    return "\n".join(rows)


def ratios(cells: list[Cell]) -> str:
    """Per cell, each proxy's CPU per request over vllm-router's, and each target's p50 over
    direct's (within one cell: the only comparison a shared machine allows)."""
    by = {(c.workload, c.concurrency, c.target): c for c in cells}
    proxies = list(dict.fromkeys(c.target for c in cells if c.target != "direct"))
    ours = [n for n in proxies if n != "vllm-router"]
    head = [f"{n} p50/direct" for n in proxies] + [f"{n} CPU/router" for n in ours]
    rows = ["| workload | conc | " + " | ".join(head) + " |",
            "|---|---:|" + "---:|" * len(head)]

    def ratio(a: float | None, b: float | None) -> str:
        return f"{a / b:.2f}" if a and b else "-"

    for w, conc in dict.fromkeys((c.workload, c.concurrency) for c in cells):
        d, r = by.get((w, conc, "direct")), by.get((w, conc, "vllm-router"))
        got = {n: by.get((w, conc, n)) for n in proxies}
        vals = [ratio(c.p50_ms if c else None, d.p50_ms if d else None) for c in got.values()]
        vals += [ratio(c.cpu_us_per_req if (c := got[n]) else None,
                       r.cpu_us_per_req if r else None) for n in ours]
        rows.append(f"| {w} | {conc} | " + " | ".join(vals) + " |")
    return "\n".join(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--router", default="/work/venvs/router/bin/vllm-router",
                   help="vllm-router executable (pip install vllm-router==0.1.17 in its own venv)")
    p.add_argument("--requests", type=int, default=3000, help="measured requests per cell")
    p.add_argument("--warmup", type=int, default=300)
    p.add_argument("--concurrency", type=int, nargs="+", default=[32, 128])
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--targets", nargs="+", default=["direct", "kvdisagg", "vllm-router"],
                   choices=["direct", "kvdisagg", "kvdisagg-short", "vllm-router"])
    p.add_argument("--baseline", metavar="DIR",
                   help="also run the kvdisagg targets from DIR/src (another checkout), as "
                   "'<target>@base'")
    p.add_argument("--baseline-first", action="store_true",
                   help="run each '@base' target just before its peer in the interleave "
                   "(default: after): the order moves CPU per request by ~5-10%% here")
    p.add_argument("--tokens", type=int, default=16, help="SSE events per streamed answer")
    p.add_argument("--token-delay-ms", type=float, default=0.0,
                   help="decode backend pause between events; >0 keeps events apart (as a "
                   "real engine does), 0 lets them arrive together")
    p.add_argument("--rounds", type=int, default=3,
                   help="repeat each cell, targets interleaved; the table shows medians")
    p.add_argument("--out", default="out/proxy-bench")
    p.add_argument("--py-spy", metavar="EXE",
                   help="instead of the table: profile the kvdisagg proxy under each workload")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        import uvloop
        uvloop.install()
    except ImportError:  # pragma: no cover
        pass

    procs: list[subprocess.Popen[bytes]] = []
    try:
        ports = {k: free_port() for k in ("prefill", "decode", "vllm-router", "prom")}
        for role in ("prefill", "decode"):
            procs.append(spawn([sys.executable, "-m", "tests.support.fake_vllm", "--port",
                                str(ports[role]), "--tokens", str(args.tokens), "--name", role,
                                "--token-delay-ms", str(args.token_delay_ms)],
                               out / f"fake-{role}.log"))
        pre, dec = (f"http://127.0.0.1:{ports[r]}" for r in ("prefill", "decode"))
        for u in (pre, dec):
            wait_http(u + "/health")
        targets: list[Target] = []
        if "direct" in args.targets:
            targets.append(Target("direct", dec, None))
        trees = {"": None} | ({"@base": Path(args.baseline).resolve() / "src"}
                              if args.baseline else {})
        if args.baseline_first:  # the interleave's order shows in the figures: swap it
            trees = dict(reversed(trees.items()))
        for name, flags in (("kvdisagg", ["--always-disaggregate"]),  # like vllm-router
                            ("kvdisagg-short", [])):  # the default decision: decode alone
            if name not in args.targets:
                continue
            for suffix, src in trees.items():
                port = free_port()
                env = None if src is None else {**os.environ, "PYTHONPATH": str(src)}
                proc = spawn([sys.executable, "-m", "kvdisagg.cli", "proxy", "--prefill", pre,
                              "--decode", dec, "--port", str(port), *flags],
                             out / f"{name}{suffix}-proxy.log", env)
                procs.append(proc)
                url = f"http://127.0.0.1:{port}"
                wait_http(url + "/readiness")
                targets.append(Target(name + suffix, url, proc.pid))
        if "vllm-router" in args.targets:
            proc = spawn([args.router, "--vllm-pd-disaggregation", "--policy", "round_robin",
                          "--prefill", pre, "--decode", dec, "--host", "127.0.0.1",
                          "--port", str(ports["vllm-router"]), "--prometheus-port",
                          str(ports["prom"]), "--log-level", "warning"],
                         out / "vllm-router.log")
            procs.append(proc)
            url = f"http://127.0.0.1:{ports['vllm-router']}"
            wait_http(url + "/health")
            targets.append(Target("vllm-router", url, proc.pid))

        if args.py_spy:
            t = next(t for t in targets if t.name.startswith("kvdisagg"))
            assert t.pid is not None
            for workload in args.workloads:
                conc = args.concurrency[0]
                with ThreadPoolExecutor(1) as ex:
                    fut = ex.submit(profile, t.pid, args.py_spy, 8,
                                    out / f"profile-{workload}-{conc}")
                    while not fut.done():
                        measure(t, workload, conc, args.requests, 0)
                    print(f"== {workload}, concurrency {conc}\n{fut.result()}", flush=True)
            return 0
        cells: list[Cell] = []
        raw: list[Cell] = []
        for workload in args.workloads:
            for conc in args.concurrency:
                runs: dict[str, list[Cell]] = {t.name: [] for t in targets}
                for _ in range(args.rounds):
                    for t in targets:
                        c = measure(t, workload, conc, args.requests, args.warmup)
                        print(c, flush=True)
                        runs[t.name].append(c)
                        raw.append(c)
                cells += [median_cell(rs) for rs in runs.values()]
        (out / "results.json").write_text(json.dumps(
            {"args": vars(args), "medians": [c._asdict() for c in cells],
             "runs": [c._asdict() for c in raw]}, indent=1))
        text = table(cells)
        (out / "table.md").write_text(text + "\n")
        print(text)
        for name in dict.fromkeys(t.name for t in targets if t.pid):
            cpu = [c.cpu_us_per_req for c in cells if c.target == name and c.cpu_us_per_req]
            if cpu:
                print(f"{name}: median CPU {statistics.median(cpu):.0f} µs/request")
        (out / "ratios.md").write_text(ratios(cells) + "\n")
        print(ratios(cells))
    finally:
        stop_processes(procs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
