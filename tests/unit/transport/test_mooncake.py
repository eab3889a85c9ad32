"""Mooncake's joined reads (transport/mooncake.py JoinedReads): concurrent pulls' ranges from one
prefill go to the engine together, each range once; a pull returns only after its ranges were
read; a failed batch fails exactly the pulls it carried; prefills never wait for each other.
Pure logic against a scripted engine; the real engine's bytes are test_conformance's.

Then ports and devices: each worker's engine listens within its rank's ports of
``mooncake_port`` (the real engine over TCP, in processes of their own: Mooncake reads its port
range once per process), and gets its rank's entry of a ``mooncake_device`` list."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from kvdisagg.connector.config import MOONCAKE_MAX_PORT, ConnectorConfig
from kvdisagg.errors import ConfigError
from kvdisagg.transport import Fetch, mooncake
from kvdisagg.transport.mooncake import JoinedReads, bound_ports, check_devices
from tests.support.ports import Listener, free_range, listening
from tests.support.transport_peer import KV_LAYOUT, PeerProcess, kv_caches, open_transport

ROOT = Path(__file__).resolve().parents[3]

WAIT_S = 10.0


class Interrupt(BaseException):
    pass


class Engine:
    """Records each batch and the local addresses it wrote; the first call blocks until
    ``release`` (reads queue meanwhile). A batch holding an address in ``bad`` returns 1,
    one holding ``boom`` raises ``boom_with``."""

    def __init__(self, bad: frozenset[int] = frozenset(), boom: int | None = None,
                 boom_with: type[BaseException] = RuntimeError) -> None:
        self.batches: list[tuple[str, list[int], list[int], list[int]]] = []
        self.written: set[int] = set()
        self.first = threading.Event()
        self.release = threading.Event()
        self.bad, self.boom, self.boom_with = bad, boom, boom_with

    def batch_transfer_sync_read(self, endpoint: str, local: list[int], remote: list[int],
                                 lengths: list[int]) -> int:
        self.batches.append((endpoint, local, remote, lengths))
        if len(self.batches) == 1:
            self.first.set()
            assert self.release.wait(WAIT_S)
        if self.boom in remote:
            raise self.boom_with("engine fault")
        if self.bad & set(remote):
            return 1
        self.written.update(local)
        return 0


def ranges(k: int, n: int = 2) -> tuple[list[int], list[int], list[int]]:
    """Pull ``k``'s ``n`` ranges: local 1000k+i, remote 2000k+i, 8 bytes each."""
    return ([1000 * k + i for i in range(n)], [2000 * k + i for i in range(n)], [8] * n)


def pull(reads: JoinedReads, engine: Engine, endpoint: str, k: int) -> str | None:
    """A pull: its bytes must have landed by the time ``read`` says they did."""
    error = reads.read(endpoint, *ranges(k))
    if error is None:
        assert set(ranges(k)[0]) <= engine.written, f"pull {k} returned before its read"
    return error


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    """Threads a broken JoinedReads may leave hanging: not waited for (the test fails on its
    bounded ``result`` instead of hanging the run)."""
    pool = ThreadPoolExecutor(8)
    yield pool
    pool.shutdown(wait=False, cancel_futures=True)


def until(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.001)


def behind_one_in_flight(pool: ThreadPoolExecutor, reads: JoinedReads, engine: Engine,
                         pulls: list[int]) -> list[Future[str | None]]:
    """Pull 0 from p:1 goes first and holds the engine; ``pulls`` from p:1 queue behind it,
    in this order. Returns every pull's future, pull 0's first; the engine is released."""
    first = pool.submit(pull, reads, engine, "p:1", 0)
    assert engine.first.wait(WAIT_S)
    later = []
    for n, k in enumerate(pulls, 1):
        later.append(pool.submit(pull, reads, engine, "p:1", k))
        until(lambda n=n: len(reads._queues["p:1"]) == n, f"pull {k} queued")
    engine.release.set()
    return [first, *later]


def test_reads_queued_behind_one_in_flight_go_out_together_each_range_once(pool) -> None:
    engine = Engine()
    reads = JoinedReads(engine)
    done = behind_one_in_flight(pool, reads, engine, [1, 2, 3, 4])
    assert [f.result(WAIT_S) for f in done] == [None] * 5
    assert len(engine.batches) == 2  # the first alone, then the four queued behind it
    endpoint, local, remote, lengths = engine.batches[1]
    assert endpoint == "p:1" and local == [a for k in (1, 2, 3, 4) for a in ranges(k)[0]]
    assert remote == [a for k in (1, 2, 3, 4) for a in ranges(k)[1]] and lengths == [8] * 8
    assert pull(reads, engine, "p:1", 9) is None  # the lead was given back
    assert len(engine.batches) == 3 and reads._queues == {}


def test_a_slow_prefill_holds_up_only_its_own_reads(pool) -> None:
    engine = Engine()
    reads = JoinedReads(engine)
    slow = pool.submit(pull, reads, engine, "p:1", 0)
    assert engine.first.wait(WAIT_S)
    queued = pool.submit(pull, reads, engine, "p:1", 1)
    until(lambda: len(reads._queues["p:1"]) == 1, "queued behind the slow read")
    assert pool.submit(pull, reads, engine, "p:2", 2).result(WAIT_S) is None  # not held up
    assert not slow.done() and not queued.done()
    engine.release.set()
    assert slow.result(WAIT_S) is None and queued.result(WAIT_S) is None
    assert [e for e, *_ in engine.batches] == ["p:1", "p:2", "p:1"]


def test_a_failed_batch_fails_exactly_the_pulls_it_carried(pool, monkeypatch) -> None:
    monkeypatch.setattr(mooncake, "MAX_BATCH", 3)
    # Pulls 1-4 (2 ranges each) are joined into batches of 3 ranges: [1 1 2] [2 3 3] [4 4].
    # The second batch fails: pulls 2 (its other range was in a good batch) and 3 fail.
    engine = Engine(bad=frozenset({2000 * 3 + 1}))
    reads = JoinedReads(engine)
    out = [f.result(WAIT_S) for f in behind_one_in_flight(pool, reads, engine, [1, 2, 3, 4])]
    assert [o is None for o in out] == [True, True, False, False, True]
    assert out[2] == out[3] == "batch read of 3 ranges from p:1 returned 1"
    assert len(engine.batches) == 4


def test_an_engine_that_raises_fails_its_pulls_and_hands_the_lead_on(pool) -> None:
    engine = Engine(boom=2000 * 2)
    reads = JoinedReads(engine)
    out = [f.result(WAIT_S) for f in behind_one_in_flight(pool, reads, engine, [1, 2])]
    assert out[0] is None
    assert out[1] == out[2] and "RuntimeError('engine fault')" in str(out[1])
    assert pull(reads, engine, "p:1", 5) is None and reads._queues == {}


def test_an_interrupted_leader_fails_the_reads_it_took_and_hands_the_lead_on(pool) -> None:
    engine = Engine(boom=2000 * 3, boom_with=Interrupt)
    reads = JoinedReads(engine)
    first, leader, other = behind_one_in_flight(pool, reads, engine, [3, 4])
    assert first.result(WAIT_S) is None
    with pytest.raises(Interrupt):
        leader.result(WAIT_S)  # pull 3 led the joined read of pulls 3 and 4
    assert other.result(WAIT_S) == "reads from p:1 interrupted"  # never told it landed
    assert pull(reads, engine, "p:1", 5) is None and reads._queues == {}


def test_nothing_to_read_never_calls_the_engine() -> None:
    engine = Engine()
    assert JoinedReads(engine).read("p:1", [], [], []) is None
    assert engine.batches == []


# ---------------------------------------------------------------- ports and devices

def test_prefill_engine_and_side_channel_listen_on_the_configured_ports() -> None:
    """Prefill (the conformance suite's peer process, rank 1, Mooncake over TCP) listens on
    ``side_channel_port`` + 1 and, with its engine, within ``mooncake_port`` + 2 .. + 3 (its
    RPC port and its TCP data port), nowhere else; decode is told an endpoint there and pulls
    the bytes through it."""
    base = free_range(6, below=MOONCAKE_MAX_PORT)
    side, engine = base, base + 2  # rank 1: base + 1, and base + 4 .. base + 5
    extra = {"transfer_timeout_seconds": 5.0, "side_channel_host": "127.0.0.1",
             "side_channel_port": side, "mooncake_port": engine, "mooncake_protocol": "tcp"}
    peer = PeerProcess("mooncake", extra, seed=1, rank=1)
    decode = None
    try:
        assert peer.port == side + 1
        listeners = listening(peer.proc.pid)
        assert {p for _, p in listeners} == {side + 1, engine + 2, engine + 3}, listeners
        assert Listener("127.0.0.1", side + 1) in listeners
        config = msgspec.convert({**{k: v for k, v in extra.items() if k != "mooncake_port"},
                                  "transport": "mooncake"}, ConnectorConfig)
        dst = kv_caches(None)
        decode, _ = open_transport(config, dst, is_producer=False)
        told: list[str] = []
        open_client = decode.open_client  # type: ignore[attr-defined]

        def spy(sock: Any, info: dict[str, Any], deadline: Any) -> Any:
            told.append(info["endpoint"])
            return open_client(sock, info, deadline)
        decode.open_client = spy  # type: ignore[attr-defined]
        remote, local = [2, 3, 9], [6, 1, 8]
        token = peer.offer("h1", remote, [1] * 40)
        assert decode.fetch(Fetch("h1", token, "127.0.0.1", peer.port, KV_LAYOUT,
                                  tuple(remote), tuple(local)), 5.0) > 0
        assert told in ([f"127.0.0.1:{engine + 2}"], [f"127.0.0.1:{engine + 3}"])
        src = kv_caches(1)
        for layer in src:
            assert torch.equal(dst[layer][local], src[layer][remote])
    finally:
        if decode is not None:
            decode.close()
        peer.close()


DECODE = """
import json, os, sys
from kvdisagg.connector.config import MOONCAKE_MAX_PORT, ConnectorConfig
from tests.support.ports import listening
from tests.support.transport_peer import kv_caches, open_transport
if sys.argv[2] == "preloaded":
    import mooncake.engine
config = ConnectorConfig(transport="mooncake", mooncake_protocol="tcp",
                         side_channel_host="127.0.0.1", mooncake_port=int(sys.argv[1]))
try:
    decode, _ = open_transport(config, kv_caches(None), is_producer=False, rank=1)
except Exception as exc:
    print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
else:
    print(json.dumps({"ports": sorted(p for _, p in listening(os.getpid()))}))
"""


def decode_in_a_process(base: int, how: str) -> dict[str, Any]:
    """A decode worker (rank 1) opened in a fresh process: what it listens on, or its error."""
    env = {k: v for k, v in os.environ.items() if k not in ("MC_MIN_RPC_PORT", "MC_MAX_RPC_PORT")}
    out = subprocess.run([sys.executable, "-c", DECODE, str(base), how], capture_output=True,
                         text=True, timeout=120, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_decode_engine_listens_on_its_ranks_ports_too() -> None:
    """Decode's engine listens as well (Mooncake starts one per worker): within its rank's
    two ports of its own ``mooncake_port``."""
    base = free_range(4, below=MOONCAKE_MAX_PORT)
    assert decode_in_a_process(base, "fresh") == {"ports": [base + 2, base + 3]}


def test_ports_cannot_be_bounded_once_the_engine_was_loaded_and_it_says_so() -> None:
    """Mooncake reads its port range once, when ``mooncake.engine`` loads: a worker whose
    process loaded it before stops with a message naming the key, not on a random port."""
    base = free_range(4, below=MOONCAKE_MAX_PORT)
    error = decode_in_a_process(base, "preloaded")["error"]
    assert error.startswith(f"ConfigError: mooncake_port={base}: rank 1's engine listens on ")
    assert "mooncake.engine was loaded in this process before" in error


def test_bound_ports_per_rank_and_past_the_last_port(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MC_MIN_RPC_PORT", "MC_MAX_RPC_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert bound_ports(0, 3) is None and "MC_MIN_RPC_PORT" not in os.environ
    assert bound_ports(17000, 3) == (17006, 17007)
    assert (os.environ["MC_MIN_RPC_PORT"], os.environ["MC_MAX_RPC_PORT"]) == ("17006", "17007")
    with pytest.raises(ConfigError, match="mooncake_port=32762: rank 3's port 32769 is past "
                       "32767"):
        bound_ports(32762, 3)


def test_rdma_refuses_devices_the_host_lacks() -> None:
    check_devices("mlx5_1", ["mlx5_0", "mlx5_1"], 1)
    check_devices("", ["mlx5_0"], 0)  # every device: Mooncake picks
    with pytest.raises(ConfigError, match=r"mooncake_device: rank 2's mlx5_9 not in "
                       r"/sys/class/infiniband \(found: mlx5_0, mlx5_1\)"):
        check_devices("mlx5_0,mlx5_9", ["mlx5_0", "mlx5_1"], 2)
    with pytest.raises(ConfigError, match="mooncake_protocol=rdma but /sys/class/infiniband "
                       "lists no RDMA device"):
        check_devices("", [], 0)


def test_each_rank_gets_its_own_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """A list of devices: rank r's engine is initialized with entry r (on a host that has
    them; the engine here records its arguments)."""
    calls: list[tuple[str, ...]] = []

    class Recorder:
        def initialize(self, *args: str) -> int:
            calls.append(args)
            return 0

        def get_rpc_port(self) -> int:
            return 15000

        def register_memory(self, addr: int, nbytes: int) -> int:
            return 0

    fake = types.ModuleType("mooncake.engine")
    fake.TransferEngine = Recorder  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "mooncake.engine", fake)
    monkeypatch.setattr(mooncake, "rdma_devices", lambda: ["mlx5_0", "mlx5_1", "mlx5_2"])
    config = msgspec.convert({"transport": "mooncake", "mooncake_protocol": "rdma",
                              "mooncake_device": ["mlx5_2", "mlx5_0,mlx5_1"]}, ConnectorConfig)
    for rank in (0, 1):
        open_transport(config, kv_caches(None), is_producer=False, rank=rank)
    assert [c[3] for c in calls] == ["mlx5_2", "mlx5_0,mlx5_1"]
    assert calls[0][:3] == ("127.0.0.1", "P2PHANDSHAKE", "rdma")
    with pytest.raises(ConfigError, match="mooncake_device lists 2 entries but this worker is "
                       "rank 2"):
        open_transport(config, kv_caches(None), is_producer=False, rank=2)
    assert len(calls) == 2
