"""Policies created at runtime (issue 29): the store keeps names and model names unique
across processes (SQLite and PostgreSQL), the registry merges them with the config's
(which stay authoritative for their names), and `new_policy` refuses bad ones with the
status, field and code the admin API answers with."""

from __future__ import annotations

import pytest

from areal_service.config import ServiceConfig
from areal_service.policy_registry import (
    PolicyError,
    PolicyRegistry,
    new_policy,
    with_runtime_policies,
)
from areal_service.serving_plan import ServingPlan
from areal_service.store import PolicyConflict
from areal_service.types import PolicyRecord

LORA = {"rank": 4, "alpha": 8.0}


def _config(**tree: object) -> ServiceConfig:
    return ServiceConfig.model_validate(
        {
            "trainer": {"lora": LORA},
            "policies": [{"name": "solver", "model_names": ["solver-model"]}],
            **tree,
        }
    )


def test_the_store_keeps_names_and_model_names_unique(store) -> None:
    first = PolicyRecord(
        name="critic", lora={"rank": 2}, model_names=("critic-b", "critic-a"), created_at=1.0
    )
    store.policies.add_policy(first)
    store.policies.add_policy(PolicyRecord(name="judge", created_at=2.0))
    with pytest.raises(PolicyConflict) as same_name:
        store.policies.add_policy(PolicyRecord(name="critic", model_names=("fresh",)))
    assert same_name.value.field == "name"
    with pytest.raises(PolicyConflict) as same_alias:
        store.policies.add_policy(PolicyRecord(name="other", model_names=("x", "critic-a")))
    assert same_alias.value.field == "model_names" and same_alias.value.value == "critic-a"
    # A refused insert leaves nothing behind: neither the policy nor its free alias "x".
    listed = store.policies.list_policies()
    assert [p.name for p in listed] == ["critic", "judge"]
    assert listed[0].lora == {"rank": 2} and listed[0].model_names == ("critic-a", "critic-b")
    assert listed[1].lora is None and listed[1].model_names == ()
    store.policies.add_policy(PolicyRecord(name="other", model_names=("x",), created_at=3.0))
    assert store.policies.list_policies()[-1].model_names == ("x",)


def test_the_registry_merges_config_and_runtime_policies() -> None:
    config = _config()
    registry = PolicyRegistry(config)
    assert registry.names() == ["default", "solver"]
    added = registry.update(
        [
            PolicyRecord(name="critic", lora={"rank": 16, "alpha": 32.0}, model_names=("c",)),
            # The config declares "solver": its stored namesake is ignored.
            PolicyRecord(name="solver", lora={"rank": 64}, model_names=("other",)),
        ]
    )
    assert added == ["critic"]
    assert registry.names() == ["default", "solver", "critic"]
    assert registry.model_policies == {"solver-model": "solver", "c": "critic"}
    critic, solver = registry.lora("critic"), registry.lora("solver")
    assert critic is not None and critic.rank == 16 and solver is not None and solver.rank == 4
    assert registry.source("critic") == "runtime" and registry.source("solver") == "config"
    assert "critic" in registry and "default" in registry and "nobody" not in registry
    assert registry.update(list(registry.runtime.values())) == []  # nothing new
    # A config alias that a runtime policy also holds picks the config's policy.
    clash = PolicyRegistry(config, [PolicyRecord(name="late", model_names=("solver-model",))])
    assert clash.model_policies["solver-model"] == "solver"
    with pytest.raises(KeyError):
        registry.lora("nobody")


@pytest.mark.parametrize(
    ("name", "lora", "model_names", "status", "code", "param"),
    [
        ("Bad Name", None, (), 400, "invalid_policy_name", "name"),
        ("default", None, (), 400, "invalid_policy_name", "name"),
        ("areal-lora", None, (), 400, "invalid_policy_name", "name"),
        ("v3", None, (), 400, "invalid_policy_name", "name"),
        ("critic", {"rank": 0}, (), 400, "invalid_lora", "lora.rank"),
        (
            "critic",
            {"rank": 4, "target_modules": []},
            (),
            400,
            "invalid_lora",
            "lora.target_modules",
        ),
        ("critic", {"rank": 4, "bogus": 1}, (), 400, "invalid_lora", "lora.bogus"),
        ("critic", None, ("a", "a"), 400, "invalid_model_names", "model_names"),
        ("critic", None, ("",), 400, "invalid_model_names", "model_names"),
        ("solver", None, (), 409, "policy_exists", "name"),
        ("critic", None, ("solver-model",), 409, "model_name_taken", "model_names"),
    ],
)
def test_new_policy_refuses_bad_input_with_status_field_and_code(
    name: str,
    lora: dict[str, object] | None,
    model_names: tuple[str, ...],
    status: int,
    code: str,
    param: str,
) -> None:
    config = _config()
    with pytest.raises(PolicyError) as refused:
        new_policy(config, PolicyRegistry(config), name, lora, model_names)
    assert (refused.value.status, refused.value.code, refused.value.param) == (status, code, param)


def test_new_policy_needs_lora_and_sees_runtime_names() -> None:
    plain = ServiceConfig()
    with pytest.raises(PolicyError) as no_lora:
        new_policy(plain, PolicyRegistry(plain), "critic")
    assert no_lora.value.code == "lora_not_enabled"
    config = _config()
    registry = PolicyRegistry(config, [PolicyRecord(name="critic", model_names=("c",))])
    with pytest.raises(PolicyError, match="a runtime policy"):
        new_policy(config, registry, "critic")
    with pytest.raises(PolicyError, match="picks policy 'critic'"):
        new_policy(config, registry, "judge", None, ["c"])
    made = new_policy(config, registry, "judge", {"rank": 8, "alpha": 4}, ["judge-model"])
    assert made.name == "judge" and made.model_names == ("judge-model",)
    assert made.lora is not None and made.lora["rank"] == 8 and made.lora["alpha"] == 4.0


def test_a_runtime_policys_trainer_config(tmp_path) -> None:
    config = _config(data_dir=str(tmp_path))
    runtime = [PolicyRecord(name="critic", lora={"rank": 16, "alpha": 32.0})]
    trainer = with_runtime_policies(config, runtime, "critic")
    assert trainer.trainer.policy == "critic"
    assert ServingPlan(trainer).names() == ["default", "solver", "critic"]
    critic = ServingPlan(trainer).lora("critic")
    assert critic is not None and critic.rank == 16
    assert trainer.weights_dir() == tmp_path / "weights" / "critic"
    assert (
        trainer.gateway.auth.admin_key.get_secret_value()
        == config.gateway.auth.admin_key.get_secret_value()
    )
    with pytest.raises(ValueError, match="not a declared policy"):
        with_runtime_policies(config, runtime, "nobody")


def test_cli_creates_lists_binds_and_trains_a_runtime_policy(tmp_path) -> None:
    import json

    from typer.testing import CliRunner

    from launcher.cli import _trainer_config, app

    sets = ["--set", f"data_dir={tmp_path}", "--set", "trainer.lora.rank=4"]
    sets += ["--set", "policies=[{name: solver, model_names: [solver-model]}]"]
    runner = CliRunner()
    made = runner.invoke(
        app,
        [
            "policies",
            "create",
            "critic",
            "--rank",
            "16",
            "--target-modules",
            "q_proj, v_proj",
            "--model-name",
            "critic-a",
            "--model-name",
            "critic-b",
            *sets,
        ],
    )
    assert made.exit_code == 0, made.output
    shown = json.loads(made.stdout)
    assert shown["lora"]["rank"] == 16 and shown["lora"]["alpha"] == 16.0  # trainer.lora's
    assert shown["lora"]["target_modules"] == ["q_proj", "v_proj"]
    assert shown["model_names"] == ["critic-a", "critic-b"]
    plain = runner.invoke(app, ["policies", "create", "judge", *sets])
    assert plain.exit_code == 0 and json.loads(plain.stdout)["lora"] is None
    for args, words in [
        (["critic"], "exists already (a runtime policy)"),
        (["solver"], "exists already (the config)"),
        (["other", "--model-name", "solver-model"], "already picks policy 'solver'"),
        (["Bad"], "should match pattern"),
        (["other", "--rank", "0"], "lora.rank"),
    ]:
        refused = runner.invoke(app, ["policies", "create", *args, *sets])
        assert refused.exit_code == 2 and words in refused.output, refused.output
    listed = runner.invoke(app, ["policies", "list", *sets])
    assert listed.exit_code == 0, listed.output
    rows = {r["name"]: r for r in json.loads(listed.stdout)}
    assert list(rows) == ["default", "solver", "critic", "judge"]
    assert rows["critic"]["source"] == "runtime" and rows["critic"]["lora_rank"] == 16
    assert rows["judge"]["lora_rank"] == 4 and rows["solver"]["source"] == "config"
    assert rows["critic"]["model_names"] == ["critic-a", "critic-b"]
    key = runner.invoke(app, ["keys", "create", "--policy", "critic", *sets])
    assert key.exit_code == 0 and json.loads(key.stdout)["policy"] == "critic"
    # `trainer --policy critic` resolves the stored policy as a declared one.
    trainer = _trainer_config(None, [s for s in sets if s != "--set"], "critic")
    assert trainer.trainer.policy == "critic" and trainer.weights_dir().name == "critic"
    critic = ServingPlan(trainer).lora("critic")
    assert critic is not None and critic.rank == 16
    unknown = runner.invoke(app, ["trainer", "--policy", "nobody", *sets])
    assert unknown.exit_code != 0 and "not a declared policy" in unknown.output


def test_target_modules_are_checked_against_the_base_models_layers(
    tiny_model_dir, tmp_path
) -> None:
    from areal_service.config import LORA_TARGETS
    from areal_service.policy_registry import matrix_modules

    modules = matrix_modules(tiny_model_dir)
    assert modules is not None and "model.layers.0.self_attn.q_proj" in modules
    assert not any(m.endswith("layernorm") for m in modules)  # 1-D: not a LoRA target
    assert matrix_modules(tmp_path) is None  # nothing to read: not checked
    config = _config()
    registry = PolicyRegistry(config)
    made = new_policy(config, registry, "ok", {"target_modules": list(LORA_TARGETS)}, (), modules)
    assert made.lora is not None
    for targets in (["q_proj", "nope"], ["input_layernorm"]):
        with pytest.raises(PolicyError, match="match no linear") as refused:
            new_policy(config, registry, "bad", {"target_modules": targets}, (), modules)
        assert refused.value.param == "lora.target_modules" and refused.value.status == 400
