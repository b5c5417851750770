"""A fresh PostgreSQL database per test, on the server AREAL_TEST_POSTGRES_URL names (CI
starts one on loopback); the test is skipped with the reason when it is unset or
unreachable. Created before the test, dropped (connections forced out) after."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
from sqlalchemy import create_engine, make_url, text
from sqlalchemy.exc import OperationalError

POSTGRES_ENV = "AREAL_TEST_POSTGRES_URL"


def fresh_postgres_database() -> Iterator[str]:
    """Yield the URL of a new database on the server (skip the test without one)."""
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


