"""The serving plan: how each policy of a deployment is served, decided once.

Built from the config (`default_policy:`, `policies:`, the engine kind, weight sync) and
the runtime policies (`PolicyRegistry` holds the current plan and builds a new one when
a policy is created). It answers two questions, and nothing else in the service
recomputes either:

- **How is each policy served?** One `PolicyPlan` per policy, the default included: its
  weights (`full` or `lora`), its LoRA shape, how the backends name its adapter (none,
  in place under one name, or a versioned name per published version), which pool serves
  it (the main one, or its own for a full-weight policy), how its versions are swapped,
  and the flags the engines start with (`EngineFlags`). Launchers, routing, weight sync,
  the admin API, the console and the trainer read these.
- **Which policy serves a request?** `serving(caller, own, model)`: a key or session bound
  to a policy is served (and recorded) by that policy whatever model name it sends, so
  an agent keeps its own name and cannot reach another tenant's adapter by naming its
  alias; an unbound key is the default policy's; the admin may name any policy by its
  alias; an episode may open the roles its policy declares (`roles:`).

The rules across sections (LoRA and weight sync, the engines, full-weight pools and
ports, names and aliases) are one function, `check_plan`, run when the config loads and
when a policy is created. Torch-free, like the config.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

# The section modules only: the root (`config/service.py`) runs `check_plan` when it
# validates, so the plan reads it through `PlannedConfig` and imports no circle.
from areal_service.config.engine import EngineConfig
from areal_service.config.gateway import GatewayConfig
from areal_service.config.policies import (
    DefaultPolicyConfig,
    LoRAConfig,
    PolicyCapsConfig,
    PolicyConfig,
    PolicyWeights,
)
from areal_service.config.trainer import TrainerConfig
from areal_service.types import DEFAULT_POLICY

AdapterNaming = Literal["none", "in_place", "versioned"]
"""How the backends name a policy's adapter: `none` (full weights, no adapter),
`in_place` (one name whose weights each version replaces: the local engine, vLLM's single
adapter), `versioned` (a name per version, loaded beside the retiring one without a
pause: vLLM and SGLang with named policies, `gateway/adapters.py`)."""

SwapKind = Literal["paired", "adapter", "own_pool"]
"""How a published version reaches the backends: `paired` (the main pool's paired
pause / load / continue of the default policy's weights or adapter), `adapter` (only this
policy's adapter changes, under its name), `own_pool` (a full swap on the policy's own
backends)."""

CallerKind = Literal["admin", "user", "session"]
"""Who sends a request: the admin key, a user key, or a session key (one episode's, minted
by the admin)."""

MAX_ALIAS_CHARS = 200
"""Longest model name a policy may take as an alias."""


class PlannedConfig(Protocol):
    """What the plan reads of the config tree (`ServiceConfig` has it all)."""

    @property
    def engine(self) -> EngineConfig: ...
    @property
    def gateway(self) -> GatewayConfig: ...
    @property
    def trainer(self) -> TrainerConfig: ...
    @property
    def default_policy(self) -> DefaultPolicyConfig: ...
    @property
    def policies(self) -> Sequence[PolicyConfig]: ...
    @property
    def policy_caps(self) -> PolicyCapsConfig: ...
    def backend_urls(self) -> list[str]: ...
    def model_dir(self) -> Path: ...


class PlanError(ValueError):
    """A config or a policy creation the plan cannot serve: `status` (400 bad input, 409 a
    conflict), the field at fault and a machine-readable code, as the OpenAI error shape
    has. A ValueError, so pydantic reports it where the config is validated."""

    def __init__(
        self, message: str, *, status: int = 400, param: str | None = None, code: str
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


@dataclass(frozen=True, slots=True)
class PolicyPlan:
    """How one policy is served."""

    name: str
    source: Literal["config", "runtime"]
    """Declared in the config (`default` is) or created at runtime."""
    weights: PolicyWeights
    lora: LoRAConfig | None
    """The adapter's shape; None: full weights."""
    adapter: AdapterNaming
    swap: SwapKind
    transport: Literal["disk", "distributed"]
    """How its trainer hands a version over (`trainer.weight_sync`; adapters and full-weight
    policies: disk)."""
    backend_urls: tuple[str, ...]
    """A full-weight policy's own backends; empty for the main pool."""
    engine_port: int | None
    """The port of the local engine the launcher starts for a full-weight policy; None
    when it is served by `backends` given for it, or by the main pool."""
    model_names: tuple[str, ...]
    """Its aliases (none for `default`)."""
    roles: tuple[str, ...]
    """The policies its episodes may open as roles."""

    @property
    def own_pool(self) -> bool:
        """Served by backends of its own (a full-weight named policy)."""
        return self.swap == "own_pool"


@dataclass(frozen=True, slots=True)
class EngineFlags:
    """What the engines start with, from the policies the config declares (engines start
    once; a runtime policy is served within these)."""

    lora: bool
    """LoRA serving on (`--enable-lora`): the default policy is an adapter."""
    adapters_by_name: bool
    """The backends load adapters by name at run time (vLLM, SGLang; the local engine
    swaps its adapters in place)."""
    initial_adapter: bool
    """vLLM's single adapter of the default policy, served in place from the start
    (`--lora-modules`): LoRA without named policies."""
    max_lora_rank: int
    """The largest rank among the declared policies (0 without LoRA)."""
    lora_slots: int
    """Adapters one engine batch may mix (vLLM's `--max-loras`, SGLang's
    `--max-loras-per-batch`): each policy twice, its live version and the one it retires,
    which finishes its requests while the next one serves (`gateway/adapters.py`). More
    distinct adapters than slots still run (the engines queue them); each slot costs
    memory for `rank x (in + out)` per target module and layer."""
    target_modules: tuple[str, ...]
    """Every module some declared policy's adapter targets (SGLang's
    `--lora-target-modules`)."""


class ServingPlan:
    """Every policy's plan (`default`, the config's, then the runtime ones, oldest first),
    the alias table and the engine flags. Immutable: a new policy means a new plan."""

    def __init__(self, config: PlannedConfig, runtime: Sequence[PolicyConfig] = ()) -> None:
        self.engine_kind = engine_kind(config)
        """The engine kind the policies are planned for."""
        declared = [*config.policies, *runtime]
        runtime_names = {p.name for p in runtime}
        default = _default_plan(config, self.engine_kind)
        plans = [default]
        full_place = 0
        for entry in declared:
            plans.append(
                _named_plan(
                    config, self.engine_kind, entry, default.lora, full_place, runtime_names
                )
            )
            full_place += entry.weights == "full"
        self.policies: dict[str, PolicyPlan] = {p.name: p for p in plans}
        """Policy name -> its plan, `default` first."""
        self.default = default
        # The config's aliases last: one it gained after a runtime policy took the same
        # name (a config edit and restart) keeps picking the config's policy.
        self.aliases: dict[str, str] = {
            alias: p.name for p in reversed(declared) for alias in p.model_names
        }
        """Request model name -> the policy it names (every policy's `model_names`)."""
        self.engine = _engine_flags(self, config, self.engine_kind)

    # -- the policies ----------------------------------------------------------------------
    def names(self) -> list[str]:
        """Every policy: `default`, then the named ones in order."""
        return list(self.policies)

    def named(self) -> list[PolicyPlan]:
        """The named policies (config's, then runtime's); empty: the single default."""
        return [p for p in self.policies.values() if p.name != DEFAULT_POLICY]

    def __contains__(self, name: object) -> bool:
        return name in self.policies

    def __getitem__(self, name: str) -> PolicyPlan:
        return self.policies[name]

    def lora(self, name: str) -> LoRAConfig | None:
        """Policy `name`'s adapter shape (None: full weights); KeyError for an unknown one."""
        return self.policies[name].lora

    def full_weight(self) -> list[PolicyPlan]:
        """The named policies served by pools of their own, in order."""
        return [p for p in self.policies.values() if p.own_pool]

    def runtime_creatable(self) -> bool:
        """Whether policies may be created at runtime: they are LoRA adapters on the
        shared base, and vLLM and SGLang get room for several only when started with
        declared policies (`EngineFlags.lora_slots`)."""
        started = any(p.source == "config" for p in self.named())
        return _creation_refusal(self.default.lora, self.engine_kind, started) is None

    # -- which policy serves a request -----------------------------------------------------
    def serving(self, caller: CallerKind, own: str, model: str) -> tuple[str, bool]:
        """(policy, role) for a request of `caller` whose own policy is `own` (its key's;
        for the admin, its session's or `default`) naming `model`. `role`: the policy is
        not `own`, so its completions go to the episode's role sub-session of that policy
        (`gateway/roles.py`). A bound key or session stays in its own policy whatever it
        names (an unbound key's own policy is `default`); the admin may name any policy by
        its alias; a session key may name the alias of a role its policy declares."""
        named = self.aliases.get(model)
        if named is None or named == own:
            return own, False
        if caller == "admin":
            return named, True
        if caller == "session":
            plan = self.policies.get(own)
            if plan is not None and named in plan.roles:
                return named, True
        return own, False


def engine_kind(config: PlannedConfig) -> str:
    """The engine kind (`local`, `sglang`, `vllm`): the one place the policies' plan reads
    it (how adapters are named and swapped depends on it)."""
    return config.engine.backend


def _default_plan(config: PlannedConfig, kind: str) -> PolicyPlan:
    lora = config.default_policy.lora
    adapter: AdapterNaming = "none"
    swap: SwapKind = "paired"
    if lora is not None and kind == "local":
        adapter = "in_place"
        # Beside named adapters, the default's swap touches only its own adapter's rows
        # (no pause) like theirs; alone, the paired swap loads it in place.
        swap = "adapter" if config.policies else "paired"
    elif lora is not None:
        # vLLM keeps one adapter replaced in place until named policies need versioned
        # names; SGLang versions every adapter.
        adapter = "versioned" if kind == "sglang" or config.policies else "in_place"
    return PolicyPlan(
        name=DEFAULT_POLICY,
        source="config",
        weights="full" if lora is None else "lora",
        lora=lora,
        adapter=adapter,
        swap=swap,
        transport=config.trainer.weight_sync,
        backend_urls=(),
        engine_port=None,
        model_names=(),
        roles=tuple(config.default_policy.roles),
    )


def _named_plan(
    config: PlannedConfig,
    kind: str,
    entry: PolicyConfig,
    default_lora: LoRAConfig | None,
    full_place: int,
    runtime: set[str],
) -> PolicyPlan:
    source: Literal["config", "runtime"] = "runtime" if entry.name in runtime else "config"
    names, roles = tuple(entry.model_names), tuple(entry.roles)
    if entry.weights == "full":
        port = None if entry.backends else entry.port or config.engine.port + 1 + full_place
        urls = (
            tuple(u.rstrip("/") for u in entry.backends)
            if port is None
            else (f"http://{config.engine.host}:{port}",)
        )
        return PolicyPlan(
            entry.name, source, "full", None, "none", "own_pool", "disk", urls, port, names, roles
        )
    adapter: AdapterNaming = "in_place" if kind == "local" else "versioned"
    lora = entry.lora or default_lora
    return PolicyPlan(
        entry.name, source, "lora", lora, adapter, "adapter", "disk", (), None, names, roles
    )


def _engine_flags(plan: ServingPlan, config: PlannedConfig, kind: str) -> EngineFlags:
    started = [p for p in plan.policies.values() if p.source == "config"]
    loras = [p.lora for p in started if p.lora is not None]
    lora = plan.default.lora is not None
    return EngineFlags(
        lora=lora,
        adapters_by_name=lora and kind != "local",
        initial_adapter=lora and kind == "vllm" and not config.policies,
        max_lora_rank=max((x.rank for x in loras), default=0),
        lora_slots=2 * len(started),
        target_modules=tuple(sorted({m for x in loras for m in x.target_modules})),
    )


def _creation_refusal(
    default_lora: LoRAConfig | None, kind: str, started_with_policies: bool
) -> PlanError | None:
    """Why no policy may be created at runtime on this deployment (None: they may)."""
    if default_lora is None:
        return PlanError(
            "policies share the base model and differ by their LoRA adapter: this "
            "deployment trains without one (set default_policy.lora)",
            code="lora_not_enabled",
        )
    if kind != "local" and not started_with_policies:
        return PlanError(
            f"on {kind}, policies can be created at runtime only on a deployment started "
            "with at least one policy in `policies:` (the engine is then started with "
            "room for several adapters)",
            code="policies_unsupported",
        )
    return None


# -- the rules ----------------------------------------------------------------------------
def check_plan(config: PlannedConfig, runtime: Sequence[PolicyConfig] = ()) -> None:
    """Every rule across sections that the policies must keep, for the config's policies
    and `runtime` ones (a creation passes the registry's plus the new one): PlanError, with
    a status, field and code, for the first broken. Run when the config loads
    (`ServiceConfig`) and when a policy is created (`policy_registry.new_policy`)."""
    kind = engine_kind(config)
    lora = config.default_policy.lora
    if runtime:
        refusal = _creation_refusal(lora, kind, bool(config.policies))
        if refusal is not None:
            raise refusal
    _check_lora_sync(config, kind)
    declared = [*config.policies, *runtime]
    if lora is None and any(p.weights == "lora" for p in declared):
        raise PlanError(
            "policies share the base model and differ by their LoRA adapter: set "
            "default_policy.lora (e.g. --set default_policy.lora.rank=8), or give a "
            "policy its own full weights (weights: full)",
            code="lora_not_enabled",
        )
    _check_caps(config, declared, bool(runtime))
    _check_names(config, declared)
    _check_aliases(config, declared)
    _check_full_policies(config, declared)


def _check_caps(config: PlannedConfig, declared: Sequence[PolicyConfig], creating: bool) -> None:
    """`policy_caps`: the number of named policies, and each adapter's rank and alpha
    (the default policy's too). Checked on creation against the registry plus the new
    one, so a cap lowered below what exists refuses new policies, not the config."""
    caps = config.policy_caps
    if (len(declared) if creating else len(config.policies)) > caps.max_policies:
        raise PlanError(
            f"this deployment may have at most {caps.max_policies} named policies "
            "(policy_caps.max_policies); delete one or raise the cap",
            status=409,
            param="name",
            code="too_many_policies",
        )
    shapes = [(p.name, p.lora) for p in declared if p.weights == "lora"]
    for name, lora in [(DEFAULT_POLICY, config.default_policy.lora), *shapes]:
        lora = lora or config.default_policy.lora
        if lora is None:
            continue
        for field, value, cap in (
            ("rank", lora.rank, caps.max_lora_rank),
            ("alpha", lora.alpha, caps.max_lora_alpha),
        ):
            if value > cap:
                raise PlanError(
                    f"policy {name!r}: lora.{field} {value:g} is over this deployment's "
                    f"cap of {cap:g} (policy_caps.max_lora_{field})",
                    param=f"lora.{field}",
                    code="invalid_lora",
                )


def _check_lora_sync(config: PlannedConfig, kind: str) -> None:
    if config.default_policy.lora is None:
        return
    if config.trainer.weight_sync == "distributed":
        raise PlanError(
            "default_policy.lora publishes adapters, which the backends load from disk: "
            "set trainer.weight_sync=disk",
            code="invalid_weight_sync",
        )
    if kind == "sglang" and config.gateway.router.url:
        raise PlanError(
            "default_policy.lora on SGLang loads versioned adapters on each server the "
            "gateway routes to itself; through SGLang's router (gateway.router.url) the "
            "adapter names are not wired yet: list the servers in gateway.router.backends",
            code="invalid_router",
        )


def _check_names(config: PlannedConfig, declared: Sequence[PolicyConfig]) -> None:
    seen: set[str] = set()
    configured = {p.name for p in config.policies}
    for policy in declared:
        if policy.name in seen:
            origin = "the config" if policy.name in configured else "a runtime policy"
            raise PlanError(
                f"policy {policy.name!r} exists already ({origin}): a duplicate name",
                status=409,
                param="name",
                code="policy_exists",
            )
        seen.add(policy.name)
    names = [DEFAULT_POLICY, *seen]
    if config.trainer.policy not in names:
        raise PlanError(
            f"trainer.policy {config.trainer.policy!r} is not a declared policy "
            f"(known: {', '.join([DEFAULT_POLICY, *(p.name for p in declared)])})",
            param="trainer.policy",
            code="unknown_policy",
        )
    for owner, roles in [(DEFAULT_POLICY, config.default_policy.roles)] + [
        (p.name, p.roles) for p in declared
    ]:
        if owner in roles:
            raise PlanError(
                f"policy {owner!r}: roles name the policy itself (its own turns need no role)",
                param="roles",
                code="invalid_roles",
            )


def reserved_model_names(config: PlannedConfig) -> set[str]:
    """The names no policy may take as an alias: the served model name
    (`gateway.model_name`), the names every key may send for the default policy
    (`gateway.model_names`), and the engine's served name. An alias equal to one would
    make the name every agent sends pick that policy."""
    engine = config.engine.served_model_name or str(config.model_dir())
    return {config.gateway.model_name, *(config.gateway.model_names or ()), engine}


def _check_aliases(config: PlannedConfig, declared: Sequence[PolicyConfig]) -> None:
    reserved = reserved_model_names(config)
    taken: dict[str, str] = {}
    for policy in declared:
        if len(set(policy.model_names)) != len(policy.model_names):
            raise _alias_error(f"policy {policy.name!r}: a model name is listed twice")
        for alias in policy.model_names:
            if not alias or len(alias) > MAX_ALIAS_CHARS:
                raise _alias_error(
                    f"model_names: each name must be 1 to {MAX_ALIAS_CHARS} characters"
                )
            if alias in reserved:
                raise _alias_error(
                    f"model name {alias!r} is the served model's own name (gateway.model_name, "
                    "gateway.model_names or the engine's): every key may send it, so it "
                    "cannot pick a policy",
                    code="model_name_reserved",
                )
            if alias in taken:
                raise _alias_error(
                    f"model name {alias!r} already picks policy {taken[alias]!r} (a model "
                    "name maps to one policy only)",
                    status=409,
                    code="model_name_taken",
                )
            taken[alias] = policy.name


def _alias_error(
    message: str, *, status: int = 400, code: str = "invalid_model_names"
) -> PlanError:
    return PlanError(message, status=status, param="model_names", code=code)


def _check_full_policies(config: PlannedConfig, declared: Sequence[PolicyConfig]) -> None:
    full = [p for p in declared if p.weights == "full"]
    if (
        config.trainer.policy in {p.name for p in full}
        and config.trainer.weight_sync == "distributed"
    ):
        raise PlanError(
            f"policy {config.trainer.policy!r} (weights full) is swapped from disk onto its "
            "own backends: set trainer.weight_sync=disk",
            code="invalid_weight_sync",
        )
    ports = {config.gateway.port: "gateway.port", config.engine.port: "engine.port"}
    main = set(config.backend_urls())
    for place, policy in enumerate(full):
        plan = _named_plan(config, "", policy, None, place, set())
        if config.engine.port == 0 and plan.engine_port is not None:
            raise PlanError(
                f"policy {policy.name!r}: engine.port 0 (a free port) leaves no port to "
                "derive its engine's from; set policies[].port or policies[].backends",
                param="port",
                code="invalid_port",
            )
        for url in plan.backend_urls:
            if url in main:
                raise PlanError(
                    f"policy {policy.name!r}: backend {url} also serves the main pool; a "
                    "full-weight policy needs engines of its own",
                    param="backends",
                    code="invalid_backends",
                )
        if plan.engine_port is not None:
            if plan.engine_port in ports:
                raise PlanError(
                    f"policy {policy.name!r}: port {plan.engine_port} is also "
                    f"{ports[plan.engine_port]}; set policies[].port",
                    param="port",
                    code="invalid_port",
                )
            ports[plan.engine_port] = f"policy {policy.name!r}'s port"
