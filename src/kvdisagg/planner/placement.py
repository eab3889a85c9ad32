"""Placements the planner simulates and prints: a tagged union, JSON in ``--json`` output.

Must not import ``vllm``.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]


class Disaggregated(msgspec.Struct, tag="disaggregated", frozen=True, kw_only=True):
    """``num_prefill`` prefill instances (TP x PP each) and ``num_decode`` decode instances.

    ``pp_cross`` > 1 (low node-affinity plans) splits each instance's layers over that many
    nodes, one pipeline segment per node, prefill and decode segments side by side in a node.
    """

    prefill_tp: PositiveInt = 1
    prefill_pp: PositiveInt = 1
    decode_tp: PositiveInt = 1
    decode_pp: PositiveInt = 1
    num_prefill: PositiveInt = 1
    num_decode: PositiveInt = 1
    pp_cross: PositiveInt = 1

    @property
    def num_gpus(self) -> int:
        per = (
            self.num_prefill * self.prefill_tp * self.prefill_pp
            + self.num_decode * self.decode_tp * self.decode_pp
        )
        return per * self.pp_cross

    def describe(self) -> str:
        cross = f" x{self.pp_cross} nodes (pp_cross)" if self.pp_cross > 1 else ""
        return (
            f"{self.num_prefill} prefill TP{self.prefill_tp}PP{self.prefill_pp * self.pp_cross} + "
            f"{self.num_decode} decode TP{self.decode_tp}PP{self.decode_pp * self.pp_cross}"
            f"{cross} ({self.num_gpus} GPUs)"
        )


class Colocated(msgspec.Struct, tag="colocated", frozen=True, kw_only=True):
    """``num_instances`` ordinary vLLM instances (prefill and decode on the same GPUs)."""

    tp: PositiveInt = 1
    pp: PositiveInt = 1
    num_instances: PositiveInt = 1

    @property
    def num_gpus(self) -> int:
        return self.tp * self.pp * self.num_instances

    def describe(self) -> str:
        return f"{self.num_instances} colocated TP{self.tp}PP{self.pp} ({self.num_gpus} GPUs)"


Placement = Disaggregated | Colocated
