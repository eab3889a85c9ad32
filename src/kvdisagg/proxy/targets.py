"""The forms of a discovery target (``host:port``, ``srv:_http._tcp.name``) and member URLs.

Pure parsing, shared by the config's validation and by discovery; imports nothing from the
proxy.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["Target", "parse_hostport", "parse_target", "url_for"]


class Target(NamedTuple):
    """One configured DNS name: ``srv`` True for SRV records, else A/AAAA with ``port``."""

    name: str
    port: int | None
    srv: bool


def parse_hostport(text: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port``; ValueError says what is wrong."""
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise ValueError(f"{text!r} is not host:port")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"{text!r}: write an IPv6 address as [addr]:port")
    try:
        p = int(port)
    except ValueError:
        raise ValueError(f"{text!r}: port {port!r} is not a number") from None
    if not 1 <= p <= 65535:
        raise ValueError(f"{text!r}: port {p} is not in 1-65535")
    return host, p


def parse_target(text: str) -> Target:
    """``host:port`` (A/AAAA) or ``srv:_service._proto.name`` (SRV)."""
    if text.startswith("srv:"):
        name = text[4:].strip()
        if not name or ":" in name:
            raise ValueError(f"{text!r}: SRV form is srv:_http._tcp.name (no port: "
                             "SRV records carry it)")
        return Target(name, None, True)
    host, port = parse_hostport(text)
    return Target(host, port, False)


def url_for(host: str, port: int) -> str:
    host = host.rstrip(".")
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    return f"http://{host}:{port}"
