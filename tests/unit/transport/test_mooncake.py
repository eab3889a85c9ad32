"""Mooncake's joined reads (transport/mooncake.py JoinedReads): concurrent pulls' ranges from one
prefill go to the engine together, each range once; a pull returns only after its ranges were
read; a failed batch fails exactly the pulls it carried; prefills never wait for each other.
Pure logic against a scripted engine; the real engine's bytes are test_conformance's."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from kvdisagg.transport import mooncake
from kvdisagg.transport.mooncake import JoinedReads

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
