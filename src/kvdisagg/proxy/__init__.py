"""The OpenAI-compatible front door that performs the prefill -> decode handoff."""

from kvdisagg.proxy.app import make_app, run_proxy

__all__ = ["make_app", "run_proxy"]
