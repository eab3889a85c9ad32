"""Per request: disaggregate, or let decode serve the prompt alone (issue 15).

**Why.** A handoff has a fixed cost: a second request, a pull, decode admitting the request a
second time. A short prompt, or a follow-up turn whose prefix decode already holds (its prompt
and its answer are in decode's prefix cache), costs decode less to compute than the handoff
costs the client: disaggregating it makes TTFT worse than a plain vLLM instance's, for nothing.
Long fresh prompts are where splitting pays: decode's running streams are not stalled by them.

**What.** Decode is chosen first: the candidate holding the longest cached prefix of the prompt
(from vLLM's KV events, when the proxy has them), unless it is busier than the least loaded
by more than ``policy.prefix_load_slack`` legs; otherwise the decode policy's pick. The prompt
tokens that decode would compute itself (the prompt minus that prefix) decide:
``<= decision.local_prefill_tokens`` (scaled down as decode's predicted TPOT nears
``slo.tpot_s``: a decode under TPOT pressure gets fewer local prefills) -> decode alone;
more -> disaggregated, unless prefill is backlogged while decode has nothing to protect
(``prefill_backlogged``: decode computes it, ``prefill_busy``). A request form that only
decode serves well (``body.local_reason``) goes to decode alone whatever its length.

**Inputs.** The request's prompt tokens (exact token ids when the proxy has a tokenizer, else
an estimate), what each instance caches (``CacheView``), decode's live TPOT estimate and load.
A wrong prediction costs latency, never a request: decode computes what it lacks.

**Versions.** A disaggregated request needs a prefill that speaks a side-channel protocol
version the decode speaks (``registry.pairable``; a fleet in the middle of a rolling upgrade
has pairs without one). When no routable prefill pairs with the chosen decode, the decision is
taken again among the decodes that some prefill pairs with; when there are none, decode serves
the request alone (``no_compatible_prefill``, with ``retry.decode_only_fallback``; without it
the prefill stage answers 503). The prefill is then chosen among those that pair with the
decode (``prefill.choose_prefill``).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import NamedTuple, Protocol

from kvdisagg.proxy.body import ClientBody
from kvdisagg.proxy.config import ProxyConfig
from kvdisagg.proxy.policies import Policy, RouteRequest, Selection, SloAware, Verdict, load_score
from kvdisagg.proxy.prefix_index import BlockExtra, Lookup, Pending
from kvdisagg.proxy.registry import Instance, Registry, pairable
from kvdisagg.proxy.types import Side


class Route(str, enum.Enum):
    PD = "pd"  # prefill leg, then decode pulls the KV
    DECODE_ONLY = "decode_only"  # decode computes the prompt itself


class CacheView(Protocol):
    """What each instance's prefix cache holds of a prompt (cache_index.CacheIndex)."""

    def answering(self) -> list[str]: ...

    def lookup(self, token_ids: Sequence[int], extra: BlockExtra = ...) -> Lookup: ...

    def note_pending(self, url: str, found: Lookup) -> Pending: ...

    def drop_pending(self, pending: Pending) -> None: ...


class Decision(NamedTuple):
    route: Route
    reason: str  # label of kvdisagg_proxy_routed_total
    decode: Selection  # the decode chosen (instance None: none routable now)
    uncached_tokens: int  # prompt tokens decode would compute itself (predicted)
    cached_tokens: int  # prompt tokens decode holds (predicted)
    threshold: int  # the local-prefill bound in force for this decode


class Decider:
    def __init__(self, cfg: ProxyConfig, registry: Registry, decode_policy: Policy) -> None:
        self.cfg = cfg
        self.registry = registry
        self.decode_policy = decode_policy

    def choose(self, side: Side, policy: Policy, req: RouteRequest, cands: Sequence[Instance],
               hits: dict[str, int] | None = None) -> Selection:
        """The candidate holding the longest cached prefix of the prompt (``hits``: tokens
        per instance URL), unless busier than the least loaded by more than
        ``policy.prefix_load_slack``; else ``policy``'s pick. Prefill and decode alike."""
        if not cands:
            return Selection(None, Verdict.NO_CANDIDATE)
        if hits:
            w = self.cfg.policy.token_weight
            least = min(load_score(c, side, w) for c in cands)
            slack = self.cfg.policy.prefix_load_slack
            sticky = [c for c in cands if hits.get(c.url, 0) > 0
                      and load_score(c, side, w) <= least + slack]
            if sticky:
                return Selection(max(sticky, key=lambda c: (hits.get(c.url, 0),
                                                            -load_score(c, side, w))),
                                 Verdict.OK)
        return policy.select(req, cands, side)

    def choose_decode(self, body: ClientBody, cands: Sequence[Instance],
                      hits: dict[str, int] | None = None) -> Selection:
        return self.choose(Side.DECODE, self.decode_policy, body.route, cands, hits)

    def threshold(self, decode: Instance) -> int:
        """``local_prefill_tokens``, scaled by decode's TPOT headroom (1 when unmeasured)."""
        base = self.cfg.decision.local_prefill_tokens
        if decode.tpot_s is None:
            return base
        headroom = 1.0 - SloAware.predict_tpot(decode) / self.cfg.slo.tpot_s
        return int(base * min(1.0, max(0.0, headroom)))

    def prefill_backlogged(self, decode: Instance, uncached: int) -> bool:
        """Whether ``decode`` computes this long prompt itself: it has no stream to protect
        (nothing in flight but prompts it computes, none from other clients), every prefill
        has a queue, and decode's own queue of prompts is no longer than the shortest of
        them: the prompt then starts on decode no later than on a prefill, and skips the
        handoff. Decode's queue, this prompt included, stays within
        ``decision.idle_decode_tokens``. A burst of cold prompts then uses both instances."""
        cap = self.cfg.decision.idle_decode_tokens
        if decode.in_flight(Side.DECODE) > decode.local_prefills or decode.vllm_others >= 1:
            return False
        prefills = [p for p in self.registry.candidates(Side.PREFILL) if pairable(p, decode)]
        backlog = min((p.in_flight_tokens(Side.PREFILL) for p in prefills), default=0)
        return (backlog > 0 and decode.local_prefill_tokens <= backlog
                and decode.local_prefill_tokens + uncached <= cap)

    def decide(self, body: ClientBody, hits: dict[str, int] | None = None,
               avoid: tuple[Instance, ...] = ()) -> Decision:
        """``hits``: cached prompt tokens per instance; ``avoid``: decode instances to choose
        only when no other is routable. The prompt's length is ``body.route.prompt_tokens``:
        exact when the proxy knows the token ids (``Serving.open``), else an estimate."""
        hits = hits or {}
        cands = (self.registry.candidates(Side.DECODE, avoid)
                 or self.registry.candidates(Side.DECODE))
        decision = self._decide(body, hits, cands)
        decode = decision.decode.instance
        if decision.route is not Route.PD or not isinstance(decode, Instance):
            return decision
        prefills = self.registry.candidates(Side.PREFILL)
        if not prefills or any(pairable(p, decode) for p in prefills):
            return decision  # (no prefill at all: the prefill stage says so)
        # No prefill speaks a protocol version this decode does (a rolling upgrade).
        paired = [d for d in cands if any(pairable(p, d) for p in prefills)]
        if paired:
            return self._decide(body, hits, paired)
        if not self.cfg.retry.decode_only_fallback:
            return decision  # the prefill stage refuses it (503 no_compatible_prefill)
        return decision._replace(route=Route.DECODE_ONLY, reason="no_compatible_prefill")

    def _decide(self, body: ClientBody, hits: dict[str, int],
                cands: Sequence[Instance]) -> Decision:
        """``decide`` among decode candidates ``cands``."""
        sel = self.choose_decode(body, cands, hits)
        prompt = body.route.prompt_tokens
        decode = sel.instance
        if not isinstance(decode, Instance):  # none routable: the decode stage says so
            return Decision(Route.PD, "no_decode", sel, prompt, 0, 0)
        cached = min(prompt, hits.get(decode.url, 0))
        uncached, threshold = prompt - cached, self.threshold(decode)

        def decided(route: Route, reason: str) -> Decision:
            return Decision(route, reason, sel, uncached, cached, threshold)

        if body.local_reason is not None:
            return decided(Route.DECODE_ONLY, body.local_reason)
        if not self.cfg.decision.enabled:
            return decided(Route.PD, "always")
        if uncached > threshold:
            if self.prefill_backlogged(decode, uncached):
                return decided(Route.DECODE_ONLY, "prefill_busy")
            return decided(Route.PD, "uncached_prompt")
        return decided(Route.DECODE_ONLY, "cached_prefix" if cached else "short_prompt")
