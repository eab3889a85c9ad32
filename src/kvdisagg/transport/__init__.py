"""Transports move a handoff's KV between workers; they never decide what may be read."""

from kvdisagg.transport.base import TRANSPORTS, Fetch, Offer, PullTiming, Transport, load_transport

__all__ = ["TRANSPORTS", "Fetch", "Offer", "PullTiming", "Transport", "load_transport"]
