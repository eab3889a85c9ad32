"""``kvdisagg plan``'s output (planner/plan_cli.py): the transport and policy of its launch
lines, each with the reason it was chosen, and the replica counts as a kustomize overlay."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from kvdisagg.cli import main
from kvdisagg.planner.profile import ParallelProfile, Profile, save_profile


@pytest.fixture(scope="module")
def profile(tmp_path_factory: pytest.TempPathFactory) -> str:
    config = ParallelProfile(tp=1, prefill=(10, 0.1, 1e-5), decode_small=(8, 5e-4, 0.05),
                             decode_large=(8, 5e-4, 0.05), max_num_tokens=60000)
    path = tmp_path_factory.mktemp("plan") / "toy.json"
    save_profile(Profile(model="toy", configs=(config,)), path)
    return str(path)


def plan(profile: str, *more: str) -> list[str]:
    return ["plan", "--profile", profile, "--ttft-slo", "0.4", "--tpot-slo", "0.06",
            "--requests", "200", "--gpus", "2", *more]


def test_the_chosen_transport_and_policy_are_printed_and_used(
        profile: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(plan(profile)) == 0
    out = capsys.readouterr().out
    assert "transport : nccl (auto on GPUs: KV moves device to device" in out
    assert "policy    : least_loaded (what the simulator dispatches by" in out
    launch = out.split("\nlaunch")[1]
    assert launch.count('"transport":"nccl"') == 2 and "--policy least_loaded" in launch
    assert main(plan(profile, "--device", "cpu", "--policy", "slo_aware")) == 0
    out = capsys.readouterr().out
    assert "transport : tcp (auto on CPU" in out and "policy    : slo_aware (--policy)" in out
    assert '"transport":"tcp"' in out and "--policy slo_aware" in out


def test_json_says_which_transport_and_policy(profile: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert main(plan(profile, "--transport", "mooncake", "--json")) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["transport"] == {"name": "mooncake", "why": "--transport"}
    assert out["policy"]["name"] == "least_loaded"
    assert all('"transport":"mooncake"' in c for c in out["commands"][:-1])


def test_lmcache_without_its_server_is_a_usage_error(profile: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert main(plan(profile, "--transport", "lmcache")) == 2
    assert "kvdisagg plan: transport lmcache needs" in capsys.readouterr().err
    assert main(plan(profile, "--transport", "lmcache", "--lmcache-url", "lm://c:65432")) == 0


def test_kustomize_writes_the_replica_counts(profile: str, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    base = tmp_path / "base"
    base.mkdir()
    (base / "kustomization.yaml").write_text("resources: []\n")
    overlay = tmp_path / "overlays" / "planned"
    assert main(plan(profile, "--kustomize", str(overlay), "--kustomize-base", str(base),
                     "--json")) == 0
    out = json.loads(capsys.readouterr().out)
    doc = yaml.safe_load((overlay / "kustomization.yaml").read_text())
    dep = out["deployment"]
    assert doc["resources"] == ["../../base"]
    assert doc["replicas"] == [{"name": "prefill", "count": dep["num_prefill"]},
                               {"name": "decode", "count": dep["num_decode"]}]
    assert out["kustomization"] == str(overlay / "kustomization.yaml")
    assert main(plan(profile, "--kustomize", str(overlay), "--kustomize-base", str(base))) == 0
    assert f"kustomize overlay: {overlay / 'kustomization.yaml'} (prefill " in \
        capsys.readouterr().out
    assert main(plan(profile, "--kustomize", str(tmp_path / "o"), "--kustomize-base",
                     str(tmp_path / "nowhere"))) == 2
    assert "no kustomization.yaml there" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
