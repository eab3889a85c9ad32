"""What each instance's prefix cache holds, learned from vLLM itself: one ``CacheIndex`` per
proxy watches each instance's KV cache events (kv_events.py) into one prefix index
(prefix_index.py) and answers, per request, how many prompt tokens each instance would reuse.

    index = CacheIndex(cfg)                      # one per proxy, inside its event loop
    await index.watch(url, Role.DECODE)          # find its publisher, subscribe, replay
    index.cached_tokens(token_ids)               # {url: tokens vLLM would reuse}
    await index.unwatch(url)                     # stop, drop its entries
    await index.close()

Where the events are: ``GET /kv_event_sources`` on the instance (vLLM's publisher config per
data-parallel rank), its endpoint's port on the host of the instance's URL, unless
``CacheIndexConfig.sources`` names them. An instance whose events the index cannot use (events
off, several ranks behind one URL, an unreachable endpoint, a hybrid KV cache) is said so in
the log once and left out of every answer (``InstanceStatus.state`` DISABLED with the reason).

The index is a routing hint: a wrong answer costs latency, never a request. Must not import
vllm.
"""

from __future__ import annotations

import asyncio
import copy
import enum
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import aiohttp
import msgspec
import zmq
import zmq.asyncio

from kvdisagg.proxy.config import CacheIndexConfig, EventSource
from kvdisagg.proxy.routing.kv_events import (
    EventStream,
    IndexCounters,
    StreamState,
    source_from_publisher,
)
from kvdisagg.proxy.routing.prefix_index import Lookup, Pending, PrefixIndex
from kvdisagg.proxy.routing.prompt_keys import NO_EXTRA, BlockExtra

__all__ = ["CacheIndex", "IndexState", "InstanceStatus"]

log = logging.getLogger("kvdisagg.proxy.routing.cache_index")
FIRST_RETRY_S = 0.5  # the first wait before asking a starting instance again (then doubled)


class IndexState(str, enum.Enum):
    DISCOVERING = "discovering"  # asking GET /kv_event_sources
    CONNECTING = "connecting"  # ZMQ handshake with the publisher
    SYNCING = "syncing"  # first replay
    LIVE = "live"  # answering
    DISABLED = "disabled"  # cannot use this instance's events (reason)
    STOPPED = "stopped"


class InstanceStatus(msgspec.Struct, kw_only=True, frozen=True):
    """One instance's index, for /admin/list and metrics."""

    url: str
    role: str
    state: IndexState
    reason: str | None = None
    endpoint: str | None = None
    replay_endpoint: str | None = None
    block_size: int | None = None
    blocks: int = 0
    """Distinct blocks indexed now."""
    counters: IndexCounters = msgspec.field(default_factory=IndexCounters)
    """A copy of its stream's and view's counters (they only grow)."""


@dataclass
class _Watch:
    url: str
    role: str
    task: asyncio.Task[None] | None = None
    source: EventSource | None = None
    stream: EventStream | None = None
    reason: str | None = None
    discovered: asyncio.Event = field(default_factory=asyncio.Event)
    counters: IndexCounters = field(default_factory=IndexCounters)
    """The instance's, kept by its stream and its view in the index together, across
    resets (they only grow)."""

    @property
    def state(self) -> IndexState:
        if self.reason is not None:
            return IndexState.DISABLED
        if self.stream is None:
            return IndexState.DISCOVERING
        return IndexState(self.stream.state.value)


def _key(url: str) -> str:
    return url.rstrip("/")


class CacheIndex:
    """One per proxy; every method runs on the proxy's event loop."""

    def __init__(self, cfg: CacheIndexConfig | None = None) -> None:
        self.cfg = cfg or CacheIndexConfig()
        self.index = PrefixIndex(self.cfg.max_blocks_per_instance)
        self._ctx: zmq.asyncio.Context | None = None
        self._watches: dict[str, _Watch] = {}
        self._closed = False

    def _context(self) -> zmq.asyncio.Context:
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        return self._ctx

    # -- membership -------------------------------------------------------------------------

    async def watch(self, url: str, role: str = "kv_both") -> None:
        """Start following ``url``'s events (in the background; returns at once). Idempotent;
        ``role`` (prefill, decode, kv_both) is only a label for status and metrics."""
        if self._closed:
            raise RuntimeError("CacheIndex is closed")
        key = _key(url)
        role = getattr(role, "value", role)
        w = self._watches.get(key)
        if w is not None:
            w.role = role
            return
        w = self._watches[key] = _Watch(key, role)
        self.index.add(key, w.counters)
        w.task = asyncio.create_task(self._run(w), name=f"kv-events {key}")

    async def unwatch(self, url: str) -> None:
        """Stop following ``url`` and drop everything it had."""
        w = self._watches.pop(_key(url), None)
        if w is not None:
            await self._stop(w)
        self.index.remove(_key(url))

    def reset(self, url: str) -> None:
        """Drop ``url``'s entries and rebuild them from its replay buffer, e.g. when health
        probes saw it restart. A disabled instance is asked ``/kv_event_sources`` again."""
        w = self._watches.get(_key(url))
        if w is None:
            return
        if w.stream is not None and w.reason is None:
            self.index.remove(w.url)  # also lifts a disabling the events caused (hybrid cache)
            self.index.add(w.url, w.counters)
            w.stream.request_resync()
            return
        if w.reason is not None:
            self.index.remove(w.url)
            old = w.task
            w.reason, w.source, w.stream = None, None, None
            w.discovered = asyncio.Event()
            self.index.add(w.url, w.counters)
            if old is not None:
                old.cancel()
            w.task = asyncio.create_task(self._run(w), name=f"kv-events {w.url}")

    async def close(self) -> None:
        """Stop every stream and close the ZMQ context; the index is empty afterwards."""
        self._closed = True
        watches = list(self._watches.values())
        self._watches.clear()
        await asyncio.gather(*(self._stop(w) for w in watches))
        for w in watches:
            self.index.remove(w.url)
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    async def _stop(self, w: _Watch) -> None:
        if w.task is not None:
            w.task.cancel()
            try:
                await w.task
            except asyncio.CancelledError:
                pass

    # -- the per-instance task --------------------------------------------------------------

    async def _run(self, w: _Watch) -> None:
        try:
            source = self.cfg.sources.get(w.url) or await self._discover(w)
            if source is None:
                return
            w.source = source
            log.info("kv events of %s: subscribing to %s (replay: %s, topic %r)", w.url,
                     source.endpoint, source.replay_endpoint or "none", source.topic)
            w.stream = EventStream(self._context(), w.url, source, self.index,
                                   connect_timeout_s=self.cfg.connect_timeout_s,
                                   replay_timeout_s=self.cfg.replay_timeout_s,
                                   max_message_bytes=self.cfg.max_message_bytes,
                                   counters=w.counters)
            w.discovered.set()
            await w.stream.run()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug must not take the proxy down: the hint goes away
            log.exception("kv events of %s: stopped", w.url)
            self._disable(w, f"its event stream failed: {exc!r}")
        finally:
            w.discovered.set()

    def _disable(self, w: _Watch, reason: str) -> None:
        w.reason = reason
        self.index.disable(w.url, reason)

    async def _discover(self, w: _Watch) -> EventSource | None:
        """The instance's publisher from ``GET /kv_event_sources``; retried while it does not
        answer, None (the watch disabled) when its answer rules the index out."""
        timeout = aiohttp.ClientTimeout(total=self.cfg.connect_timeout_s)
        said = False
        # An instance starting up answers within seconds: ask again soon, then back off to
        # retry_s (the proxy's first requests should not miss the index for want of a retry).
        wait_s = min(FIRST_RETRY_S, self.cfg.retry_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                try:
                    async with session.get(w.url + "/kv_event_sources") as resp:
                        body = await resp.read()
                        status = resp.status
                except (aiohttp.ClientError, TimeoutError) as exc:
                    status, body = 0, repr(exc).encode()
                if status == 200:
                    try:
                        return source_from_publisher(msgspec.json.decode(body), w.url)
                    except (ValueError, msgspec.DecodeError) as exc:
                        self._disable(w, str(exc))
                        return None
                if status == 404:
                    self._disable(w, "it has no GET /kv_event_sources (vLLM older than 0.32?): "
                                     "name its events in cache_index.sources")
                    return None
                if not said:
                    log.info("kv events of %s: cannot ask for its publisher yet (%s); retrying "
                             "(backing off to every %.0fs)", w.url,
                             status or body.decode(errors="replace"), self.cfg.retry_s)
                    said = True
                await asyncio.sleep(wait_s)
                wait_s = min(wait_s * 2, self.cfg.retry_s)

    # -- queries ----------------------------------------------------------------------------

    def answering(self) -> list[str]:
        """URLs the index answers for now (live streams)."""
        return [w.url for w in self._watches.values()
                if w.reason is None and w.stream is not None
                and w.stream.state is StreamState.LIVE
                and self.index.get(w.url) is not None
                and self.index.get(w.url).disabled is None]  # type: ignore[union-attr]

    def cached_tokens(self, token_ids: Sequence[int], extra: BlockExtra = NO_EXTRA,
                      instances: Iterable[str] | None = None) -> dict[str, int]:
        """Prompt tokens each instance would reuse from its prefix cache for ``token_ids``
        (whole blocks, at most ``len(token_ids) - 1`` as vLLM caps a hit).

        Only instances the index answers for appear (absent: unknown, not zero); restrict
        with ``instances`` (URLs). ``extra``: the request's LoRA name and cache salt. Pure
        lookup (does not modify anything); about 10 us of CPU per 128-token block on the 2-core
        test machine (benchmarks/tokenizer.py). Raises ValueError for token ids outside
        [0, 2**32).
        """
        live = self.answering()
        if instances is not None:
            wanted = {_key(u) for u in instances}
            live = [u for u in live if u in wanted]
        return self.index.cached_tokens(token_ids, extra, live)

    def lookup(self, token_ids: Sequence[int], extra: BlockExtra = NO_EXTRA) -> Lookup:
        """``cached_tokens`` for every instance the index answers for, with the prompt's
        block keys (for ``note_pending``)."""
        return self.index.lookup(token_ids, extra, self.answering())

    def note_pending(self, url: str, found: Lookup) -> Pending:
        """``url`` computes the prompt ``found`` was looked up for: count its blocks as held
        there until ``drop_pending`` (PrefixIndex.note_pending)."""
        return self.index.note_pending(_key(url), found)

    def drop_pending(self, pending: Pending) -> None:
        self.index.drop_pending(pending)

    async def wait_live(self, url: str, timeout_s: float) -> bool:
        """Wait until ``url``'s index answers (True), is disabled or the time is up (False)."""
        w = self._watches.get(_key(url))
        if w is None:
            return False
        try:
            async with asyncio.timeout(timeout_s):
                await w.discovered.wait()
                if w.stream is None:
                    return False
                await w.stream.synced.wait()
        except TimeoutError:
            return False
        return w.url in self.answering()

    def status(self) -> list[InstanceStatus]:
        """Each watched instance's index, for /admin/list and metrics."""
        out = []
        for w in self._watches.values():
            inst = self.index.get(w.url)
            state, reason = w.state, w.reason
            if inst is not None and inst.disabled is not None:
                state, reason = IndexState.DISABLED, inst.disabled
            out.append(InstanceStatus(
                url=w.url, role=w.role, state=state, reason=reason,
                endpoint=w.source.endpoint if w.source else None,
                replay_endpoint=w.source.replay_endpoint if w.source else None,
                block_size=inst.block_size if inst else None,
                blocks=inst.blocks if inst else 0, counters=copy.copy(w.counters)))
        return out
