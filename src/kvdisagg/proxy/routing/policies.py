"""Routing policies: given the request and the healthy candidates of one side, pick one.

A policy only selects. It does no I/O and never blocks; what it reads (in-flight counts, vLLM
queue gauges scraped by the registry, live latency estimates, the prompt tokens each instance
caches) is kept current by the registry, the cache index and the handoff's stages. Prefill and
decode each get their own policy instance, so ``--prefill-policy prefix_aware --decode-policy
least_loaded`` works. A new policy is a small class with ``name`` and ``select``, added to
``POLICIES``. ``CacheAware`` composes with any of them: the proxy wraps the configured policy
of each side in it (``make_policy``), so what the caches hold is weighed in one place.

Policies are generic over the instance type (``InstanceView`` is all they read): the registry's
``Instance`` comes back as an ``Instance`` (``Selection[Instance]``), a test's fake as the fake.
Imports nothing of the proxy but its config, its vocabulary and how prompts are hashed
(prompt_keys.py).

Each policy's doc says: why choose it / what it does / inputs / configuration.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import ClassVar, Generic, NamedTuple, Protocol, TypeVar

from kvdisagg.proxy.config import PolicyConfig, SloConfig
from kvdisagg.proxy.routing.prompt_keys import rendezvous_weight
from kvdisagg.proxy.types import PolicyName, Side

__all__ = ["RouteRequest", "InstanceView", "Verdict", "Selection", "Policy",
           "RoundRobin", "LeastLoaded", "PrefixAware", "SloAware", "CacheAware", "POLICIES",
           "make_policy", "load_score"]

NO_HITS: Mapping[str, int] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What a policy may know about a request; built once per request by ``body.py``."""

    prefix_key: bytes  # the placement key: the prompt text's first ``prefix_block_chars``
    prompt_tokens: int  # an estimate (characters / 4, or the token ids' count)
    max_tokens: int
    hits: Mapping[str, int] = field(default_factory=lambda: NO_HITS)
    """Prompt tokens each instance caches (instance URL -> tokens, predicted from vLLM's KV
    events; empty without a cache index): what ``CacheAware`` reads."""

    def with_hits(self, hits: Mapping[str, int]) -> RouteRequest:
        return replace(self, hits=hits) if hits else self

    def with_length(self, prompt_tokens: int) -> RouteRequest:
        """The same request, its prompt's length known exactly (its token ids counted)."""
        return replace(self, prompt_tokens=prompt_tokens)


class InstanceView(Protocol):
    """The read-only face of a registry instance that policies see."""

    url: str
    vllm_waiting: float  # vLLM's vllm:num_requests_waiting, from the last scrape
    vllm_running: float  # vLLM's vllm:num_requests_running
    prefill_s_per_token: float | None  # live estimate of the prefill leg, seconds per token
    tpot_s: float | None  # live estimate of time per output token
    tpot_load: float  # decode legs in flight when tpot_s was measured (EWMA)

    def in_flight(self, side: Side) -> int: ...

    def in_flight_tokens(self, side: Side) -> int: ...


class Verdict(enum.Enum):
    OK = "ok"
    NO_CANDIDATE = "no_candidate"
    SLO_MISS = "slo_miss"  # the best candidate is predicted to miss the SLO


Inst = TypeVar("Inst", bound=InstanceView)


class Selection(NamedTuple, Generic[Inst]):
    """The candidate picked (None: there was none), and whether it is predicted to serve."""

    instance: Inst | None
    verdict: Verdict
    predicted_s: float | None = None  # slo_aware: predicted TTFT (prefill) or TPOT (decode)


def _none() -> Selection[Inst]:
    return Selection(None, Verdict.NO_CANDIDATE)


class Policy(Protocol):
    @property
    def name(self) -> PolicyName: ...

    def select(self, req: RouteRequest, candidates: Sequence[Inst],
               side: Side) -> Selection[Inst]: ...


class RoundRobin:
    """**Why:** the baseline; equal instances, uniform requests.
    **What:** cycles through the candidates in registry order.
    **Inputs:** none. **Configuration:** none."""

    name: ClassVar[PolicyName] = PolicyName.ROUND_ROBIN

    def __init__(self, cfg: PolicyConfig | None = None, slo: SloConfig | None = None) -> None:
        self._next = 0

    def select(self, req: RouteRequest, candidates: Sequence[Inst],
               side: Side) -> Selection[Inst]:
        if not candidates:
            return _none()
        i = self._next % len(candidates)
        self._next = i + 1
        return Selection(candidates[i], Verdict.OK)


def load_score(inst: InstanceView, side: Side, token_weight: float) -> float:
    """In-flight legs through this proxy, their tokens, and vLLM's own queue (other clients)."""
    return (inst.in_flight(side) + inst.in_flight_tokens(side) * token_weight
            + inst.vllm_waiting + 0.5 * inst.vllm_running)


class LeastLoaded:
    """**Why:** uneven request sizes or instances shared with other clients.
    **What:** picks the lowest ``in_flight + tokens * token_weight + vllm_waiting +
    0.5 * vllm_running``; ties go round robin.
    **Inputs:** in-flight legs and tokens per side, vLLM's queue gauges from ``/metrics``.
    **Configuration:** ``policy.token_weight`` (default 1/512: 512 tokens weigh one request)."""

    name: ClassVar[PolicyName] = PolicyName.LEAST_LOADED

    def __init__(self, cfg: PolicyConfig | None = None, slo: SloConfig | None = None) -> None:
        self.token_weight = (cfg or PolicyConfig()).token_weight
        self._tie = 0

    def select(self, req: RouteRequest, candidates: Sequence[Inst],
               side: Side) -> Selection[Inst]:
        if not candidates:
            return _none()
        n = len(candidates)
        self._tie += 1
        best: Inst | None = None
        best_score = float("inf")
        for k in range(n):  # start at a rotating offset so ties spread
            inst = candidates[(self._tie + k) % n]
            s = load_score(inst, side, self.token_weight)
            if s < best_score:
                best, best_score = inst, s
        return Selection(best, Verdict.OK)


class PrefixAware:
    """**Why:** shared system prompts, multi-turn chat, few-shot templates: a prefill instance
    that already holds the prefix in vLLM's prefix cache skips recomputing it.
    **What:** rendezvous-hashes the prompt's first ``prefix_block_chars`` characters onto the
    candidates (the placement key, prompt_keys.py: no tokenizer or KV events needed, the same
    home from every proxy replica; adding or removing an instance moves only its own keys),
    and stays there while that instance's in-flight count is within ``prefix_load_slack`` of
    the least loaded candidate; otherwise it takes the least loaded one (balance beats
    affinity under skew).
    **Inputs:** the prompt prefix, in-flight legs. **Configuration:** ``policy.prefix_block_chars``,
    ``policy.prefix_load_slack``."""

    name: ClassVar[PolicyName] = PolicyName.PREFIX_AWARE

    def __init__(self, cfg: PolicyConfig | None = None, slo: SloConfig | None = None) -> None:
        cfg = cfg or PolicyConfig()
        self.slack = cfg.prefix_load_slack
        self._fallback = LeastLoaded(cfg)

    def select(self, req: RouteRequest, candidates: Sequence[Inst],
               side: Side) -> Selection[Inst]:
        if not candidates:
            return _none()
        home = max(candidates, key=lambda c: rendezvous_weight(req.prefix_key, c.url))
        least = min(c.in_flight(side) for c in candidates)
        if home.in_flight(side) <= least + self.slack:
            return Selection(home, Verdict.OK)
        return self._fallback.select(req, candidates, side)


class SloAware:
    """**Why:** latency SLOs (TTFT for prefill, TPOT for decode) matter more than balance.
    **What:** predicts each candidate's TTFT (prefill side) as
    ``s_per_token * (tokens queued ahead + this prompt)`` or TPOT (decode side) as
    ``tpot * (1 + load) / (1 + load when measured)``, from live measurements, and picks the
    lowest. If even the best misses the SLO, the verdict is ``SLO_MISS`` and the proxy applies
    ``slo.admission``: ``queue`` (send it to the best anyway), ``shed`` (429), or ``colocate``
    (prefill side: run the whole request on a decode instance). An instance without
    measurements yet is predicted at 0, so it gets explored.
    **Inputs:** live per-instance estimates, in-flight tokens, vLLM's waiting queue.
    **Configuration:** ``slo.ttft_s``, ``slo.tpot_s``, ``slo.admission``."""

    name: ClassVar[PolicyName] = PolicyName.SLO_AWARE

    def __init__(self, cfg: PolicyConfig | None = None, slo: SloConfig | None = None) -> None:
        self.slo = slo or SloConfig()

    @staticmethod
    def predict_ttft(req: RouteRequest, inst: InstanceView) -> float:
        spt = inst.prefill_s_per_token
        if spt is None:
            return 0.0
        ahead = inst.in_flight_tokens(Side.PREFILL) + inst.vllm_waiting * req.prompt_tokens
        return spt * (ahead + req.prompt_tokens)

    @staticmethod
    def predict_tpot(inst: InstanceView) -> float:
        if inst.tpot_s is None:
            return 0.0
        load = inst.in_flight(Side.DECODE) + inst.vllm_waiting
        return inst.tpot_s * (1.0 + load) / (1.0 + inst.tpot_load)

    def select(self, req: RouteRequest, candidates: Sequence[Inst],
               side: Side) -> Selection[Inst]:
        if not candidates:
            return _none()
        if side is Side.PREFILL:
            scored = [(self.predict_ttft(req, c), i, c) for i, c in enumerate(candidates)]
            target = self.slo.ttft_s
        else:
            scored = [(self.predict_tpot(c), i, c) for i, c in enumerate(candidates)]
            target = self.slo.tpot_s
        pred, _, best = min(scored, key=lambda t: (t[0], t[1]))
        verdict = Verdict.OK if pred <= target else Verdict.SLO_MISS
        return Selection(best, verdict, pred)


class CacheAware:
    """**Why:** a prompt whose prefix an instance caches costs that instance only the rest; the
    proxy knows what each cache holds from vLLM's KV events (``cache_index.py``).
    **What:** wraps the side's configured policy: the candidate caching the longest prefix of
    the prompt (``req.hits``), unless its load (``load_score``) exceeds the least loaded
    candidate's by more than ``prefix_load_slack``; ties go to the less loaded. With no hit
    within the slack, or no cache index, the wrapped policy picks.
    **Inputs:** ``RouteRequest.hits`` (tokens cached per instance), in-flight legs and tokens,
    vLLM's queue gauges. **Configuration:** ``policy.token_weight``,
    ``policy.prefix_load_slack``; on whenever ``cache_index.enabled``."""

    def __init__(self, inner: Policy, cfg: PolicyConfig | None = None) -> None:
        cfg = cfg or PolicyConfig()
        self.inner = inner
        self.token_weight = cfg.token_weight
        self.slack = cfg.prefix_load_slack

    @property
    def name(self) -> PolicyName:
        return self.inner.name

    def select(self, req: RouteRequest, candidates: Sequence[Inst],
               side: Side) -> Selection[Inst]:
        if not candidates:
            return _none()
        hits = req.hits
        if hits:
            w = self.token_weight
            least = min(load_score(c, side, w) for c in candidates)
            sticky = [c for c in candidates if hits.get(c.url, 0) > 0
                      and load_score(c, side, w) <= least + self.slack]
            if sticky:
                return Selection(max(sticky, key=lambda c: (hits.get(c.url, 0),
                                                            -load_score(c, side, w))),
                                 Verdict.OK)
        return self.inner.select(req, candidates, side)


POLICIES: dict[PolicyName,
               type[RoundRobin] | type[LeastLoaded] | type[PrefixAware] | type[SloAware]] = {
    p.name: p for p in (RoundRobin, LeastLoaded, PrefixAware, SloAware)
}
assert set(POLICIES) == set(PolicyName), "a policy name without its class, or the reverse"


def make_policy(name: PolicyName | str, cfg: PolicyConfig, slo: SloConfig) -> CacheAware:
    """The policy called ``name``, cache-aware (``CacheAware``: it only differs where the
    request says what the caches hold)."""
    try:
        cls = POLICIES[PolicyName(name)]
    except ValueError:
        raise ValueError(f"unknown policy {name!r}; choose one of "
                         f"{sorted(p.value for p in PolicyName)}") from None
    return CacheAware(cls(cfg, slo), cfg)
