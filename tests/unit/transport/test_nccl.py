"""nccl.py's synchronization with the device, proved on CPU with recording fakes.

On CUDA the host only enqueues: ``Work.wait()`` orders streams and the scatter is a kernel. These
tests inject, through ``CudaSync``, a fake stream and event, and give the transport a fake group
whose works complete only after a few polls (as NCCL's do, on their own stream) and refuse a
``wait()`` before that (on CUDA it would return with the bytes not there yet). They pin the
order the module's docstring states: each receive completed -> its copies enqueued -> an event
recorded on the KV's stream -> the host saw the event done -> only then ``recv`` returns and the
load is reported done (Done to prefill, ``fetch`` returns); the same for ``send`` before prefill
may free its blocks; and a transfer that never completes raises TransferTimeout within the
deadline instead of hanging. The bytes themselves are moved by the conformance and data-path
tests, and on a GPU by ``kvdisagg gpu-check`` (kvdisagg/cli/gpu_check.py).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any

import msgspec
import pytest
import torch

from kvdisagg.connector.config import ConnectorConfig
from kvdisagg.connector.layout import LayerRegion, copy_runs, layer_regions, whole_slices
from kvdisagg.errors import ConfigError, TransferTimeout
from kvdisagg.transport import Fetch, Offer, nccl
from kvdisagg.transport.nccl import CudaSync, HostSync, NcclTransport
from kvdisagg.transport.pull import Deadline, PullPlan
from tests.support.ports import Listener, free_range, listening
from tests.support.transport_peer import KV_LAYOUT, PeerProcess, kv_caches, open_transport

POLLS = 3  # is_completed()/query() calls before a fake op or event is done


class Log(list[str]):
    """What happened, in order, across threads (list.append holds the GIL)."""

    def at(self, entry: str) -> int:
        assert entry in self, f"{entry!r} never happened: {list(self)}"
        return self.index(entry)

    def before(self, *entries: str) -> None:
        positions = [self.at(e) for e in entries]
        assert positions == sorted(positions), f"expected {entries} in order: {list(self)}"


class FakeGroup:
    """A pair's sends and receives, NCCL-like: an op completes after POLLS polls of
    ``is_completed()`` (a receive only once its send was posted: its bytes land then), and a
    ``wait()`` before that fails the test. ``done=False``: no op ever completes."""

    def __init__(self, log: Log, done: bool = True) -> None:
        self.log, self.done = log, done
        self.sent: dict[int, torch.Tensor] = {}
        self.lock = threading.Lock()

    class Work:
        def __init__(self, group: FakeGroup, name: str, land: Any = None) -> None:
            self.group, self.name, self.land = group, name, land
            self.polls, self.completed = 0, False

        def is_completed(self) -> bool:
            if self.completed or not self.group.done:
                return self.completed
            if self.land is not None and not self.land(ready=True):
                return False  # the matching send is not posted yet
            self.polls += 1
            if self.polls >= POLLS:
                if self.land is not None:
                    self.land(ready=False)
                self.completed = True
                self.group.log.append(f"{self.name} completed")
            return self.completed

        def wait(self, timeout: Any = None) -> bool:
            assert self.completed, f"{self.name} waited for before it completed"
            self.group.log.append(f"{self.name} waited")
            return True

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Work:
        with self.lock:
            self.sent[tag] = tensors[0].clone()
        return self.Work(self, f"send {tag}")

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Work:
        def land(ready: bool) -> bool:
            with self.lock:
                if ready:
                    return tag in self.sent
                sent = self.sent.pop(tag)
            tensors[0].view(-1).view(torch.uint8).copy_(sent.view(-1).view(torch.uint8))
            return True
        return self.Work(self, f"recv {tag}", land)


class FakeStream:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __repr__(self) -> str:
        return f"stream of {self.device}"


class FakeEvent:
    """Done after POLLS polls of ``query()`` once recorded; ``done=False``: never."""

    def __init__(self, log: Log, side: str, done: bool = True) -> None:
        self.log, self.side, self.done = log, side, done
        self.recorded, self.polls = False, 0

    def record(self, stream: FakeStream) -> None:
        self.recorded = True
        self.log.append(f"{self.side} event recorded on {stream!r}")

    def query(self) -> bool:
        assert self.recorded, "an event polled before it was recorded"
        self.polls += 1
        if not self.done or self.polls < POLLS:
            return False
        self.log.append(f"{self.side} host saw the event done")
        return True


class Sock:
    def sendall(self, data: bytes) -> None:
        pass


def recording_sync(log: Log, side: str, done: bool = True) -> CudaSync:
    return CudaSync(torch.device("cpu"), stream=FakeStream,
                    event=lambda: FakeEvent(log, side, done))


def side(regions: list[LayerRegion], log: Log, name: str, done: bool = True) -> NcclTransport:
    """A transport as attach() makes it on CUDA, its copies logged (the host's memmoves stand
    for the kernels they queue there)."""
    transport = NcclTransport(ConnectorConfig())
    transport.regions, transport.backend = regions, "nccl"
    transport.sync = recording_sync(log, name, done)
    gather, scatter = transport._gather, transport._scatter

    def logged_gather(message: Any, slices: Any) -> torch.Tensor:
        log.append(f"{name} gather enqueued")
        return gather(message, slices)

    def logged_scatter(message: Any, slices: Any, buf: torch.Tensor) -> None:
        scatter(message, slices, buf)
        log.append(f"{name} scatter enqueued")
    transport._gather, transport._scatter = logged_gather, logged_scatter  # type: ignore
    return transport


def regions_of(seed: int | None, num_blocks: int = 32) -> list[LayerRegion]:
    return layer_regions(kv_caches(seed, num_blocks=num_blocks))


def whole(regions: list[LayerRegion], src: list[int], dst: list[int]) -> PullPlan:
    return PullPlan(copy_runs(len(regions), src, dst), whole_slices(regions),
                    tuple(range(len(regions))), (0, 0))


SRC, DST = [2, 3, 9, 4, 17], [6, 1, 8, 0, 12]  # scattered on decode: received into buffers


@pytest.fixture
def small_messages(monkeypatch: pytest.MonkeyPatch) -> int:
    """Two blocks of a layer per message: several messages, more than IN_FLIGHT."""
    page = regions_of(None)[0].page_bytes
    monkeypatch.setitem(nccl.MESSAGE_BYTES, "nccl", 2 * page)
    return len(nccl.plan_messages(copy_runs(2, SRC, DST), "dst", [page, page], 2 * page))


def test_recv_returns_only_after_the_host_saw_its_copies_done(small_messages: int) -> None:
    log = Log()
    src, dst = regions_of(1), regions_of(None)
    group = FakeGroup(log)
    side(src, log, "prefill").send(group, Sock(), whole(src, SRC, DST), Deadline(5, "t"), b"")
    del log[:]
    side(dst, log, "decode").recv(group, Sock(), whole(dst, SRC, DST), Deadline(5, "t"))
    log.append("recv returned")

    assert small_messages > nccl.IN_FLIGHT
    for k in range(small_messages):  # each message: landed, waited for, then scattered
        log.before(f"recv {k} completed", f"recv {k} waited")
        assert log.index(f"recv {k} waited") < [i for i, e in enumerate(log)
                                                if e == "decode scatter enqueued"][k]
    scatters = [i for i, e in enumerate(log) if e == "decode scatter enqueued"]
    assert len(scatters) == small_messages
    recorded = "decode event recorded on stream of cpu"  # the KV's device's current stream
    assert max(scatters) < log.at(recorded)
    log.before(recorded, "decode host saw the event done", "recv returned")
    assert log[-2:] == ["decode host saw the event done", "recv returned"]
    for s_region, d_region in zip(src, dst):
        for s, d in zip(SRC, DST):
            assert torch.equal(d_region.rows(d, 1), s_region.rows(s, 1))


def test_send_returns_only_after_the_host_saw_nccl_done_with_the_pages(
        small_messages: int) -> None:
    log = Log()
    src = regions_of(1)
    side(src, log, "prefill").send(FakeGroup(log), Sock(), whole(src, SRC, DST),
                                   Deadline(5, "t"), b"")
    log.append("send returned")
    for k in range(small_messages):
        log.before(f"send {k} completed", f"send {k} waited",
                   "prefill event recorded on stream of cpu")
    assert log[-3:] == ["prefill event recorded on stream of cpu",
                        "prefill host saw the event done", "send returned"]


@pytest.mark.parametrize("stuck", ["op", "event"])
def test_a_transfer_that_never_completes_times_out_within_the_deadline(stuck: str) -> None:
    """A receive NCCL never completes (``is_completed()`` stays false; its ``wait()`` would
    return at once on CUDA), or copies the device never finishes: TransferTimeout once the
    deadline passed, never a hang, and never a report of bytes that did not land."""
    log = Log()
    src, dst = regions_of(1), regions_of(None)
    group = FakeGroup(log)
    side(src, log, "prefill").send(group, Sock(), whole(src, SRC, DST), Deadline(5, "t"), b"")
    group.done = stuck != "op"
    receiver = side(dst, log, "decode", done=stuck != "event")
    started = time.monotonic()
    with pytest.raises(TransferTimeout, match="pull of h1"):
        receiver.recv(group, Sock(), whole(dst, SRC, DST), Deadline(0.2, "pull of h1"))
    elapsed = time.monotonic() - started
    assert 0.2 <= elapsed < 1.0
    if stuck == "op":
        assert not any("recv" in e or "decode" in e for e in log), log
    else:
        assert "decode event recorded on stream of cpu" in log
        assert "decode host saw the event done" not in log


def test_on_cpu_a_wait_blocks_and_nothing_more_is_waited_for() -> None:
    """gloo: ``attach`` picks HostSync, whose waits are not polled (gloo's ``wait()`` blocks
    until the op is done) and whose fence is a no-op."""
    transport = NcclTransport(ConnectorConfig())
    transport.attach(regions_of(None), is_producer=False)
    assert transport.backend == "gloo" and type(transport.sync) is HostSync
    assert transport.sync.waits_block and not CudaSync.waits_block

    class BlockingWork:
        def is_completed(self) -> bool:
            raise AssertionError("gloo's works are not polled")

        def wait(self, timeout: Any = None) -> bool:
            return True

    transport._wait([BlockingWork()], Deadline(5, "t"))
    transport.sync.fence(Deadline(5, "t"))


def test_decode_reports_the_load_done_and_prefill_frees_only_after_the_copies(
        small_messages: int) -> None:
    """A whole pull over the side channel (both sides in this process, their group the fake):
    decode's fetch returns (the load is reported done) and its Done reaches prefill (which
    frees the blocks) only after each side's host saw its copies done."""
    log = Log()
    config = msgspec.convert({"transport": "nccl", "transfer_timeout_seconds": 5.0,
                              "side_channel_host": "127.0.0.1"}, ConnectorConfig)
    src_kv, dst_kv = kv_caches(1), kv_caches(None)
    prefill, port = open_transport(config, src_kv, is_producer=True)
    decode, _ = open_transport(config, dst_kv, is_producer=False)
    assert isinstance(prefill, NcclTransport) and isinstance(decode, NcclTransport)
    group = FakeGroup(log)
    for transport, name in ((prefill, "prefill"), (decode, "decode")):
        transport.backend = "nccl"
        transport.sync = recording_sync(log, name)
        transport.open_server = lambda *args: group  # type: ignore[method-assign]
        transport.open_client = lambda *args: group  # type: ignore[method-assign]
    release = prefill.table.release

    def logged_release(*args: Any, **kwargs: Any) -> bool:
        log.append("prefill got Done: the blocks may be freed")
        return release(*args, **kwargs)
    prefill.table.release = logged_release  # type: ignore[method-assign]
    try:
        prefill.offer(Offer("h1", "token-h1", tuple(SRC), 30.0))
        decode.fetch(Fetch("h1", "token-h1", "127.0.0.1", port, KV_LAYOUT, tuple(SRC),
                           tuple(DST)), 5.0)
        log.append("decode: load reported done")
        deadline = time.monotonic() + 5
        while "prefill got Done: the blocks may be freed" not in log \
                and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        decode.close()
        prefill.close()
    log.before(f"recv {small_messages - 1} completed", "decode event recorded on stream of cpu",
               "decode host saw the event done", "decode: load reported done")
    log.before("decode host saw the event done", "prefill got Done: the blocks may be freed")
    log.before(f"send {small_messages - 1} completed", "prefill event recorded on stream of cpu",
               "prefill host saw the event done", "prefill got Done: the blocks may be freed")
    for layer in src_kv:
        assert torch.equal(dst_kv[layer][DST], src_kv[layer][SRC])


# ---------------------------------------------------------------- the rendezvous port

def test_prefill_listens_on_the_configured_ports_and_decode_meets_there() -> None:
    """``nccl_store_port`` + rank: prefill's TCPStore listens there, on ``side_channel_host``
    alone (not every interface), beside the side channel on ``side_channel_port`` + rank, and
    nothing else listens until a group forms; decode is told that port and its pull works
    through it. Prefill runs in its own process (the conformance suite's peer), as rank 1."""
    base = free_range(4)
    side, store = base, base + 2  # rank 1 listens on base + 1 and base + 3
    extra = {"transfer_timeout_seconds": 5.0, "side_channel_host": "127.0.0.1",
             "side_channel_port": side, "nccl_store_port": store}
    peer = PeerProcess("nccl", extra, seed=1, rank=1)
    decode = None
    try:
        assert peer.port == side + 1
        assert listening(peer.proc.pid) == {Listener("127.0.0.1", side + 1),
                                            Listener("127.0.0.1", store + 1)}
        config = msgspec.convert({**extra, "transport": "nccl"}, ConnectorConfig)
        dst = kv_caches(None)
        decode, _ = open_transport(config, dst, is_producer=False)
        told: list[dict[str, Any]] = []
        open_client = decode.open_client  # type: ignore[attr-defined]

        def spy(sock: Any, info: dict[str, Any], deadline: Deadline) -> Any:
            told.append(info)
            return open_client(sock, info, deadline)
        decode.open_client = spy  # type: ignore[attr-defined]
        token = peer.offer("h1", SRC, [1] * 80)
        assert decode.fetch(Fetch("h1", token, "127.0.0.1", peer.port, KV_LAYOUT, tuple(SRC),
                                  tuple(DST)), 5.0) > 0
        assert [(i["store_host"], i["store_port"]) for i in told] == [("127.0.0.1", store + 1)]
        src = kv_caches(1)
        for layer in src:
            assert torch.equal(dst[layer][DST], src[layer][SRC])
    finally:
        if decode is not None:
            decode.close()
        peer.close()


def test_a_taken_store_port_stops_start_up_naming_the_key() -> None:
    config = msgspec.convert({"transport": "nccl", "side_channel_host": "127.0.0.1",
                              "nccl_store_port": free_range(1)}, ConnectorConfig)
    with socket.create_server(("127.0.0.1", config.nccl_store_port)):
        with pytest.raises(ConfigError, match=rf"nccl_store_port={config.nccl_store_port}: "
                           "rank 0 cannot listen on 127.0.0.1"):
            open_transport(config, kv_caches(1), is_producer=True)
    past = msgspec.convert({"transport": "nccl", "nccl_store_port": 65535}, ConnectorConfig)
    with pytest.raises(ConfigError, match="nccl_store_port=65535: rank 1's port 65536"):
        open_transport(past, kv_caches(1), is_producer=True, rank=1)


def test_closing_frees_the_store_port_for_the_next_transport() -> None:
    config = msgspec.convert({"transport": "nccl", "side_channel_host": "127.0.0.1",
                              "nccl_store_port": free_range(1)}, ConnectorConfig)
    for _ in range(2):
        prefill, _ = open_transport(config, kv_caches(1), is_producer=True)
        assert Listener("127.0.0.1", config.nccl_store_port) in listening(os.getpid())
        prefill.close()
    assert Listener("127.0.0.1", config.nccl_store_port) not in listening(os.getpid())
