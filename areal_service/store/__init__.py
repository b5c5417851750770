"""The trajectory store: every SQL statement of the service lives in this package.

`TrajectoryStore` (`trajectory.py`) is the entry point; the modules beside it own one job
each: `connect.py` (engine, SQLite pragmas), `schema.py` (tables), `migrate.py`
(Alembic glue), `rows.py` (row <-> record), `inserts.py` + `writer.py` (the gateway's
completion capture), `linking.py` (parent linking), `episode_reads.py`,
`session_queries.py`, `readiness.py` (ready groups, reward settling counts),
`claims.py` (the claim state machine with its reward settling), `reward_admission.py`
(a reward checked against the claim and inserted in one transaction) and `audit.py`
(every session's state, `unaccounted`).
Nothing outside the package imports SQLAlchemy or an ORM row.
"""

from areal_service.store.connect import create_store_engine, upgrade_database
from areal_service.store.migrate import alembic_config
from areal_service.store.trajectory import TrajectoryStore

__all__ = ["TrajectoryStore", "alembic_config", "create_store_engine", "upgrade_database"]
