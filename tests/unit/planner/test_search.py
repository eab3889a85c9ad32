"""Goodput bisection, SLO scale, placement search vs brute force, launch commands and the CLI
(planner/goodput.py, search.py, commands.py, plan_cli.py, simulate_cli.py)."""

import itertools
import json

import pytest

from kvdisagg.cli import main
from kvdisagg.planner.commands import Launch, launch_commands
from kvdisagg.planner.goodput import SimEnv, SloTarget, goodput, max_rate, tightest_slo_scale
from kvdisagg.planner.placement import Colocated, Disaggregated
from kvdisagg.planner.profile import ParallelProfile, Profile, save_profile
from kvdisagg.planner.search import search_plan
from kvdisagg.planner.trace import draw, load_lengths


def _profile():
    # tp2 is faster per request but not twice as fast: a real trade-off for the search.
    def cfg(tp, k):
        return ParallelProfile(
            tp=tp,
            prefill=(10 / k, 0.1 / k, 1e-5 / k),
            decode_small=(8 / k, 5e-4 / k, 0.05 / k),
            decode_large=(8 / k, 5e-4 / k, 0.05 / k),
            max_num_tokens=60000,
        )
    return Profile(model="toy", configs=(cfg(1, 1.0), cfg(2, 1.6)))


def test_max_rate_finds_threshold():
    r = max_rate(lambda rate: 1.0 if rate <= 3.7 else 0.0, 0.9, start=1.0, rel_tol=0.001)
    assert r.rate == pytest.approx(3.7, rel=0.002) and r.rate <= 3.7
    assert max_rate(lambda rate: 0.5, 0.9).rate == 0.0


def test_goodput_falls_with_tighter_slo_and_scale_is_consistent():
    env = SimEnv(profile=_profile())
    seed = draw(load_lengths("sharegpt"), 400, seed=0)
    pl = Disaggregated()
    loose = goodput(pl, seed, env, SloTarget(ttft_s=1.0, tpot_s=0.1))
    tight = goodput(pl, seed, env, SloTarget(ttft_s=0.3, tpot_s=0.05))
    assert loose.rate > tight.rate > 0
    # At the loose goodput rate, scale 1 of the loose SLO is (just) enough.
    k = tightest_slo_scale(pl, seed.at_rate(loose.rate), env, SloTarget(ttft_s=1.0, tpot_s=0.1))
    assert 0.5 < k <= 1.0


def test_single_request_slo_scale_known_answer():
    env = SimEnv(profile=_profile())
    seed = draw(load_lengths("fixed:100:11"), 1, seed=0)
    m_ttft = (10 + 0.1 * 100 + 1e-5 * 100**2) * 1e-3
    # TTFT SLO = 2x the single-request prefill: scale 0.5 is the tightest met.
    k = tightest_slo_scale(
        Disaggregated(), seed.at_rate(1.0), env, SloTarget(ttft_s=2 * m_ttft, tpot_s=10.0)
    )
    assert k == pytest.approx(0.5, rel=0.01)


@pytest.mark.parametrize("affinity", ["high", "low"])
def test_search_matches_brute_force(affinity):
    env = SimEnv(profile=_profile())
    seed = draw(load_lengths("sharegpt"), 120, seed=0)
    slo = SloTarget(ttft_s=0.4, tpot_s=0.06)
    gpus = 3
    best = 0.0
    for tp_p, tp_d, n_p, n_d in itertools.product((1, 2), (1, 2), (1, 2), (1, 2)):
        pl = Disaggregated(prefill_tp=tp_p, decode_tp=tp_d, num_prefill=n_p, num_decode=n_d)
        if pl.num_gpus <= gpus:
            best = max(best, goodput(pl, seed, env, slo, rel_tol=0.03).rate / pl.num_gpus)
    found = search_plan(seed, env, slo, gpus=gpus, gpus_per_node=gpus, affinity=affinity,
                        rel_tol=0.03)
    assert found.unit.per_gpu == pytest.approx(best, rel=0.04)
    assert found.unit.placement.num_gpus <= gpus
    assert found.colocated is not None and found.colocated.per_gpu > 0


def test_plan_replicates_to_meet_rate():
    env = SimEnv(profile=_profile())
    seed = draw(load_lengths("sharegpt"), 120, seed=0)
    slo = SloTarget(ttft_s=0.4, tpot_s=0.06)
    free = search_plan(seed, env, slo, gpus=3, rel_tol=0.03)
    want = free.unit.goodput * 2.5
    p = search_plan(seed, env, slo, gpus=12, rate=want, rel_tol=0.03)
    assert p.meets_rate and p.predicted_goodput >= want
    assert p.replicas == -(-want // p.unit.goodput)
    assert p.deployment.num_gpus == p.replicas * p.unit.placement.num_gpus <= 12
    short = search_plan(seed, env, slo, gpus=free.unit.placement.num_gpus, rate=want, rel_tol=0.03)
    assert short.meets_rate is False and short.replicas == 1


def test_launch_commands_place_gpus_and_roles():
    pl = Disaggregated(prefill_tp=2, decode_tp=1, num_prefill=2, num_decode=3)
    cmds = launch_commands(pl, "m", gpus_per_node=4, ttft_slo_s=0.25, tpot_slo_s=0.1)
    launches = [c for c in cmds if isinstance(c, Launch)]
    assert [(c.role, c.node, c.gpus) for c in launches] == [
        ("prefill", 0, (0, 1)),
        ("prefill", 0, (2, 3)),
        ("decode", 1, (0,)),
        ("decode", 1, (1,)),
        ("decode", 1, (2,)),
    ]
    assert (
        "--tensor-parallel-size 2" in launches[0].command and "kv_producer" in launches[0].command
    )
    assert (
        "kv_consumer" in launches[2].command and "--tensor-parallel-size" not in launches[2].command
    )
    proxy = cmds[-1]
    assert isinstance(proxy, str) and proxy.startswith(
        "kvdisagg proxy --prefill 'http://<node0>:8100' 'http://<node0>:8101' --decode")
    assert "--slo-ttft 0.25 --slo-tpot 0.1" in proxy
    col = launch_commands(Colocated(tp=4, num_instances=2), "m", gpus_per_node=8)
    assert len(col) == 2 and all("kv-transfer-config" not in c.command for c in col)
    # With the nodes' addresses, every line runs as printed: no placeholder left.
    named = launch_commands(pl, "m", gpus_per_node=4, hosts=["10.0.0.1", "10.0.0.2"])
    assert not any("<node" in (c.command if isinstance(c, Launch) else c) for c in named)
    assert '"side_channel_host":"10.0.0.1"' in named[0].command
    assert "--host 10.0.0.2 --port 8102" in named[2].command


def test_launch_lines_on_cpu_bind_a_core_per_rank_and_start_as_printed():
    import shlex

    from kvdisagg.planner.commands import printed

    pl = Disaggregated(prefill_tp=1, decode_tp=1, decode_pp=2)
    cmds = launch_commands(pl, "/m", gpus_per_node=3, device="cpu",
                           serve_args=["--dtype", "float32"])
    lines = printed(cmds)
    assert lines[0] == "# node 0" and lines[1].endswith(" &") and not lines[-1].endswith("&")
    assert lines[1].startswith(
        "VLLM_CPU_OMP_THREADS_BIND=0 python -m "
        "vllm.entrypoints.openai.api_server --model /m --host 127.0.0.1 --port 8100"
    )
    assert lines[2].startswith("VLLM_CPU_OMP_THREADS_BIND='1|2' python -m")
    assert (
        "--pipeline-parallel-size 2 --distributed-executor-backend mp --dtype float32" in lines[2]
    )
    argv = shlex.split(lines[1][:-2])
    config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert config["kv_role"] == "kv_producer"
    assert config["kv_connector_extra_config"]["side_channel_host"] == "127.0.0.1"
    assert lines[-1].startswith("kvdisagg proxy --prefill http://127.0.0.1:8100 "
                                "--decode http://127.0.0.1:8101")


@pytest.mark.parametrize("placement, why", [
    (Disaggregated(prefill_tp=4, decode_tp=1), "a prefill instance needs 4 devices"),
    (Disaggregated(decode_pp=2, pp_cross=2), "span 2 nodes"),
])
def test_placements_the_connector_does_not_serve_get_no_launch_lines(placement, why):
    from kvdisagg.errors import ConfigError
    from kvdisagg.planner.commands import unserved

    assert why in unserved(placement, gpus_per_node=2)
    with pytest.raises(ConfigError, match=why):
        launch_commands(placement, "m", gpus_per_node=2)


def test_plan_keeps_instances_within_a_node():
    env = SimEnv(profile=_profile())
    seed = draw(load_lengths("sharegpt"), 120, seed=0)
    slo = SloTarget(ttft_s=0.4, tpot_s=0.06)
    for affinity in ("high", "low"):
        found = search_plan(seed, env, slo, gpus=4, gpus_per_node=1 if affinity == "high" else 4,
                     affinity=affinity, rel_tol=0.05)
        for cand in found.candidates:
            assert not unserved_at(cand.placement, 1 if affinity == "high" else 4), cand


def unserved_at(placement, per_node):
    from kvdisagg.planner.commands import unserved

    return unserved(placement, per_node)


def test_cli_simulate_and_plan_json(tmp_path, capsys):
    path = tmp_path / "toy.json"
    save_profile(_profile(), path)
    common = [
        "--profile",
        str(path),
        "--ttft-slo",
        "0.4",
        "--tpot-slo",
        "0.06",
        "--requests",
        "200",
        "--json",
    ]
    assert main(["simulate", *common, "--prefill-tp", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["placement"]["prefill_tp"] == 2 and out["per_gpu"] > 0
    assert main(["simulate", *common, "--colocated", "--rate", "1.0"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert 0 <= out["attainment"] <= 1 and out["slo_scale"] > 0
    assert main(["plan", *common, "--gpus", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["unit"]["per_gpu"] > 0 and any(
        c.startswith("kvdisagg proxy") for c in out["commands"]
    )
    # Bad input is a clear error and exit code 2, not a traceback.
    assert main(["simulate", *common, "--decode-tp", "3"]) == 2
    assert "no config tp=3" in capsys.readouterr().err
    assert main(["plan", *common[:-1], "--gpus", "0"]) == 2
    assert main(["plan", *common[:-1], "--gpus", "1"]) == 2
    assert "at least 2 GPUs" in capsys.readouterr().err
