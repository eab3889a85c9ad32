"""The stages of one exchange before its client sees a byte, in order.

    plan:     the prompt's token ids (when the cache index answers), what each instance caches,
              then the decider's ``RoutePlan`` (decide.py)
    early:    disaggregated, and the plan allows it: the decode leg sent with the prefill leg
              (early.py, ``EarlyDispatch``)
    prefill:  the prefill legs with retries, or decode alone (prefill.py, ``PrefillStage``)
    lead:     a stream whose first token prefill gave: its start (first_token.py, ``FirstToken``)
    decode:   a decode leg that answered, with retries and re-prefills (decode.py,
              ``DecodeStage``)

``Pipeline.open`` returns what the relay (relay.py) hands the client: a decode leg that
answered (``Opened``), or, for the client's own stream, prefill's first token with the
continuation decode will serve (``Led``). A request none can serve raises ``Refusal``.

Imports the stages; nothing imports it but the relay, fan-out and the front door.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Literal, overload

from kvdisagg.proxy.fleet.registry import Instance
from kvdisagg.proxy.handoff.decode import DecodeStage, Opened
from kvdisagg.proxy.handoff.early import EarlyDispatch
from kvdisagg.proxy.handoff.exchange import Exchange
from kvdisagg.proxy.handoff.first_token import FirstToken, Led
from kvdisagg.proxy.handoff.prefill import Handoff, PrefillFailed, PrefillStage
from kvdisagg.proxy.routing.decide import DecodeChoice, Route, RoutePlan
from kvdisagg.proxy.routing.prefix_index import Lookup
from kvdisagg.proxy.routing.prompt_keys import BlockExtra
from kvdisagg.proxy.types import Side

log = logging.getLogger("kvdisagg.proxy")
_PD, _DECODE_ONLY = Route.PD.value, Route.DECODE_ONLY.value  # routed_total's route labels
PENDING_GRACE_S = 2.0
"""How long a prompt stays noted as computed on an instance after its leg answered: vLLM
publishes the blocks after the step that computed them, and the KV events take a moment."""


class Pipeline:
    """Plan, prefill if disaggregated, and open a decode leg that answered, for one exchange."""

    __slots__ = ("x",)

    def __init__(self, x: Exchange) -> None:
        self.x = x

    @overload
    async def open(self, avoid: tuple[Instance, ...] = ...,
                   lead: Literal[False] = ...) -> Opened: ...

    @overload
    async def open(self, avoid: tuple[Instance, ...] = ..., *,
                   lead: bool) -> Opened | Led: ...

    async def open(self, avoid: tuple[Instance, ...] = (), lead: bool = False
                   ) -> Opened | Led:
        """A decode leg that answered. ``avoid``: decode instances to use only when no other is
        left (a migrated stream's); ``lead``: the client's own stream, which may start with
        prefill's first token instead (``Led``: its decode leg opened by the relay)."""
        x = self.x
        body = x.body
        ids = body.token_ids if body.token_ids is not None else body.forwarded_ids
        if (ids is None and x.cache is not None and x.tokenizer is not None
                and x.cache.answering()):  # worth tokenizing: the index would answer
            ids = await self._tokenized()
        found = self._lookup(ids) if ids is not None else None
        plan = x.decider.decide(x.body, x.hits, avoid, lead)
        cache = x.cache
        # The prompt is being computed where it goes (prefill, or decode alone): until then
        # the index counts it there, so the same prefix arriving meanwhile follows it.
        computing = (plan.prefill.instance if plan.prefill is not None
                     else plan.decode.instance)
        if cache is None or found is None or computing is None:
            return await self._run(plan, avoid)
        pending = cache.note_pending(computing.url, found)
        try:
            return await self._run(plan, avoid)
        finally:
            asyncio.get_running_loop().call_later(PENDING_GRACE_S, cache.drop_pending, pending)

    def _lookup(self, ids: list[int]) -> Lookup | None:
        """What each instance caches of the prompt of token ids ``ids`` (``x.hits``); their
        count replaces the estimate of the prompt's length."""
        x = self.x
        route = x.body.route
        if len(ids) != route.prompt_tokens:
            # The exact length replaces the estimate for every stage: the decision, and the
            # prompt tokens a prefill leg queues (what ``prefill_backlogged`` weighs).
            x.body = x.body._replace(route=route.with_length(len(ids)))
        if x.cache is None:
            return None
        salt = x.body.fields.get("cache_salt")
        try:
            found = x.cache.lookup(ids, BlockExtra(
                lora_name=None, cache_salt=salt if isinstance(salt, str) else None))
        except ValueError:  # ids the index cannot hold: no prediction
            return None
        x.hits = found.hits
        return found

    async def _tokenized(self) -> list[int] | None:
        """The prompt's token ids worked out by the tokenizer (in process, or vLLM's
        /tokenize); None when it cannot (the decision then counts an estimate). ``open`` asks
        only when the cache index answers for some instance and the request carries no ids."""
        x = self.x
        assert x.tokenizer is not None
        decode = x.registry.candidates(Side.DECODE)
        prompts = await x.tokenizer.token_ids(x.body.fields, x.body.chat,
                                              decode[0].pool if decode else None)
        return prompts[0] if prompts is not None and len(prompts) == 1 else None

    async def _run(self, plan: RoutePlan, avoid: tuple[Instance, ...]) -> Opened | Led:
        x = self.x
        if log.isEnabledFor(logging.DEBUG):  # (its arguments cost more than the check)
            log.debug("request %s: %s:%s, %d prompt tokens, %d cached on decode %s (threshold "
                      "%d)", x.rid, plan.route.value, plan.reason.value,
                      x.body.route.prompt_tokens, plan.cached_tokens,
                      plan.decode.instance.url if plan.decode.instance else None,
                      plan.threshold)
        if x.root is not None:
            x.root.set_attributes({"kvdisagg.route": plan.route.value,
                                   "kvdisagg.reason": plan.reason.value,
                                   "kvdisagg.cached_tokens": plan.cached_tokens,
                                   "kvdisagg.uncached_tokens": plan.uncached_tokens})
        decode = plan.decode
        if plan.prefill is not None:  # disaggregated
            failed: PrefillFailed | None = None
            if plan.early:
                early = await EarlyDispatch(x).open(plan)
                if early.opened is not None:
                    self._count(plan, early.opened.pre)
                    return early.opened
                failed = early.failed
            pre = await PrefillStage(x).run(plan.prefill, failed, lead=plan.first_token,
                                            decode=decode.instance)
            choice = (x.decider.handoff_decode(x.body.route, pre.versions, decode, avoid)
                      if pre.kv is not None else DecodeChoice(decode))
            decode = choice.selection
            if choice.alone is not None:
                log.warning("request %s: no decode speaks protocol %s of the handoff's "
                            "prefill; decode computes the prompt itself", x.rid, pre.versions)
                pre = Handoff.decode_alone(choice.alone, x.body.route.prompt_tokens)
            if pre.answer:
                led = FirstToken(x).lead(pre, decode, avoid)
                if led is not None:
                    self._count(plan, pre)
                    return led
                pre = pre._replace(answer=b"")
        else:
            pre = Handoff.decode_alone(plan.reason, plan.uncached_tokens)
        self._count(plan, pre)
        return await DecodeStage(x).open(pre, decode, avoid)

    def _count(self, plan: RoutePlan, pre: Handoff) -> None:
        m = self.x.metrics
        # ``_value_``: the label string without the ``value`` property's two Python calls
        if pre.kv is not None or pre.alone is None:
            m.routed(_PD, plan.reason._value_)
        else:
            m.routed(_DECODE_ONLY, pre.alone._value_)
        decode = plan.decode.instance
        if plan.cached_tokens and decode is not None:
            m.predicted_hit(decode.url, plan.cached_tokens)
