"""Discrete-event simulator of prefill, decode and colocated instances (DistServe's model).

```
 arrival ──► least-loaded prefill ──► [prefill batch: FCFS, prompt tokens <= budget, KV room]
                                             │ pp stages, several batches in flight
                                             ▼ prefill_end (TTFT in DistServe's definition)
             least-loaded decode ◄──────────┘
   [pending: wait for KV room] ─► [KV transfer: bytes/token / link bandwidth, one link per decode]
                                             ▼
             [continuous batching: every step takes all ready requests; pp groups in flight]
                                             ▼ finish after `steps` decode iterations
```

A colocated instance (the vLLM baseline) runs one iteration at a time: a prefill batch whenever
prompts are waiting and the KV cache has room (prefill-prioritised, no mixing), else a decode step
over all running requests.

Speed: a decode step costs O(1) whatever the batch size. A group of requests that step together
keeps aggregates (batch size, sum of context lengths) and buckets requests by the group iteration
at which they finish, so only arrivals, joins and exits touch a request. When a lone group would
step with nothing else happening until the next event or exit, those steps are jumped over in
closed form (their times are an arithmetic series), so light load costs no more than heavy load.
Thousands of requests simulate in tens of milliseconds. Deterministic: no randomness inside; ties
are broken by an event sequence number. Must not import ``vllm``.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence
from typing import NamedTuple, cast

import numpy as np

from kvdisagg.planner.latency import LatencyModel
from kvdisagg.planner.trace import Requests

_UNBOUNDED = 1 << 62


def _through_stages(stage_free: list[float], t: float, first: float, other: float) -> float:
    """Run one batch through a pipeline starting at ``t``: stage 0 takes ``first``, each later
    stage ``other``; each stage starts when the batch reaches it and the stage is free.
    Updates ``stage_free`` in place and returns when the last stage finishes."""
    end = max(t, stage_free[0]) + first
    stage_free[0] = end
    for k in range(1, len(stage_free)):
        end = max(end, stage_free[k]) + other
        stage_free[k] = end
    return end


class Timeline(NamedTuple):
    """Per-request times (s); ``first`` is the end of the first decode step (nan if none)."""

    arrival: np.ndarray
    prefill_end: np.ndarray
    first: np.ndarray
    finish: np.ndarray
    steps: np.ndarray


class _Group:
    """Requests stepping together through a decode pipeline; aggregates only."""

    __slots__ = ("it", "batch", "sum_ctx1", "finish", "joined")

    def __init__(self) -> None:
        self.it = 0
        self.batch = 0
        self.sum_ctx1 = 0
        self.finish: dict[int, list[int]] = {}
        self.joined: list[int] = []

    def absorb(self, other: _Group) -> None:
        off = self.it - other.it
        for k, reqs in other.finish.items():
            mine = self.finish.get(k + off)
            if mine is None:
                self.finish[k + off] = reqs
            else:
                mine.extend(reqs)
        self.batch += other.batch
        self.sum_ctx1 += other.sum_ctx1
        self.joined.extend(other.joined)


class _Sim:
    """Shared event loop state; instances push events through ``push``."""

    def __init__(self, req: Requests, steps: np.ndarray) -> None:
        n = len(req.arrival)
        self.plen = req.prompt.tolist()
        self.steps = steps.tolist()
        self.arrival = req.arrival.tolist()
        self.prefill_end = [math.nan] * n
        self.first = [math.nan] * n
        self.finish = [math.nan] * n
        self.heap: list[tuple[float, int, object, int, object]] = []
        self.seq = 0
        self.next_arrival = 0  # index of the next request to arrive

    def push(self, t: float, handler: object, kind: int, arg: object = None) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, handler, kind, arg))

    def next_time(self) -> float:
        """Time of the next event anywhere (arrival or queued); nothing changes before it."""
        t = self.heap[0][0] if self.heap else math.inf
        i = self.next_arrival
        return min(t, self.arrival[i]) if i < len(self.arrival) else t

    def run(self, arrive: object) -> None:
        heap, arrival = self.heap, self.arrival
        n = len(arrival)
        while self.next_arrival < n or heap:
            i = self.next_arrival
            if i < n and (not heap or arrival[i] <= heap[0][0]):
                self.next_arrival = i + 1
                arrive(i, arrival[i])  # type: ignore[operator]
                continue
            t, _, handler, kind, arg = heapq.heappop(heap)
            handler.on_event(t, kind, arg)  # type: ignore[attr-defined]


def _skip_steps(model: LatencyModel, g: _Group, t: float, horizon: float) -> tuple[int, float]:
    """How many decode steps of ``g`` alone can run from ``t`` with no visible effect.

    A step is invisible when it ends before ``horizon`` (the next event anywhere, which might add
    a request) and nobody finishes at its end. Step ``k`` takes ``c0 + c1*(S + k*B)``, so the
    end of ``m`` steps is quadratic in ``m``: solve it, then fix rounding by one. Returns
    ``(m, time after m steps)``.
    """
    n_free = min(g.finish) - g.it - 1
    if n_free <= 0 or horizon <= t:
        return 0, t
    c0, c1 = model.decode_linear_s(g.batch)
    d0, inc = c0 + c1 * g.sum_ctx1, c1 * g.batch

    def end(m: int) -> float:
        return t + m * d0 + inc * m * (m - 1) / 2

    budget = horizon - t
    if math.isinf(budget):
        m = n_free
    elif inc > 0:
        a, b = inc / 2, d0 - inc / 2
        m = int((-b + math.sqrt(b * b + 4 * a * budget)) / (2 * a)) if a > 0 else n_free
    else:
        m = int(budget / d0) if d0 > 0 else n_free
    m = max(0, min(m, n_free))
    while m > 0 and end(m) >= horizon:
        m -= 1
    while m < n_free and end(m + 1) < horizon:
        m += 1
    return m, end(m)


# Event kinds.
_STAGE0_FREE, _BATCH_DONE, _XFER_DONE = 0, 1, 2


class _Prefill:
    """A prefill instance: FCFS batches by token budget; holds KV until decode has pulled it."""

    def __init__(
        self, sim: _Sim, model: LatencyModel, budget: int, capacity: int, route: object
    ) -> None:
        self.sim, self.model, self.budget, self.capacity = sim, model, budget, capacity
        self.route = route  # callable(t, i, src) -> None, or None for prefill-only runs
        self.queue: deque[int] = deque()
        self.stage_free = [0.0] * model.pp
        self.kv = 0  # tokens in flight or held for decode
        self.load = 0  # queued + in-progress requests (the dispatch metric)

    def submit(self, t: float, i: int) -> None:
        self.queue.append(i)
        self.load += 1
        self.try_start(t)

    def try_start(self, t: float) -> None:
        if self.stage_free[0] > t or not self.queue:
            return
        plen, q = self.sim.plen, self.queue
        batch: list[int] = []
        tok = sq = 0
        while q:
            p = plen[q[0]]
            if batch and tok + p > self.budget:
                break
            if self.kv + tok + p > self.capacity and (batch or self.kv):
                break  # no KV room: wait for decode to pull (or take one alone if empty)
            batch.append(q.popleft())
            tok += p
            sq += p * p
        if not batch:
            return
        self.kv += tok
        first, other = self.model.prefill_stages_s(tok, sq)
        end = _through_stages(self.stage_free, t, first, other)
        self.sim.push(end, self, _BATCH_DONE, batch)
        if len(self.stage_free) > 1:
            self.sim.push(self.stage_free[0], self, _STAGE0_FREE)

    def release(self, t: float, tokens: int) -> None:
        self.kv -= tokens
        self.try_start(t)

    def on_event(self, t: float, kind: int, arg: object) -> None:
        if kind == _BATCH_DONE:
            sim = self.sim
            for i in arg:  # type: ignore[attr-defined]
                sim.prefill_end[i] = t
                self.load -= 1
                if self.route is None:
                    sim.finish[i] = t
                    self.kv -= sim.plen[i]
                else:
                    self.route(t, i, self)  # type: ignore[operator]
        self.try_start(t)


class _Decode:
    """A decode instance: admits by KV room, pulls KV over its link, continuous batching."""

    def __init__(self, sim: _Sim, model: LatencyModel, capacity: int, xfer_s_per_token: float,
                 max_batch: int = _UNBOUNDED) -> None:
        self.sim, self.model, self.capacity, self.max_batch = sim, model, capacity, max_batch
        self.xfer = xfer_s_per_token
        self.link_free = 0.0
        self.pending: deque[tuple[int, _Prefill | None]] = deque()
        self.newcomers: list[int] = []
        self.ready: list[_Group] = []
        self.stage_free = [0.0] * model.pp
        self.inflight = 0  # groups in the pipeline
        self.wake = False  # a _STAGE0_FREE event is queued
        self.kv = 0
        self.load = 0

    def submit(self, t: float, i: int, src: _Prefill | None) -> None:
        self.pending.append((i, src))
        self.load += 1
        self.admit(t)

    def admit(self, t: float) -> None:
        sim, pending = self.sim, self.pending
        started = False
        while pending:
            if self.load - len(pending) >= self.max_batch:
                break  # the batch cap: admitted (loading or decoding) requests only
            i, src = pending[0]
            p = sim.plen[i]
            if self.kv + p > self.capacity and self.kv > 0:
                break
            pending.popleft()
            self.kv += p
            dur = p * self.xfer
            if dur > 0:
                start = max(t, self.link_free)
                self.link_free = start + dur
                sim.push(self.link_free, self, _XFER_DONE, (i, src))
            else:
                self._arrived(t, i, src)
                started = True
        if started:
            self.try_start(t)

    def _arrived(self, t: float, i: int, src: _Prefill | None) -> None:
        if src is not None:
            src.release(t, self.sim.plen[i])
        if self.sim.steps[i] <= 0:
            self.sim.finish[i] = t
            self.kv -= self.sim.plen[i]
            self.load -= 1
        else:
            self.newcomers.append(i)

    def try_start(self, t: float) -> None:
        if not (self.ready or self.newcomers):
            return
        if self.stage_free[0] > t:
            if not self.wake:  # wake up when stage 0 frees (only when work waits)
                self.wake = True
                self.sim.push(self.stage_free[0], self, _STAGE0_FREE)
            return
        groups = self.ready
        if groups:
            groups.sort(key=lambda g: -g.batch)
            g = groups[0]
            for rest in groups[1:]:
                g.absorb(rest)
            self.ready = []
        else:
            g = _Group()
        if not self.newcomers and not g.joined and self.inflight == 0:
            m, t_skip = _skip_steps(self.model, g, t, self.sim.next_time())
            if m:
                g.it += m
                g.sum_ctx1 += g.batch * m
                self.kv += g.batch * m
                t = t_skip
                self.stage_free = [t] * len(self.stage_free)
        if self.newcomers:
            plen, steps = self.sim.plen, self.sim.steps
            for i in self.newcomers:
                k = g.it + steps[i]
                bucket = g.finish.get(k)
                if bucket is None:
                    g.finish[k] = [i]
                else:
                    bucket.append(i)
                g.batch += 1
                g.sum_ctx1 += plen[i] + 1
            g.joined.extend(self.newcomers)
            self.newcomers = []
        first, other = self.model.decode_stages_s(g.batch, g.sum_ctx1)
        end = _through_stages(self.stage_free, t, first, other)
        self.inflight += 1
        self.sim.push(end, self, _BATCH_DONE, g)

    def on_event(self, t: float, kind: int, arg: object) -> None:
        if kind == _BATCH_DONE:
            g: _Group = arg  # type: ignore[assignment]
            sim = self.sim
            self.inflight -= 1
            g.it += 1
            g.sum_ctx1 += g.batch
            self.kv += g.batch
            for i in g.joined:
                sim.first[i] = t
            g.joined = []
            done = g.finish.pop(g.it, None)
            if done:
                plen, steps = sim.plen, sim.steps
                for i in done:
                    sim.finish[i] = t
                    g.batch -= 1
                    g.sum_ctx1 -= plen[i] + steps[i] + 1
                    self.kv -= plen[i] + steps[i]
                    self.load -= 1
                self.admit(t)
            if g.batch > 0:
                self.ready.append(g)
        elif kind == _XFER_DONE:
            i, src = cast("tuple[int, _Prefill | None]", arg)
            self._arrived(t, i, src)
        else:
            self.wake = False
        self.try_start(t)


class _Colocated:
    """A colocated instance (vLLM baseline): prefill-prioritised, one iteration at a time, pp=1."""

    def __init__(self, sim: _Sim, model: LatencyModel, budget: int, capacity: int,
                 max_batch: int = _UNBOUNDED) -> None:
        self.sim, self.model, self.budget, self.capacity = sim, model, budget, capacity
        self.max_batch = max_batch
        self.queue: deque[int] = deque()
        self.group = _Group()
        self.busy = False
        self.kv = 0
        self.load = 0

    def submit(self, t: float, i: int) -> None:
        self.queue.append(i)
        self.load += 1
        self.step(t)

    def step(self, t: float) -> None:
        if self.busy:
            return
        sim, q, g = self.sim, self.queue, self.group
        batch: list[int] = []
        tok = sq = 0
        while q and g.batch + len(batch) < self.max_batch:
            p = sim.plen[q[0]]
            if batch and tok + p > self.budget:
                break
            if self.kv + tok + p > self.capacity and (batch or self.kv):
                break
            batch.append(q.popleft())
            tok += p
            sq += p * p
        if batch:
            self.kv += tok
            self.busy = True
            sim.push(t + self.model.prefill_s(tok, sq), self, 0, batch)
        elif g.batch > 0:
            if not g.joined and not q:
                m, t_skip = _skip_steps(self.model, g, t, sim.next_time())
                if m:
                    g.it += m
                    g.sum_ctx1 += g.batch * m
                    self.kv += g.batch * m
                    t = t_skip
            self.busy = True
            sim.push(t + self.model.decode_s(g.batch, g.sum_ctx1), self, 1, None)

    def on_event(self, t: float, kind: int, arg: object) -> None:
        self.busy = False
        sim, g = self.sim, self.group
        plen, steps = sim.plen, sim.steps
        if kind == 0:
            for i in arg:  # type: ignore[attr-defined]
                sim.prefill_end[i] = t
                if steps[i] <= 0:
                    sim.finish[i] = t
                    self.kv -= plen[i]
                    self.load -= 1
                    continue
                k = g.it + steps[i]
                g.finish.setdefault(k, []).append(i)
                g.batch += 1
                g.sum_ctx1 += plen[i] + 1
                g.joined.append(i)
        else:
            g.it += 1
            g.sum_ctx1 += g.batch
            self.kv += g.batch
            for i in g.joined:
                sim.first[i] = t
            g.joined = []
            for i in g.finish.pop(g.it, ()):
                sim.finish[i] = t
                g.batch -= 1
                g.sum_ctx1 -= plen[i] + steps[i] + 1
                self.kv -= plen[i] + steps[i]
                self.load -= 1
        self.step(t)


class SimInstance(NamedTuple):
    """One instance to simulate: its latency model and KV capacity / prefill token budget."""

    model: LatencyModel
    capacity: int | None = None
    """KV-cache tokens; None: unbounded."""
    prefill_budget: int | None = None
    """Max prompt tokens per prefill batch; None: the capacity (DistServe)."""
    max_batch: int | None = None
    """Most requests decoding at once (SloScheduler's TPOT cap, ``decode_batch_cap()``);
    None: bounded by KV capacity only. Ignored by prefill instances."""

    def budget(self) -> int:
        b = self.prefill_budget if self.prefill_budget is not None else self.capacity
        return b if b is not None else _UNBOUNDED

    def cap(self) -> int:
        return self.capacity if self.capacity is not None else _UNBOUNDED

    def batch_cap(self) -> int:
        return self.max_batch if self.max_batch is not None else _UNBOUNDED


def _finish(sim: _Sim, steps: np.ndarray) -> Timeline:
    return Timeline(np.asarray(sim.arrival), np.asarray(sim.prefill_end), np.asarray(sim.first),
                    np.asarray(sim.finish), steps)


def simulate_disaggregated(
    req: Requests,
    prefill: Sequence[SimInstance],
    decode: Sequence[SimInstance],
    *,
    kv_bytes_per_token: int = 0,
    link_bytes_per_s: float = math.inf,
    steps: np.ndarray | None = None,
) -> Timeline:
    """Disaggregated fleet. With no prefill instances requests arrive at decode with their KV
    (``prefill_end`` = arrival); with no decode instances they finish at prefill end: the
    single-phase runs of the high-affinity search."""
    if not prefill and not decode:
        raise ValueError("simulate_disaggregated needs at least one instance")
    st = req.output if steps is None else steps
    sim = _Sim(req, st)
    xfer = (
        kv_bytes_per_token / link_bytes_per_s
        if kv_bytes_per_token and math.isfinite(link_bytes_per_s)
        else 0.0
    )
    decs = [_Decode(sim, s.model, s.cap(), xfer, s.batch_cap()) for s in decode]

    def route(t: float, i: int, src: _Prefill | None) -> None:
        best = min(decs, key=lambda d: d.load)
        best.submit(t, i, src)

    pres = [_Prefill(sim, s.model, s.budget(), s.cap(), route if decs else None) for s in prefill]
    if pres:
        def arrive(i: int, t: float) -> None:
            min(pres, key=lambda p: p.load).submit(t, i)
    else:
        def arrive(i: int, t: float) -> None:
            sim.prefill_end[i] = t
            route(t, i, None)
    sim.run(arrive)
    return _finish(sim, st)


def simulate_colocated(req: Requests, instances: Sequence[SimInstance], *,
                       steps: np.ndarray | None = None) -> Timeline:
    """Colocated instances (each prefill-prioritised), requests to the least-loaded one."""
    if not instances:
        raise ValueError("simulate_colocated needs at least one instance")
    st = req.output if steps is None else steps
    sim = _Sim(req, st)
    cols = [_Colocated(sim, s.model, s.budget(), s.cap(), s.batch_cap()) for s in instances]

    def arrive(i: int, t: float) -> None:
        min(cols, key=lambda c: c.load).submit(t, i)

    sim.run(arrive)
    return _finish(sim, st)
