"""Alembic environment of the trajectory store: target metadata is `schema.Base`.

The URL comes from the Alembic config built by `areal_service.store.migrate.alembic_config`;
when the caller passes an open connection in `config.attributes["connection"]` the
migration runs on it (and inside its transaction). SQLite gets batch mode, because its
ALTER TABLE cannot drop or change columns and constraints in place.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection, create_engine, pool

from areal_service.store.schema import Base

config = context.config
target_metadata = Base.metadata


def _configure(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )


def run_migrations_offline() -> None:
    """Emit SQL to stdout (`alembic upgrade --sql`) without connecting."""
    context.configure(
        url=config.get_main_option("sqlalchemy.url"),
        target_metadata=target_metadata,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    """Migrate through the caller's connection, else through a fresh engine."""
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure(connection)
        with context.begin_transaction():
            context.run_migrations()
        return
    url = config.get_main_option("sqlalchemy.url")
    if url is None:
        raise RuntimeError("alembic config has no sqlalchemy.url; use alembic_config(url)")
    engine = create_engine(url, poolclass=pool.NullPool)
    with engine.connect() as connection:
        _configure(connection)
        with context.begin_transaction():
            context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
