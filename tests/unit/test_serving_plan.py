"""The serving plan (`areal_service/serving_plan.py`): each policy's plan over the
combinations of the default policy's adapter x engine kind x declared policies, the
rules across sections as one function (`check_plan`), and which policy serves a
request for each kind of principal."""

from __future__ import annotations

import re
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from areal_service.config import (
    DefaultPolicyConfig,
    EngineConfig,
    GatewayConfig,
    PolicyConfig,
    ServiceConfig,
    TrainerConfig,
)
from areal_service.serving_plan import PlanError, ServingPlan, check_plan

LORA = {"rank": 4, "alpha": 8.0}


def _config(*, lora: bool = True, backend: str = "local", **tree: Any) -> ServiceConfig:
    base: dict[str, Any] = {"engine": {"backend": backend}}
    if lora:
        base["default_policy"] = {"lora": LORA}
    return ServiceConfig.model_validate({**base, **tree})


@pytest.mark.parametrize(
    ("lora", "backend", "named", "adapter", "swap", "named_adapter", "by_name", "initial"),
    [
        (False, "local", False, "none", "paired", None, False, False),
        (False, "vllm", False, "none", "paired", None, False, False),
        (False, "sglang", False, "none", "paired", None, False, False),
        (True, "local", False, "in_place", "paired", None, False, False),
        (True, "local", True, "in_place", "adapter", "in_place", False, False),
        (True, "vllm", False, "in_place", "paired", None, True, True),
        (True, "vllm", True, "versioned", "paired", "versioned", True, False),
        (True, "sglang", False, "versioned", "paired", None, True, False),
        (True, "sglang", True, "versioned", "paired", "versioned", True, False),
    ],
)
def test_each_combination_has_one_plan(
    lora: bool,
    backend: str,
    named: bool,
    adapter: str,
    swap: str,
    named_adapter: str | None,
    by_name: bool,
    initial: bool,
) -> None:
    policies = [{"name": "solver", "model_names": ["solver-model"]}] if named else []
    plan = ServingPlan(_config(lora=lora, backend=backend, policies=policies))
    default = plan.default
    assert (default.weights, default.adapter, default.swap) == (
        "lora" if lora else "full",
        adapter,
        swap,
    )
    assert plan.engine.lora == lora and plan.engine.adapters_by_name == by_name
    assert plan.engine.initial_adapter == initial
    assert plan.engine.lora_slots == 2 * (1 + named)
    if named:
        solver = plan["solver"]
        assert solver.adapter == named_adapter and solver.swap == "adapter"
        assert solver.lora is not None and solver.lora.rank == 4  # the default's shape
        assert plan.aliases == {"solver-model": "solver"}


def test_full_weight_policies_get_their_own_pools_and_engine_flags_count_adapters() -> None:
    plan = ServingPlan(
        _config(
            engine={"backend": "sglang", "port": 31000},
            policies=[
                {"name": "critic", "weights": "full"},
                {"name": "judge", "lora": {"rank": 16, "target_modules": ["q_proj"]}},
            ],
        )
    )
    critic = plan["critic"]
    assert critic.own_pool and critic.lora is None and critic.adapter == "none"
    assert critic.backend_urls == ("http://127.0.0.1:31001",) and critic.engine_port == 31001
    assert [p.name for p in plan.full_weight()] == ["critic"]
    assert plan.engine.max_lora_rank == 16 and plan.engine.lora_slots == 6
    assert "q_proj" in plan.engine.target_modules and "down_proj" in plan.engine.target_modules


def test_runtime_policies_join_the_plan_and_are_creatable_only_where_engines_have_room() -> None:
    config = _config(policies=[{"name": "solver", "model_names": ["s"]}])
    plan = ServingPlan(config, [PolicyConfig(name="critic", model_names=["c"])])
    assert plan.names() == ["default", "solver", "critic"]
    assert plan["critic"].source == "runtime" and plan.aliases == {"s": "solver", "c": "critic"}
    assert plan.runtime_creatable()
    assert not ServingPlan(_config(lora=False)).runtime_creatable()
    assert not ServingPlan(_config(backend="vllm")).runtime_creatable()
    assert ServingPlan(_config(backend="vllm", policies=[{"name": "a"}])).runtime_creatable()


@pytest.mark.parametrize(
    ("caller", "own", "model", "served"),
    [
        # A bound key or session keeps its own policy whatever it names (N1, N2).
        ("user", "solver", "tenantb-model", ("solver", False)),
        ("session", "solver", "tenantb-model", ("solver", False)),
        ("user", "solver", "reviewer-model", ("solver", False)),  # roles are episodes'
        ("user", "solver", "my-agent", ("solver", False)),
        # An unbound key is the default policy's.
        ("user", "default", "solver-model", ("default", False)),
        ("session", "default", "tenantb-model", ("default", False)),
        # An episode opens the roles its policy declares.
        ("session", "solver", "reviewer-model", ("reviewer", True)),
        ("session", "solver", "solver-model", ("solver", False)),
        # The admin may name any policy; else its own (its session's, or default).
        ("admin", "default", "tenantb-model", ("tenantb", True)),
        ("admin", "solver", "reviewer-model", ("reviewer", True)),
        ("admin", "default", "gpt-4o-mini", ("default", False)),
    ],
)
def test_which_policy_serves_a_request_comes_from_its_principal(
    caller: Any, own: str, model: str, served: tuple[str, bool]
) -> None:
    plan = ServingPlan(
        _config(
            policies=[
                {"name": "solver", "model_names": ["solver-model"], "roles": ["reviewer"]},
                {"name": "reviewer", "model_names": ["reviewer-model"]},
                {"name": "tenantb", "model_names": ["tenantb-model"]},
            ]
        )
    )
    assert plan.serving(caller, own, model) == served


@pytest.mark.parametrize(
    ("tree", "runtime", "status", "code", "message"),
    [
        (
            {"lora": False, "policies": [{"name": "a"}]},
            [],
            400,
            "lora_not_enabled",
            "set default_policy.lora",
        ),
        ({"lora": False}, [{"name": "a"}], 400, "lora_not_enabled", "trains without one"),
        ({"backend": "vllm"}, [{"name": "a"}], 400, "policies_unsupported", "on vllm"),
        ({"trainer": {"weight_sync": "distributed"}}, [], 400, "invalid_weight_sync", "disk"),
        (
            {"backend": "sglang", "gateway": {"router": {"url": "http://r:1"}}},
            [],
            400,
            "invalid_router",
            "router",
        ),
        ({"policies": [{"name": "a"}]}, [{"name": "a"}], 409, "policy_exists", "(the config)"),
        ({}, [{"name": "a"}, {"name": "a"}], 409, "policy_exists", "a runtime policy"),
        ({"trainer": {"policy": "b"}}, [], 400, "unknown_policy", "not a declared policy"),
        ({"policies": [{"name": "a", "roles": ["a"]}]}, [], 400, "invalid_roles", "itself"),
        (
            {"policies": [{"name": "a", "model_names": ["m"]}]},
            [{"name": "b", "model_names": ["m"]}],
            409,
            "model_name_taken",
            "already picks policy 'a'",
        ),
        ({}, [{"name": "b", "model_names": ["m", "m"]}], 400, "invalid_model_names", "twice"),
        ({}, [{"name": "b", "model_names": [""]}], 400, "invalid_model_names", "1 to 200"),
        # N6: no alias takes the name every key may send for the default policy.
        ({}, [{"name": "b", "model_names": ["areal-policy"]}], 400, "model_name_reserved", ""),
        (
            {"gateway": {"model_names": ["gpt-4o-mini"]}},
            [{"name": "b", "model_names": ["gpt-4o-mini"]}],
            400,
            "model_name_reserved",
            "every key may send it",
        ),
        (
            {"engine": {"served_model_name": "m"}},
            [{"name": "b", "model_names": ["m"]}],
            400,
            "model_name_reserved",
            "",
        ),
        (
            {"policies": [{"name": "a", "weights": "full", "port": 8000}]},
            [],
            400,
            "invalid_port",
            "gateway.port",
        ),
        (
            {"engine": {"port": 0}, "policies": [{"name": "a", "weights": "full"}]},
            [],
            400,
            "invalid_port",
            "engine.port 0",
        ),
        (
            {
                "gateway": {"router": {"backends": ["http://e:1"]}},
                "policies": [{"name": "a", "weights": "full", "backends": ["http://e:1/"]}],
            },
            [],
            400,
            "invalid_backends",
            "main pool",
        ),
        (
            {
                "lora": False,
                "trainer": {"policy": "a", "weight_sync": "distributed"},
                "policies": [{"name": "a", "weights": "full"}],
            },
            [],
            400,
            "invalid_weight_sync",
            "weights full",
        ),
    ],
)
def test_the_rules_across_sections_are_one_function(
    tree: dict[str, Any], runtime: list[dict[str, Any]], status: int, code: str, message: str
) -> None:
    """Each rule, at config load (`runtime` empty: `ServiceConfig` runs `check_plan`) and
    at a creation (the new policy among the runtime ones), with its status and code."""
    sections = {k: v for k, v in tree.items() if k not in ("lora", "backend")}
    sections["engine"] = {"backend": tree.get("backend", "local"), **tree.get("engine", {})}
    if tree.get("lora", True):
        sections["default_policy"] = {"lora": LORA}
    if runtime:
        with pytest.raises(PlanError) as refused:
            check_plan(
                ServiceConfig.model_validate(sections),
                [PolicyConfig.model_validate(r) for r in runtime],
            )
    else:
        with pytest.raises(ValidationError, match=re.escape(message)):
            ServiceConfig.model_validate(sections)
        with pytest.raises(PlanError) as refused:
            check_plan(_unchecked(sections))
    assert (refused.value.status, refused.value.code) == (status, code)
    assert message in refused.value.message


SECTIONS: dict[str, type[BaseModel]] = {
    "engine": EngineConfig,
    "trainer": TrainerConfig,
    "gateway": GatewayConfig,
    "default_policy": DefaultPolicyConfig,
}


def _unchecked(tree: dict[str, Any]) -> ServiceConfig:
    """`tree`'s sections validated one by one, without the root's rules (`model_copy`
    validates nothing): what `check_plan` is then given alone."""
    update: dict[str, Any] = {
        k: SECTIONS[k].model_validate(v) for k, v in tree.items() if k in SECTIONS
    }
    update["policies"] = [PolicyConfig.model_validate(p) for p in tree.get("policies", [])]
    return ServiceConfig().model_copy(update=update)
