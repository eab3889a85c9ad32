"""Mooncake's joined reads (transport/mooncake.py JoinedReads): concurrent pulls' ranges go to
the engine together, each range once, and a failed batch fails exactly the pulls it carried.
Pure logic against a scripted engine; the real engine's bytes are test_conformance's."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvdisagg.transport import mooncake
from kvdisagg.transport.mooncake import JoinedReads


class Engine:
    """Records each batch; the first one blocks until ``release`` (reads queue meanwhile);
    a batch holding an address in ``bad`` returns 1, one holding ``boom`` raises."""

    def __init__(self, bad: set[int] = frozenset(), boom: int | None = None) -> None:
        self.batches: list[tuple[str, list[int], list[int], list[int]]] = []
        self.first = threading.Event()
        self.release = threading.Event()
        self.bad, self.boom = bad, boom

    def batch_transfer_sync_read(self, endpoint: str, local: list[int], remote: list[int],
                                 lengths: list[int]) -> int:
        self.batches.append((endpoint, local, remote, lengths))
        if len(self.batches) == 1:
            self.first.set()
            assert self.release.wait(10)
        if self.boom in remote:
            raise RuntimeError("engine fault")
        return 1 if self.bad & set(remote) else 0


def ranges(k: int, n: int = 2) -> tuple[list[int], list[int], list[int]]:
    """Pull ``k``'s ``n`` ranges: local 1000k+i, remote 2000k+i, 8 bytes each."""
    return ([1000 * k + i for i in range(n)], [2000 * k + i for i in range(n)], [8] * n)


def read_while_the_first_is_in_flight(reads: JoinedReads, engine: Engine, pulls: list[int],
                                      endpoint: str | None = None) -> list[str | None]:
    """Pull 0 goes first and holds the engine; ``pulls`` queue behind it; then all finish."""
    with ThreadPoolExecutor(len(pulls) + 1) as pool:
        first = pool.submit(reads.read, "p:1", *ranges(0))
        assert engine.first.wait(10)
        later = []
        for n, k in enumerate(pulls, 1):  # queued behind the read in flight, in this order
            later.append(pool.submit(reads.read, endpoint or f"p:{1 + k % 2}", *ranges(k)))
            while len(reads._queue) < n:
                threading.Event().wait(0.001)
        engine.release.set()
        return [first.result(10)] + [f.result(10) for f in later]


def test_reads_queued_behind_one_in_flight_go_out_together_each_range_once() -> None:
    engine = Engine()
    reads = JoinedReads(engine)
    assert read_while_the_first_is_in_flight(reads, engine, [1, 2, 3, 4], "p:1") == [None] * 5
    assert len(engine.batches) == 2  # the first alone, then the four queued behind it
    endpoint, local, remote, lengths = engine.batches[1]
    assert endpoint == "p:1" and sorted(local) == sorted(a for k in (1, 2, 3, 4)
                                                         for a in ranges(k)[0])
    assert sorted(remote) == sorted(a for k in (1, 2, 3, 4) for a in ranges(k)[1])
    assert [local.index(1000 * k) for k in (1, 2, 3, 4)] == [remote.index(2000 * k) for k in
                                                             (1, 2, 3, 4)]  # pairs kept
    assert reads.read("p:1", *ranges(9)) is None  # the lead was given back
    assert len(engine.batches) == 3


def test_one_batch_per_prefill_endpoint() -> None:
    engine = Engine()
    reads = JoinedReads(engine)
    assert read_while_the_first_is_in_flight(reads, engine, [1, 2, 3, 4]) == [None] * 5
    by_endpoint = {e: sorted(loc) for e, loc, _, _ in engine.batches[1:]}
    assert by_endpoint == {"p:1": sorted(ranges(2)[0] + ranges(4)[0]),
                           "p:2": sorted(ranges(1)[0] + ranges(3)[0])}


def test_a_failed_batch_fails_exactly_the_pulls_it_carried(monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    monkeypatch.setattr(mooncake, "MAX_BATCH", 3)
    # Pulls 1-4 (2 ranges each) are joined into batches of 3 ranges: [1 1 2] [2 3 3] [4 4].
    # The second batch fails: pulls 2 (its other range was in a good batch) and 3 fail.
    engine = Engine(bad={2000 * 3 + 1})
    reads = JoinedReads(engine)
    out = read_while_the_first_is_in_flight(reads, engine, [1, 2, 3, 4], "p:1")
    assert [o is None for o in out] == [True, True, False, False, True]
    assert out[2] == out[3] == "batch read of 3 ranges from p:1 returned 1"
    assert len(engine.batches) == 4


def test_an_engine_that_raises_fails_its_pulls_and_hands_the_lead_on() -> None:
    engine = Engine(boom=2000 * 2)
    reads = JoinedReads(engine)
    out = read_while_the_first_is_in_flight(reads, engine, [1, 2], "p:1")
    assert out[0] is None
    assert out[1] == out[2] and "RuntimeError('engine fault')" in str(out[1])
    assert reads.read("p:1", *ranges(5)) is None and not reads._queue and not reads._leading


def test_nothing_to_read_never_calls_the_engine() -> None:
    engine = Engine()
    assert JoinedReads(engine).read("p:1", [], [], []) is None
    assert engine.batches == []
