"""Early dispatch: a disaggregated request's decode leg goes out together with its prefill leg.

**Why.** In the ordinary handoff, decode hears of the request only once prefill has answered:
the proxy then sends the decode leg, and vLLM's HTTP intake, input processing and a schedule
(~3 ms on CPU, docs/benchmarks.md) sit on the critical path before the pull can start. Sent
early, decode admits the request while prefill computes, and its pull waits at prefill for the
handoff (transport/handoffs.py: an *early* Read), so it starts the moment the KV is offered.

**How.** The proxy names the handoff, a random id and token, in both legs: prefill's request
carries them (``kvdisagg_early``) and its connector offers the KV under them; decode's
kv_transfer_params are that prefill's last handoff params (its side-channel host and ports,
layout, transport and shape, which do not change while it runs) with the new id and token,
``early`` set and no block ids: decode claims its whole prompt and reads prefill's blocks by
position.

**When.** The decision is on and chose ``pd`` (``--always-disaggregate`` keeps the ordinary
handoff for every request); the chosen prefill is idle (no leg of ours in flight, no other
client's request in its vLLM gauges at the last probe: it starts at once, so decode holds the
request's blocks for the prefill's compute, not its queue); an earlier handoff told us its
parameters; its transport is a pull transport (a store has no side channel: port 0); the pair
speaks protocol version ``EARLY_HANDOFF_VERSION`` or later (or the proxy does not know their
versions).
Otherwise, and for a migrated stream's continuation, the ordinary path.

**Failure.** If the prefill leg fails first, the decode leg is cancelled (vLLM aborts it) and
the request is served the ordinary way, that leg counted as its first prefill try (another
prefill, or decode alone, as the decider says); a client error (4xx) goes back as it
came. If the decode leg fails, the prefill leg is cancelled and the request served the
ordinary way. Both count as ``fell_back`` in ``kvdisagg_proxy_early_handoffs_total``. A
handoff offered but never read is freed when its lease runs out.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import Any, NamedTuple

import msgspec

from kvdisagg.connector.protocol.params import RemotePrefill
from kvdisagg.connector.protocol.versions import EARLY_HANDOFF_VERSION
from kvdisagg.proxy.fleet.registry import Instance
from kvdisagg.proxy.handoff.decode import DecodeStage, Opened
from kvdisagg.proxy.handoff.exchange import Exchange
from kvdisagg.proxy.handoff.legs import LegFailure
from kvdisagg.proxy.handoff.prefill import Handoff, PrefillFailed, PrefillStage
from kvdisagg.proxy.routing.decide import RoutePlan
from kvdisagg.proxy.routing.policies import Verdict
from kvdisagg.proxy.types import Side

log = logging.getLogger("kvdisagg.proxy")


class Early(NamedTuple):
    """What early dispatch came to: a decode leg that answered (``opened``), else the
    ordinary path, counting ``failed`` (a prefill leg that failed) as its first try."""

    opened: Opened | None = None
    failed: PrefillFailed | None = None


def early_params(template: bytes, handoff_id: str, token: str) -> bytes | None:
    """Decode's kv_transfer_params for an early handoff from the prefill whose last handoff
    params are ``template``; None if they cannot serve (unreadable, or a store transport)."""
    try:
        last = msgspec.json.decode(template, type=RemotePrefill)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    if last.remote_port == 0:  # a store transport: no side channel to wait at
        return None
    extras = msgspec.structs.replace(last.kvdisagg, token=token, early=True,
                                     lease_expires=time.time() + last.kvdisagg.lease_s)
    params = msgspec.to_builtins(msgspec.structs.replace(
        last, remote_request_id=handoff_id, remote_block_ids=[], remote_num_tokens=0,
        kvdisagg=extras))
    params["do_remote_decode"] = False
    return msgspec.json.encode(params)


class EarlyDispatch:
    """An exchange's decode leg sent together with its prefill leg (``RoutePlan.early``)."""

    __slots__ = ("x",)

    def __init__(self, x: Exchange) -> None:
        self.x = x

    async def open(self, plan: RoutePlan) -> Early:
        """A decode leg that answered, sent with its prefill leg to the plan's prefill; or
        the ordinary path (not eligible, or a leg failed). A client error (4xx) from the
        prefill leg raises ``Refusal``."""
        x = self.x
        decode, sel = plan.decode.instance, plan.prefill
        inst = sel.instance if sel is not None and sel.verdict is Verdict.OK else None
        declined = _declined(x.registry.candidates(Side.DECODE), decode, inst)
        if declined is not None:
            x.metrics.early_declined(declined)
            return Early()
        assert decode is not None and inst is not None and inst.handoff_params is not None
        named = {"handoff_id": secrets.token_urlsafe(16), "token": secrets.token_urlsafe(16)}
        kv = early_params(inst.handoff_params, **named)
        if kv is None:
            x.metrics.early_declined("store_transport")
            return Early()
        deadline = time.perf_counter() + x.cfg.timeouts.decode_total_s
        prefilled = asyncio.ensure_future(PrefillStage(x).leg(inst, named))
        opening = asyncio.ensure_future(DecodeStage(x).attempt(decode, Handoff(kv), deadline))
        try:
            await asyncio.wait((prefilled, opening), return_when=asyncio.FIRST_COMPLETED)
            failed = None if opening.done() else _failure(prefilled)
            if failed is not None:
                await _cancel(opening)
            else:
                opened = await opening
        except BaseException:
            await _cancel(opening)
            await _cancel(prefilled)
            raise
        if failed is not None:
            x.metrics.early_handoff("fell_back")
            log.warning("request %s: early handoff: prefill failed (%s); serving it the "
                        "ordinary way", x.rid, failed.message)
            return _retry_from(inst, failed)
        if isinstance(opened, Opened):
            x.metrics.early_handoff("opened")
            x.keep(prefilled)  # it ends on its own; its leg does its own bookkeeping
            return Early(opened)
        await _cancel(prefilled)
        x.metrics.early_handoff("fell_back")
        failed = _failure(prefilled)  # both legs may have ended in the same turn of the loop
        log.warning("request %s: early handoff: decode failed (%s)%s; serving it the ordinary "
                    "way", x.rid, opened.failure.message,
                    "" if failed is None else f", prefill too ({failed.message})")
        return Early() if failed is None else _retry_from(inst, failed)


def _declined(decodes: list[Instance], decode: Instance | None,
              prefill: Instance | None) -> str | None:
    """Why the request cannot go out early (None: it can, if its transport pulls); the
    reasons of the module docstring, as ``kvdisagg_proxy_early_declined_total`` names them."""
    if decode is None or decode not in decodes:
        return "no_decode"
    if prefill is None:
        return "no_prefill"  # none chosen, or predicted to miss the SLO
    if prefill.handoff_params is None:
        return "no_template"
    if prefill.in_flight(Side.PREFILL):
        return "prefill_busy"
    if prefill.vllm_others >= 1:  # our own legs discounted: a stale reading of the last one
        return "prefill_queue"     # (caught waiting by a probe) must not decline the next
    if not _speak_early(prefill, decode):
        return "protocol"
    return None


def _speak_early(prefill: Instance, decode: Instance) -> bool:
    """Whether the pair speaks a protocol version with early handoffs (unknown: as before)."""
    if prefill.protocol is None or decode.protocol is None:
        return True
    version = prefill.protocol.common(decode.protocol)
    return version is not None and version >= EARLY_HANDOFF_VERSION


def _failure(prefilled: asyncio.Future[Handoff | LegFailure]) -> LegFailure | None:
    """The prefill leg's failure, if it ended with one."""
    if not prefilled.done() or prefilled.cancelled() or prefilled.exception() is not None:
        return None
    res = prefilled.result()
    return res if isinstance(res, LegFailure) else None


def _retry_from(inst: Instance, failed: LegFailure) -> Early:
    """The failed leg the ordinary path counts as tried; a client error raised as it came."""
    if failed.client_error is not None:
        raise failed.client_error
    return Early(failed=PrefillFailed(inst, failed))


async def _cancel(task: asyncio.Future[Any]) -> None:
    """Cancel ``task`` and wait for it to clean up (its leg closes, vLLM aborts)."""
    if task.done():
        if not task.cancelled():
            task.exception()  # retrieved: a failed leg was already recorded by its scope
        return
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        if (current := asyncio.current_task()) is not None and current.cancelling():
            raise
    except Exception:  # its failure is recorded by its leg scope
        pass
