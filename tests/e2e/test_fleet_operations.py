from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import yaml

from kvdisagg.local.fleet import Fleet
from kvdisagg.local.servers import free_port, stop_process

from .conftest import (
    LOG_DIR,
    completion_tokens,
    metric,
    plain_tokens,
    prompt_ids,
    wait_handoffs_freed,
)

pytestmark = pytest.mark.e2e

GEN = {"model": "tiny", "temperature": 0, "max_tokens": 8, "ignore_eos": True}
CLIENT_TIMEOUT_S = 60.0  # every client wait is bounded: a hang fails the test
PROMPTS = [prompt_ids(n, seed=4000 + n) for n in (40, 130, 200, 260)]


class Outcome(NamedTuple):
    ok: bool
    status: int
    text: str  # generated text (ok) or the error message
    handoff: str  # the proxy's X-Kvdisagg-Handoff header


def _request(url: str, body: dict[str, Any]) -> urllib.request.Request:
    return urllib.request.Request(url, json.dumps(body).encode(),
                                  {"Content-Type": "application/json"})


def complete(base: str, prompt: list[int], stream: bool = False, **kw: Any) -> Outcome:
    """One completion; errors come back as an Outcome with the server's message."""
    body = {**GEN, "prompt": prompt, "stream": stream, **kw}
    try:
        with urllib.request.urlopen(_request(base + "/v1/completions", body),
                                    timeout=CLIENT_TIMEOUT_S) as r:
            handoff = r.headers.get("X-Kvdisagg-Handoff", "")
            if not stream:
                return Outcome(True, r.status, json.loads(r.read())["choices"][0]["text"],
                               handoff)
            text = []
            for line in r:
                line = line.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return Outcome(False, r.status, event["error"]["message"], handoff)
                text.append(event["choices"][0]["text"])
            return Outcome(True, r.status, "".join(text), handoff)
    except urllib.error.HTTPError as e:
        return Outcome(False, e.code, json.loads(e.read())["error"]["message"], "")


ADMIN_KEY = "e2e-admin-key"


def admin(base: str, op: str, **body: Any) -> tuple[int, dict[str, Any]]:
    """A call of the admin API on its own listener ``base``, with the key."""
    req = (_request(f"{base}/admin/{op}", body) if body
           else urllib.request.Request(f"{base}/admin/{op}"))
    req.add_header("Authorization", f"Bearer {ADMIN_KEY}")
    try:
        with urllib.request.urlopen(req, timeout=CLIENT_TIMEOUT_S) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def instance(base: str, url: str) -> dict[str, Any] | None:
    _, listing = admin(base, "list")
    return next((i for i in listing["instances"] if i["url"] == url), None)


def wait_until(what: str, cond: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:.0f}s: {what}")
        time.sleep(0.2)


class Load:
    """Closed-loop client threads (alternating streaming and not) until ``stop()``."""

    def __init__(self, base: str, threads: int = 3) -> None:
        self.base = base
        self.outcomes: list[tuple[int, Outcome]] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(k,), daemon=True)
                         for k in range(threads)]

    def _run(self, k: int) -> None:
        i = k
        while not self._stop.is_set():
            p = i % len(PROMPTS)
            try:
                out = complete(self.base, PROMPTS[p], stream=bool(i % 2))
            except Exception as exc:  # a client timeout (a hang) or a malformed answer
                out = Outcome(False, 0, f"client: {exc!r}", "")
            with self._lock:
                self.outcomes.append((p, out))
            i += len(self._threads)

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def wait_done(self, n: int, timeout_s: float = 60.0) -> None:
        wait_until(f"{n} requests done", lambda: len(self.outcomes) >= n, timeout_s)

    def stop(self) -> list[tuple[int, Outcome]]:
        self._stop.set()
        for t in self._threads:
            t.join(CLIENT_TIMEOUT_S + 5)
            assert not t.is_alive(), "a client request hung past its timeout"
        return self.outcomes

    def __exit__(self, *exc: object) -> None:
        self.stop()


LEASE_S = 6.0
TRANSFER_TIMEOUT_S = 5.0
HOLD_S = LEASE_S + TRANSFER_TIMEOUT_S  # how long a retiring prefill waits for its handoffs
SHUTDOWN_TIMEOUT_S = 30  # prefill's --shutdown-timeout: longer than HOLD_S
DECODE_SHUTDOWN_S = 3  # decode's: streams still running after it are migrated
BURST = 8


@pytest.fixture(scope="module")
def fleet(model):
    """2P2D behind the fleet's proxy (every request through prefill), with the retirement
    settings: short leases, and --shutdown-timeout 30 s (prefills) / 3 s (decodes)."""
    fleet = Fleet(model, LOG_DIR / "fleet-ops", prefills=2, decodes=2,
                  prefill_extra={"lease_seconds": LEASE_S,
                                 "transfer_timeout_seconds": TRANSFER_TIMEOUT_S},
                  decode_extra={"transfer_timeout_seconds": TRANSFER_TIMEOUT_S},
                  prefill_args=["--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)],
                  decode_args=["--shutdown-timeout", str(DECODE_SHUTDOWN_S)],
                  worker_in_engine=True)
    with fleet:
        yield fleet


class PD2:
    """The fleet's instances behind a proxy of its own: the admin API on its own listener, fast
    health probes and a breaker, no decision (every request through prefill)."""

    def __init__(self, fleet: Fleet, plain: str) -> None:
        self.fleet, self.plain = fleet, plain  # plain: the answers (no DisaggConnector)
        self.prefill = fleet.prefills
        self.log_dir = fleet.log_dir
        self.port = self.admin_port = 0  # picked once the instances are up (see start)
        self.url = self.admin_url = ""
        self.proxy: subprocess.Popen[bytes] | None = None
        self.refs: list[str] = []

    def restart_prefill(self, i: int) -> None:
        """A new process on the same port, with the same flags (the proxy knows the instance
        by its URL)."""
        server = self.prefill[i]
        server.log_path = server.log_path.with_suffix(".restarted.log")
        server.start().wait_ready(300)

    def config(self) -> Path:
        cfg = {"host": "127.0.0.1", "port": self.port,
               "instances": [*({"url": p.base_url, "role": "prefill"} for p in self.prefill),
                             *({"url": d.base_url, "role": "decode"}
                               for d in self.fleet.decodes)],
               "health": {"interval_s": 0.5, "timeout_s": 1.0, "failure_threshold": 2,
                          "success_threshold": 2, "startup_timeout_s": 60.0},
               "breaker": {"failure_threshold": 3, "open_s": 2.0},
               "timeouts": {"prefill_s": 30.0, "decode_connect_s": 10.0,
                            "decode_total_s": 60.0, "decode_idle_s": 30.0},
               "decision": {"enabled": False},  # every request through prefill
               "admin": {"port": self.admin_port, "key_file": str(self.log_dir / "admin.key"),
                         "allowed_targets": ["127.0.0.0/8"]}}
        (self.log_dir / "admin.key").write_text(ADMIN_KEY)
        path = self.log_dir / "admin-proxy.yaml"
        path.write_text(yaml.safe_dump(cfg))
        return path

    def start(self) -> PD2:
        self.port, self.admin_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.admin_url = f"http://127.0.0.1:{self.admin_port}"
        log = open(self.log_dir / "admin-proxy.log", "wb")
        self.proxy = subprocess.Popen([sys.executable, "-m", "kvdisagg.cli", "proxy",
                                       "--config", str(self.config())],
                                      stdout=log, stderr=subprocess.STDOUT)
        log.close()

        def ready() -> bool:
            assert self.proxy is not None
            if self.proxy.poll() is not None:
                raise AssertionError(f"the proxy exited with {self.proxy.returncode}")
            try:
                with urllib.request.urlopen(self.url + "/readiness", timeout=2) as r:
                    return json.loads(r.read())["prefill"]["healthy"] == 2
            except (OSError, ValueError):
                return False
        wait_until("proxy ready with both prefills", ready, 60)
        self.refs = [complete(self.plain, p).text for p in PROMPTS]
        return self

    def stop(self) -> None:
        if self.proxy is not None:
            stop_process(self.proxy, 15)

    def prefill_requests(self, i: int) -> float:
        return metric(self.url, "kvdisagg_proxy_instance_requests_total",
                      instance=self.prefill[i].base_url, side="prefill")

    def check(self, outcomes: list[tuple[int, Outcome]]) -> int:
        """Every request succeeded with the single-instance text, or failed with a message;
        returns the number of failures."""
        failed = 0
        for p, out in outcomes:
            if out.ok:
                assert out.text == self.refs[p], (p, out)
            else:  # status 200 with an error event, or an HTTP error; never a client timeout
                failed += 1
                assert out.status >= 200 and out.text, out
        return failed


@pytest.fixture(scope="module")
def pd2(fleet: Fleet, plain: str) -> Iterator[PD2]:
    proxy = PD2(fleet, plain)
    try:
        yield proxy.start()
    finally:
        proxy.stop()


def test_token_identical_to_single_instance_through_both_prefills(pd2: PD2) -> None:
    before = [pd2.prefill_requests(i) for i in range(2)]
    for prompt, ref in zip(PROMPTS, pd2.refs):
        for stream in (False, True):
            out = complete(pd2.url, prompt, stream=stream)
            assert out == Outcome(True, 200, ref, "pd"), (len(prompt), stream, out)
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda i: complete(pd2.url, PROMPTS[i % 4]), range(8)))
    assert [o.text for o in outs] == [pd2.refs[i % 4] for i in range(8)]
    # round robin used both prefill instances, and nothing fell back to recompute
    assert [pd2.prefill_requests(i) - before[i] for i in range(2)] == [8, 8]
    assert metric(pd2.url, "kvdisagg_proxy_routed_total", route="decode_only") == 0
    assert metric(pd2.url, "kvdisagg_proxy_missing_kv_transfer_params_total") == 0


def test_prefill_killed_mid_load_then_restarted(pd2: PD2) -> None:
    victim = pd2.prefill[0].base_url
    with Load(pd2.url) as load:
        load.wait_done(6)
        pd2.prefill[0].stop(grace_s=0)  # SIGKILL-like: no graceful shutdown
        killed_at = len(load.outcomes)
        load.wait_done(killed_at + 12)
        outcomes = load.stop()
    failed = pd2.check(outcomes)
    # failover (prefill retry on the other instance, decode retry with a fresh handoff) keeps
    # almost everything successful; what fails, failed with a message (checked above)
    print(f"prefill killed mid-load: {len(outcomes)} requests, {failed} failed")
    assert failed <= 3, [o for _, o in outcomes if not o.ok]  # at most those in flight
    wait_until("killed prefill reported unhealthy",
               lambda: instance(pd2.admin_url, victim)["healthy"] is False, 10)
    info = instance(pd2.admin_url, victim)
    assert info["last_probe_error"], info
    assert metric(pd2.url, "kvdisagg_proxy_instance_healthy", instance=victim) == 0
    # while it is down, requests go to the survivor
    for p, ref in zip(PROMPTS, pd2.refs):
        assert complete(pd2.url, p) == Outcome(True, 200, ref, "pd")

    pd2.restart_prefill(0)
    wait_until("restarted prefill healthy again",
               lambda: instance(pd2.admin_url, victim)["healthy"] is True, 15)
    assert metric(pd2.url, "kvdisagg_proxy_instance_healthy", instance=victim) == 1
    before = pd2.prefill_requests(0)
    for p, ref in zip(PROMPTS, pd2.refs):
        assert complete(pd2.url, p, stream=True) == Outcome(True, 200, ref, "pd")
    assert pd2.prefill_requests(0) - before == 2  # back in the round robin


def test_admin_drain_remove_add_under_load_loses_no_request(pd2: PD2) -> None:
    p0, p1 = (p.base_url for p in pd2.prefill)
    # The serving port has no admin route, key or not; the admin listener wants the key.
    for url, key, status in ((pd2.url + "/admin/list", ADMIN_KEY, 404),
                             (pd2.admin_url + "/admin/list", None, 401)):
        req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key
                                     else {})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=10)
        assert err.value.code == status, url
    with Load(pd2.url) as load:
        load.wait_done(3)
        status, res = admin(pd2.admin_url, "drain", url=p1, remove=True, timeout_s=30.0)
        assert status == 200 and res["drained"] is True, res
        assert instance(pd2.admin_url, p1) is None
        load.wait_done(len(load.outcomes) + 4)

        status, res = admin(pd2.admin_url, "add", url=p1, role="prefill")
        assert status == 201 and res["healthy"] is True, res
        load.wait_done(len(load.outcomes) + 6)
        assert pd2.prefill_requests(1) > 0  # the re-added instance (fresh counters) got work

        status, res = admin(pd2.admin_url, "drain", url=p0, timeout_s=30.0)
        assert status == 200 and res["drained"] is True, res
        assert res["instance"]["state"] == "draining"
        assert res["instance"]["in_flight"]["prefill"] == 0
        frozen = pd2.prefill_requests(0)
        load.wait_done(len(load.outcomes) + 6)
        outcomes = load.stop()
    assert pd2.prefill_requests(0) == frozen  # a draining instance gets no new work
    assert pd2.check(outcomes) == 0, [o for _, o in outcomes if not o.ok]
    assert all(o.handoff == "pd" for _, o in outcomes)
    status, res = admin(pd2.admin_url, "undrain", url=p0)
    assert status == 200 and res["state"] == "active"


# Graceful retirement, behind the fleet's own proxy. These end the fleet: they run last.


def bodies(seed: int, n: int, max_tokens: int = 24, stream: bool | None = None
           ) -> list[dict[str, Any]]:
    return [{"model": "tiny", "prompt": prompt_ids(600 + 100 * (i % 4), seed=seed + i),
             "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
             "return_token_ids": True, "stream": i % 2 == 1 if stream is None else stream}
            for i in range(n)]


def pulls(fleet) -> float:
    return sum(metric(d.base_url, "vllm:kvdisagg_pulls_total") for d in fleet.decodes)


def pull_failures(fleet) -> float:
    return sum(metric(d.base_url, "vllm:kvdisagg_pull_failures_total") for d in fleet.decodes)


def proxy_metric(fleet, name: str, **labels: str) -> float:
    return metric(fleet.proxy_url, name, **labels)


@pytest.mark.timeout(900)
def test_prefill_sigterm_serves_its_handoffs_then_exits(fleet, plain):
    """Decode is paused while a burst is prefilled, so the prefills hold every handoff; prefill
    0 gets SIGTERM (its API server only, as Kubernetes sends it), then decode resumes. Every
    request succeeds, token-identical to a plain instance, every handoff is pulled (decode's
    pull count), prefill 0 exits within HOLD_S of the signal plus the pulls, and later requests
    go to prefill 1 only."""
    fleet.wait_proxy_ready()  # prefill 0, killed and restarted above, back in its rotation
    retiring, other = fleet.prefills
    items, later = bodies(0, BURST), bodies(100, 4)
    expected = plain_tokens(plain, items + later)
    pulls0, failures0 = pulls(fleet), pull_failures(fleet)
    offered0 = [metric(p.base_url, "vllm:kvdisagg_handoffs_offered_total")
                for p in fleet.prefills]

    for d in fleet.decodes:
        d.pause()
    try:
        with ThreadPoolExecutor(BURST) as pool:
            futures = [pool.submit(completion_tokens, fleet.proxy_url, b, 300) for b in items]
            # Every prompt prefilled and offered (decode cannot pull: it is stopped). Bounded:
            # the proxy's health probe of the stopped decode times out after 5 s (not dead).
            deadline = time.monotonic() + 4.0
            while time.monotonic() < deadline and sum(
                    metric(p.base_url, "vllm:kvdisagg_handoffs_offered_total") - o
                    for p, o in zip(fleet.prefills, offered0)) < BURST:
                time.sleep(0.2)
            held = metric(retiring.base_url, "vllm:kvdisagg_handoffs_offered_total") - offered0[0]
            assert retiring.proc is not None
            proxy_log = fleet.log_dir / "proxy.log"
            logged = proxy_log.stat().st_size  # what the proxy logs from here on is this test's
            signalled = time.monotonic()
            os.kill(retiring.proc.pid, signal.SIGTERM)
            time.sleep(1.0)
            for d in fleet.decodes:
                d.resume()
            results = [f.result() for f in futures]
    finally:
        for d in fleet.decodes:
            d.resume()
    assert held > 0, "prefill 0 held no handoff when it was signalled: the test proves nothing"
    assert results == [("ok", e) for e in expected[:BURST]]

    # Prefill 0 exits once its handoffs are pulled: within HOLD_S of the signal at most.
    retiring.proc.wait(timeout=HOLD_S + 15)
    exited = time.monotonic() - signalled
    log = retiring.log_path.read_text(errors="replace")
    assert "kvdisagg: retiring" in log and "giving up" not in log, log[-3000:]
    assert exited < HOLD_S + 15

    # The proxy saw it retiring (or gone) and routes only to prefill 1 now.
    results = [completion_tokens(fleet.proxy_url, b, 300) for b in later]
    assert results == [("ok", e) for e in expected[BURST:]]
    assert pulls(fleet) - pulls0 == BURST + len(later), "every KV pulled, none recomputed"
    assert pull_failures(fleet) == failures0  # (the prefill killed above failed a pull)
    offered, freed = wait_handoffs_freed(other.base_url)
    assert offered == freed
    with open(proxy_log, "rb") as f:
        f.seek(logged)
        since = f.read().decode(errors="replace")
    assert "is retiring" in since or "unhealthy" in since


@pytest.mark.timeout(900)
def test_decode_sigterm_finishes_or_migrates_its_streams(fleet, plain):
    """Long greedy streams run on both decodes; decode 0 gets SIGTERM (its API server). Its
    streams run on for DECODE_SHUTDOWN_S, then vLLM kills its engine and the proxy migrates
    each stream left to decode 1. Every stream completes token-identical to a plain run; decode
    0 exits within DECODE_SHUTDOWN_S plus teardown; later requests all go to decode 1."""
    retiring, other = fleet.decodes
    items, later = bodies(200, BURST, max_tokens=500, stream=True), bodies(300, 4)
    expected = plain_tokens(plain, items + later)
    migrated0 = proxy_metric(fleet, "kvdisagg_proxy_migrations_total", outcome="ok")
    with ThreadPoolExecutor(BURST) as pool:
        futures = [pool.submit(completion_tokens, fleet.proxy_url, b, 300) for b in items]
        deadline = time.monotonic() + 120  # bounds a broken fleet, not the burst
        while (time.monotonic() < deadline
               and metric(retiring.base_url, "vllm:num_requests_running") < 2):
            time.sleep(0.1)
        assert retiring.proc is not None
        signalled = time.monotonic()
        os.kill(retiring.proc.pid, signal.SIGTERM)
        retiring.proc.wait(timeout=DECODE_SHUTDOWN_S + 30)  # then killed, torn down
        exited = time.monotonic() - signalled
        results = [f.result() for f in futures]
    assert results == [("ok", e) for e in expected[:BURST]]
    assert exited < DECODE_SHUTDOWN_S + 30
    log = retiring.log_path.read_text(errors="replace")
    assert "kvdisagg: retiring" in log, log[-3000:]
    migrated = proxy_metric(fleet, "kvdisagg_proxy_migrations_total", outcome="ok") - migrated0
    assert migrated >= 1, "no stream outlived the shutdown timeout: the test proves nothing"
    before = metric(other.base_url, "vllm:kvdisagg_pulls_total")
    results = [completion_tokens(fleet.proxy_url, b, 300) for b in later]
    assert results == [("ok", e) for e in expected[BURST:]]
    assert metric(other.base_url, "vllm:kvdisagg_pulls_total") - before == len(later)
