"""KV cache events into the cache index, over real ZMQ on loopback, published by vLLM's own
``ZmqEventPublisher`` (the component a vLLM instance runs): ordering, replay of what came before
the subscription, sequence gaps (a lossy relay in between), replay unavailable or too short,
publisher restarts, malformed messages, eviction, resets, discovery over HTTP and shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
import zmq
from aiohttp import web

from kvdisagg.local.servers import free_port
from kvdisagg.proxy.config import CacheIndexConfig, EventSource, TokenizerConfig
from kvdisagg.proxy.routing.cache_index import CacheIndex, IndexState
from kvdisagg.proxy.routing.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    InvalidMessage,
    decode_batch,
    source_from_publisher,
    subscriber_address,
)
from tests.support.proxy_harness import until as harness_until
from tests.support.zmq_relay import LossyRelay

kv_events = pytest.importorskip("vllm.distributed.kv_events")

BS = 4
URL = "http://127.0.0.1:1"
WAIT_S = 15.0
T = list(range(100, 200))


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def v_stored(hashes: list[int], parent: int | None, tokens: list[int], **kw: Any) -> Any:
    """vLLM's own BlockStored, as its block pool builds it."""
    return kv_events.BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                                 block_size=kw.pop("block_size", BS), lora_id=None, medium="GPU",
                                 lora_name=None, **kw)


def v_removed(*hashes: int) -> Any:
    return kv_events.BlockRemoved(block_hashes=list(hashes), medium="GPU")


class Publisher:
    """vLLM's ZmqEventPublisher on loopback ports that survive a restart."""

    def __init__(self, replay: bool = True, buffer_steps: int = 10_000,
                 ports: tuple[int, int] | None = None) -> None:
        self.ports = ports or (free_port(), free_port())
        self.replay = replay
        self.buffer_steps = buffer_steps
        self.pub: Any = None
        self.start()

    def start(self) -> None:
        p, r = self.ports
        deadline = time.monotonic() + 10
        while True:  # ZMQ unbinds a closed socket's port asynchronously (its I/O thread)
            try:
                self.pub = kv_events.ZmqEventPublisher(
                    0, endpoint=f"tcp://*:{p}",
                    replay_endpoint=f"tcp://*:{r}" if self.replay else None,
                    buffer_steps=self.buffer_steps, topic="kv")
                return
            except zmq.ZMQError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def restart(self) -> None:
        self.pub.shutdown()
        self.start()

    def publish(self, *events: Any) -> None:
        """Publish, and return once the publisher's thread sent the batch (and buffered it for
        replay): a subscriber arriving next must find it there, not still queued."""
        self.pub.publish(kv_events.KVEventBatch(ts=time.time(), events=list(events)))
        deadline = time.monotonic() + WAIT_S
        while self.pub._event_queue.unfinished_tasks:
            assert time.monotonic() < deadline, "vLLM's publisher thread sent nothing"
            time.sleep(0.001)

    @property
    def source(self) -> EventSource:
        p, r = self.ports
        return EventSource(endpoint=f"tcp://127.0.0.1:{p}",
                           replay_endpoint=f"tcp://127.0.0.1:{r}" if self.replay else None,
                           topic="kv")

    def close(self) -> None:
        self.pub.shutdown()


until = functools.partial(harness_until, timeout_s=WAIT_S)


@contextlib.asynccontextmanager
async def watching(*sources: tuple[str, EventSource], **cfg: Any) -> AsyncIterator[CacheIndex]:
    index = CacheIndex(CacheIndexConfig(sources=dict(sources), **cfg))
    try:
        for url, _ in sources:
            await index.watch(url)
            assert await index.wait_live(url, WAIT_S), index.status()
        yield index
    finally:
        await index.close()
    # Clean shutdown: no task of ours left, the ZMQ context terminated (term() would hang on an
    # open socket).
    assert index._ctx is None
    left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    assert left == []


def stats(index: CacheIndex, url: str = URL) -> Any:
    return next(s for s in index.status() if s.url == url)


# -- the wire ----------------------------------------------------------------------------------

def test_decode_what_vllm_encodes() -> None:
    batch = kv_events.KVEventBatch(ts=1.5, events=[
        v_stored([1, 2], None, T[:8], extra_keys=[("salt",), None], group_idx=0),
        v_removed(2), kv_events.AllBlocksCleared()], data_parallel_rank=0)
    events, unknown = decode_batch(msgspec.msgpack.encode(batch))
    assert unknown == 0
    assert events == [
        BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=T[:8], block_size=BS,
                    medium="GPU", extra_keys=[["salt"], None], group_idx=0),
        BlockRemoved(block_hashes=[2], medium="GPU"), AllBlocksCleared()]
    # bytes hashes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0) decode too
    raw = kv_events.KVEventBatch(ts=1.0, events=[v_removed(b"\x01" * 32)])  # type: ignore[arg-type]
    assert decode_batch(msgspec.msgpack.encode(raw))[0] == [
        BlockRemoved(block_hashes=[b"\x01" * 32], medium="GPU")]


def test_decode_refuses_malformed_and_skips_unknown() -> None:
    enc = msgspec.msgpack.encode
    events, unknown = decode_batch(enc([1.0, [{"type": "BlocksMoved", "x": 1},
                                              {"type": "AllBlocksCleared"}], 0]))
    assert events == [AllBlocksCleared()] and unknown == 1
    for bad in (b"\xc1", enc({"ts": 1}), enc([1.0, [{"nope": 1}]]),
                enc([1.0, [{"type": "BlockStored", "block_hashes": [1]}]]),  # fields missing
                enc([1.0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                            "token_ids": [-1, 2, 3, 4], "block_size": 4}]]),  # a negative id
                enc([1.0, [{"type": "BlockRemoved", "block_hashes": ["x"]}]])):
        with pytest.raises(InvalidMessage):
            decode_batch(bad)


def test_where_to_subscribe() -> None:
    url = "http://10.1.2.3:8000"
    assert subscriber_address("tcp://*:5557", url) == "tcp://10.1.2.3:5557"
    assert subscriber_address("tcp://[::]:5557", url) == "tcp://10.1.2.3:5557"
    assert subscriber_address("tcp://0.0.0.0:5557", "http://[fd00::1]:80") == "tcp://[fd00::1]:5557"
    assert subscriber_address("tcp://10.9.9.9:6000", url) == "tcp://10.9.9.9:6000"
    assert subscriber_address("ipc:///tmp/kv", url) == "ipc:///tmp/kv"
    for bad in ("inproc://kv", "tcp://*", "tcp://*:x", "tcp://*:0"):
        with pytest.raises(ValueError):
            subscriber_address(bad, url)
    # What vLLM 0.32 answers on GET /kv_event_sources (captured from a real instance).
    real = {"0": {"enable_kv_cache_events": True, "publisher": "zmq",
                  "endpoint": "tcp://*:52691", "replay_endpoint": "tcp://*:54023",
                  "buffer_steps": 10000, "hwm": 100000, "max_queue_size": 100000, "topic": "kv"}}
    assert source_from_publisher(real, url) == EventSource(
        endpoint="tcp://10.1.2.3:52691", replay_endpoint="tcp://10.1.2.3:54023", topic="kv")
    no_replay = {"0": dict(real["0"], replay_endpoint=None)}
    assert source_from_publisher(no_replay, url).replay_endpoint is None
    for bad, says in (({}, "--kv-events-config"),
                      ({"0": real["0"], "1": real["0"]}, "data-parallel"),
                      ({"0": dict(real["0"], enable_kv_cache_events=False)}, "off"),
                      ({"0": dict(real["0"], publisher="null")}, "off"),
                      ({"0": {"endpoint": 5}}, "format")):
        with pytest.raises(ValueError, match=says):
            source_from_publisher(bad, url)


# -- streams from vLLM's publisher -------------------------------------------------------------

def test_replay_of_what_came_before_then_live_order_eviction_and_clear() -> None:
    async def go() -> None:
        pub = Publisher()
        try:
            pub.publish(v_stored([1, 2], None, T[:8]))  # before anyone listens: PUB drops it
            pub.publish(v_stored([3], 2, T[8:12]))
            async with watching((URL, pub.source)) as index:
                assert index.cached_tokens(T[:13]) == {URL: 12}  # learned from the replay
                s = stats(index)
                c = s.counters
                assert s.state is IndexState.LIVE and c.replays == 1 and c.batches == 2
                assert s.block_size == BS and s.blocks == 3
                pub.publish(v_stored([4], 3, T[12:16]))
                await until(lambda: index.cached_tokens(T[:17]) == {URL: 16}, "block 4")
                pub.publish(v_removed(4, 3))
                await until(lambda: index.cached_tokens(T[:17]) == {URL: 8}, "eviction")
                pub.publish(v_stored([9], None, T[40:44]), kv_events.AllBlocksCleared(),
                            v_stored([10], None, T[50:54]))
                await until(lambda: stats(index).counters.batches == 5, "the clear")
                assert index.cached_tokens(T[:17]) == {URL: 0}
                assert index.cached_tokens(T[50:55]) == {URL: 4}
                s = stats(index)
                c = s.counters
                assert (c.gaps, c.drops, c.restarts, c.invalid, c.cleared) == (0, 0, 0, 0, 1)
        finally:
            pub.close()

    run(go())


def test_a_gap_is_replayed_including_a_lost_eviction() -> None:
    async def go() -> None:
        pub = Publisher()
        relay = LossyRelay(f"tcp://127.0.0.1:{pub.ports[0]}")
        src = EventSource(endpoint=relay.endpoint, replay_endpoint=pub.source.replay_endpoint,
                          topic="kv")
        try:
            async with watching((URL, src)) as index:
                pub.publish(v_stored([1, 2, 3], None, T[:12]))
                await until(lambda: index.cached_tokens(T[:13]) == {URL: 12}, "first blocks")
                # (the first sync's replay happens only if the handshake came within its bound)
                before = stats(index).counters.replays
                relay.drop_next(2)
                pub.publish(v_removed(3))  # lost on the way: the index would keep block 3
                pub.publish(v_stored([5], None, T[60:64]))  # lost too
                await until(lambda: relay.dropped == 2, "the relay to drop two")
                pub.publish(v_stored([6], None, T[70:74]))  # arrives: seq 3 after 0
                await until(lambda: stats(index).counters.batches == 4, "the replay")
                s = stats(index)
                c = s.counters
                assert c.gaps == 1 and c.replays == before + 1 and c.drops == 0
                assert index.cached_tokens(T[:13]) == {URL: 8}  # the lost eviction applied
                assert index.cached_tokens(T[60:65]) == {URL: 4}
                assert index.cached_tokens(T[70:75]) == {URL: 4}
        finally:
            relay.close()
            pub.close()

    run(go())


def test_without_replay_a_gap_drops_the_instance_entries() -> None:
    async def go() -> None:
        pub = Publisher(replay=False)
        relay = LossyRelay(f"tcp://127.0.0.1:{pub.ports[0]}")
        try:
            async with watching((URL, EventSource(endpoint=relay.endpoint, topic="kv"))) as index:
                pub.publish(v_stored([1, 2], None, T[:8]))
                await until(lambda: index.cached_tokens(T[:9]) == {URL: 8}, "first blocks")
                relay.drop_next(1)
                pub.publish(v_removed(2))
                await until(lambda: relay.dropped == 1, "the relay to drop one")
                pub.publish(v_stored([7], None, T[30:34]))
                await until(lambda: stats(index).counters.drops == 1, "the drop")
                # Block 1 may still be cached, but after a loss nothing old is trusted.
                assert index.cached_tokens(T[:9]) == {URL: 0}
                assert index.cached_tokens(T[30:35]) == {URL: 4}
                s = stats(index)
                assert s.counters.gaps == 1 and s.counters.replays == 0
        finally:
            relay.close()
            pub.close()

    run(go())


def test_a_gap_older_than_the_replay_buffer_drops_then_keeps_what_it_has() -> None:
    async def go() -> None:
        pub = Publisher(buffer_steps=2)
        relay = LossyRelay(f"tcp://127.0.0.1:{pub.ports[0]}")
        src = EventSource(endpoint=relay.endpoint, replay_endpoint=pub.source.replay_endpoint,
                          topic="kv")
        try:
            async with watching((URL, src)) as index:
                pub.publish(v_stored([1], None, T[:4]))
                await until(lambda: index.cached_tokens(T[:5]) == {URL: 4}, "first block")
                relay.drop_next(3)
                pub.publish(v_removed(1))  # seq 1: falls out of the 2-batch buffer
                pub.publish(v_stored([2], None, T[10:14]))  # seq 2
                pub.publish(v_stored([3], None, T[20:24]))  # seq 3
                await until(lambda: relay.dropped == 3, "the relay to drop three")
                pub.publish(v_stored([4], None, T[30:34]))  # seq 4 arrives; buffer: 3, 4
                await until(lambda: stats(index).counters.drops == 1, "the drop")
                await until(lambda: index.cached_tokens(T[30:35]) == {URL: 4}, "seq 4")
                assert index.cached_tokens(T[20:25]) == {URL: 4}  # replayed
                assert index.cached_tokens(T[10:15]) == {URL: 0}  # lost
                assert index.cached_tokens(T[:5]) == {URL: 0}
        finally:
            relay.close()
            pub.close()

    run(go())


def test_a_publisher_restart_drops_and_resyncs() -> None:
    async def go() -> None:
        pub = Publisher()
        try:
            async with watching((URL, pub.source)) as index:
                for i in range(3):
                    pub.publish(v_stored([10 + i], None, T[10 * i:10 * i + 4]))
                await until(lambda: stats(index).counters.batches == 3, "three batches")
                pub.restart()  # a new vLLM process: empty cache, seq from 0 again
                await asyncio.sleep(0.3)  # let the subscriber reconnect
                pub.publish(v_stored([99], None, T[50:54]))
                await until(lambda: stats(index).counters.restarts == 1, "the restart")
                await until(lambda: index.cached_tokens(T[50:55]) == {URL: 4}, "new block")
                assert index.cached_tokens(T[:5]) == {URL: 0}
                assert stats(index).counters.drops == 1
        finally:
            pub.close()

    run(go())


def test_a_restart_whose_first_batches_were_missed_is_still_a_restart() -> None:
    """The new publisher's seq is already past ours when we hear from it again: without the
    check after a reconnect this would look like a gap, and the old entries would survive."""
    async def go() -> None:
        pub = Publisher()
        try:
            async with watching((URL, pub.source)) as index:
                for i in range(3):
                    pub.publish(v_stored([10 + i], None, T[10 * i:10 * i + 4]))
                await until(lambda: stats(index).counters.batches == 3, "three batches")
                pub.restart()
                for i in range(5):  # published before the subscriber is back: lost live
                    pub.publish(v_stored([50 + i], None, T[50 + i:54 + i]))
                deadline = time.monotonic() + WAIT_S
                extra = 0
                while index.cached_tokens(T[80:85]).get(URL) != 4:
                    assert time.monotonic() < deadline, index.status()
                    if extra < 20:  # seq 5, 6, ...: until one reaches us
                        pub.publish(v_stored([80 + extra], None, T[80 + extra:84 + extra]))
                        extra += 1
                    await asyncio.sleep(0.3)
                s = stats(index)
                c = s.counters
                assert c.restarts == 1 and c.drops == 1 and c.gaps == 0, s
                assert index.cached_tokens(T[:5]) == {URL: 0}  # the old publisher's
                assert index.cached_tokens(T[50:55]) == {URL: 4}  # replayed from 0
        finally:
            pub.close()

    run(go())


def test_malformed_messages_count_and_drop_then_the_stream_goes_on() -> None:
    async def go() -> None:
        ctx = zmq.Context()
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        enc = msgspec.msgpack.encode

        def send(seq: int, payload: bytes, topic: bytes = b"kv") -> None:
            pub.send_multipart([topic, seq.to_bytes(8, "big"), payload])

        def batch(*events: Any) -> bytes:
            return enc(kv_events.KVEventBatch(ts=1.0, events=list(events)))

        try:
            src = EventSource(endpoint=f"tcp://127.0.0.1:{port}", topic="kv")
            async with watching((URL, src)) as index:
                await asyncio.sleep(0.2)
                send(0, batch(v_stored([1], None, T[:4])))
                await until(lambda: index.cached_tokens(T[:5]) == {URL: 4}, "seq 0")
                send(1, b"\x93\x01")  # truncated msgpack
                await until(lambda: stats(index).counters.invalid == 1, "invalid batch")
                assert index.cached_tokens(T[:5]) == {URL: 0}
                pub.send_multipart([b"kv", b"\x00\x02"])  # a 2-byte seq, 2 frames
                await until(lambda: stats(index).counters.invalid == 2, "invalid frames")
                send(5, batch(v_stored([2], None, T[8:12])), topic=b"kvx")  # not our topic
                send(2, enc([1.0, [{"type": "Future"}, {"type": "AllBlocksCleared"}], 0]))
                send(3, batch(v_stored([3], None, T[20:24])))
                await until(lambda: index.cached_tokens(T[20:25]) == {URL: 4}, "recovery")
                s = stats(index)
                c = s.counters
                assert c.unknown_events == 1 and c.invalid == 2 and c.drops == 2
                assert index.cached_tokens(T[8:13]) == {URL: 0}
        finally:
            pub.close(0)
            ctx.term()

    run(go())


def test_two_instances_reset_and_unwatch() -> None:
    async def go() -> None:
        a, b = Publisher(), Publisher()
        ua, ub = "http://127.0.0.1:1", "http://127.0.0.1:2"
        try:
            async with watching((ua, a.source), (ub, b.source)) as index:
                a.publish(v_stored([1, 2], None, T[:8]))
                b.publish(v_stored([7], None, T[:4]))
                await until(lambda: index.cached_tokens(T[:9]) == {ua: 8, ub: 4}, "both")
                assert index.cached_tokens(T[:9], instances=[ub + "/"]) == {ub: 4}
                index.reset(ua)  # e.g. health probes saw it restart: rebuilt from its replay
                await until(lambda: stats(index, ua).counters.replays == 2, "the resync")
                assert index.cached_tokens(T[:9]) == {ua: 8, ub: 4}
                assert stats(index, ua).counters.drops == 0  # asked for, not lost
                # one counters struct per instance, shared by its stream and its view, kept
                # across the reset: the blocks stored before it and again from the replay
                assert stats(index, ua).counters.stored == 4
                await index.unwatch(ua)
                assert index.cached_tokens(T[:9]) == {ub: 4}
                assert index.index.get(ua) is None and [s.url for s in index.status()] == [ub]
        finally:
            a.close()
            b.close()

    run(go())


# -- discovery over HTTP ------------------------------------------------------------------------

async def serve_get(path: str, handler: Any) -> tuple[web.AppRunner, str]:
    """A loopback HTTP server answering GET ``path``; its runner and base URL."""
    app = web.Application()
    app.router.add_get(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


def test_discovery_from_kv_event_sources() -> None:
    async def go() -> None:
        pub = Publisher()
        answers: dict[str, Any] = {}

        async def sources(request: web.Request) -> web.Response:
            answer = answers.get(request.match_info["name"], 503)  # 503: not up yet
            if isinstance(answer, int):
                return web.Response(status=answer)
            return web.json_response(answer)

        runner, base = await serve_get("/{name}/kv_event_sources", sources)
        p, r = pub.ports
        answers["good"] = {"0": {"enable_kv_cache_events": True, "publisher": "zmq",
                                 "endpoint": f"tcp://*:{p}", "replay_endpoint": f"tcp://*:{r}",
                                 "buffer_steps": 10000, "hwm": 100000, "max_queue_size": 100000,
                                 "topic": "kv"}}
        answers["off"] = {}
        answers["old"] = 404
        index = CacheIndex(CacheIndexConfig(connect_timeout_s=2, retry_s=0.2))
        try:
            pub.publish(v_stored([1], None, T[:4]))
            for name in ("good", "off", "old", "down"):
                await index.watch(f"{base}/{name}", "decode")
            await index.watch(f"http://127.0.0.1:{free_port()}", "prefill")  # nobody there
            assert await index.wait_live(f"{base}/good", WAIT_S)
            assert not await index.wait_live(f"{base}/off", WAIT_S)
            assert not await index.wait_live(f"{base}/old", WAIT_S)
            assert index.cached_tokens(T[:5]) == {f"{base}/good": 4}
            by_url = {s.url: s for s in index.status()}
            assert by_url[f"{base}/good"].endpoint == f"tcp://127.0.0.1:{p}"
            assert by_url[f"{base}/good"].role == "decode"
            assert by_url[f"{base}/off"].state is IndexState.DISABLED
            assert "--kv-events-config" in (by_url[f"{base}/off"].reason or "")
            assert "/kv_event_sources" in (by_url[f"{base}/old"].reason or "")
            assert by_url[f"{base}/down"].state is IndexState.DISCOVERING
            answers["down"] = answers["good"]  # it comes up: the next retry finds it
            assert await index.wait_live(f"{base}/down", WAIT_S)
            answers["off"] = answers["good"]  # restarted with events on
            index.reset(f"{base}/off")
            assert await index.wait_live(f"{base}/off", WAIT_S)
            assert len(index.cached_tokens(T[:5])) == 3
        finally:
            await index.close()
            await runner.cleanup()
            pub.close()
        assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []

    run(go())


def test_config_is_checked() -> None:
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"replay_timeout_s": 0}, CacheIndexConfig)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"sources": {URL: {"endpoint": "tcp://x:1", "bogus": 1}}},
                        CacheIndexConfig)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"tokenizer": {"mode": "psychic"}}, CacheIndexConfig)
    cfg = msgspec.convert(json.loads('{"sources": {"http://a:1": {"endpoint": "tcp://a:2"}}}'),
                          CacheIndexConfig)
    assert cfg.sources["http://a:1"].replay_endpoint is None


def test_every_key_is_documented() -> None:
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[4] / "docs" / "configuration.md").read_text()
    keys = [f"cache_index.{f}" for f in CacheIndexConfig.__struct_fields__]
    keys += [f"cache_index.tokenizer.{f}" for f in TokenizerConfig.__struct_fields__]
    missing = [k for k in keys if f"`{k}`" not in doc]
    assert missing == [], f"not in docs/configuration.md: {missing}"


def test_a_starting_instance_is_found_soon_after_it_comes_up() -> None:
    """Not up at the first ask: asked again after 0.5 s, then 1 s, ..., up to retry_s, so an
    instance that comes up 1 s later is followed within about a second, not after retry_s."""
    async def go() -> None:
        pub = Publisher()
        up = False
        p, r = pub.ports
        good = {"0": {"enable_kv_cache_events": True, "publisher": "zmq",
                      "endpoint": f"tcp://*:{p}", "replay_endpoint": f"tcp://*:{r}",
                      "buffer_steps": 10000, "hwm": 100000, "max_queue_size": 100000,
                      "topic": "kv"}}

        async def sources(request: web.Request) -> web.Response:
            return web.json_response(good) if up else web.Response(status=503)

        runner, url = await serve_get("/kv_event_sources", sources)
        index = CacheIndex(CacheIndexConfig(connect_timeout_s=2, retry_s=30))
        try:
            await index.watch(url, "decode")
            await asyncio.sleep(1.0)  # asked at 0 and 0.5 s: not up
            up = True
            started = time.monotonic()
            assert await index.wait_live(url, WAIT_S)
            assert time.monotonic() - started < 3.0  # the 1.5 s retry, not retry_s (30 s)
        finally:
            await index.close()
            await runner.cleanup()
            pub.close()

    run(go())
