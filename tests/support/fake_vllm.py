"""A fake vLLM OpenAI server for proxy tests and the proxy benchmark (no model, no engine).

It speaks the handoff protocol the proxy sees: a prefill request (``do_remote_decode``) gets
``kv_transfer_params`` back; a decode request streams ``tokens`` SSE events or returns one JSON
body. Faults are attributes a test can flip while it runs (status, delay, missing params,
dying mid-stream, hanging), and every request is recorded, including whether the proxy
aborted it. Run as a process for benchmarks:
``python -m tests.support.fake_vllm --port 8101 --tokens 16``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import threading
from collections.abc import Iterator
from typing import Any

import msgspec
from aiohttp import web

_dec = msgspec.json.Decoder().decode
_enc = msgspec.json.Encoder().encode


class FakeVllm:
    def __init__(self, name: str = "fake", tokens: int = 2, record: bool = True) -> None:
        self.name = name
        self.tokens = tokens
        self.record = record
        self.status = 200  # answer every generation request with this status
        self.delay_s = 0.0  # before answering
        self.with_kv = True  # prefill answers carry kv_transfer_params
        self.full_kv = False  # ... with every field DisaggConnector's have (else NIXL-like)
        self.aborting = False  # answer 200 finish_reason "abort", as a vLLM shutting down does
        self.die_after: int | None = None  # decode: close the connection after N events
        # decode: after N events, end the stream as vLLM does when its engine dies (an error
        # event of code 500, then [DONE]: EngineDeadError, e.g. killed at --shutdown-timeout)
        self.engine_dies_after: int | None = None
        # decode: end the stream cleanly after N events, without finish_reason or [DONE]
        # (an API server shutting down)
        self.ends_after: int | None = None
        self.hang_after: int | None = None  # decode: go silent after N events
        self.token_delay_s = 0.0  # streaming: pause before each token event (bench tests)
        self.use_max_tokens = False  # stream the request's max_tokens events, not ``tokens``
        self.health_status = 200
        self.health_delay_s = 0.0  # a slow /health (a starved host), not a dead one
        self.retiring = False  # /metrics says vllm:kvdisagg_retiring 1 (SIGTERM received)
        self.others = 0  # requests of other clients its queue gauges count (waiting)
        self.active = 0  # generation requests being answered (its running gauge)
        self.kv_load_failures = 0  # the next N decode legs with KV fail as vLLM does (policy fail)
        self.recomputed: dict[str, int] = {}  # vllm:kvdisagg_recomputed_prompts_total by reason
        self.max_model_len: int | None = None  # listed by /v1/models when set
        # The side-channel protocol versions (lo, hi) it speaks, as DisaggConnector says them:
        # its /metrics gauges, its handoff params (full_kv); a decode fails the load of a
        # handoff whose prefill speaks none of them, as vLLM does (policy fail). None: says
        # nothing, pairs with anything (another connector, an older release).
        self.protocol: tuple[int, int] | None = None
        # /detokenize as vLLM answers it, when set: "" for an id the tokenizer does not know
        # (>= vocab_size), text for the others; unset, the route echoes like any other
        self.vocab_size: int | None = None
        self.seen: list[dict[str, Any]] = []
        self.aborted = 0  # requests whose client (the proxy) went away before the end
        self.incompatible = 0  # decode legs with a handoff of a prefill it speaks no version of
        self._ids = itertools.count()

    def kv_params(self) -> dict[str, Any]:
        params: dict[str, Any] = {
            "do_remote_decode": False, "do_remote_prefill": True,
            "remote_engine_id": f"engine-{self.name}", "remote_request_id": "r",
            "remote_block_ids": [1, 2, 3], "remote_host": "127.0.0.1", "remote_port": 5600,
            "tp_size": 1}
        if self.full_kv:  # what DisaggConnector returns (early handoffs build on them)
            params |= {"remote_num_tokens": 40, "kvdisagg": {
                "transport": "tcp", "kv_layout": "fake", "token": "faketoken",
                "lease_expires": 0.0, "lease_s": 30.0, "ports": [5600]}}
            if self.protocol is not None:
                params["kvdisagg"] |= {"min_version": self.protocol[0],
                                       "version": self.protocol[1]}
        return params

    def speaks_with(self, kv: dict[str, Any]) -> bool:
        """Whether this decode speaks a protocol version of the handoff's prefill."""
        extras = kv.get("kvdisagg")
        if self.protocol is None or not isinstance(extras, dict) or "version" not in extras:
            return True
        hi, lo = extras["version"], extras.get("min_version") or extras["version"]
        return max(lo, self.protocol[0]) <= min(hi, self.protocol[1])

    async def generate(self, request: web.Request) -> web.StreamResponse:
        self.active += 1
        try:
            return await self._generate(request)
        finally:
            self.active -= 1

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = _dec(raw)
        if self.record:
            self.seen.append({"name": self.name, "raw": raw, "body": body, "path": request.path,
                              "headers": request.headers.copy()})
        chat = request.path.endswith("/chat/completions")
        try:
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            if self.status != 200:
                return web.Response(body=_enc({"error": {"message": f"{self.name} says no",
                                                         "type": "fake", "code": self.status}}),
                                    status=self.status, content_type="application/json")
            kv = body.get("kv_transfer_params") or {}
            if self.aborting:
                return web.json_response({"id": f"cmpl-{self.name}", "object": "text_completion",
                                          "choices": [{"index": 0, "text": "",
                                                       "finish_reason": "abort"}]})
            if kv.get("do_remote_decode"):
                out: dict[str, Any] = {"id": f"cmpl-{self.name}", "object": "text_completion",
                                       "choices": [{"index": 0, "text": "x"}]}
                if body.get("return_token_ids") is True:  # the first token, as vLLM says it
                    pids = _prompt_ids(body, chat)
                    choice = out["choices"][0]
                    choice |= {"finish_reason": "length", "stop_reason": None,
                               "token_ids": [99]}
                    if chat:
                        out |= {"id": f"chatcmpl-{self.name}", "prompt_token_ids": pids}
                        choice["message"] = {"role": "assistant", "content": choice.pop("text")}
                    else:
                        choice["prompt_token_ids"] = pids
                if self.with_kv:
                    out["kv_transfer_params"] = self.kv_params()
                return web.Response(body=_enc(out), content_type="application/json")
            if kv.get("do_remote_prefill") and self.kv_load_failures > 0:
                self.kv_load_failures -= 1
                return await self._kv_load_failure(request, bool(body.get("stream")))
            if kv.get("do_remote_prefill") and not self.speaks_with(kv):
                self.incompatible += 1
                return await self._kv_load_failure(request, bool(body.get("stream")))
            if body.get("stream"):
                n = body.get("max_tokens") if self.use_max_tokens else None
                return await self._stream(request, chat, n if isinstance(n, int) else None, body)
            text = "".join(f"t{i} " for i in range(self.tokens))
            choices = [({"index": j, "message": {"role": "assistant", "content": text}}
                        if chat else {"index": j, "text": text, "prompt_echo": body.get("prompt")})
                       for j in range(body.get("n") or 1)]
            return web.Response(body=_enc({
                "id": f"cmpl-{self.name}-{next(self._ids)}", "choices": choices,
                "usage": {"prompt_tokens": _prompt_tokens(body),
                          "completion_tokens": self.tokens * len(choices),
                          "total_tokens": _prompt_tokens(body) + self.tokens * len(choices)}}),
                content_type="application/json")
        except (asyncio.CancelledError, ConnectionResetError):
            self.aborted += 1
            raise

    async def _stream(self, request: web.Request, chat: bool, tokens: int | None = None,
                      body: dict[str, Any] | None = None) -> web.StreamResponse:
        """Events shaped as vLLM 0.32 writes them: completions carry ``prompt_token_ids`` and
        ``token_ids`` (null unless ``return_token_ids``), chat too, starting with a role chunk.
        Token k of an answer is ``t{k}`` (id 100 + k), the last with finish_reason length; a prompt
        that ends with ids >= 100 (a migrated stream's continuation) continues the count."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        body = body or {}
        rid = f"cmpl-{self.name}-{next(self._ids)}"
        ids = body.get("return_token_ids") is True
        pids = _prompt_ids(body, chat)
        offset = sum(1 for t in pids if t >= 100)
        n = body.get("n") or 1
        count = self.tokens if tokens is None else tokens
        if chat:
            for j in range(n):
                role: dict[str, Any] = {"id": rid, "choices": [
                    {"index": j, "delta": {"role": "assistant", "content": ""}}]}
                role |= {"prompt_token_ids": pids if ids else None, "prompt_text": None}
                await resp.write(b"data: " + _enc(role) + b"\n\n")
        for i in range(count):
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
            if self.die_after is not None and i >= self.die_after:
                assert request.transport is not None
                request.transport.abort()
                return resp
            if self.ends_after is not None and i >= self.ends_after:
                await resp.write_eof()
                return resp
            if self.engine_dies_after is not None and i >= self.engine_dies_after:
                dead = {"error": {"message": "EngineCore encountered an issue. See stack trace "
                                  "(above) for the root cause.", "type": "InternalServerError",
                                  "param": None, "code": 500}}
                await resp.write(b"data: " + _enc(dead) + b"\n\ndata: [DONE]\n\n")
                return resp
            if self.hang_after is not None and i >= self.hang_after:
                await asyncio.sleep(3600)
            k = offset + i
            for j in range(n):
                choice: dict[str, Any]
                if chat:
                    choice = {"index": j, "delta": {"content": f"t{k} "},
                              "token_ids": [100 + k] if ids else None}
                else:
                    choice = {"index": j, "text": f"t{k} ",
                              "prompt_token_ids": pids if ids and i == 0 else None,
                              "token_ids": [100 + k] if ids else None}
                    if isinstance(body.get("prompt"), str) and body["prompt"].startswith("#") \
                            or (body.get("prompt") is not None and n > 1):
                        choice["prompt_echo"] = body["prompt"]
                choice["finish_reason"] = "length" if i == count - 1 else None
                await resp.write(b"data: " + _enc({"id": rid, "choices": [choice]}) + b"\n\n")
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": len(pids), "completion_tokens": count * n,
                     "total_tokens": len(pids) + count * n}
            await resp.write(b"data: " + _enc({"id": rid, "choices": [],
                                               "usage": usage}) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _kv_load_failure(self, request: web.Request,
                               stream: bool) -> web.StreamResponse:
        """What vLLM 0.32 answers when a KV load fails under ``kv_load_failure_policy`` fail."""
        err = _enc({"error": {"message": "Internal server error", "type": "InternalServerError",
                              "param": None, "code": 500}})
        if not stream:
            return web.Response(body=err, status=500, content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: " + err + b"\n\ndata: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def health(self, _request: web.Request) -> web.Response:
        await asyncio.sleep(self.health_delay_s)
        return web.Response(status=self.health_status, text="")

    async def metrics(self, _request: web.Request) -> web.Response:
        """vLLM's queue gauges, and the connector's recompute counter as vLLM renders it
        (with its ``_created`` sample, which is not a count)."""
        text = (f'vllm:num_requests_waiting{{engine="0"}} {float(self.others)}\n'
                f'vllm:num_requests_running{{engine="0"}} {float(self.active)}\n')
        for reason, n in self.recomputed.items():
            labels = f'{{engine="0",model_name="tiny",reason="{reason}"}}'
            text += (f"vllm:kvdisagg_recomputed_prompts_total{labels} {float(n)}\n"
                     f"vllm:kvdisagg_recomputed_prompts_created{labels} 1.7e9\n")
        if self.retiring:  # SIGTERM received
            text += 'vllm:kvdisagg_retiring{engine="0"} 1.0\n'
        if self.protocol is not None:
            text += (f'vllm:kvdisagg_protocol_version_min{{engine="0"}} '
                     f'{float(self.protocol[0])}\n'
                     f'vllm:kvdisagg_protocol_version{{engine="0"}} {float(self.protocol[1])}\n')
        return web.Response(text=text)

    async def models(self, _request: web.Request) -> web.Response:
        card: dict[str, Any] = {"id": "tiny"}
        if self.max_model_len is not None:
            card["max_model_len"] = self.max_model_len
        return web.json_response({"object": "list", "data": [card]})

    async def detokenize(self, request: web.Request) -> web.Response:
        if self.vocab_size is None:
            return await self.other(request)
        body = await request.json()
        if self.record:
            self.seen.append({"name": self.name, "raw": b"", "path": request.path_qs,
                              "headers": request.headers.copy(), "body": body})
        known = [t for t in body.get("tokens") or [] if 0 <= t < self.vocab_size]
        return web.json_response({"prompt": "".join(f"<{t}>" for t in known)})

    async def other(self, request: web.Request) -> web.Response:
        """Any other vLLM route: echoes what it got (a control route must never be reached)."""
        raw = await request.read()
        if self.record:
            self.seen.append({"name": self.name, "raw": raw, "path": request.path_qs,
                              "headers": request.headers.copy(), "body": None})
        return web.json_response({"route": request.path_qs, "method": request.method,
                                  "got": raw.decode()})

    def app(self) -> web.Application:
        app = web.Application()
        for method, path in (("POST", "/tokenize"), ("POST", "/pause"),
                             ("POST", "/v1/responses")):
            app.router.add_route(method, path, self.other)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_post("/v1/chat/completions", self.generate)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/v1/models", self.models)
        return app


@contextlib.contextmanager
def served_in_thread(fake: FakeVllm) -> Iterator[str]:
    """``fake`` on loopback, answered from a thread and event loop of its own, for code under
    test that blocks or runs its own loop (``asyncio.run``); yields the base URL."""
    from aiohttp.test_utils import TestServer

    loop = asyncio.new_event_loop()
    server = TestServer(fake.app(), host="127.0.0.1")
    started = threading.Event()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(server.start_server())
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    if not started.wait(10):
        raise RuntimeError("the fake vLLM server did not start")
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def _prompt_tokens(body: dict[str, Any]) -> int:
    p = body.get("prompt")
    return len(p) if isinstance(p, (str, list)) else 4


def _prompt_ids(body: dict[str, Any], chat: bool) -> list[int]:
    """The fake's tokenization: ids given (a prompt of ids, or vLLM's forwarded
    ``kv_transfer_params.prompt_token_ids``), else one id per character, all below 100."""
    forwarded = (body.get("kv_transfer_params") or {}).get("prompt_token_ids")
    if isinstance(forwarded, list):
        return forwarded
    p = body.get("prompt")
    if not chat and isinstance(p, list) and all(isinstance(t, int) for t in p):
        return p
    text = p if isinstance(p, str) else "".join(
        str(m.get("content")) for m in body.get("messages") or [] if isinstance(m, dict))
    return [3 + ord(c) % 90 for c in text] or [3]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--name", default="fake")
    p.add_argument("--token-delay-ms", type=float, default=0.0,
                   help="pause before each streamed event (paced like a real engine)")
    p.add_argument("--vocab-size", type=int,
                   help="answer /detokenize as vLLM does for a vocabulary of this many ids")
    args = p.parse_args(argv)
    import uvloop

    fake = FakeVllm(args.name, args.tokens, record=False)
    fake.token_delay_s = args.token_delay_ms / 1000
    fake.vocab_size = args.vocab_size
    uvloop.install()
    web.run_app(fake.app(), host=args.host, port=args.port, access_log=None, print=None,
                backlog=2048)


if __name__ == "__main__":
    main()
