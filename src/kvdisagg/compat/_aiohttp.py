"""A stream response that sends its headers with its first chunk (aiohttp 3.x).

``web.Response`` sends headers and a whole body in one write; ``web.StreamResponse`` writes its
headers at ``prepare()``, a separate write (and packet) before the first event of a relayed
stream. Its class attribute ``_send_headers_immediately`` (False: keep them for the first
write) is private; the proxy's relay prepares only once it holds that first chunk.
"""

from __future__ import annotations

from aiohttp import web


class HeadersWithFirstChunk(web.StreamResponse):
    _send_headers_immediately = False
