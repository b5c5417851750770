"""Store fixtures: `store_url` runs each test on a fresh SQLite file and, when
AREAL_TEST_POSTGRES_URL names a reachable server, on a fresh PostgreSQL database
(created per test, dropped after). `store` is a migrated TrajectoryStore on that URL.
`tok`: the gateway's tokenizer of the tiny model (its reference: `tokenizer_reference`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from support.postgres_db import fresh_postgres_database
from support.tokenizer_reference import set_reference

from areal_service.config import StoreConfig
from areal_service.store import TrajectoryStore
from gateway.tokenizer import ChatTokenizer


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An empty database URL, once per dialect."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'store.db'}"
    else:
        yield from fresh_postgres_database()


@pytest.fixture
def store(store_url: str) -> Iterator[TrajectoryStore]:
    """A TrajectoryStore migrated to head on `store_url`."""
    opened = TrajectoryStore.open(store_url, StoreConfig())
    yield opened
    opened.close()


@pytest.fixture(scope="session")
def tok(tiny_model_dir: Path) -> ChatTokenizer:
    """The gateway's tokenizer of the tiny model, loaded as in production; transformers'
    own one becomes `tokenizer_reference.hf()`, the reference the tests compare with."""
    from transformers import AutoTokenizer

    set_reference(AutoTokenizer.from_pretrained(tiny_model_dir))
    return ChatTokenizer.from_pretrained(tiny_model_dir)
