"""The OpenAI-compatible front door that performs the prefill -> decode handoff.

``make_app`` is loaded on first use, so importing one of the proxy's modules
(``kvdisagg.proxy.routing.body``) does not import the whole application.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvdisagg.proxy.app import make_app

__all__ = ["make_app"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from kvdisagg.proxy import app

        return getattr(app, name)
    raise AttributeError(f"module 'kvdisagg.proxy' has no attribute {name!r}")
