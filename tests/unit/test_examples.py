"""Offline checks of examples/: Kubernetes manifests against the API schemas, the kustomize
base's cross-references, shell syntax, every ``--kv-transfer-config`` and every
``kvdisagg proxy`` flag. Nothing here starts a process other than ``bash -n``.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml

from kvdisagg.config import parse_config
from kvdisagg.proxy.cli import add_arguments
from kvdisagg.proxy.config import load_config_file

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
K8S = EXAMPLES / "kubernetes"
K8S_VERSION = "1.30.0"
EXAMPLE_DIRS = ("cpu-1p1d", "gpu-xpyd", "behind-vllm-router", "kubernetes")
# Placeholders the examples fill in at run time, and a sample value for each.
PLACEHOLDERS = {"$(POD_IP)": "10.0.0.7", "@HOST@": "10.0.0.1", "@RDMA@": "mlx5_0",
                "@LMCACHE_PORT@": "65432"}
# Custom resources: no built-in schema; checked structurally.
CRDS = {("keda.sh/v1alpha1", "ScaledObject")}
WORKLOAD_KINDS = {"Deployment", "StatefulSet"}


def example_files(*suffixes: str) -> list[Path]:
    return sorted(p for p in EXAMPLES.rglob("*") if p.is_file() and p.suffix in suffixes)


def k8s_docs() -> list[tuple[Path, dict[str, Any]]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None and path.name != "kustomization.yaml":
                docs.append((path, doc))
    return docs


def by_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for _, d in k8s_docs() if d["kind"] == kind}


def workloads() -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for _, d in k8s_docs() if d["kind"] in WORKLOAD_KINDS}


def pod_labels(w: dict[str, Any]) -> dict[str, str]:
    return w["spec"]["template"]["metadata"]["labels"]


def containers(w: dict[str, Any]) -> list[dict[str, Any]]:
    return w["spec"]["template"]["spec"]["containers"]


# ---------------------------------------------------------------- the layout

def test_every_example_has_a_readme_listed_at_the_root():
    index = (EXAMPLES / "README.md").read_text()
    for name in EXAMPLE_DIRS:
        assert (EXAMPLES / name / "README.md").is_file(), f"examples/{name}/README.md missing"
        assert f"({name}/" in index or f"({name})" in index, f"examples/README.md: no link to {name}"


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
    assert {"--prefill", "--decode", "--policy", "--config", "--prefill-dns"} <= set(used), sorted(used)
    unknown = {f: w for f, w in used.items() if f not in known}
    assert not unknown, f"flags kvdisagg proxy does not have: {unknown}"


def test_proxy_flag_check_can_fail():
    assert proxy_flags_in_text("kvdisagg proxy --prefill http://a --no-such-flag 1\n") == [
        "--prefill", "--no-such-flag"]
    assert "--no-such-flag" not in proxy_parser()._option_string_actions


def test_proxy_config_files_load():
    cfg = load_config_file(EXAMPLES / "gpu-xpyd" / "proxy.yaml").validate()
    assert cfg.policy.prefill == cfg.policy.decode == "slo_aware"


# ---------------------------------------------------------------- Kubernetes: schemas

def test_kustomization_resources_exist():
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert kust["kind"] == "Kustomization"
    listed = set(kust["resources"])
    for res in listed:
        assert (K8S / res).is_file(), f"kustomization.yaml: {res} does not exist"
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert on_disk == listed, f"not in kustomization.yaml: {on_disk - listed}"


@pytest.mark.parametrize("path,doc", k8s_docs(),
                         ids=lambda x: x.name if isinstance(x, Path) else x.get("kind", "?"))
def test_manifest_validates(path: Path, doc: dict[str, Any]):
    if (doc.get("apiVersion"), doc.get("kind")) in CRDS:
        check_scaled_object(doc)
        return
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


def check_scaled_object(doc: dict[str, Any]) -> None:
    assert doc["apiVersion"] == "keda.sh/v1alpha1" and doc["kind"] == "ScaledObject"
    name = doc["metadata"]["name"]
    spec = doc["spec"]
    assert set(spec) <= {"scaleTargetRef", "minReplicaCount", "maxReplicaCount", "cooldownPeriod",
                         "pollingInterval", "idleReplicaCount", "fallback", "advanced",
                         "triggers"}, f"ScaledObject {name}: unknown keys"
    target = spec["scaleTargetRef"]
    assert target["name"] in workloads(), f"ScaledObject {name}: no workload {target['name']}"
    assert workloads()[target["name"]]["kind"] == target.get("kind", "Deployment")
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    assert spec["triggers"], f"ScaledObject {name}: no triggers"
    documented = set(re.findall(r"`(kvdisagg_proxy_\w+)`", (ROOT / "docs" / "proxy.md").read_text()))
    for trig in spec["triggers"]:
        assert trig["type"] == "prometheus"
        meta = trig["metadata"]
        assert {"serverAddress", "query", "threshold"} <= set(meta)
        assert isinstance(meta["threshold"], str) and float(meta["threshold"]) > 0
        metrics = re.findall(r"kvdisagg_proxy_\w+", meta["query"])
        assert metrics and set(metrics) <= documented, f"not in docs/proxy.md: {metrics}"


def test_scaled_object_check_can_fail():
    doc = json.loads(json.dumps(by_kind("ScaledObject")["decode"]))
    doc["spec"]["triggers"][0]["metadata"]["query"] = "sum(kvdisagg_proxy_no_such_metric)"
    with pytest.raises(AssertionError):
        check_scaled_object(doc)
    doc = json.loads(json.dumps(by_kind("ScaledObject")["decode"]))
    doc["spec"]["scaleTargetRef"]["name"] = "decoder"
    with pytest.raises(AssertionError):
        check_scaled_object(doc)


# ---------------------------------------------------------------- Kubernetes: references

def container_ports(w: dict[str, Any]) -> dict[str, int]:
    ports = {}
    for c in containers(w):
        for p in c.get("ports", []):
            ports[p.get("name", str(p["containerPort"]))] = p["containerPort"]
            ports[str(p["containerPort"])] = p["containerPort"]
    return ports


def selected(svc: dict[str, Any]) -> list[dict[str, Any]]:
    sel = svc["spec"]["selector"]
    return [w for w in workloads().values() if sel.items() <= pod_labels(w).items()]


def check_services(services: dict[str, dict[str, Any]]) -> None:
    for name, svc in services.items():
        ws = selected(svc)
        assert ws, f"Service {name}: selector {svc['spec']['selector']} matches no pod template"
        for p in svc["spec"]["ports"]:
            target = str(p.get("targetPort", p["port"]))
            for w in ws:
                assert target in container_ports(w), (
                    f"Service {name}: targetPort {target} is no containerPort of "
                    f"{w['metadata']['name']} ({sorted(container_ports(w))})")


def test_services_select_pods_and_ports():
    check_services(by_kind("Service"))


def test_service_check_can_fail():
    bad = json.loads(json.dumps(by_kind("Service")["decode"]))
    bad["spec"]["selector"]["kvdisagg/role"] = "decoder"
    with pytest.raises(AssertionError, match="matches no pod template"):
        check_services({"decode": bad})
    bad = json.loads(json.dumps(by_kind("Service")["prefill"]))
    bad["spec"]["ports"][1]["targetPort"] = 5601
    with pytest.raises(AssertionError, match="no containerPort"):
        check_services({"prefill": bad})


def test_workload_selectors_and_probes_name_ports():
    for name, w in workloads().items():
        sel = w["spec"]["selector"]["matchLabels"]
        assert sel.items() <= pod_labels(w).items(), f"{name}: selector does not match its pods"
        for c in containers(w):
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                if probe in c:
                    assert str(c[probe]["httpGet"]["port"]) in container_ports(w), f"{name} {probe}"


def test_vllm_pods_side_channel_and_gpu():
    for name, w in workloads().items():
        for c in containers(w):
            args = c.get("args", [])
            if "--kv-transfer-config" not in args:
                continue
            assert c["resources"]["requests"]["nvidia.com/gpu"] == 1, name
            assert c["readinessProbe"]["httpGet"]["path"] == "/health", name
            cfg = json.loads(args[args.index("--kv-transfer-config") + 1]
                             .replace("$(POD_IP)", PLACEHOLDERS["$(POD_IP)"]))
            check_kv_transfer_config(cfg, name)
            extra = cfg.get("kv_connector_extra_config", {})
            if cfg["kv_role"] in ("kv_producer", "kv_both"):
                raw = args[args.index("--kv-transfer-config") + 1]
                assert '"side_channel_host":"$(POD_IP)"' in raw, f"{name}: advertise the pod IP"
                env = {e["name"]: e for e in c.get("env", [])}
                assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
                assert extra["side_channel_port"] in container_ports(w).values(), (
                    f"{name}: side_channel_port {extra['side_channel_port']} not a containerPort")
                (svc,) = [v for v in by_kind("Service").values() if w in selected(v)]
                assert extra["side_channel_port"] in [p["port"] for p in svc["spec"]["ports"]]


def proxy_config_from_configmap(tmp_path: Path) -> tuple[Any, dict[str, Any]]:
    deploy = by_kind("Deployment")["kvdisagg-proxy"]
    (c,) = containers(deploy)
    args = c["args"]
    path = Path(args[args.index("--config") + 1])
    mount = next(m for m in c["volumeMounts"] if str(path).startswith(m["mountPath"] + "/"))
    vol = next(v for v in deploy["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
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
    namespace = yaml.safe_load((K8S / "kustomization.yaml").read_text())["namespace"]
    services, roles = by_kind("Service"), []
    for i, arg in enumerate(args):
        if arg not in ("--prefill-dns", "--decode-dns"):
            continue
        role = arg[2:-4]
        m = re.fullmatch(r"([a-z0-9-]+)\.([a-z0-9-]+)\.svc\.cluster\.local:(\d+)", args[i + 1])
        assert m, f"{arg} {args[i + 1]}: expected <service>.<namespace>.svc.cluster.local:<port>"
        svc_name, ns, port = m.group(1), m.group(2), int(m.group(3))
        assert ns == namespace, f"{arg}: namespace {ns}, the base deploys into {namespace}"
        svc = services.get(svc_name)
        assert svc is not None, f"{arg}: no Service {svc_name}"
        assert svc["spec"].get("clusterIP") == "None", f"{arg}: Service {svc_name} is not headless"
        assert port in [p["port"] for p in svc["spec"]["ports"]], f"{arg}: port {port}"
        ws = selected(svc)
        assert ws and all(pod_labels(w)["kvdisagg/role"] == role for w in ws), (
            f"{arg}: Service {svc_name} selects no {role} pods")
        roles.append(role)
    return roles


def test_proxy_finds_members_through_headless_services(tmp_path: Path):
    cfg, c = proxy_config_from_configmap(tmp_path)
    args = c["args"]
    assert int(args[args.index("--port") + 1]) in container_ports(
        by_kind("Deployment")["kvdisagg-proxy"]).values()
    assert sorted(check_proxy_discovery(args)) == ["decode", "prefill"]
    assert not cfg.instances
    scaled = by_kind("ScaledObject")
    assert {s["spec"]["scaleTargetRef"]["name"] for s in scaled.values()} == {"prefill", "decode"}


def test_proxy_discovery_check_can_fail():
    with pytest.raises(AssertionError, match="no Service"):
        check_proxy_discovery(["--prefill-dns", "prefil.kvdisagg.svc.cluster.local:8000"])
    with pytest.raises(AssertionError, match="selects no decode pods"):
        check_proxy_discovery(["--decode-dns", "prefill.kvdisagg.svc.cluster.local:8000"])
    with pytest.raises(AssertionError, match="port"):
        check_proxy_discovery(["--decode-dns", "decode.kvdisagg.svc.cluster.local:9000"])


def test_prestop_drains_this_pod_at_the_proxy_admin_service(tmp_path: Path):
    cfg, proxy_container = proxy_config_from_configmap(tmp_path)
    admin_port = cfg.admin.port
    services = by_kind("Service")
    public = services["kvdisagg-proxy"]
    assert all(p["port"] != admin_port and p["targetPort"] not in ("admin", admin_port)
               for p in public["spec"]["ports"]), "the public Service carries the admin API"
    # only the vLLM pods may reach the admin port
    (policy,) = [n for n in by_kind("NetworkPolicy").values()
                 if n["spec"]["podSelector"]["matchLabels"] == pod_labels(
                     by_kind("Deployment")["kvdisagg-proxy"])]
    for rule in policy["spec"]["ingress"]:
        if any(p["port"] in ("admin", admin_port) for p in rule["ports"]):
            assert [f["podSelector"]["matchLabels"] for f in rule["from"]] == [
                {"app.kubernetes.io/name": "vllm"}], rule
    for name, w in workloads().items():
        for c in containers(w):
            hook = c.get("lifecycle", {}).get("preStop")
            if hook is None:
                continue
            cmd = " ".join(hook["exec"]["command"])
            host = re.search(r"http://([a-z0-9-]+):(\d+)/admin/drain", cmd)
            assert host and host.group(1) in services, f"{name}: {cmd}"
            svc = services[host.group(1)]
            assert svc is not public, f"{name}: drains through the public Service"
            (port,) = [p for p in svc["spec"]["ports"] if p["port"] == int(host.group(2))]
            assert container_ports(by_kind("Deployment")["kvdisagg-proxy"])[port["targetPort"]] \
                == admin_port, f"{name}: {host.group(0)} is not the proxy's admin listener"
            # the key: a file of a mounted Secret, the same Secret as the proxy's
            key_path = re.search(r"\$\(cat (\S+)\)", cmd)
            assert key_path and "Authorization: Bearer" in cmd, f"{name}: no key sent: {cmd}"
            mount = next(m for m in c["volumeMounts"]
                         if Path(key_path.group(1)).parent == Path(m["mountPath"]))
            vol = next(v for v in w["spec"]["template"]["spec"]["volumes"]
                       if v["name"] == mount["name"])
            proxy_vol = next(v for v in by_kind("Deployment")["kvdisagg-proxy"]["spec"][
                "template"]["spec"]["volumes"] if "secret" in v)
            assert vol["secret"]["secretName"] == proxy_vol["secret"]["secretName"], name
            # DNS discovery knows a pod as http://<pod IP>:<port>
            assert "http://$POD_IP:8000" in cmd, f"{name}: drains another URL than its own"
            env = {e["name"]: e for e in c.get("env", [])}
            assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP", name


def test_prometheus_scrape_config():
    cm = by_kind("ConfigMap")["kvdisagg-prometheus-config"]
    prom = yaml.safe_load(cm["data"]["prometheus.yml"])
    (job,) = prom["scrape_configs"]
    keep = next(r for r in job["relabel_configs"]
                if r["source_labels"] == ["__meta_kubernetes_pod_label_app_kubernetes_io_name"])
    names = {pod_labels(w)["app.kubernetes.io/name"] for w in workloads().values()}
    assert all(re.fullmatch(keep["regex"], n) for n in names), (keep["regex"], names)
    namespace = yaml.safe_load((K8S / "kustomization.yaml").read_text())["namespace"]
    assert job["kubernetes_sd_configs"][0]["namespaces"]["names"] == [namespace]


def test_shlex_roundtrip_of_the_cpu_example():
    """The CPU example starts vLLM the way the tests do (the CPU build's flags)."""
    text = (EXAMPLES / "cpu-1p1d" / "run.sh").read_text()
    words = shlex.split(text.replace("\\\n", " "), comments=True)
    for flag in ("--dtype", "--max-model-len", "--enforce-eager", "--block-size"):
        assert flag in words
    assert "VLLM_CPU_OMP_THREADS_BIND=0" in text and "VLLM_CPU_OMP_THREADS_BIND=1" in text
    assert "0.0.0.0" not in text
