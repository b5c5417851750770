"""Real storage faults for tests, on demand: `chattr +i` makes a file immutable (a
read-only mount, for SQLite); needs root and a filesystem that supports it."""

from __future__ import annotations

import subprocess
from pathlib import Path


def chattr(flag: str, *paths: Path) -> bool:
    """`chattr FLAG PATHS`; False when it is unavailable or refused."""
    try:
        return (
            subprocess.run(
                ["chattr", flag, *map(str, paths)], capture_output=True, check=False
            ).returncode
            == 0
        )
    except FileNotFoundError:
        return False
