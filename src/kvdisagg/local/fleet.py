"""A 1P1D fleet of real vLLM processes plus the proxy, shared by the demo, tests and benchmarks.

By default each instance gets its own core (``VLLM_CPU_OMP_THREADS_BIND``); ``binds`` changes
that, None for an instance meaning vLLM's own default (as users start it). Each instance has its
own process group and log file; all start in parallel, since start-up dominates on small
machines.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Sequence

from kvdisagg.local.servers import VllmServer, free_port


def kv_transfer_args(role: str, extra: dict[str, Any] | None = None,
                     failure_policy: str = "fail") -> list[str]:
    config = {"kv_connector": "DisaggConnector", "kv_role": role,
              "kv_load_failure_policy": failure_policy,
              "kv_connector_extra_config": extra or {}}
    return ["--kv-transfer-config", json.dumps(config)]


def kv_events_args(name: str) -> list[str]:
    """``--kv-events-config`` for an instance on this host: vLLM's publisher bound to a local
    socket file (vLLM binds ``ipc://`` endpoints; a ``tcp://host:port`` one would make it
    connect instead) and its replay endpoint on loopback, so nothing listens beyond this
    host. The proxy's cache index finds both through ``GET /kv_event_sources``."""
    sock = Path(tempfile.gettempdir()) / f"kvdisagg-kv-events-{name}-{free_port()}.sock"
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"ipc://{sock}",
              "replay_endpoint": f"tcp://127.0.0.1:{free_port()}", "topic": "kv"}
    return ["--kv-events-config", json.dumps(events)]


class Fleet:
    """Prefill + decode (+ an optional plain reference instance) + ``kvdisagg proxy``."""

    def __init__(self, model: Path, log_dir: Path, *, reference: bool = False,
                 prefill_extra: dict[str, Any] | None = None,
                 decode_extra: dict[str, Any] | None = None,
                 decode_failure_policy: str = "fail", prefill_failure_policy: str = "fail",
                 prefill_args: Sequence[str] = (), decode_args: Sequence[str] = (),
                 reference_args: Sequence[str] = (), proxy_args: Sequence[str] = (),
                 binds: dict[str, str | None] | None = None,
                 env: dict[str, str] | None = None, always_disaggregate: bool = True,
                 prefills: int = 1, decodes: int = 1, kv_events: bool = False) -> None:
        """``always_disaggregate``: the proxy sends every request through prefill (what tests
        of the handoff want); False: the proxy decides per request, as it does by default.
        ``prefills``: how many prefill instances (``self.prefills``; ``self.prefill`` is the
        first), all with the same arguments and binding; ``decodes`` likewise (``self.decodes``,
        ``self.decode``). ``kv_events``: prefill and decode
        publish vLLM's KV cache events (``kv_events_args``) and the proxy tokenizes with the
        model's tokenizer, so its cache index predicts what each instance holds."""
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir = log_dir
        bind = {"prefill": "0", "decode": "1", "reference": "nobind", **(binds or {})}
        self.prefills = [
            VllmServer(model, log_path=log_dir / (f"prefill{i}.log" if i else "prefill.log"),
                       omp_threads_bind=bind["prefill"],
                       extra_args=[*kv_transfer_args("kv_producer", prefill_extra,
                                                     prefill_failure_policy), *prefill_args,
                                   *(kv_events_args(f"prefill{i}") if kv_events else ())],
                       env=env)
            for i in range(prefills)]
        self.prefill = self.prefills[0]
        self.decodes = [
            VllmServer(model, log_path=log_dir / (f"decode{i}.log" if i else "decode.log"),
                       omp_threads_bind=bind["decode"], env=env,
                       extra_args=[*kv_transfer_args("kv_consumer", decode_extra,
                                                     decode_failure_policy),
                                   *decode_args,
                                   *(kv_events_args(f"decode{i}" if i else "decode")
                                     if kv_events else ())])
            for i in range(decodes)]
        self.decode = self.decodes[0]
        self.reference = (VllmServer(model, log_path=log_dir / "reference.log",
                                     omp_threads_bind=bind["reference"], env=env,
                                     extra_args=list(reference_args))
                          if reference else None)
        self.proxy_port = free_port()
        self.proxy_args = (["--always-disaggregate"] * always_disaggregate
                           + ["--tokenizer", str(model)] * kv_events + list(proxy_args))
        self.proxy: subprocess.Popen[bytes] | None = None

    @property
    def servers(self) -> list[VllmServer]:
        return [s for s in (*self.prefills, *self.decodes, self.reference) if s is not None]

    @property
    def proxy_url(self) -> str:
        return f"http://127.0.0.1:{self.proxy_port}"

    def start(self, timeout_s: float = 900.0) -> Fleet:
        for server in self.servers:
            server.start()
        log = open(self.log_dir / "proxy.log", "wb")
        self.proxy = subprocess.Popen(
            [sys.executable, "-m", "kvdisagg.cli", "proxy",
             "--prefill", *(p.base_url for p in self.prefills),
             "--decode", *(d.base_url for d in self.decodes), "--host", "127.0.0.1",
             "--port", str(self.proxy_port), *self.proxy_args],
            stdout=log, stderr=subprocess.STDOUT)
        try:
            for server in self.servers:
                server.wait_ready(timeout_s)
            self.wait_proxy_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_proxy_ready(self, timeout_s: float = 60.0) -> None:
        """Until the proxy's probes have found every instance healthy (``/readiness``)."""
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.proxy_url + "/readiness", timeout=2) as r:
                    state = json.loads(r.read())
                if all(state[side]["healthy"] == state[side]["total"]
                       for side in ("prefill", "decode")):
                    return
                last = str(state)
            except (OSError, ValueError, KeyError) as exc:  # 503 until ready, or still starting
                last = str(exc)
            time.sleep(0.2)
        raise RuntimeError(f"proxy not ready ({last}); see {self.log_dir / 'proxy.log'}")

    def stop(self) -> None:
        if self.proxy and self.proxy.poll() is None:
            self.proxy.terminate()
            try:
                self.proxy.wait(10)
            except subprocess.TimeoutExpired:
                self.proxy.kill()
        for server in self.servers:
            server.stop()

    def __enter__(self) -> Fleet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
