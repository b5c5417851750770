"""Named policies (`policies:` in config, issue 29's second slice): validation, the
default single policy, and per-policy trainer directories."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from areal_service.config import DEFAULT_POLICY, ServiceConfig

LORA = {"rank": 4, "alpha": 8.0}


def _config(**tree: object) -> ServiceConfig:
    return ServiceConfig.model_validate({"trainer": {"lora": LORA}, **tree})


def test_no_policies_is_the_single_default_policy(tmp_path) -> None:
    config = ServiceConfig(data_dir=tmp_path)
    assert config.policies == []
    assert config.policy_names() == [DEFAULT_POLICY]
    assert config.trainer.policy == DEFAULT_POLICY
    assert config.weights_dir() == tmp_path / "weights"
    assert config.checkpoint_dir() == tmp_path / "checkpoints"


def test_declared_policies_take_trainer_lora_unless_given(tmp_path) -> None:
    config = _config(data_dir=str(tmp_path), policies=[
        {"name": "solver", "model_names": ["solver-model"]},
        {"name": "verifier", "lora": {"rank": 16, "alpha": 32.0}},
    ], )
    assert config.policy_names() == ["default", "solver", "verifier"]
    solver, verifier = config.policy_lora("solver"), config.policy_lora("verifier")
    assert solver is not None and solver.rank == 4
    assert verifier is not None and verifier.rank == 16
    with pytest.raises(KeyError):
        config.policy_lora("nobody")
    trainer = _config(data_dir=str(tmp_path), policies=[{"name": "solver"}],
                      )
    trainer = trainer.model_copy(update={"trainer": trainer.trainer.model_copy(
        update={"policy": "solver"})})
    assert trainer.weights_dir() == tmp_path / "weights" / "solver"
    assert trainer.checkpoint_dir() == tmp_path / "checkpoints" / "solver"


@pytest.mark.parametrize(("tree", "message"), [
    ({"policies": [{"name": "a"}], "trainer": {}}, "set trainer.lora"),
    ({"policies": [{"name": "Bad Name"}]}, "should match pattern"),
    ({"policies": [{"name": "default"}]}, "reserved"),
    ({"policies": [{"name": "areal-lora"}]}, "reserved"),
    ({"policies": [{"name": "v3"}]}, "version directory"),
    ({"policies": [{"name": "a"}, {"name": "a"}]}, "duplicate name"),
    ({"policies": [{"name": "a", "model_names": ["m"]},
                   {"name": "b", "model_names": ["m"]}]}, "more than one policy"),
    ({"policies": [{"name": "a"}], "trainer": {"lora": LORA, "policy": "b"}},
     "not a declared policy"),
])
def test_bad_policies_are_refused_when_the_config_loads(tree: dict[str, object],
                                                        message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        ServiceConfig.model_validate({"trainer": {"lora": LORA}, **tree})


def test_cli_keys_create_binds_the_policy(tmp_path) -> None:
    import json

    from typer.testing import CliRunner

    from areal_service.config import load_config
    from areal_service.store import TrajectoryStore
    from launcher.cli import app

    sets = ["--set", f"data_dir={tmp_path}", "--set", "trainer.lora.rank=4",
            "--set", "policies=[{name: solver}]"]
    runner = CliRunner()
    created = runner.invoke(app, ["keys", "create", "--policy", "solver", *sets])
    assert created.exit_code == 0, created.output
    key_id = json.loads(created.stdout)["id"]
    unknown = runner.invoke(app, ["keys", "create", "--policy", "nobody", *sets])
    assert unknown.exit_code == 2 and "unknown policy 'nobody'" in unknown.output
    config = load_config(overrides=[f"data_dir={tmp_path}"])
    store = TrajectoryStore.open(config.database_url(), config.store)
    try:
        key = store.keys.get_api_key(key_id)
        assert key is not None and key.policy == "solver"
        assert [k.policy for k in store.keys.list_api_keys()] == ["solver"]
    finally:
        store.close()
