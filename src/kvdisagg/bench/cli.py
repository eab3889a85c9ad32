"""``kvdisagg bench``: open-loop load against one or more OpenAI-compatible endpoints.

Each ``--url`` is measured with the same requests at each rate (endpoints interleaved rate by
rate, so machine noise hits all of them alike), and the run writes ``records.jsonl`` (one line
per request), ``summary.json`` (``BenchResult``) and two PNG plots into ``--out``.

Before any load, each endpoint is asked its model, ``max_model_len`` and vocabulary
(``endpoint.py``): token-id prompts stay inside the vocabulary, and a workload that cannot fit
is refused in one line. The API key comes from ``--api-key-file`` or ``KVDISAGG_API_KEY``,
never the command line (``keys.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import sys
from pathlib import Path
from typing import Any

from kvdisagg.errors import ConfigError, EndpointError
from kvdisagg.keys import API_KEY_ENV, key_from, refused_on_command_line


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("endpoints")
    g.add_argument("--url", action="append", required=True, metavar="[NAME=]URL",
                   help="endpoint base URL (repeat to compare); NAME labels it")
    g.add_argument("--gpus", type=int, nargs="+", default=[1], metavar="N",
                   help="GPUs behind each --url, in order (one value: all); goodput per GPU "
                        "divides by it")
    g.add_argument("--model", help="model name to send (default: the endpoint's first model)")
    g.add_argument("--api", choices=["completions", "chat"], default="completions")
    g.add_argument("--api-key-file", metavar="FILE",
                   help="file holding the key sent as Authorization: Bearer KEY (else "
                        "$KVDISAGG_API_KEY; else none)")
    g.add_argument("--api-key", help=argparse.SUPPRESS)  # refused: argv is public
    g.add_argument("--extra-body", metavar="JSON", default="{}",
                   help='fields added to every request, e.g. \'{"return_token_ids": true}\' '
                        "(vLLM: exact token counts)")
    s = p.add_argument_group("objectives")
    s.add_argument("--ttft-slo", type=float, default=1.0, metavar="S",
                   help="TTFT objective, seconds (default 1.0, the proxy's default)")
    s.add_argument("--tpot-slo", type=float, default=0.1, metavar="S",
                   help="TPOT objective, seconds (default 0.1, the proxy's default)")
    s.add_argument("--attainment", type=float, default=0.9,
                   help="target fraction meeting both SLOs (default 0.9)")
    r = p.add_argument_group("load")
    r.add_argument("--rate", type=float, nargs="+", metavar="R",
                   help="arrival rate(s), req/s; several rates make a sweep")
    r.add_argument("--sweep", metavar="LO:HI",
                   help="bisect for the highest rate meeting --attainment in [LO, HI]")
    r.add_argument("--sweep-steps", type=int, default=3)
    r.add_argument("--per-gpu-rate", action="store_true",
                   help="rates are per GPU: each endpoint gets rate x its --gpus")
    r.add_argument("--num-requests", type=int, default=100, metavar="N")
    r.add_argument("--duration", type=float, metavar="S",
                   help="instead of --num-requests: rate x S requests per run")
    r.add_argument("--arrival", choices=["poisson", "constant"], default="poisson")
    r.add_argument("--prompt-len", default="uniform:32:256", metavar="SPEC",
                   help="N | uniform:LO:HI | normal:MEAN:STD | lognormal:MEDIAN:SIGMA | "
                        "exponential:MEAN (tokens)")
    r.add_argument("--output-len", default="uniform:16:64", metavar="SPEC")
    r.add_argument("--max-prompt-len", type=int)
    r.add_argument("--max-output-len", type=int)
    r.add_argument("--dataset", metavar="FILE",
                   help=".csv (prompt_len,output_len) or .jsonl rows, drawn with replacement")
    r.add_argument("--trace", metavar="FILE",
                   help="replay a dataset file with a timestamp column (--rate rescales it)")
    r.add_argument("--token-id-range", metavar="LO:HI",
                   help=f"prompts are random token ids in [LO, HI) (default: "
                        f"{DEFAULT_TOKEN_IDS}, ending where the endpoints' vocabulary ends); a "
                        "range past it is refused")
    r.add_argument("--text-prompts", action="store_true",
                   help="send text of ~prompt_len words instead of token ids")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--warmup", type=int, default=2, metavar="N",
                   help="unrecorded sequential requests per endpoint first")
    t = p.add_argument_group("bounds")
    t.add_argument("--timeout", type=float, default=300.0, help="per request, seconds")
    t.add_argument("--idle-timeout", type=float, default=60.0,
                   help="max silence within a stream, seconds")
    t.add_argument("--connect-timeout", type=float, default=10.0)
    o = p.add_argument_group("output")
    o.add_argument("--phases-from", action="append", default=[], metavar="URL",
                   help="a prefill or decode instance whose handoff phases (its "
                   "vllm:kvdisagg_phase_seconds) the run's breakdown shows, beside the proxy's; "
                   "repeatable")
    o.add_argument("--proxy-window", type=float, default=60.0, metavar="S",
                   help="the proxy's slo.window_s, to compare its goodput gauge")
    o.add_argument("--out", default="out/bench", metavar="DIR")
    o.add_argument("--no-plots", action="store_true")
    o.add_argument("--quiet", action="store_true", help="no progress bars")
    o.add_argument("--json", action="store_true", help="print the summary JSON to stdout")


DEFAULT_TOKEN_IDS = "10:500"
"""Past the special ids of common tokenizers; narrowed to a smaller vocabulary (the demo's tiny
model knows 512 ids, 0-3 special)."""


def _fail(msg: str) -> SystemExit:
    return SystemExit(f"kvdisagg bench: {msg}")


def _endpoints(args: argparse.Namespace):  # -> list[Endpoint]
    from kvdisagg.bench.runner import Endpoint

    urls = args.url
    gpus = args.gpus * len(urls) if len(args.gpus) == 1 else args.gpus
    if len(gpus) != len(urls):
        raise _fail(f"--gpus has {len(args.gpus)} values for {len(urls)} --url; give one "
                    "per URL or one for all")
    eps = []
    for i, (spec, n) in enumerate(zip(urls, gpus)):
        # NAME=URL: the first "=" before "://" (a query string may hold more)
        name, _, url = spec.partition("=") if "=" in spec.split("://")[0] else ("", "", spec)
        if not url.startswith(("http://", "https://")):
            raise _fail(f"--url {spec!r}: the URL must start with http:// or https://")
        if n < 1:
            raise _fail(f"--gpus must be >= 1, got {n}")
        eps.append(Endpoint(name or f"ep{i}", url.rstrip("/"), n))
    if len({e.name for e in eps}) != len(eps):
        raise _fail("endpoint names must differ (use NAME=URL)")
    return eps


def _range(spec: str, flag: str) -> tuple[float, float]:
    try:
        lo, hi = (float(x) for x in spec.split(":"))
    except ValueError:
        raise _fail(f"{flag} {spec!r}: expected LO:HI") from None
    if not 0 <= lo < hi:
        raise _fail(f"{flag} {spec!r}: need 0 <= LO < HI")
    return lo, hi


def run(args: argparse.Namespace) -> int:
    """Check the options, run the load (rates, a sweep, or a trace), then report."""
    from rich.console import Console

    options = _Options(args)
    # stderr: stdout stays clean for --json; wide when logged, so the tables stay readable
    console = Console(stderr=True, width=None if sys.stderr.isatty() else 160)
    for note in options.notes:
        console.print(note, markup=False, highlight=False)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with _Session(args, options, console, out / "records.jsonl") as session:
        sweeps = session.sweep() if args.sweep else session.at_rates()
    return _report(args, options, console, out, session, sweeps)


class _Options:
    """The command line checked once, as the types the runs use."""

    def __init__(self, args: argparse.Namespace) -> None:
        from kvdisagg.bench import workload
        from kvdisagg.bench.records import Slo

        self.endpoints = _endpoints(args)
        if not (args.ttft_slo > 0 and args.tpot_slo > 0):
            raise _fail("--ttft-slo and --tpot-slo must be > 0")
        if not 0 < args.attainment <= 1:
            raise _fail("--attainment must be in (0, 1]")
        if args.rate and args.sweep:
            raise _fail("give --rate or --sweep, not both")
        if not args.rate and not args.sweep and not args.trace:
            raise _fail("give --rate R [R ...], --sweep LO:HI or --trace FILE")
        if args.rate and any(r <= 0 for r in args.rate):
            raise _fail("rates must be > 0")
        try:
            dataset = workload.load_dataset(args.trace or args.dataset) if (
                args.trace or args.dataset) else None
            self.prompt_len = workload.LengthDist(args.prompt_len, args.max_prompt_len)
            self.output_len = workload.LengthDist(args.output_len, args.max_output_len)
        except ValueError as exc:
            raise _fail(str(exc)) from None
        if dataset and (args.max_prompt_len or args.max_output_len):
            dataset = [workload.RequestLengths(
                min(d.prompt_len, args.max_prompt_len or d.prompt_len),
                min(d.output_len, args.max_output_len or d.output_len),
                d.prompt, d.timestamp) for d in dataset]
        self.dataset = dataset
        lo, hi = _range(args.token_id_range or DEFAULT_TOKEN_IDS, "--token-id-range")
        self.slo = Slo(ttft_s=args.ttft_slo, tpot_s=args.tpot_slo)
        try:
            self.extra_body = json.loads(args.extra_body)
        except ValueError as exc:
            raise _fail(f"--extra-body is not JSON: {exc}") from None
        if not isinstance(self.extra_body, dict):
            raise _fail("--extra-body must be a JSON object")
        self.phase_urls = [u.rstrip("/") for u in args.phases_from]
        if bad := [u for u in self.phase_urls if not u.startswith(("http://", "https://"))]:
            raise _fail(f"--phases-from {bad[0]!r}: the URL must start with http:// or https://")
        if args.api_key is not None:
            raise _fail(str(refused_on_command_line("--api-key", "--api-key-file",
                                                    API_KEY_ENV)))
        try:
            self.api_key = key_from(args.api_key_file, API_KEY_ENV, "--api-key-file")
        except ConfigError as exc:
            raise _fail(str(exc)) from None
        self.notes: list[str] = []
        """Lines to print before the load: what was learnt from the endpoints."""
        self.models = self._models(args)
        text = args.text_prompts or args.api == "chat"
        self.token_ids = None if text else self._token_ids(args, int(lo), int(hi))

    def _models(self, args: argparse.Namespace) -> dict[str, str]:
        """Each endpoint's model (``--model``, else its first), checked against its
        ``max_model_len`` where the workload's longest request is known."""
        from kvdisagg.bench.endpoint import model_card

        models, longest = {}, self._longest_request()
        for e in self.endpoints:
            try:
                card = model_card(e.url, self.api_key, args.connect_timeout)
            except EndpointError as exc:
                if not args.model:
                    raise _fail(f"{exc}; pass --model") from None
                card = None  # the request will say; --model needs no listing
            models[e.name] = args.model or (card.id if card else "")
            if card and card.max_model_len and longest and longest[0] + longest[1] > (
                    card.max_model_len):
                raise _fail(
                    f"requests of up to {longest[0]} prompt + {longest[1]} output tokens do not "
                    f"fit {e.name}'s max_model_len {card.max_model_len} ({e.url}/v1/models): "
                    "lower --prompt-len/--output-len or set --max-prompt-len/--max-output-len")
        return models

    def _longest_request(self) -> tuple[int, int] | None:
        """(prompt, output) tokens of the longest request the workload can draw, if bounded."""
        if self.dataset:
            longest = max(self.dataset, key=lambda d: d.prompt_len + d.output_len)
            return longest.prompt_len, longest.output_len
        prompt, output = self.prompt_len.upper(), self.output_len.upper()
        return (prompt, output) if prompt and output else None

    def _token_ids(self, args: argparse.Namespace, lo: int, hi: int) -> tuple[int, int]:
        """``[lo, hi)`` for token-id prompts, inside every endpoint's vocabulary: the default
        range ends where the smallest vocabulary does; a range given past it is refused."""
        from kvdisagg.bench.endpoint import vocabulary_end

        for e in self.endpoints:
            model = self.models[e.name]
            end = vocabulary_end(e.url, model, lo, hi, self.api_key, args.connect_timeout)
            if end is None:
                continue
            if end <= lo:
                raise _fail(f"{e.name}'s model {model} knows no token id from {lo} on (its "
                            f"/detokenize; the vocabulary ends at {end}): give --token-id-range "
                            f"0:{end} or --text-prompts")
            if args.token_id_range:
                raise _fail(f"--token-id-range {args.token_id_range} goes past the vocabulary "
                            f"of {e.name}'s model {model} (token ids below {end}, by its "
                            f"/detokenize): use --token-id-range {lo}:{end} or --text-prompts")
            self.notes.append(f"token ids {lo}:{end}: the vocabulary of {e.name}'s model "
                              f"{model} ends at {end} (its /detokenize)")
            hi = end
        return lo, hi


class _Session:
    """The runs of one invocation: each appends its records to the records file as it ends."""

    def __init__(self, args: argparse.Namespace, options: _Options, console: Any,
                 records_path: Path) -> None:
        self.args, self.options, self.console = args, options, console
        self.records_path = records_path
        self.records: list[Any] = []  # RequestRecord
        self.runs: list[Any] = []  # RunSummary
        self._salt = 0
        self._warmed: set[str] = set()

    def __enter__(self) -> _Session:
        import msgspec

        self._file = open(self.records_path, "wb")
        self._encode = msgspec.json.Encoder().encode
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.close()

    def one_run(self, ep: Any, rate: float | None) -> Any:
        """One open-loop run against ``ep`` at ``rate`` (None: the trace's own timing)."""
        from kvdisagg.bench import report, workload
        from kvdisagg.bench.client import ClientConfig
        from kvdisagg.bench.runner import run_once

        args, o = self.args, self.options
        self._salt += 1
        ep_rate = rate * ep.gpus if (rate is not None and args.per_gpu_rate) else rate
        if args.trace:
            n = len(o.dataset or [])
        elif args.duration:
            n = max(1, math.ceil((ep_rate or 0) * args.duration))
        else:
            n = args.num_requests
        specs = workload.build(n, ep_rate, seed=args.seed, salt=self._salt,
                               arrival=args.arrival, prompt_len=o.prompt_len,
                               output_len=o.output_len, dataset=o.dataset,
                               trace=bool(args.trace), token_ids=o.token_ids)
        warm = [] if ep.name in self._warmed else workload.build(
            max(1, args.warmup), 1.0, seed=args.seed + 99, salt=-self._salt,
            prompt_len=workload.LengthDist("16"), output_len=workload.LengthDist("4"),
            token_ids=o.token_ids)[:args.warmup]
        self._warmed.add(ep.name)
        cfg = ClientConfig(model=o.models[ep.name], api=args.api, connect_s=args.connect_timeout,
                           idle_s=args.idle_timeout, total_s=args.timeout, api_key=o.api_key,
                           extra_body=o.extra_body)
        label = f"{ep.name}@{ep_rate:g}" if ep_rate is not None else f"{ep.name}@trace"
        with report.RunProgress(self.console, label, len(specs),
                                enabled=not args.quiet) as prog:
            outcome = asyncio.run(run_once(ep, specs, cfg, o.slo, run=label, rate=ep_rate,
                                           on_done=prog.done, warmup=warm,
                                           proxy_window_s=args.proxy_window,
                                           phase_urls=o.phase_urls))
        for rec in outcome.records:
            self._file.write(self._encode(rec) + b"\n")
        self._file.flush()
        self.records.extend(outcome.records)
        self.runs.append(outcome.summary)
        return outcome.summary

    def sweep(self) -> list[Any]:
        """--sweep: per endpoint, bisect the highest rate that meets the attainment goal."""
        from kvdisagg.bench.records import SweepPoint
        from kvdisagg.bench.sweep import bisect_max_rate

        args, out = self.args, []
        lo, hi = _range(args.sweep, "--sweep")
        for ep in self.options.endpoints:

            def attainment(rate: float, ep: Any = ep) -> float:
                return float(self.one_run(ep, rate).attainment)

            best, probes = bisect_max_rate(attainment, lo, hi, args.attainment,
                                           args.sweep_steps)
            k = ep.gpus if args.per_gpu_rate else 1  # probes -> endpoint rates
            out.append(_sweep(ep, best.rate * k if best.rate is not None else None,
                              best.censored,
                              [SweepPoint(p.rate * k, p.attainment) for p in probes],
                              args.attainment))
        return out

    def at_rates(self) -> list[Any]:
        """--rate R...(or --trace): every endpoint at each rate; several rates also give each
        endpoint's highest rate meeting the goal."""
        from kvdisagg.bench.records import SweepPoint
        from kvdisagg.bench.sweep import max_rate_from_points

        args = self.args
        for rate in (list(args.rate) if args.rate else [None]):
            for ep in self.options.endpoints:
                self.one_run(ep, rate)
        if not (args.rate and len(args.rate) > 1):
            return []
        out = []
        for ep in self.options.endpoints:
            pts = [SweepPoint(r.rate or 0.0, r.attainment) for r in self.runs
                   if r.endpoint == ep.name]
            best = max_rate_from_points(pts, args.attainment)
            out.append(_sweep(ep, best.rate, best.censored, pts, args.attainment))
        return out


def _report(args: argparse.Namespace, options: _Options, console: Any, out: Path,
            session: _Session, sweeps: list[Any]) -> int:
    """summary.json, the tables, the plots, --json; 2 if a run had no success."""
    import msgspec

    from kvdisagg.bench import plots, report
    from kvdisagg.bench.records import BenchResult

    runs, slo = session.runs, options.slo
    result = BenchResult(slo=slo, target_attainment=args.attainment, command=sys.argv[:],
                         runs=runs, sweeps=sweeps)
    (out / "summary.json").write_bytes(msgspec.json.format(msgspec.json.encode(result)))
    console.print(report.runs_table(runs, slo))
    if any(r.phases for r in runs):
        console.print(report.phases_table(runs))
    for r in runs:
        for url in r.metrics_unread:
            console.print(f"{r.run}: {url}/metrics was unreadable at the run's start or end, so "
                          "its phases and SLO counters for this run are unknown (not shown)")
    if sweeps:
        console.print(report.sweeps_table(sweeps))
    if not args.no_plots and importlib.util.find_spec("matplotlib") is None:
        console.print("plots skipped: matplotlib is not installed (pip install "
                      "'kvdisagg\\[bench]'; --no-plots asks for none)")  # \\[: not rich markup
    elif not args.no_plots:
        paths = [plots.latency_cdfs(session.records, slo, out / "latency_cdf.png")]
        if any(r.rate is not None for r in runs):
            paths.append(plots.attainment_vs_rate(runs, args.attainment,
                                                  out / "attainment_vs_rate.png"))
        console.print("plots: " + ", ".join(map(str, paths)))
    console.print(f"records: {session.records_path}  summary: {out / 'summary.json'}")
    if args.json:
        sys.stdout.write(msgspec.json.encode(result).decode() + "\n")
    broken = [r.run for r in runs if r.ok == 0]
    if broken:
        console.print(f"[red]no request succeeded in: {', '.join(broken)}[/red]")
        return 2
    return 0


def _sweep(ep: Any, max_rate: float | None, censored: bool, points: list[Any],
           target: float) -> Any:
    """A SweepResult from endpoint rates (not per GPU)."""
    from kvdisagg.bench.records import SweepResult

    return SweepResult(endpoint=ep.name, gpus=ep.gpus, target=target, points=points,
                       max_rate=max_rate,
                       max_rate_per_gpu=None if max_rate is None else max_rate / ep.gpus,
                       censored=censored)
