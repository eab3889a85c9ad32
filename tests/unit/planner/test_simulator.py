"""Simulator known answers: a single request, a saturated queue, M/D/1 waiting, batching, KV
capacity and transfer, determinism (planner/simulator.py)."""

import math

import numpy as np
import pytest

from kvdisagg.planner.latency import LatencyModel
from kvdisagg.planner.profile import ParallelProfile
from kvdisagg.planner.simulator import SimInstance, simulate_colocated, simulate_disaggregated
from kvdisagg.planner.trace import Requests, draw, load_lengths


def _model(pp=1, pre=(10.0, 0.1, 0.0), dec=(5.0, 0.001, 0.5), it=0.0):
    return LatencyModel(
        ParallelProfile(
            tp=1, pp=pp, prefill=pre, decode_small=dec, decode_large=dec, iter_overhead_ms=it
        )
    )


def _req(arrival, prompt, output):
    return Requests(
        np.asarray(arrival, float), np.asarray(prompt, np.int64), np.asarray(output, np.int64)
    )


def _decode_total(m, batch, plen, steps):
    return sum(m.decode_s(batch, batch * (plen + j + 1)) for j in range(steps))


@pytest.mark.parametrize("steps", [1, 7, 300])
def test_single_request_disaggregated(steps):
    m = _model()
    tl = simulate_disaggregated(_req([1.0], [500], [steps]), [SimInstance(m)], [SimInstance(m)])
    assert tl.prefill_end[0] == pytest.approx(1.0 + m.prefill_s(500, 500**2))
    assert tl.first[0] == pytest.approx(tl.prefill_end[0] + m.decode_s(1, 501))
    assert tl.finish[0] == pytest.approx(tl.prefill_end[0] + _decode_total(m, 1, 500, steps))


def test_single_request_colocated_matches_disaggregated_phases():
    m = _model(it=2.0)
    tl = simulate_colocated(_req([0.0], [300], [50]), [SimInstance(m)])
    assert tl.prefill_end[0] == pytest.approx(m.prefill_s(300, 300**2))
    assert tl.finish[0] == pytest.approx(tl.prefill_end[0] + _decode_total(m, 1, 300, 50))


def test_saturated_prefill_queue_serializes():
    # Budget of one prompt per batch: the k-th of n simultaneous prompts ends at k * service time.
    m = _model()
    n, plen = 20, 400
    tl = simulate_disaggregated(
        _req([0.0] * n, [plen] * n, [1] * n), [SimInstance(m, prefill_budget=plen)], []
    )
    service = m.prefill_s(plen, plen**2)
    np.testing.assert_allclose(np.sort(tl.prefill_end), service * np.arange(1, n + 1))


def test_saturated_pipeline_overlaps_stages():
    # pp=2: stage 0 takes first = work/2 + overheads; batches enter every `first` seconds.
    m = _model(pp=2, it=3.0)
    n, plen = 10, 400
    tl = simulate_disaggregated(
        _req([0.0] * n, [plen] * n, [1] * n), [SimInstance(m, prefill_budget=plen)], []
    )
    first, other = m.prefill_stages_s(plen, plen**2)
    assert first > other
    np.testing.assert_allclose(np.sort(tl.prefill_end), first * np.arange(1, n + 1) + other)


def test_prefill_batches_by_token_budget():
    # The first prompt starts at once on the idle instance; the queued ones batch up to 250 tokens.
    m = _model()
    tl = simulate_disaggregated(
        _req([0.0] * 4, [100] * 4, [1] * 4), [SimInstance(m, prefill_budget=250)], []
    )
    one, two = m.prefill_s(100, 100**2), m.prefill_s(200, 2 * 100**2)
    np.testing.assert_allclose(tl.prefill_end, [one, one + two, one + two, 2 * one + two])


def test_md1_mean_wait_matches_pollaczek_khinchine():
    # Poisson arrivals, deterministic service D, one server: mean wait = rho*D / (2(1-rho)).
    m = _model(pre=(50.0, 0.0, 0.0))
    d = m.prefill_s(1, 1)
    rho = 0.7
    seed = draw(load_lengths("fixed:1:1"), 40000, seed=1)
    req = seed.at_rate(rho / d)
    tl = simulate_disaggregated(req, [SimInstance(m, prefill_budget=1)], [])
    wait = np.mean(tl.prefill_end - tl.arrival) - d
    assert wait == pytest.approx(rho * d / (2 * (1 - rho)), rel=0.05)


def test_continuous_batching_steps_together():
    m = _model()
    k, plen, steps = 8, 100, 20
    tl = simulate_disaggregated(_req([0.0] * k, [plen] * k, [steps] * k), [], [SimInstance(m)])
    # Request 0 starts alone on the idle instance; the other k-1 join at its first step boundary.
    t = m.decode_s(1, plen + 1)
    for j in range(steps):
        t += m.decode_s(k if j < steps - 1 else k - 1,
                        (plen + j + 2 if j < steps - 1 else 0) + (k - 1) * (plen + j + 1))
        if j == steps - 2:
            t0 = t
    assert tl.finish[0] == pytest.approx(t0)
    np.testing.assert_allclose(tl.finish[1:], t)


def test_late_joiner_shares_steps_and_light_load_skipping_is_exact():
    # A lone request decodes for a while (steps are skipped in closed form), then a second joins.
    m = _model()
    one = m.decode_s(1, 101)
    tl = simulate_disaggregated(_req([0.0, 10.5 * one], [100, 100], [40, 5]), [], [SimInstance(m)])
    # Request 1 joins at the first step boundary after its arrival (step 11 of request 0).
    t = sum(m.decode_s(1, 100 + j + 1) for j in range(11))
    for j in range(5):
        t += m.decode_s(2, (100 + 11 + j + 1) + (100 + j + 1))
    assert tl.finish[1] == pytest.approx(t)
    assert tl.first[1] == pytest.approx(sum(m.decode_s(1, 100 + j + 1) for j in range(11))
                                        + m.decode_s(2, 112 + 101))


def test_kv_capacity_admits_one_at_a_time():
    m = _model()
    cap = 150  # one 100-token prompt plus its 20 generated tokens fits, two do not
    tl = simulate_disaggregated(
        _req([0.0, 0.0], [100, 100], [20, 20]), [], [SimInstance(m, capacity=cap)]
    )
    alone = _decode_total(m, 1, 100, 20)
    assert sorted(tl.finish) == pytest.approx([alone, 2 * alone])


def test_kv_transfer_time_from_bytes_and_bandwidth():
    m = _model()
    bw = 1e6  # bytes/s
    tl = simulate_disaggregated(_req([0.0], [200], [3]), [SimInstance(m)], [SimInstance(m)],
                                kv_bytes_per_token=1000, link_bytes_per_s=bw)
    xfer = 200 * 1000 / bw
    assert tl.finish[0] == pytest.approx(tl.prefill_end[0] + xfer + _decode_total(m, 1, 200, 3))


def test_colocated_prefill_preempts_decode_steps():
    # A prompt arriving mid-decode runs at the next step boundary, delaying the running request.
    m = _model()
    one = m.decode_s(1, 101)
    p0 = m.prefill_s(100, 100**2)
    tl = simulate_colocated(_req([0.0, p0 + 2.5 * one], [100, 100], [10, 1]), [SimInstance(m)])
    assert tl.prefill_end[1] == pytest.approx(
        p0 + sum(m.decode_s(1, 100 + j + 1) for j in range(3)) + p0
    )
    assert tl.finish[0] > p0 + _decode_total(m, 1, 100, 10) + p0 * 0.99


def test_deterministic_under_seed():
    m = _model()
    lengths = load_lengths("sharegpt")
    runs = [
        simulate_disaggregated(
            draw(lengths, 500, seed=s).at_rate(3.0), [SimInstance(m)], [SimInstance(m)]
        )
        for s in (7, 7, 8)
    ]
    np.testing.assert_array_equal(runs[0].finish, runs[1].finish)
    assert not np.array_equal(runs[0].finish, runs[2].finish)
    assert not np.isnan(runs[0].finish).any()
    assert math.isfinite(float(np.max(runs[0].finish)))


def test_client_definition_counts_the_handoff():
    # Through our proxy the first token comes from decode's first step, not from prefill.
    from kvdisagg.planner.goodput import latencies

    m = _model()
    tl = simulate_disaggregated(_req([0.0], [200], [5]), [SimInstance(m)], [SimInstance(m)])
    ttft_ds, tpot_ds = latencies(tl, "distserve", colocated=False)
    ttft_cl, tpot_cl = latencies(tl, "client", colocated=False)
    assert ttft_ds[0] == pytest.approx(m.prefill_s(200, 200**2))
    assert ttft_cl[0] == pytest.approx(ttft_ds[0] + m.decode_s(1, 201))
    assert tpot_ds[0] == pytest.approx(_decode_total(m, 1, 200, 5) / 5)
    assert tpot_cl[0] == pytest.approx((_decode_total(m, 1, 200, 5) - m.decode_s(1, 201)) / 4)


def _most_decoding_at_once(tl) -> int:
    """Largest number of requests between their prefill end and their finish at any instant."""
    events = sorted([(t, 1) for t in tl.prefill_end] + [(t, -1) for t in tl.finish],
                    key=lambda e: (e[0], e[1]))
    most = now = 0
    for _, d in events:
        now += d
        most = max(most, now)
    return most


@pytest.mark.parametrize("colocated", [False, True])
def test_decode_batch_cap_bounds_the_batch_and_shortens_steps(colocated):
    """SloScheduler's TPOT cap: at most ``max_batch`` decode at once; each of their steps is the
    shorter step of a smaller batch, while the rest wait for a place."""
    m = _model(dec=(5.0, 0.001, 2.0))
    req = _req([0.0] * 8, [100] * 8, [40] * 8)

    def run(spec):
        return (simulate_colocated(req, [spec]) if colocated
                else simulate_disaggregated(req, [SimInstance(m)], [spec]))

    free, capped = run(SimInstance(m)), run(SimInstance(m, max_batch=3))
    decoding = (capped.finish - capped.first) if not colocated else None
    assert _most_decoding_at_once(free) == 8
    if not colocated:  # disaggregated: decode alone; prefill ends are the same in both runs
        np.testing.assert_allclose(free.prefill_end, capped.prefill_end)
        assert _most_decoding_at_once(capped._replace(prefill_end=capped.first)) <= 3
        assert np.min(decoding) < np.min(free.finish - free.first)  # shorter steps
    else:
        starts = np.sort(capped.prefill_end)
        assert starts[3] >= np.sort(capped.finish)[0]  # the 4th starts once one finished
