"""Named policies (`policies:` in config, issue 29's second slice): validation, the
default single policy, and per-policy trainer directories."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from areal_service.config import DEFAULT_POLICY, ServiceConfig
from areal_service.serving_plan import ServingPlan

LORA = {"rank": 4, "alpha": 8.0}


def _config(**tree: object) -> ServiceConfig:
    return ServiceConfig.model_validate({"trainer": {"lora": LORA}, **tree})


def test_no_policies_is_the_single_default_policy(tmp_path) -> None:
    config = ServiceConfig(data_dir=tmp_path)
    assert config.policies == []
    assert ServingPlan(config).names() == [DEFAULT_POLICY]
    assert config.trainer.policy == DEFAULT_POLICY
    assert config.weights_dir() == tmp_path / "weights"
    assert config.checkpoint_dir() == tmp_path / "checkpoints"


def test_declared_policies_take_trainer_lora_unless_given(tmp_path) -> None:
    config = _config(
        data_dir=str(tmp_path),
        policies=[
            {"name": "solver", "model_names": ["solver-model"]},
            {"name": "verifier", "lora": {"rank": 16, "alpha": 32.0}},
        ],
    )
    plan = ServingPlan(config)
    assert plan.names() == ["default", "solver", "verifier"]
    solver, verifier = plan.lora("solver"), plan.lora("verifier")
    assert solver is not None and solver.rank == 4
    assert verifier is not None and verifier.rank == 16
    with pytest.raises(KeyError):
        plan.lora("nobody")
    trainer = _config(
        data_dir=str(tmp_path),
        policies=[{"name": "solver"}],
    )
    trainer = trainer.model_copy(
        update={"trainer": trainer.trainer.model_copy(update={"policy": "solver"})}
    )
    assert trainer.weights_dir() == tmp_path / "weights" / "solver"
    assert trainer.checkpoint_dir() == tmp_path / "checkpoints" / "solver"


@pytest.mark.parametrize(
    ("tree", "message"),
    [
        ({"policies": [{"name": "a"}], "trainer": {}}, "set default_policy.lora"),
        ({"policies": [{"name": "Bad Name"}]}, "should match pattern"),
        ({"policies": [{"name": "default"}]}, "reserved"),
        ({"policies": [{"name": "areal-lora"}]}, "reserved"),
        ({"policies": [{"name": "v3"}]}, "version directory"),
        ({"policies": [{"name": "a"}, {"name": "a"}]}, "duplicate name"),
        (
            {
                "policies": [
                    {"name": "a", "model_names": ["m"]},
                    {"name": "b", "model_names": ["m"]},
                ]
            },
            "already picks policy 'a'",
        ),
        (
            {"policies": [{"name": "a"}], "trainer": {"lora": LORA, "policy": "b"}},
            "not a declared policy",
        ),
    ],
)
def test_bad_policies_are_refused_when_the_config_loads(
    tree: dict[str, object], message: str
) -> None:
    with pytest.raises(ValidationError, match=message):
        ServiceConfig.model_validate({"trainer": {"lora": LORA}, **tree})


def test_cli_keys_create_binds_the_policy(tmp_path) -> None:
    import json

    from typer.testing import CliRunner

    from areal_service.config import load_config
    from areal_service.store import TrajectoryStore
    from launcher.cli import app

    sets = [
        "--set",
        f"data_dir={tmp_path}",
        "--set",
        "trainer.lora.rank=4",
        "--set",
        "policies=[{name: solver}]",
    ]
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


def _episode(store, sid: str, policy: str, group_id: str | None = None) -> None:
    """An ended, rewarded one-turn session of `policy`."""
    from areal_service.types import CompletionRecord, RewardRecord, SessionRecord

    store.add_session(
        SessionRecord(
            id=sid, group_id=group_id, created_at=1.0, last_activity_at=1.0, policy=policy
        )
    )
    store.add_completions(
        [
            CompletionRecord(
                id=f"{sid}-c",
                model="m",
                prompt_ids=(1, 2, 3),
                output_ids=(10, 20),
                output_logprobs=(-0.5, -0.25),
                output_versions=(0, 0),
                finish_reason="stop",
                session_id=sid,
                created_at=1.0,
            )
        ]
    )
    store.add_reward(RewardRecord(id=f"r-{sid}", value=1.0, session_id=sid))
    store.end_session(sid, "client", at=2.0)


def test_a_policys_trainer_claims_and_releases_only_its_own_episodes(store) -> None:
    from areal_service.store.claims import EpisodeClaimer

    for i in range(2):
        _episode(store, f"sol-{i}", "solver", group_id="g-sol")
        _episode(store, f"def-{i}", DEFAULT_POLICY, group_id="g-def")
    # The same group id under two policies stays two groups: each trainer its own.
    _episode(store, "sol-shared", "solver", group_id="g-shared")
    _episode(store, "def-shared", DEFAULT_POLICY, group_id="g-shared")
    args = {"group_size": None, "max_groups": 10, "current_version": 0, "max_staleness": None}
    solver = EpisodeClaimer(store, reward_wait_s=0, policy="solver")
    got = solver.claim_groups(claimer="solver-trainer", **args)
    assert sorted(s for g in got.groups for s in g.session_ids) == ["sol-0", "sol-1", "sol-shared"]
    # A default trainer starting up releases stale claims: never the solver's.
    default = EpisodeClaimer(store, reward_wait_s=0)
    assert default.release_stale_claims(0) == 0
    assert {store.get_session(s).status for s in ("sol-0", "sol-shared")} == {"claimed"}
    mine = default.claim_groups(claimer="default-trainer", **args)
    assert sorted(s for g in mine.groups for s in g.session_ids) == ["def-0", "def-1", "def-shared"]
    assert solver.release_stale_claims(0) == 3
    assert store.get_session("sol-0").status == "ended"
    assert store.get_session("def-0").status == "claimed"


def test_versions_and_steps_count_per_policy(store) -> None:
    from areal_service.types import TrainStepRecord, WeightVersionRecord
    from trainer.resume import resume_point

    store.add_weight_version(WeightVersionRecord(version=3, path="/d3", metadata={"step": 3}))
    store.add_weight_version(
        WeightVersionRecord(version=1, path="/s1", policy="solver", metadata={"step": 1})
    )
    for step in (1, 2, 3):
        store.add_train_step(TrainStepRecord(step=step, version=step))
    store.add_train_step(TrainStepRecord(step=1, version=1, policy="solver"))
    assert resume_point(store, None) == (3, 3)
    assert resume_point(store, None, "solver") == (1, 1)
    assert resume_point(store, None, "verifier") == (0, 0)
    assert [s.step for s in store.list_train_steps(policy="solver")] == [1]
    assert store.latest_train_step().step == 3
    merged = store.update_weight_version_metadata(1, {"live_at": 5.0}, "solver")
    assert merged is not None and merged.policy == "solver"
    assert store.get_weight_version(1) is None  # the default policy has no v1
    assert store.live_weight_version(policy="solver").path == "/s1"
    assert store.live_weight_version() is None


def test_cli_trainer_policy_must_be_declared(tmp_path) -> None:
    from typer.testing import CliRunner

    from launcher.cli import app

    ran = CliRunner().invoke(
        app,
        [
            "trainer",
            "--policy",
            "nobody",
            "--set",
            f"data_dir={tmp_path}",
            "--set",
            "trainer.lora.rank=4",
            "--set",
            "policies=[{name: solver}]",
        ],
    )
    assert ran.exit_code != 0 and "not a declared policy" in ran.output


def test_policies_run_on_vllm_and_sglang_but_not_through_sglangs_router() -> None:
    for backend in ("vllm", "sglang"):
        config = ServiceConfig.model_validate(
            {"trainer": {"lora": LORA}, "engine": {"backend": backend}, "policies": [{"name": "a"}]}
        )
        assert ServingPlan(config).names() == ["default", "a"]
    with pytest.raises(ValidationError, match="router"):
        ServiceConfig.model_validate(
            {
                "trainer": {"lora": LORA},
                "engine": {"backend": "sglang"},
                "gateway": {"router": {"url": "http://127.0.0.1:9"}},
            }
        )


def test_per_policy_figures_read_in_grouped_queries(store) -> None:
    """What the console's Policies pages and `areal_policy_*` read: sessions by policy and
    status, each policy's newest train step, a group's policies."""
    from areal_service.types import SessionRecord, TrainStepRecord

    assert store.count_sessions_by_policy() == {} and store.latest_train_steps() == {}
    for i in range(2):
        _episode(store, f"sol-{i}", "solver", group_id="g-shared")
    _episode(store, "def-0", DEFAULT_POLICY, group_id="g-shared")
    store.add_session(
        SessionRecord(id="def-1", group_id="g-def", created_at=1.0, last_activity_at=1.0)
    )
    assert store.count_sessions_by_policy() == {
        "solver": {"ended": 2},
        DEFAULT_POLICY: {"ended": 1, "open": 1},
    }
    assert store.group_policies("g-shared") == [DEFAULT_POLICY, "solver"]
    assert store.group_policies("g-def") == [DEFAULT_POLICY]
    assert store.group_policies("g-none") == []
    for step in (1, 2):
        store.add_train_step(TrainStepRecord(step=step, version=step, metrics={"loss": -step}))
    store.add_train_step(TrainStepRecord(step=5, version=5, metrics={"loss": 0.5}, policy="solver"))
    latest = store.latest_train_steps()
    assert {p: (s.step, s.metrics["loss"]) for p, s in latest.items()} == {
        DEFAULT_POLICY: (2, -2),
        "solver": (5, 0.5),
    }
