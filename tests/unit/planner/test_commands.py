"""The launch lines' transport and policy, and the kustomize overlay (planner/commands.py)."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvdisagg.errors import ConfigError
from kvdisagg.planner.commands import (
    DECODE_DEPLOYMENT,
    POLICIES,
    PREFILL_DEPLOYMENT,
    TRANSPORTS,
    Launch,
    choose_transport,
    kustomization,
    launch_commands,
)
from kvdisagg.planner.placement import Colocated, Disaggregated

ROOT = Path(__file__).resolve().parents[3]
PAIR = Disaggregated(num_prefill=1, num_decode=1)


def kv_configs(cmds: list[Launch | str]) -> list[dict[str, Any]]:
    out = []
    for c in cmds:
        if isinstance(c, Launch):
            argv = shlex.split(c.command)
            out.append(json.loads(argv[argv.index("--kv-transfer-config") + 1]))
    return out


def test_auto_transport_is_nccl_between_gpus_and_tcp_on_cpu() -> None:
    assert choose_transport("auto", "gpu").name == "nccl"
    assert choose_transport("auto", "cpu").name == "tcp"
    assert choose_transport("mooncake", "gpu") == ("mooncake", "--transport")
    with pytest.raises(ConfigError, match="--transport 'rdma'"):
        choose_transport("rdma", "gpu")


def test_policies_are_the_proxys() -> None:
    from kvdisagg.proxy.types import PolicyName

    assert set(POLICIES) == {p.value for p in PolicyName}


@pytest.mark.parametrize("transport,prefill,decode", [
    ("tcp", {"transport": "tcp", "side_channel_host": "10.0.0.5"}, None),
    ("nccl", {"transport": "nccl", "side_channel_host": "10.0.0.5"}, {"transport": "nccl"}),
    # mooncake: decode's engine listens on its own address too
    ("mooncake", {"transport": "mooncake", "side_channel_host": "10.0.0.5"},
     {"transport": "mooncake", "side_channel_host": "10.0.0.6"}),
    ("lmcache", {"transport": "lmcache", "lmcache_url": "lm://cache:65432",
                 "side_channel_host": "10.0.0.5"},
     {"transport": "lmcache", "lmcache_url": "lm://cache:65432"}),
])
def test_each_side_gets_the_transports_own_config(transport: str, prefill: dict[str, Any],
                                                  decode: dict[str, Any] | None) -> None:
    cmds = launch_commands(PAIR, "m", gpus_per_node=1, hosts=["10.0.0.5", "10.0.0.6"],
                           transport=transport, lmcache_url="lm://cache:65432")
    p_cfg, d_cfg = kv_configs(cmds)
    assert p_cfg["kv_role"] == "kv_producer" and d_cfg["kv_role"] == "kv_consumer"
    assert p_cfg["kv_connector_extra_config"] == prefill
    assert d_cfg.get("kv_connector_extra_config") == decode
    recompute = transport == "lmcache"  # a chunk missing from the store: recomputed
    assert ("kv_load_failure_policy" in p_cfg) == ("kv_load_failure_policy" in d_cfg) == recompute


def test_the_policy_goes_on_the_proxy_line_and_bad_choices_are_refused() -> None:
    for policy in POLICIES:
        proxy = launch_commands(PAIR, "m", gpus_per_node=2, policy=policy)[-1]
        assert isinstance(proxy, str) and f"--policy {policy} " in proxy
    with pytest.raises(ConfigError, match="policy 'fastest'"):
        launch_commands(PAIR, "m", gpus_per_node=2, policy="fastest")
    with pytest.raises(ConfigError, match="transport 'ib'"):
        launch_commands(PAIR, "m", gpus_per_node=2, transport="ib")
    with pytest.raises(ConfigError, match="--lmcache-url lm://HOST:PORT"):
        launch_commands(PAIR, "m", gpus_per_node=2, transport="lmcache")
    assert set(TRANSPORTS) == {"tcp", "nccl", "mooncake", "lmcache"}


def base_dir(tmp_path: Path) -> Path:
    """A base as examples/kubernetes has it: prefill and decode Deployments."""
    base = tmp_path / "base"
    base.mkdir()
    for name in (PREFILL_DEPLOYMENT, DECODE_DEPLOYMENT):
        (base / f"{name}.yaml").write_text(yaml.safe_dump({
            "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name},
            "spec": {"replicas": 2, "selector": {"matchLabels": {"app": name}},
                     "template": {"metadata": {"labels": {"app": name}},
                                  "spec": {"containers": [{"name": "vllm", "image": "x"}]}}}}))
    (base / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": ["prefill.yaml", "decode.yaml"]}))
    return base


def test_the_overlay_sets_both_replica_counts_over_a_relative_base(tmp_path: Path) -> None:
    base, overlay = base_dir(tmp_path), tmp_path / "overlays" / "plan"
    text = kustomization(Disaggregated(num_prefill=3, num_decode=2), str(base), str(overlay))
    doc = yaml.safe_load(text)
    assert doc["resources"] == ["../../base"]
    assert doc["replicas"] == [{"name": "prefill", "count": 3}, {"name": "decode", "count": 2}]
    assert "NOTE" not in text  # TP1 on both sides: the base's pods as they are
    tp2 = kustomization(Disaggregated(prefill_tp=2, decode_pp=2), str(base), str(overlay))
    notes = [line for line in tp2.splitlines() if line.startswith("# NOTE")]
    assert notes == [
        "# NOTE: the plan's prefill runs TP2PP1 on 2 GPUs: add --tensor-parallel-size 2 and set "
        "nvidia.com/gpu: 2 in the base's prefill Deployment",
        "# NOTE: the plan's decode runs TP1PP2 on 2 GPUs: add --pipeline-parallel-size 2 and set "
        "nvidia.com/gpu: 2 in the base's decode Deployment"]
    remote = "github.com/org/fleet//k8s?ref=v1"
    assert yaml.safe_load(kustomization(PAIR, remote, str(overlay)))["resources"] == [remote]


def test_the_overlay_refuses_what_it_cannot_scale(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no kustomization.yaml there"):
        kustomization(PAIR, str(tmp_path), str(tmp_path / "o"))
    with pytest.raises(ConfigError, match="the plan is 2 colocated"):
        kustomization(Colocated(num_instances=2), str(base_dir(tmp_path)), str(tmp_path / "o"))


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (kustomize) not installed")
def test_kustomize_builds_the_overlay(tmp_path: Path) -> None:
    base, overlay = base_dir(tmp_path), tmp_path / "overlay"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(
        kustomization(Disaggregated(num_prefill=3, num_decode=5), str(base), str(overlay)))
    built = subprocess.run(["kubectl", "kustomize", str(overlay)], capture_output=True,
                           text=True, timeout=60, check=True).stdout
    replicas = {d["metadata"]["name"]: d["spec"]["replicas"] for d in yaml.safe_load_all(built)}
    assert replicas == {"prefill": 3, "decode": 5}


def test_the_example_deployments_have_the_names_the_overlay_scales() -> None:
    """examples/kubernetes (however its files are laid out) defines one Deployment of each name
    (patches of it aside), running that side's role."""
    roles: dict[str, list[str]] = {}
    for path in sorted((ROOT / "examples" / "kubernetes").rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict) and doc.get("kind") == "Deployment" and (
                    "selector" in doc.get("spec", {})):  # a definition, not a patch
                roles.setdefault(doc["metadata"]["name"], []).append(json.dumps(doc))
    assert len(roles.get(PREFILL_DEPLOYMENT, [])) == 1, roles.keys()
    assert len(roles.get(DECODE_DEPLOYMENT, [])) == 1, roles.keys()
    assert "kv_producer" in roles[PREFILL_DEPLOYMENT][0]
    assert "kv_consumer" in roles[DECODE_DEPLOYMENT][0]
