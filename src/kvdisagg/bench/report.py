"""What a person sees: a live progress bar per run and the attainment/goodput tables (rich)."""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvdisagg.bench.records import RequestRecord, RunSummary, Slo, SweepResult


class RunProgress:
    """A progress bar for one run, updated as each request finishes (good/failed shown live)."""

    def __init__(self, console: Console, label: str, total: int, enabled: bool = True) -> None:
        self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                                 MofNCompleteColumn(), TextColumn("{task.fields[stats]}"),
                                 TimeElapsedColumn(), console=console, disable=not enabled,
                                 transient=False)
        self.task = self.progress.add_task(label, total=total, stats="")
        self.good = self.failed = 0

    def __enter__(self) -> RunProgress:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def done(self, rec: RequestRecord) -> None:
        self.good += rec.met_both
        self.failed += not rec.ok
        n = self.progress.tasks[0].completed + 1
        self.progress.update(self.task, advance=1,
                             stats=f"good {self.good}/{n:.0f}  failed {self.failed}")


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f}"


def runs_table(runs: Sequence[RunSummary], slo: Slo) -> Table:
    t = Table(title=f"SLO attainment (TTFT <= {slo.ttft_s * 1000:.0f} ms, "
                    f"TPOT <= {slo.tpot_s * 1000:.0f} ms)")
    for col in ("endpoint", "gpus", "rate", "req", "ok", "TTFT p50/p90 ms", "TPOT p50/p90 ms",
                "ttft ok", "tpot ok", "both", "goodput r/s", "per GPU", "proxy both",
                "proxy goodput"):
        t.add_column(col, justify="left" if col == "endpoint" else "right")
    for r in runs:
        p = r.proxy
        t.add_row(r.endpoint, str(r.gpus), "-" if r.rate is None else f"{r.rate:.2f}",
                  str(r.requests), str(r.ok),
                  f"{_ms(r.ttft_s.p50)}/{_ms(r.ttft_s.p90)}",
                  f"{_ms(r.tpot_s.p50)}/{_ms(r.tpot_s.p90)}",
                  f"{r.attainment_ttft:.0%}", f"{r.attainment_tpot:.0%}", f"{r.attainment:.0%}",
                  f"{r.goodput_rps:.2f}", f"{r.goodput_rps_per_gpu:.2f}",
                  "-" if p is None or p.attainment is None else f"{p.attainment:.0%}",
                  "-" if p is None else f"{p.goodput_rps:.2f}")
    return t


def sweeps_table(sweeps: Sequence[SweepResult]) -> Table:
    target = sweeps[0].target if sweeps else 0.0
    t = Table(title=f"Goodput: highest rate with >= {target:.0%} attainment")
    for col in ("endpoint", "gpus", "rates tried", "max rate r/s", "per GPU"):
        t.add_column(col, justify="left" if col == "endpoint" else "right")
    for s in sweeps:
        bound = ">= " if s.censored else ""
        t.add_row(s.endpoint, str(s.gpus), ", ".join(f"{p.rate:g}" for p in s.points),
                  "none" if s.max_rate is None else f"{bound}{s.max_rate:.2f}",
                  "none" if s.max_rate_per_gpu is None else f"{bound}{s.max_rate_per_gpu:.2f}")
    return t


def phases_table(runs: Sequence[RunSummary]) -> Table:
    """The handoff timeline of each run: mean per phase, from the histograms (docs/operations.md,
    "Handoff timeline"); a request's own breakdown is in its trace."""
    t = Table(title="handoff phases (mean over the run)")
    for col in ("run", "where", "phase", "count", "mean ms"):
        t.add_column(col, justify="right" if col in ("count", "mean ms") else "left")
    for r in runs:
        for p in r.phases:
            t.add_row(r.run, p.where, p.phase, str(p.count), f"{p.mean_s * 1e3:.2f}")
    return t
