"""`TrainerConfig`: every knob of the trainer (optimizer, decoupled PPO, advantages,
batching, staleness, checkpoints). Torch-free so `areal_service.config` can nest it as
`ServiceConfig.trainer` without importing torch; it must not import `areal_service.config`
(that module imports this one). Defaults follow AReaL where AReaL has one.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

AdvantageKind = Literal["grpo", "drgrpo", "rloo", "batch"]


class TrainerConfig(BaseModel):
    """The `trainer:` section."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    # ---- optimizer -------------------------------------------------------------------------
    lr: float = Field(1e-6, gt=0)
    """AdamW learning rate (constant)."""
    weight_decay: float = Field(0.01, ge=0)
    """AdamW decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW (beta1, beta2)."""
    grad_clip: float = Field(1.0, gt=0)
    """Clip the global gradient L2 norm to this value before each optimizer step."""

    # ---- decoupled PPO loss ----------------------------------------------------------------
    eps_clip: float = Field(0.2, gt=0, lt=1)
    """PPO clip: ratio pi_theta/pi_prox is clipped to [1 - eps_clip, 1 + eps_clip]."""
    eps_clip_higher: float | None = Field(None, gt=0)
    """Upper clip (DAPO "clip-higher"): ratio clipped to 1 + eps_clip_higher. None: eps_clip."""
    behav_imp_weight_cap: float | None = Field(5.0, gt=1)
    """Tokens whose behaviour weight pi_prox/pi_behave exceeds this are masked out of the
    loss (AReaL's truncation). None: no cap."""
    kl_coef: float = Field(0.0, ge=0)
    """Weight of the k3 KL(pi_theta || pi_ref) penalty. 0 loads no reference model."""

    # ---- advantages ------------------------------------------------------------------------
    advantage: AdvantageKind = "grpo"
    """`grpo`: (r - mean_g)/(std_g + eps); `drgrpo`: r - mean_g; `rloo`: r_i minus the mean
    of the other sessions of its group; `batch`: normalised over the whole batch (for
    ungrouped online sessions)."""
    adv_eps: float = Field(1e-6, gt=0)
    """The eps in the std normalisation of `grpo` and `batch`."""

    # ---- batching --------------------------------------------------------------------------
    group_size: int = Field(4, ge=1)
    """Sessions per GRPO group the trainer waits for (1 for ungrouped online sessions)."""
    batch_groups: int = Field(4, ge=1)
    """Groups per training step."""
    max_tokens_per_mb: int = Field(8192, ge=2)
    """Token budget of one packed micro-batch (prompt + output tokens, no padding). A
    longer sequence gets a micro-batch of its own."""
    ppo_minibatches: int = Field(1, ge=1)
    """Optimizer steps per training batch. Above 1, pi_prox is recomputed for the whole
    batch before the first update."""

    # ---- off-policy control ----------------------------------------------------------------
    max_staleness: int = Field(2, ge=0)
    """eta: episodes whose oldest token is more than eta versions old are dropped; the
    gateway admits sessions only inside the window (AReaL's max_head_offpolicyness)."""
    turn_discount: float = Field(1.0, ge=0, le=1)
    """gamma: a session's return reaches earlier turns as R_i = r_i + gamma * R_{i+1}."""
    reward_default_for_unrewarded: float | None = 0.0
    """Return of a session that ended without a reward. None: drop such sessions."""

    # ---- run -------------------------------------------------------------------------------
    checkpoint_every: int = Field(10, ge=1)
    """Write a resumable checkpoint every this many steps."""
    total_steps: int | None = None
    """Stop after this many optimizer steps. None: train until stopped (online mode)."""
    seed: int = 1
    """Seed of torch / python RNGs in the trainer."""
    torch_threads: int | None = Field(None, ge=1)
    """Intra-op CPU threads of each trainer process (torch.set_num_threads). None: torch's
    default; set it when the trainer shares the CPU with the engine."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Compute dtype. `auto`: bfloat16 on CUDA (fp32 master weights, FSDP2 mixed
    precision), float32 on CPU."""

    @model_validator(mode="after")
    def _check(self) -> TrainerConfig:
        if self.advantage in ("grpo", "drgrpo", "rloo") and self.group_size < 2:
            raise ValueError(
                f"trainer.advantage={self.advantage!r} needs trainer.group_size >= 2 "
                "(a group of one has zero advantage); use advantage='batch' for ungrouped sessions"
            )
        return self

    @property
    def clip_high(self) -> float:
        """The upper clip epsilon actually used."""
        return self.eps_clip if self.eps_clip_higher is None else self.eps_clip_higher
