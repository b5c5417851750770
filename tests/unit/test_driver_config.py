"""The driver's config file: its own sections next to the service's, `--set` reaching
both; the visiting order; the persisted position."""

from __future__ import annotations

import pytest

from launcher.dataset_driver import DriverState, epoch_order, training_config
from launcher.driver_config import load_driver_config

CONFIG = """
data_dir: {data}
dataset: {{path: examples/math/data/train.jsonl, limit: 10}}
agent: examples.math.agent:solve
rollout: {{group_size: 2, batch_size: 3, epochs: 2}}
eval: {{n_samples: 4, k: [1, 4]}}
trainer: {{lr: 1.0e-5}}
gateway: {{port: 18001}}
"""


def test_sections_split_and_overrides_reach_both(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text(CONFIG.format(data=tmp_path / "d"))
    driver, config = load_driver_config(path, ["rollout.epochs=3", "trainer.lr=2e-5", "eval.k=[2]"])
    assert driver.agent == "examples.math.agent:solve"
    assert driver.rollout.epochs == 3 and driver.rollout.group_size == 2
    assert driver.eval.k == [2] and driver.eval_datasets() == [driver.dataset]
    assert config.trainer.lr == 2e-5 and config.gateway.port == 18001
    trained = training_config(driver, config, num_samples=10)
    assert trained.trainer.group_size == 2 and trained.trainer.batch_groups == 3
    assert trained.trainer.total_steps == 3 * 10 // 3
    assert trained.gateway.sessions.staleness_gate


def test_config_errors(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("rollout: {group_size: 0}\n")
    with pytest.raises(ValueError, match="group_size"):
        load_driver_config(path)
    path.write_text("eval: {n_samples: 2, k: [4]}\n")
    with pytest.raises(ValueError, match="between 1 and n_samples"):
        load_driver_config(path)
    path.write_text("rolout: {}\n")  # a typo is a service key, which forbids extras
    with pytest.raises(ValueError):
        load_driver_config(path)


def test_epoch_order_is_deterministic_and_differs_per_epoch():
    first = epoch_order(50, 0, shuffle=True, seed=3)
    assert first == epoch_order(50, 0, shuffle=True, seed=3)
    assert sorted(first) == list(range(50)) and first != list(range(50))
    assert epoch_order(50, 1, shuffle=True, seed=3) != first
    assert epoch_order(5, 0, shuffle=False, seed=3) == [0, 1, 2, 3, 4]


def test_state_round_trip_and_fingerprint(tmp_path):
    path = tmp_path / "driver" / "state.json"
    state = DriverState(
        fingerprint={"samples": 10},
        epoch=1,
        done=[3, 1],
        in_flight={"4": ["sess_a", "sess_b"]},
        episodes=12,
    )
    state.save(path)
    assert DriverState.load(path, {"samples": 10}) == state
    assert DriverState.load(path, {"samples": 11}).done == []  # another run: start over
