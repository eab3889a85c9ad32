"""The proxy's Prometheus metrics, SLO attainment and live goodput (names in docs/proxy.md).

Why not prometheus_client: its labelled children take a lock and a dict lookup per update and
its registry is process-global (two apps in one test process collide). The proxy runs on one
event loop, so plain dicts and lists are enough and cost a few hundred nanoseconds per update;
the text is rendered only when scraped. Per-instance gauges are read from the registry at
scrape time, so they cannot drift from the state routing uses.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from kvdisagg.proxy.config import SloConfig
from kvdisagg.proxy.fleet.registry import Registry
from kvdisagg.proxy.types import Side

if TYPE_CHECKING:
    from kvdisagg.proxy.routing.cache_index import CacheIndex

P = "kvdisagg_proxy_"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Histogram:
    __slots__ = ("name", "help", "bounds", "counts", "sum", "count")

    def __init__(self, name: str, help_: str, bounds: Iterable[float]) -> None:
        self.name, self.help = name, help_
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, v)] += 1
        self.sum += v
        self.count += 1

    def render(self, out: list[str]) -> None:
        out.append(f"# HELP {self.name} {self.help}\n# TYPE {self.name} histogram\n")
        acc = 0
        for b, c in zip(self.bounds, self.counts):
            acc += c
            out.append(f'{self.name}_bucket{{le="{b}"}} {acc}\n')
        out.append(f'{self.name}_bucket{{le="+Inf"}} {self.count}\n'
                   f"{self.name}_sum {self.sum}\n{self.name}_count {self.count}\n")


def _labels(**kv: str) -> str:
    return "{" + ",".join(f'{k}="{_esc(v)}"' for k, v in kv.items()) + "}"


def _esc(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class Metrics:
    def __init__(self, slo: SloConfig, clock=time.monotonic) -> None:
        self.slo = slo
        self.clock = clock
        self.started = clock()
        self.in_flight = 0
        self.requests: dict[tuple[str, str], int] = {}
        self.errors: dict[tuple[str, str, str], int] = {}
        self.missing_kv: dict[str, int] = {}
        self.routes: dict[tuple[str, str], int] = {}
        self.migrations: dict[str, int] = {}
        self.early: dict[str, int] = {}
        self.early_declines: dict[str, int] = {}
        self.first_tokens: dict[str, int] = {}
        self.predicted_hits: dict[str, int] = {}
        # the cache index (app.py sets it), for its per-instance gauges
        self.cache: CacheIndex | None = None
        self.rejections: dict[str, int] = {}
        self.discovery_errors: dict[tuple[str, str], int] = {}
        self.ttft = Histogram(P + "ttft_seconds", "Time to first token (streaming).",
                              LATENCY_BUCKETS)
        self.tpot = Histogram(P + "tpot_seconds", "Mean time per output token after the first.",
                              TPOT_BUCKETS)
        self.e2e = Histogram(P + "e2e_seconds", "End-to-end latency of successful requests.",
                             LATENCY_BUCKETS)
        self.handoff = Histogram(P + "handoff_seconds", "Prefill leg until kv_transfer_params.",
                                 LATENCY_BUCKETS)
        self.decode_first_token = Histogram(
            P + "decode_first_token_seconds", "Decode leg sent until its first token event "
            "(streaming): the KV pull, decode's first step and the relay.", LATENCY_BUCKETS)
        self.slo_requests = 0
        self.slo_met = {"ttft": 0, "tpot": 0, "both": 0}
        self._window: deque[tuple[float, bool, str]] = deque()

    # updates (hot path)
    def request_done(self, endpoint: str, outcome: str) -> None:
        k = (endpoint, outcome)
        self.requests[k] = self.requests.get(k, 0) + 1

    def leg_error(self, url: str, side: Side, kind: str) -> None:
        k = (url, side.value, kind)
        self.errors[k] = self.errors.get(k, 0) + 1

    def missing_kv_params(self, url: str) -> None:
        self.missing_kv[url] = self.missing_kv.get(url, 0) + 1

    def routed(self, route: str, reason: str) -> None:
        """A request (each prompt of a several-prompt one) served disaggregated (``pd``) or by
        decode alone (``decode_only``), and why."""
        k = (route, reason)
        self.routes[k] = self.routes.get(k, 0) + 1

    def early_handoff(self, outcome: str) -> None:
        """A decode leg sent together with its prefill leg (early.py): ``opened`` (decode
        answered), or ``fell_back`` (it failed: served the ordinary way)."""
        self.early[outcome] = self.early.get(outcome, 0) + 1

    def early_declined(self, reason: str) -> None:
        """A disaggregated request that may go out early went the ordinary way before sending
        anything (early.py, "When"), and why: an operator asking why early dispatch is rare
        reads it here."""
        self.early_declines[reason] = self.early_declines.get(reason, 0) + 1

    def first_token(self, outcome: str) -> None:
        """A disaggregated stream eligible for prefill's first token (first_token.py): ``sent``
        (the client got it when prefill answered), or ``ordinary`` (prefill's answer was no
        ordinary first token: decode gave it, after the handoff)."""
        self.first_tokens[outcome] = self.first_tokens.get(outcome, 0) + 1

    def predicted_hit(self, url: str, tokens: int) -> None:
        """Prompt tokens the index predicted ``url`` would reuse for a request sent there;
        compare with vLLM's own vllm:prefix_cache_hits_total on that instance."""
        self.predicted_hits[url] = self.predicted_hits.get(url, 0) + tokens

    def migration(self, outcome: str) -> None:
        """A stream whose decode failed mid-way: moved (``ok``), ended as it was
        (``finished``: its last token was delivered, only usage and [DONE] were owed), or not
        (``failed``, ``exhausted``: retry.migrations used up, ``impossible``: nothing to
        resume from)."""
        self.migrations[outcome] = self.migrations.get(outcome, 0) + 1

    def rejected(self, reason: str) -> None:
        self.rejections[reason] = self.rejections.get(reason, 0) + 1

    def discovery_error(self, side: str, source: str) -> None:
        k = (side, source)
        self.discovery_errors[k] = self.discovery_errors.get(k, 0) + 1

    def judge(self, decode_url: str, e2e: float, ttft: float | None, tpot: float | None,
              completion_tokens: int | None) -> bool:
        """Record one successful request against the SLO; True if it met both."""
        slo = self.slo
        if ttft is not None:
            ok_ttft = ttft <= slo.ttft_s
            ok_tpot = tpot is None or tpot <= slo.tpot_s
        else:  # non-streaming: only the total is known
            n = max(1, completion_tokens or 1)
            ok_ttft = ok_tpot = e2e <= slo.ttft_s + slo.tpot_s * (n - 1)
        both = ok_ttft and ok_tpot
        self.slo_requests += 1
        self.slo_met["ttft"] += ok_ttft
        self.slo_met["tpot"] += ok_tpot
        self.slo_met["both"] += both
        now = self.clock()
        w = self._window
        w.append((now, both, decode_url))
        cutoff = now - slo.window_s
        while w and w[0][0] < cutoff:
            w.popleft()
        return both

    # scrape
    def goodput(self) -> tuple[float, float, dict[str, float]]:
        """(attainment, goodput req/s, goodput per decode instance) over the sliding window."""
        now = self.clock()
        cutoff = now - self.slo.window_s
        w = self._window
        while w and w[0][0] < cutoff:
            w.popleft()
        span = max(1.0, min(self.slo.window_s, now - self.started))
        met = [u for _, ok, u in w if ok]
        per: dict[str, float] = {}
        for u in met:
            per[u] = per.get(u, 0.0) + 1.0
        attainment = len(met) / len(w) if w else 0.0
        return attainment, len(met) / span, {u: n / span for u, n in per.items()}

    def render(self, registry: Registry) -> str:
        out: list[str] = []
        add = out.append
        add(f"# TYPE {P}requests_total counter\n")
        for (ep, oc), n in sorted(self.requests.items()):
            add(f"{P}requests_total{_labels(endpoint=ep, outcome=oc)} {n}\n")
        add(f"# TYPE {P}in_flight gauge\n{P}in_flight {self.in_flight}\n")
        insts = list(registry.instances.values())
        for fam, kind in (("instance_in_flight", "gauge"), ("instance_requests_total", "counter"),
                          ("instance_retries_total", "counter")):
            add(f"# TYPE {P}{fam} {kind}\n")
            for inst in insts:
                for side in (Side.PREFILL, Side.DECODE):
                    v = (inst.in_flight(side) if fam == "instance_in_flight" else
                         inst.requests[side] if fam == "instance_requests_total" else
                         inst.retries[side])
                    add(f"{P}{fam}{_labels(instance=inst.url, side=side.value)} {v}\n")
        add(f"# HELP {P}instance_recomputed_prompts_total Requests that reached the instance "
            f"with a handoff but whose prompt it computed itself (its own "
            f"vllm:kvdisagg_recomputed_prompts_total as last probed; resets when it restarts), "
            f"by reason.\n# TYPE {P}instance_recomputed_prompts_total counter\n")
        for inst in insts:
            for reason, count in sorted(inst.recomputed.items()):
                add(f"{P}instance_recomputed_prompts_total"
                    f"{_labels(instance=inst.url, reason=reason)} {count}\n")
        add(f"# TYPE {P}instance_errors_total counter\n")
        for (url, side_name, kind), n in sorted(self.errors.items()):
            add(f"{P}instance_errors_total{_labels(instance=url, side=side_name, kind=kind)} {n}\n")
        add(f"# TYPE {P}instance_healthy gauge\n")
        for inst in insts:
            add(f"{P}instance_healthy{_labels(instance=inst.url, role=inst.role.value)} "
                f"{int(inst.up)}\n")
        add(f"# HELP {P}instance_protocol_version The side-channel protocol versions each "
            f"instance speaks (bound: min, max), as last seen (its "
            f"vllm:kvdisagg_protocol_version gauges, a prefill's handoff params); only "
            f"instances with a version in common are paired. Absent while unknown.\n"
            f"# TYPE {P}instance_protocol_version gauge\n")
        for inst in insts:
            if inst.protocol is not None:
                for bound, v in (("min", inst.protocol.lo), ("max", inst.protocol.hi)):
                    add(f"{P}instance_protocol_version"
                        f"{_labels(instance=inst.url, role=inst.role.value, bound=bound)} {v}\n")
        add(f"# TYPE {P}missing_kv_transfer_params_total counter\n")
        for url, n in sorted(self.missing_kv.items()):
            add(f"{P}missing_kv_transfer_params_total{_labels(instance=url)} {n}\n")
        add(f"# HELP {P}routed_total Requests served disaggregated (route=pd) or by decode "
            f"alone (route=decode_only), by reason.\n# TYPE {P}routed_total counter\n")
        for (route, reason), n in sorted(self.routes.items()):
            add(f"{P}routed_total{_labels(route=route, reason=reason)} {n}\n")
        add(f"# HELP {P}migrations_total Streams whose decode failed mid-way, by outcome "
            f"(ok: moved to another decode).\n# TYPE {P}migrations_total counter\n")
        for outcome, n in sorted(self.migrations.items()):
            add(f"{P}migrations_total{_labels(outcome=outcome)} {n}\n")
        add(f"# HELP {P}early_handoffs_total Decode legs sent together with their prefill "
            f"leg, by outcome (opened; fell_back: served the ordinary way).\n"
            f"# TYPE {P}early_handoffs_total counter\n")
        for outcome, n in sorted(self.early.items()):
            add(f"{P}early_handoffs_total{_labels(outcome=outcome)} {n}\n")
        add(f"# HELP {P}early_declined_total Disaggregated requests eligible for early "
            f"dispatch that took the ordinary handoff instead, by reason.\n"
            f"# TYPE {P}early_declined_total counter\n")
        for reason, n in sorted(self.early_declines.items()):
            add(f"{P}early_declined_total{_labels(reason=reason)} {n}\n")
        add(f"# HELP {P}first_tokens_from_prefill_total Disaggregated streams eligible for "
            f"prefill's first token, by outcome (sent: when prefill answered; ordinary: decode "
            f"gave it).\n# TYPE {P}first_tokens_from_prefill_total counter\n")
        for outcome, n in sorted(self.first_tokens.items()):
            add(f"{P}first_tokens_from_prefill_total{_labels(outcome=outcome)} {n}\n")
        add(f"# HELP {P}predicted_cached_tokens_total Prompt tokens the cache index "
            f"predicted each decode would reuse, over the requests sent to it (compare with "
            f"its vllm:prefix_cache_hits_total).\n"
            f"# TYPE {P}predicted_cached_tokens_total counter\n")
        for url, n in sorted(self.predicted_hits.items()):
            add(f"{P}predicted_cached_tokens_total{_labels(instance=url)} {n}\n")
        if self.cache is not None:
            _render_index(self.cache.status(), add)
        add(f"# HELP {P}rejected_total Requests turned away before any leg, with Retry-After.\n"
            f"# TYPE {P}rejected_total counter\n")
        for reason, n in sorted(self.rejections.items()):
            add(f"{P}rejected_total{_labels(reason=reason)} {n}\n")
        add(f"# HELP {P}discovery_errors_total Failed discovery lookups (last good answer kept).\n"
            f"# TYPE {P}discovery_errors_total counter\n")
        for (side_name, src), n in sorted(self.discovery_errors.items()):
            add(f"{P}discovery_errors_total{_labels(side=side_name, source=src)} {n}\n")
        for h in (self.ttft, self.tpot, self.e2e, self.handoff, self.decode_first_token):
            h.render(out)
        add(f"# TYPE {P}slo_requests_total counter\n{P}slo_requests_total {self.slo_requests}\n")
        add(f"# TYPE {P}slo_met_total counter\n")
        for k, n in self.slo_met.items():
            add(f"{P}slo_met_total{_labels(slo=k)} {n}\n")
        attainment, goodput, per = self.goodput()
        add(f"# HELP {P}slo_attainment Fraction meeting TTFT and TPOT SLOs, sliding window.\n"
            f"# TYPE {P}slo_attainment gauge\n{P}slo_attainment {attainment}\n")
        add(f"# HELP {P}goodput_rps Requests meeting both SLOs per second, sliding window.\n"
            f"# TYPE {P}goodput_rps gauge\n{P}goodput_rps {goodput}\n")
        add(f"# TYPE {P}instance_goodput_rps gauge\n")
        for inst in insts:
            if inst.role.serves(inst.role.DECODE):
                add(f"{P}instance_goodput_rps{_labels(instance=inst.url)} "
                    f"{per.get(inst.url, 0.0)}\n")
        return "".join(out)


_INDEX_COUNTERS = ("events", "gaps", "restarts", "replays", "replay_failures", "drops",
                   "invalid")


def _render_index(status: Iterable[Any], add: Any) -> None:
    """The cache index's per-instance state (cache_index.InstanceStatus)."""
    rows = list(status)
    add(f"# HELP {P}cache_index_live 1 while the index answers for the instance (its KV "
        f"events followed), else 0.\n# TYPE {P}cache_index_live gauge\n")
    for st in rows:
        add(f"{P}cache_index_live{_labels(instance=st.url, state=st.state.value)} "
            f"{int(st.state.value == 'live')}\n")
    add(f"# TYPE {P}cache_index_blocks gauge\n")
    for st in rows:
        add(f"{P}cache_index_blocks{_labels(instance=st.url)} {st.blocks}\n")
    for name in _INDEX_COUNTERS:
        add(f"# TYPE {P}cache_index_{name}_total counter\n")
        for st in rows:
            add(f"{P}cache_index_{name}_total{_labels(instance=st.url)} "
                f"{getattr(st.counters, name)}\n")
