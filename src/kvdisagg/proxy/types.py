"""The proxy's vocabulary: small enums every layer shares (config, policies, registry, stages).

Imports nothing from the proxy, so any module may import it (imports run one way: the
vocabulary and config -> fleet/ -> routing/ -> metrics -> handoff/ -> app;
tests/unit/test_layering.py).
"""

from __future__ import annotations

import enum

__all__ = ["Role", "Side", "Admission", "PolicyName"]


class Role(str, enum.Enum):
    """Which side an instance serves; ``kv_both`` may be picked for either."""

    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "kv_both"

    def serves(self, side: Role | Side) -> bool:
        return self.value == side.value or self is Role.BOTH


class Side(str, enum.Enum):
    """The leg of a request an instance serves: prefill or decode."""

    PREFILL = "prefill"
    DECODE = "decode"


class Admission(str, enum.Enum):
    """What slo_aware does when no instance is predicted to meet the SLO."""

    QUEUE = "queue"  # take the best instance anyway (the request waits in its queue)
    SHED = "shed"  # answer 429 at once
    COLOCATE = "colocate"  # skip prefill, run the whole request on a decode instance


class PolicyName(str, enum.Enum):
    """The routing policies (policies.POLICIES has one class per name)."""

    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"
    PREFIX_AWARE = "prefix_aware"
    SLO_AWARE = "slo_aware"
