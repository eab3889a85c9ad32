"""What a process listens on, read from /proc (Linux), and free port ranges to configure.

The transport tests use these to check that a configured port is the one a listener took,
on the address it was told, and that nothing else listens where it should not.
"""

from __future__ import annotations

import ipaddress
import os
import random
import socket
from typing import NamedTuple


class Listener(NamedTuple):
    host: str  # "0.0.0.0" or "::" for every interface
    port: int


def _address(hex_addr: str) -> str:
    """/proc/net/tcp{,6}'s address: 32-bit words in host byte order (little-endian here)."""
    raw = bytes.fromhex(hex_addr)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words))


def listening(pid: int) -> set[Listener]:
    """The TCP sockets process ``pid`` holds in LISTEN state."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = set()
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    host, port = fields[1].rsplit(":", 1)
                    out.add(Listener(_address(host), int(port, 16)))
    return out


def free_range(count: int, below: int | None = None) -> int:
    """The first of ``count`` consecutive ports that are free now on every interface, all
    below ``below`` if given (else the OS's ephemeral range supplies it). The caller binds them
    soon after; another process may race it, as with any free port."""
    rng = random.Random()
    for _ in range(200):
        if below is None:
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                base = probe.getsockname()[1]
        else:
            base = rng.randrange(max(1024, below - 8000), below - count + 1)
        if base + count > 65536:
            continue
        held = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                held.append(s)
                s.bind(("0.0.0.0", port))
            return base
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise RuntimeError(f"no {count} consecutive free ports found")
