"""`PolicyStore`: the policies created at runtime (`policies`, `policy_model_names`), so
every gateway process, worker and trainer sharing the store sees the same ones. Whether
a new policy is valid against the config (reserved names, the config's own policies and
aliases) is `areal_service/policy_registry.py`'s; this module only keeps names and
aliases unique across processes: both are primary keys, inserted in one transaction.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import delete, func, select, update
from sqlalchemy.exc import IntegrityError

from areal_service.store.access import RowAccess
from areal_service.store.schema import PolicyModelNameRow, PolicyRow, SessionRow
from areal_service.types import PolicyRecord, now

UNTRAINED = ("open", "ended", "claimed")
"""The states of a session that a policy's trainer would still move (train or drop)."""


class PolicyConflict(Exception):
    """A runtime policy's name or one of its model names is taken by another one."""

    def __init__(self, field: str, value: str) -> None:
        super().__init__(f"{field} {value!r} is taken")
        self.field = field
        """`name` or `model_names`."""
        self.value = value


class PolicyStore(RowAccess):
    """Runtime policies, read whole (a handful of rows; the gateway reloads them off the
    request path)."""

    def add_policy(self, record: PolicyRecord) -> PolicyRecord:
        """Insert a policy and its model names in one transaction; `PolicyConflict` when
        the name or a model name exists already (nothing is inserted then)."""
        try:
            with self._sessions.begin() as session:
                session.add(
                    PolicyRow(
                        name=record.name,
                        lora=record.lora,
                        created_at=record.created_at,
                        roles=list(record.roles),
                    )
                )
                session.flush()  # the name's conflict before the aliases'
                session.add_all(
                    PolicyModelNameRow(model_name=m, policy=record.name) for m in record.model_names
                )
        except IntegrityError:
            raise self._conflict(record) from None
        return record

    def _conflict(self, record: PolicyRecord) -> PolicyConflict:
        """Which of `record`'s keys another row holds (read after the failed insert)."""
        with self._sessions() as session:
            if session.get(PolicyRow, record.name) is not None:
                return PolicyConflict("name", record.name)
            taken = session.scalars(
                select(PolicyModelNameRow.model_name).where(
                    PolicyModelNameRow.model_name.in_(record.model_names)
                )
            ).first()
        return PolicyConflict("model_names", taken or ",".join(record.model_names))

    def set_roles(self, name: str, roles: Sequence[str]) -> bool:
        """Replace runtime policy `name`'s roles (and stamp `updated_at`, which moves the
        refreshers' mark); False when no such policy is stored."""
        return bool(
            self._update(
                update(PolicyRow)
                .where(PolicyRow.name == name)
                .values(roles=list(roles), updated_at=now())
            )
        )

    def delete_policy(self, name: str, reason: str) -> int | None:
        """Delete runtime policy `name` and its model names, and drop its sessions no
        trainer has moved yet (open, ended or claimed) with `reason`, in one transaction;
        their completions and rewards stay (export reads them). The number of sessions
        dropped; None when no such policy is stored. Keys bound to it are kept (the
        gateway refuses them, naming the deletion)."""
        at = now()
        with self._engine.begin() as connection:
            gone = connection.execute(delete(PolicyRow).where(PolicyRow.name == name))
            if not gone.rowcount:
                return None
            connection.execute(delete(PolicyModelNameRow).where(PolicyModelNameRow.policy == name))
            dropped = connection.execute(
                update(SessionRow)
                .where(SessionRow.policy == name, SessionRow.status.in_(UNTRAINED))
                .values(
                    status="dropped",
                    drop_reason=reason,
                    ended_at=func.coalesce(SessionRow.ended_at, at),
                    end_reason=func.coalesce(SessionRow.end_reason, "policy_deleted"),
                )
            )
        return int(dropped.rowcount)

    def has_policy(self, name: str) -> bool:
        """Whether runtime policy `name` is stored (one primary-key read)."""
        with self._sessions() as session:
            return session.get(PolicyRow, name) is not None

    def policies_mark(self) -> tuple[int, str | None, str | None]:
        """(count, newest creation, newest change of roles) of the runtime policies: one
        aggregate row, what a refresher compares before reading the tables whole (at
        1,000 policies the whole read every second was most of an idle gateway's CPU).
        A creation moves the count and the newest creation, a deletion the count (a
        deletion and a creation between two reads: the newest creation), a change of
        roles the newest change."""
        with self._sessions() as session:
            count, newest, changed = session.execute(
                select(
                    func.count(), func.max(PolicyRow.created_at), func.max(PolicyRow.updated_at)
                ).select_from(PolicyRow)
            ).one()
        return (
            int(count),
            None if newest is None else str(newest),
            None if changed is None else str(changed),
        )

    def list_policies(self) -> list[PolicyRecord]:
        """Every runtime policy, oldest first (two queries, whole tables)."""
        with self._sessions() as session:
            rows = session.scalars(select(PolicyRow).order_by(PolicyRow.created_at, PolicyRow.name))
            policies = list(rows)
            aliases: dict[str, list[str]] = {}
            for alias in session.scalars(
                select(PolicyModelNameRow).order_by(PolicyModelNameRow.model_name)
            ):
                aliases.setdefault(alias.policy, []).append(alias.model_name)
        return [
            PolicyRecord(
                name=p.name,
                lora=p.lora,
                model_names=tuple(aliases.get(p.name, ())),
                created_at=p.created_at,
                roles=tuple(p.roles or ()),
            )
            for p in policies
        ]
