"""OpenAI-style errors, so OpenAI clients surface the message instead of a parse error, and
``Refusal``: the one exception that ends a request with an HTTP error.

A stage that cannot serve a request (a bad body, no instance, every try failed, a client error
an upstream answered) raises ``Refusal``; the front door (serving.py) is the one place that
turns it into the client's response. Once the client has the stream's headers, the stage that
holds the stream writes it as an error event instead (``error_event``).

Imports nothing of the proxy. (kvdisagg.errors holds the other exceptions.)
"""

from __future__ import annotations

import math

import msgspec
from aiohttp import web

from kvdisagg.errors import ProxyError

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


class Refusal(ProxyError):
    """The request ends with this HTTP error: ``status`` and a JSON ``body`` (OpenAI-style, or
    an upstream's error as it came), with ``headers`` (``Retry-After``)."""

    def __init__(self, status: int, body: bytes, headers: dict[str, str] | None = None,
                 content_type: str | None = "application/json") -> None:
        super().__init__(f"{status}: {body[:300].decode('utf-8', 'replace')}")
        self.status, self.body, self.headers = status, body, headers
        self.content_type = content_type  # None: aiohttp's default (bytes: octet-stream)

    @classmethod
    def error(cls, status: int, message: str, type_: str = "invalid_request_error",
              headers: dict[str, str] | None = None) -> Refusal:
        return cls(status, error_body(status, message, type_), headers)

    @classmethod
    def retry_later(cls, status: int, message: str, type_: str = "service_unavailable",
                    retry_after_s: float = 1.0) -> Refusal:
        """Turned away before any leg (429/503), with a ``Retry-After`` to come back."""
        return cls.error(status, message, type_,
                         {"Retry-After": str(max(1, math.ceil(retry_after_s)))})

    @classmethod
    def relayed(cls, status: int, data: bytes, message: str) -> Refusal:
        """An upstream's 4xx: its JSON body if it is OpenAI-style, else ``message`` wrapped."""
        if data.startswith(b"{") and b'"error"' in data[:200]:
            return cls(status, data)
        return cls.error(status, message)

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")

    @property
    def outcome(self) -> str:
        """The ``outcome`` label of ``kvdisagg_proxy_requests_total``."""
        return "shed" if self.status == 429 else "error"

    def response(self) -> web.Response:
        return web.Response(body=self.body, status=self.status,
                            content_type=self.content_type, headers=self.headers)
