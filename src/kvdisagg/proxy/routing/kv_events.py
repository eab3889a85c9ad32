"""vLLM's KV cache events from one instance, over ZMQ: subscribe, keep the sequence, replay what
was missed, hand each batch to a sink (the prefix index) in order.

vLLM publishes them when started with ``--kv-events-config '{"enable_kv_cache_events": true,
"publisher": "zmq", "endpoint": "tcp://*:PORT", "replay_endpoint": "tcp://*:PORT2"}'``
(vllm/distributed/kv_events.py, ``ZmqEventPublisher``):

- live, on a PUB socket: multipart ``[topic, seq (8 bytes, big endian), msgpack batch]``; a
  batch is an array ``[ts, [event, ...], data_parallel_rank]``; an event is a map tagged by
  ``type``: ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``. ``seq`` counts from 0
  per publisher process;
- replay, on a ROUTER socket: a DEALER sends ``[b"", start seq]`` and gets every batch still
  buffered (``buffer_steps``) from that seq on, as ``[b"", topic, seq, batch]``, then
  ``[b"", b"", seq -1, b""]``.

Sequence rules (``EventStream``): a seq past the expected one is a gap -> replay from the
expected one; a seq before it is a publisher restart (a new vLLM process, its cache empty) ->
drop the instance's entries, replay from 0. A replay that is unavailable, fails, or no longer
holds the missing range -> drop the instance's entries and start over from what arrives:
a lost ``BlockRemoved`` would otherwise leave a block the instance no longer holds. Everything
that crosses the process boundary is validated (frames, seq, msgspec types); a malformed batch
counts as lost. Waits on the publisher are bounded (handshake, each replay frame); an idle
instance is not an error.

Must not import vllm: the proxy runs without it.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Sequence
from typing import Annotated, Any, Protocol
from urllib.parse import urlsplit

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from kvdisagg.proxy.config import EventSource

__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "Event", "EventBatch", "EventSink",
           "EventStream", "Hash", "InvalidMessage", "PublisherConfig",
           "IndexCounters", "StreamState", "decode_batch", "source_from_publisher",
           "subscriber_address"]

log = logging.getLogger("kvdisagg.proxy.routing.kv_events")

Hash = int | bytes
"""vLLM's ``ExternalBlockHash``: an int (the default, ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``)
or the raw hash bytes."""

TokenId = Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)]
END_SEQ = (-1).to_bytes(8, "big", signed=True)


# -- wire: our own mirror of vllm.distributed.kv_events (vLLM 0.32) --------------------------------
# Unknown fields are ignored (vLLM adds fields with defaults); the ones we use are type-checked.
# Fields vLLM always sends get defaults here too, so an older or newer producer still decodes.

class BlockStored(msgspec.Struct, tag=True, frozen=True, gc=False):
    """Full blocks newly cached by one request, in order; ``parent_block_hash`` is the vLLM hash
    of the block before the first of them (None: they start the prompt)."""

    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[TokenId]
    block_size: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)]
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[list[Any] | None] | None = None
    """Per block: LoRA name, ``(mm identifier, offset)`` pairs, cache salt, embedding digests."""
    group_idx: int | None = None


class BlockRemoved(msgspec.Struct, tag=True, frozen=True, gc=False):
    """Blocks evicted (one event per evicted copy)."""

    block_hashes: list[Hash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, frozen=True, gc=False):
    """The instance's prefix cache was reset."""


Event = BlockStored | BlockRemoved | AllBlocksCleared
KNOWN_EVENTS = frozenset(("BlockStored", "BlockRemoved", "AllBlocksCleared"))


class EventBatch(msgspec.Struct, array_like=True, frozen=True, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class _Tag(msgspec.Struct):
    type: str


_batch_decoder = msgspec.msgpack.Decoder(EventBatch)
_event_decoder = msgspec.msgpack.Decoder(Event)
_tag_decoder = msgspec.msgpack.Decoder(_Tag)


class InvalidMessage(ValueError):
    """A message from the publisher that does not follow vLLM's format."""


def decode_batch(payload: bytes) -> tuple[list[Event], int]:
    """The events of one msgpack batch, and how many had a type we do not know (skipped).

    Raises InvalidMessage for anything malformed, including a known event type with bad fields.
    """
    try:
        batch = _batch_decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise InvalidMessage(f"batch: {exc}") from None
    events: list[Event] = []
    unknown = 0
    for raw in batch.events:
        try:
            events.append(_event_decoder.decode(raw))
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            try:
                tag = _tag_decoder.decode(raw).type
            except (msgspec.DecodeError, msgspec.ValidationError):
                raise InvalidMessage(f"event: {exc}") from None
            if tag in KNOWN_EVENTS:
                raise InvalidMessage(f"{tag}: {exc}") from None
            unknown += 1
    return events, unknown


# -- where to subscribe --------------------------------------------------------------------------

class PublisherConfig(msgspec.Struct, frozen=True):
    """One data-parallel rank's entry of ``GET /kv_event_sources`` (vLLM's KVEventsConfig)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    topic: str = ""


def _url_host(instance_url: str) -> str:
    host = urlsplit(instance_url).hostname
    if not host:
        raise ValueError(f"instance url {instance_url!r} has no host")
    return f"[{host}]" if ":" in host else host


def subscriber_address(endpoint: str, instance_url: str) -> str:
    """The address a subscriber connects to for a publisher configured with ``endpoint``.

    vLLM binds wildcard endpoints (``tcp://*:P``, ``tcp://[::]:P``, ``tcp://0.0.0.0:P``): the
    instance's host (from its URL) with that port. A concrete ``tcp://host:P`` is used as given
    (vLLM reports ``tcp://*:0`` bound as ``tcp://<node ip>:<port>``); ``ipc://`` too. An
    ``inproc://`` endpoint cannot be reached from another process: ValueError.
    """
    if endpoint.startswith("ipc://"):
        return endpoint
    if not endpoint.startswith("tcp://"):
        raise ValueError(f"KV events endpoint {endpoint!r}: only tcp:// and ipc:// can be "
                         "reached from the proxy")
    hostport = endpoint[len("tcp://"):]
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"KV events endpoint {endpoint!r} has no port")
    if host in ("*", "[::]", "::", "0.0.0.0", "[*]"):
        return f"tcp://{_url_host(instance_url)}:{port}"
    return endpoint


def source_from_publisher(sources: Any, instance_url: str) -> EventSource:
    """The EventSource of an instance from its ``GET /kv_event_sources`` answer (decoded JSON).

    ValueError, with what to change, when the instance publishes nothing the index can use.
    """
    try:
        ranks = msgspec.convert(sources, dict[str, PublisherConfig])
    except msgspec.ValidationError as exc:
        raise ValueError(f"/kv_event_sources is not vLLM's format: {exc}") from None
    if not ranks:
        raise ValueError("it publishes no KV cache events: start vLLM with --kv-events-config "
                         "'{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", "
                         "\"endpoint\": \"tcp://*:PORT\", \"replay_endpoint\": "
                         "\"tcp://*:PORT2\"}'")
    if len(ranks) > 1:
        raise ValueError(f"it has {len(ranks)} data-parallel ranks behind one URL, each with its "
                         "own cache, and vLLM picks the rank: the cached prefix of a request "
                         "cannot be predicted; list each rank's server as an instance")
    cfg = next(iter(ranks.values()))
    if not cfg.enable_kv_cache_events or cfg.publisher != "zmq":
        raise ValueError(f"its KV events are off (enable_kv_cache_events="
                         f"{cfg.enable_kv_cache_events}, publisher={cfg.publisher!r}): "
                         "start vLLM with --kv-events-config and publisher zmq")
    replay = cfg.replay_endpoint
    return EventSource(endpoint=subscriber_address(cfg.endpoint, instance_url),
                       replay_endpoint=subscriber_address(replay, instance_url) if replay else None,
                       topic=cfg.topic)


# -- the stream ---------------------------------------------------------------------------------

class EventSink(Protocol):
    """Where batches go (PrefixIndex). Called from the stream's task, in sequence order."""

    def apply(self, instance: str, events: Sequence[Event]) -> None: ...

    def clear(self, instance: str) -> int: ...


class StreamState(str, enum.Enum):
    CONNECTING = "connecting"  # waiting for the publisher's handshake
    SYNCING = "syncing"  # first replay (what the instance cached before we listened)
    LIVE = "live"
    STOPPED = "stopped"


class IndexCounters(msgspec.Struct, kw_only=True):
    """One instance's counters in the cache index, kept together by its event stream
    (``EventStream``, the first group) and its view in the prefix index
    (``prefix_index.IndexedInstance``, the second), and reported as they are
    (``cache_index.InstanceStatus``, /metrics). They only grow (Prometheus counters)."""

    batches: int = 0
    """Batches applied (live and replayed)."""
    events: int = 0
    gaps: int = 0
    """Times a seq skipped ahead (batches missed)."""
    restarts: int = 0
    """Times the seq went back (a new publisher process)."""
    replays: int = 0
    """Replays completed."""
    replay_failures: int = 0
    """Replays that timed out or broke (the instance's entries were then dropped)."""
    drops: int = 0
    """Times the instance's entries were dropped because events were lost."""
    invalid: int = 0
    """Messages refused by validation."""
    unknown_events: int = 0
    """Events of a type we do not know (skipped)."""
    stored: int = 0
    """Block copies indexed (BlockStored)."""
    removed: int = 0
    """Block copies evicted (BlockRemoved of a block the index held)."""
    cleared: int = 0
    """AllBlocksCleared events (vLLM's prefix cache was reset)."""
    orphans: int = 0
    """Blocks stored under a parent the index does not hold (skipped)."""
    ignored: int = 0
    """Blocks of another tier (medium) or another block size, or malformed (skipped)."""
    overflows: int = 0
    """Times the instance claimed more blocks than ``max_blocks`` (entries dropped)."""


class _Replay(enum.Enum):
    DONE = "done"  # the buffer from the start seq on was applied
    MISMATCH = "mismatch"  # the batch to verify is not the one we applied: another publisher
    FAILED = "failed"  # timed out or broke (what came before the failure is applied)
    UNAVAILABLE = "unavailable"  # no replay endpoint


class EventStream:
    """Consumes one instance's events into ``sink`` until cancelled (``run``).

    Owned by one asyncio task; the sockets are created and closed inside ``run``. A dropped
    connection makes the next batch suspect: a restarted publisher counts from 0 again, and if
    we missed its first batches its seq may already be past ours, so before anything else the
    batch we applied last is replayed and compared (same bytes: the same publisher).
    """

    def __init__(self, ctx: zmq.asyncio.Context, instance: str, source: EventSource,
                 sink: EventSink, *, connect_timeout_s: float = 5.0,
                 replay_timeout_s: float = 5.0, max_message_bytes: int = 64 << 20,
                 poll_s: float = 1.0, counters: IndexCounters | None = None) -> None:
        self.ctx = ctx
        self.instance = instance
        self.source = source
        self.sink = sink
        self.connect_timeout_s = connect_timeout_s
        self.replay_timeout_s = replay_timeout_s
        self.max_message_bytes = max_message_bytes
        self.poll_s = poll_s
        self.state = StreamState.CONNECTING
        self.counters = IndexCounters() if counters is None else counters
        self._topic = source.topic.encode()
        self._expected: int | None = None  # next seq; None: no state continuous with the stream
        self._last: tuple[int, int] | None = None  # (seq, hash(batch)) applied last
        self._overlap: dict[int, int] | None = None  # seq -> hash(batch) of the last replay
        self._suspect = False  # the connection dropped since the last batch
        self._resync_wanted = False
        self.synced = asyncio.Event()
        """Set once the first sync attempt ended (replayed, or nothing to replay from)."""

    def request_resync(self) -> None:
        """Drop the instance's entries and replay its whole buffer (e.g. it was restarted);
        done by the stream's task at its next turn (within ``poll_s``)."""
        self._resync_wanted = True

    def _socket(self, kind: int) -> zmq.asyncio.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 5000)
        return sock

    async def run(self) -> None:
        sub = self._socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, 100_000)  # vLLM's own hwm: a long replay must not overflow it
        # ZMTP heartbeats: a publisher host that vanished without closing is noticed (the
        # connection drops, and the next batch is verified).
        sub.setsockopt(zmq.HEARTBEAT_IVL, 5000)
        sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, 15000)
        sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        try:
            sub.connect(self.source.endpoint)
            connected = await self._handshake(monitor)
            self.state = StreamState.SYNCING
            if connected:
                await self._replay(0)
            self.state = StreamState.LIVE
            self.synced.set()
            poller = zmq.asyncio.Poller()
            poller.register(sub, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            while True:
                if self._resync_wanted:
                    self._resync_wanted = False
                    self._drop("a resync was requested", lost=False)
                    await self._replay(0)
                ready = dict(await poller.poll(int(self.poll_s * 1000)))
                if monitor in ready:  # first: a disconnect precedes the next connection's data
                    event = await recv_monitor_message(monitor)
                    if event["event"] == zmq.EVENT_DISCONNECTED:
                        self._suspect = True
                    continue
                if sub not in ready:
                    continue
                frames = await sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    self.counters.invalid += 1
                    self._drop(f"a message of {len(frames)} frames is not vLLM's "
                               "[topic, seq, batch]")
                    continue
                if frames[0] != self._topic:
                    continue  # another topic sharing our prefix (ZMQ filters by prefix)
                await self._on_live(int.from_bytes(frames[1], "big"), frames[2])
        finally:
            self.state = StreamState.STOPPED
            self.synced.set()
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    async def _handshake(self, monitor: zmq.asyncio.Socket) -> bool:
        """True once the publisher's handshake is done (our subscription then reaches it
        before any replay we ask for), False if it did not come within the bound (ZMQ keeps
        reconnecting in the background)."""
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                while True:
                    event = await recv_monitor_message(monitor)
                    if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                        return True
        except TimeoutError:
            log.warning("kv events: no publisher answers at %s for %s within %.1fs; still "
                        "trying", self.source.endpoint, self.instance, self.connect_timeout_s)
            return False

    def _drop(self, reason: str, *, lost: bool = True) -> None:
        n = self.sink.clear(self.instance)
        self._expected = None
        self._last = None
        self._overlap = None
        if lost:
            self.counters.drops += 1
            log.warning("kv events of %s: %s; dropped its %d indexed blocks, starting over",
                        self.instance, reason, n)

    async def _on_live(self, seq: int, payload: bytes) -> None:
        if self._suspect:
            self._suspect = False
            if self._last is not None:
                last_seq = self._last[0]
                verdict = await self._replay(last_seq, verify=self._last)
                if verdict is _Replay.MISMATCH:
                    self.counters.restarts += 1
                    self._drop(f"it reconnected with another batch {last_seq}: its publisher "
                               "restarted")
                elif verdict is not _Replay.DONE:
                    self._drop("it reconnected, and without a replay of batch "
                               f"{last_seq} it may be another publisher")
        if self._overlap is not None:
            if self._overlap.get(seq) == hash(payload):
                return  # published while we replayed: the replay applied it already
            self._overlap = None
        exp = self._expected
        if exp is not None and seq < exp:
            self.counters.restarts += 1
            self._drop(f"its publisher restarted (seq {seq} after {exp - 1})")
            exp = None
        elif exp is not None and seq > exp:
            self.counters.gaps += 1
            log.info("kv events of %s: batches %d..%d missed; replaying", self.instance, exp,
                     seq - 1)
        start = 0 if exp is None else exp
        if seq > start:
            await self._replay(start)
            exp = self._expected
            if exp is not None and seq < exp:
                return  # the replay brought it
            if exp is not None and seq > exp:
                self._drop(f"batches {exp}..{seq - 1} are lost and no replay holds them")
            # else no state is kept (never synced, or dropped): start over from this batch
        self._apply(seq, payload)

    def _apply(self, seq: int, payload: bytes) -> None:
        """Apply batch ``seq``: the next one after the current state, or the first of a new
        start (no state kept)."""
        self._expected = seq + 1
        try:
            events, unknown = decode_batch(payload)
        except InvalidMessage as exc:
            self.counters.invalid += 1
            self._drop(f"batch {seq} is malformed ({exc})")
            self._expected = seq + 1
            return
        self._last = (seq, hash(payload))
        if unknown:
            if not self.counters.unknown_events:
                log.warning("kv events of %s: skipping events of a type this proxy does not "
                            "know (a newer vLLM?)", self.instance)
            self.counters.unknown_events += unknown
        self.counters.batches += 1
        self.counters.events += len(events)
        self.sink.apply(self.instance, events)

    async def _replay(self, start: int, verify: tuple[int, int] | None = None) -> _Replay:
        """Ask the publisher for its buffered batches from ``start`` on and apply them.

        Leaves ``_expected`` after the last batch applied. A buffer that no longer reaches back
        to ``start`` drops the instance's entries (when it had any) first. ``verify``: (seq,
        hash) of the batch at ``start``, already applied: MISMATCH, and nothing applied, unless
        the replay begins with exactly that batch.
        """
        endpoint = self.source.replay_endpoint
        if endpoint is None:
            return _Replay.UNAVAILABLE
        dealer = self._socket(zmq.DEALER)
        overlap: dict[int, int] = {}
        try:
            dealer.connect(endpoint)
            async with asyncio.timeout(self.replay_timeout_s):
                await dealer.send_multipart((b"", start.to_bytes(8, "big")))
            first = True
            while True:
                async with asyncio.timeout(self.replay_timeout_s):
                    frames = await dealer.recv_multipart()
                if len(frames) != 4 or frames[0] != b"" or len(frames[2]) != 8:
                    raise InvalidMessage(f"a replay message of {len(frames)} frames")
                end = frames[2] == END_SEQ
                if not end and frames[1] != self._topic:
                    raise InvalidMessage(f"a replayed batch of topic {frames[1]!r}")
                seq = -1 if end else int.from_bytes(frames[2], "big")
                if first:
                    first = False
                    if verify is not None:
                        if (seq, hash(frames[3])) != verify:
                            return _Replay.MISMATCH
                        overlap[seq] = verify[1]
                        continue
                    if not end and seq > start and self._expected is not None:
                        self._drop(f"batches {start}..{seq - 1} are no longer in its replay "
                                   "buffer")
                if end:
                    break
                exp = self._expected
                if exp is not None and seq < exp:
                    continue
                if exp is not None and seq > exp:
                    raise InvalidMessage(f"the replay skipped from {exp} to {seq}")
                self._apply(seq, frames[3])
                overlap[seq] = hash(frames[3])
                if len(overlap) % 64 == 0:
                    await asyncio.sleep(0)  # a long replay must not hold the proxy's loop
            self.counters.replays += 1
            self._overlap = overlap or None
            if self._expected is None and start == 0:
                self._expected = 0  # nothing published yet: the empty state is complete
            return _Replay.DONE
        except (TimeoutError, InvalidMessage, zmq.ZMQError) as exc:
            self.counters.replay_failures += 1
            what = "timed out" if isinstance(exc, TimeoutError) else str(exc)
            log.warning("kv events of %s: replay from %d at %s failed: %s", self.instance, start,
                        endpoint, what)
            self._overlap = overlap or None
            return _Replay.FAILED
        finally:
            dealer.close(linger=0)
