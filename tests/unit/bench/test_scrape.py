"""kvdisagg bench's scrape.py: phase means from histogram deltas."""

from __future__ import annotations

from kvdisagg.bench.scrape import phase_means, phase_totals
from kvdisagg.prom_text import samples


def test_phase_breakdown_from_histogram_deltas():
    def text(transfer: tuple[int, float], leg: tuple[int, float]) -> str:
        return (f'vllm:kvdisagg_phase_seconds_count{{engine="0",phase="transfer"}} {transfer[0]}\n'
                f'vllm:kvdisagg_phase_seconds_sum{{engine="0",phase="transfer"}} {transfer[1]}\n'
                f'vllm:kvdisagg_phase_seconds_bucket{{engine="0",phase="transfer",le="1"}} 9\n'
                f"kvdisagg_proxy_handoff_seconds_count {leg[0]}\n"
                f"kvdisagg_proxy_handoff_seconds_sum {leg[1]}\n"
                f"kvdisagg_proxy_ttft_seconds_count 99\n")

    before = phase_totals(samples(text((2, 0.004), (5, 1.0))))
    assert before == {"transfer": (2, 0.004), "prefill leg": (5, 1.0)}
    after = phase_totals(samples(text((6, 0.012), (5, 1.0))))
    (m,) = phase_means("http://d", before, after)  # the prefill leg saw nothing new
    assert (m.where, m.phase, m.count) == ("http://d", "transfer", 4)
    assert abs(m.mean_s - 0.002) < 1e-12
