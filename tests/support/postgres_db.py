"""A fresh PostgreSQL database per test, on the server AREAL_TEST_POSTGRES_URL names (CI
starts one on loopback); the test is skipped with the reason when it is unset or
unreachable. Created before the test, dropped (connections forced out) after."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest
from sqlalchemy import make_url
from sqlalchemy.exc import OperationalError

from areal_service.store.connect import scratch_postgres_database

POSTGRES_ENV = "AREAL_TEST_POSTGRES_URL"


def fresh_postgres_database() -> Iterator[str]:
    """Yield the URL of a new database on the server (skip the test without one)."""
    base = os.environ.get(POSTGRES_ENV)
    if not base:
        pytest.skip(
            f"{POSTGRES_ENV} is not set (e.g. postgresql+psycopg://u:pw@localhost/postgres)"
        )
    with contextlib.ExitStack() as stack:
        try:
            url = stack.enter_context(scratch_postgres_database(base, "areal_test"))
        except OperationalError as error:
            pytest.skip(f"PostgreSQL at {make_url(base)!r} is unreachable: {error.orig}")
        yield url
