"""Read an endpoint's Prometheus ``/metrics`` (bounded), and the ``kvdisagg proxy`` SLO numbers.

A plain vLLM or another router simply lacks the ``kvdisagg_proxy_*`` families; then there is
no proxy view and bench reports only what it measured itself.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import aiohttp

_LINE = re.compile(r"^([A-Za-z_:][\w:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
PROXY = "kvdisagg_proxy_"


class Sample(NamedTuple):
    name: str
    labels: dict[str, str]
    value: float


def parse(text: str) -> list[Sample]:
    out = []
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        m = _LINE.match(line)
        if not m:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        out.append(Sample(m.group(1), dict(_LABEL.findall(m.group(2) or "")), value))
    return out


def total(samples: list[Sample], name: str, **labels: str) -> float | None:
    """Sum of ``name``'s samples whose labels include ``labels``; None if there is none."""
    vals = [s.value for s in samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    return sum(vals) if vals else None


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


async def fetch(session: aiohttp.ClientSession, base_url: str,
                timeout_s: float = 5.0) -> list[Sample] | None:
    """The endpoint's samples, or None when it has no readable /metrics."""
    try:
        async with session.get(base_url.rstrip("/") + "/metrics",
                               timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            if r.status != 200:
                return None
            return parse((await r.content.read(16 << 20)).decode("utf-8", "replace"))
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None
