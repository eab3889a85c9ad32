"""examples/kubernetes/monitoring/: the alert rules (``promtool check rules``, and ``promtool test
rules`` on the synthetic series of rules.test.yaml: every alert fires where it should and stays
silent elsewhere), the PrometheusRule that wraps them (generated from rules.yaml), the alerts'
table in docs/operations.md, and the Grafana dashboard (valid JSON, unique panel ids, queries that
parse). Every metric and label that a rule or a panel names must be one the code exports: the
proxy's /metrics and the connector's Prometheus families as rendered here, in process, and vLLM's
own families as its source declares them.

promtool comes from Debian's ``prometheus`` package (scripts/setup.sh installs it): without it the
promtool tests skip, except under CI=true, where they fail.

Run as a script to regenerate prometheusrule.yaml after editing rules.yaml:
``.venv/bin/python tests/unit/test_monitoring.py``.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import types
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "examples" / "kubernetes" / "monitoring"
RULES = MONITORING / "rules.yaml"
RULE_TESTS = MONITORING / "rules.test.yaml"
PROMETHEUS_RULE = MONITORING / "prometheusrule.yaml"
DASHBOARD = MONITORING / "grafana-dashboard.json"
OPERATIONS = ROOT / "docs" / "operations.md"
REGENERATE = ".venv/bin/python tests/unit/test_monitoring.py"

# Labels Prometheus gives every series of examples/kubernetes' scrape job (prometheus-config.yaml):
# the target's job and instance, and the pod and role that its relabelling adds.
TARGET_LABELS = frozenset({"job", "instance", "pod", "role"})
# vLLM's PrometheusStatLogger labels every family with these (vllm/v1/metrics/loggers.py).
VLLM_LABELS = ["model_name", "engine"]
SEVERITIES = {"critical", "warning"}

PROMETHEUS_RULE_HEAD = """\
# GENERATED from rules.yaml: edit that file, then regenerate this one with
#   .venv/bin/python tests/unit/test_monitoring.py
# (tests/unit/test_monitoring.py fails while the two differ). The same alerts as a
# PrometheusRule for the Prometheus Operator (kube-prometheus-stack): its Prometheus loads the
# PrometheusRules whose labels match its ruleSelector (the chart's default selects
# release: <the Helm release's name>); set the label below to yours.
#   kubectl -n kvdisagg apply -f examples/kubernetes/monitoring/prometheusrule.yaml
apiVersion: monitoring.coreos.com/v1
kind: PrometheusRule
metadata:
  name: kvdisagg
  labels:
    app.kubernetes.io/part-of: kvdisagg
    release: kube-prometheus-stack
spec:
"""


def prometheus_rule() -> str:
    """prometheusrule.yaml's text: rules.yaml's ``groups:`` (comments and all) under ``spec:``."""
    lines = RULES.read_text().splitlines()
    start = lines.index("groups:")
    return PROMETHEUS_RULE_HEAD + "".join(
        f"  {line}\n" if line else "\n" for line in lines[start:])


def rule_groups() -> list[dict[str, Any]]:
    groups: list[dict[str, Any]] = yaml.safe_load(RULES.read_text())["groups"]
    return groups


def alerts() -> list[dict[str, Any]]:
    return [r for g in rule_groups() for r in g["rules"]]


def promtool() -> str:
    """promtool's path; a skip without it, or a failure under CI=true."""
    found = shutil.which("promtool")
    if found:
        return found
    if os.environ.get("CI", "").lower() in ("1", "true"):
        pytest.fail("promtool is missing: CI must run the alert tests (scripts/setup.sh "
                    "installs Debian's prometheus package, which has it)")
    pytest.skip("promtool is not installed (apt-get install prometheus; scripts/setup.sh)")


def run_promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool(), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


# ------------------------------------------------------------------ what the code exports

def exposition_families(text: str) -> dict[str, set[str]]:
    """Series name -> its label names, from an exposition text's ``# TYPE`` lines and samples,
    the way Prometheus stores them: a counter family ``x`` as ``x_total``, a histogram as
    ``_bucket`` (with ``le``), ``_sum`` and ``_count``, and a label ``instance`` as
    ``exported_instance`` (the scrape keeps ``instance`` for the target)."""
    from prometheus_client.parser import text_string_to_metric_families

    series: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        if family.type == "unknown":  # no # TYPE line
            continue
        name = family.name  # a counter's without its _total (prometheus_client's reading)
        names = {"counter": [name + "_total"],
                 "histogram": [name + "_bucket", name + "_sum", name + "_count"]
                 }.get(family.type, [name])
        for n in names:
            series[n] = {"le"} if n.endswith("_bucket") else set()
        for s in family.samples:
            if s.name in series:
                series[s.name] |= {"exported_instance" if lb == "instance" else lb
                                   for lb in s.labels}
    return series


def proxy_exposition() -> str:
    """The proxy's /metrics with a sample in every family (proxy/metrics.py)."""
    from kvdisagg.proxy.config import InstanceSpec, ProxyConfig, SloConfig
    from kvdisagg.proxy.fleet.registry import Registry
    from kvdisagg.proxy.metrics import Metrics
    from kvdisagg.proxy.routing.cache_index import IndexState, InstanceStatus
    from kvdisagg.proxy.types import Role, Side

    reg = Registry(ProxyConfig())
    for url, role in (("http://p0:8000", Role.PREFILL), ("http://d0:8000", Role.DECODE)):
        reg.add(InstanceSpec(url=url, role=role))
    reg.instances["http://d0:8000"].recomputed = {"load_failed": 1.0}
    m = Metrics(SloConfig())
    m.request_done("completions", "ok")
    m.leg_error("http://p0:8000", Side.PREFILL, "timeout")
    m.missing_kv_params("http://p0:8000")
    m.routed("pd", "uncached_prompt")
    m.migration("ok")
    m.early_handoff("opened")
    m.first_token("sent")
    m.predicted_hit("http://d0:8000", 16)
    m.rejected("max_in_flight")
    m.discovery_error("decode", "k8s:app=vllm")
    m.judge("http://d0:8000", 1.0, 0.2, 0.01, 10)

    class Index:
        def status(self) -> list[InstanceStatus]:
            return [InstanceStatus(url="http://d0:8000", role="decode", state=IndexState.LIVE)]

    m.cache = Index()  # type: ignore[assignment]
    return m.render(reg)


def connector_exposition() -> str:
    """The connector's families as vLLM's /metrics shows them (connector/stats.py), rendered
    through prometheus_client the way vLLM's stat logger does."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    from kvdisagg.connector.stats import DisaggPromMetrics

    registry = CollectorRegistry()
    metric_types = {cls: functools.partial(cls, registry=registry)
                    for cls in (Counter, Gauge, Histogram)}
    DisaggPromMetrics(types.SimpleNamespace(kv_transfer_config=None), metric_types,
                      VLLM_LABELS, {0: ["m", "0"]})
    return generate_latest(registry).decode()


def vllm_own_series() -> set[str]:
    """vLLM's own families (``vllm:kv_cache_usage_perc``...) as its stat logger declares them."""
    import vllm.v1.metrics.loggers as loggers

    source = Path(loggers.__file__).read_text()
    out: set[str] = set()
    for kind, name in re.findall(r'self\._(gauge|counter|histogram)_cls\(\s*name="(vllm:\w+)"',
                                 source):
        out |= {"counter": {name + "_total"},
                "histogram": {name + "_bucket", name + "_sum", name + "_count"}}.get(kind, {name})
    assert "vllm:kv_cache_usage_perc" in out, "vLLM's stat logger changed: update this parser"
    return out


Exported = dict[str, set[str] | None]


@pytest.fixture(scope="module")
def exported() -> Exported:
    """Every series name a rule or a panel may use -> its label names (None: not checked)."""
    known: Exported = {}
    known.update(dict.fromkeys(vllm_own_series()))
    known.update(exposition_families(connector_exposition()))
    known.update(exposition_families(proxy_exposition()))
    return known


# ------------------------------------------------------------------------- reading PromQL

_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_SELECTOR = re.compile(r"([a-zA-Z_:][\w:]*)?\s*\{([^}]*)\}")
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan", "group_left", "group_right"}
_NAME = re.compile(r"(?<![\w:.])([a-zA-Z_:][\w:]*)(?![\w:])(?!\s*\()")  # not a function


class Query:
    """The metric names, their matchers' label names and the grouping labels of one PromQL
    expression (enough for the expressions here, which promtool parses besides)."""

    def __init__(self, expr: str) -> None:
        text = expr.replace("$__rate_interval", "5m")
        self.grouping = {lb.strip() for g in _GROUPING.findall(text)
                         for lb in g.split(",") if lb.strip()}
        text = _GROUPING.sub(" ", text)
        self.matchers: list[tuple[str, set[str]]] = []
        for name, body in _SELECTOR.findall(text):
            self.matchers.append((name, set(re.findall(r'(\w+)\s*(?:=~|!~|!=|=)\s*"', body))))
        text = _SELECTOR.sub(lambda m: f" {m.group(1) or ''} ", text)
        text = re.sub(r"\[[^\]]*\]", " ", text)
        text = re.sub(r'"[^"]*"', " ", text)
        self.metrics = {n for n in _NAME.findall(text) if n.lower() not in _KEYWORDS}


def check_query(expr: str, known: Exported, where: str) -> Query:
    """Fails on a metric the code does not export, or a label none of the query's metrics has."""
    q = Query(expr)
    assert q.metrics, f"{where}: no metric in {expr!r}"
    unknown = sorted(q.metrics - set(known))
    assert not unknown, f"{where}: {unknown} are not exported by kvdisagg or vLLM: {expr!r}"
    labels = set(TARGET_LABELS)
    for name in q.metrics:
        has = known[name]
        labels |= has if has is not None else {"*"}
    for name, used in q.matchers:
        has = known.get(name)
        missing = used - TARGET_LABELS - (has if has is not None else used)
        assert not missing, f"{where}: {name} has no label {sorted(missing)}: {expr!r}"
    if "*" not in labels:
        missing = q.grouping - labels
        assert not missing, f"{where}: no metric of the query has {sorted(missing)}: {expr!r}"
    return q


# ------------------------------------------------------------------------------- the rules

def test_every_rule_is_an_alert_with_for_severity_summary_and_description() -> None:
    names = [r.get("alert") for r in alerts()]
    assert all(names) and len(names) == len(set(names)), names
    for r in alerts():
        assert set(r) == {"alert", "expr", "for", "labels", "annotations"}, r["alert"]
        assert r["labels"]["severity"] in SEVERITIES, r["alert"]
        assert set(r["annotations"]) == {"summary", "description"}, r["alert"]
        assert re.fullmatch(r"\d+[smh]", r["for"]), r["alert"]


def test_rules_name_only_metrics_and_labels_the_code_exports(exported: Exported) -> None:
    for r in alerts():
        check_query(r["expr"], exported, r["alert"])


def test_the_metric_check_can_fail(exported: Exported) -> None:
    with pytest.raises(AssertionError, match="not exported"):
        check_query("rate(vllm:kvdisagg_pull_total[5m])", exported, "typo")
    with pytest.raises(AssertionError, match="has no label"):
        check_query('rate(vllm:kvdisagg_pulls_total{reason="x"}[5m])', exported, "label")
    with pytest.raises(AssertionError, match="has no label"):  # the proxy's is renamed
        check_query('kvdisagg_proxy_instance_healthy{exported_instance="x",kind="y"}',
                    exported, "label")
    with pytest.raises(AssertionError, match="no metric of the query has"):
        check_query("sum by (reason) (rate(vllm:kvdisagg_pulls_total[5m]))", exported, "by")
    q = check_query('sum by (pod, reason) (rate(vllm:kvdisagg_recomputed_prompts_total'
                    '{reason=~"a|b"}[5m])) / ignoring (reason) group_left '
                    'sum by (pod) (rate(vllm:kvdisagg_pulls_total[5m]))', exported, "ok")
    assert q.metrics == {"vllm:kvdisagg_recomputed_prompts_total", "vllm:kvdisagg_pulls_total"}
    assert q.grouping == {"pod", "reason"}


def test_every_alert_is_tested_firing_and_silent() -> None:
    """rules.test.yaml: each alert expected to fire at some eval_time and expected silent at
    another."""
    fired: set[str] = set()
    silent: set[str] = set()
    tests = yaml.safe_load(RULE_TESTS.read_text())
    assert tests["rule_files"] == [RULES.name]
    for t in tests["tests"]:
        for case in t.get("alert_rule_test", []):
            (fired if case.get("exp_alerts") else silent).add(case["alertname"])
    names = {r["alert"] for r in alerts()}
    assert names - fired == set(), f"never tested firing: {sorted(names - fired)}"
    assert names - silent == set(), f"never tested silent: {sorted(names - silent)}"
    assert fired | silent <= names, f"tests of no alert: {sorted((fired | silent) - names)}"


def test_promtool_check_rules() -> None:
    out = run_promtool("check", "rules", RULES.name, cwd=MONITORING)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(alerts())} rules found" in out.stdout


def test_promtool_test_rules() -> None:
    out = run_promtool("test", "rules", RULE_TESTS.name, cwd=MONITORING)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_promtool_test_rules_can_fail(tmp_path: Path) -> None:
    """The silent-recompute alert as docs/operations.md had it (a ``reason`` label on one side
    of the division only): it never fires, and the tests say so."""
    doc = yaml.safe_load(RULES.read_text())
    (rule,) = [r for g in doc["groups"] for r in g["rules"]
               if r["alert"] == "KvdisaggSilentRecompute"]
    rule["expr"] = ('rate(vllm:kvdisagg_recomputed_prompts_total'
                    '{reason=~"load_failed|invalid_params"}[5m]) '
                    '/ rate(vllm:kvdisagg_pulls_total[5m]) > 0.01')
    (tmp_path / RULES.name).write_text(yaml.safe_dump(doc))
    shutil.copy(RULE_TESTS, tmp_path)
    out = run_promtool("test", "rules", RULE_TESTS.name, cwd=tmp_path)
    assert out.returncode != 0, out.stdout
    assert "alertname: KvdisaggSilentRecompute" in out.stdout + out.stderr


def test_prometheus_rule_is_rules_yaml_wrapped() -> None:
    doc = yaml.safe_load(PROMETHEUS_RULE.read_text())
    assert (doc["apiVersion"], doc["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    assert doc["metadata"]["name"] == "kvdisagg"
    assert doc["spec"]["groups"] == rule_groups(), f"regenerate it: {REGENERATE}"
    assert PROMETHEUS_RULE.read_text() == prometheus_rule(), f"regenerate it: {REGENERATE}"


def test_every_alert_is_in_the_operations_table() -> None:
    text = OPERATIONS.read_text()
    section = text.split("### What to alert on", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(Kvdisagg\w+)` \| (critical|warning) \|", section, re.M)
    documented = dict(rows)
    assert documented == {r["alert"]: r["labels"]["severity"] for r in alerts()}, (
        "docs/operations.md#what-to-alert-on: one row per alert of rules.yaml, with its severity")


# ---------------------------------------------------------------------------- the dashboard

def dashboard_panels(panels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for p in panels:
        out.append(p)
        out += dashboard_panels(p.get("panels", []))
    return out


def test_dashboard_is_grafana_json_with_unique_panel_ids() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 36
    (ds,) = [v for v in dash["templating"]["list"] if v["type"] == "datasource"]
    assert ds["query"] == "prometheus"
    panels = dashboard_panels(dash["panels"])
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), f"panel ids repeat: {ids}"
    for p in panels:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        if p["type"] == "row":
            continue
        assert p["targets"], p["title"]
        assert p["datasource"]["uid"] == "${" + ds["name"] + "}", p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]


def test_dashboard_queries_name_only_what_the_code_exports(exported: Exported) -> None:
    dash = json.loads(DASHBOARD.read_text())
    seen: set[str] = set()
    for p in dashboard_panels(dash["panels"]):
        for t in p.get("targets", []):
            q = check_query(t["expr"], exported, p["title"])
            seen |= q.metrics
            legend = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", t.get("legendFormat", "")))
            assert legend <= q.grouping, (
                f"{p['title']}: the legend names {sorted(legend - q.grouping)}, which the "
                f"query does not keep: {t['expr']!r}")
    # the handoff, end to end: every phase, pulls and bytes, failures, decisions, goodput
    for name in ("vllm:kvdisagg_phase_seconds_bucket", "vllm:kvdisagg_pulls_total",
                 "vllm:kvdisagg_pulled_bytes_total", "vllm:kvdisagg_pull_failures_total",
                 "vllm:kvdisagg_checksum_failures_total",
                 "vllm:kvdisagg_recomputed_prompts_total",
                 "vllm:kvdisagg_handoffs_expired_total", "kvdisagg_proxy_routed_total",
                 "kvdisagg_proxy_first_tokens_from_prefill_total",
                 "kvdisagg_proxy_migrations_total", "kvdisagg_proxy_ttft_seconds_bucket",
                 "kvdisagg_proxy_tpot_seconds_bucket", "kvdisagg_proxy_goodput_rps",
                 "kvdisagg_proxy_slo_met_total"):
        assert name in seen, f"the dashboard shows no {name}"


def test_dashboard_queries_parse(tmp_path: Path) -> None:
    """Each panel's query as a recording rule, for promtool's PromQL parser."""
    dash = json.loads(DASHBOARD.read_text())
    rules = [{"record": f"panel_{p['id']}_{t['refId']}",
              "expr": t["expr"].replace("$__rate_interval", "5m")}
             for p in dashboard_panels(dash["panels"]) for t in p.get("targets", [])]
    (tmp_path / "panels.yaml").write_text(
        yaml.safe_dump({"groups": [{"name": "panels", "rules": rules}]}))
    out = run_promtool("check", "rules", "panels.yaml", cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr


if __name__ == "__main__":
    PROMETHEUS_RULE.write_text(prometheus_rule())
    print(f"wrote {PROMETHEUS_RULE.relative_to(ROOT)}")
