"""Who is in the fleet and who may get traffic: membership, health, breakers, load, counters.

Health has two halves. Active probes (``GET /health`` every ``health.interval_s``, bounded by
``health.timeout_s``) flip an instance only after ``failure_threshold`` consecutive failures or
``success_threshold`` consecutive successes, so one blip doesn't flap routing. Passive request
outcomes feed a circuit breaker per instance; only breakage counts (``Outcome``), never
slowness. A candidate is ACTIVE, healthy and breaker-closed (or half-open with its trial free);
when the breakers would leave a side with no candidate, its healthy instances are candidates
anyway (a breaker must not turn a fleet off). Probes are also the liveness check of legs waiting
for an answer: an instance that turns unhealthy has those legs failed at once, so they fail over
instead of waiting out their deadline. The same probe scrapes vLLM's ``/metrics`` queue gauges
that ``least_loaded`` and ``slo_aware`` read; decode's count of prompts it computed itself
although they came with a handoff (``vllm:kvdisagg_recomputed_prompts_total``), which the
proxy's /metrics exports per instance, so a silent recompute is visible where the fleet is
watched; and ``vllm:kvdisagg_retiring``: an instance that is retiring (SIGTERM,
connector/retire.py) turns DRAINING by itself (no new legs; those in flight finish), and ACTIVE
again if the same URL later answers without it (a new process).

Protocol versions: the side-channel versions each instance speaks (``Instance.protocol``), as
its ``vllm:kvdisagg_protocol_version`` and ``..._min`` gauges say at each scrape and, for a
prefill, as the ``kvdisagg`` params of its last handoff say (``handoff_versions``); the last
observation stands. ``pairable`` / ``accepts`` tell routing which pairs can move KV, so a fleet
in the middle of a rolling upgrade pairs only instances with a version in common. An instance
that says nothing (another connector; a release from before the gauges) is unknown, and
pairs with every instance, as before.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable

import msgspec

from kvdisagg.connector.protocol.versions import Versions
from kvdisagg.errors import UpstreamError, UpstreamTimeout
from kvdisagg.prom_text import Sample, samples
from kvdisagg.proxy.config import InstanceSpec, ProxyConfig
from kvdisagg.proxy.fleet.breaker import BreakerState, CircuitBreaker
from kvdisagg.proxy.fleet.upstream import Pool
from kvdisagg.proxy.types import Role, Side

log = logging.getLogger("kvdisagg.proxy")

_EWMA = 0.2  # weight of a new latency sample


class State(str, enum.Enum):
    ACTIVE = "active"
    DRAINING = "draining"  # no new work; in-flight legs finish
    REMOVED = "removed"


class MemberEvent(enum.Enum):
    """What ``Registry.listeners`` hear about an instance."""

    ADDED = "added"
    REMOVED = "removed"
    RECOVERED = "recovered"  # healthy again after being unhealthy (it may have restarted)


class Outcome(enum.Enum):
    """How one upstream leg ended, as its instance's counters and breaker see it."""

    OK = "ok"  # closes the breaker
    BROKEN = "broken"  # refused connection, 5xx, broken stream: counts toward opening it
    NEUTRAL = "neutral"  # an error that says nothing about the instance: a timeout under
    #                      load, 429, a KV load that failed because its prefill died
    CANCELLED = "cancelled"  # the client went away: not an error at all


class InstanceInfo(msgspec.Struct, kw_only=True):
    """One row of ``GET /admin/list``."""

    url: str
    role: str
    state: str
    healthy: bool
    breaker: str
    last_probe_error: str | None
    in_flight: dict[str, int]
    in_flight_tokens: dict[str, int]
    requests: dict[str, int]
    errors: dict[str, int]
    retries: dict[str, int]
    vllm_waiting: float
    vllm_running: float
    recomputed_prompts: dict[str, float]
    prefill_s_per_token: float | None
    tpot_s: float | None
    protocol: str | None = None
    """The side-channel protocol versions it speaks (``4..5``), null while unknown."""


class Instance:
    """Mutable per-instance state; policies see it through ``InstanceView`` only."""

    def __init__(self, spec: InstanceSpec, cfg: ProxyConfig) -> None:
        self.url = spec.key
        self.role = spec.role
        self.state = State.ACTIVE
        self.healthy = False  # until the first probe answers
        self.probed = False
        self.probed_unhealthy = False  # found unhealthy once: a later recovery is news
        self.ok_streak = 0
        self.fail_streak = 0
        self.last_probe_error: str | None = "not probed yet"
        self.last_probe_dead = False
        self.breaker = CircuitBreaker(self.url, cfg.breaker.failure_threshold, cfg.breaker.open_s)
        self._in_flight = {Side.PREFILL: 0, Side.DECODE: 0}
        self._tokens = {Side.PREFILL: 0, Side.DECODE: 0}
        self.requests = {Side.PREFILL: 0, Side.DECODE: 0}
        self.errors = {Side.PREFILL: 0, Side.DECODE: 0}
        self.retries = {Side.PREFILL: 0, Side.DECODE: 0}
        self.vllm_waiting = 0.0
        self.vllm_running = 0.0
        self.vllm_others = 0.0
        """Requests vLLM held at the last scrape beyond this proxy's legs (prefill and decode):
        other clients' (another proxy's, a direct caller's). Our own leg caught waiting by a
        scrape is not one: read raw, it kept an idle prefill "busy" until the next probe."""
        self.recomputed: dict[str, float] = {}
        """The instance's vllm:kvdisagg_recomputed_prompts_total by reason, as last scraped."""
        self.prefill_s_per_token: float | None = None
        self.tpot_s: float | None = None
        self.tpot_load = 0.0
        self.local_prefills = 0
        """Decode legs computing their prompt here (sent, no first byte yet; legs.LegScope)."""
        self.local_prefill_tokens = 0
        """The prompt tokens those legs compute (predicted)."""
        self.handoff_params: bytes | None = None
        self.max_model_len: int | None = None  # from /v1/models, once (first_token.py)
        """Prefill: the kv_transfer_params of its last handoff (early.py builds from them)."""
        self.protocol: Versions | None = None
        """The side-channel protocol versions it speaks, as last seen (None: unknown)."""
        self.idle = asyncio.Event()
        self.idle.set()
        self.pool = Pool(self.url)
        self.retiring = False  # DRAINING because the instance itself said it is retiring
        self.on_recovered: Callable[[Instance], None] = lambda inst: None

    # InstanceView
    def in_flight(self, side: Side) -> int:
        return self._in_flight[side]

    def in_flight_tokens(self, side: Side) -> int:
        return self._tokens[side]

    # bookkeeping for one leg
    def start(self, side: Side, tokens: int) -> None:
        self._in_flight[side] += 1
        self._tokens[side] += tokens
        self.requests[side] += 1
        self.breaker.on_start()
        self.idle.clear()

    def finish(self, side: Side, tokens: int, outcome: Outcome) -> None:
        self._in_flight[side] -= 1
        self._tokens[side] -= tokens
        if outcome is Outcome.OK:
            self.breaker.on_success()
        elif outcome is Outcome.BROKEN:
            self.errors[side] += 1
            self.breaker.on_failure()
        else:
            self.errors[side] += outcome is Outcome.NEUTRAL
            self.breaker.trial_in_flight = False
        if not self._in_flight[Side.PREFILL] and not self._in_flight[Side.DECODE]:
            self.idle.set()

    def observe_prefill(self, seconds: float, tokens: int) -> None:
        spt = seconds / max(1, tokens)
        old = self.prefill_s_per_token
        self.prefill_s_per_token = spt if old is None else old + _EWMA * (spt - old)

    def observe_tpot(self, tpot: float) -> None:
        load = float(self._in_flight[Side.DECODE])
        if self.tpot_s is None:
            self.tpot_s, self.tpot_load = tpot, load
        else:
            self.tpot_s += _EWMA * (tpot - self.tpot_s)
            self.tpot_load += _EWMA * (load - self.tpot_load)

    @property
    def up(self) -> bool:
        """What /metrics and /admin/list report as healthy."""
        return self.healthy and self.breaker.state is not BreakerState.OPEN

    def info(self) -> InstanceInfo:
        sides = (Side.PREFILL, Side.DECODE)
        return InstanceInfo(
            url=self.url, role=self.role.value, state=self.state.value, healthy=self.up,
            breaker=self.breaker.state.value, last_probe_error=self.last_probe_error,
            in_flight={s.value: self._in_flight[s] for s in sides},
            in_flight_tokens={s.value: self._tokens[s] for s in sides},
            requests={s.value: self.requests[s] for s in sides},
            errors={s.value: self.errors[s] for s in sides},
            retries={s.value: self.retries[s] for s in sides},
            vllm_waiting=self.vllm_waiting, vllm_running=self.vllm_running,
            recomputed_prompts=dict(self.recomputed),
            prefill_s_per_token=self.prefill_s_per_token, tpot_s=self.tpot_s,
            protocol=None if self.protocol is None else str(self.protocol))

    # active probes
    def probe_result(self, ok: bool, error: str | None, cfg: ProxyConfig,
                     dead: bool = True) -> None:
        """Hysteresis; the very first result sets the state directly (start-up is not delayed).
        ``dead``: the failure shows the instance gone (refused, reset, an error status), not
        merely slow; only then do legs already waiting on it fail over."""
        self.last_probe_error, self.last_probe_dead = error, dead and not ok
        if ok:
            self.ok_streak += 1
            self.fail_streak = 0
        else:
            self.fail_streak += 1
            self.ok_streak = 0
        if not self.probed:
            self.probed = True
            self._set_healthy(ok)
        elif ok and not self.healthy and self.ok_streak >= cfg.health.success_threshold:
            self._set_healthy(True)
        elif not ok and self.healthy and self.fail_streak >= cfg.health.failure_threshold:
            self._set_healthy(False)
        if not self.healthy and self.last_probe_dead:
            self._fail_legs_on_a_dead_instance()

    def _fail_legs_on_a_dead_instance(self) -> None:
        """An unhealthy instance whose probe shows it gone: the legs waiting on it fail now
        (and migrate or retry) instead of waiting out their timeouts. Checked at every such
        probe, not only when it turns unhealthy: an instance first found slow (probes timing
        out) and then gone kept its waiting legs for their whole timeouts. A slow
        instance still answers the legs it has, so only a dead one fails them. A retiring one's
        streams fail too: its drain has ended (vLLM killed its engine at --shutdown-timeout and
        stopped listening), so they would stall for good."""
        self.pool.fail_waiting(f"{self.url} turned unhealthy ({self.last_probe_error})",
                               streams=self.retiring)

    def _set_healthy(self, healthy: bool) -> None:
        if healthy != self.healthy:
            (log.info if healthy else log.warning)(
                "instance %s (%s) is now %s%s",
                self.url,
                self.role.value,
                "healthy" if healthy else "unhealthy",
                "" if healthy else f": {self.last_probe_error}",
            )
        recovered = healthy and not self.healthy and self.probed_unhealthy
        self.probed_unhealthy = self.probed_unhealthy or not healthy
        self.healthy = healthy
        if recovered:
            self.on_recovered(self)
        if healthy:
            self.breaker.reset()


_WAITING, _RUNNING = "vllm:num_requests_waiting", "vllm:num_requests_running"
_RECOMPUTED = "vllm:kvdisagg_recomputed_prompts_total"
_PROTOCOL_MAX = "vllm:kvdisagg_protocol_version"
_PROTOCOL_MIN = "vllm:kvdisagg_protocol_version_min"
_RETIRING = "vllm:kvdisagg_retiring"
PROBED = (_WAITING, _RUNNING, _RECOMPUTED, _PROTOCOL_MAX, _RETIRING)
"""Name prefixes of the samples a probe reads from vLLM's /metrics (``probe_samples``)."""


def probe_samples(text: bytes) -> list[Sample]:
    """The samples of vLLM's /metrics that a probe reads: one parse of the ``PROBED`` lines
    (a whole page, with vLLM's histograms, would take about 100 times longer on the proxy's
    loop). ValueError: not the exposition format."""
    return samples(text, PROBED)


def vllm_queue(found: list[Sample]) -> tuple[float, float]:
    """Sum vLLM's ``num_requests_waiting`` / ``num_requests_running`` gauges over engines."""
    waiting = running = 0.0
    for s in found:
        if s.name.startswith(_WAITING):
            waiting += s.value
        elif s.name.startswith(_RUNNING):
            running += s.value
    return waiting, running


def recomputed_by_reason(found: list[Sample]) -> dict[str, float]:
    """Sum ``vllm:kvdisagg_recomputed_prompts_total`` by its ``reason`` label over engines
    (connector/stats.py RECOMPUTED): requests that came with a handoff but whose prompt the
    instance computed itself."""
    out: dict[str, float] = {}
    for s in found:
        if s.name == _RECOMPUTED and "reason" in s.labels:
            out[s.labels["reason"]] = out.get(s.labels["reason"], 0.0) + s.value
    return out


def protocol_versions(found: list[Sample]) -> Versions | None:
    """The side-channel versions the instance speaks, from its ``vllm:kvdisagg_protocol_version``
    and ``vllm:kvdisagg_protocol_version_min`` gauges (connector/stats.py VERSION_GAUGES); over
    several engines, the versions all of them speak. None: it exports neither."""
    his = [int(s.value) for s in found if s.name == _PROTOCOL_MAX]
    los = [int(s.value) for s in found if s.name == _PROTOCOL_MIN]
    if not his:
        return None
    hi = min(his)
    return Versions(max(los) if los else hi, hi)


def is_retiring(found: list[Sample]) -> bool:
    """Whether any engine of the instance exports ``vllm:kvdisagg_retiring`` 1."""
    return any(s.value > 0 for s in found if s.name.startswith(_RETIRING))


class _HandoffExtras(msgspec.Struct):
    version: int | None = None
    min_version: int = 0


class _HandoffParams(msgspec.Struct):
    kvdisagg: _HandoffExtras | None = None


_handoff = msgspec.json.Decoder(_HandoffParams).decode


def handoff_versions(kv: bytes | None) -> Versions | None:
    """The versions a prefill speaks, from the raw ``kv_transfer_params`` of its handoff (the
    ``kvdisagg`` key's ``version`` and ``min_version``, protocol.HandoffExtras); None when they
    do not say (another connector, e.g. NixlConnector)."""
    if kv is None:
        return None
    try:
        extras = _handoff(kv).kvdisagg
    except msgspec.DecodeError:  # ValidationError included
        return None
    if extras is None or extras.version is None:
        return None
    return Versions(extras.min_version or extras.version, extras.version)


def accepts(decode: Instance, versions: Versions | None) -> bool:
    """Whether ``decode`` can pull a handoff of a prefill speaking ``versions``: a version in
    common, or either side unknown (paired as before versions were exported)."""
    mine = decode.protocol
    return mine is None or versions is None or mine.common(versions) is not None


def pairable(prefill: Instance, decode: Instance) -> bool:
    """Whether ``decode`` can pull from ``prefill`` (``accepts``, with prefill's versions as
    last seen)."""
    return accepts(decode, prefill.protocol)


class _ModelCard(msgspec.Struct):
    max_model_len: int | None = None


class _Models(msgspec.Struct):
    data: list[_ModelCard] = []


_models = msgspec.json.Decoder(_Models).decode


def parse_max_model_len(text: bytes) -> int | None:
    """The smallest ``max_model_len`` vLLM's ``/v1/models`` lists (None: not said)."""
    try:
        lens = [c.max_model_len for c in _models(text).data if c.max_model_len]
    except msgspec.DecodeError:  # ValidationError included
        return None
    return min(lens) if lens else None


class Registry:
    """The fleet; order is the order instances were added (round robin follows it)."""

    def __init__(self, cfg: ProxyConfig) -> None:
        self.cfg = cfg
        self.instances: dict[str, Instance] = {}
        self._cache: dict[Side, list[Instance]] = {}
        self._task: asyncio.Task[None] | None = None
        self.listeners: list[Callable[[MemberEvent, Instance], None]] = []
        """Told of every instance added, removed or recovered (the cache index follows)."""

    def _tell(self, event: MemberEvent, inst: Instance) -> None:
        for listener in self.listeners:
            listener(event, inst)

    # membership
    def add(self, spec: InstanceSpec) -> Instance:
        if spec.key in self.instances:
            raise ValueError(f"instance {spec.key} is already in the fleet")
        inst = Instance(spec, self.cfg)
        inst.on_recovered = lambda i: self._tell(MemberEvent.RECOVERED, i)
        self.instances[inst.url] = inst
        self._cache.clear()
        log.info("added %s instance %s", inst.role.value, inst.url)
        self._tell(MemberEvent.ADDED, inst)
        return inst

    def get(self, url: str) -> Instance:
        try:
            return self.instances[url.rstrip("/")]
        except KeyError:
            raise KeyError(f"no instance {url.rstrip('/')} in the fleet") from None

    async def drain(self, url: str, timeout_s: float) -> bool:
        """Stop new work on ``url`` and wait (bounded) for its in-flight legs; True if idle."""
        inst = self.get(url)
        inst.state = State.DRAINING
        self._cache.clear()
        log.info("draining %s (%d legs in flight)", inst.url,
                 inst.in_flight(Side.PREFILL) + inst.in_flight(Side.DECODE))
        try:
            async with asyncio.timeout(timeout_s):
                await inst.idle.wait()
        except TimeoutError:
            return False
        return True

    def undrain(self, url: str) -> Instance:
        inst = self.get(url)
        inst.state, inst.retiring = State.ACTIVE, False
        self._cache.clear()
        return inst

    def remove(self, url: str) -> Instance:
        inst = self.get(url)
        del self.instances[inst.url]
        inst.state = State.REMOVED
        inst.pool.close()  # idle connections go; legs in flight finish, then close theirs
        self._cache.clear()
        log.info("removed instance %s", inst.url)
        self._tell(MemberEvent.REMOVED, inst)
        return inst

    def members(self, side: Side) -> list[Instance]:
        """Every instance that may serve ``side`` (whatever its health), registry order."""
        m = self._cache.get(side)
        if m is None:
            want = Role.PREFILL if side is Side.PREFILL else Role.DECODE
            m = self._cache[side] = [i for i in self.instances.values()
                                     if i.state is State.ACTIVE and i.role.serves(want)]
        return m

    def candidates(self, side: Side, exclude: tuple[Instance, ...] = ()) -> list[Instance]:
        """Routable instances of ``side``; if breakers alone leave none, the healthy ones."""
        live = [i for i in self.members(side) if i.healthy]
        cands = [i for i in live if i.breaker.can_execute()] or live
        return [i for i in cands if i not in exclude]

    # probes
    async def probe(self, inst: Instance) -> None:
        cfg = self.cfg.health
        dead = False
        try:
            resp = await inst.pool.request(b"GET", "/health", connect_s=cfg.timeout_s,
                                           headers_s=cfg.timeout_s)
            await resp.read(cfg.timeout_s)
            ok = resp.status == 200
            error, dead = (None, False) if ok else (f"/health returned {resp.status}", True)
        except UpstreamTimeout as exc:  # slow (a starved host): not known dead
            ok, error = False, f"/health: {exc}"
        except UpstreamError as exc:  # refused, reset: the process is gone
            ok, error, dead = False, f"/health: {exc}", True
        if ok and cfg.scrape_metrics:  # load gauges only: a slow /metrics is not a failure
            try:
                mine = inst.in_flight(Side.PREFILL) + inst.in_flight(Side.DECODE)
                resp = await inst.pool.request(b"GET", "/metrics", connect_s=cfg.timeout_s,
                                               headers_s=cfg.timeout_s)
                text = await resp.read(cfg.timeout_s)
                if resp.status == 200:
                    found = probe_samples(text)
                    inst.vllm_waiting, inst.vllm_running = vllm_queue(found)
                    # Discounted by the most of our own legs it may have counted: a leg that
                    # ended during the scrape must not read as another client's for a probe
                    # interval (it blocked prefill_busy right after a burst).
                    mine = max(mine, inst.in_flight(Side.PREFILL) + inst.in_flight(Side.DECODE))
                    inst.vllm_others = max(0.0, inst.vllm_waiting + inst.vllm_running - mine)
                    inst.recomputed = recomputed_by_reason(found)
                    if (versions := protocol_versions(found)) is not None:
                        inst.protocol = versions
                    self.follow_retiring(inst, is_retiring(found))
            except (UpstreamError, ValueError):  # ValueError: not the exposition format
                pass
        if ok and inst.max_model_len is None:
            try:
                resp = await inst.pool.request(b"GET", "/v1/models", connect_s=cfg.timeout_s,
                                               headers_s=cfg.timeout_s)
                text = await resp.read(cfg.timeout_s)
                if resp.status == 200:
                    inst.max_model_len = parse_max_model_len(text)
            except UpstreamError:
                pass
        inst.probe_result(ok, error, self.cfg, dead=dead)

    def follow_retiring(self, inst: Instance, retiring: bool) -> None:
        """An instance that says it is retiring drains; one that no longer says so (a new
        process at its URL) is ACTIVE again, unless an operator drained it."""
        if retiring and inst.state is State.ACTIVE:
            inst.state, inst.retiring = State.DRAINING, True
            log.warning("instance %s (%s) is retiring: draining it (%d legs in flight)",
                        inst.url, inst.role.value,
                        inst.in_flight(Side.PREFILL) + inst.in_flight(Side.DECODE))
        elif not retiring and inst.retiring and inst.state is State.DRAINING:
            inst.state, inst.retiring = State.ACTIVE, False
            log.info("instance %s (%s) is no longer retiring", inst.url, inst.role.value)
        else:
            return
        self._cache.clear()

    async def probe_all(self) -> None:
        insts = list(self.instances.values())
        if insts:
            await asyncio.gather(*(self.probe(i) for i in insts))

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.health.interval_s)
            try:
                await self.probe_all()
            except Exception:  # a probe bug must not stop health checking
                log.exception("health probe round failed")

    async def start(self) -> None:
        """Probe until a decode instance is up or ``startup_timeout_s`` passes, then keep
        probing."""
        deadline = time.monotonic() + self.cfg.health.startup_timeout_s
        while True:
            await self.probe_all()
            if self.candidates(Side.DECODE) and (self.candidates(Side.PREFILL)
                                                 or self.cfg.retry.decode_only_fallback):
                break
            if time.monotonic() >= deadline:
                down = [i.url for i in self.instances.values() if not i.healthy]
                log.warning("serving although instances are down after %.0fs: %s",
                            self.cfg.health.startup_timeout_s, down)
                break
            await asyncio.sleep(min(0.5, self.cfg.health.interval_s))
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for inst in self.instances.values():
            inst.pool.close()
