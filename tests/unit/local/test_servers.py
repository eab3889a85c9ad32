"""VllmServer.stop leaves nothing behind: the process group gone, and the ``ipc://`` socket file
of its KV events publisher removed (vLLM, killed, does not unlink it; fleets of the benchmarks
and e2e tests left one in /tmp per run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kvdisagg.local.fleet import kv_events_args
from kvdisagg.local.servers import VllmServer


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
