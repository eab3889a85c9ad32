"""Data-path helpers of the pull transports: each side derives the same bytes from the same runs.

The conformance tests move real bytes between processes; these pin the pure pieces they rest on
(message plans, spans, byte views, addresses), with seeded random block lists.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from kvdisagg.connector.config import ConnectorConfig
from kvdisagg.connector.layout import (
    LayerRegion,
    copy_runs,
    layer_regions,
    pull_slices,
    whole_slices,
    with_arena,
)
from kvdisagg.errors import TransferFailed
from kvdisagg.transport import nccl
from kvdisagg.transport.base import TRANSPORTS, transport_class
from kvdisagg.transport.mooncake import JoinedReads, MemoryInfo, MooncakeTransport, _address
from kvdisagg.transport.nccl import NcclTransport, block_runs, plan_messages
from kvdisagg.transport.pull import Deadline, PullPlan
from kvdisagg.transport.tcp import TcpTransport


class Seeded(random.Random):
    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.seed_value = seed

    def __repr__(self) -> str:
        return f"Seeded({self.seed_value})"


@pytest.fixture(params=range(8))
def rng(request: pytest.FixtureRequest) -> Seeded:
    return Seeded(request.param)


def random_pull(rng: random.Random, num_blocks: int) -> tuple[list[int], list[int]]:
    """A handoff's blocks (scattered, with some consecutive stretches) and decode's blocks."""
    n = rng.randint(1, num_blocks // 2)
    src = sorted(rng.sample(range(num_blocks), n)) if rng.random() < 0.5 else \
        rng.sample(range(num_blocks), n)
    start = rng.randint(0, num_blocks - n)
    dst = list(range(start, start + n)) if rng.random() < 0.5 else rng.sample(range(num_blocks), n)
    return src, dst


def kv(num_blocks: int, layers: int = 3, seed: int | None = 0, arena: int = 0,
       heads: int = 2) -> list[LayerRegion]:
    g = torch.Generator().manual_seed(seed or 0)
    shape = (num_blocks, heads, 4, 8)
    caches = {f"layer.{i}": (torch.rand(shape, generator=g) if seed is not None
                             else torch.zeros(shape)) for i in range(layers)}
    regions = layer_regions(caches)
    if arena:
        regions = with_arena(regions, arena)
        for r in regions:
            r.stage.copy_(torch.randint(0, 256, r.stage.shape, dtype=torch.uint8, generator=g))
    return regions


def row(region: LayerRegion, block: int) -> torch.Tensor:
    return region.rows(block, 1)[0]


def whole(regions: list[LayerRegion], src: list[int], dst: list[int]) -> PullPlan:
    """A pull of every layer and head (both sides sharded alike)."""
    return PullPlan(copy_runs(len(regions), src, dst), whole_slices(regions),
                    tuple(range(len(regions))), (0, 0))


def window(regions: list[LayerRegion], src: list[int], dst: list[int], first: int, heads: int,
           src_heads: tuple[int, int]) -> PullPlan:
    """A pull of heads ``first..`` of this side's pages (the other side's TP differs)."""
    layers = tuple(range(len(regions)))
    return PullPlan(copy_runs(len(layers), src, dst), pull_slices(regions, layers, first, heads),
                    layers, src_heads)


def head(region: LayerRegion, block: int, h: int) -> torch.Tensor:
    size = region.head_bytes
    return row(region, block)[h * size:(h + 1) * size]


# ---- nccl: message plans ----------------------------------------------------------------------


def test_plan_messages_cover_every_row_in_order_within_the_cap(rng: Seeded) -> None:
    src, dst = random_pull(rng, 64)
    pages = [rng.choice([8, 16]) for _ in range(3)]
    cap = rng.choice([8, 40, 100, 10_000])
    runs = copy_runs(3, src, dst)
    plans = {side: plan_messages(runs, side, pages, cap) for side in ("src", "dst")}
    for side, ids in (("src", src), ("dst", dst)):
        flat = [(seg.layer, i) for message in plans[side] for seg in message for i in seg.ids]
        assert flat == [(layer, i) for layer in range(3) for i in ids], rng
    for message in plans["src"]:
        nbytes = sum(len(seg.ids) * pages[seg.layer] for seg in message)
        assert nbytes <= max(cap, max(pages)), rng
        assert all(seg.ids for seg in message)
    # The two sides' k-th messages hold the same layers and row counts: same bytes, same order.
    shape = {side: [[(seg.layer, len(seg.ids)) for seg in m] for m in plans[side]]
             for side in plans}
    assert shape["src"] == shape["dst"], rng


def test_plan_messages_split_a_layer_larger_than_the_cap() -> None:
    runs = copy_runs(1, [0, 1, 2, 3, 4], [5, 6, 7, 8, 9])
    plan = plan_messages(runs, "dst", [10], 25)
    assert [[seg.ids for seg in m] for m in plan] == [[[5, 6]], [[7, 8]], [[9]]]


@pytest.mark.parametrize("ids, limit, expected", [
    ([], 4, []),
    ([3], 4, [(3, 1)]),
    ([1, 2, 3, 4, 5], 4, [(1, 3), (4, 2)]),  # pages end at 4: the arena starts a new span
    ([5, 4, 6, 7], 100, [(5, 1), (4, 1), (6, 2)]),
])
def test_spans_coalesce_consecutive_ids_but_not_across_the_arena(ids, limit, expected) -> None:
    assert block_runs(ids, limit) == expected


# ---- nccl: gather, send, receive, scatter ------------------------------------------------------


class FakeGroup:
    """Two ranks' sends and receives in one process: receive copies what was sent with its tag."""

    def __init__(self) -> None:
        self.sent: dict[int, torch.Tensor] = {}
        self.messages = 0

    class Work:
        def __init__(self, done: Any = None) -> None:
            self.done = done

        def wait(self, timeout: Any = None) -> bool:
            if self.done:
                self.done()
            return True

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Work:
        assert tensors[0].is_contiguous()
        self.sent[tag] = tensors[0].clone()
        self.messages += 1
        return self.Work()

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Work:
        def done() -> None:
            sent = self.sent.pop(tag)
            assert sent.nbytes == tensors[0].nbytes, (tag, sent.nbytes, tensors[0].nbytes)
            tensors[0].view(-1).view(torch.uint8).copy_(sent.view(-1).view(torch.uint8))
        return self.Work(done)


class Sock:
    def sendall(self, data: bytes) -> None:
        pass


def nccl_side(regions: list[LayerRegion]) -> NcclTransport:
    transport = NcclTransport(ConnectorConfig())
    transport.regions, transport.backend = regions, "gloo"
    return transport


@pytest.mark.parametrize("cap", [3 * 256, 4 << 20])  # 3 pages per message (in place if
@pytest.mark.parametrize("staged", [False, True])  # consecutive), or one message in all
def test_nccl_pull_moves_each_block_into_its_destination(rng: Seeded, staged: bool, cap: int,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(nccl.MESSAGE_BYTES, "gloo", cap)
    src_regions = kv(40, seed=rng.seed_value + 1, arena=16 if staged else 0)
    dst_regions = kv(40, seed=None)
    src, dst = random_pull(rng, 32)
    if staged:
        src = [40 + i for i in rng.sample(range(16), min(len(src), 16))]
        dst = dst[:len(src)]
    group = FakeGroup()
    nccl_side(src_regions).send(group, Sock(), whole(src_regions, src, dst), Deadline(5, "test"),
                                b"")
    nccl_side(dst_regions).recv(group, Sock(), whole(dst_regions, src, dst), Deadline(5, "test"))
    assert not group.sent
    for s_region, d_region in zip(src_regions, dst_regions):
        for s, d in zip(src, dst):
            assert torch.equal(row(d_region, d), row(s_region, s)), (rng, s, d)
        untouched = set(range(40)) - set(dst)
        assert all(int(row(d_region, b).count_nonzero()) == 0 for b in untouched), rng


def test_nccl_pull_is_one_message_per_cap_not_per_run() -> None:
    src_regions, dst_regions = kv(64, seed=1), kv(64, seed=None)
    src, dst = list(range(0, 64, 2)), list(range(32))  # 32 runs per layer
    group = FakeGroup()
    plan = whole(src_regions, src, dst)
    nccl_side(src_regions).send(group, Sock(), plan, Deadline(5, "test"), b"")
    nccl_side(dst_regions).recv(group, Sock(), whole(dst_regions, src, dst), Deadline(5, "test"))
    assert len(plan.runs) == 96 and group.messages == 1


@pytest.mark.parametrize("cap", [3 * 128, 4 << 20])
@pytest.mark.parametrize("split", ["split", "gather"])
def test_nccl_pull_of_some_heads_moves_each_head_into_its_place(rng: Seeded, split: str,
                                                                cap: int, monkeypatch) -> None:
    """Another TP on each side: decode's one head from prefill's second of two (split), or
    prefill's one head into decode's second of two (gather); the other head untouched."""
    monkeypatch.setitem(nccl.MESSAGE_BYTES, "gloo", cap)
    src_heads, dst_heads = (2, 1) if split == "split" else (1, 2)
    src_regions = kv(40, seed=rng.seed_value + 1, heads=src_heads)
    dst_regions = kv(40, seed=None, heads=dst_heads)
    src, dst = random_pull(rng, 32)
    src_first, dst_first = (1, 0) if split == "split" else (0, 1)
    group = FakeGroup()
    nccl_side(src_regions).send(group, Sock(), window(src_regions, src, dst, src_first, 1,
                                                      (src_first, 1)), Deadline(5, "t"), b"")
    nccl_side(dst_regions).recv(group, Sock(), window(dst_regions, src, dst, dst_first, 1,
                                                      (src_first, 1)), Deadline(5, "t"))
    for s_region, d_region in zip(src_regions, dst_regions):
        for s, d in zip(src, dst):
            assert torch.equal(head(d_region, d, dst_first), head(s_region, s, src_first)), rng
            if dst_heads == 2:
                assert int(head(d_region, d, 1 - dst_first).count_nonzero()) == 0, rng


# ---- tcp: byte views ---------------------------------------------------------------------------


def test_tcp_views_are_the_runs_bytes_in_order_merged(rng: Seeded) -> None:
    regions = kv(40, seed=rng.seed_value, arena=8)
    transport = TcpTransport(ConnectorConfig())
    transport.regions = regions
    transport.attach(regions, is_producer=True)
    src, dst = random_pull(rng, 48)
    plan = whole(regions, src, dst)
    for side, ids in (("src", src), ("dst", dst)):
        views = transport._views(plan, side)
        assert views is not None
        expected = b"".join(row(r, b).numpy().tobytes() for r in regions for b in ids)
        assert b"".join(bytes(v) for v in views) == expected, rng
        assert len(views) <= len(plan.runs)


def test_tcp_views_of_some_heads_are_those_heads_of_each_block(rng: Seeded) -> None:
    regions = kv(40, seed=rng.seed_value, heads=4)
    transport = TcpTransport(ConnectorConfig())
    transport.regions = regions
    transport.attach(regions, is_producer=True)
    src, dst = random_pull(rng, 40)
    first, count = rng.randint(0, 2), 2  # heads 0-1, 1-2 or 2-3 of 4
    views = transport._views(window(regions, src, dst, first, count, (first, count)), "src")
    expected = b"".join(head(r, b, h).numpy().tobytes() for r in regions for b in src
                        for h in range(first, first + count))
    assert b"".join(bytes(v) for v in views) == expected, rng


# ---- mooncake: addresses -----------------------------------------------------------------------


def test_mooncake_address_of_pages_arena_and_out_of_range() -> None:
    memory = MemoryInfo(endpoint="", bases=[1000, 5000], page_bytes=[10, 20],
                        num_blocks=[4, 4], stage_bases=[9000, 9500], stage_blocks=[2, 2])
    assert _address(memory, 1, 2, 2, "x") == 5000 + 2 * 20
    assert _address(memory, 0, 5, 1, "x") == 9000 + 10
    with pytest.raises(TransferFailed, match="3..4 are not prefill's"):
        _address(memory, 0, 3, 2, "prefill's")  # straddles pages and arena
    with pytest.raises(TransferFailed, match="not decode's"):
        _address(memory, 0, 6, 1, "decode's")


def test_mooncake_reads_a_window_per_block_at_both_sides_addresses() -> None:
    """Decode (1 head) reads prefill's second head of two: one range per block, at each side's
    base + block * page + the heads' offset."""
    dst_regions = kv(8, layers=2, seed=None, heads=1)
    transport = MooncakeTransport(ConnectorConfig())
    transport.regions = dst_regions
    transport._memory = MemoryInfo(endpoint="", bases=[r.pages.data_ptr() for r in dst_regions],
                                   page_bytes=[r.page_bytes for r in dst_regions],
                                   num_blocks=[8, 8], layers=[0, 1], heads=[1, 1])
    prefill = MemoryInfo(endpoint="p:1", bases=[10_000, 50_000], page_bytes=[256, 256],
                         num_blocks=[8, 8], layers=[0, 1], heads=[2, 2])
    calls = []

    class Engine:
        def batch_transfer_sync_read(self, endpoint, local, remote, lengths):
            calls.append((list(local), list(remote), list(lengths)))
            return 0

    transport.engine = Engine()
    transport.reads = JoinedReads(transport.engine)
    plan = window(dst_regions, [3, 4], [0, 1], 0, 1, (1, 1))
    transport.recv(prefill, Sock(), plan, Deadline(5, "t"))
    ((local, remote, lengths),) = calls
    base = [r.pages.data_ptr() for r in dst_regions]
    assert remote == [10_000 + 3 * 256 + 128, 10_000 + 4 * 256 + 128,
                      50_000 + 3 * 256 + 128, 50_000 + 4 * 256 + 128]
    assert local == [base[0], base[0] + 128, base[1], base[1] + 128]
    assert lengths == [128] * 4


@pytest.mark.parametrize("name", sorted(TRANSPORTS))
def test_every_transport_has_the_whole_protocol(name):
    """The worker calls the Transport protocol's members directly (no duck-typed probes), so
    each transport defines every one of them."""
    from kvdisagg.transport.base import Transport

    cls = transport_class(name)
    members = {m for m in vars(Transport) if not m.startswith("_")} | {"name", "keyed_by_tokens"}
    missing = sorted(m for m in members if not hasattr(cls, m))
    assert not missing, f"{name} lacks {missing}"
    assert isinstance(cls.keyed_by_tokens, bool)
