"""One open-loop run: send each request at its arrival time, whatever the earlier ones are doing.

Open loop is the point: a closed loop (N users waiting for answers) slows its own arrivals when
the server slows down and so hides queueing, which is exactly what TTFT SLOs are about. Each
request is bounded by the client timeouts, so the run ends. When the endpoint is a
``kvdisagg proxy``, its SLO counters are read before and after, and its live goodput gauge
after, so the two views of the same run can be compared.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import aiohttp

from kvdisagg.bench import scrape
from kvdisagg.bench.attainment import judge, met_per_event, summarize, window_goodput
from kvdisagg.bench.client import ClientConfig, send
from kvdisagg.bench.records import ProxyView, RequestRecord, RunSummary, Slo
from kvdisagg.bench.workload import RequestSpec
from kvdisagg.errors import EndpointError


class Endpoint(NamedTuple):
    name: str
    url: str
    gpus: int = 1


class RunOutcome(NamedTuple):
    records: list[RequestRecord]
    summary: RunSummary


OnDone = Callable[[RequestRecord], None]
SETTLE_S = 0.25  # before the closing scrape: let the proxy finish judging the last request


async def _warmup(session: aiohttp.ClientSession, ep: Endpoint, specs: Sequence[RequestSpec],
                  cfg: ClientConfig) -> None:
    for spec in specs:
        rec = RequestRecord(endpoint=ep.name, run="warmup", index=spec.index, rate=None,
                            scheduled_at_s=0.0, sent_at_s=0.0, prompt_len=spec.prompt_len,
                            output_len=spec.output_len)
        await send(session, ep.url, spec, cfg, rec, time.perf_counter())
        if not rec.ok:
            raise EndpointError(f"warm-up request to {ep.name} ({ep.url}) failed: {rec.error}")


def proxy_view(before: scrape.ProxySnapshot | None, after: scrape.ProxySnapshot | None,
               records: Sequence[RequestRecord], duration_s: float, after_at_s: float,
               window_s: float | None, slo: Slo) -> ProxyView | None:
    """The proxy's own accounting of the run, next to bench's count over the same window."""
    if before is None or after is None:
        return None
    judged = after.judged - before.judged
    met = after.met_both - before.met_both
    view = ProxyView(judged=judged, met_both=met, attainment=met / judged if judged else None,
                     goodput_rps=met / duration_s if duration_s > 0 else 0.0,
                     bench_met_both_per_event=sum(met_per_event(r, slo) for r in records))
    # The gauge's window must lie inside the run, or it also counts earlier traffic.
    if window_s and after.goodput_rps is not None and after_at_s >= window_s:
        view.gauge_goodput_rps = after.goodput_rps
        view.gauge_at_s = after_at_s
        view.window_s = window_s
        view.bench_window_goodput_rps = window_goodput(records, after_at_s, window_s)
        view.bench_window_goodput_rps_per_event = window_goodput(
            records, after_at_s, window_s, lambda r: met_per_event(r, slo))
    return view


async def run_once(ep: Endpoint, specs: Sequence[RequestSpec], cfg: ClientConfig, slo: Slo, *,
                   run: str, rate: float | None, on_done: OnDone | None = None,
                   warmup: Sequence[RequestSpec] = (),
                   proxy_window_s: float | None = None,
                   phase_urls: Sequence[str] = ()) -> RunOutcome:
    """``phase_urls``: instances whose handoff-timeline histograms the summary reports, with
    the endpoint's own (a kvdisagg proxy's)."""
    connector = aiohttp.TCPConnector(limit=0)  # open loop: no client-side queue
    urls = [ep.url, *phase_urls]
    async with aiohttp.ClientSession(connector=connector) as session:
        await _warmup(session, ep, warmup, cfg)
        scraped_before = [await scrape.fetch(session, u) for u in urls]
        records = [RequestRecord(endpoint=ep.name, run=run, index=s.index, rate=rate,
                                 scheduled_at_s=s.at_s, sent_at_s=s.at_s,
                                 prompt_len=s.prompt_len, output_len=s.output_len)
                   for s in specs]

        async def one(spec: RequestSpec, rec: RequestRecord) -> None:
            await send(session, ep.url, spec, cfg, rec, t0)
            judge(rec, slo)
            if on_done is not None:
                on_done(rec)

        t0 = time.perf_counter()
        tasks = []
        for spec, rec in zip(specs, records):
            delay = t0 + spec.at_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(spec, rec)))
        await asyncio.gather(*tasks)
        await asyncio.sleep(SETTLE_S)
        after_at = time.perf_counter() - t0
        scraped_after = [await scrape.fetch(session, u) for u in urls]
    summary = summarize(records, endpoint=ep.name, url=ep.url, run=run, gpus=ep.gpus, rate=rate)
    # A phase is what a histogram added between two readings: with either reading missing it is
    # unknown (an unread start read as zero would credit the run with all earlier traffic).
    for u, b, a in zip(urls, scraped_before, scraped_after):
        if b is None or a is None:
            summary.metrics_unread.append(u)
        else:
            summary.phases += scrape.phase_means(u, scrape.phase_totals(b),
                                                 scrape.phase_totals(a))
    summary.proxy = proxy_view(scrape.proxy_snapshot(scraped_before[0] or []),
                               scrape.proxy_snapshot(scraped_after[0] or []), records,
                               summary.duration_s, after_at, proxy_window_s, slo)
    return RunOutcome(records, summary)
