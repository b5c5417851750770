"""Store fixtures: `store_url` runs each test on a fresh SQLite file and, when
AREAL_TEST_POSTGRES_URL names a reachable server, on a fresh PostgreSQL database
(created per test, dropped after). `store` is a migrated TrajectoryStore on that URL.
`tok`: the gateway's tokenizer of the tiny model (its reference: `tokenizer_reference`)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, make_url, text
from sqlalchemy.exc import OperationalError
from tokenizer_reference import set_reference

from areal_service.config import StoreConfig
from areal_service.store import TrajectoryStore
from gateway.tokenizer import ChatTokenizer

POSTGRES_ENV = "AREAL_TEST_POSTGRES_URL"


def _postgres_database() -> Iterator[str]:
    base = os.environ.get(POSTGRES_ENV)
    if not base:
        pytest.skip(
            f"{POSTGRES_ENV} is not set (e.g. postgresql+psycopg://u:pw@localhost/postgres)"
        )
    name = f"areal_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(base, isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 3})
    try:
        with admin.connect() as connection:
            connection.execute(text(f'CREATE DATABASE "{name}"'))
    except OperationalError as error:
        admin.dispose()
        pytest.skip(f"PostgreSQL at {make_url(base)!r} is unreachable: {error.orig}")
    try:
        yield make_url(base).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as connection:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An empty database URL, once per dialect."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'store.db'}"
    else:
        yield from _postgres_database()


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
