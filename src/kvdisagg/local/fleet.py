"""A 1P1D fleet (or nPmD) of real vLLM processes plus the proxy, shared by the demo, tests and
benchmarks.

By default each instance gets its own core (``VLLM_CPU_OMP_THREADS_BIND``); ``binds`` changes
that, None for an instance meaning vLLM's own default (as users start it). Each instance has its
own process group and log file; all start in parallel, since start-up dominates on small
machines, and stop in parallel.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvdisagg.local.servers import (
    VllmServer,
    free_port,
    metric_value,
    stop_all,
    stop_process,
    stop_processes,
)


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


def _merged(base: dict[str, Any] | None, each: Sequence[dict[str, Any] | None],
            i: int) -> dict[str, Any]:
    """``base`` with entry ``i`` of ``each`` (if any) over it."""
    return {**(base or {}), **((each[i] if i < len(each) else None) or {})}


def spawn_proxy(prefills: Sequence[str], decodes: Sequence[str], port: int,
                args: Sequence[str], log_path: Path) -> subprocess.Popen[bytes]:
    """``kvdisagg proxy`` on loopback ``port`` in front of these instance URLs, its output in
    ``log_path``."""
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "kvdisagg.cli", "proxy", "--prefill", *prefills,
             "--decode", *decodes, "--host", "127.0.0.1", "--port", str(port), *args],
            stdout=log, stderr=subprocess.STDOUT)


def wait_proxy_ready(url: str, timeout_s: float = 60.0, log_path: Path | None = None) -> None:
    """Until the proxy at ``url`` has found every instance healthy (``/readiness``)."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/readiness", timeout=2) as r:
                state = json.loads(r.read())
            if all(state[side]["healthy"] == state[side]["total"]
                   for side in ("prefill", "decode")):
                return
            last = str(state)
        except (OSError, ValueError, KeyError) as exc:  # 503 until ready, or still starting
            last = str(exc)
        time.sleep(0.2)
    raise RuntimeError(f"proxy not ready ({last}); see {log_path or url}")


@contextmanager
def running_proxy(prefills: Sequence[str], decodes: Sequence[str], args: Sequence[str],
                  log_path: Path) -> Iterator[str]:
    """A proxy in front of these instances for the ``with`` block; yields its URL once
    ready, stops it after."""
    port = free_port()
    proc = spawn_proxy(prefills, decodes, port, args, log_path)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_proxy_ready(url, log_path=log_path)
        yield url
    finally:
        stop_process(proc)


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
                 prefills: int = 1, decodes: int = 1, kv_events: bool = False,
                 prefill_extras: Sequence[dict[str, Any] | None] = (),
                 kv_cache_gib: float = 1.0, worker_in_engine: bool = False) -> None:
        """``always_disaggregate``: the proxy sends every request through prefill (what tests
        of the handoff want); False: the proxy decides per request, as it does by default.
        ``prefills``: how many prefill instances (``self.prefills``; ``self.prefill`` is the
        first), all with the same arguments and binding, but ``prefill_extras``: connector
        settings of prefill ``i`` merged over ``prefill_extra`` (entry ``i``; missing or None:
        ``prefill_extra`` alone), e.g. one prefill announcing another protocol version
        (``protocol_version_override``). ``decodes``: how many decode
        instances (``self.decodes``; ``self.decode`` is the first), all with the same
        arguments; decode ``i`` is bound as ``binds["decode{i}"]`` if given, else as the first.
        ``kv_events``: prefill and decode
        publish vLLM's KV cache events (``kv_events_args``) and the proxy tokenizes with the
        model's tokenizer, so its cache index predicts what each instance holds.
        ``kv_cache_gib``: each instance's KV cache, per rank. ``worker_in_engine``: every
        instance runs its worker in its engine process (``VllmServer``; one rank each)."""
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir = log_dir
        bind = {"prefill": "0", "decode": "1", "reference": "nobind", **(binds or {})}
        self.prefills = [
            VllmServer(model, log_path=log_dir / (f"prefill{i}.log" if i else "prefill.log"),
                       omp_threads_bind=bind["prefill"],
                       extra_args=[*kv_transfer_args("kv_producer", _merged(
                                       prefill_extra, prefill_extras, i),
                                       prefill_failure_policy), *prefill_args,
                                   *(kv_events_args(f"prefill{i}") if kv_events else ())],
                       env=env, kv_cache_gib=kv_cache_gib, worker_in_engine=worker_in_engine)
            for i in range(prefills)]
        self.prefill = self.prefills[0]
        self.decodes = [
            VllmServer(model, log_path=log_dir / (f"decode{i}.log" if i else "decode.log"),
                       omp_threads_bind=bind.get(f"decode{i}", bind["decode"]), env=env,
                       kv_cache_gib=kv_cache_gib, worker_in_engine=worker_in_engine,
                       extra_args=[*kv_transfer_args("kv_consumer", decode_extra,
                                                     decode_failure_policy), *decode_args,
                                   *(kv_events_args(f"decode{i}" if i else "decode")
                                     if kv_events else ())])
            for i in range(decodes)]
        self.decode = self.decodes[0]
        self.reference = (VllmServer(model, log_path=log_dir / "reference.log",
                                     omp_threads_bind=bind["reference"], env=env,
                                     kv_cache_gib=kv_cache_gib,
                                     worker_in_engine=worker_in_engine,
                                     extra_args=list(reference_args))
                          if reference else None)
        self.proxy_port = free_port()
        self.tokenizer_args = ["--tokenizer", str(model)] * kv_events
        self.proxy_args = (["--always-disaggregate"] * always_disaggregate
                           + self.tokenizer_args + list(proxy_args))
        self.proxy: subprocess.Popen[bytes] | None = None
        self.extra_proxies: list[subprocess.Popen[bytes]] = []

    @property
    def servers(self) -> list[VllmServer]:
        return [s for s in (*self.prefills, *self.decodes, self.reference) if s is not None]

    @property
    def proxy_url(self) -> str:
        return f"http://127.0.0.1:{self.proxy_port}"

    def _spawn_proxy(self, port: int, args: Sequence[str], log_name: str,
                     decodes: Sequence[str] = ()) -> subprocess.Popen[bytes]:
        return spawn_proxy([p.base_url for p in self.prefills],
                           decodes or [d.base_url for d in self.decodes], port, args,
                           self.log_dir / log_name)

    def start(self, timeout_s: float = 900.0) -> Fleet:
        for server in self.servers:
            server.start()
        self.proxy = self._spawn_proxy(self.proxy_port, self.proxy_args, "proxy.log")
        try:
            for server in self.servers:
                server.wait_ready(timeout_s)
            self.wait_proxy_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def extra_proxy(self, proxy_args: Sequence[str], name: str,
                    decodes: Sequence[str] = ()) -> str:
        """Another proxy on the same instances (started fleet), with its own arguments (the
        fleet's ``kv_events`` tokenizer included, not ``--always-disaggregate``); stopped with
        the fleet or by ``stop_extra_proxies``. ``decodes``: other decode URLs than the
        fleet's (a relay in front of them). Returns its URL once ready; its log is
        ``<name>.log``."""
        port = free_port()
        self.extra_proxies.append(
            self._spawn_proxy(port, [*self.tokenizer_args, *proxy_args], f"{name}.log",
                              decodes))
        url = f"http://127.0.0.1:{port}"
        self.wait_proxy_ready(url=url)
        return url

    def wait_proxy_ready(self, timeout_s: float = 60.0, url: str | None = None) -> None:
        """Until the proxy's probes have found every instance healthy (``/readiness``)."""
        wait_proxy_ready(url or self.proxy_url, timeout_s, self.log_dir / "proxy.log")

    def wait_index_live(self, timeout_s: float = 120.0) -> None:
        """Until the proxy's cache index follows every prefill and decode's KV events
        (``kv_events``): the proxy is ready as soon as the instances answer its probes, but
        finds each publisher on a retry some seconds later; until then it predicts no cache
        hit and counts a prompt's tokens by an estimate (it tokenizes only for the index)."""
        want = len(self.prefills) + len(self.decodes)
        deadline = time.monotonic() + timeout_s
        while (live := metric_value(self.proxy_url, "kvdisagg_proxy_cache_index_live")) < want:
            if time.monotonic() > deadline:
                raise RuntimeError(f"proxy's cache index live for {live:.0f} of {want} "
                                   f"instances after {timeout_s:.0f}s; see "
                                   f"{self.log_dir / 'proxy.log'}")
            time.sleep(0.5)

    def stop_extra_proxies(self) -> None:
        """Stop the proxies ``extra_proxy`` started (the fleet's own stays): each probes every
        instance, and vLLM renders its whole /metrics page for each probe."""
        stop_processes(self.extra_proxies)
        self.extra_proxies = []

    def stop(self) -> None:
        """The proxies, then the instances; each group signalled at once and then waited for,
        so that shutdowns overlap (a fleet's teardown took a few seconds per process)."""
        stop_processes([self.proxy, *self.extra_proxies])
        stop_all(self.servers)

    def __enter__(self) -> Fleet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

