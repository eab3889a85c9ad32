"""The handoff table of a prefill worker: what may be read, by whom, until when.

Shared by every pull transport (transport/pull.py), whatever moves the bytes.

Clients never control what memory is read: a Read names a handoff, proves it holds the handoff's
random token, and may only list blocks of that handoff; prefill maps them to memory itself.
Reads of an acknowledged handoff, or of one freed when its lease ran out, are refused (a Read
that comes after the lease ran out but before the blocks were freed is served), and a handoff
being read is pinned so its lease cannot expire under the reader. The decode that holds a
handoff renews its lease while the request waits in its queue (Renew), so a lease runs out only
when that decode went away.

A handoff read by several decode workers (another TP or PP on decode, connector/sharding.py) is
freed after the last of them said Done: each Done names how many readers there are.

A Read may come before its handoff (the offer reaches the worker with the next engine step):
it waits for it as long as the engine makes progress (a step running, or one ended less than
IDLE_GRACE_S ago: an engine with an offer to make steps at once, so one idle that long has
none), and at most until two more steps started without it; the worker reports its steps
(``step``).

An *early* handoff (the proxy sent the decode leg together with the prefill leg) is named by
the proxy: its id and token come with the prefill request, and the scheduler tells the worker
to ``expect`` it as soon as the request reaches the engine. Decode's Read comes before prefill
has computed anything and names blocks by position (``first_block``), since nobody knows
prefill's block ids yet. It waits as long as the handoff is expected (the request is in this
engine: it ends in an offer or in ``forget``), and for an id not expected yet, while the
prefill leg may still be on its way, ``early_grace_s``.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

KEEPALIVE_S = 1.0  # a Read waiting for its handoff tells decode it is alive this often
IDLE_GRACE_S = 5.0  # an idle engine offers a handoff within this, or it is not coming
TOMBSTONES = 4096  # ids freed recently: a late Read for one is refused at once, not after a wait
_RELEASED_EARLY = "released by decode before prefill offered it"


@dataclass
class _Handoff:
    token: str
    block_ids: frozenset[int]
    order: tuple[int, ...]  # the blocks in prompt order (reads by position)
    lease_s: float
    deadline: float
    readers: int = 0
    done: bool = False
    dones: int = 0  # Done messages from decode workers so far


@dataclass
class HandoffTable:
    """Handoffs a prefill worker holds blocks for, keyed by vLLM request id. Thread-safe."""

    _items: dict[str, _Handoff] = field(default_factory=dict)
    _cond: threading.Condition = field(default_factory=threading.Condition)
    _gone: OrderedDict[str, str] = field(default_factory=OrderedDict)  # id -> why
    expired_unread: int = 0  # handoffs freed because their lease ran out (ever)
    _steps: int = 0  # engine steps started
    _in_step: bool = False
    _last_step: float = field(default_factory=time.monotonic)  # when a step last ended
    _expected: dict[str, str] = field(default_factory=dict)  # early handoff id -> token

    def step(self, running: bool) -> None:
        """The engine started (``running``) or ended a step: Reads waiting for their
        handoff measure the engine's progress by these."""
        with self._cond:
            if running and not self._in_step:
                self._steps += 1
            self._in_step = running
            self._last_step = time.monotonic()
            self._cond.notify_all()

    def add(self, req_id: str, token: str, block_ids: Sequence[int], lease_s: float) -> bool:
        """False (and nothing added) for an id already held: an early handoff's id comes from
        the request, and a second request naming it must not replace the first's blocks."""
        with self._cond:
            if req_id in self._items:
                logger.warning("kvdisagg: a second offer for handoff %s ignored", req_id)
                return False
            released = self._gone.get(req_id) == _RELEASED_EARLY
            self._expected.pop(req_id, None)
            self._gone.pop(req_id, None)
            self._items[req_id] = _Handoff(token, frozenset(block_ids), tuple(block_ids),
                                           lease_s, time.monotonic() + lease_s,
                                           done=released)
            self._cond.notify_all()
            return True

    def expect(self, req_id: str, token: str) -> None:
        """An early handoff's request reached the engine: its offer, or ``forget``, follows."""
        with self._cond:
            if req_id not in self._items and req_id not in self._gone:
                self._expected[req_id] = token
                self._cond.notify_all()

    def forget(self, req_id: str, why: str) -> None:
        """An expected handoff will not be offered (its request ended otherwise)."""
        with self._cond:
            if self._expected.pop(req_id, None) is not None:
                self._tombstone(req_id, why)
                self._cond.notify_all()

    def pin(self, req_id: str, token: str, block_ids: Sequence[int], wait_s: float,
            keepalive: Callable[[], None] | None = None, first_block: int = -1,
            count: int = 0, early_grace_s: float = 0.0) -> tuple[str, tuple[int, ...]]:
        """Check a Read and pin the handoff; return ('', the blocks granted) or (why not, ()).
        ``first_block`` >= 0: an early Read of ``count`` blocks by position (``block_ids``
        unused). While it waits for the handoff, ``keepalive`` runs every KEEPALIVE_S (or a
        quarter of ``wait_s``, decode's bound on silence too), outside the lock."""
        arrived, start = self._steps, time.monotonic()
        interval = min(KEEPALIVE_S, wait_s / 4) if wait_s > 0 else KEEPALIVE_S
        idle_s = min(wait_s, IDLE_GRACE_S)
        early = first_block >= 0

        def settled() -> bool:
            if req_id in self._items or req_id in self._gone:
                return True
            if early:  # its request is in the engine, or its prefill leg on its way
                return (req_id not in self._expected
                        and time.monotonic() - start > early_grace_s)
            if self._steps >= arrived + 2:
                return True  # two steps began since the Read: the offer is not coming
            idle_since = max(self._last_step, start)
            return not self._in_step and time.monotonic() - idle_since > idle_s

        while True:
            with self._cond:
                if self._cond.wait_for(settled, timeout=interval):
                    return self._pin(req_id, token, block_ids, first_block, count)
            if keepalive is not None:
                keepalive()

    def _pin(self, req_id: str, token: str, block_ids: Sequence[int], first_block: int,
             count: int) -> tuple[str, tuple[int, ...]]:
        with self._cond:
            h = self._items.get(req_id)
            if h is None:
                return f"handoff {req_id!r} {self._gone.get(req_id, 'unknown')}", ()
            if not hmac.compare_digest(h.token, token):
                return f"wrong token for handoff {req_id!r}", ()
            if h.done:
                return f"handoff {req_id!r} already released", ()
            if first_block >= 0:
                if first_block + count > len(h.order):
                    return (f"blocks {first_block}..{first_block + count - 1} asked of "
                            f"handoff {req_id!r}, which holds {len(h.order)}"), ()
                block_ids = h.order[first_block:first_block + count]
            outside = set(block_ids) - h.block_ids
            if outside:
                return f"blocks {sorted(outside)[:8]} are not part of handoff {req_id!r}", ()
            # Past its deadline but not yet freed: the blocks are intact (nothing frees a
            # pinned handoff), so a late Read is served; on a starved host the Renew that
            # would have kept it alive may simply not have been read yet.
            h.deadline = max(h.deadline, time.monotonic() + h.lease_s)
            h.readers += 1
            return "", tuple(block_ids)

    def unpin(self, req_id: str) -> None:
        with self._cond:
            if (h := self._items.get(req_id)) is not None:
                h.readers -= 1

    def renew(self, refs: Sequence[tuple[str, str]]) -> int:
        """Restart the leases of ``(handoff id, token)`` pairs that are held and whose token
        matches; return how many were. A renewal that comes after the lease ran out but before
        the blocks were freed counts, as a late Read does: on a starved host the decode that
        holds the handoff may simply not have got through yet, and the blocks are intact."""
        now, renewed = time.monotonic(), 0
        with self._cond:
            for req_id, token in refs:
                h = self._items.get(req_id)
                if (h is not None and not h.done
                        and hmac.compare_digest(h.token, token)):
                    h.deadline = now + h.lease_s
                    renewed += 1
        return renewed

    def release(self, req_id: str, token: str, readers: int = 1, force: bool = False) -> bool:
        """One of ``readers`` decode workers is done with the handoff (``force``: decode gave
        it up): freed once all of them are. False for an unknown id or a wrong token."""
        with self._cond:
            h = self._items.get(req_id)
            if h is None and req_id not in self._gone and hmac.compare_digest(
                    self._expected.get(req_id, token), token):
                # An early handoff given up before prefill offered it (expected, or its
                # request not even here yet): a Read waiting for it is refused now, and the
                # offer, if it comes, is freed at once.
                self._expected.pop(req_id, None)
                self._tombstone(req_id, _RELEASED_EARLY)
                self._cond.notify_all()
                return True
            if h is None or not hmac.compare_digest(h.token, token):
                return False
            h.dones += 1
            if force or h.dones >= readers:
                h.done = True
            return True

    def take_finished(self) -> set[str]:
        """Ids acknowledged, or whose lease ran out while nobody reads them; removed."""
        now = time.monotonic()
        with self._cond:
            out = {rid for rid, h in self._items.items()
                   if h.readers == 0 and (h.done or now > h.deadline)}
            for rid in out:
                expired = not self._items.pop(rid).done
                if expired:
                    self.expired_unread += 1
                    logger.warning("kvdisagg: handoff %s lease expired unread; freeing", rid)
                self._tombstone(rid, "expired unread" if expired else "already released")
            return out

    def _tombstone(self, req_id: str, why: str) -> None:
        self._gone[req_id] = why
        if len(self._gone) > TOMBSTONES:
            self._gone.popitem(last=False)

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)
