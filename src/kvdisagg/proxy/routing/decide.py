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
(``prefill_backlogged``: decode computes it, ``prefill_busy``). A request form that the
handoff cannot serve exactly (contract.py: ``paths.handoff``) goes to decode alone whatever its
length.

**Inputs.** The request's prompt tokens (exact token ids when the proxy has a tokenizer, else
an estimate), what each instance caches (``CacheView``), decode's live TPOT estimate and load.
A wrong prediction costs latency, never a request: decode computes what it lacks.

**Versions.** A disaggregated request needs a prefill that speaks a side-channel protocol
version the decode speaks (``registry.pairable``; a fleet in the middle of a rolling upgrade
has pairs without one). When no routable prefill pairs with the chosen decode, the decision is
taken again among the decodes that some prefill pairs with; when there are none, decode serves
the request alone (``no_compatible_prefill``, with ``retry.decode_only_fallback``; without it
the prefill stage answers 503). The prefill is then chosen among those that pair with the
decode (``Decider.choose_prefill``).

**The plan.** ``decide`` returns one ``RoutePlan``: the route and its ``Reason``, the decode and
(disaggregated) the first prefill to try, the prediction, and which of the contract's paths
the request may take (early dispatch, the first token from prefill, migration: ``takes_*``).
Every reason to serve a request by decode alone is decided in this module: at the decision
(the contract's, ``short_prompt``, ``cached_prefix``, ``prefill_busy``,
``no_compatible_prefill``), and for the prefill and decode stages when the handoff cannot go
on (``admission``: ``colocate``; ``after_prefill``: ``no_healthy_prefill``,
``prefill_failed``, ``no_compatible_prefill``; ``handoff_decode`` / ``retry_decode``:
``no_compatible_decode``). Each is a ``Reason``, the ``reason`` label of
``kvdisagg_proxy_routed_total``.

Imports routing's policies and the fleet's registry, never the handoff's stages.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import NamedTuple, Protocol

from kvdisagg.connector.protocol.versions import Versions
from kvdisagg.proxy.config import ProxyConfig
from kvdisagg.proxy.fleet.registry import Instance, Registry, accepts, pairable
from kvdisagg.proxy.routing.body import ClientBody
from kvdisagg.proxy.routing.policies import Policy, RouteRequest, Selection, SloAware, Verdict
from kvdisagg.proxy.routing.prefix_index import Lookup, Pending
from kvdisagg.proxy.routing.prompt_keys import BlockExtra
from kvdisagg.proxy.types import Admission, Side


class Route(str, enum.Enum):
    PD = "pd"  # prefill leg, then decode pulls the KV
    DECODE_ONLY = "decode_only"  # decode computes the prompt itself


class Reason(str, enum.Enum):
    """Why a request takes its route: the ``reason`` label of ``kvdisagg_proxy_routed_total``
    (docs/proxy.md lists them; kvdisagg demo explains each)."""

    # disaggregated
    UNCACHED_PROMPT = "uncached_prompt"  # more uncached prompt than decode computes itself
    ALWAYS = "always"  # the decision is off (--always-disaggregate)
    NO_DECODE = "no_decode"  # no decode routable now: the decode stage refuses it
    # decode alone: decided
    SHORT_PROMPT = "short_prompt"
    CACHED_PREFIX = "cached_prefix"
    PREFILL_BUSY = "prefill_busy"
    COLOCATE = "colocate"  # slo_aware: no prefill meets the TTFT SLO, slo.admission colocate
    # decode alone: the contract (contract.py: the handoff declines the form)
    PROMPT_LOGPROBS = "prompt_logprobs"
    BEAM_SEARCH = "beam_search"
    PROMPT_EMBEDS = "prompt_embeds"
    INVALID_MIN_TOKENS = "invalid_min_tokens"
    # decode alone: fallbacks (retry.decode_only_fallback)
    NO_HEALTHY_PREFILL = "no_healthy_prefill"
    PREFILL_FAILED = "prefill_failed"
    NO_COMPATIBLE_PREFILL = "no_compatible_prefill"
    NO_COMPATIBLE_DECODE = "no_compatible_decode"


class CacheView(Protocol):
    """What each instance's prefix cache holds of a prompt (cache_index.CacheIndex)."""

    def answering(self) -> list[str]: ...

    def lookup(self, token_ids: Sequence[int], extra: BlockExtra = ...) -> Lookup: ...

    def note_pending(self, url: str, found: Lookup) -> Pending: ...

    def drop_pending(self, pending: Pending) -> None: ...


class RoutePlan(NamedTuple):
    """How one request is served, decided before any leg (``Decider.decide``)."""

    route: Route
    reason: Reason  # label of kvdisagg_proxy_routed_total
    decode: Selection[Instance]  # the decode chosen (instance None: none routable now)
    prefill: Selection[Instance] | None  # disaggregated: the prefill of the first try
    uncached_tokens: int  # prompt tokens decode would compute itself (predicted)
    cached_tokens: int  # prompt tokens decode holds (predicted)
    threshold: int  # the local-prefill bound in force for this decode
    early: bool = False  # the decode leg may go out with the prefill leg (early.py)
    first_token: bool = False  # a stream may start with prefill's token (first_token.py)
    migration: bool = False  # a broken stream may go on on another decode (migrate.py)


class DecodeChoice(NamedTuple):
    """The decode for a leg, and the reason decode computes the prompt itself although it
    was prefilled (None: it takes the handoff)."""

    selection: Selection[Instance]
    alone: Reason | None = None


class Fallback(NamedTuple):
    """Every prefill try failed, or none could be tried: why, and whether decode serves the
    request alone (else the prefill stage answers the client an error)."""

    reason: Reason
    decode_alone: bool


def takes_early(cfg: ProxyConfig, body: ClientBody) -> bool:
    """Whether a disaggregated request may go out early (before choosing anything)."""
    return (cfg.decision.enabled and cfg.decision.early_decode
            and body.forwarded_ids is None)


def takes_first_token(cfg: ProxyConfig, body: ClientBody) -> bool:
    """Whether ``body``'s first token may come from prefill (before its prefill leg): the
    contract allows it (contract.py) and the stream is the client's own request."""
    return (cfg.decision.first_token_from_prefill and body.paths.first_token is None
            and not body.one_of_many and body.forwarded_ids is None)


def takes_migration(cfg: ProxyConfig, body: ClientBody) -> bool:
    """A stream the proxy can move to another decode if its decode fails (migrate.py): the
    contract allows it (contract.py) and migrations are on."""
    return (body.paths.migration is None and not body.one_of_many
            and cfg.retry.migrations > 0)


class Decider:
    """Every routing choice of a request: its route, its decode, each prefill try."""

    def __init__(self, cfg: ProxyConfig, registry: Registry, prefill_policy: Policy,
                 decode_policy: Policy) -> None:
        self.cfg = cfg
        self.registry = registry
        self.prefill_policy = prefill_policy
        self.decode_policy = decode_policy

    def choose_prefill(self, req: RouteRequest, tried: tuple[Instance, ...] = (),
                       decode: Instance | None = None) -> Selection[Instance]:
        """The prefill policy's pick (cache-aware: ``req.hits``), among the routable prefills
        not ``tried``. ``decode``: the decode chosen for the request: only prefills it can
        pull from (a protocol version in common)."""
        cands = self.registry.candidates(Side.PREFILL, tried)
        if decode is not None:
            cands = [p for p in cands if pairable(p, decode)]
        return self.prefill_policy.select(req, cands, Side.PREFILL)

    def choose_decode(self, req: RouteRequest,
                      cands: Sequence[Instance]) -> Selection[Instance]:
        return self.decode_policy.select(req, cands, Side.DECODE)

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

    def decide(self, body: ClientBody, hits: Mapping[str, int] | None = None,
               avoid: tuple[Instance, ...] = (), lead: bool = False) -> RoutePlan:
        """``hits``: cached prompt tokens per instance; ``avoid``: decode instances to choose
        only when no other is routable (a migrated stream's); ``lead``: the client's own
        stream (its first token may come from prefill). The prompt's length is
        ``body.route.prompt_tokens``: exact when the proxy knows the token ids, else an
        estimate."""
        req = body.route.with_hits(hits) if hits else body.route
        cands = (self.registry.candidates(Side.DECODE, avoid)
                 or self.registry.candidates(Side.DECODE))
        plan = self._decide(body, req, cands)
        decode = plan.decode.instance
        if plan.route is Route.PD and decode is not None:
            prefills = self.registry.candidates(Side.PREFILL)
            if prefills and not any(pairable(p, decode) for p in prefills):
                # No prefill speaks a protocol version this decode does (a rolling upgrade).
                paired = [d for d in cands if any(pairable(p, d) for p in prefills)]
                if paired:
                    plan = self._decide(body, req, paired)
                elif self.cfg.retry.decode_only_fallback:
                    plan = plan._replace(route=Route.DECODE_ONLY,
                                         reason=Reason.NO_COMPATIBLE_PREFILL)
                # else: the prefill stage refuses it (503 no_compatible_prefill)
        migration = takes_migration(self.cfg, body)
        # The plan's last fields, in one new tuple (``_replace`` costs several times that).
        if plan.route is not Route.PD:
            return RoutePlan(plan.route, plan.reason, plan.decode, plan.prefill,
                             plan.uncached_tokens, plan.cached_tokens, plan.threshold,
                             migration=migration) if migration else plan
        return RoutePlan(plan.route, plan.reason, plan.decode,
                         self.choose_prefill(req, decode=plan.decode.instance),
                         plan.uncached_tokens, plan.cached_tokens, plan.threshold,
                         early=not avoid and takes_early(self.cfg, body),
                         first_token=lead and takes_first_token(self.cfg, body),
                         migration=migration)

    def _decide(self, body: ClientBody, req: RouteRequest,
                cands: Sequence[Instance]) -> RoutePlan:
        """``decide`` among decode candidates ``cands``."""
        sel = self.choose_decode(req, cands)
        prompt = body.route.prompt_tokens
        decode = sel.instance
        if decode is None:  # none routable: the decode stage says so
            return RoutePlan(Route.PD, Reason.NO_DECODE, sel, None, prompt, 0, 0)
        cached = min(prompt, req.hits.get(decode.url, 0))
        uncached, threshold = prompt - cached, self.threshold(decode)

        def decided(route: Route, reason: Reason) -> RoutePlan:
            return RoutePlan(route, reason, sel, None, uncached, cached, threshold)

        if body.paths.handoff is not None:  # the contract: only decode alone is exact
            return decided(Route.DECODE_ONLY, Reason(body.paths.handoff))
        if not self.cfg.decision.enabled:
            return decided(Route.PD, Reason.ALWAYS)
        if uncached > threshold:
            if self.prefill_backlogged(decode, uncached):
                return decided(Route.DECODE_ONLY, Reason.PREFILL_BUSY)
            return decided(Route.PD, Reason.UNCACHED_PROMPT)
        return decided(Route.DECODE_ONLY,
                       Reason.CACHED_PREFIX if cached else Reason.SHORT_PROMPT)

    def admission(self, sel: Selection[Instance], first_try: bool) -> Admission:
        """What a leg to ``sel`` does: ``queue`` (go ahead), or, on the first try when
        slo_aware predicts even the best instance misses its SLO, ``slo.admission``:
        ``shed`` (the stage refuses the request, 429) or ``colocate`` (prefill side: decode
        serves the request alone, ``Reason.COLOCATE``)."""
        if first_try and sel.verdict is Verdict.SLO_MISS:
            return self.cfg.slo.admission
        return Admission.QUEUE

    def after_prefill(self, tried: bool, missing_kv: bool) -> Fallback:
        """Every prefill try failed (``tried``) or none could be made: decode serves the
        request alone when ``retry.decode_only_fallback`` allows, unless a prefill answered
        without kv_transfer_params (a misconfigured fleet: an error, never a silent
        recompute)."""
        reason = (Reason.PREFILL_FAILED if tried else Reason.NO_COMPATIBLE_PREFILL
                  if self.registry.candidates(Side.PREFILL) else Reason.NO_HEALTHY_PREFILL)
        return Fallback(reason, self.cfg.retry.decode_only_fallback and not missing_kv)

    def handoff_decode(self, req: RouteRequest, versions: Versions | None,
                       first: Selection[Instance],
                       avoid: tuple[Instance, ...] = ()) -> DecodeChoice:
        """The decode to take a handoff from a prefill speaking ``versions``: ``first`` when it
        speaks one of them, else the pick among the decodes that do; with none, ``first``
        computing the prompt itself (``no_compatible_decode``)."""
        decode = first.instance
        if decode is None or accepts(decode, versions):
            return DecodeChoice(first)
        reg = self.registry
        cands = [c for c in (reg.candidates(Side.DECODE, avoid) or reg.candidates(Side.DECODE))
                 if accepts(c, versions)]
        if cands:
            return DecodeChoice(self.choose_decode(req, cands))
        return DecodeChoice(first, Reason.NO_COMPATIBLE_DECODE)

    def retry_decode(self, req: RouteRequest, tried: Sequence[Instance],
                     answered: Sequence[Instance], avoid: tuple[Instance, ...],
                     handoff: bool, versions: Versions | None) -> DecodeChoice:
        """The decode for a retry: one not tried (nor in ``avoid`` while others are left); with
        none, one that ``answered`` with an error (typically a KV load that failed because its
        prefill died: it gets the retry, with a fresh handoff). A ``handoff`` goes only to a
        decode speaking one of the prefill's ``versions``; with none, decode computes the
        prompt itself (``no_compatible_decode``)."""
        reg = self.registry
        cands = (reg.candidates(Side.DECODE, (*tried, *avoid))
                 or reg.candidates(Side.DECODE, tuple(tried)))
        if not cands and answered:
            cands = [i for i in reg.candidates(Side.DECODE) if i in answered]
        alone = None
        if handoff and cands:  # only decodes that can pull this handoff
            fit = [c for c in cands if accepts(c, versions)]
            if not fit:
                alone = Reason.NO_COMPATIBLE_DECODE
            cands = fit or cands
        return DecodeChoice(self.choose_decode(req, cands), alone)
