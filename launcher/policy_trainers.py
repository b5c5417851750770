"""One trainer process per named policy (`trainer --policy NAME`), beside the default
policy's: started by `launch --scheduler local` (which also polls for policies created at
runtime) and by `serve` (the config's policies)."""

from __future__ import annotations

import logging
from pathlib import Path

from areal_service.config import ServiceConfig
from areal_service.serving_plan import ServingPlan
from areal_service.store import TrajectoryStore
from launcher.processes import ChildProcess, cli_argv

log = logging.getLogger(__name__)


class PolicyTrainers:
    """One trainer process per named policy (`trainer --policy NAME`, logs in
    `logs/trainer-NAME.log`), besides the default policy's: the config's at start, and
    each policy created at runtime (`POST /admin/policies`, `policies create`, the
    console) when `poll` finds it in the store. Each one started is appended to
    `children`, which the launcher stops (and only those)."""

    def __init__(
        self,
        config: ServiceConfig,
        cfg_path: Path,
        logs: Path,
        env: dict[str, str],
        children: list[ChildProcess],
    ) -> None:
        self._config = config
        self._cfg_path = cfg_path
        self._logs = logs
        self._env = env
        self._children = children
        self.started: dict[str, ChildProcess] = {}
        # Runtime policies exist only where the serving plan lets them be created:
        # elsewhere there is nothing to poll for.
        self._polls = ServingPlan(config).runtime_creatable()
        self._store: TrajectoryStore | None = None
        self._refused: set[str] = set()
        """Policies whose trainer the cap kept from starting (logged once each)."""

    def start(self, names: list[str]) -> None:
        """Start the trainer of each of `names` not started yet, up to
        `policy_caps.max_policies` trainers (each is a process of a few GB); the policies
        beyond are named in one log line, once."""
        fresh, refused = within_cap(
            list(self.started), names, self._config.policy_caps.max_policies
        )
        refused = [n for n in refused if n not in self._refused]
        if refused:
            self._refused.update(refused)
            log.error(
                "not starting the trainers of %s: policy_caps.max_policies is %d and %d "
                "trainers run (delete a policy or raise the cap)",
                ", ".join(refused),
                self._config.policy_caps.max_policies,
                len(self.started) + len(fresh),
            )
        for name in fresh:
            child = ChildProcess(
                f"trainer-{name}",
                cli_argv("trainer", "--config", str(self._cfg_path), "--policy", name),
                log_path=self._logs / f"trainer-{name}.log",
                env=self._env,
            )
            self._children.append(child)
            self.started[name] = child

    def poll(self) -> None:
        """Start the trainers of runtime policies created since the last poll, and stop
        those of runtime policies deleted since (one small store read); a store that
        fails is tried again at the next poll."""
        if not self._polls:
            return
        try:
            if self._store is None:
                self._store = TrajectoryStore.open(self._config.database_url(), self._config.store)
            runtime = self._store.policies.list_policies()
        except Exception:  # noqa: BLE001 - the gateway reports the store; retry later
            log.exception("reading the runtime policies failed; retrying")
            return
        declared = {p.name for p in self._config.policies}
        names = [r.name for r in runtime if r.name not in declared]
        self.stop_deleted(declared | set(names))
        self.start(names)

    def stop_deleted(self, existing: set[str]) -> None:
        """Stop the trainer of each started policy not in `existing` (deleted at runtime:
        `DELETE /admin/policies/{name}`, `policies delete`, the console), one log line
        each; it may be started again if a policy of that name is created later."""
        for name in [n for n in self.started if n not in existing]:
            child = self.started.pop(name)
            log.warning("policy %s was deleted: stopping its trainer", name)
            child.stop()
            if child in self._children:
                self._children.remove(child)
            self._refused.discard(name)

    def close(self) -> None:
        """Close the store connection (the trainers are stopped by the launcher)."""
        if self._store is not None:
            self._store.close()


def within_cap(started: list[str], names: list[str], cap: int) -> tuple[list[str], list[str]]:
    """(to start, refused): the names of `names` not in `started`, in order, the first
    ones up to `cap` trainers in all, the rest refused."""
    fresh = [n for n in dict.fromkeys(names) if n not in started]
    room = max(0, cap - len(started))
    return fresh[:room], fresh[room:]
