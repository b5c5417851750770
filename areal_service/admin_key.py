"""The admin key actually in force: never the shipped default on a reachable address.

`gateway.auth.admin_key` defaults to `sk-areal-admin` so a first local run needs no setup;
that value is public, so:

- bound to a non-loopback address with the default, the gateway refuses to start
  (`DefaultAdminKeyError`, naming the setting to change);
- on loopback with the default, a random key is generated once per data dir, kept in
  `<data_dir>/admin_key` (mode 0600), and used instead. Only what serves creates it
  (the gateway, `serve`, and the commands that start a gateway of their own: demo,
  train, eval); `load_config` only reads it when it exists, so every process loading
  the same config (gateway workers, agents, trainer, CLI, tests) agrees without anyone
  typing it, and a command that serves nothing (`keys`, `config show`, `export`) neither
  writes the file nor logs a key.

A key set explicitly (config file, `--set`, `AREAL_GATEWAY__AUTH__ADMIN_KEY`) is used as is.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
from pathlib import Path

DEFAULT_ADMIN_KEY = "sk-areal-admin"
KEY_FILE = "admin_key"


class DefaultAdminKeyError(RuntimeError):
    """The default admin key on an address other machines can reach."""


def is_loopback(host: str) -> bool:
    """Whether `host` is only reachable from this machine (`localhost`, 127.0.0.0/8,
    ::1). `0.0.0.0`, `::` and any name or other address count as reachable."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def resolve_admin_key(
    key: str, host: str, data_dir: Path, *, binding: bool = False, create: bool = True
) -> tuple[str, bool]:
    """(the admin key in force, whether `<data_dir>/admin_key` was just created).

    `binding`: the caller is about to listen on `host` (the gateway, `serve`): the
    default key on a non-loopback address raises `DefaultAdminKeyError`. Other callers
    keep the default there (a client of a reachable gateway needs the real key set
    explicitly anyway, and the gateway will refuse to start with it). `create=False`
    only reads a key file that exists (the default stays in force without one)."""
    if key != DEFAULT_ADMIN_KEY:
        return key, False
    if not is_loopback(host):
        if binding:
            raise DefaultAdminKeyError(
                f"refusing to serve on {host} with the default admin key "
                f"{DEFAULT_ADMIN_KEY!r}, which anyone can read in the docs: set "
                "gateway.auth.admin_key (AREAL_GATEWAY__AUTH__ADMIN_KEY, or --set "
                "gateway.auth.admin_key=...) to a secret, or bind gateway.host to 127.0.0.1"
            )
        return key, False
    if not create:
        return _read(data_dir / KEY_FILE) or key, False
    return _read_or_create(data_dir / KEY_FILE)


def _read(path: Path) -> str | None:
    """The key in `path`; None when there is no file or it is empty."""
    try:
        return path.read_text().strip() or None
    except FileNotFoundError:
        return None


def _read_or_create(path: Path) -> tuple[str, bool]:
    """The key in `path`, creating it (0600, exclusively: two processes starting at once
    agree on one key) when absent."""
    key = _read(path)
    if key:
        return key, False
    path.parent.mkdir(parents=True, exist_ok=True)
    key = f"sk-areal-admin-{secrets.token_urlsafe(24)}"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another process won the race, or an empty file was left
        existing = path.read_text().strip()
        if existing:
            return existing, False
        fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
    with os.fdopen(fd, "w") as out:
        out.write(key + "\n")
    path.chmod(0o600)
    return key, True
