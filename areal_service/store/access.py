"""`RowAccess`: the one-transaction ORM helpers the store's objects share (add a row, get
one by key, list a query's rows as records, run an UPDATE). Each store object
(`TrajectoryStore`, `KeyStore`) is one of these over the engine they all share.
"""

from __future__ import annotations

from typing import Any, TypeVar

from sqlalchemy import Engine
from sqlalchemy.orm import sessionmaker
from sqlalchemy.sql import Select

from areal_service.store.rows import to_record
from areal_service.store.schema import Base

_R = TypeVar("_R")


class RowAccess:
    """Short transactions over `engine`: one per call, synchronous and thread-safe."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._sessions = sessionmaker(engine, expire_on_commit=False)

    def _add(self, row: Base) -> None:
        with self._sessions.begin() as session:
            session.add(row)

    def _get(self, cls: type[_R], row_type: type[Base], key: object) -> _R | None:
        with self._sessions() as session:
            row = session.get(row_type, key)
            return None if row is None else to_record(cls, row)

    def _list(self, cls: type[_R], statement: Select[Any]) -> list[_R]:
        with self._sessions() as session:
            return [to_record(cls, row) for row in session.scalars(statement)]

    def _update(self, statement: Any) -> int:
        with self._engine.begin() as connection:
            return int(connection.execute(statement).rowcount)

    def _count(self, statement: Select[Any]) -> int:
        with self._engine.connect() as connection:
            return int(connection.execute(statement).scalar_one())
