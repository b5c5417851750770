"""The config file of `areal-service train` (the dataset driver) and `areal-service eval`.

One YAML file: the driver's own sections (`dataset`, `agent`, `reward`, `model`,
`rollout`, `eval`) next to the service sections every command reads (`data_dir`,
`engine`, `gateway`, `trainer`, ...). `--set` overrides reach either kind by their first
key (`--set rollout.epochs=2`, `--set trainer.lr=1e-5`).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from areal_service.config import (
    ServiceConfig,
    apply_overrides,
    config_from_tree,
    read_config_file,
)
from areal_service.config_errors import config_error
from areal_service.datasets import DatasetConfig


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class RolloutConfig(_Section):
    """How the driver walks the dataset while training."""

    group_size: int = Field(4, ge=1)
    """Episodes per sample (one session each, one GRPO group); sets trainer.group_size."""
    batch_size: int = Field(4, ge=1)
    """Samples (groups) per training step; sets trainer.batch_groups."""
    epochs: int = Field(1, ge=1)
    """Passes over the dataset."""
    concurrency: int = Field(16, ge=1)
    """Most agent episodes running at once (rounded up to whole groups)."""
    shuffle: bool = True
    """Visit samples in a seeded random order, a new order each epoch."""
    seed: int = 0
    """Seed of the visiting order."""
    max_tokens: int | None = Field(None, ge=1)
    """`max_tokens` the built-in single-turn agent sends (and passed to agents that take
    a `max_tokens` argument). None: the gateway's `default_max_tokens`."""
    progress_interval_s: float = Field(5.0, gt=0)
    """Seconds between progress lines."""
    drain_timeout_s: float = Field(120.0, gt=0)
    """After the last episode, how long the trainer may go without a new step before it
    is stopped (a remainder smaller than a batch never fills one)."""


class EvalConfig(_Section):
    """`areal-service eval`: greedy and sampled runs, pass@k."""

    datasets: list[DatasetConfig] = Field(default_factory=list)
    """Datasets to evaluate, one table row each. Empty: the `dataset` section."""
    n_samples: int = Field(4, ge=1)
    """Sampled runs per question (n of pass@k)."""
    k: list[int] = Field(default_factory=lambda: [1])
    """pass@k values to report (each at most n_samples)."""
    temperature: float = Field(0.6, ge=0)
    """Temperature of the sampled runs (the greedy run uses 0)."""
    max_tokens: int | None = Field(None, ge=1)
    """Output budget per model call. None: the gateway's `default_max_tokens`."""
    greedy: bool = True
    """Also run every question once greedily (greedy_acc, greedy_length)."""
    concurrency: int = Field(16, ge=1)
    """Most episodes running at once."""
    limit: int | None = Field(None, ge=1)
    """Use only the first `limit` rows of every eval dataset (`--set eval.limit=5` for a
    quick check); a dataset's own smaller `limit` still applies. None: all rows."""
    correct_at: float = 1.0
    """An episode counts as correct when its reward is at least this."""
    out_dir: Path | None = None
    """Where results.json / results.csv go. None: `<data_dir>/eval`."""
    progress_interval_s: float = Field(15.0, gt=0)
    """Seconds between progress lines."""

    @model_validator(mode="after")
    def _check(self) -> EvalConfig:
        too_big = [k for k in self.k if not 1 <= k <= self.n_samples]
        if too_big:
            raise ValueError(
                f"eval.k values {too_big} must be between 1 and n_samples ({self.n_samples})"
            )
        return self


class DriverConfig(_Section):
    """The driver's sections of the config file."""

    dataset: DatasetConfig | None = None
    """The training dataset (and the eval dataset unless `eval.datasets` is set)."""
    agent: str | None = None
    """`module:function`: `async def agent(sample, base_url, api_key) -> reward` (a
    float, or `{completion_id: reward}`); it may also take `temperature` and
    `max_tokens` keyword arguments. None: the built-in single-turn agent (one chat
    completion of the sample's `messages`, scored by `reward`)."""
    reward: str = "math"
    """Reward of the built-in agent: `math`, `exact_match`, `numeric` or `module:function`
    (`fn(completion_text, sample) -> float`, sync or async)."""
    model: str | None = None
    """Model name the built-in agent sends. None: `gateway.model_name`."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """Training-time rollout settings."""
    eval: EvalConfig = Field(default_factory=EvalConfig)
    """Evaluation settings."""

    def eval_datasets(self) -> list[DatasetConfig]:
        """What `eval` runs on (each cut to `eval.limit` rows when that is set)."""
        if self.eval.datasets:
            datasets = self.eval.datasets
        elif self.dataset is None:
            raise ValueError("the config names no dataset (set `dataset` or `eval.datasets`)")
        else:
            datasets = [self.dataset]
        cap = self.eval.limit
        if cap is None:
            return datasets
        return [d.model_copy(update={"limit": min(cap, d.limit or cap)}) for d in datasets]


DRIVER_KEYS = frozenset(DriverConfig.model_fields)


def load_driver_config(
    path: Path | None, overrides: list[str] | None = None
) -> tuple[DriverConfig, ServiceConfig]:
    """Split the file and the overrides into the driver's sections and the service
    config; the service part resolves as for every other command (env, `--set`)."""
    tree = read_config_file(path)
    mine = {k: v for k, v in tree.items() if k in DRIVER_KEYS}
    service = {k: v for k, v in tree.items() if k not in DRIVER_KEYS}
    driver_overrides, service_overrides = [], []
    for item in overrides or []:
        first = item.split("=", 1)[0].split(".", 1)[0].strip()
        (driver_overrides if first in DRIVER_KEYS else service_overrides).append(item)
    mine = apply_overrides(mine, driver_overrides)
    try:
        driver = DriverConfig.model_validate(mine)
    except ValidationError as exc:
        error = config_error(exc, DriverConfig, path)
        if any(tuple(e["loc"]) == ("dataset", "path") for e in exc.errors()):
            # `--set dataset.limit=5` on an eval file, which lists `eval.datasets` instead.
            error = type(error)(f"{error} (to use fewer rows in `eval`, set eval.limit=N)")
        raise error from None
    # The service sections resolve as any command's file does (file < env < --set).
    config = config_from_tree(
        service, service_overrides, source=path, top_level=tuple(DriverConfig.model_fields)
    )
    return driver, config


def has_driver_sections(path: Path | None, overrides: list[str] | None = None) -> bool:
    """Whether the file or the overrides use any of the driver's sections (a `train` /
    `eval` config rather than a service one)."""
    firsts = {item.split("=", 1)[0].split(".", 1)[0].strip() for item in overrides or []}
    return bool((set(read_config_file(path)) | firsts) & DRIVER_KEYS)
