"""The differential conformance suite (issue 26): generated request forms, each sent to the
proxy and to a plain vLLM instance without DisaggConnector (``fleet.reference``), compared
field by field, on every path that accepts the form.

Paths are forced by the proxy's flags, one proxy each, on the session's fleet:

- ``first-token``: every request through prefill, a stream's first token from prefill;
- ``ordinary``: every request through prefill, the ordinary handoff;
- ``decide-early``: the proxy's decision (decode alone for short prompts) with early dispatch;
- migration: ``ordinary`` and ``first-token`` again, with decode behind a relay that breaks a
  chosen stream (tests/support/cutting_relay.py) at the client's k-th token: k 0, 1, a middle
  token inside a multi-byte character, the last token, and after the finish event; over fixed
  streams and the grammar's first forms that the contract lets migrate.

Each response also shows the path it took (``X-Kvdisagg-Handoff``), which must be the one the
contract (proxy/routing/contract.py) gives for the form, and each case checks the counters of
that path: decode's pulls moved by one for a handoff and not for decode alone or a refusal;
early dispatch opened for each handoff of ``decide-early`` (and for nothing else); the
proxy's first-token counter matches the forms that took it; a break migrated or only finished
the stream as it should. So a silent recompute or a fallback can never pass as P/D. Greedy
and seeded answers are reproducible, so comparisons are exact except logprobs
(``LOGPROB_RTOL``: decode computes the prompt's last token in another kernel, as prefix caching
does). ``prompt_tokens_details`` is compared too (null on both here).
"""

from __future__ import annotations

import codecs
import json
import math
import random
import time
import urllib.error
import urllib.request
from collections import Counter
from typing import Any, NamedTuple

import pytest

from kvdisagg.prom_text import Sample, samples, total
from kvdisagg.proxy.routing import contract
from tests.support.cutting_relay import cutting_relay

from .conftest import metric

pytestmark = pytest.mark.e2e

SEED = 2026
FORMS = 44  # generated forms per mode, plus the named holes (HOLES)
LOGPROB_RTOL = 1e-4
PULLS = "vllm:kvdisagg_pulls_total"  # decode's: one per handoff it loaded
EARLY = "kvdisagg_proxy_early_handoffs_total"
DECLINED = "kvdisagg_proxy_early_declined_total"
IN_FLIGHT = "kvdisagg_proxy_instance_in_flight"
WORDS = ("sea fox dog tide salt wind shore wave gull rock sand reef boat net storm calm "
         "café naïve 東京 señor ünter björk crème").split()
EOS, PAD, PARTIAL_BYTE, LETTER_C = 2, 3, 131, 70  # tiny model ids: </s>, <pad>, 0xC3, "c"
TOOL = {"type": "function", "function": {
    "name": "get_tide", "description": "tide at a place",
    "parameters": {"type": "object", "properties": {"place": {"type": "string"}}}}}


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def form(rng: random.Random, i: int) -> tuple[str, dict[str, Any]]:
    """One request form from the grammar: (endpoint, body)."""
    chat = rng.random() < 0.5
    stream = rng.random() < 0.65
    long = rng.random() < 0.5
    words = rng.randint(150, 260) if long else rng.randint(2, 30)
    body: dict[str, Any] = {"model": "tiny", "stream": stream}
    head = f"form {SEED}-{i}: "  # unique: no prefix hit from another form
    if chat:
        body["messages"] = [{"role": "system", "content": head + "answer briefly."},
                            {"role": "user", "content": text(rng, words)}]
        if rng.random() < 0.15:
            body["messages"][1]["content"] = [{"type": "text", "text": text(rng, words)}]
    elif rng.random() < 0.35:
        body["prompt"] = [5 + (i * 7919 + k * 31) % 400 for k in range(words * 2)]
    else:
        body["prompt"] = head + text(rng, words)
    k = rng.randint(1, 10)
    limit = rng.choice(["max_tokens", "max_tokens", "float", "mct", "mct_null"] if chat
                       else ["max_tokens", "max_tokens", "float"])
    body.update({"max_tokens": {"max_tokens": k}, "float": {"max_tokens": float(k)},
                 "mct": {"max_completion_tokens": k},
                 "mct_null": {"max_completion_tokens": None, "max_tokens": k}}[limit])
    if rng.random() < 0.7:
        body["temperature"] = 0
    else:
        body.update(temperature=0.9, top_p=0.95, seed=rng.randint(1, 10_000))
    if rng.random() < 0.15:
        body["n"] = 2
    optional: list[tuple[float, dict[str, Any]]] = [
        (0.12, {"logprobs": True, "top_logprobs": rng.randint(0, 2)} if chat
         else {"logprobs": rng.randint(0, 2)}),
        (0.1, {"stop": [rng.choice(["e", "sea", " fox", "é"])]}),
        (0.1, {"stop_token_ids": [rng.randint(40, 300)]}),
        (0.1, {"min_tokens": rng.choice([0, k, k + 2, -1])}),
        (0.1, {"ignore_eos": True}),
        (0.08, {"presence_penalty": 0.5, "frequency_penalty": 0.3}),
        (0.08, {"repetition_penalty": 1.3}),
        (0.15, {"return_token_ids": True}),
        (0.06, {"skip_special_tokens": False}),
        (0.05, {"structured_outputs": {"choice": ["yes", "no"]}}),
        (0.05, {"logit_bias": {str(rng.randint(40, 300)): 5.0}}),
    ]
    if not chat:
        optional.append((0.06, {"echo": True}))
    else:
        optional.append((0.05, {"tools": [TOOL], "tool_choice": "none"}))
    if stream:
        optional.append((0.3, {"stream_options": {"include_usage": True}}))
        optional.append((0.06, {"stream_options": {"include_usage": True,
                                                   "continuous_usage_stats": True}}))
    for p, fields in optional:
        if rng.random() < p:
            body.update(fields)
    return ("chat" if chat else "completions"), body


def chat_msgs(content: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": content}]


HOLES: list[tuple[str, dict[str, Any]]] = [
    # (1) a multimodal part: the plain instance's answer (a text-only model's 400)
    ("chat", {"model": "tiny", "stream": True, "max_tokens": 6, "temperature": 0,
              "messages": chat_msgs([{"type": "text", "text": "what is this " * 40},
                                     {"type": "image_url", "image_url": {
                                         "url": "data:image/png;base64,iVBORw0KGgo="}}])}),
    # (2) a null max_completion_tokens: vLLM takes max_tokens
    ("chat", {"model": "tiny", "stream": True, "max_completion_tokens": None, "max_tokens": 5,
              "temperature": 0, "messages": chat_msgs("tides " * 150)}),
    ("chat", {"model": "tiny", "stream": True, "max_completion_tokens": None,
              "max_tokens": 100000, "temperature": 0, "messages": chat_msgs("tides " * 150)}),
    # (3) requests a plain instance refuses
    ("completions", {"model": "tiny", "stream": True, "max_tokens": 4, "min_tokens": 6,
                     "temperature": 0, "prompt": "salt " * 200}),
    ("completions", {"model": "tiny", "stream": True, "max_tokens": 4, "min_tokens": -1,
                     "temperature": 0, "prompt": "salt " * 200}),
    # (4) token ids in a stream
    ("completions", {"model": "tiny", "stream": True, "max_tokens": 8, "temperature": 0,
                     "return_token_ids": True, "prompt": "reef " * 190,
                     "stream_options": {"include_usage": True}}),
    ("chat", {"model": "tiny", "stream": True, "max_tokens": 8, "temperature": 0,
              "return_token_ids": True, "messages": chat_msgs("reef " * 190)}),
    # (5) a first token that ends the answer, one without text, one inside a character
    ("completions", {"model": "tiny", "stream": True, "max_tokens": 6, "temperature": 0,
                     "allowed_token_ids": [EOS], "prompt": "gull " * 180,
                     "stream_options": {"include_usage": True}}),
    ("chat", {"model": "tiny", "stream": True, "max_tokens": 6, "temperature": 0,
              "allowed_token_ids": [EOS], "messages": chat_msgs("gull " * 180)}),
    ("completions", {"model": "tiny", "stream": True, "max_tokens": 4, "temperature": 0,
                     "allowed_token_ids": [PAD], "prompt": "wave " * 180}),
    ("completions", {"model": "tiny", "stream": True, "max_tokens": 4, "temperature": 0,
                     "allowed_token_ids": [PARTIAL_BYTE, 106, 166, 255],
                     "prompt": "wave " * 181}),
    ("chat", {"model": "tiny", "stream": True, "max_tokens": 4, "temperature": 0,
              "allowed_token_ids": [PARTIAL_BYTE, 106, 166, 255],
              "messages": chat_msgs("wave " * 181)}),
    # prompts shorter than a block; a full and a partial prefix hit on decode
    ("completions", {"model": "tiny", "stream": True, "max_tokens": 5, "temperature": 0,
                     "prompt": [7]}),
    ("completions", {"model": "tiny", "stream": False, "max_tokens": 5, "temperature": 0,
                     "prompt": [9, 10, 11]}),
    ("completions", {"model": "tiny", "stream": True, "max_tokens": 5, "temperature": 0,
                     "prompt": list(range(20, 276))}),
    ("completions", {"model": "tiny", "stream": True, "max_tokens": 5, "temperature": 0,
                     "prompt": list(range(20, 276))}),
    ("completions", {"model": "tiny", "stream": True, "max_tokens": 5, "temperature": 0,
                     "prompt": list(range(20, 276)) + [40, 41, 42]}),
]


def tagged(body: dict[str, Any], tag: int) -> dict[str, Any]:
    """``body`` with a prompt of its own for one mode (decode caches what earlier modes
    pulled: the same prompt again would load nothing)."""
    body = json.loads(json.dumps(body))
    if "messages" in body:
        first = body["messages"][0]
        if isinstance(first["content"], str):
            first["content"] = f"[{tag}] " + first["content"]
        else:
            first["content"] = [{"type": "text", "text": f"[{tag}] "}, *first["content"]]
    elif isinstance(body["prompt"], str):
        body["prompt"] = f"[{tag}] " + body["prompt"]
    else:
        body["prompt"] = [400 + tag, *body["prompt"]]
    return body


def forms(tag: int) -> list[tuple[str, dict[str, Any]]]:
    rng = random.Random(SEED)
    return [(ep, tagged(body, tag)) for ep, body in [form(rng, i) for i in range(FORMS)]
            + HOLES]


# -- calling and normalizing ---------------------------------------------------------------

def call(base: str, endpoint: str, body: dict[str, Any], rid: str = ""
         ) -> tuple[dict[str, Any], str]:
    """The answer normalized for comparison, and the ``X-Kvdisagg-Handoff`` header."""
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    headers = {"Content-Type": "application/json"}
    if rid:
        headers["X-Request-Id"] = rid
    req = urllib.request.Request(base + path, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            handoff = r.headers.get("X-Kvdisagg-Handoff", "")
            if not body.get("stream"):
                return plain(json.loads(r.read())), handoff
            return merged(r), handoff
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            doc = json.loads(raw)
        except ValueError:
            doc = {"raw": raw.decode("utf-8", "replace")}
        err = doc.get("error") if isinstance(doc.get("error"), dict) else doc
        return {"status": e.code, "type": err.get("type"),
                "message": err.get("message")}, e.headers.get("X-Kvdisagg-Handoff", "")


def plain(doc: dict[str, Any]) -> dict[str, Any]:
    for key in ("id", "created", "system_fingerprint"):
        doc.pop(key, None)
    return doc


def merged(r: Any) -> dict[str, Any]:
    """A stream's events merged per choice: texts, token ids, logprobs concatenated; roles,
    finish and stop reasons, prompt ids and usage as the list of what the events carried
    (a second prompt_token_ids or role is a difference); errors; whether [DONE] came; and one
    ``created`` and model for the whole stream."""
    out: dict[str, Any] = {"choices": {}, "usage": [], "errors": [], "done": False,
                           "prompt_token_ids": [], "created": set(), "model": set(),
                           "object": set()}
    for line in r:
        line = line.strip()
        if not line.startswith(b"data: "):
            continue
        if line == b"data: [DONE]":
            out["done"] = True
            continue
        e = json.loads(line[6:])
        if "error" in e:
            out["errors"].append(e["error"])
            continue
        out["created"].add(e.get("created"))
        out["model"].add(e.get("model"))
        out["object"].add(e.get("object"))
        if e.get("usage") is not None:
            out["usage"].append(e["usage"])
        if e.get("prompt_token_ids") is not None:
            out["prompt_token_ids"].append(e["prompt_token_ids"])
        for c in e.get("choices") or ():
            m = out["choices"].setdefault(c["index"], {
                "text": "", "token_ids": [], "roles": [], "finish": [], "stop": [],
                "logprobs": [], "prompt_token_ids": [], "tool_calls": [], "keys": set()})
            m["keys"] |= set(c)
            delta = c.get("delta") or {}
            m["text"] += (delta.get("content") or "") if "delta" in c else (c.get("text") or "")
            if delta.get("role"):
                m["roles"].append(delta["role"])
            if delta.get("tool_calls"):
                m["tool_calls"].append(delta["tool_calls"])
            m["token_ids"].append(c.get("token_ids"))
            if c.get("finish_reason") is not None:
                m["finish"].append(c["finish_reason"])
                m["stop"].append(c.get("stop_reason"))
            if c.get("prompt_token_ids") is not None:
                m["prompt_token_ids"].append(c["prompt_token_ids"])
            lp = c.get("logprobs")
            if lp and "content" in lp:  # chat: a list per token
                m["logprobs"] += lp.get("content") or []
            elif lp:  # completions: lists per field, one item per token
                m["logprobs"] += [dict(zip(lp, items)) for items in zip(*lp.values())]
    for m in out["choices"].values():
        ids = m["token_ids"]
        m["token_ids"] = (None if all(t is None for t in ids)
                          else [t for part in ids if part for t in part])
        m["keys"] = sorted(m["keys"])
    out["created"] = len(out["created"])
    out["model"], out["object"] = sorted(out["model"]), sorted(out["object"])
    return out


def differences(got: Any, want: Any, at: str = "") -> list[str]:
    """Field-by-field differences; floats under ``logprob`` keys within LOGPROB_RTOL."""
    if isinstance(want, dict) and isinstance(got, dict):
        out = []
        for k in sorted(set(want) | set(got), key=str):
            if k not in got or k not in want:
                out.append(f"{at}.{k}: {'missing' if k not in got else 'extra'}")
            else:
                out += differences(got[k], want[k], f"{at}.{k}")
        return out
    if isinstance(want, list) and isinstance(got, list):
        if len(want) != len(got):
            return [f"{at}: {len(got)} items, want {len(want)}: {got!r:.300} vs {want!r:.300}"]
        return [d for i, (g, w) in enumerate(zip(got, want))
                for d in differences(g, w, f"{at}[{i}]")]
    if (isinstance(want, float) and isinstance(got, float) and "logprob" in at
            and math.isclose(got, want, rel_tol=LOGPROB_RTOL, abs_tol=LOGPROB_RTOL)):
        return []
    return [] if got == want else [f"{at}: {got!r:.200} != {want!r:.200}"]


# -- the suite -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def proxies(fleet) -> dict[str, str]:
    strict = ["--always-disaggregate", "--no-decode-only-fallback"]
    return {"first-token": fleet.extra_proxy(strict, "conformance-first-token"),
            "ordinary": fleet.extra_proxy([*strict, "--no-first-token-from-prefill"],
                                          "conformance-ordinary"),
            "decide-early": fleet.extra_proxy(["--early-decode", "--local-prefill-tokens",
                                               "128"], "conformance-decide-early")}


def _expected_route(endpoint: str, body: dict[str, Any]) -> contract.Paths:
    return contract.paths(body, endpoint == "chat", body.get("stream") is True,
                          body.get("n") if isinstance(body.get("n"), int) else 1)


def _warm_first_token(url: str) -> None:
    """Until the proxy knows decode's max_model_len (its probes read it once): it takes the
    first token from prefill only then."""
    body = {"model": "tiny", "prompt": "warm " * 30, "max_tokens": 3, "stream": True,
            "temperature": 0}
    before = metric(url, "kvdisagg_proxy_first_tokens_from_prefill_total", outcome="sent")
    for _ in range(60):
        call(url, "completions", body)
        if metric(url, "kvdisagg_proxy_first_tokens_from_prefill_total",
                  outcome="sent") > before:
            return
        time.sleep(0.5)
    raise AssertionError("the proxy never took the first token from prefill")


def _warm_early(url: str) -> None:
    """Until the proxy dispatches a handoff early: it needs one ordinary handoff from prefill
    first (its kv_transfer_params are the template of an early one, early.py)."""
    before = _early(url).opened
    for i in range(20):
        call(url, "completions", {"model": "tiny", "prompt": f"warm early {i}: " + "tide " * 200,
                                  "max_tokens": 2, "temperature": 0})
        if _early(url).opened > before:
            return
        time.sleep(0.5)
    raise AssertionError("the proxy never dispatched a handoff early")


class EarlyCount(NamedTuple):
    opened: float
    fell_back: float


def _prefill_legs_ended(url: str, within_s: float = 30.0) -> None:
    """Until the proxy has no prefill leg in flight: an early handoff's prefill answer may
    reach the proxy after decode's whole answer reached the client (bounded: a leg that never
    ends is a failure of its own)."""
    deadline = time.monotonic() + within_s
    while True:
        if total(scrape(url, IN_FLIGHT), IN_FLIGHT, side="prefill") == 0:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"a prefill leg still in flight after {within_s:.0f}s")
        time.sleep(0.05)


def _declined(url: str) -> dict[str, float]:
    """The proxy's reasons for not dispatching early (kvdisagg_proxy_early_declined_total)."""
    return {s.labels["reason"]: s.value for s in scrape(url, DECLINED)}


def _early(url: str) -> EarlyCount:
    """The proxy's early handoffs (proxy/metrics.py: kvdisagg_proxy_early_handoffs_total)."""
    found = scrape(url, EARLY)
    return EarlyCount(total(found, EARLY, outcome="opened") or 0.0,
                      total(found, EARLY, outcome="fell_back") or 0.0)


def scrape(base: str, *prefixes: str) -> list[Sample]:
    """``base``'s metrics, only the lines of ``prefixes`` parsed (vLLM's page is long)."""
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        return samples(r.read(), prefixes)


def pulls(decode: str) -> float:
    """Decode's completed KV pulls (one per handoff it loaded)."""
    return total(scrape(decode, PULLS), PULLS) or 0.0


def _pulls_moved(decode: str, before: float, within_s: float = 10.0) -> float:
    """Decode's pulls once they moved from ``before``, or as they are after ``within_s``
    (as conftest.wait_metric_change: the counter may come with decode's next engine step)."""
    deadline = time.monotonic() + within_s
    while (value := pulls(decode)) == before and time.monotonic() < deadline:
        time.sleep(0.1)
    return value


def _answer_tokens(plain_url: str, endpoint: str, body: dict[str, Any],
                   want: dict[str, Any]) -> int:
    """How many tokens the plain instance's answer to a one-answer stream has: its token ids
    or usage when the stream shows them, else the same request's whole answer's usage."""
    ids = want["choices"][0]["token_ids"] if want["choices"] else None
    if ids is not None:
        return len(ids)
    if want["usage"]:
        return int(want["usage"][-1]["completion_tokens"])
    whole = {k: v for k, v in body.items() if k != "stream_options"}
    got, _ = call(plain_url, endpoint, {**whole, "stream": False})
    return int((got.get("usage") or {}).get("completion_tokens", -1))


MODES = ["first-token", "ordinary", "decide-early"]


@pytest.mark.parametrize("mode", MODES)
def test_every_form_as_a_plain_instance_answers(fleet, proxies, mode):
    url = proxies[mode]
    if mode == "first-token":
        _warm_first_token(url)
    if mode == "decide-early":
        _warm_early(url)
    d = fleet.decode.base_url
    pulls_at = pulls(d)
    early_at = _early(url)
    sent0 = metric(url, "kvdisagg_proxy_first_tokens_from_prefill_total", outcome="sent")
    ordinary0 = metric(url, "kvdisagg_proxy_first_tokens_from_prefill_total",
                       outcome="ordinary")
    failed: list[str] = []
    routes: Counter[str] = Counter()
    first_tokens = long_pd = refused_late = 0
    for i, (endpoint, body) in enumerate(forms(MODES.index(mode))):
        want, _ = call(fleet.reference.base_url, endpoint, body)
        if mode == "decide-early":
            _prefill_legs_ended(url)  # the precondition of going early: prefill idle
        got, handoff = call(url, endpoint, body)
        diffs = differences(got, want)
        paths = _expected_route(endpoint, body)
        ok = "status" not in want
        if ok and mode != "decide-early":
            expect = "pd" if paths.handoff is None else f"decode_only:{paths.handoff}"
            if handoff != expect:
                diffs.append(f"path: {handoff!r}, the contract says {expect!r}")
        if ok and mode == "decide-early" and paths.handoff is not None:
            if handoff != f"decode_only:{paths.handoff}":
                diffs.append(f"path: {handoff!r}, the contract says decode alone")
        routes[handoff or "-"] += 1
        if not ok and paths.handoff is None and paths.first_token is None:
            refused_late += 1  # prefill answered; decode's limit refused it: the ordinary path
        if ok and handoff == "pd":
            if mode == "first-token" and paths.first_token is None:
                first_tokens += 1
            prompt = body.get("prompt") or body.get("messages")
            if len(json.dumps(prompt)) > 600 and i < FORMS:  # unique prompts over 128 tokens
                long_pd += 1
        # The path it took, in counters: a handoff's KV moved (one pull: n samples share it),
        # a decode-alone answer or a refusal moved none. Prefill's first token may be the
        # whole answer: decode then never hears of the request.
        moved = int(ok and handoff == "pd")
        if (moved and mode == "first-token" and paths.first_token is None
                and _answer_tokens(fleet.reference.base_url, endpoint, body, want) == 1):
            moved = 0
        now = _pulls_moved(d, pulls_at) if moved else pulls(d)
        if now - pulls_at != moved:
            diffs.append(f"decode pulled {now - pulls_at:g} times, want {moved} (path "
                         f"{handoff!r})")
        pulls_at = now
        if mode == "decide-early":
            # Every handoff of this proxy goes out early (decide.takes_early: the decision is
            # on, --early-decode, a client's own request; early.py: prefill idle, as it is
            # between these sequential requests, and its handoff template known: _warm_early);
            # decode alone never does. A refused form may race its two legs: not counted.
            early = _early(url)
            if ok and (early.opened - early_at.opened, early.fell_back - early_at.fell_back
                       ) != (moved, 0):
                diffs.append(f"early handoffs: {early.opened - early_at.opened:g} opened, "
                             f"{early.fell_back - early_at.fell_back:g} fell back; want "
                             f"{moved} opened (path {handoff!r}); declined so far: "
                             f"{_declined(url)}")
            early_at = early
        if diffs:
            failed.append(f"form {i} {endpoint} {json.dumps(body)[:300]}\n  " +
                          "\n  ".join(diffs[:8]))
    assert not failed, f"{len(failed)} forms differ ({mode}):\n" + "\n".join(failed)
    # nothing pulled late (vLLM publishes a pull with a step of its engine)
    assert _pulls_moved(d, pulls_at, within_s=1.0) == pulls_at
    assert long_pd > 0, routes
    if mode == "decide-early":  # the decision took both routes
        assert any(r.startswith("decode_only:") and r != "decode_only:invalid_min_tokens"
                   for r in routes), routes
        return  # early dispatch serves the pd streams: no first token from prefill to count
    sent = metric(url, "kvdisagg_proxy_first_tokens_from_prefill_total", outcome="sent")
    ordinary = metric(url, "kvdisagg_proxy_first_tokens_from_prefill_total",
                      outcome="ordinary")
    assert (sent - sent0, ordinary - ordinary0) == (
        first_tokens, refused_late if mode == "first-token" else 0), routes


MIGRATING_FORMS = 3  # the seeded grammar's first forms that migration serves (contract.py)
MIGRATION_PATHS = ["ordinary", "first-token"]
BYTES_ONLY = [PARTIAL_BYTE, 106, 166, 255, 169]  # 0xC3 0xA9 0xE6 0x9D 0xE9: lead and tail bytes


def _byte_decoder() -> dict[str, int]:
    """The tiny model's byte-level alphabet (GPT-2's ``bytes_to_unicode``): character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars = {b: b for b in printable}
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + len(chars) - len(printable)
    return {chr(c): b for b, c in chars.items()}


@pytest.fixture(scope="module")
def token_bytes(model):
    """Token ids -> the bytes they stand for (special tokens: none, as vLLM skips them)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    special = {t.content for t in tok.get_added_tokens_decoder().values()}
    alphabet = _byte_decoder()

    def of(ids: list[int]) -> bytes:
        return bytes(alphabet[c] for i in ids if (t := tok.id_to_token(i)) not in special
                     for c in t)
    return of


def mid_character(data: bytes) -> bool:
    """Whether ``data`` ends inside a UTF-8 character (its lead byte came, not its last)."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    decoder.decode(data, final=False)
    return bool(decoder.getstate()[0])


def _cut_points(ids: list[int], first: int, token_bytes: Any) -> list[tuple[str, int | None]]:
    """Where to break an answer of token ids ``ids``, as (name, tokens the client has at the
    break; None: after the event with the finish reason): k 0, 1, a middle token inside a
    multi-byte character (the first such break inside decode's stream if there is one), the
    last token, and after the finish. ``first``: tokens the client has before decode's leg
    starts (1: prefill's first token); no break before them."""
    n = len(ids)
    mids = [j for j in range(max(1, first), n) if mid_character(token_bytes(ids[:j]))]
    mid = next((j for j in mids if j > first), mids[0] if mids else None)
    ks = {0: "k0", 1: "k1", n: "last"} | ({mid: "mid-character"} if mid is not None else {})
    if first:
        ks.setdefault(first + 1, f"k{first + 1}")  # decode's first token (k 1: before its leg)
    return [*((name, k) for k, name in sorted(ks.items()) if first <= k <= n),
            ("after-finish", None)]


def _migration_cases(endpoint_bodies_tag: int) -> list[tuple[str, str, dict[str, Any]]]:
    """(name, endpoint, body): streams of byte tokens and of token ids, each endpoint; and the
    seeded grammar's first MIGRATING_FORMS forms whose migration the contract allows."""
    cases = []
    for endpoint in ("completions", "chat"):
        for b, extra in enumerate([
                {"max_tokens": 8, "return_token_ids": True,
                 "stream_options": {"include_usage": True}},
                {"max_tokens": 6, "allowed_token_ids": BYTES_ONLY}]):
            prompt = f"break {endpoint} {b}: " + "tide and salt " * 60
            body = {"model": "tiny", "stream": True, "temperature": 0, **extra,
                    **({"messages": chat_msgs(prompt)} if endpoint == "chat"
                       else {"prompt": prompt})}
            cases.append((f"{endpoint}-{b}", endpoint, tagged(body, endpoint_bodies_tag)))
    grammar = [(i, ep, body) for i, (ep, body) in enumerate(forms(endpoint_bodies_tag)[:FORMS])
               if _expected_route(ep, body).migration is None]
    assert len(grammar) >= MIGRATING_FORMS, len(grammar)
    return cases + [(f"form{i}", ep, body) for i, ep, body in grammar[:MIGRATING_FORMS]]


@pytest.mark.parametrize("path", MIGRATION_PATHS)
def test_a_stream_broken_at_any_token_gives_the_plain_answer(fleet, token_bytes, path):
    """Migration, injected: decode's stream breaks at the client's k-th token (the relay cuts
    decode's leg there); the proxy finishes the answer on decode (the continuation) and the
    client's stream is the plain instance's, text included. k: 0, 1, a middle token inside a
    multi-byte character (computed from the plain answer's bytes; the byte-token streams
    always have one), the last token, and after the event with the finish reason (when vLLM
    sent it apart from the last token's). On the first-token path decode's leg starts after
    prefill's token: k counts it.

    Each break is checked where it fell (the relay's record: the tokens decode's leg had
    delivered) and by the path it took: a break after the finish reason only ends the stream
    (``finished``), one before decode's first event retries the leg before the client's first
    byte of it (no migration), any other migrates once (``ok``); decode pulled once for the
    handoff, and once more for the retry's or continuation's."""
    tag = 10 + MIGRATION_PATHS.index(path)
    with cutting_relay(fleet.decode.base_url) as relay:
        flags = ["--always-disaggregate", "--no-decode-only-fallback"]
        if path == "ordinary":
            flags.append("--no-first-token-from-prefill")
        url = fleet.extra_proxy(flags, f"conformance-migrate-{path}", decodes=[relay.url])
        if path == "first-token":
            _warm_first_token(url)
        d = fleet.decode.base_url
        failed: list[str] = []
        mid_cuts: list[str] = []
        for name, endpoint, body in _migration_cases(tag):
            paths = _expected_route(endpoint, body)
            want, _ = call(fleet.reference.base_url, endpoint, body)
            ids = want["choices"][0]["token_ids"]
            if ids is None:
                ids = call(fleet.reference.base_url, endpoint,
                           {**body, "return_token_ids": True})[0]["choices"][0]["token_ids"]
            first = int(path == "first-token" and paths.first_token is None)
            if len(ids) <= first:
                continue  # prefill's token is the whole answer: decode gets no leg
            for cut, k in _cut_points(ids, first, token_bytes):
                if k is None and relay.cut[-1].finished:
                    continue  # the last token's event carried the finish: the same break
                for attempt in range(3):
                    where = ("end" if k is None else "0" if k == first
                             else f"t{k - first}")
                    rid = f"cut{where}-{path}-{name}-{cut}-{attempt}"
                    diffs, fell = _broken_once(url, d, relay, endpoint, body, rid, want, k,
                                               first)
                    if fell:  # else vLLM merged events: the break fell later; again
                        break
                if not fell:
                    diffs.append(f"the break never fell at token {k}: {relay.cut[-1]}")
                if cut == "mid-character":
                    mid_cuts.append(name)
                if diffs:
                    failed.append(f"{name} {json.dumps(body)[:200]} broken at {cut} "
                                  f"(token {k}): " + "; ".join(diffs[:6]))
        assert not failed, "\n".join(failed)
        # the byte-token streams had a break inside a character, on each endpoint
        assert {"completions-1", "chat-1"} <= set(mid_cuts), mid_cuts


def _broken_once(url: str, decode: str, relay: Any, endpoint: str, body: dict[str, Any],
                 rid: str, want: dict[str, Any], k: int | None, first: int
                 ) -> tuple[list[str], bool]:
    """One request whose decode leg the relay breaks (``rid``): its differences from the plain
    answer ``want`` and from the path it should have taken, and whether the break fell where
    asked (after ``k - first`` of the leg's tokens)."""
    pulls0, mig0 = pulls(decode), _migrations(url)
    broken0 = len(relay.cut)
    got, handoff = call(url, endpoint, body, rid=rid)
    diffs = differences(got, want)
    if handoff != "pd":
        diffs.append(f"path {handoff!r}")
    if len(relay.cut) != broken0 + 1 or relay.cut[-1].rid != rid:
        return [*diffs, f"the relay broke {relay.cut[broken0:]}, not {rid}"], True
    broke = relay.cut[-1]
    fell = (broke.finished if k is None else len(broke.token_ids) == k - first)
    migrated = int(k is not None and k > first and not broke.finished)
    want_mig = {"ok": migrated, "finished": int(broke.finished)}
    got_mig = {o: n - mig0.get(o, 0) for o, n in _migrations(url).items()
               if n != mig0.get(o, 0)}
    if got_mig != {o: n for o, n in want_mig.items() if n}:
        diffs.append(f"migrations {got_mig}, want {want_mig}")
    # the leg broken before its first event may have pulled already (vLLM aborts it when
    # the relay goes away); its retry pulls a fresh handoff
    moved = _pulls_moved(decode, pulls0) - pulls0
    want_pulls = {1, 2} if k == first else {1 + migrated}
    if moved not in want_pulls:
        diffs.append(f"decode pulled {moved:g} times, want {sorted(want_pulls)}")
    return diffs, fell


def _migrations(url: str) -> dict[str, float]:
    """The proxy's migrations by outcome (ok, finished, exhausted, impossible, failed)."""
    found = scrape(url, "kvdisagg_proxy_migrations_total")
    return {s.labels["outcome"]: s.value for s in found}


# -- sampling equivalence ----------------------------------------------------------------------

SAMPLES = 160
ALPHA = 0.001


def _chi2(a: Counter[Any], b: Counter[Any]) -> float:
    keys = set(a) | set(b)
    na, nb = sum(a.values()), sum(b.values())
    stat = 0.0
    for k in keys:
        tot = a[k] + b[k]
        for n, c in ((na, a[k]), (nb, b[k])):
            e = tot * n / (na + nb)
            stat += (c - e) ** 2 / e if e else 0.0
    return stat


def _permutation_p(a: list[Any], b: list[Any], rounds: int = 2000) -> float:
    """The share of random relabellings whose chi-square is at least the observed one."""
    rng = random.Random(7)
    observed = _chi2(Counter(a), Counter(b))
    pooled = a + b
    hits = 0
    for _ in range(rounds):
        rng.shuffle(pooled)
        if _chi2(Counter(pooled[:len(a)]), Counter(pooled[len(a):])) >= observed - 1e-9:
            hits += 1
    return (hits + 1) / (rounds + 1)


def test_the_first_two_tokens_are_sampled_as_a_plain_instance_samples_them(fleet, proxies):
    """Unseeded sampling over a few tokens chosen to be hard (end of sequence, a special token
    without text, a byte of a multi-byte character, a letter): the distribution of the first
    two tokens through the first-token path equals the plain instance's. A path that sampled
    again after an unwanted first token would make that token's probability p² instead of p.

    Power: with SAMPLES answers a side, a permutation chi-square test at ALPHA 0.001 rejects
    a shift of one token's share from 0.25 to 0.0625 (the p² bias) with probability > 0.99
    (binomial: 40 vs 10 expected, z > 4.5), while a true equality fails once in a thousand
    runs."""
    from concurrent.futures import ThreadPoolExecutor

    url = proxies["first-token"]
    _warm_first_token(url)
    body = {"model": "tiny", "stream": True, "max_tokens": 2, "temperature": 2.0,
            "return_token_ids": True, "allowed_token_ids": [EOS, PAD, PARTIAL_BYTE, LETTER_C],
            "skip_special_tokens": True}
    sent0 = metric(url, "kvdisagg_proxy_first_tokens_from_prefill_total", outcome="sent")

    def sample(base: str, i: int) -> tuple[int, ...]:
        b = {**body, "prompt": f"sample {i % 8}: " + "sea " * 140}
        got, _ = call(base, "completions", b)
        assert not got["errors"] and got["done"], got
        return tuple(got["choices"][0]["token_ids"])

    with ThreadPoolExecutor(4) as pool:
        plain = list(pool.map(lambda i: sample(fleet.reference.base_url, i), range(SAMPLES)))
        pd = list(pool.map(lambda i: sample(url, i), range(SAMPLES)))
    assert metric(url, "kvdisagg_proxy_first_tokens_from_prefill_total",
                  outcome="sent") - sent0 == SAMPLES
    firsts_plain, firsts_pd = [t[0] for t in plain], [t[0] for t in pd]
    assert len(set(firsts_plain)) >= 3, Counter(firsts_plain)  # the test has something to see
    p_first = _permutation_p(firsts_plain, firsts_pd)
    p_pair = _permutation_p(plain, pd)
    assert p_first > ALPHA and p_pair > ALPHA, (Counter(firsts_plain), Counter(firsts_pd),
                                                p_first, p_pair)
