"""The policies a deployment has: the config's (`policies:`, authoritative for their
names) and those created at runtime (`POST /admin/policies`, the CLI, the console), kept
in the store (`store.policies`) so every gateway process and trainer sees them.

`PolicyRegistry` is what the gateway and the launcher read instead of `config.policies`:
one object per process, rebuilt from the store off the request path (the gateway's
refresher, the launcher's poll); reads are attribute and dict lookups. `new_policy`
checks a creation against the config and the registry, in the same words for the admin
API, the console and the CLI; the store's primary keys settle two creators racing.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from areal_service.config import LoRAConfig, PolicyConfig, ServiceConfig
from areal_service.serving_plan import PlanError, PolicyPlan, ServingPlan, check_plan
from areal_service.types import DEFAULT_POLICY, PolicyRecord


class PolicyError(ValueError):
    """A policy that cannot be created: `status` (400 bad input, 409 a conflict), the
    request field at fault and a machine-readable code, as the OpenAI error shape has."""

    def __init__(self, status: int, message: str, param: str | None, code: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def policy_config(record: PolicyRecord) -> PolicyConfig:
    """The config entry a stored policy stands for (the trainer of a runtime policy runs
    with it appended to `policies:`)."""
    return PolicyConfig(
        name=record.name,
        lora=None if record.lora is None else LoRAConfig.model_validate(record.lora),
        model_names=list(record.model_names),
        roles=list(record.roles),
    )


class PolicyRegistry:
    """Every policy of one deployment: `default`, the config's, then the runtime ones
    (oldest first), and the serving plan over them (`plan`), built anew when the runtime
    policies change. Not thread-safe; in the gateway only its event loop touches it, and
    `update` swaps whole objects, so a reader never sees half of a refresh."""

    def __init__(self, config: ServiceConfig, runtime: Sequence[PolicyRecord] = ()) -> None:
        self._config = config
        self.runtime: dict[str, PolicyRecord] = {}
        """The runtime policies by name (the config's are not stored)."""
        self.runtime_configs: dict[str, PolicyConfig] = {}
        """Their config entries, validated once each (a creation or a refresh validates
        only the new ones: at 1,000 policies revalidating all took most of a creation)."""
        self.plan = ServingPlan(config)
        """How each policy is served, and which policy serves a request."""
        self.update(runtime)

    def update(self, runtime: Sequence[PolicyRecord]) -> list[str]:
        """Adopt the store's runtime policies (new, deleted or with other roles); the
        names not known before (a runtime policy whose name the config declares is
        ignored: the config stays authoritative for its names)."""
        configured = {p.name for p in self._config.policies}
        fresh = [r for r in runtime if r.name not in configured]
        added = [r.name for r in fresh if r.name not in self.runtime]
        if len(fresh) == len(self.runtime) and all(self.runtime.get(r.name) == r for r in fresh):
            return []
        configs = {
            r.name: self.runtime_configs[r.name]
            if self.runtime.get(r.name) == r  # the same record: its entry stands
            else policy_config(r)
            for r in fresh
        }
        self.plan = ServingPlan(self._config, list(configs.values()))
        self.runtime = {r.name: r for r in fresh}
        self.runtime_configs = configs
        return added

    @property
    def declared(self) -> list[PolicyPlan]:
        """The named policies (config's, then runtime's); empty: the single default."""
        return self.plan.named()

    @property
    def model_policies(self) -> dict[str, str]:
        """Request model name -> policy (every policy's `model_names`)."""
        return self.plan.aliases

    def names(self) -> list[str]:
        """Every policy: `default`, then the named ones in order."""
        return self.plan.names()

    def __contains__(self, name: object) -> bool:
        return name in self.plan

    def lora(self, name: str) -> LoRAConfig | None:
        """The LoRA settings of policy `name` (its own, else the default policy's; None for
        a full-weight policy); KeyError for an unknown policy."""
        return self.plan.lora(name)

    def model_names(self, name: str) -> list[str]:
        """The request model names that pick policy `name` (none for `default`)."""
        return list(self.plan[name].model_names)

    def source(self, name: str) -> str:
        """`config` or `runtime` (the default policy is the config's)."""
        return self.plan[name].source


MAX_HEADER_BYTES = 100 * 2**20
"""A safetensors header larger than this is not read (a malformed file)."""


def matrix_modules(model_dir: Path) -> set[str] | None:
    """The module paths of the checkpoint's 2-D weights (`model.layers.0.self_attn.q_proj`
    for `...q_proj.weight`): what a LoRA target may name (linear and embedding layers;
    norms and biases are 1-D). Read from the safetensors headers only (a few KB per
    file, no tensor data, no torch). None when the folder has no readable safetensors:
    the check is then skipped and the trainer reports a bad target."""
    modules: set[str] = set()
    files = sorted(model_dir.glob("*.safetensors"))
    for path in files:
        try:
            with path.open("rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                if size > MAX_HEADER_BYTES:
                    return None
                header = json.loads(f.read(size))
        except (OSError, ValueError, struct.error):
            return None
        for key, info in header.items():
            if key.endswith(".weight") and len(info.get("shape", ())) == 2:
                modules.add(key.removesuffix(".weight"))
    return modules or None


def _unmatched_targets(targets: Sequence[str], modules: Collection[str]) -> list[str]:
    """The targets no module matches, by PEFT's rule (the whole path, or its last parts
    after a dot)."""
    return [t for t in targets if not any(m == t or m.endswith(f".{t}") for m in modules)]


def new_policy(
    config: ServiceConfig,
    registry: PolicyRegistry,
    name: str,
    lora: dict[str, Any] | None = None,
    model_names: Sequence[str] = (),
    modules: Collection[str] | None = None,
    roles: Sequence[str] = (),
) -> PolicyRecord:
    """The record of a policy to create, checked against the deployment; `PolicyError`
    (400 or 409, with the field and a code) when it cannot be. `modules`: the base
    model's `matrix_modules`, against which the target modules are checked (None: not
    checked). The rules across policies are the serving plan's (`check_plan`, as when
    the config loads). `roles`: as `policies[].roles`, each a named policy that exists
    (`checked_roles`). The registry should be fresh (a name created elsewhere since the
    last refresh is caught by the store's keys instead)."""
    entry = _entry(name=name, lora=lora, model_names=list(model_names), roles=list(roles))
    _check_roles_exist(registry, entry)
    if entry.lora is not None and modules is not None:
        unmatched = _unmatched_targets(entry.lora.target_modules, modules)
        if unmatched:
            raise PolicyError(
                400,
                f"lora.target_modules: {', '.join(map(repr, unmatched))} match no linear "
                "or embedding layer of the base model",
                "lora.target_modules",
                "invalid_lora",
            )
    try:
        check_plan(config, [*registry.runtime_configs.values(), entry])
    except PlanError as exc:
        raise PolicyError(exc.status, exc.message, exc.param, exc.code) from None
    return PolicyRecord(
        name=entry.name,
        lora=None if entry.lora is None else entry.lora.model_dump(mode="json"),
        model_names=tuple(entry.model_names),
        roles=tuple(entry.roles),
    )


_CODES = {
    "name": "invalid_policy_name",
    "model_names": "invalid_model_names",
    "roles": "invalid_roles",
}
"""The error code of a bad field of a new policy (others: its `lora`'s)."""


def _entry(**fields: Any) -> PolicyConfig:
    """The config entry of `fields`, or `PolicyError` 400 naming the first bad field as
    the config's validation words it."""
    try:
        return PolicyConfig(**fields)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = [str(p) for p in error["loc"]]
        field = where[0] if where else "name"
        param = ".".join(where) or None
        code = _CODES.get(field, "invalid_lora")
        message = str(error["msg"]).removeprefix("Value error, ")
        raise PolicyError(400, f"{param or 'policy'}: {message}", param, code) from None


def _check_roles_exist(registry: PolicyRegistry, entry: PolicyConfig) -> None:
    """Each of `entry`'s roles is a named policy of the deployment other than itself (a
    role is served by its policy's adapter: `default` has no alias to open it by)."""
    for role in entry.roles:
        if role == entry.name:
            raise PolicyError(
                400,
                f"roles: {role!r} is the policy itself (its own turns need no role)",
                "roles",
                "invalid_roles",
            )
        if role == DEFAULT_POLICY or role not in registry:
            known = [n for n in registry.names() if n not in (DEFAULT_POLICY, entry.name)]
            raise PolicyError(
                400,
                f"roles: {role!r} is not a named policy of this deployment (known: "
                f"{', '.join(known) or 'none'})",
                "roles",
                "invalid_roles",
            )


def checked_roles(
    config: ServiceConfig, registry: PolicyRegistry, name: str, roles: Sequence[str]
) -> PolicyRecord:
    """The record of runtime policy `name` with its roles set to `roles` (the admin's
    `PATCH /admin/policies/{name}`, the console's form, `policies roles`), checked as a
    creation's are; `PolicyError` 404 for a policy not stored at runtime, 409 for a
    config-declared one (its roles are the config's), 400 for bad roles."""
    record = registry.runtime.get(name)
    if record is None:
        raise _not_runtime(config, registry, name, "its roles are set in the config")
    entry = _entry(name=name, roles=list(roles))
    _check_roles_exist(registry, entry)
    return replace(record, roles=tuple(entry.roles))


def deletable(config: ServiceConfig, registry: PolicyRegistry, name: str) -> PolicyRecord:
    """The runtime policy `name` when it may be deleted; `PolicyError` otherwise: 404
    unknown, 409 `default` or a config-declared policy (the config is its source: remove
    it there), 409 a policy another one declares among its roles."""
    record = registry.runtime.get(name)
    if record is None:
        raise _not_runtime(config, registry, name, "remove it from the config and restart")
    users = [p.name for p in registry.plan.policies.values() if name in p.roles]
    if users:
        raise PolicyError(
            409,
            f"policy {name!r} is a role of {', '.join(map(repr, users))}: remove it from "
            "their roles first",
            "name",
            "policy_in_use",
        )
    return record


DELETED = "policy_deleted"
"""The drop reason's kind of a deleted policy's sessions (`/metrics`, the audit)."""


def deletion_reason(name: str) -> str:
    """The drop reason stored on the sessions of deleted policy `name`."""
    return f"{DELETED}: policy {name!r} was deleted by the admin"


def _not_runtime(
    config: ServiceConfig, registry: PolicyRegistry, name: str, fix: str
) -> PolicyError:
    """Why `name` cannot be changed or deleted: unknown (404), or not a runtime policy."""
    if name == DEFAULT_POLICY:
        return PolicyError(
            409,
            f"policy {name!r} is the default policy: it cannot be changed or deleted here",
            "name",
            "config_policy",
        )
    if name in registry:
        return PolicyError(
            409,
            f"policy {name!r} is declared in the config (policies:): {fix}",
            "name",
            "config_policy",
        )
    return PolicyError(404, f"no policy {name!r}", "name", "policy_not_found")


def lora_over_default(config: ServiceConfig, given: Mapping[str, Any]) -> dict[str, Any]:
    """A new policy's adapter shape: the fields `given`, the others the default policy's
    (`default_policy.lora`), as the admin API, the console and the CLI fill them."""
    default = config.default_policy.lora
    return {**(default.model_dump(mode="json") if default else {}), **given}


def with_runtime_policies(
    config: ServiceConfig, runtime: Sequence[PolicyRecord], trainer_policy: str | None = None
) -> ServiceConfig:
    """`config` with the runtime policies appended to `policies:` (those the config does
    not declare) and `trainer.policy` set when given, validated again: what a runtime
    policy's trainer runs with, so its LoRA shape and directories resolve as for a
    declared one (ValidationError, "not a declared policy", for an unknown one)."""
    registry = PolicyRegistry(config, runtime)
    tree = config.model_dump(mode="json")
    tree["gateway"]["auth"]["admin_key"] = config.gateway.auth.admin_key.get_secret_value()
    tree["policies"] = [
        *(p.model_dump(mode="json") for p in config.policies),
        *(policy_config(r).model_dump(mode="json") for r in registry.runtime.values()),
    ]
    if trainer_policy is not None:
        tree["trainer"]["policy"] = trainer_policy
    return ServiceConfig.model_validate(tree)
