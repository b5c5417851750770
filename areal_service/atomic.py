"""Atomic directory writes: build in a temp dir beside the target, then rename.

Readers (the engine loading `weights/vN`, a restarting trainer) see either the old
directory or the complete new one, never a half-written checkpoint.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_dir(out: Path) -> Iterator[Path]:
    """Yield a temp dir to fill; on success it replaces `out`, on error it is removed."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
