"""The Transport interface, what crosses it, and the registry that resolves ``transport`` names.

A transport owns the whole data path of a handoff between one prefill worker and one decode
worker: prefill *offers* a finished request's blocks, decode *fetches* them into its own blocks,
and prefill learns which offers it may free. Pull transports (tcp, nccl, mooncake) keep the
blocks in prefill's memory until decode has read them (transport/pull.py); the store transport
(lmcache) copies them out to a server at once and frees them.

The calls are blocking and bounded: the worker runs ``fetch`` on a thread pool and polls
``take_released`` every step, which is simpler than a submit/poll pair and costs nothing here.

A transport is a name in TRANSPORTS or ``module:Class`` for a user's own; its constructor takes
``(config, tp_rank)``.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from kvdisagg.connector.protocol.versions import PROTOCOL_VERSION
from kvdisagg.errors import ConfigError

if TYPE_CHECKING:
    from kvdisagg.connector.config import ConnectorConfig
    from kvdisagg.connector.layout import KvGeometry, LayerRegion
    from kvdisagg.connector.sharding import Part, Shape
    from kvdisagg.tracing import Tracer


@dataclass(frozen=True)
class Offer:
    """Prefill: the blocks of finished request ``handoff_id`` (its KV in prompt order)."""

    handoff_id: str
    token: str
    block_ids: tuple[int, ...]
    lease_s: float
    prompt_token_ids: tuple[int, ...] = ()  # store transports key chunks by token prefix
    trace: str = ""  # traceparent of the request's prefill leg (tracing.py), '' if none


@dataclass(frozen=True)
class Fetch:
    """Decode: fill ``local_block_ids`` with prefill's ``remote_block_ids`` (same length; may be
    empty: then only release). ``first_block`` is the index of the first one in the prompt.

    ``part``: the layers and heads to read from the prefill worker at ``port``
    (connector/sharding.py; no layers: only release it); None: all of this worker's layers and
    heads (both instances sharded alike). ``prefill``: the prefill instance's shape (store keys;
    None: this one's)."""

    handoff_id: str
    token: str
    host: str
    port: int
    kv_layout: str
    remote_block_ids: tuple[int, ...]
    local_block_ids: tuple[int, ...]
    prompt_token_ids: tuple[int, ...] = ()
    first_block: int = 0
    part: Part | None = None
    prefill: Shape | None = None
    early: bool = False
    """Sent before prefill computed the handoff: ``remote_block_ids`` is empty and prefill
    serves its blocks from ``first_block`` on, once offered (handoffs.py)."""
    version: int = PROTOCOL_VERSION
    """The side-channel protocol version to speak with this prefill: the highest both
    instances speak (decode's scheduler chose it from the handoff's params, protocol.Versions)."""


@dataclass
class PullTiming:
    """Where one fetch's time went: ``(phase, time.time_ns())`` as each phase ends, in order
    from ``start_ns`` (pull transports: connect, read, transfer, done; others mark nothing)."""

    start_ns: int
    marks: list[tuple[str, int]] = field(default_factory=list)
    reused: bool = False  # the side-channel connection was pooled (no connect, no Hello)

    def mark(self, phase: str) -> None:
        self.marks.append((phase, time.time_ns()))

    def phases(self) -> list[tuple[str, int, int]]:
        """``(phase, start_ns, end_ns)`` for each mark."""
        out, start = [], self.start_ns
        for phase, end in self.marks:
            out.append((phase, start, end))
            start = end
        return out


class Transport(Protocol):
    name: ClassVar[str]
    keyed_by_tokens: ClassVar[bool]
    """True for a store keyed by the prompt's tokens (LMCache): it copies out what it offers,
    so prefill needs no staging arena, and decode finds chunks by tokens, not by a handoff."""

    def instrument(self, tracer: Tracer, observe: Callable[[str, float], None]) -> None:
        """The worker's tracer and phase histograms, for the work the transport does on its
        own threads (prefill serving a Read)."""
        ...

    def step(self, running: bool) -> None:
        """Prefill: an engine step started (``running``) or ended; a Read waiting for its
        handoff measures the engine's progress by these."""
        ...

    def expired_unread(self) -> int:
        """Prefill: handoffs freed because their lease ran out before a read (ever)."""
        ...

    def register(self, regions: Sequence[LayerRegion], *, kv_layout: str, block_size: int,
                 is_producer: bool, geometry: KvGeometry | None = None,
                 rank: int | None = None, shape: Shape | None = None) -> int:
        """Take the worker's KV memory; return the side-channel port to advertise (0: none).
        ``kv_layout`` is ``geometry``'s fingerprint; ``rank`` is this worker's rank in its
        instance of parallelism ``shape`` (PP-major)."""
        ...

    def offer(self, offer: Offer) -> bool:
        """Prefill: make an offer's blocks available to the decode that holds its token;
        False if refused (its id is already held: nothing to free later)."""
        ...

    def expect(self, handoff_id: str, token: str) -> None:
        """Prefill: an early handoff's request reached the engine (an early Read for it waits
        until it is offered or forgotten). Store transports: nothing to do."""
        ...

    def forget(self, handoff_id: str, why: str) -> None:
        """Prefill: an expected early handoff will not be offered; its Read is refused."""
        ...

    def fetch(self, fetch: Fetch, timeout_s: float, timing: PullTiming | None = None) -> int:
        """Decode: copy a handoff into local blocks within ``timeout_s``; return bytes moved.
        Raises TransportError (or IncompatiblePeerError). ``timing`` collects its phases."""
        ...

    def take_released(self) -> set[str]:
        """Prefill: ids of offers whose blocks may now be freed (each reported once)."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class _Entry:
    module: str
    cls: str
    install: str  # how to get the dependency, shown when the import fails


TRANSPORTS: dict[str, _Entry] = {
    "tcp": _Entry("kvdisagg.transport.tcp", "TcpTransport", ""),
    "nccl": _Entry("kvdisagg.transport.nccl", "NcclTransport", "pip install torch"),
    "mooncake": _Entry("kvdisagg.transport.mooncake", "MooncakeTransport",
                       "pip install 'kvdisagg[mooncake]' (GPU hosts: 'kvdisagg[mooncake-gpu]') "
                       "and apt-get install -y libibverbs1"),
    "lmcache": _Entry("kvdisagg.transport.lmcache", "LMCacheTransport",
                      "pip install 'kvdisagg[lmcache]'"),
}


def transport_class(name: str) -> type[Transport]:
    """Resolve a name or ``module:Class``; a missing dependency says how to install it."""
    if name in TRANSPORTS:
        entry = TRANSPORTS[name]
        module_name, cls_name, install = entry.module, entry.cls, entry.install
    else:
        module_name, _, cls_name = name.partition(":")
        install = ""
        if not cls_name:
            raise ConfigError(f"transport={name!r}: unknown; choose one of {sorted(TRANSPORTS)} "
                              "or give 'module:Class'")
    try:
        return getattr(importlib.import_module(module_name), cls_name)
    except ImportError as exc:
        hint = f"; install it with: {install}" if install else ""
        raise ConfigError(f"transport={name!r} needs a missing dependency ({exc}){hint}") from None
    except AttributeError as exc:
        raise ConfigError(f"transport={name!r}: cannot load: {exc}") from None


def load_transport(config: ConnectorConfig, tp_rank: int = 0) -> Transport:
    cls: Any = transport_class(config.transport)  # the Protocol declares no __init__
    return cls(config, tp_rank)

