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
import sys
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import urlsplit

import msgspec
import pytest
import yaml

from kvdisagg.config import parse_config
from kvdisagg.proxy import admin_cli
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
    namespace = yaml.safe_load((K8S / "kustomization.yaml").read_text())["namespace"]
    k = cfg.discovery.kubernetes
    assert k is not None, "discovery.kubernetes is not set"
    assert k.namespace in (None, namespace), f"discovery.kubernetes.namespace {k.namespace}"
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
                   and s.get("namespace") == namespace for s in rb["subjects"]):
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
    scaled = by_kind("ScaledObject")
    assert {s["spec"]["scaleTargetRef"]["name"] for s in scaled.values()} == {"prefill", "decode"}


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

    def patched(kind: str) -> dict[str, dict[str, Any]]:
        return {role["metadata"]["name"]: role} if kind == "Role" else real(kind)
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


def test_prestop_drains_this_pod_at_the_proxy_admin_service(tmp_path: Path):
    cfg, _ = proxy_config_from_configmap(tmp_path)
    admin_port = cfg.admin.port
    services = by_kind("Service")
    public = services["kvdisagg-proxy"]
    proxy = by_kind("Deployment")["kvdisagg-proxy"]
    assert all(p["port"] != admin_port and p["targetPort"] not in ("admin", admin_port)
               for p in public["spec"]["ports"]), "the public Service carries the admin API"
    # only the vLLM pods may reach the admin port
    (policy,) = [n for n in by_kind("NetworkPolicy").values()
                 if n["spec"]["podSelector"]["matchLabels"] == pod_labels(proxy)]
    for rule in policy["spec"]["ingress"]:
        if any(p["port"] in ("admin", admin_port) for p in rule["ports"]):
            assert [f["podSelector"]["matchLabels"] for f in rule["from"]] == [
                {"app.kubernetes.io/name": "vllm"}], rule
    hooks = 0
    for name, w in workloads().items():
        for c in containers(w):
            if "preStop" not in c.get("lifecycle", {}):
                continue
            hooks += 1
            args = prestop_drain(c)
            target = urlsplit(args.proxy)
            assert target.hostname in services, f"{name}: --proxy {args.proxy}: no such Service"
            svc = services[target.hostname]
            assert svc is not public, f"{name}: drains through the public Service"
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
            vllm = c["args"]
            shutdown_s = int(vllm[vllm.index("--shutdown-timeout") + 1])
            assert args.timeout + admin_cli.ANSWER_GRACE_S + shutdown_s + 10 <= grace, name
            kv = json.loads(vllm[vllm.index("--kv-transfer-config") + 1])
            if kv["kv_role"] == "kv_producer":
                conn = parse_config(kv.get("kv_connector_extra_config"))
                assert shutdown_s >= conn.lease_seconds + conn.transfer_timeout_seconds, name
            else:
                assert shutdown_s > 0, name
            assert args.missing_ok and not args.remove, name
    assert hooks == 2
    for path in K8S.glob("*.yaml"):  # nothing in the pods needs curl
        assert "curl" not in path.read_text(), f"{path.relative_to(ROOT)} uses curl"


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


def test_manifests_run_the_images_build_sh_builds():
    images = built_images()
    seen = set()
    for name, w in workloads().items():
        for c in containers(w):
            assert c["image"] in images, f"{name}: {c['image']} is not built by images/build.sh"
            kind = images[c["image"]].name
            if "--kv-transfer-config" in c.get("args", []):
                assert kind == "vllm.Dockerfile", f"{name}: vLLM runs from {kind}"
            if c.get("command", [])[:2] == ["kvdisagg", "proxy"]:
                assert kind == "proxy.Dockerfile", f"{name}: the proxy runs from {kind}"
                user = check_dockerfile(images[c["image"]].read_text(), kind)["user"]
                sc = w["spec"]["template"]["spec"]["securityContext"]
                assert sc["runAsNonRoot"] and str(sc["runAsUser"]) == user.split(":")[0]
            seen.add(kind)
    assert seen == {"vllm.Dockerfile", "proxy.Dockerfile"}


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
