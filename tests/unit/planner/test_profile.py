"""Profile format, fitting and DistServe import (planner/profile.py, planner/latency.py)."""

from pathlib import Path

import msgspec
import numpy as np
import pytest

from kvdisagg.errors import ConfigError
from kvdisagg.planner.latency import LatencyModel
from kvdisagg.planner.profile import (
    PROFILE_VERSION,
    LatencySample,
    ParallelProfile,
    Profile,
    fit_profile,
    load_profile,
    save_profile,
)

DATA = Path(__file__).resolve().parents[3] / "src/kvdisagg/planner/data/distserve"


def _grid(pre, small, large, *, tp=1, noise=0.0, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for bs in (1, 2, 4, 8, 16, 32, 64, 96, 128):
        for length in (16, 64, 256, 512, 1024):
            t = pre[0] + pre[1] * bs * length + pre[2] * bs * length * length
            out.append(
                LatencySample.uniform(
                    "prefill", bs, length, t * 1e-3 * (1 + noise * rng.standard_normal()), tp=tp
                )
            )
            d = small if bs < 95 else large
            t = d[0] + d[1] * bs * (length + 1) + d[2] * bs
            out.append(
                LatencySample.uniform(
                    "decode", bs, length, t * 1e-3 * (1 + noise * rng.standard_normal()), tp=tp
                )
            )
    return out


def test_fit_recovers_exact_coefficients():
    pre, small, large = (18.1, 0.1019, 7.12e-6), (19.9, 6.27e-4, 0.0385), (7.17, 5.8e-4, 0.158)
    prof = fit_profile(_grid(pre, small, large, tp=2), model="m", max_num_tokens={(2, 1): 1000})
    cfg = prof.get(2, 1)
    np.testing.assert_allclose(cfg.prefill, pre, rtol=1e-6)
    np.testing.assert_allclose(cfg.decode_small, small, rtol=1e-6)
    np.testing.assert_allclose(cfg.decode_large, large, rtol=1e-6)
    assert cfg.max_num_tokens == 1000
    # Fitted samples already include overheads.
    assert cfg.iter_overhead_ms == 0 and cfg.pp_overhead_ms == 0


def test_fit_is_non_negative_and_close_under_noise():
    pre, small = (5.0, 0.05, 0.0), (3.0, 1e-4, 0.02)
    prof = fit_profile(_grid(pre, small, small, noise=0.05, seed=3))
    cfg = prof.get(1)
    assert all(c >= 0 for c in cfg.prefill + cfg.decode_small + cfg.decode_large)
    m = LatencyModel(cfg)
    # Predictions within ~5% of truth on a mid-grid batch.
    assert m.prefill_s(8 * 512, 8 * 512 * 512) == pytest.approx(
        (5.0 + 0.05 * 8 * 512) * 1e-3, rel=0.05
    )


def test_fit_needs_samples():
    with pytest.raises(ConfigError, match="need at least 3"):
        fit_profile([LatencySample.uniform("prefill", 1, 10, 0.01)])
    with pytest.raises(ConfigError, match="no samples"):
        fit_profile([])


def test_sample_validation_at_the_boundary():
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert(
            {"phase": "prefill", "batch_size": 0, "num_tokens": 1, "seconds": 1.0}, LatencySample
        )
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert(
            {"phase": "sideways", "batch_size": 1, "num_tokens": 1, "seconds": 1.0}, LatencySample
        )


def test_save_load_roundtrip_and_version(tmp_path):
    prof = Profile(
        model="m",
        configs=(
            ParallelProfile(
                tp=1,
                prefill=(1, 2, 3),
                decode_small=(4, 5, 6),
                decode_large=(7, 8, 9),
                max_num_tokens=10,
            ),
        ),
    )
    path = tmp_path / "p.json"
    save_profile(prof, path)
    assert load_profile(path) == prof
    raw = msgspec.json.decode(path.read_bytes())
    assert raw["version"] == PROFILE_VERSION
    raw["version"] = 99
    path.write_bytes(msgspec.json.encode(raw))
    with pytest.raises(ConfigError, match="version 99"):
        load_profile(path)


def test_distserve_import_matches_published_formula():
    prof = load_profile(DATA / "profiler-a100-80g.distserve.json", model="facebook/opt-13b")
    assert (1, 1) in prof.parallel_configs() and (2, 1) in prof.parallel_configs()
    cfg = prof.get(1, 1)
    assert cfg.max_num_tokens == 66144 and cfg.decode_bs_threshold == 95
    m = LatencyModel(cfg)
    # (a + b*L + c*L^2)/1 + 1 + 2 + 1e-4*L ms for one 1000-token prompt, by hand from the JSON.
    a, b, c = 18.10254647486372, 0.1019122572698738, 7.122264314252114e-06
    assert m.prefill_s(1000, 1000**2) == pytest.approx(
        (a + b * 1000 + c * 1e6 + 1 + 2 + 0.1) * 1e-3
    )
    # decode, B=10, ctx 500 each: small-batch curve.
    a, b, c = 19.934702624895458, 0.0006269356524350583, 0.03850697740828398
    assert m.decode_s(10, 10 * 501) == pytest.approx(
        (a + b * 5010 + c * 10 + 2 + 1e-4 * 5000) * 1e-3
    )
    # PP divides the work per stage and adds pp ms to each stage; overheads on the first stage only.
    m2 = LatencyModel(prof.get(1, 2))
    work = 18.10254647486372 + 0.1019122572698738 * 1000 + 7.122264314252114e-06 * 1e6
    first, other = m2.prefill_stages_s(1000, 1e6)
    assert other == pytest.approx((work / 2 + 2) * 1e-3)
    assert first == pytest.approx((work / 2 + 2 + 2 + 0.1) * 1e-3)
    assert m2.prefill_s(1000, 1e6) == pytest.approx(first + other)


def test_distserve_file_needs_model():
    with pytest.raises(ConfigError, match="pass --model"):
        load_profile(DATA / "profiler-a100-80g.vllm.json")
    with pytest.raises(ConfigError, match="no model"):
        load_profile(DATA / "profiler-a100-80g.vllm.json", model="facebook/opt-1b")
    with pytest.raises(ConfigError, match="no config tp=3"):
        load_profile(DATA / "profiler-a100-80g.vllm.json", model="facebook/opt-13b").get(3, 1)


def test_planner_never_imports_vllm():
    import subprocess
    import sys

    code = (
        "import sys, kvdisagg.cli\n"
        "import kvdisagg.planner.plan_cli, kvdisagg.planner.simulate_cli, kvdisagg.planner.search\n"
        "import kvdisagg.planner.commands, kvdisagg.planner.cli_common\n"
        "bad = sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.'))\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
