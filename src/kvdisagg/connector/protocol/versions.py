"""The P->D protocol's versions: which one an instance speaks, and what each one changed.

The version covers both contracts between a prefill and a decode: the kv_transfer_params that
travel through the proxy (params.py) and the side channel's frames (frames.py). The proxy reads
an instance's range from its /metrics and pairs only instances with a version in common, so this
module imports nothing (params.py imports it, and the proxy imports both).

PROTOCOL_VERSION history:
  1: Hello / Read / Done over length-prefixed msgpack frames, one connection per pull.
  2: persistent connections (Hello once); Hello/Reply carry the transport's name and info;
     Read names decode's blocks too (transports pair the ranges); Done is one-way and ends
     every pull (prefill unpins, then frees the handoff).
  3: decode-paced leases: kv_transfer_params carry ``lease_s``; decode's scheduler keeps every
     handoff it holds alive with one-way Renew frames on a control connection (Hello with
     ``control``), so a lease runs out only when its decode stops renewing.
  4: any TP and PP on either side (connector/sharding.py): kv_transfer_params carry ``stages``
     and a port per prefill rank (PP-major); the fingerprint covers the model's geometry only
     and Hello carries the geometry itself (a refusal names what differs); Read names the
     layers and heads to read, Done how many readers prefill waits for; Wait frames keep a
     slow peer's waits alive (bounds measure silence, not duration);
     and KV checksums: a Read may ask for one (``checksum``: the algorithm,
     connector/integrity.py); prefill then follows the bytes with a Checksum frame of what it
     sent, decode compares it with what landed in its blocks and says in Done whether it
     matched (``checksum_ok``).
  5: early handoffs: the proxy may send the decode leg together with the prefill leg, naming
     the handoff itself (``EarlyHandoff`` in prefill's request, ``early`` in decode's params,
     whose block ids and token count are then unknown); decode's Read names blocks by position
     (``first_block``) and waits at prefill until the handoff is offered; the grant (Reply)
     names prefill's blocks. Tokens are URL-safe ASCII.

Versions in common (no wire change, so still 5): an instance speaks every version from
MIN_PROTOCOL_VERSION to PROTOCOL_VERSION (``Versions``). Prefill's kv_transfer_params say which
(``version`` and ``min_version``), decode says in its Hello the highest version both speak,
and prefill accepts any version of its own range. Each instance exports its range on its
/metrics (``vllm:kvdisagg_protocol_version``, ``vllm:kvdisagg_protocol_version_min``), where
the proxy reads it and pairs only prefills and decodes with a version in common, so a fleet
in the middle of a rolling upgrade keeps serving. 5 speaks 4: a version-4 peer's frames are
5's without the fields 5 added (each has a default, and both sides ignore fields they do not
know), and an early handoff (5's one addition) is never sent to or asked of a peer below
EARLY_HANDOFF_VERSION. The range must only widen by keeping the old frames' meaning: a change
that does not (a field whose absence means something else) raises MIN_PROTOCOL_VERSION.
"""

from __future__ import annotations

from typing import NamedTuple

PROTOCOL_VERSION = 5
MIN_PROTOCOL_VERSION = 4
"""The oldest version this code still speaks (see the history above: 5 speaks 4)."""
EARLY_HANDOFF_VERSION = 5
"""Early handoffs (``early`` params, a Read by position) need this version on both sides."""


class Versions(NamedTuple):
    """The protocol versions an instance speaks: every one from ``lo`` to ``hi``."""

    lo: int
    hi: int

    def common(self, other: Versions) -> int | None:
        """The version two instances speak to each other (the highest both speak), or None
        when they have none in common."""
        version = min(self.hi, other.hi)
        return version if version >= max(self.lo, other.lo) else None

    def __str__(self) -> str:
        return str(self.hi) if self.lo == self.hi else f"{self.lo}..{self.hi}"


SPOKEN = Versions(MIN_PROTOCOL_VERSION, PROTOCOL_VERSION)


def spoken(override: int | None = None) -> Versions:
    """What this instance speaks: ``SPOKEN``, or only ``override`` (the test-only connector
    key ``protocol_version_override``: an instance that announces another version)."""
    return SPOKEN if override is None else Versions(override, override)

