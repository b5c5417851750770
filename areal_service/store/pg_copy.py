"""Binary `COPY ... FROM STDIN` for PostgreSQL through psycopg 3: the completions
insert of `inserts.py` on PostgreSQL. Owns the COPY statement, the wire type of each
column, and the int4 range check that binary COPY lacks. Takes the same driver-ready
row tuples as the INSERT it replaces; opens no connection and commits nothing.

Why: a batch of 64 gateway completions (1k+1k tokens each) as pipelined INSERTs costs
the server a parse/bind/execute per row; as one binary COPY the rows stream in while
the client is still formatting the next ones (measured on PostgreSQL 15, batches of 64:
server CPU ~137 -> ~113 µs per row, ~78 with lz4 TOAST compression, see `connect.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import JSON, BigInteger, Float, Integer, LargeBinary, String, Table
from sqlalchemy.engine import Dialect

__all__ = ["BinaryCopy", "copy_supported"]

_INT4_MIN, _INT4_MAX = -(2**31), 2**31 - 1

# Binary wire format per column type. `text` also serves varchar(n) and json: their
# binary receive functions read plain UTF-8 text (varchar still checks its length, json
# still validates), so a JSON column gets exactly the text the INSERT path sends.
# Order matters: BigInteger is an Integer.
_WIRE_TYPES: tuple[tuple[type[Any], str], ...] = (
    (LargeBinary, "bytea"),
    (BigInteger, "int8"),
    (Integer, "int4"),
    (Float, "float8"),
    (JSON, "text"),
    (String, "text"),
)


def copy_supported(dialect: Dialect) -> bool:
    """True for PostgreSQL through psycopg 3 (`postgresql+psycopg://`), the driver whose
    `Cursor.copy` this module uses; other drivers keep the INSERT path."""
    return dialect.name == "postgresql" and dialect.driver == "psycopg"


def _wire_type(column: Any) -> str:
    for sql_type, wire in _WIRE_TYPES:
        if isinstance(column.type, sql_type):
            if wire == "float8" and getattr(column.type, "precision", None) is not None:
                break  # Float(precision) may be real (float4): not handled here
            return wire
    raise NotImplementedError(f"binary COPY of {column.table.name}.{column.name}: {column.type!r}")


class BinaryCopy:
    """`COPY table (columns) FROM STDIN (FORMAT BINARY)` of row tuples in `columns` order.

    Wire types come from the SQLAlchemy table, not the server catalog: no round trip,
    and a mismatch with the live table fails loudly ("incorrect binary data format").
    psycopg's binary int4 dumper silently wraps values outside int32 (2**31 arrives as
    -2**31), so int4 columns are range-checked here and refused with the error the
    server gives the INSERT (psycopg's NumericValueOutOfRange, SQLSTATE 22003: a
    DataError once translated); the COPY is abandoned and the caller rolls back."""

    def __init__(self, table: Table, columns: Sequence[str], dialect: Dialect) -> None:
        from psycopg import errors  # the `postgres` extra: imported only when it is in use

        self._out_of_range = errors.NumericValueOutOfRange
        quote = dialect.identifier_preparer.quote
        wire = [_wire_type(table.c[name]) for name in columns]
        self.statement = (
            f"COPY {dialect.identifier_preparer.format_table(table)} "
            f"({', '.join(quote(name) for name in columns)}) FROM STDIN (FORMAT BINARY)"
        )
        self._types = wire
        self._int4 = tuple(i for i, kind in enumerate(wire) if kind == "int4")

    def write(self, cursor: Any, rows: Sequence[Sequence[Any]]) -> None:
        """Send `rows` on `cursor` (a psycopg 3 cursor, in a transaction). psycopg sends
        them as they are formatted (32 KiB buffers), so the server parses row k while
        row k+1 is being formatted; the COPY ends (one wait for the server) on return."""
        int4 = self._int4
        with cursor.copy(self.statement) as copy:
            copy.set_types(self._types)
            for row in rows:
                for i in int4:
                    value = row[i]
                    if value is not None and not _INT4_MIN <= value <= _INT4_MAX:
                        raise self._out_of_range(f"integer out of range: {value}")
                copy.write_row(row)
