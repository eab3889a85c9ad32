"""The Transport interface and the registry that resolves ``transport`` names.

The side channel (connector/side_channel.py) authenticates a pull and decides which blocks it
covers; the transport only moves those bytes. Views are given in stream order (see layout.py).
A transport is a name in TRANSPORTS or ``module:Class`` for a user's own.
"""

from __future__ import annotations

import importlib
import socket
from typing import Callable, ClassVar, Protocol, Sequence

from kvdisagg.errors import ConfigError


class Transport(Protocol):
    name: ClassVar[str]

    def send(self, sock: socket.socket, views: Sequence[memoryview]) -> None:
        """Prefill worker: deliver the views of an accepted Read to the puller."""
        ...

    def recv(self, sock: socket.socket, views: Sequence[memoryview]) -> None:
        """Decode worker: fill the views with the bytes of an accepted Read."""
        ...


def _tcp() -> type[Transport]:
    from kvdisagg.transport.tcp import TcpTransport

    return TcpTransport


TRANSPORTS: dict[str, Callable[[], type[Transport]]] = {"tcp": _tcp}


def load_transport(name: str) -> Transport:
    """Instantiate a transport by name or ``module:Class``; a bad name is a ConfigError."""
    if name in TRANSPORTS:
        return TRANSPORTS[name]()()
    module, _, cls = name.partition(":")
    if not cls:
        raise ConfigError(f"transport={name!r}: unknown; choose one of {sorted(TRANSPORTS)} "
                          "or give 'module:Class'")
    try:
        return getattr(importlib.import_module(module), cls)()
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"transport={name!r}: cannot load: {exc}") from None
