"""What to send and when: prompt/output lengths (a distribution or a dataset file) and arrivals
(Poisson, evenly spaced, or a replayed trace), as a list of ``RequestSpec``s.

Runs at different rates reuse the same random draws scaled by the rate (common random
numbers), so an attainment-vs-rate curve is not jagged by resampling; only the prompt *content*
changes from run to run (``salt``), so an instance's prefix cache never turns a later run into
cache hits. Prompts are token ids by default: exact lengths, no tokenizer needed on the client.

The dataset file format is this module's (``parse_dataset``): the planner's traces
(planner/trace.py) read the same files through it. Imports nothing but the standard library.
"""

from __future__ import annotations

import csv
import json
import math
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, NamedTuple

Arrival = Literal["poisson", "constant"]

_WORDS = ("the cache block key value token prefill decode model layer attention server client "
          "request stream batch queue time data river mountain city question answer story").split()


class RequestSpec(NamedTuple):
    index: int  # type: ignore[assignment]  # a field named like tuple.index
    at_s: float  # arrival, relative to the run start
    prompt_len: int
    output_len: int
    prompt: list[int] | str


class RequestLengths(NamedTuple):
    prompt_len: int
    output_len: int
    prompt: str | list[int] | None = None  # a dataset's own prompt, sent as is
    timestamp: float | None = None  # a trace's arrival time, seconds


class LengthDist:
    """A length distribution parsed from a spec string, clipped to ``[1, max_len]``.

    ``128`` or ``fixed:128``; ``uniform:LO:HI`` (inclusive); ``normal:MEAN:STD``;
    ``lognormal:MEDIAN:SIGMA``; ``exponential:MEAN``.
    """

    def __init__(self, spec: str, max_len: int | None = None) -> None:
        self.spec = spec
        self.max_len = max_len
        kind, *args = spec.split(":") if ":" in spec else ("fixed", spec)
        try:
            vals = [float(a) for a in args]
        except ValueError:
            raise ValueError(f"length spec {spec!r}: parameters must be numbers") from None
        arity = {"fixed": 1, "uniform": 2, "normal": 2, "lognormal": 2, "exponential": 1}
        if kind not in arity:
            raise ValueError(f"length spec {spec!r}: unknown kind {kind!r}; use one of "
                             f"{sorted(arity)} (e.g. uniform:32:256)")
        if len(vals) != arity[kind]:
            raise ValueError(f"length spec {spec!r}: {kind} takes {arity[kind]} parameter(s)")
        if any(v < 0 for v in vals) or (kind != "normal" and vals[0] <= 0):
            raise ValueError(f"length spec {spec!r}: parameters must be positive")
        if kind == "uniform" and vals[1] < vals[0]:
            raise ValueError(f"length spec {spec!r}: HI must be >= LO")
        self.kind, self.args = kind, vals

    def upper(self) -> int | None:
        """The longest length this draws, where bounded (``fixed``, ``uniform``, or any kind
        with ``max_len``); None for an unbounded tail."""
        if self.kind == "fixed":
            bound = max(1, int(round(self.args[0])))
        elif self.kind == "uniform":
            bound = max(1, int(self.args[1]))
        else:
            return self.max_len
        return min(bound, self.max_len) if self.max_len else bound

    def sample(self, rng: random.Random) -> int:
        a = self.args
        if self.kind == "fixed":
            x = a[0]
        elif self.kind == "uniform":
            x = rng.randint(int(a[0]), int(a[1]))
        elif self.kind == "normal":
            x = rng.gauss(a[0], a[1])
        elif self.kind == "lognormal":
            x = rng.lognormvariate(math.log(a[0]), a[1])
        else:
            x = rng.expovariate(1 / a[0])
        n = max(1, int(round(x)))
        return min(n, self.max_len) if self.max_len else n


def load_dataset(path: str | Path) -> list[RequestLengths]:
    """The rows of a dataset file (``parse_dataset``); ValueError naming the file and line."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"cannot read dataset {path}: {exc}") from None
    return parse_dataset(text, path.suffix, str(path))


_ALIASES = {"prompt_len": "prompt_tokens", "output_len": "output_tokens"}


def _length(row: dict[str, Any], key: str) -> int:
    """``row[key]``, or its alias (``prompt_tokens``/``output_tokens``), as an int."""
    return int(row[key] if key in row else row[_ALIASES[key]])


def parse_dataset(text: str, suffix: str, name: str) -> list[RequestLengths]:
    """The one dataset format, for ``kvdisagg bench`` and ``kvdisagg plan``/``simulate`` alike:
    rows of CSV (``suffix`` ``.csv``: columns ``prompt_len,output_len[,timestamp]``) or JSON lines
    (``.jsonl``/``.json``: keys ``prompt_len`` or ``prompt`` (text or token ids),
    ``output_len``, ``timestamp``). ``prompt_tokens``/``output_tokens`` are accepted for
    ``prompt_len``/``output_len``; other columns or keys (a bench records file's) are ignored.
    ``name`` is the file, for messages. Stdlib only (bench has no numpy, the planner reads it
    too); ValueError for a row it cannot read."""
    rows: list[RequestLengths] = []
    if suffix == ".csv":
        reader = csv.DictReader(text.splitlines())
        for i, row in enumerate(reader, 2):
            try:
                ts = row.get("timestamp")
                rows.append(RequestLengths(_length(row, "prompt_len"), _length(row, "output_len"),
                                           timestamp=float(ts) if ts not in (None, "") else None))
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{name}:{i}: need integer prompt_len and output_len "
                                 f"columns ({exc})") from None
    elif suffix in (".jsonl", ".json"):
        for i, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                prompt = row.get("prompt")
                if prompt is not None and not (isinstance(prompt, str) or (
                        isinstance(prompt, list) and all(isinstance(t, int) for t in prompt))):
                    raise ValueError("prompt must be text or a list of token ids")
                if "prompt_len" in row or "prompt_tokens" in row:
                    plen = _length(row, "prompt_len")
                elif prompt is None:
                    raise KeyError("prompt_len")
                else:
                    plen = len(prompt) if isinstance(prompt, list) else len(prompt.split())
                ts = row.get("timestamp")
                rows.append(RequestLengths(plen, _length(row, "output_len"), prompt,
                                           float(ts) if ts is not None else None))
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                raise ValueError(f"{name}:{i}: need output_len and prompt_len or prompt "
                                 f"({exc})") from None
    else:
        raise ValueError(f"dataset {name}: use a .csv or .jsonl file")
    if not rows:
        raise ValueError(f"dataset {name} has no rows")
    for r in rows:
        if r.prompt_len < 1 or r.output_len < 1:
            raise ValueError(f"dataset {name}: lengths must be >= 1, got {r[:2]}")
    return rows


def arrival_times(n: int, rate: float, kind: Arrival, seed: int) -> list[float]:
    """``n`` arrival times at ``rate`` req/s starting at 0; the same draws for every rate."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    if kind == "constant":
        return [i / rate for i in range(n)]
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(1.0) / rate
    return out


def trace_times(rows: Sequence[RequestLengths], rate: float | None) -> list[float]:
    """A trace's timestamps from 0, rescaled to ``rate`` req/s on average (None: as recorded)."""
    ts = [r.timestamp for r in rows]
    if any(t is None for t in ts):
        raise ValueError("trace replay needs a timestamp on every row")
    t0 = min(ts)  # type: ignore[type-var]
    rel = sorted(t - t0 for t in ts)  # type: ignore[operator]
    if rate is None or len(rel) < 2 or rel[-1] == 0:
        return rel
    native = (len(rel) - 1) / rel[-1]
    return [t * native / rate for t in rel]


def _prompt(n: int, rng: random.Random, token_ids: tuple[int, int] | None) -> list[int] | str:
    if token_ids is None:
        return " ".join(rng.choice(_WORDS) for _ in range(n))
    lo, hi = token_ids
    return [rng.randrange(lo, hi) for _ in range(n)]


def build(n: int, rate: float | None, *, seed: int, salt: int, arrival: Arrival = "poisson",
          prompt_len: LengthDist | None = None, output_len: LengthDist | None = None,
          dataset: Sequence[RequestLengths] | None = None, trace: bool = False,
          token_ids: tuple[int, int] | None = (10, 500)) -> list[RequestSpec]:
    """The requests of one run. ``dataset`` rows are drawn with replacement (``trace``: in
    order, at their timestamps). ``token_ids=None`` sends text prompts of ~``prompt_len`` words."""
    if n < 1:
        raise ValueError(f"need at least one request, got {n}")
    rng_len = random.Random(seed + 1)
    rng_prompt = random.Random(f"{seed}/{salt}")
    if trace:
        if not dataset:
            raise ValueError("trace replay needs a dataset with timestamps")
        rows = list(dataset[:n])
        times = trace_times(rows, rate)
        rows.sort(key=lambda r: r.timestamp or 0.0)
    else:
        if rate is None:
            raise ValueError("a rate is needed unless a trace is replayed")
        times = arrival_times(n, rate, arrival, seed)
        if dataset:
            rows = [dataset[rng_len.randrange(len(dataset))] for _ in range(n)]
        else:
            if prompt_len is None or output_len is None:
                raise ValueError("give prompt and output length distributions or a dataset")
            rows = [RequestLengths(prompt_len.sample(rng_len), output_len.sample(rng_len))
                    for _ in range(n)]
    out = []
    for i, (t, row) in enumerate(zip(times, rows)):
        prompt = row.prompt if row.prompt is not None else _prompt(row.prompt_len, rng_prompt,
                                                                    token_ids)
        out.append(RequestSpec(i, t, row.prompt_len, row.output_len, prompt))
    return out
