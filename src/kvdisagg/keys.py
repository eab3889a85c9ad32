"""Keys (API keys, the admin key) come from a file or an environment variable, never from the
command line: any local user can read a process's arguments (``ps``, ``/proc/PID/cmdline``).

A command takes ``--X-key-file FILE`` (a mounted Kubernetes Secret, a file of mode 0600) and
reads ``KVDISAGG_*`` from the environment when no file is given; a ``--X-key`` flag is kept
only to be refused with :func:`refused_on_command_line`, which says where the key goes instead.
Imports nothing of kvdisagg but ``errors``.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvdisagg.errors import ConfigError

API_KEY_ENV = "KVDISAGG_API_KEY"
"""The API key kvdisagg sends upstream as ``Authorization: Bearer`` when no file is given: the
proxy's to its vLLM instances (vLLM's ``--api-key``), bench's to the endpoints it measures."""
ADMIN_KEY_ENV = "KVDISAGG_ADMIN_KEY"
"""The key of the proxy's admin API when no file is given: the proxy requires it of every admin
call (``admin.key_file``), and ``kvdisagg admin`` sends it (``--key-file``)."""


def read_key_file(path: str, what: str) -> str:
    """The key in ``path`` (surrounding whitespace, a trailing newline, stripped); ConfigError
    naming ``what`` (the flag or config key) if the file is unreadable or empty."""
    try:
        key = Path(path).read_text().strip()
    except OSError as exc:
        raise ConfigError(f"{what}: cannot read {path}: {exc}") from None
    if not key:
        raise ConfigError(f"{what}: {path} is empty")
    return key


def key_from(path: str | None, env: str, what: str) -> str | None:
    """The key in ``path`` when given, else in the environment variable ``env``; None if
    neither holds one."""
    if path:
        return read_key_file(path, what)
    return os.environ.get(env, "").strip() or None


def refused_on_command_line(flag: str, file_flag: str, env: str) -> ConfigError:
    """The error for a key given as ``flag`` on the command line: where to put it instead."""
    return ConfigError(f"{flag} is not accepted: any local user can read a command line. Put "
                       f"the key in a file ({file_flag} FILE) or in the environment variable "
                       f"{env}")
