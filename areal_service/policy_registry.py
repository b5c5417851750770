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
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from areal_service.config import LoRAConfig, PolicyConfig, ServiceConfig
from areal_service.serving_plan import PlanError, PolicyPlan, ServingPlan, check_plan
from areal_service.types import PolicyRecord


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
        """Adopt the store's runtime policies; the names not known before (a runtime
        policy whose name the config declares is ignored: the config stays
        authoritative for its names)."""
        configured = {p.name for p in self._config.policies}
        fresh = [r for r in runtime if r.name not in configured]
        added = [r.name for r in fresh if r.name not in self.runtime]
        if not added and len(fresh) == len(self.runtime):
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
) -> PolicyRecord:
    """The record of a policy to create, checked against the deployment; `PolicyError`
    (400 or 409, with the field and a code) when it cannot be. `modules`: the base
    model's `matrix_modules`, against which the target modules are checked (None: not
    checked). The rules across policies are the serving plan's (`check_plan`, as when
    the config loads). The registry should be fresh (a name created elsewhere since the
    last refresh is caught by the store's keys instead)."""
    try:
        entry = PolicyConfig(name=name, lora=lora, model_names=list(model_names))
    except ValidationError as exc:
        error = exc.errors()[0]
        where = [str(p) for p in error["loc"]]
        field = where[0] if where else "name"
        param = ".".join(where) or None
        code = "invalid_policy_name" if field == "name" else "invalid_lora"
        if field == "model_names":
            code = "invalid_model_names"
        message = str(error["msg"]).removeprefix("Value error, ")
        raise PolicyError(400, f"{param or 'policy'}: {message}", param, code) from None
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
    )


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
