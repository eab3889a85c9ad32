"""PNG plots (matplotlib, Agg backend: no display needed): attainment vs per-GPU rate, one line
per endpoint with the target drawn in; and TTFT / TPOT CDFs with the SLOs drawn in."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from kvdisagg.bench.records import RequestRecord, RunSummary, Slo


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def attainment_vs_rate(runs: Sequence[RunSummary], target: float, path: Path) -> Path:
    plt = _plt()
    by_ep: dict[str, list[RunSummary]] = defaultdict(list)
    for r in runs:
        if r.rate is not None:
            by_ep[r.endpoint].append(r)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, rs in by_ep.items():
        rs.sort(key=lambda r: r.rate or 0.0)
        ax.plot([(r.rate or 0.0) / r.gpus for r in rs], [100 * r.attainment for r in rs],
                marker="o", label=f"{name} ({rs[0].gpus} GPU{'s' if rs[0].gpus > 1 else ''})")
    ax.axhline(100 * target, color="grey", ls="--", lw=1, label=f"target {target:.0%}")
    ax.set_xlabel("rate per GPU (req/s)")
    ax.set_ylabel("SLO attainment, both (%)")
    ax.set_ylim(-2, 102)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def latency_cdfs(records: Sequence[RequestRecord], slo: Slo, path: Path) -> Path:
    """One line per run (endpoint @ rate) in each panel; failed requests are left out."""
    plt = _plt()
    runs: dict[str, list[RequestRecord]] = defaultdict(list)
    for r in records:
        if r.ok:
            runs[f"{r.endpoint} @ {r.rate:g}/s" if r.rate is not None else r.run].append(r)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, field, limit, title in ((axes[0], "ttft_s", slo.ttft_s, "TTFT"),
                                    (axes[1], "tpot_s", slo.tpot_s, "TPOT")):
        for label, rs in runs.items():
            xs = sorted(1000 * v for v in (getattr(r, field) for r in rs) if v is not None)
            if xs:
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label)
        ax.axvline(1000 * limit, color="grey", ls="--", lw=1, label=f"SLO {limit * 1000:g} ms")
        ax.set_xlabel(f"{title} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{title} CDF")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
