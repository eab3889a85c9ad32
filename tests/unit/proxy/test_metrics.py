"""The proxy's /metrics (proxy/metrics.py): SLO attainment and goodput from requests served by
fake vLLM upstreams on loopback."""

from __future__ import annotations

import pytest

from kvdisagg.proxy.config import SloConfig
from tests.support.proxy_harness import GEN, metric, proxy, run


def test_goodput_and_slo_metrics() -> None:
    async def t() -> None:
        async with proxy(slo=SloConfig(ttft_s=0.5, tpot_s=0.1)) as env:
            for stream in (True, True, False):
                r = await env.client.post("/v1/completions", json={**GEN, "stream": stream})
                await r.read()
            env.prefill[0].delay_s = 0.6  # misses TTFT
            r = await env.client.post("/v1/completions", json={**GEN, "stream": True})
            await r.read()
            text = await env.metrics()
            assert metric(text, "kvdisagg_proxy_slo_requests_total") == 4
            assert metric(text, "kvdisagg_proxy_slo_met_total", slo="both") == 3
            assert metric(text, "kvdisagg_proxy_slo_attainment") == pytest.approx(0.75)
            assert metric(text, "kvdisagg_proxy_goodput_rps") > 0
            assert metric(text, "kvdisagg_proxy_instance_goodput_rps",
                          instance=env.urls["d0"]) == metric(text, "kvdisagg_proxy_goodput_rps")
            assert metric(text, "kvdisagg_proxy_handoff_seconds_count") == 4
            assert metric(text, "kvdisagg_proxy_e2e_seconds_count") == 4
    run(t())
