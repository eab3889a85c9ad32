"""Request migration (proxy/handoff/migrate.py, issue 18) against fake vLLM upstreams on loopback: a
stream whose decode fails mid-way goes on on another decode, and which streams are tapped."""

from __future__ import annotations

from typing import Any

from kvdisagg.proxy.config import RetryConfig
from tests.support.proxy_harness import events, metric, post_stream, proxy, run


def token_texts(evs: list[Any], chat: bool = False) -> list[str]:
    out = []
    for e in evs:
        if e == "[DONE]" or "error" in e:
            continue
        for c in e.get("choices") or []:
            text = (c.get("delta") or {}).get("content") if chat else c.get("text")
            if text:
                out.append(text)
    return out


def test_stream_migrates_to_another_decode_without_gap_or_duplicate() -> None:
    async def t(chat: bool) -> None:
        async with proxy(n_decode=2) as env:
            for d in env.decode:
                d.use_max_tokens = True
            env.decode[0].die_after = 3  # the decision's round robin starts with d0
            data = await post_stream(env, chat, 8)
            evs = events(data)
            assert token_texts(evs, chat) == [f"t{k} " for k in range(8)]
            assert evs[-1] == "[DONE]" and evs.count("[DONE]") == 1
            assert not any("error" in e for e in evs if e != "[DONE]")
            assert b'"token_ids":[' not in data  # the client did not ask for them
            assert len({e["id"] for e in evs if e != "[DONE]"}) == 1
            if chat:
                assert sum(1 for e in evs[:-1] for c in e["choices"]
                           if (c.get("delta") or {}).get("role")) == 1
            usage = evs[-2]["usage"]  # the whole answer, as one uninterrupted stream
            assert usage == {"prompt_tokens": 5 if not chat else 5, "completion_tokens": 8,
                             "total_tokens": 13}
            # the continuation: prompt + the 3 delivered tokens, 5 left to generate
            (cont,) = env.decode[1].seen
            cb = cont["body"]
            assert cb["max_tokens"] == 5 and cb["return_token_ids"] is True
            ids = (cb["kv_transfer_params"]["prompt_token_ids"] if chat else cb["prompt"])
            assert ids[-3:] == [100, 101, 102] and len(ids) == 8
            # decode's detokenizer resumes where the original prompt ended
            assert cb["kv_transfer_params"]["kvdisagg_resume"] == 5
            text = await env.metrics()
            assert metric(text, "kvdisagg_proxy_migrations_total", outcome="ok") == 1
            assert metric(text, "kvdisagg_proxy_requests_total", outcome="ok") == 1
            assert metric(text, "kvdisagg_proxy_instance_in_flight") == 0
    run(t(False))
    run(t(True))


def test_a_stream_vllm_ends_with_a_server_error_migrates() -> None:
    """vLLM ends a running stream with an error event of code 500 when its engine dies (a
    decode killed at its --shutdown-timeout): the proxy keeps that event and its [DONE] from
    the client and finishes the answer on the other decode. A request's own error (code 400)
    is passed through as vLLM sent it."""
    async def t() -> None:
        async with proxy(n_decode=2) as env:
            for d in env.decode:
                d.use_max_tokens = True
            env.decode[0].engine_dies_after = 3
            body = {"model": "tiny", "prompt": "hello", "max_tokens": 8, "stream": True}
            evs = events(await (await env.client.post("/v1/completions", json=body)).read())
            assert token_texts(evs) == [f"t{k} " for k in range(8)]
            assert not any("error" in e for e in evs if e != "[DONE]")
            assert evs.count("[DONE]") == 1 and evs[-1] == "[DONE]"
            (cont,) = env.decode[1].seen
            assert cont["body"]["max_tokens"] == 5 and cont["body"]["prompt"][-3:] == [
                100, 101, 102]
            text = await env.metrics()
            assert metric(text, "kvdisagg_proxy_migrations_total", outcome="ok") == 1
            assert metric(text, "kvdisagg_proxy_instance_in_flight") == 0
    run(t())


def test_a_stream_that_ends_cleanly_before_its_finish_reason_migrates() -> None:
    """An API server shutting down may end a stream cleanly (its chunked body terminated)
    with no finish_reason and no [DONE], after some tokens or none: relayed as the end, the
    client got a cut answer (the full run's decode SIGTERM). The leg failed: the rest of the
    answer is migrated, whole and once."""
    async def t(after: int) -> None:
        async with proxy(n_decode=2) as env:
            for d in env.decode:
                d.use_max_tokens = True
            env.decode[0].ends_after = after
            body = {"model": "tiny", "prompt": "hello", "max_tokens": 8, "stream": True}
            evs = events(await (await env.client.post("/v1/completions", json=body)).read())
            assert token_texts(evs) == [f"t{k} " for k in range(8)]
            assert not any("error" in e for e in evs if e != "[DONE]")
            assert evs.count("[DONE]") == 1 and evs[-1] == "[DONE]"
            (cont,) = env.decode[1].seen
            assert cont["body"]["max_tokens"] == 8 - after
            text = await env.metrics()
            assert metric(text, "kvdisagg_proxy_migrations_total", outcome="ok") == 1
            assert metric(text, "kvdisagg_proxy_instance_in_flight") == 0
    run(t(3))
    run(t(1))


def test_a_client_error_event_mid_stream_is_not_migrated() -> None:
    from kvdisagg.proxy.handoff.migrate import Tap

    tap = Tap(chat=False, strip=False)
    ok = b'data: {"id":"x","choices":[{"text":"a","token_ids":[5]}]}\n\n'
    bad = b'data: {"error":{"message":"bad","type":"BadRequestError","code":400}}\n\n'
    assert tap.feed(ok + bad) == ok + bad and tap.failure is None
    dead = b'data: {"error":{"message":"EngineCore died","code":500}}\n\ndata: [DONE]\n\n'
    assert tap.feed(ok + dead[:20]) == ok  # an event cut in two waits for its end
    assert tap.feed(dead[20:]) == b"" and tap.failure == "EngineCore died"
    assert tap.feed(ok) == b""  # nothing after the failure reaches the client
    assert tap.ids == [5, 5]  # what the client got, not what came after the failure


def test_only_decode_failing_twice_still_finishes_the_stream_then_gives_up() -> None:
    async def t(fault: str, tokens: int, migrations: int, finished: bool) -> None:
        async with proxy(retry=RetryConfig(migrations=migrations)) as env:
            d = env.decode[0]
            d.use_max_tokens = True
            setattr(d, fault, 2)
            r = await env.client.post("/v1/completions", json={
                "model": "tiny", "prompt": "hello", "max_tokens": tokens, "stream": True,
                "return_token_ids": True})
            evs = events(await r.read())
            texts = token_texts(evs)
            if finished:
                assert texts == [f"t{k} " for k in range(tokens)]
                # the client asked for token ids: it gets them, one per token, in order
                ids = [i for e in evs[:-1] for c in e["choices"] for i in c["token_ids"]]
                assert ids == [100 + k for k in range(tokens)]
            else:
                assert texts == [f"t{k} " for k in range(2 * (migrations + 1))]
                assert "error" in evs[-2] and f"after {migrations} migrations" in \
                    evs[-2]["error"]["message"]
            text = await env.metrics()
            assert metric(text, "kvdisagg_proxy_migrations_total", outcome="ok") == \
                migrations
    run(t("die_after", 5, 2, True))  # 2 + 2 + 1 tokens over three legs
    run(t("hang_after", 5, 2, True))  # silent past decode_idle_s: moved as well
    run(t("die_after", 9, 2, False))


def test_n_streams_are_not_migrated() -> None:
    async def t() -> None:
        async with proxy(n_decode=2) as env:
            env.decode[0].tokens, env.decode[0].die_after = 5, 2
            r = await env.client.post("/v1/completions", json={
                "model": "tiny", "prompt": "hello", "max_tokens": 5, "n": 2, "stream": True})
            evs = events(await r.read())
            assert "error" in evs[-2] and evs[-1] == "[DONE]"
            assert "return_token_ids" not in env.decode[0].seen[0]["body"]
            assert env.decode[1].seen == []
    run(t())


def test_echo_streams_ask_decode_for_no_token_ids() -> None:
    """vLLM echoes no prompt text when return_token_ids is set: an echo stream is not tapped."""
    async def t() -> None:
        async with proxy() as env:
            r = await env.client.post("/v1/completions", json={
                "model": "tiny", "prompt": "hi", "max_tokens": 2, "stream": True, "echo": True})
            assert r.status == 200
            assert "return_token_ids" not in env.decode[0].seen[0]["body"]
    run(t())


def _event(doc: dict[str, Any]) -> bytes:
    import json

    return b"data: " + json.dumps(doc, separators=(",", ":")).encode() + b"\n\n"


def test_a_continuation_keeps_the_originals_created_and_prompt_ids() -> None:
    """(issue 26 #4) return_token_ids streams: the continuation's first event carries its own
    prompt (the original's plus the delivered tokens) and its own creation time; the client
    gets the original's prompt ids once, in the first event, and one ``created``."""
    import json

    from kvdisagg.proxy.handoff.migrate import Tap

    first = Tap(False, strip=False)
    first.feed(_event({"id": "cmpl-a", "created": 100, "model": "tiny", "choices": [{
        "index": 0, "text": "x", "prompt_token_ids": [1, 2], "token_ids": [7]}]}))
    resumed = Tap(False, strip=False, resumed=first)
    out = resumed.feed(_event({"id": "cmpl-b", "created": 105, "model": "tiny", "choices": [{
        "index": 0, "text": "y", "prompt_token_ids": [1, 2, 7], "token_ids": [8]}]}))
    doc = json.loads(out[6:])
    assert (doc["id"], doc["created"]) == ("cmpl-a", 100)
    assert doc["choices"][0]["prompt_token_ids"] is None
    assert resumed.ids == [7, 8] and resumed.prompt_ids == [1, 2]


def test_a_break_after_the_last_token_ends_the_stream_as_vllm_would() -> None:
    """(issue 26 #6) the finish_reason was delivered: a continuation would generate past the
    end (or fail: nothing left of the limit). The client gets the usage event it asked for,
    counted as vLLM counts it, and [DONE]."""
    import json

    from kvdisagg.proxy.handoff.migrate import Tap, ending

    tap = Tap(True, strip=True)
    tap.feed(_event({"id": "chatcmpl-a", "object": "chat.completion.chunk", "created": 9,
                     "model": "tiny", "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                         "content": ""}}],
                     "prompt_token_ids": [1, 2, 3]}))
    assert not tap.finished
    tap.feed(_event({"id": "chatcmpl-a", "object": "chat.completion.chunk", "created": 9,
                     "model": "tiny", "choices": [{"index": 0, "delta": {"content": "z"},
                                                   "finish_reason": "stop",
                                                   "token_ids": [4, 5]}]}))
    assert tap.finished and not tap.usage_sent
    end = ending(tap, include_usage=True)
    usage, done = [e for e in end.split(b"\n\n") if e]
    assert done == b"data: [DONE]"
    assert json.loads(usage[6:]) == {
        "id": "chatcmpl-a", "object": "chat.completion.chunk", "created": 9, "model": "tiny",
        "choices": [], "usage": {"prompt_tokens": 3, "total_tokens": 5, "completion_tokens": 2}}
    assert ending(tap, include_usage=False) == b"data: [DONE]\n\n"


def test_an_aborted_answer_is_not_a_finished_one() -> None:
    """An engine shutting down (SIGTERM) ends its streams with finish_reason abort: the rest
    of the answer must be migrated, not the stream ended there (test_retire's decode SIGTERM
    caught it)."""
    from kvdisagg.proxy.handoff.migrate import Tap

    tap = Tap(False, strip=False)
    out = tap.feed(_event({"id": "c", "created": 1, "model": "tiny", "choices": [{
        "index": 0, "text": "a", "token_ids": [4]}]}) + _event({
            "id": "c", "created": 1, "model": "tiny", "choices": [{
                "index": 0, "text": "", "finish_reason": "abort", "token_ids": []}]}))
    assert not tap.finished and tap.failure is not None  # the leg failed: migrate the rest
    assert b"abort" not in out and tap.ids == [4]  # the client never sees the abort
    tap = Tap(False, strip=False)
    tap.feed(_event({"id": "c", "created": 1, "model": "tiny", "choices": [{
        "index": 0, "text": "x", "finish_reason": "length", "token_ids": [5]}]}))
    assert tap.finished


def test_a_stream_that_ends_before_its_finish_reason_failed() -> None:
    """vLLM's stream generator just ends (usage event, [DONE]) when its engine shuts down under
    a request it had not started; relayed, the client got prefill's first token and [DONE]
    (test_retire's decode SIGTERM in CI). The leg failed: the rest of the answer is migrated."""
    from kvdisagg.proxy.handoff.migrate import Tap

    head = _event({"id": "c", "created": 1, "model": "tiny", "choices": [{
        "index": 0, "text": "a", "token_ids": [4]}]})
    usage = _event({"id": "c", "created": 1, "model": "tiny", "choices": [],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}})
    for tail in (b"data: [DONE]\n\n", usage + b"data: [DONE]\n\n"):
        tap = Tap(False, strip=False)
        assert tap.feed(head + tail) == head  # kept back: not for the client
        assert tap.failure is not None and not tap.finished and tap.ids == [4]
        tap = Tap(False, strip=False)  # the end in a later read than the last token
        assert tap.feed(head) == head and tap.failure is None
        assert tap.feed(tail) == b"" and tap.failure is not None
    # The request's own error (a 4xx event) ends the answer: its [DONE] goes to the client.
    tap = Tap(False, strip=False)
    refusal = _event({"error": {"message": "bad", "type": "BadRequestError", "code": 400}})
    assert tap.feed(refusal + b"data: [DONE]\n\n") == refusal + b"data: [DONE]\n\n"
    assert tap.failure is None
    # A finished answer's usage event and [DONE] pass, in the same read or a later one.
    done = _event({"id": "c", "created": 1, "model": "tiny", "choices": [{
        "index": 0, "text": "", "finish_reason": "stop", "token_ids": [2]}]})
    tap = Tap(False, strip=False)
    assert tap.feed(head + done + usage + b"data: [DONE]\n\n") == (
        head + done + usage + b"data: [DONE]\n\n")
    assert tap.failure is None and tap.finished
