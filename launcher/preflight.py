"""Checks made before a command starts any process, so a mistake costs a second and one
sentence rather than a model load, a traceback and a log to dig through: the checkpoint
folder exists and is one, and the ports the command would bind are free (a busy port
would otherwise let a health check reach *another* server and report its success)."""

from __future__ import annotations

import errno
import socket
from pathlib import Path


class StartError(RuntimeError):
    """A command cannot start (or a child it started died before it was ready); the
    message names the cause and the next step, and the CLI prints it as one line."""


class NotReadyError(StartError, TimeoutError):
    """A child did not answer its health check in time (still a TimeoutError for callers
    that wait on several)."""


def check_model_dir(path: Path | str) -> None:
    """StartError unless `path` is a folder holding a Hugging Face checkpoint
    (`config.json`); for a missing `weights/vN` it lists the versions that exist."""
    path = Path(path)
    if not path.exists():
        hint = ""
        versions = sorted(
            (p.name for p in path.parent.glob("v[0-9]*") if p.is_dir()),
            key=lambda name: int(name[1:]) if name[1:].isdigit() else -1,
        )
        if versions:
            hint = f" (published versions in {path.parent}: {', '.join(versions[-5:])})"
        raise StartError(
            f"model {path} does not exist{hint}: engine.model (or --model) "
            "must be a folder holding a Hugging Face checkpoint; leave "
            "engine.model unset for the tiny model"
        )
    if not (path / "config.json").is_file():
        raise StartError(
            f"{path} is not a model checkpoint (no config.json in it): "
            "engine.model (or --model) must be a folder saved by "
            "`save_pretrained`, such as <data_dir>/weights/vN"
        )


def check_tokenizer_loadable(path: Path | str) -> None:
    """StartError when checkpoint `path`'s tokenizer needs transformers (a class the
    torch-free loader does not rebuild, custom code, no tokenizer.json) and this install
    has none (`areal-service[gateway]`)."""
    import importlib.util

    from gateway.tokenizer_mirror import transformers_reason

    path = Path(path)
    if not path.is_dir():
        return  # no checkpoint here (yet): check_model_dir or the loader says so
    reason = transformers_reason(path)
    if reason is not None and importlib.util.find_spec("transformers") is None:
        raise StartError(
            f"the tokenizer of {path} needs transformers ({reason}), which is "
            "not installed: install areal-service[train] "
            '(pip install "areal-service[train]")'
        )


def check_port_free(host: str, port: int, setting: str) -> None:
    """StartError if something already listens on `host:port` (0 picks a free port and
    is never busy). SO_REUSEADDR as uvicorn sets it: a port left in TIME_WAIT by a
    previous run counts as free, a listening one does not."""
    if port == 0:
        return
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise StartError(f"cannot bind {host}:{port} ({setting}): {exc.strerror}") from None
            raise StartError(
                f"port {port} on {host} ({setting}) is already in use, probably by another "
                "`areal-service serve` or `demo`: stop it, or choose free ports with "
                "--set gateway.port=... --set engine.port=..."
            ) from None
