"""Child processes the CLI starts (local engine, gateway, trainer) and their shutdown.

Every process is started by us and stopped by us, by handle: SIGTERM, a grace period,
then SIGKILL. Nothing is ever killed by name. Each child runs in its own process group
so a Ctrl-C in the terminal reaches the parent first and the parent stops them in order.
SIGTERM (what systemd, Docker and Kubernetes send) stops them in the same order
(`exit_on_sigterm`), and a parent that dies without stopping them (SIGKILL, a crash)
takes them along: each child asks the kernel for SIGTERM when its parent dies.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from types import FrameType

import httpx

from areal_service.config import save_config
from launcher.preflight import NotReadyError, StartError

__all__ = ["ChildProcess", "StartError", "cli_argv", "exit_on_sigterm", "save_config"]

log = logging.getLogger(__name__)

TRAINER_GRACE_S = 60.0
"""How long a stopped trainer may take to finish its step, publish and checkpoint."""


@contextmanager
def exit_on_sigterm() -> Iterator[None]:
    """SIGTERM raises SystemExit in the main thread while inside, so `finally` blocks stop
    children in order. (uvicorn restores the handler it found and re-raises the signal
    after its own shutdown; with the default handler the process would die on the spot
    and orphan its children.)"""

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        if frame is not None and frame.f_code.co_name == "__del__":
            # An exception raised in a finalizer is printed and dropped ("Exception
            # ignored in ... __del__"), and the command would run on as if never asked
            # to stop: deliver the signal again a moment later instead.
            threading.Timer(0.05, os.kill, (os.getpid(), signum)).start()
            return
        raise SystemExit(128 + signum)

    previous: Callable | int | None = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class ChildProcess:
    """A started subprocess with a readiness probe and an orderly stop."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        log_path: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.log_path = log_path
        self._log = open(log_path, "ab") if log_path else None  # noqa: SIM115 - owned
        self.proc = subprocess.Popen(
            list(argv),
            stdout=self._log or subprocess.DEVNULL,
            stderr=subprocess.STDOUT if self._log else subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
            start_new_session=True,
            preexec_fn=_die_with_parent(),  # noqa: PLW1509 - one prctl call, no locks
        )
        log.info("started %s (pid %d): %s", name, self.proc.pid, " ".join(argv))

    def wait_http_ok(self, url: str, timeout_s: float = 120.0) -> None:
        """Block until GET `url` answers 200, or raise if the child died or time ran out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise self._died()
            try:
                ok = httpx.get(url, timeout=2.0).status_code == 200
            except httpx.HTTPError:
                ok = False
            if ok and self.proc.poll() is None:  # not another server answering for a dead one
                return
            if ok:
                raise self._died()
            time.sleep(0.2)
        raise NotReadyError(
            f"{self.name} not ready at {url} after {timeout_s:.0f} s{self._see_log()}"
        )

    def _died(self) -> StartError:
        return StartError(
            f"{self.name} exited with code {self.proc.returncode} before it "
            f"was ready{self._see_log()}"
        )

    def _see_log(self) -> str:
        """`; last log line: ...; full log: PATH` (the log's last line usually names the
        cause: a missing file, a busy port, out of memory)."""
        if self.log_path is None:
            return ""
        if self._log:
            self._log.flush()
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
                lines = [ln.strip() for ln in f.read().decode(errors="replace").splitlines()]
        except OSError:
            lines = []
        last = next((ln for ln in reversed(lines) if ln), "")
        return (f"; last log line: {last[:300]}" if last else "") + f"; full log: {self.log_path}"

    def stop(self, grace_s: float | None = None) -> None:
        """SIGTERM, wait up to `grace_s`, then SIGKILL; only this child's process group.
        By default the trainer gets `TRAINER_GRACE_S` (on SIGTERM it finishes the step
        under way, publishes and checkpoints), every other child 10 s."""
        if grace_s is None:
            trainer = self.name == "trainer" or self.name.startswith("trainer-")  # per policy
            grace_s = TRAINER_GRACE_S if trainer else 10.0
        asked = self.proc.poll() is None
        if asked:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                log.warning(
                    "%s did not stop within %.0f s of SIGTERM: killing it%s",
                    self.name,
                    grace_s,
                    self._see_log(),
                )
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        # The group's other members (an SGLang server's scheduler and detokenizer) can
        # outlive a leader that died first or left on SIGTERM before them: end them too.
        # The leader's pid names the group while any member lives, so this reaches no one
        # else; an empty group is ProcessLookupError.
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        code = self.proc.returncode
        # Ending on the SIGTERM it was sent (uvicorn re-raises it; the trainer exits 143)
        # is the orderly stop asked for: said without a code that reads as a failure.
        orderly = code == 0 or (asked and code in (-signal.SIGTERM, 128 + signal.SIGTERM))
        if orderly:
            log.info("stopped %s", self.name)
        else:
            log.warning("%s had exited with code %s%s", self.name, code, self._see_log())
        if self._log:
            self._log.close()


def _die_with_parent() -> Callable[[], None] | None:
    """A pre-exec hook asking Linux to SIGTERM the child when its parent thread dies
    (prctl PR_SET_PDEATHSIG). Only from the main thread: the signal follows the thread
    that forked, and a worker thread ending would stop the child. The libc symbol is
    resolved here, in the parent: the hook runs between fork and exec, where loading a
    library could deadlock on a lock another thread held at fork time."""
    if not sys.platform.startswith("linux"):
        return None
    if threading.current_thread() is not threading.main_thread():
        return None
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1

    def hook() -> None:
        prctl(pr_set_pdeathsig, signal.SIGTERM)

    return hook


def cli_argv(*args: str) -> list[str]:
    """argv that runs `areal-service ARGS` with this interpreter (no PATH lookup)."""
    return [sys.executable, "-m", "launcher", *args]
