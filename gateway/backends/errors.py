"""The errors of a backend call (every engine client, `gateway/backends/interruptible.py`);
no imports, so any gateway module can raise or catch them without pulling in a client."""

from __future__ import annotations


class BackendError(Exception):
    """The backend answered with an error status (or a mid-stream error event)."""

    def __init__(self, status: int, message: str, *, url: str = "") -> None:
        super().__init__(f"{url or 'backend'}: {status} {message}")
        self.status = status
        self.message = message
        self.url = url


class BackendUnavailable(BackendError):
    """Unreachable, reset, timed out, 503 or stuck paused: routes answer 503 + retry-after.

    `sent` is False only when the request certainly never reached the backend
    (connection refused / connect timeout), so it is safe to retry elsewhere."""

    def __init__(self, message: str, *, url: str = "", sent: bool = True) -> None:
        super().__init__(503, message, url=url)
        self.sent = sent
