"""`policies:` and `default_policy:`: the named policies on the one base model and the
default policy's adapter shape. How they are served (adapter naming, pools, swaps) and
the rules across sections are the serving plan's (`areal_service/serving_plan.py`)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from areal_service.types import DEFAULT_POLICY

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The attention and MLP projections of Llama/Qwen/Mistral-style decoders (SmolLM2, the
tiny model): LoRA on all of them is what QLoRA found to match full fine-tuning best."""


class LoRAConfig(BaseModel):
    """An adapter's shape (`default_policy.lora`, `policies[].lora`): train a LoRA adapter
    (PEFT) instead of every weight. Each version is published as the adapter alone
    (PEFT's `adapter_config.json` + `adapter_model.safetensors`) and swapped in place on
    the backends."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    rank: int = Field(8, ge=1, le=512)
    """LoRA rank r (the adapter's inner dimension)."""
    alpha: float = Field(16.0, gt=0, allow_inf_nan=False)
    """LoRA alpha: the update is scaled by alpha / rank."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input while training. 0 keeps the trainer's forward equal
    to the engine's, which the PPO ratio assumes."""
    target_modules: list[str] = Field(default_factory=lambda: list(LORA_TARGETS), min_length=1)
    """Module names (PEFT's suffix match) that get an adapter."""


POLICY_NAME_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,62}$"
"""A policy's name is also its served adapter name (vLLM's `lora_name`, the model name
the gateway sends), the `weights/<policy>/` directory and a store column value: lower
case, digits, `-` and `_`, at most 63 characters."""


PolicyWeights = Literal["lora", "full"]
"""How a named policy differs from the base model: `lora`, an adapter served beside the
others on the main backends; `full`, its own full weights on its own backends."""


class PolicyConfig(BaseModel):
    """One entry of `policies:`: a named policy on the shared base model with its own LoRA
    adapter (or, with `weights: full`, its own full weights on its own backends), trained
    by its own trainer process (`trainer.policy`)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    name: str = Field(pattern=POLICY_NAME_PATTERN)
    """The policy's name: what keys and sessions are bound to, and its adapter's served
    name on the backends."""
    lora: LoRAConfig | None = None
    """The adapter's rank, alpha and target modules. None: `default_policy.lora`'s."""
    model_names: list[str] = Field(default_factory=list)
    """Request model names (aliases) that pick this policy where the caller may choose:
    the admin key, and an episode of a policy that declares this one among its `roles`.
    A key or session bound to a policy is served by its own policy whatever name it
    sends (the serving plan, `areal_service/serving_plan.py`). An alias may not be
    `gateway.model_name`, one of `gateway.model_names` or the engine's served name."""
    roles: list[str] = Field(default_factory=list)
    """The policies this policy's episodes may open as roles (a multi-agent episode: a
    turn naming a role's alias is served by that policy and recorded in the episode's
    role sub-session, `gateway/roles.py`). A turn naming any other policy's alias stays in
    the episode's own policy."""
    weights: PolicyWeights = "lora"
    """`lora`: a LoRA adapter on the shared base, served by the main backends. `full`:
    full fine-tuning; every weight is the policy's own, so it is served by backends of
    its own (`backends`, else a local engine the launcher starts on `port`), which only
    its versions are swapped onto."""
    backends: list[str] = Field(default_factory=list)
    """`weights: full` only: URLs of the engines serving this policy (as
    `gateway.router.backends` for the main pool). Empty: the local engine that `serve`
    starts for it at `engine.host`:`port`."""
    port: int | None = Field(None, ge=1, le=65535)
    """`weights: full` only: the port of the local engine started for it. None:
    `engine.port` + its place among the full-weight policies (1, 2, ...)."""

    @model_validator(mode="after")
    def _check_weights(self) -> PolicyConfig:
        if self.weights == "full" and self.lora is not None:
            raise ValueError(
                f"policy {self.name!r}: weights full trains every weight; drop its lora "
                "section (or use weights: lora)"
            )
        if self.weights == "lora" and (self.backends or self.port is not None):
            raise ValueError(
                f"policy {self.name!r}: backends and port are for weights: full (a LoRA "
                "policy is served by the main backends beside the others)"
            )
        if self.backends and self.port is not None:
            raise ValueError(
                f"policy {self.name!r}: give either backends (engines you run) or port "
                "(the local engine started for it), not both"
            )
        return self

    @field_validator("roles")
    @classmethod
    def _role_names(cls, value: list[str]) -> list[str]:
        return _checked_roles(value)

    @field_validator("name")
    @classmethod
    def _not_reserved(cls, value: str) -> str:
        # "default" is the implicit single policy; "areal-lora" is its served name.
        if value in (DEFAULT_POLICY, "areal-lora"):
            raise ValueError(f"policy name {value!r} is reserved (the default policy)")
        # The default policy publishes `weights/v{N}/`, beside the policies' directories.
        if value[0] == "v" and value[1:].isdigit():
            raise ValueError(f"policy name {value!r} looks like a version directory")
        return value


def _checked_roles(roles: list[str]) -> list[str]:
    pattern = re.compile(POLICY_NAME_PATTERN)
    for role in roles:
        if not pattern.match(role):
            raise ValueError(f"roles: {role!r} is not a policy name")
    if len(set(roles)) != len(roles):
        raise ValueError("roles: a role is listed twice")
    return roles


class DefaultPolicyConfig(BaseModel):
    """`default_policy:`: the policy every unbound key is served by (the single policy of a
    deployment without `policies:`), declared as the named ones are."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    lora: LoRAConfig | None = None
    """Train and serve the default policy as a LoRA adapter on the frozen base model
    (`trainer/lora.py`); also the shape of a named policy that gives none. None: full
    fine-tuning. Versions are published as adapters and loaded in place by the engines;
    disk weight sync only. Named LoRA policies need it (the base stays shared).
    Formerly `trainer.lora` (still read, with a warning)."""
    roles: list[str] = Field(default_factory=list)
    """The named policies the default policy's episodes may open as roles (as
    `policies[].roles`)."""

    @field_validator("roles")
    @classmethod
    def _role_names(cls, value: list[str]) -> list[str]:
        return _checked_roles(value)


class PolicyCapsConfig(BaseModel):
    """`policy_caps:`: what one deployment may hold of policies and adapters, checked when
    the config loads and when a policy is created at runtime (the admin API, console,
    CLI). Each policy costs a trainer process (a few GB), an adapter on every backend and
    a share of the gateway's and syncer's rounds; a LoRA update is scaled by alpha / rank,
    so an unbounded alpha overflows the first step."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    max_policies: int = Field(64, ge=0)
    """Named policies (the config's and the runtime ones; `default` not counted) the
    deployment may have: creating one more is 409 `too_many_policies`, and `launch`
    refuses to start more trainers than this."""
    max_lora_rank: int = Field(64, ge=1, le=512)
    """Largest LoRA rank a policy's adapter may have (an adapter's memory grows with it:
    rank 512 on every projection is larger than the tiny base model)."""
    max_lora_alpha: float = Field(1024.0, gt=0, allow_inf_nan=False)
    """Largest LoRA alpha a policy's adapter may have."""
