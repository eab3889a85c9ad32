"""Transports move a granted pull's KV bytes; they never decide what may be read."""

from kvdisagg.transport.base import Transport, load_transport

__all__ = ["Transport", "load_transport"]
