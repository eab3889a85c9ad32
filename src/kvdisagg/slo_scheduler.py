"""SloScheduler: vLLM's v1 Scheduler with deadline-aware admission (``--scheduler-cls``).

Runs in the EngineCore process, in place of vLLM's scheduler; select it with
``--scheduler-cls kvdisagg.slo_scheduler.SloScheduler`` (vLLM resolves the qualified name with
``resolve_obj_by_qualname`` inside EngineCore). vLLM builds the class it is given whatever
``async_scheduling`` says, so SloScheduler picks its own base when built: vLLM's
``AsyncScheduler`` when async scheduling is on (vLLM's default on GPUs: the next step is
scheduled while the current one runs), its ``Scheduler`` otherwise (CPU, PP on the V1 runner,
``--no-async-scheduling``)::

    SloScheduler(vllm_config=..., ...)   async_scheduling on  -> AsyncSloScheduler
                                                               (SloScheduler, AsyncScheduler)
                                         off                 -> SloScheduler (Scheduler)

It keeps vLLM's schedule loop whole and only changes what that loop sees, before each
``schedule()``:

- the order of ``self.waiting`` (earliest TTFT deadline first, starved requests first);
- the per-step token budget (``self.max_num_scheduled_tokens``), once, at start;
- whether new prompts may be admitted this step (held KV above ``held_kv_share``);
- how many requests may be running (``self.max_num_active_reqs``, from the TPOT profile).

Settings are a frozen ``SchedulerSettings``, read once from
``kv_transfer_config.kv_connector_extra_config["scheduler"]``, else from the JSON in
``KVDISAGG_SCHEDULER``, else defaults. ``policy: "stock"`` leaves vLLM's behaviour untouched.

This module may import vllm, kvdisagg.errors, the connector's HTTP contract
(kvdisagg.connector.protocol.params: the request's SLO key) and the counters it exports through
the connector's stats (kvdisagg.connector.stats); it must not import torch, kvdisagg.transport or
the rest of kvdisagg.connector (it reads vLLM's scheduler state only, never the connector's).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Annotated, Any, Literal

import msgspec
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.request_queue import FCFSRequestQueue
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from kvdisagg.compat._vllm import paused_new
from kvdisagg.connector.protocol.params import SLO_PARAMS_KEY, RequestSlo
from kvdisagg.connector.stats import PROM_COUNTERS, SloStats
from kvdisagg.errors import ConfigError

__all__ = ["ENV_VAR", "EXTRA_CONFIG_KEY", "PROM_COUNTERS", "SLO_PARAMS_KEY", "AsyncSloScheduler",
           "RequestSlo", "SchedulerSettings", "SloScheduler", "SloStats", "load_settings",
           "parse_settings"]

logger = logging.getLogger(__name__)

EXTRA_CONFIG_KEY = "scheduler"
"""Key of ``kv_connector_extra_config`` holding the SchedulerSettings dict."""
ENV_VAR = "KVDISAGG_SCHEDULER"
"""JSON SchedulerSettings, used when kv_connector_extra_config has no ``scheduler`` key.
Read here rather than in an ``envs.py`` (the house style's home for env vars): the package has
no such module yet, and this is read once per scheduler, at construction."""
Seconds = Annotated[float, msgspec.Meta(gt=0, le=86400)]
NonNegSeconds = Annotated[float, msgspec.Meta(ge=0, le=86400)]


class SchedulerSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Settings of SloScheduler (``kv_connector_extra_config["scheduler"]``)."""

    policy: Literal["stock", "slo"] = "slo"
    """``slo``: everything below applies. ``stock``: vLLM's Scheduler, unchanged (every other
    key is still validated, and then ignored)."""
    ttft_s: Seconds = 2.0
    """Default TTFT objective: a waiting request's deadline is its arrival time plus this (or
    plus its own ``kv_transfer_params["kvdisagg_slo"]["ttft_s"]``)."""
    starvation_s: Seconds = 30.0
    """A request waiting longer than this goes ahead of every deadline-ordered one (oldest
    first), so a long-deadline request is never starved by a stream of short ones."""
    max_batched_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    """Per-step token budget (vLLM's ``max_num_scheduled_tokens``); set it to the saturation
    point of the prefill curve measured by ``kvdisagg profile`` (docs/scheduler.md). At most
    vLLM's ``--max-num-batched-tokens``, which sizes the model runner's buffers. None: vLLM's
    budget."""
    held_kv_share: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.5
    """Prefill backpressure: while the KV blocks held by finished requests whose handoff decode
    has not pulled yet exceed this share of the KV cache, no new prompt is admitted (requests
    that already hold KV still run). 1.0 turns it off."""
    tpot_s: Seconds | None = None
    """Decode TPOT objective: requests join the running batch only while the predicted step time
    ``decode_base_s + decode_per_seq_s * batch`` stays within it. None: no cap."""
    decode_base_s: NonNegSeconds = 0.0
    """Step time of the linear decode profile at batch 0 (from ``kvdisagg profile``'s decode
    coefficients; docs/scheduler.md)."""
    decode_per_seq_s: NonNegSeconds = 0.0
    """Step time added per running request in the linear decode profile."""

    def __post_init__(self) -> None:
        if self.tpot_s is not None and self.decode_base_s + self.decode_per_seq_s > self.tpot_s:
            raise ValueError(
                f"tpot_s={self.tpot_s} is below the predicted step time of a batch of one, "
                f"decode_base_s + decode_per_seq_s = {self.decode_base_s + self.decode_per_seq_s}"
                ": nothing could ever run; raise tpot_s, fix the profile, or unset tpot_s")

    def decode_batch_cap(self) -> int | None:
        """The largest batch whose predicted step time is within ``tpot_s`` (None: no cap).

        ``decode_base_s + decode_per_seq_s * batch <= tpot_s``; at least 1 (``__post_init__``).
        """
        if self.tpot_s is None or self.decode_per_seq_s == 0:
            return None
        # The small epsilon keeps an exact fit (0.02 + 0.01 * 3 == 0.05) from flooring down.
        return int((self.tpot_s - self.decode_base_s) / self.decode_per_seq_s + 1e-9)


def parse_settings(raw: object, source: str) -> SchedulerSettings:
    """Validate ``raw`` (a dict) into SchedulerSettings; ConfigError names the key and source."""
    try:
        return msgspec.convert(raw, SchedulerSettings)
    except (msgspec.ValidationError, ValueError) as exc:
        known = ", ".join(SchedulerSettings.__struct_fields__)
        raise ConfigError(
            f"kvdisagg scheduler: invalid settings in {source}: {exc} (known keys: {known}; "
            f"policy \"stock\" turns the scheduler's changes off)") from None


def load_settings(extra_config: Mapping[str, Any] | None,
                  environ: Mapping[str, str] = os.environ) -> SchedulerSettings:
    """The settings from ``extra_config["scheduler"]``, else ``$KVDISAGG_SCHEDULER``, else the
    defaults. Called once, by SloScheduler's constructor."""
    if extra_config and EXTRA_CONFIG_KEY in extra_config:
        return parse_settings(extra_config[EXTRA_CONFIG_KEY],
                              f'kv_connector_extra_config["{EXTRA_CONFIG_KEY}"]')
    text = environ.get(ENV_VAR, "").strip()
    if not text:
        return SchedulerSettings()
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"kvdisagg scheduler: {ENV_VAR} is not JSON ({exc}): {text!r}; "
                          f"e.g. {ENV_VAR}='{{\"policy\": \"slo\", \"ttft_s\": 1.0}}'") from None
    return parse_settings(raw, f"${ENV_VAR}")


class SloScheduler(Scheduler):
    """vLLM's Scheduler, with the waiting queue and admission limits set before each step.

    Under ``policy: "slo"``:

    1. ``self.waiting`` is rebuilt in this order (stable, so ties stay first-come-first-served)::

           [ preempted / resumed ][ starved, oldest first ][ the rest, earliest deadline first ]
             (vLLM's resume-first)  (waited > starvation_s)  (arrival + ttft_s)

       ``self.kv_holding_waiting`` (requests that hold KV: remote loads, preempted with blocks)
       is left alone: vLLM drains it before ``self.waiting`` anyway.
    2. ``self.max_num_scheduled_tokens`` is ``max_batched_tokens`` (set once).
    3. While held KV exceeds ``held_kv_share``, the step runs with vLLM's own ``PAUSED_NEW``
       admission rule (only requests holding KV are admitted); the pause is lifted afterwards,
       and an engine-level pause (``pause_state``) is never overridden.
    4. ``self.max_num_active_reqs`` (vLLM's bound on admission into RUNNING, which never
       preempts) is capped by ``SchedulerSettings.decode_batch_cap()``. Not
       ``max_num_running_reqs``: that one is the model runner's slot count, asserted against.

    ``clock`` (wall time, like ``Request.arrival_time``) is a seam for tests.

    Built as ``SloScheduler(...)``, it is an ``AsyncSloScheduler`` when the config's async
    scheduling is on (see the module's docstring).
    """

    max_num_active_reqs: int  # vLLM's Scheduler sets it; decode_batch_cap may lower it

    def __new__(cls, *args: Any, **kwargs: Any) -> SloScheduler:
        if cls is SloScheduler and _async_scheduling(args, kwargs):
            cls = AsyncSloScheduler
        return super().__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.clock: Callable[[], float] = time.time
        kvt = self.vllm_config.kv_transfer_config
        self.settings = load_settings(kvt.kv_connector_extra_config if kvt else None)
        self._deadlines: dict[str, float] = {}  # never-admitted requests' TTFT deadlines
        self._misses = self._reordered = self._cap_steps = self._backpressure_steps = 0
        self._batch_cap: int | None = None
        # The counters travel to /metrics with DisaggConnector's stats (another connector's
        # stats class would not know the keys).
        self._export_stats = kvt is not None and kvt.kv_connector == "DisaggConnector"
        self._exported = SloStats(0, 0, 0, 0)
        base = "AsyncScheduler" if isinstance(self, AsyncScheduler) else "Scheduler"
        if not self._export_stats:
            logger.info("kvdisagg SloScheduler: its counters (vllm:kvdisagg_sched_*) reach "
                        "/metrics with DisaggConnector's stats only; to export them here add "
                        "--kv-transfer-config '{\"kv_connector\":\"DisaggConnector\","
                        "\"kv_role\":\"kv_consumer\"}' (docs/scheduler.md)")
        if self.settings.policy == "stock":
            logger.info("kvdisagg SloScheduler: policy stock (vLLM's %s, unchanged)", base)
            return
        if not isinstance(self.waiting, FCFSRequestQueue):
            raise ConfigError(
                f"kvdisagg scheduler: policy \"slo\" orders the waiting queue itself and needs "
                f"vLLM's --scheduling-policy fcfs (got {self.scheduler_config.policy!r}); "
                f"drop --scheduling-policy, or set policy \"stock\"")
        budget = self.settings.max_batched_tokens
        if budget is not None:
            limit = self.scheduler_config.max_num_batched_tokens
            if budget > limit:
                raise ConfigError(
                    f"kvdisagg scheduler: max_batched_tokens={budget} exceeds vLLM's "
                    f"--max-num-batched-tokens={limit}, which sizes the model runner's buffers; "
                    f"lower max_batched_tokens or raise --max-num-batched-tokens")
            self.max_num_scheduled_tokens = budget
        cap = self.settings.decode_batch_cap()
        if cap is not None and cap < self.max_num_active_reqs:
            self._batch_cap = cap
            self.max_num_active_reqs = cap
        logger.info("kvdisagg SloScheduler on vLLM's %s: %s (token budget %d, batch cap %s)",
                    base, self.settings, self.max_num_scheduled_tokens, self._batch_cap)

    # ---- vLLM's hooks -----------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """vLLM's add_request; a new request also gets its TTFT deadline (slo policy)."""
        is_new = request.request_id not in self.requests
        super().add_request(request)
        if is_new and self.settings.policy == "slo" and request.request_id in self.requests:
            self._deadlines[request.request_id] = request.arrival_time + self._ttft_s(request)

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        """Order ``self.waiting``, decide backpressure, then vLLM's schedule() unchanged."""
        if self.settings.policy == "stock":
            return super().schedule(throttle_prefills)
        now = self.clock()
        self._order_waiting(now)
        fresh = [r for r in self.waiting if r.request_id in self._deadlines]
        hold_new = self.held_kv_share() > self.settings.held_kv_share
        if hold_new and self.waiting:
            self._backpressure_steps += 1
        with self._new_prompts_paused(hold_new):
            out = super().schedule(throttle_prefills)
        for req in fresh:  # admitted: running, or its remote KV load started
            if req.status in (RequestStatus.RUNNING, RequestStatus.WAITING_FOR_REMOTE_KVS):
                if now > self._deadlines.pop(req.request_id):
                    self._misses += 1
        if (self._batch_cap is not None and len(self.running) >= self._batch_cap
                and (self.waiting or self.kv_holding_waiting)):
            self._cap_steps += 1
        return out

    def make_stats(self, *args: Any, **kwargs: Any) -> Any:
        """vLLM's SchedulerStats, with the counters' increase since the last report added to
        ``kv_connector_stats`` (DisaggConnector only; see PROM_COUNTERS)."""
        stats = super().make_stats(*args, **kwargs)
        if stats is None or not self._export_stats:
            return stats
        now = self.slo_stats()
        delta = {key: value - old
                 for key, value, old in zip(PROM_COUNTERS, now, self._exported) if value != old}
        if delta:
            self._exported = now
            stats.kv_connector_stats = {**(stats.kv_connector_stats or {}), **delta}
        return stats

    # ---- what SloScheduler adds -------------------------------------------------------------

    def slo_stats(self) -> SloStats:
        """The counters (read-only; cheap; any thread that may read the scheduler)."""
        return SloStats(self._misses, self._reordered, self._cap_steps, self._backpressure_steps)

    def held_kv_blocks(self) -> int:
        """KV blocks of finished requests kept for a handoff not yet pulled (delayed free)."""
        num_running, num_waiting = self.get_request_counts()
        if len(self.requests) == num_running + num_waiting:
            return 0  # the usual case: nobody is held
        return sum(len(ids) for req in self.requests.values() if req.is_finished()
                   for ids in self.kv_cache_manager.get_block_ids(req.request_id))

    def held_kv_share(self) -> float:
        """``held_kv_blocks()`` over the KV cache's blocks."""
        total = self.cache_config.num_gpu_blocks or 1
        return self.held_kv_blocks() / total

    def _ttft_s(self, request: Request) -> float:
        params = request.kv_transfer_params or {}
        raw = params.get(SLO_PARAMS_KEY)
        if raw is None:
            return self.settings.ttft_s
        try:
            slo = msgspec.convert(raw, RequestSlo)
        except msgspec.ValidationError as exc:
            # Not raised: an error in EngineCore would take every request down with this one.
            logger.warning("request %s: ignoring kv_transfer_params[%r] (%s); using ttft_s=%s",
                           request.request_id, SLO_PARAMS_KEY, exc, self.settings.ttft_s)
            return self.settings.ttft_s
        return slo.ttft_s if slo.ttft_s is not None else self.settings.ttft_s

    def _order_waiting(self, now: float) -> None:
        """Rebuild ``self.waiting`` in place (same deque, same requests, new order)."""
        if len(self._deadlines) > len(self.waiting):  # aborted before admission
            for req_id in [r for r in self._deadlines if r not in self.requests]:
                del self._deadlines[req_id]
        if len(self.waiting) < 2:
            return
        starvation_s = self.settings.starvation_s

        def rank(req: Request) -> tuple[int, float]:
            deadline = self._deadlines.get(req.request_id)
            if deadline is None:
                return (0, 0.0)  # preempted or resumed: keep vLLM's resume-first order
            if now - req.arrival_time > starvation_s:
                return (1, req.arrival_time)
            return (2, deadline)

        before = list(self.waiting)
        after = sorted(before, key=rank)
        if any(a is not b for a, b in zip(before, after)):
            self._reordered += 1
            self.waiting.clear()
            self.waiting.extend(after)

    @contextlib.contextmanager
    def _new_prompts_paused(self, paused: bool) -> Iterator[None]:
        """vLLM's PAUSED_NEW for one schedule(): requests holding KV run, new ones wait."""
        if not paused:
            yield
            return
        with paused_new(self):
            yield


class AsyncSloScheduler(SloScheduler, AsyncScheduler):
    """SloScheduler on vLLM's AsyncScheduler: what ``SloScheduler(...)`` builds when async
    scheduling is on. Nothing to select by hand; the MRO runs SloScheduler's hooks around
    AsyncScheduler's (output placeholders, caching blocks of outputs as they arrive)."""


def _async_scheduling(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether the VllmConfig that vLLM builds the scheduler with has async scheduling on
    (vLLM resolved it before: ``VllmConfig.__post_init__``; None counts as off)."""
    config = kwargs.get("vllm_config", args[0] if args else None)
    scheduler_config = getattr(config, "scheduler_config", None)
    return bool(getattr(scheduler_config, "async_scheduling", False))
