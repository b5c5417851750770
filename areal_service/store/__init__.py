"""The trajectory store: every SQL statement of the service lives in this package.

`TrajectoryStore` (`trajectory.py`) is the entry point: trajectories (sessions,
completions, rewards, weight versions, train steps) and their reads. Over the same
engine it builds the other domains, reached as its attributes: `store.keys`
(`KeyStore`, `api_keys.py`) and `store.coordination` (`Coordination`,
`coordination.py`: leases, admissions, auth failures, key counters, console sign-outs).
One access style: callers use these objects' methods. The modules beside them own one
job each and take the engine, called only by their owning object: `connect.py`
(engine, SQLite pragmas), `schema.py` (tables), `migrate.py` (Alembic glue), `rows.py`
and `access.py` (row <-> record, one-transaction helpers), `inserts.py` + `writer.py`
(the gateway's completion capture), `linking.py` (parent linking), `episode_reads.py`,
`session_queries.py`, `readiness.py` (ready groups, reward settling counts), `audit.py`
(every session's state), `merge_stats.py`, `write_probe.py` (readiness's write),
`claims.py` (`EpisodeClaimer`, the claim state machine), `reward_admission.py` (a
reward checked against the claim and inserted in one transaction), and the
coordination tables' `leases.py`, `admissions.py`, `auth_failures.py`,
`key_counters.py`, `revocations.py`. `store.policies` (`PolicyStore`,
`policy_registry.py`) keeps the policies created at runtime.
Nothing outside the package imports SQLAlchemy or an ORM row, or holds the engine.
"""

from areal_service.store.api_keys import KeyStore
from areal_service.store.connect import create_store_engine, upgrade_database
from areal_service.store.coordination import Coordination
from areal_service.store.migrate import alembic_config
from areal_service.store.policy_registry import PolicyConflict, PolicyStore
from areal_service.store.trajectory import TrajectoryStore

__all__ = [
    "Coordination",
    "KeyStore",
    "PolicyConflict",
    "PolicyStore",
    "TrajectoryStore",
    "alembic_config",
    "create_store_engine",
    "upgrade_database",
]
