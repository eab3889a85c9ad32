"""Read an endpoint's Prometheus ``/metrics`` (bounded; parsed by kvdisagg.prom_text), and the
``kvdisagg proxy`` SLO numbers.

A plain vLLM or another router simply lacks the ``kvdisagg_proxy_*`` families; then there is
no proxy view and bench reports only what it measured itself.
"""

from __future__ import annotations

import asyncio
from typing import NamedTuple

import aiohttp

from kvdisagg import prom_text
from kvdisagg.bench.records import PhaseMean
from kvdisagg.prom_text import Sample, total

PROXY = "kvdisagg_proxy_"


class ProxySnapshot(NamedTuple):
    judged: float
    met_both: float
    goodput_rps: float | None


def proxy_snapshot(samples: list[Sample]) -> ProxySnapshot | None:
    judged = total(samples, PROXY + "slo_requests_total")
    met = total(samples, PROXY + "slo_met_total", slo="both")
    if judged is None or met is None:
        return None
    return ProxySnapshot(judged, met, total(samples, PROXY + "goodput_rps"))


async def fetch(session: aiohttp.ClientSession, base_url: str, timeout_s: float = 5.0,
                attempts: int = 3) -> list[Sample] | None:
    """The endpoint's samples, or None when it has no readable /metrics.

    A busy instance can be slow to answer right after a burst, so a timeout, a refused
    connection or a 5xx is tried again (``attempts`` in all, a growing pause between); a 4xx
    (a router without /metrics) or a page that does not parse is final."""
    for attempt in range(attempts):
        if attempt:
            await asyncio.sleep(float(attempt))
        try:
            async with session.get(base_url.rstrip("/") + "/metrics",
                                   timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                if r.status >= 500:
                    continue
                if r.status != 200:
                    return None
                return prom_text.samples(await r.content.read(16 << 20))
        except ValueError:
            return None
        except (aiohttp.ClientError, TimeoutError):
            continue
    return None


# The handoff timeline's histograms: the proxy's own, and vLLM instances' per-phase one.
PROXY_PHASES = {PROXY + "handoff_seconds": "prefill leg",
                PROXY + "decode_first_token_seconds": "decode leg to first token"}
INSTANCE_PHASES = "vllm:kvdisagg_phase_seconds"


def phase_totals(samples: list[Sample]) -> dict[str, tuple[float, float]]:
    """``phase -> (count, sum of seconds)`` of every timeline histogram in ``samples``
    (summed over an instance's engines)."""
    out: dict[str, tuple[float, float]] = {}
    for s in samples:
        base, _, part = s.name.rpartition("_")
        if part not in ("count", "sum"):
            continue
        if base in PROXY_PHASES:
            phase = PROXY_PHASES[base]
        elif base == INSTANCE_PHASES and "phase" in s.labels:
            phase = s.labels["phase"]
        else:
            continue
        count, total_s = out.get(phase, (0.0, 0.0))
        out[phase] = (count + s.value, total_s) if part == "count" else (count, total_s + s.value)
    return out


def phase_means(where: str, before: dict[str, tuple[float, float]],
                after: dict[str, tuple[float, float]]) -> list[PhaseMean]:
    """What each phase added between two phase_totals of one endpoint."""
    out = []
    for phase, (count, total_s) in after.items():
        c0, s0 = before.get(phase, (0.0, 0.0))
        if count > c0:
            out.append(PhaseMean(where, phase, int(count - c0), (total_s - s0) / (count - c0)))
    return out
