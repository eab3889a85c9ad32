"""OpenAI-style error responses, so OpenAI clients surface the message instead of a parse error.

(The exceptions themselves are in kvdisagg.errors.)"""

from __future__ import annotations

import msgspec
from aiohttp import web

_encode = msgspec.json.Encoder().encode


def error_body(status: int, message: str, type_: str) -> bytes:
    return _encode({"error": {"message": message, "type": type_, "param": None,
                              "code": status}})


def error_response(status: int, message: str, type_: str = "invalid_request_error",
                   headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=error_body(status, message, type_), status=status,
                        content_type="application/json", headers=headers)


def error_event(status: int, message: str, type_: str = "upstream_error") -> bytes:
    """An error as one SSE event then ``[DONE]``; used once streaming headers are sent."""
    return b"data: " + error_body(status, message, type_) + b"\n\ndata: [DONE]\n\n"
