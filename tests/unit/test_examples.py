"""Offline checks of examples/: Kubernetes manifests (the base and every overlay, built by
kustomize's rules, tests/support/kustomize.py) against the API schemas and against each
other, shell syntax, every ``--kv-transfer-config`` and every ``kvdisagg proxy`` flag. Nothing
here starts a process other than ``bash -n`` and, where installed, ``kubectl kustomize``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import urlsplit

import msgspec
import pytest
import yaml

from kvdisagg.connector.config import parse_config
from kvdisagg.proxy import admin_cli
from kvdisagg.proxy.cli import add_arguments
from kvdisagg.proxy.config import load_config_file
from kvdisagg.proxy.routing.kv_events import source_from_publisher
from tests.support import kustomize

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
K8S = EXAMPLES / "kubernetes"
K8S_BASE = K8S / "base"
K8S_VERSION = "1.30.0"
# What is built and checked: `kubectl apply -k examples/kubernetes` (the base), each overlay,
# and the base with every component at once (what a user's own overlay may combine).
K8S_BUILDS = ("base", "keda", "rdma", "all")
EXAMPLE_DIRS = ("cpu-1p1d", "gpu-xpyd", "behind-vllm-router", "kubernetes")
# Placeholders the examples fill in at run time, and a sample value for each.
PLACEHOLDERS = {"$(POD_IP)": "10.0.0.7", "@HOST@": "10.0.0.1", "@RDMA@": "mlx5_0",
                "@LMCACHE_PORT@": "65432", "@SIDE_PORT@": "7100", "@STORE_PORT@": "7200",
                "@MOONCAKE_PORT@": "7300"}
# Custom resources: no built-in schema; checked structurally. Never in the base.
CRDS = {("keda.sh/v1alpha1", "ScaledObject")}
WORKLOAD_KINDS = {"Deployment", "StatefulSet"}
VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def example_files(*suffixes: str) -> list[Path]:
    return sorted(p for p in EXAMPLES.rglob("*") if p.is_file() and p.suffix in suffixes)


def all_components() -> dict[str, Any]:
    """The base with every component of components/, as a kustomization in overlays/."""
    base = kustomize.load_kustomization(K8S_BASE)
    return {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
            "namespace": base["namespace"], "labels": base["labels"], "resources": ["../base"],
            "components": [f"../components/{p.name}"
                           for p in sorted((K8S / "components").iterdir()) if p.is_dir()]}


@functools.cache
def _built(build: str) -> str:
    if build == "base":
        docs = kustomize.build(K8S)
    elif build == "all":
        docs = kustomize.build(K8S / "overlays", all_components())
    else:
        docs = kustomize.build(K8S / "overlays" / build)
    return json.dumps(docs)


def k8s_docs(build: str = "base") -> list[dict[str, Any]]:
    """The build's resources, a fresh copy each call (tests may change them)."""
    docs: list[dict[str, Any]] = json.loads(_built(build))
    return docs


def by_kind(kind: str, build: str = "base") -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in k8s_docs(build) if d["kind"] == kind}


def workloads(build: str = "base") -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in k8s_docs(build) if d["kind"] in WORKLOAD_KINDS}


def namespace() -> str:
    ns: str = kustomize.load_kustomization(K8S_BASE)["namespace"]
    return ns


def pod_labels(w: dict[str, Any]) -> dict[str, str]:
    return w["spec"]["template"]["metadata"]["labels"]


def pod_spec(w: dict[str, Any]) -> dict[str, Any]:
    return w["spec"]["template"]["spec"]


def containers(w: dict[str, Any]) -> list[dict[str, Any]]:
    return w["spec"]["template"]["spec"]["containers"]


def is_vllm(c: dict[str, Any]) -> bool:
    return "--kv-transfer-config" in c.get("args", [])


def container_env(c: dict[str, Any]) -> dict[str, str]:
    """The container's environment as Kubernetes makes it: ``$(VAR)`` in a value expanded from
    the entries above it (any other reference stays as written); the pod IP as the sample
    address, a Secret's value as ``<NAME>``."""
    env: dict[str, str] = {}
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = VAR_REF.sub(lambda m: env.get(m[1], m[0]), e["value"])
        elif e["valueFrom"].get("fieldRef", {}).get("fieldPath") == "status.podIP":
            env[e["name"]] = PLACEHOLDERS["$(POD_IP)"]
        else:
            env[e["name"]] = f"<{e['name']}>"
    return env


def expanded_args(c: dict[str, Any]) -> list[str]:
    """The container's args after Kubernetes expanded ``$(VAR)`` from its environment."""
    env = container_env(c)
    return [VAR_REF.sub(lambda m: env.get(m[1], m[0]), a) for a in c.get("args", [])]


def flag_value(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def kv_transfer_config(c: dict[str, Any]) -> dict[str, Any]:
    cfg: dict[str, Any] = json.loads(flag_value(expanded_args(c), "--kv-transfer-config"))
    return cfg


# ---------------------------------------------------------------- the layout

def test_every_example_has_a_readme_listed_at_the_root():
    index = (EXAMPLES / "README.md").read_text()
    for name in EXAMPLE_DIRS:
        assert (EXAMPLES / name / "README.md").is_file(), f"examples/{name}/README.md missing"
        assert f"({name}/" in index or f"({name})" in index, (
            f"examples/README.md: no link to {name}"
        )


def test_deployment_doc_is_linked_from_the_readme():
    assert (ROOT / "docs" / "deployment.md").is_file()
    assert "(docs/deployment.md)" in (ROOT / "README.md").read_text()


def test_relative_links_in_example_docs_resolve():
    for md in [*example_files(".md"), ROOT / "docs" / "deployment.md"]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", md.read_text()):
            if "://" in target:
                continue
            assert (md.parent / target).exists(), f"{md.relative_to(ROOT)}: broken link {target}"


# ---------------------------------------------------------------- shell scripts

@pytest.mark.parametrize("script", example_files(".sh"), ids=lambda p: str(p.relative_to(EXAMPLES)))
def test_shell_syntax(script: Path):
    res = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def test_bash_n_can_fail(tmp_path: Path):
    bad = tmp_path / "bad.sh"
    bad.write_text("if true; then\n  echo unterminated\n")
    assert subprocess.run(["bash", "-n", str(bad)], capture_output=True).returncode != 0


# ---------------------------------------------------------------- --kv-transfer-config

def balanced_objects(text: str, opener: str) -> list[str]:
    """Every brace-balanced text that starts with ``opener`` (which starts with '{')."""
    out, start = [], text.find(opener)
    while start != -1:
        depth = 0
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                out.append(text[start:i + 1])
                break
        start = text.find(opener, start + 1)
    return out


def kv_transfer_configs(path: Path) -> list[dict[str, Any]]:
    configs = []
    for raw in balanced_objects(path.read_text(), '{"kv_connector"'):
        for placeholder, value in PLACEHOLDERS.items():
            raw = raw.replace(placeholder, value)
        try:
            configs.append(json.loads(raw))
        except json.JSONDecodeError as exc:
            raise AssertionError(f"{path.relative_to(ROOT)}: not JSON: {raw}: {exc}") from None
    return configs


def check_kv_transfer_config(cfg: dict[str, Any], where: str) -> None:
    assert cfg["kv_connector"] == "DisaggConnector", where
    assert cfg["kv_role"] in ("kv_producer", "kv_consumer", "kv_both"), where
    unknown = set(cfg) - {"kv_connector", "kv_role", "kv_connector_extra_config",
                          "kv_connector_module_path", "kv_load_failure_policy"}
    assert not unknown, f"{where}: keys vLLM's KVTransferConfig lacks: {unknown}"
    parse_config(cfg.get("kv_connector_extra_config"))


def test_every_kv_transfer_config_parses():
    seen = 0
    for path in example_files(".sh", ".md", ".yaml"):
        text = path.read_text()
        configs = kv_transfer_configs(path)
        if "kv-transfer-config" in text and path.suffix in (".sh", ".yaml"):
            assert configs, f"{path.relative_to(ROOT)} mentions --kv-transfer-config, none parsed"
        for cfg in configs:
            if cfg["kv_connector"] == "NixlConnector":  # the "replace this" of the llm-d note
                continue
            check_kv_transfer_config(cfg, str(path.relative_to(ROOT)))
            seen += 1
    assert seen >= 10
    for transport in ("tcp", "nccl", "mooncake", "lmcache"):
        text = (EXAMPLES / "gpu-xpyd" / "launch.sh").read_text() + (
            EXAMPLES / "cpu-1p1d" / "run.sh").read_text()
        assert f'"transport":"{transport}"' in text


def test_kv_transfer_config_check_can_fail():
    with pytest.raises(Exception, match="side_channel_hots"):
        check_kv_transfer_config({"kv_connector": "DisaggConnector", "kv_role": "kv_producer",
                                  "kv_connector_extra_config": {"side_channel_hots": "x"}}, "t")
    with pytest.raises(AssertionError):
        check_kv_transfer_config({"kv_connector": "NixlConnector", "kv_role": "kv_both"}, "t")


# ---------------------------------------------------------------- kvdisagg proxy flags

def proxy_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvdisagg proxy")
    add_arguments(p)
    return p


PROXY_CMD = re.compile(r"""(?:\bkvdisagg|\$\{?KVDISAGG\}?"?|kvdisagg\.cli)\s+proxy\b""")


def proxy_flags_in_text(text: str) -> list[str]:
    """The --flags of every ``kvdisagg proxy`` command line in a script or a doc."""
    flags = []
    text = text.replace("\\\n", " ")
    for m in PROXY_CMD.finditer(text):
        line = text[m.end():].split("\n", 1)[0].split(" #", 1)[0]
        flags += re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", line)
    return flags


def proxy_flags_in_k8s() -> list[str]:
    flags = []
    for w in workloads().values():
        for c in containers(w):
            if c.get("command", [])[:2] == ["kvdisagg", "proxy"]:
                flags += [a for a in c.get("args", []) if a.startswith("--")]
    return flags


def test_every_proxy_flag_exists():
    known = set(proxy_parser()._option_string_actions)
    used: dict[str, list[str]] = {}
    for path in [*example_files(".sh", ".md"), ROOT / "docs" / "deployment.md"]:
        for flag in proxy_flags_in_text(path.read_text()):
            used.setdefault(flag, []).append(str(path.relative_to(ROOT)))
    for flag in proxy_flags_in_k8s():
        used.setdefault(flag, []).append("examples/kubernetes")
    assert {"--prefill", "--decode", "--policy", "--config", "--prefill-dns"} <= set(used), sorted(
        used
    )
    unknown = {f: w for f, w in used.items() if f not in known}
    assert not unknown, f"flags kvdisagg proxy does not have: {unknown}"


def test_proxy_flag_check_can_fail():
    assert proxy_flags_in_text("kvdisagg proxy --prefill http://a --no-such-flag 1\n") == [
        "--prefill", "--no-such-flag"]
    assert "--no-such-flag" not in proxy_parser()._option_string_actions


def test_proxy_config_files_load():
    cfg = load_config_file(EXAMPLES / "gpu-xpyd" / "proxy.yaml").validate()
    assert cfg.policy.prefill == cfg.policy.decode == "slo_aware"



# ---------------------------------------------------------------- Kubernetes: the builds

KUSTOMIZATION_DIRS = sorted(p.parent for p in K8S.rglob("kustomization.yaml")
                            if "monitoring" not in p.relative_to(K8S).parts)


@pytest.mark.parametrize("root", KUSTOMIZATION_DIRS, ids=lambda p: str(p.relative_to(K8S)) or ".")
def test_kustomizations_list_their_files(root: Path):
    """Every path a kustomization names exists, and every YAML file beside it is used."""
    kust = kustomize.load_kustomization(root)
    used = set()
    for res in [*kust.get("resources", []), *kust.get("components", [])]:
        assert (root / res).exists(), f"{root.relative_to(K8S)}: {res} does not exist"
        used.add((root / res).resolve())
    for entry in kust.get("patches", []):
        assert (root / entry["path"]).is_file(), f"{root.relative_to(K8S)}: {entry} missing"
        used.add((root / entry["path"]).resolve())
    on_disk = {p.resolve() for p in root.glob("*.yaml")} - {(root / "kustomization.yaml").resolve()}
    assert on_disk <= used, f"{root.relative_to(K8S)}: not listed: {sorted(on_disk - used)}"


def test_every_overlay_and_component_is_built_here():
    overlays = {p.name for p in (K8S / "overlays").iterdir() if p.is_dir()}
    assert overlays == set(K8S_BUILDS) - {"base", "all"}, overlays
    assert kustomize.load_kustomization(K8S)["resources"] == ["base"]
    for name in overlays:
        kust = kustomize.load_kustomization(K8S / "overlays" / name)
        assert kust["resources"] == ["../../base"], name
        # a base's namespace and labels reach only the base's own resources: each overlay
        # repeats them for what its components add
        base = kustomize.load_kustomization(K8S_BASE)
        assert (kust["namespace"], kust["labels"]) == (base["namespace"], base["labels"]), name
    text = (K8S / "README.md").read_text()
    for comp in (K8S / "components").iterdir():
        assert f"components/{comp.name}" in text, f"README.md does not mention {comp.name}"
    for name in overlays:
        assert f"kubectl apply -k examples/kubernetes/overlays/{name}" in text, name


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="no kubectl (its kustomize)")
@pytest.mark.parametrize("build", K8S_BUILDS)
def test_builds_match_kubectl_kustomize(build: str, tmp_path: Path):
    """tests/support/kustomize.py builds what kustomize itself (kubectl's) builds, field for
    field and in every list's order."""
    if build == "base":
        root = K8S
    elif build == "all":
        root = tmp_path
        kust = all_components()
        rel = os.path.relpath(K8S / "overlays", tmp_path)
        kust["resources"] = [f"{rel}/{r}" for r in kust["resources"]]
        kust["components"] = [f"{rel}/{c}" for c in kust["components"]]
        (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(kust))
    else:
        root = K8S / "overlays" / build
    out = subprocess.run(["kubectl", "kustomize", str(root)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr

    def keyed(docs: Any) -> dict[tuple[str, str], Any]:
        return {(d["kind"], d["metadata"]["name"]): json.loads(json.dumps(d)) for d in docs}
    theirs = keyed(d for d in yaml.safe_load_all(out.stdout) if d)
    ours = keyed(k8s_docs(build))
    assert sorted(ours) == sorted(theirs)
    for key, doc in ours.items():
        assert doc == theirs[key], f"{build}: {key} differs from kubectl kustomize's"


def test_kustomize_subset_refuses_what_it_does_not_implement(tmp_path: Path):
    (tmp_path / "kustomization.yaml").write_text("resources: []\nreplicas: [{name: x}]\n")
    with pytest.raises(kustomize.KustomizeError, match="replicas"):
        kustomize.build(tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        "patches: [{path: p.yaml, target: {kind: Deployment}}]\n")
    with pytest.raises(kustomize.KustomizeError, match="only `path:`"):
        kustomize.build(tmp_path)
    with pytest.raises(kustomize.KustomizeError, match=r"\$patch"):
        kustomize.merge({"a": [1]}, {"a": [{"$patch": "replace"}], "$patch": "delete"})
    # env entries merge by name, the patch's first; a null removes a field
    base = {"env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}],
            "emptyDir": {}, "args": ["x"]}
    kustomize.merge(base, {"env": [{"name": "B", "value": "3"}, {"name": "C", "value": "4"}],
                           "emptyDir": None, "args": ["y"]})
    assert base == {"env": [{"name": "B", "value": "3"}, {"name": "C", "value": "4"},
                            {"name": "A", "value": "1"}], "args": ["y"]}


# ---------------------------------------------------------------- Kubernetes: schemas

@pytest.mark.parametrize("build,doc", [(b, d) for b in K8S_BUILDS for d in k8s_docs(b)],
                         ids=lambda x: x if isinstance(x, str)
                         else f"{x['kind']}/{x['metadata']['name']}")
def test_manifest_validates(build: str, doc: dict[str, Any]):
    if (doc.get("apiVersion"), doc.get("kind")) in CRDS:
        assert build != "base", f"the base must apply without CRDs: {doc['kind']} in it"
        check_scaled_object(doc, build)
        return
    if doc["kind"] not in kustomize.CLUSTER_SCOPED:
        assert doc["metadata"]["namespace"] == namespace(), doc["metadata"]
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_schema_validation_can_fail():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    doc = by_kind("Deployment")["kvdisagg-proxy"]
    bad = json.loads(json.dumps(doc))
    bad["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "eight"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)
    bad = json.loads(json.dumps(doc))
    bad["spec"]["replica"] = 1   # a typo: strict refuses unknown fields
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def check_scaled_object(doc: dict[str, Any], build: str = "keda") -> None:
    assert doc["apiVersion"] == "keda.sh/v1alpha1" and doc["kind"] == "ScaledObject"
    name = doc["metadata"]["name"]
    spec = doc["spec"]
    assert set(spec) <= {"scaleTargetRef", "minReplicaCount", "maxReplicaCount", "cooldownPeriod",
                         "pollingInterval", "idleReplicaCount", "fallback", "advanced",
                         "triggers"}, f"ScaledObject {name}: unknown keys"
    target = spec["scaleTargetRef"]
    ws = workloads(build)
    assert target["name"] in ws, f"ScaledObject {name}: no workload {target['name']}"
    assert ws[target["name"]]["kind"] == target.get("kind", "Deployment")
    # KEDA's HPA owns the count: a `replicas` in the manifest would undo it at every apply
    assert "replicas" not in ws[target["name"]]["spec"], f"{target['name']}: replicas is set"
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    assert spec["triggers"], f"ScaledObject {name}: no triggers"
    documented = set(
        re.findall(r"`(kvdisagg_proxy_\w+)`", (ROOT / "docs" / "proxy.md").read_text())
    )
    for trig in spec["triggers"]:
        assert trig["type"] == "prometheus"
        meta = trig["metadata"]
        assert {"serverAddress", "query", "threshold"} <= set(meta)
        assert isinstance(meta["threshold"], str) and float(meta["threshold"]) > 0
        metrics = re.findall(r"kvdisagg_proxy_\w+", meta["query"])
        assert metrics and set(metrics) <= documented, f"not in docs/proxy.md: {metrics}"


def test_scaled_object_check_can_fail():
    doc = json.loads(json.dumps(by_kind("ScaledObject", "keda")["decode"]))
    doc["spec"]["triggers"][0]["metadata"]["query"] = "sum(kvdisagg_proxy_no_such_metric)"
    with pytest.raises(AssertionError):
        check_scaled_object(doc)
    doc = json.loads(json.dumps(by_kind("ScaledObject", "keda")["decode"]))
    doc["spec"]["scaleTargetRef"]["name"] = "decoder"
    with pytest.raises(AssertionError):
        check_scaled_object(doc)
    doc = json.loads(json.dumps(by_kind("ScaledObject", "keda")["decode"]))
    with pytest.raises(AssertionError, match="replicas is set"):
        check_scaled_object(doc, "base")  # the base's Deployments keep their replicas


def test_keda_is_an_overlay_whose_comments_match_the_discovery():
    assert not by_kind("ScaledObject"), "the base must apply without KEDA's CRDs"
    assert {s["spec"]["scaleTargetRef"]["name"] for s in by_kind("ScaledObject", "keda").values()
            } == {"prefill", "decode"}
    text = (K8S / "components" / "keda" / "scaledobjects.yaml").read_text()
    assert "DNS discovery" not in text and "discovery.kubernetes" in text


# ---------------------------------------------------------------- Kubernetes: references

def container_ports(w: dict[str, Any]) -> dict[str, int]:
    ports = {}
    for c in containers(w):
        for p in c.get("ports", []):
            ports[p.get("name", str(p["containerPort"]))] = p["containerPort"]
            ports[str(p["containerPort"])] = p["containerPort"]
    return ports


def selected(svc: dict[str, Any], build: str = "base") -> list[dict[str, Any]]:
    sel = svc["spec"]["selector"]
    return [w for w in workloads(build).values() if sel.items() <= pod_labels(w).items()]


def check_services(services: dict[str, dict[str, Any]], build: str = "base") -> None:
    for name, svc in services.items():
        ws = selected(svc, build)
        assert ws, f"Service {name}: selector {svc['spec']['selector']} matches no pod template"
        for p in svc["spec"]["ports"]:
            target = str(p.get("targetPort", p["port"]))
            for w in ws:
                assert target in container_ports(w), (
                    f"Service {name}: targetPort {target} is no containerPort of "
                    f"{w['metadata']['name']} ({sorted(container_ports(w))})")


@pytest.mark.parametrize("build", K8S_BUILDS)
def test_services_select_pods_and_ports(build: str):
    check_services(by_kind("Service", build), build)


def test_service_check_can_fail():
    bad = json.loads(json.dumps(by_kind("Service")["decode"]))
    bad["spec"]["selector"]["kvdisagg/role"] = "decoder"
    with pytest.raises(AssertionError, match="matches no pod template"):
        check_services({"decode": bad})
    bad = json.loads(json.dumps(by_kind("Service")["prefill"]))
    bad["spec"]["ports"][1]["targetPort"] = 5601
    with pytest.raises(AssertionError, match="no containerPort"):
        check_services({"prefill": bad})


@pytest.mark.parametrize("build", K8S_BUILDS)
def test_workload_selectors_and_probes_name_ports(build: str):
    for name, w in workloads(build).items():
        sel = w["spec"]["selector"]["matchLabels"]
        assert sel.items() <= pod_labels(w).items(), f"{name}: selector does not match its pods"
        for c in containers(w):
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                if probe in c:
                    assert str(c[probe]["httpGet"]["port"]) in container_ports(w), f"{name} {probe}"


def check_env_references(c: dict[str, Any], where: str) -> None:
    """Every ``$(VAR)`` resolves: in an env value, to an entry above it (Kubernetes expands
    only those; a patch that reorders env breaks this); in args and command, to any entry."""
    names: list[str] = []
    for e in c.get("env", []):
        for ref in VAR_REF.findall(e.get("value", "")):
            assert ref in names, f"{where}: env {e['name']} uses $({ref}), not defined above it"
        names.append(e["name"])
    for word in [*c.get("command", []), *c.get("args", [])]:
        for ref in VAR_REF.findall(word):
            assert ref in names, f"{where}: $({ref}) in the command line is no env entry"


@pytest.mark.parametrize("build", K8S_BUILDS)
def test_env_references_resolve(build: str):
    for name, w in workloads(build).items():
        for c in containers(w):
            check_env_references(c, f"{build}: {name}")
            assert not any("$(" in a for a in expanded_args(c)), name


def test_env_reference_check_can_fail():
    c = json.loads(json.dumps(containers(workloads("rdma")["prefill"])[0]))
    check_env_references(c, "ok")
    c["env"] = [e for e in c["env"] if e["name"] != "POD_IP"] + [
        e for e in c["env"] if e["name"] == "POD_IP"]   # the order a careless patch leaves
    with pytest.raises(AssertionError, match=r"uses \$\(POD_IP\), not defined above it"):
        check_env_references(c, "bad")


@pytest.mark.parametrize("build", K8S_BUILDS)
def test_vllm_pods_side_channel_and_gpu(build: str):
    pod_ip = PLACEHOLDERS["$(POD_IP)"]
    seen = set()
    for name, w in workloads(build).items():
        for c in containers(w):
            if not is_vllm(c):
                continue
            assert c["resources"]["requests"]["nvidia.com/gpu"] == 1, name
            assert c["readinessProbe"]["httpGet"]["path"] == "/health", name
            cfg = kv_transfer_config(c)
            check_kv_transfer_config(cfg, name)
            seen.add(cfg["kv_role"])
            extra = cfg.get("kv_connector_extra_config", {})
            if cfg["kv_role"] in ("kv_producer", "kv_both"):
                # the address decode reads from: this pod's own (the downward API's pod IP)
                assert extra["side_channel_host"] == pod_ip, f"{name}: advertise the pod IP"
                env = {e["name"]: e for e in c.get("env", [])}
                assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
                assert extra["side_channel_port"] in container_ports(w).values(), (
                    f"{name}: side_channel_port {extra['side_channel_port']} not a containerPort")
                (svc,) = [v for v in by_kind("Service", build).values()
                          if w in selected(v, build)]
                assert extra["side_channel_port"] in [p["port"] for p in svc["spec"]["ports"]]
    assert seen == {"kv_producer", "kv_consumer"}, seen


# vLLM 0.32's KVEventsConfig (a pydantic dataclass that refuses other keys); importing vLLM
# here would cost most of a minute.
VLLM_KV_EVENTS_FIELDS = {"enable_kv_cache_events", "publisher", "endpoint", "replay_endpoint",
                         "buffer_steps", "hwm", "max_queue_size", "topic"}


@pytest.mark.parametrize("build", K8S_BUILDS)
def test_vllm_pods_publish_kv_events_where_the_proxy_subscribes(build: str, tmp_path: Path):
    """The proxy's cache index: each vLLM pod publishes its KV cache events; the address the
    proxy derives from ``GET /kv_event_sources`` (its own code) is a port the pod declares, by
    the names the NetworkPolicies open to the proxy."""
    cfg, _ = proxy_config_from_configmap(tmp_path)
    assert cfg.cache_index.enabled, "the proxy's cache index is off"
    assert by_kind("ConfigMap", build) == by_kind("ConfigMap"), "overlays change no config"
    pod_ip = PLACEHOLDERS["$(POD_IP)"]
    n = 0
    for name, w in workloads(build).items():
        for c in containers(w):
            if not is_vllm(c):
                continue
            n += 1
            events = json.loads(flag_value(expanded_args(c), "--kv-events-config"))
            assert set(events) <= VLLM_KV_EVENTS_FIELDS, set(events) - VLLM_KV_EVENTS_FIELDS
            url = f"http://{pod_ip}:{cfg.discovery.kubernetes.port}"
            src = source_from_publisher({"0": events}, url)
            assert src.replay_endpoint, f"{name}: no replay endpoint (a lost event drops all)"
            by_port = {v: k for k, v in container_ports(w).items() if not k.isdigit()}
            for endpoint, port_name in ((src.endpoint, "kv-events"),
                                        (src.replay_endpoint, "kv-replay")):
                host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
                assert host == pod_ip, f"{name}: {endpoint} is not at the pod's address"
                assert by_port.get(int(port)) == port_name, (
                    f"{name}: {endpoint}: port {port} is not declared as {port_name}")
    assert n == 2


# ---------------------------------------------------------------- Kubernetes: NetworkPolicies

def port_matches(spec: dict[str, Any], name: str, number: int) -> bool:
    if spec.get("protocol", "TCP") != "TCP":
        return False
    port = spec.get("port")
    if port is None:
        return True
    if isinstance(port, str):
        return port == name
    return bool(port == number or (spec.get("endPort") and port <= number <= spec["endPort"]))


def admitted(w: dict[str, Any], name: str, number: int, build: str) -> set[str]:
    """Who the NetworkPolicies selecting ``w``'s pods let in on that TCP port: the names of
    this namespace's workloads a peer selects, ``anyone`` (a rule with no ``from``), or
    ``outside:<peer>`` for a peer in other namespaces."""
    out: set[str] = set()
    for np in by_kind("NetworkPolicy", build).values():
        sel = np["spec"]["podSelector"].get("matchLabels", {})
        if not sel.items() <= pod_labels(w).items():
            continue
        assert np["spec"]["policyTypes"] == ["Ingress"], np["metadata"]["name"]
        for rule in np["spec"].get("ingress", []):
            assert rule.get("ports"), f"{np['metadata']['name']}: a rule open on every port"
            if not any(port_matches(p, name, number) for p in rule["ports"]):
                continue
            if "from" not in rule:
                out.add("anyone")
            for peer in rule.get("from", []):
                if set(peer) == {"podSelector"}:
                    want = peer["podSelector"]["matchLabels"]
                    out |= {n for n, o in workloads(build).items()
                            if want.items() <= pod_labels(o).items()}
                else:
                    out.add("outside:" + json.dumps(peer, sort_keys=True))
    return out


def check_network_policies(build: str) -> None:
    ws = workloads(build)
    proxy = {n for n, w in ws.items() if any(not is_vllm(c) for c in containers(w))}
    role = {n: pod_labels(w).get("kvdisagg/role") for n, w in ws.items()}
    decode = {n for n, r in role.items() if r == "decode"}
    prefill = {n for n, r in role.items() if r == "prefill"}
    for name, w in ws.items():
        assert any(np["spec"]["podSelector"]["matchLabels"].items() <= pod_labels(w).items()
                   for np in by_kind("NetworkPolicy", build).values()), (
            f"{name}: no NetworkPolicy selects its pods (every port open)")
        for port_name, number in container_ports(w).items():
            if port_name.isdigit():
                continue
            who = admitted(w, port_name, number, build)
            assert who, f"{name}: port {port_name} ({number}) is declared but closed"
            where = f"{build}: {name}: port {port_name} admits {sorted(who)}"
            if name in proxy and port_name == "http":   # the clients
                assert "anyone" in who, where
            elif name in proxy and port_name == "admin":   # the preStop drains
                assert who == prefill | decode, where
            elif port_name == "http":   # vLLM's API: the proxy; Prometheus elsewhere
                outside = {p for p in who if p.startswith("outside:")}
                assert who - outside == proxy, where
                for p in outside:   # one namespace, its Prometheus pods only
                    peer = json.loads(p.removeprefix("outside:"))
                    assert set(peer) == {"namespaceSelector", "podSelector"}, where
            elif port_name in ("kv-events", "kv-replay"):   # the proxy's cache index
                assert who == proxy, where
            elif port_name.startswith("side-channel"):   # decode's pulls
                assert name in prefill and who == decode, where
            else:
                raise AssertionError(f"{where}: a port this test does not know")
        extras = [kv_transfer_config(c)["kv_connector_extra_config"] for c in containers(w)
                  if is_vllm(c)]
        for extra in extras:
            if extra.get("transport") != "mooncake":
                continue
            # Mooncake's engine ports, bounded by mooncake_port (rank r: base + 2r, + 1), for
            # 8 ranks: from the other role only
            base = extra.get("mooncake_port")
            assert base, (build, name, "mooncake_port unset: its ports are random")
            other = decode if name in prefill else prefill
            for number in (base, base + 1, base + 15):
                assert admitted(w, "", number, build) == other, (build, name, number)


@pytest.mark.parametrize("build", K8S_BUILDS)
def test_network_policies_cover_every_port_by_its_peers(build: str):
    check_network_policies(build)


def test_network_policy_check_can_fail(monkeypatch: pytest.MonkeyPatch):
    real = by_kind
    for change in ("side-channel from anyone", "kv-events from decode", "no policy for decode"):
        def patched(kind: str, build: str = "base", change: str = change) -> Any:
            docs = real(kind, build)
            if kind != "NetworkPolicy":
                return docs
            if change == "side-channel from anyone":
                del docs["prefill-side-channel"]["spec"]["ingress"][0]["from"]
            elif change == "kv-events from decode":
                docs["vllm"]["spec"]["ingress"][1]["from"][0]["podSelector"]["matchLabels"] = {
                    "kvdisagg/role": "decode"}
            else:
                for np in docs.values():
                    np["spec"]["podSelector"]["matchLabels"]["kvdisagg/role"] = "prefill"
            return docs
        monkeypatch.setattr(sys.modules[__name__], "by_kind", patched)
        with pytest.raises(AssertionError):
            check_network_policies("base")


# ---------------------------------------------------------------- Kubernetes: operations

@pytest.mark.parametrize("build", K8S_BUILDS)
def test_every_workload_has_a_disruption_budget_that_allows_drains(build: str):
    pdbs = by_kind("PodDisruptionBudget", build)
    for name, w in workloads(build).items():
        mine = [p for p in pdbs.values()
                if p["spec"]["selector"]["matchLabels"].items() <= pod_labels(w).items()]
        assert len(mine) == 1, f"{name}: {len(mine)} PodDisruptionBudgets"
        spec = mine[0]["spec"]
        # one eviction at a time, whatever the replica count (minAvailable == replicas, or a
        # single replica with minAvailable 1, would block every node drain)
        assert spec.get("maxUnavailable") == 1 and "minAvailable" not in spec, spec
        others = [o for o in workloads(build) if o != name
                  and spec["selector"]["matchLabels"].items() <= pod_labels(workloads(build)[o]
                                                                            ).items()]
        assert not others, f"{mine[0]['metadata']['name']} also selects {others}"
    assert workloads(build)["kvdisagg-proxy"]["spec"].get("replicas", 1) >= 2, (
        "one proxy replica: its budget would allow an outage")


@pytest.mark.parametrize("build", K8S_BUILDS)
def test_vllm_pods_schedule_onto_gpus(build: str):
    for name, w in workloads(build).items():
        spec = pod_spec(w)
        for c in containers(w):
            if not is_vllm(c):
                continue
            res = c["resources"]
            assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"], name
            tol = [t for t in spec.get("tolerations", []) if t["key"] == "nvidia.com/gpu"]
            assert tol and tol[0]["effect"] == "NoSchedule", f"{name}: no GPU taint toleration"
            gpu_labels = set(spec.get("nodeSelector", {})) | {
                e["key"] for t in spec.get("affinity", {}).get("nodeAffinity", {}).get(
                    "preferredDuringSchedulingIgnoredDuringExecution", [])
                for e in t["preference"]["matchExpressions"]}
            assert {"nvidia.com/gpu.present", "nvidia.com/gpu.product"} <= gpu_labels, name
            (spread,) = spec["topologySpreadConstraints"]
            assert spread["labelSelector"]["matchLabels"] == w["spec"]["selector"]["matchLabels"]
            assert spread["topologyKey"] == "kubernetes.io/hostname", name


@pytest.mark.parametrize("build", K8S_BUILDS)
def test_model_cache_is_a_volume_that_outlives_the_container(build: str):
    pvcs = by_kind("PersistentVolumeClaim", build)
    for name, w in workloads(build).items():
        for c in containers(w):
            if not is_vllm(c):
                continue
            env = container_env(c)
            for var in ("HF_HOME", "VLLM_CACHE_ROOT"):
                path = Path(env[var])
                (mount,) = [m for m in c["volumeMounts"] if Path(m["mountPath"]) in path.parents]
                (vol,) = [v for v in pod_spec(w)["volumes"] if v["name"] == mount["name"]]
                source = set(vol) - {"name"}
                assert len(source) == 1, f"{name}: volume {vol['name']} has sources {source}"
                if "emptyDir" in vol:   # the base: per pod, survives container restarts
                    assert vol["emptyDir"].get("sizeLimit") and "medium" not in vol["emptyDir"]
                else:
                    claim = vol["persistentVolumeClaim"]["claimName"]
                    assert claim in pvcs, f"{name}: no PersistentVolumeClaim {claim}"
                    assert pvcs[claim]["spec"]["accessModes"] == ["ReadWriteMany"], claim
    if build == "all":
        assert pvcs, "components/model-cache-pvc: no claim"


@pytest.mark.parametrize("build", K8S_BUILDS)
def test_secrets_are_required_and_documented(build: str):
    """The Secrets are the user's to create (none in the manifests); every one referenced is
    required, and the README says how to create it."""
    assert not by_kind("Secret", build), "a Secret in the manifests: keys do not go in git"
    readme = (K8S / "README.md").read_text()
    refs: set[str] = set()
    for name, w in workloads(build).items():
        for v in pod_spec(w).get("volumes", []):
            if "secret" in v:
                refs.add(v["secret"]["secretName"])
                assert not v["secret"].get("optional"), f"{name}: optional Secret {v}"
        for c in containers(w):
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    refs.add(ref["name"])
                    assert not ref.get("optional"), f"{name}: {e['name']} from an optional Secret"
    assert refs == {"hf-token", "kvdisagg-admin"}, refs
    for secret in refs:
        assert f"create secret generic {secret}" in readme, f"README.md: how to create {secret}"


def test_rdma_overlay_runs_mooncake_over_rdma():
    n = 0
    for name, w in workloads("rdma").items():
        for c in containers(w):
            if not is_vllm(c):
                continue
            n += 1
            extra = kv_transfer_config(c)["kv_connector_extra_config"]
            assert (extra["transport"], extra["mooncake_protocol"]) == ("mooncake", "rdma"), name
            # both engines listen at their pod's address
            assert extra["side_channel_host"] == PLACEHOLDERS["$(POD_IP)"], name
            assert "IPC_LOCK" in c["securityContext"]["capabilities"]["add"], name
            rdma = {k: v for k, v in c["resources"]["requests"].items() if k.startswith("rdma/")}
            assert rdma or pod_spec(w).get("hostNetwork"), f"{name}: no RDMA device"
            assert all(c["resources"]["limits"][k] == v for k, v in rdma.items()), name
            names = {e["name"] for e in c["env"]}
            assert any(v.startswith("MC_") for v in names), names
            assert any(v.startswith("NCCL_") for v in names), names
    assert n == 2
    for name, w in workloads().items():   # the base asks for no privilege
        for c in containers(w):
            assert "add" not in c.get("securityContext", {}).get("capabilities", {}), name
            if is_vllm(c):
                assert kv_transfer_config(c)["kv_connector_extra_config"]["transport"] == "tcp"
    text = (K8S / "README.md").read_text() + (K8S / "components/rdma/kustomization.yaml"
                                               ).read_text()
    for word in ("IPC_LOCK", "memlock", "hostNetwork", "LimitMEMLOCK"):
        assert word in text, word


def proxy_config_from_configmap(tmp_path: Path) -> tuple[Any, dict[str, Any]]:
    deploy = by_kind("Deployment")["kvdisagg-proxy"]
    (c,) = containers(deploy)
    args = c["args"]
    path = Path(args[args.index("--config") + 1])
    mount = next(m for m in c["volumeMounts"] if str(path).startswith(m["mountPath"] + "/"))
    vol = next(
        v for v in deploy["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]
    )
    cm = by_kind("ConfigMap")[vol["configMap"]["name"]]
    text = cm["data"][path.name]
    (tmp_path / path.name).write_text(text)
    cfg = load_config_file(tmp_path / path.name)
    if cfg.admin.key_file:  # the key comes from a Secret mounted where the config says
        key_file = Path(cfg.admin.key_file)
        mount = next(m for m in c["volumeMounts"] if key_file.parent == Path(m["mountPath"]))
        vol = next(v for v in deploy["spec"]["template"]["spec"]["volumes"]
                   if v["name"] == mount["name"])
        assert "secret" in vol, f"admin.key_file {key_file} is not from a Secret: {vol}"
        (tmp_path / "admin-key").write_text("sample-key")
        cfg = msgspec.structs.replace(cfg, admin=msgspec.structs.replace(
            cfg.admin, key_file=str(tmp_path / "admin-key")))
    return cfg.validate(), c


def check_proxy_discovery(args: list[str]) -> list[str]:
    """Every --prefill-dns/--decode-dns NAME:PORT names a headless Service of this base that
    selects the pods of that role, on one of its ports; returns the roles found."""
    services, roles = by_kind("Service"), []
    for i, arg in enumerate(args):
        if arg not in ("--prefill-dns", "--decode-dns"):
            continue
        role = arg[2:-4]
        m = re.fullmatch(r"([a-z0-9-]+)\.([a-z0-9-]+)\.svc\.cluster\.local:(\d+)", args[i + 1])
        assert m, f"{arg} {args[i + 1]}: expected <service>.<namespace>.svc.cluster.local:<port>"
        svc_name, ns, port = m.group(1), m.group(2), int(m.group(3))
        assert ns == namespace(), f"{arg}: namespace {ns}, the base deploys into {namespace()}"
        svc = services.get(svc_name)
        assert svc is not None, f"{arg}: no Service {svc_name}"
        assert svc["spec"].get("clusterIP") == "None", f"{arg}: Service {svc_name} is not headless"
        assert port in [p["port"] for p in svc["spec"]["ports"]], f"{arg}: port {port}"
        ws = selected(svc)
        assert ws and all(pod_labels(w)["kvdisagg/role"] == role for w in ws), (
            f"{arg}: Service {svc_name} selects no {role} pods")
        roles.append(role)
    return roles


def test_proxy_discovery_check_can_fail():
    with pytest.raises(AssertionError, match="no Service"):
        check_proxy_discovery(["--prefill-dns", "prefil.kvdisagg.svc.cluster.local:8000"])
    with pytest.raises(AssertionError, match="selects no decode pods"):
        check_proxy_discovery(["--decode-dns", "prefill.kvdisagg.svc.cluster.local:8000"])
    with pytest.raises(AssertionError, match="port"):
        check_proxy_discovery(["--decode-dns", "decode.kvdisagg.svc.cluster.local:9000"])


def label_selector(text: str) -> dict[str, str]:
    """An equality-based label selector (``a=b,c=d``) as a dict; other forms fail the check."""
    out = {}
    for term in text.split(","):
        k, sep, v = term.partition("=")
        assert sep and k.strip() and "!" not in k and not v.startswith("="), (
            f"selector {text!r}: only a=b terms are checked here")
        out[k.strip()] = v.strip()
    return out


def check_api_discovery(cfg: Any, proxy: dict[str, Any]) -> list[str]:
    """discovery.kubernetes selects the pods of each role on their HTTP port, in the base's
    namespace, and RBAC lets the proxy's service account list and watch them; returns the
    roles found."""
    k = cfg.discovery.kubernetes
    assert k is not None, "discovery.kubernetes is not set"
    assert k.namespace in (None, namespace()), f"discovery.kubernetes.namespace {k.namespace}"
    assert k.api_server.startswith("https://")
    roles = []
    for role, sel in (("prefill", k.prefill_selector), ("decode", k.decode_selector)):
        if not sel:
            continue
        want = label_selector(sel)
        ws = [w for w in workloads().values() if want.items() <= pod_labels(w).items()]
        assert ws, f"{role}_selector {sel!r} matches no pod template"
        for w in ws:
            assert pod_labels(w)["kvdisagg/role"] == role, (
                f"{role}_selector {sel!r} selects {w['metadata']['name']}"
            )
            assert container_ports(w).get("http") == k.port, (
                f"discovery.kubernetes.port {k.port} is not {w['metadata']['name']}'s http port")
        roles.append(role)
    spec = proxy["spec"]["template"]["spec"]
    sa = spec.get("serviceAccountName")
    assert sa in by_kind("ServiceAccount"), (
        f"the proxy runs as {sa!r}, no ServiceAccount of the base"
    )
    assert spec.get("automountServiceAccountToken", True), "the proxy needs its token mounted"
    verbs: set[str] = set()
    for rb in by_kind("RoleBinding").values():
        if not any(s["kind"] == "ServiceAccount" and s["name"] == sa
                   and s.get("namespace") == namespace() for s in rb["subjects"]):
            continue
        assert rb["roleRef"]["kind"] == "Role", "a Role: the proxy reads its own namespace only"
        role_obj = by_kind("Role")[rb["roleRef"]["name"]]
        for rule in role_obj["rules"]:
            if "" in rule["apiGroups"] and "pods" in rule["resources"]:
                verbs |= set(rule["verbs"])
    assert {"list", "watch"} <= verbs, f"the proxy's service account may only {sorted(verbs)} pods"
    return roles


def test_proxy_finds_members_through_the_api_with_rbac(tmp_path: Path):
    cfg, c = proxy_config_from_configmap(tmp_path)
    args = c["args"]
    assert int(args[args.index("--port") + 1]) in container_ports(
        by_kind("Deployment")["kvdisagg-proxy"]).values()
    assert sorted(check_api_discovery(cfg, by_kind("Deployment")["kvdisagg-proxy"])) == [
        "decode", "prefill"]
    assert not cfg.instances and not cfg.discovery.prefill_dns and not cfg.discovery.decode_dns
    for name, w in workloads().items():  # the vLLM pods get no API token
        if name != "kvdisagg-proxy":
            assert w["spec"]["template"]["spec"]["automountServiceAccountToken"] is False, name


def test_api_discovery_check_can_fail(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    cfg, _ = proxy_config_from_configmap(tmp_path)
    proxy = by_kind("Deployment")["kvdisagg-proxy"]
    rep = msgspec.structs.replace
    swapped = rep(cfg, discovery=rep(cfg.discovery, kubernetes=rep(
        cfg.discovery.kubernetes, prefill_selector=cfg.discovery.kubernetes.decode_selector)))
    with pytest.raises(AssertionError, match="prefill_selector .* selects decode"):
        check_api_discovery(swapped, proxy)
    wrong_port = rep(cfg, discovery=rep(cfg.discovery, kubernetes=rep(
        cfg.discovery.kubernetes, port=8100)))
    with pytest.raises(AssertionError, match="port 8100"):
        check_api_discovery(wrong_port, proxy)
    bad = json.loads(json.dumps(proxy))
    del bad["spec"]["template"]["spec"]["serviceAccountName"]
    with pytest.raises(AssertionError, match="no ServiceAccount"):
        check_api_discovery(cfg, bad)
    role = json.loads(json.dumps(by_kind("Role")["kvdisagg-proxy-discovery"]))
    role["rules"][0]["verbs"] = ["get", "list"]  # no watch
    real = by_kind

    def patched(kind: str, build: str = "base") -> dict[str, dict[str, Any]]:
        return {role["metadata"]["name"]: role} if kind == "Role" else real(kind, build)
    monkeypatch.setattr(sys.modules[__name__], "by_kind", patched)
    with pytest.raises(AssertionError, match=r"may only \['get', 'list'\] pods"):
        check_api_discovery(cfg, proxy)


def test_dns_discovery_shown_in_the_readme_finds_both_roles():
    """The README's DNS alternative names the headless Services of this base."""
    text = (K8S / "README.md").read_text()
    flags = re.findall(r"(--(?:prefill|decode)-dns) ([a-z0-9.:-]+)", text)
    args = [w for pair in flags for w in pair]
    assert sorted(set(check_proxy_discovery(args))) == ["decode", "prefill"]


def admin_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvdisagg admin")
    admin_cli.add_arguments(p)
    return p


def prestop_drain(c: dict[str, Any]) -> argparse.Namespace:
    """The preStop hook's ``kvdisagg admin drain`` command line, parsed by the CLI's parser."""
    hook = c["lifecycle"]["preStop"]["exec"]["command"]
    assert hook[:2] == ["sh", "-c"], f"not sh -c: {hook}"
    words = shlex.split(hook[2].replace("$POD_IP", PLACEHOLDERS["$(POD_IP)"]))
    assert words[:3] == ["exec", "kvdisagg", "admin"], f"not exec kvdisagg admin: {words}"
    try:
        args = admin_parser().parse_args(words[3:])
    except SystemExit:
        raise AssertionError(f"kvdisagg admin refuses {words[3:]}") from None
    assert args.admin_command == "drain", words
    return args


@pytest.mark.parametrize("build", K8S_BUILDS)
def test_prestop_drains_this_pod_at_every_proxy_replica(build: str, tmp_path: Path):
    cfg, _ = proxy_config_from_configmap(tmp_path)
    admin_port = cfg.admin.port
    services = by_kind("Service", build)
    public = services["kvdisagg-proxy"]
    proxy = by_kind("Deployment", build)["kvdisagg-proxy"]
    assert all(p["port"] != admin_port and p["targetPort"] not in ("admin", admin_port)
               for p in public["spec"]["ports"]), "the public Service carries the admin API"
    # only the vLLM pods may reach the admin port
    (policy,) = [n for n in by_kind("NetworkPolicy", build).values()
                 if n["spec"]["podSelector"]["matchLabels"] == pod_labels(proxy)]
    for rule in policy["spec"]["ingress"]:
        if any(p["port"] in ("admin", admin_port) for p in rule["ports"]):
            assert [f["podSelector"]["matchLabels"] for f in rule["from"]] == [
                {"app.kubernetes.io/name": "vllm"}], rule
    hooks = 0
    for name, w in workloads(build).items():
        for c in containers(w):
            if not is_vllm(c):
                continue
            hooks += 1
            args = prestop_drain(c)
            target = urlsplit(args.proxy)
            assert target.hostname in services, f"{name}: --proxy {args.proxy}: no such Service"
            svc = services[target.hostname]
            assert svc is not public, f"{name}: drains through the public Service"
            # every proxy replica routes its own requests: the drain must reach each of them,
            # the ready and the not ready (one may still have legs in flight on this pod)
            assert args.each_address, f"{name}: drains at one proxy replica of several"
            assert svc["spec"].get("clusterIP") == "None", f"{target.hostname}: not headless"
            assert svc["spec"].get("publishNotReadyAddresses") is True, target.hostname
            assert selected(svc, build) == [proxy]
            (port,) = [p for p in svc["spec"]["ports"] if p["port"] == target.port]
            assert container_ports(proxy)[port["targetPort"]] == admin_port, (
                f"{name}: {args.proxy} is not the proxy's admin listener")
            # the key: a file of a mounted Secret, the same Secret as the proxy's
            assert args.key_file, f"{name}: no --key-file"
            mount = next(m for m in c["volumeMounts"]
                         if Path(args.key_file).parent == Path(m["mountPath"]))
            vol = next(v for v in w["spec"]["template"]["spec"]["volumes"]
                       if v["name"] == mount["name"])
            proxy_vol = next(v for v in proxy["spec"]["template"]["spec"]["volumes"]
                             if "secret" in v)
            assert vol["secret"]["secretName"] == proxy_vol["secret"]["secretName"], name
            # the URL discovery knows this pod by: http://<pod IP>:<http port>
            assert '"http://$POD_IP:8000"' in c["lifecycle"]["preStop"]["exec"]["command"][2]
            assert args.url == f"http://{PLACEHOLDERS['$(POD_IP)']}:{cfg.discovery.kubernetes.port}"
            assert container_ports(w)["http"] == cfg.discovery.kubernetes.port
            env = {e["name"]: e for e in c.get("env", [])}
            assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP", name
            # bounded inside the grace period; a pod the proxy never knew is not an error
            grace = w["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
            assert args.timeout + admin_cli.ANSWER_GRACE_S < grace, name
            # then SIGTERM: vLLM's --shutdown-timeout (retirement) and its teardown fit too,
            # and a prefill's covers how long it may hold a handoff (docs/operations.md)
            shutdown_s = int(flag_value(expanded_args(c), "--shutdown-timeout"))
            assert args.timeout + admin_cli.ANSWER_GRACE_S + shutdown_s + 10 <= grace, name
            kv = kv_transfer_config(c)
            if kv["kv_role"] == "kv_producer":
                conn = parse_config(kv.get("kv_connector_extra_config"))
                assert shutdown_s >= conn.lease_seconds + conn.transfer_timeout_seconds, name
            else:
                assert shutdown_s > 0, name
            assert args.missing_ok and not args.remove, name
    assert hooks == 2
    # the proxy's own: a pause while the endpoints drop it, then SIGTERM drains its requests
    (pc,) = containers(proxy)
    pause = pc["lifecycle"]["preStop"]["exec"]["command"]
    assert pause[0] == "sleep" and proxy["spec"]["replicas"] >= 2
    grace = proxy["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert int(pause[1]) + cfg.drain_timeout_s < grace
    assert "curl" not in json.dumps(workloads(build)), "a pod uses curl"  # not in the images


def test_prestop_check_can_fail():
    c = json.loads(json.dumps(containers(workloads()["decode"])[0]))
    script = c["lifecycle"]["preStop"]["exec"]["command"][2]
    c["lifecycle"]["preStop"]["exec"]["command"][2] = script.replace("--timeout", "--timout")
    with pytest.raises(AssertionError, match="kvdisagg admin refuses"):
        prestop_drain(c)
    c["lifecycle"]["preStop"]["exec"]["command"][2] = "curl -X POST http://x/admin/drain"
    with pytest.raises(AssertionError, match="not exec kvdisagg admin"):
        prestop_drain(c)


def test_prometheus_scrape_config():
    cm = by_kind("ConfigMap")["kvdisagg-prometheus-config"]
    prom = yaml.safe_load(cm["data"]["prometheus.yml"])
    (job,) = prom["scrape_configs"]
    keep = next(r for r in job["relabel_configs"]
                if r["source_labels"] == ["__meta_kubernetes_pod_label_app_kubernetes_io_name"])
    names = {pod_labels(w)["app.kubernetes.io/name"] for w in workloads().values()}
    assert all(re.fullmatch(keep["regex"], n) for n in names), (keep["regex"], names)
    assert job["kubernetes_sd_configs"][0]["namespaces"]["names"] == [namespace()]


def test_shlex_roundtrip_of_the_cpu_example():
    """The CPU example starts vLLM the way the tests do (the CPU build's flags)."""
    text = (EXAMPLES / "cpu-1p1d" / "run.sh").read_text()
    words = shlex.split(text.replace("\\\n", " "), comments=True)
    for flag in ("--dtype", "--max-model-len", "--enforce-eager", "--block-size"):
        assert flag in words
    assert "VLLM_CPU_OMP_THREADS_BIND=0" in text and "VLLM_CPU_OMP_THREADS_BIND=1" in text
    assert "0.0.0.0" not in text


# ---------------------------------------------------------------- Kubernetes: images
# Docker cannot run here: the Dockerfiles are parsed and checked against the source tree,
# pyproject.toml, build.sh and the manifests.

IMAGES = K8S / "images"
INSTRUCTIONS = {"FROM", "ARG", "ENV", "LABEL", "WORKDIR", "COPY", "RUN", "USER", "EXPOSE",
                "ENTRYPOINT", "CMD"}


class Instruction(NamedTuple):
    cmd: str
    args: str
    line: int


def parse_dockerfile(text: str) -> list[Instruction]:
    """Instructions with continuation lines joined; comments and parser directives dropped."""
    out, buf, start = [], "", 0
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if line.startswith("#") or (not buf and not line):
            continue
        if not buf:
            start = n
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        cmd, _, args = buf.partition(" ")
        out.append(Instruction(cmd.upper(), " ".join(args.split()), start))
        buf = ""
    assert not buf, "the file ends inside a continued line"
    return out


def pyproject() -> dict[str, Any]:
    import tomllib
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def in_build_context(rel: str) -> bool:
    """Whether the root .dockerignore lets ``rel`` (a path under the root) into the context:
    the last pattern matching it or a parent decides, ``!`` re-including."""
    from fnmatch import fnmatch
    patterns = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]
    parts = Path(rel).parts
    paths = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    included = True
    for pat in patterns:
        neg = pat.startswith("!")
        pat = pat.lstrip("!").rstrip("/")
        if any(fnmatch(p, pat) for p in paths):
            included = neg
    return included


def check_dockerfile(text: str, where: str) -> dict[str, Any]:
    """Checks one Dockerfile; returns what the cross-checks need: the final stage's base, user,
    labels and the pip extras installed."""
    instrs = parse_dockerfile(text)
    unknown = {i.cmd for i in instrs} - INSTRUCTIONS
    assert not unknown, f"{where}: instructions not checked here (ADD?): {unknown}"
    assert instrs and instrs[0].cmd == "FROM", f"{where}: does not start with FROM"
    stages: list[str] = []
    args: dict[str, str] = {}
    final: dict[str, Any] = {}
    extras: list[str] = []
    for ins in instrs:
        if ins.cmd == "FROM":
            words = ins.args.split()
            base = words[0]
            if base not in stages:
                tag = base.partition(":")[2]
                assert tag and tag != "latest" and re.search(r"\d", tag) and "$" not in base, (
                    f"{where}:{ins.line}: {base} is not pinned to a version")
            stages.append(
                words[2] if len(words) == 3 and words[1].upper() == "AS" else f"#{len(stages)}"
            )
            final = {"base": base, "user": None, "labels": {}}
            args = {}
        elif ins.cmd == "ARG":
            k, _, v = ins.args.partition("=")
            args[k] = v
        elif ins.cmd == "LABEL":
            for k, v in re.findall(r'(\S+)="([^"]*)"', ins.args):
                final["labels"][k] = v
        elif ins.cmd == "USER":
            final["user"] = ins.args
        elif ins.cmd == "COPY":
            words = ins.args.split()
            flags = [w for w in words if w.startswith("--")]
            srcs = [w for w in words if not w.startswith("--")][:-1]
            frm = [f.split("=", 1)[1] for f in flags if f.startswith("--from=")]
            if frm:
                assert frm[0] in stages[:-1], f"{where}:{ins.line}: no earlier stage {frm[0]}"
                continue
            for src in srcs:
                assert (ROOT / src).exists(), f"{where}:{ins.line}: COPY {src}: no such path"
                assert in_build_context(src.rstrip("/")), (
                    f"{where}:{ins.line}: COPY {src}: left out of the context by .dockerignore")
        elif ins.cmd == "RUN":
            run = ins.args
            for k, v in args.items():
                run = run.replace(f"${{{k}}}", v).replace(f"${k}", v)
            extras += [e.strip() for group in re.findall(r"(?:kvdisagg|\.whl\))\[([^\]]+)\]", run)
                       for e in group.split(",")]
    known = set(pyproject()["project"]["optional-dependencies"])
    missing = set(extras) - known
    assert not missing, f"{where}: extras pyproject.toml lacks: {sorted(missing)}"
    final["extras"] = extras
    return final


def built_images() -> dict[str, Path]:
    """image:tag -> Dockerfile, as images/build.sh builds them."""
    text = (IMAGES / "build.sh").read_text()
    built = re.findall(r'docker build -f (\S+) -t "\$\{prefix\}([^"]+)" \.', text)
    assert built, "images/build.sh builds nothing"
    return {image: ROOT / path for path, image in built}


def test_dockerfiles_build_from_this_tree():
    version = pyproject()["project"]["version"]
    gpu = pyproject()["project"]["optional-dependencies"]["gpu"]
    (vllm_pin,) = [r for r in gpu if r.startswith("vllm==")]
    vllm_version = vllm_pin.split("==")[1]
    images = built_images()
    assert set(images.values()) == set(IMAGES.glob("*.Dockerfile")), "a Dockerfile build.sh skips"
    for image, path in images.items():
        assert path.is_file(), f"build.sh: {path} does not exist"
        final = check_dockerfile(path.read_text(), str(path.relative_to(ROOT)))
        assert final["labels"]["org.opencontainers.image.version"] == version, path.name
        name, _, tag = image.partition(":")
        if name == "kvdisagg-vllm":  # vLLM's image, the version kvdisagg's gpu extra pins
            assert final["base"] == f"vllm/vllm-openai:v{vllm_version}", final["base"]
            assert tag == f"{version}-vllm{vllm_version}", image
            assert set(final["extras"]) == {"mooncake-gpu", "lmcache", "tracing"}, final["extras"]
        else:  # the proxy: no vLLM, a non-root numeric user
            assert name == "kvdisagg-proxy" and tag == version, image
            assert final["base"].startswith("python:3.11"), final["base"]
            assert "vllm" not in path.read_text().lower().replace("no vllm", ""), path.name
            uid = final["user"].split(":")[0]
            assert uid.isdigit() and int(uid) != 0, f"{path.name}: USER {final['user']}"


def check_image_reference(image: str, where: str) -> str:
    """A pullable reference: a registry host first (a name without one is looked up on Docker
    Hub, where these images are not), a tag that names a version. Returns the image's own
    name:tag, as images/build.sh tags it."""
    registry, _, rest = image.partition("/")
    assert rest and ("." in registry or ":" in registry or registry == "localhost"), (
        f"{where}: {image} names no registry (set it in base/kustomization.yaml `images:`)")
    name, _, tag = rest.rpartition("/")[2].partition(":")
    assert tag and tag != "latest" and re.search(r"\d", tag), f"{where}: {image}: no version tag"
    return f"{name}:{tag}"


@pytest.mark.parametrize("build", K8S_BUILDS)
def test_manifests_run_the_images_build_sh_builds(build: str):
    images = built_images()
    base = kustomize.load_kustomization(K8S_BASE)
    assert {i["name"] for i in base["images"]} == {i.partition(":")[0] for i in images}
    seen = set()
    for name, w in workloads(build).items():
        for c in containers(w):
            own = check_image_reference(c["image"], f"{build}: {name}")
            assert own in images, f"{name}: {c['image']} is not built by images/build.sh"
            kind = images[own].name
            if is_vllm(c):
                assert kind == "vllm.Dockerfile", f"{name}: vLLM runs from {kind}"
            if c.get("command", [])[:2] == ["kvdisagg", "proxy"]:
                assert kind == "proxy.Dockerfile", f"{name}: the proxy runs from {kind}"
                user = check_dockerfile(images[own].read_text(), kind)["user"]
                sc = w["spec"]["template"]["spec"]["securityContext"]
                assert sc["runAsNonRoot"] and str(sc["runAsUser"]) == user.split(":")[0]
            seen.add(kind)
    assert seen == {"vllm.Dockerfile", "proxy.Dockerfile"}


def test_image_reference_check_can_fail():
    assert check_image_reference("registry.example.com/ml/kvdisagg-proxy:0.1.0", "t") == (
        "kvdisagg-proxy:0.1.0")
    assert check_image_reference("localhost:5000/kvdisagg-proxy:0.1.0", "t") == (
        "kvdisagg-proxy:0.1.0")
    for bad, why in (("kvdisagg-proxy:0.1.0", "no registry"), ("ml/kvdisagg-proxy:0.1", "no reg"),
                     ("r.example.com/kvdisagg-proxy", "no version"),
                     ("r.example.com/kvdisagg-proxy:latest", "no version")):
        with pytest.raises(AssertionError, match=why):
            check_image_reference(bad, "t")


def test_proxy_image_pins_every_dependency():
    from packaging.requirements import Requirement
    pins = {}
    for line in (IMAGES / "proxy-constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, ver = line.partition("==")
            assert ver, f"proxy-constraints.txt: {line!r} is not name==version"
            pins[name.lower().replace("_", "-")] = ver
    for raw in pyproject()["project"]["dependencies"]:
        req = Requirement(raw)
        name = req.name.lower().replace("_", "-")
        assert name in pins, f"proxy-constraints.txt does not pin {req.name}"
        assert req.specifier.contains(pins[name]), f"{req.name}=={pins[name]} is not {req}"
    # the proxy's image stays lean: the extras' heavy packages are not in it (kvdisagg.cli.EXTRAS)
    heavy = {"numpy", "rich", "matplotlib"} & set(pins)
    assert not heavy, f"proxy-constraints.txt pins {sorted(heavy)}: the proxy does not need them"


def test_dockerfile_checks_can_fail():
    ok = ("FROM python:3.11.13-slim-bookworm AS b\nCOPY src/ src/\n"
          "FROM python:3.11.13-slim-bookworm\n")
    check_dockerfile(ok, "ok")
    for bad, why in (
            ("FROM python:latest\n", "not pinned"),
            ("FROM python\n", "not pinned"),
            ("FROM python:3.11.13-slim\nCOPY no/such/dir/ /x/\n", "no such path"),
            ("FROM python:3.11.13-slim\nCOPY tests/ /x/\n", "left out of the context"),
            ("FROM python:3.11.13-slim\nCOPY --from=wheel /w /w\n", "no earlier stage"),
            ("FROM python:3.11.13-slim\nRUN pip install 'kvdisagg[mooncake-gpu,nope]'\n", "nope"),
            ("FROM python:3.11.13-slim\nARG X=gpuu\nRUN pip install \\\n  kvdisagg[${X}]\n",
             "gpuu"),
            ("FROM python:3.11.13-slim\nADD src/ /src/\n", "ADD")):
        with pytest.raises(AssertionError, match=why):
            check_dockerfile(bad, "bad")
    with pytest.raises(AssertionError, match="continued"):
        parse_dockerfile("FROM x:1\nRUN a \\\n")
