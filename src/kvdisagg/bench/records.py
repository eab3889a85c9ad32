"""What bench writes: one ``RequestRecord`` per request (JSON lines) and one ``RunSummary`` per run.

These are files other tools read back (``kvdisagg bench --compare``, notebooks), so they are
msgspec Structs with defaults on every field added later. Times are seconds; ``*_at_s`` fields
are relative to the run's start (the first scheduled arrival is at 0).
"""

from __future__ import annotations

import msgspec


class Slo(msgspec.Struct, frozen=True, kw_only=True):
    """The two latency objectives; a request is *good* when it meets both."""

    ttft_s: float
    tpot_s: float


class RequestRecord(msgspec.Struct, kw_only=True):
    endpoint: str
    run: str
    index: int
    rate: float | None  # target arrival rate of the run (None: a replayed trace at speed 1)
    scheduled_at_s: float  # when the arrival process said to send it
    sent_at_s: float  # when it was actually sent (lags scheduled_at_s if the client is overloaded)
    prompt_len: int
    output_len: int  # max_tokens asked for (ignore_eos makes it the real length on vLLM)
    ok: bool = False
    status: int | None = None
    error: str | None = None
    output_tokens: int = 0  # tokens received (exact with token_ids, else one per event)
    output_events: int = 0  # stream events that carried tokens (vLLM may pack several in one)
    ttft_s: float | None = None  # sent -> first token event
    tpot_s: float | None = None  # (last - first token) / (output_tokens - 1); None below 2 tokens
    e2e_s: float | None = None
    done_at_s: float | None = None  # completion time, relative to the run start
    itl_s: list[float] = msgspec.field(default_factory=list)  # every inter-token gap
    met_ttft: bool = False
    met_tpot: bool = False
    met_both: bool = False


class Percentiles(msgspec.Struct, kw_only=True):
    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None
    max: float | None = None


class ProxyView(msgspec.Struct, kw_only=True):
    """The endpoint's own (``kvdisagg proxy``) SLO accounting for the same run, from /metrics."""

    judged: float  # delta of kvdisagg_proxy_slo_requests_total over the run
    met_both: float  # delta of kvdisagg_proxy_slo_met_total{slo="both"}
    attainment: float | None  # met_both / judged
    goodput_rps: float  # met_both / the run's duration (bench's clock)
    gauge_goodput_rps: float | None = None  # kvdisagg_proxy_goodput_rps, last scrape in the run
    gauge_at_s: float | None = None  # when that scrape was taken (run clock)
    bench_window_goodput_rps: float | None = None  # bench's own count over the same window
    window_s: float | None = None
    # Bench's records judged as the proxy judges them: TPOT per SSE event, not per token. The
    # two differ when vLLM packs several tokens into one event (a starved API server).
    bench_met_both_per_event: float | None = None
    bench_window_goodput_rps_per_event: float | None = None


class PhaseMean(msgspec.Struct, frozen=True):
    """One phase of the handoff timeline over a run, from the Prometheus histograms of the
    proxy and of the instances given with ``--phases-from`` (deltas across the run)."""

    where: str  # the URL scraped
    phase: str
    count: int
    mean_s: float


class RunSummary(msgspec.Struct, kw_only=True):
    endpoint: str
    url: str
    run: str
    gpus: int
    rate: float | None
    requests: int
    ok: int
    duration_s: float  # first arrival -> last completion
    ttft_s: Percentiles
    tpot_s: Percentiles
    itl_s: Percentiles
    e2e_s: Percentiles
    attainment_ttft: float
    attainment_tpot: float
    attainment: float  # both SLOs met, over all requests sent (failures count as misses)
    goodput_rps: float  # good requests per second of run
    goodput_rps_per_gpu: float
    throughput_rps: float  # successful requests per second of run
    output_tokens_per_s: float
    proxy: ProxyView | None = None
    phases: list[PhaseMean] = []  # the handoff timeline's histograms over the run
    # Endpoints whose /metrics could not be read at the run's start or end: no proxy view or
    # phases from them for this run (unknown, not zero).
    metrics_unread: list[str] = []


class SweepPoint(msgspec.Struct, frozen=True):
    rate: float
    attainment: float


class SweepResult(msgspec.Struct, kw_only=True):
    """The highest rate meeting the target attainment (DistServe's goodput), per endpoint."""

    endpoint: str
    gpus: int
    target: float
    points: list[SweepPoint]
    max_rate: float | None  # None: even the lowest rate tried misses the target
    max_rate_per_gpu: float | None
    censored: bool = False  # True: the highest rate tried still met it (the answer is a bound)


class BenchResult(msgspec.Struct, kw_only=True):
    slo: Slo
    target_attainment: float
    command: list[str]
    runs: list[RunSummary]
    sweeps: list[SweepResult]
