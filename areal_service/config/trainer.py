"""`trainer:`: the RL trainer (optimizer, loss, advantages, batching, off-policy
control, weight sync, the policy it trains)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from areal_service.config.policies import POLICY_NAME_PATTERN
from areal_service.types import DEFAULT_POLICY

AdvantageKind = Literal["grpo", "drgrpo", "rloo", "batch"]
MismatchMask = Literal["none", "token", "sequence"]


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
    mismatch_mask: MismatchMask = "none"
    """Train-inference mismatch masking on w = pi_prox/pi_behave (formula in
    `trainer/loss.py`), alongside `behav_imp_weight_cap`: `token` (IcePop) masks tokens
    whose w leaves [mismatch_low, mismatch_high]; `sequence` (MIS) masks a whole sequence
    whose geometric-mean w leaves it; `none` only reports the mismatch (`mismatch_kl`,
    `mismatch_masked_ratio` per step). Worth turning on with bf16 serving."""
    mismatch_low: float = Field(0.5, gt=0, le=1)
    """Lower bound a of the mismatch interval [a, b]."""
    mismatch_high: float = Field(5.0, ge=1)
    """Upper bound b of the mismatch interval [a, b]."""
    kl_coef: float = Field(0.0, ge=0)
    """Weight of the k3 KL(pi_theta || pi_ref) penalty per trained token. Above 0 the
    trainer holds a frozen reference model (sharded like the policy, no optimizer
    state); 0 loads none."""
    ref_model: str | None = None
    """Directory of the HF checkpoint used as pi_ref when kl_coef > 0. None: the initial
    checkpoint (the engine's model, v0), also after a resume."""

    # ---- advantages ------------------------------------------------------------------------
    advantage: AdvantageKind = "grpo"
    """`grpo`: (r - mean_g)/(std_g + eps); `drgrpo`: r - mean_g; `rloo`: r_i minus the mean
    of the other sessions of its group; `batch`: normalised over the whole batch. Under
    the group kinds a group of one (an ungrouped session) gets `ungrouped_baseline`."""
    adv_eps: float = Field(1e-6, gt=0)
    """The eps in the std normalisation of `grpo` and `batch`."""

    # ---- truncated outputs (trainer/truncation.py) ------------------------------------
    no_eos: Literal["train", "mask", "penalty"] = "train"
    """A truncated output (no EOS: it hit its token limit): `train` it with its full
    reward (AReaL's behaviour; the demo's tiny model rarely stops by itself), `mask` its
    sequence out of the loss (DAPO's overlong filtering), or add `no_eos_penalty` to its
    session's return (`penalty`). The trainer's per-step line shows the policy and the
    truncated share (`no_eos`)."""
    no_eos_penalty: float = -1.0
    """Added to a truncated session's return under `no_eos = "penalty"`."""
    overlong_buffer: int | None = Field(None, ge=1)
    """DAPO's soft overlong punishment: the last this-many tokens before
    `overlong_max_tokens` cost linearly up to -1 of return (beyond: -1). None: off."""
    overlong_max_tokens: int | None = Field(None, ge=1)
    """L_max of the overlong punishment: the generation limit the agents use."""

    # ---- batching --------------------------------------------------------------------------
    group_size: int = Field(4, ge=1)
    """Sessions per GRPO group the trainer waits for (1: take every ended group as it
    is, for online sessions; groups of one get `ungrouped_baseline`). Ungrouped sessions
    are claimed under any group_size, each a group of one."""
    batch_groups: int = Field(4, ge=1)
    """Groups per training step."""
    max_tokens_per_mb: int = Field(8192, ge=2)
    """Token budget of one packed micro-batch (prompt + output tokens, no padding). A
    longer sequence gets a micro-batch of its own."""
    grad_sync_every_mb: bool = True
    """With several trainer processes: reduce-scatter gradients after every micro-batch
    (FSDP2's default: each rank holds only its gradient shard). False: only after a
    step's last micro-batch, one reduce-scatter per step instead of one per micro-batch,
    at the cost of each rank holding full, unsharded gradients in between (the model's
    size in float32): worth it for small models and many micro-batches."""
    ppo_minibatches: int = Field(1, ge=1)
    """Optimizer steps per training batch. Above 1, pi_prox is recomputed for the whole
    batch before the first update."""

    # ---- off-policy control ----------------------------------------------------------------
    max_staleness: int = Field(2, ge=0)
    """eta, the admission window: with `gateway.sessions.staleness_gate` on, the gateway
    admits sessions only inside it (AReaL's max_head_offpolicyness), so gated traffic is
    sampled at most eta versions behind the trainer."""
    max_train_staleness: int = Field(8, ge=0)
    """The training bound: an episode whose oldest token is more than this many versions
    behind the trainer when claimed is dropped (reason `stale: ...`); within it, it trains
    with the decoupled-PPO correction (pi_prox recomputed, behaviour weights capped at
    `behav_imp_weight_cap`). Wider than `max_staleness` so a slow, human-paced agent's
    episodes are not all lost while other traffic trains; 8 is where the share of tokens
    the cap masks stays small in the measurement of `docs/episodes-and-rewards.md`
    (`benchmarks/staleness_drift.py`). Below `max_staleness`, `max_staleness` applies."""
    turn_discount: float = Field(1.0, ge=0, le=1)
    """gamma: a session's return reaches earlier turns as R_i = r_i + gamma * R_{i+1}."""
    reward_wait_s: float = Field(60.0, ge=0)
    """Reward settling window: a group is claimed once every session has ended and is
    rewarded (or declared that no reward will come), or once this many seconds passed
    since its last session ended; then `unrewarded_policy` decides about the sessions
    still without a reward. Judges that score after the episode need it above their
    latency."""
    unrewarded_policy: Literal["drop_group", "default_reward"] = "drop_group"
    """What a settled group with an unrewarded session becomes: `drop_group` drops the
    whole group (drop reason `unrewarded: ...`); `default_reward` trains the session
    with `reward_default_for_unrewarded`."""
    reward_default_for_unrewarded: float | None = 0.0
    """Return of an unrewarded session under `unrewarded_policy = "default_reward"`
    (ignored by `drop_group`)."""
    partial_group_wait_s: float | None = Field(120.0, ge=0)
    """A group with fewer ended sessions than `group_size` (none open) settles this many
    seconds after its last session ended and trains with its real size (>= 2 members;
    a lone member is dropped, reason `group incomplete`). None: partial groups wait for
    `group_size` forever (and hold their staleness places)."""
    ungrouped_baseline: Literal["batch", "task_mean"] = "batch"
    """Advantage of an ungrouped session (a group of one) when `advantage` is a group
    kind: `batch` normalises the ungrouped returns of a step together, (r - mean)/(std +
    eps); `task_mean` subtracts a running mean of earlier returns of the same `task_id`
    (`baseline_decay`; kept by the trainer process, started from the step's own mean)."""
    baseline_decay: float = Field(0.9, ge=0, lt=1)
    """`task_mean`: b <- decay * b + (1 - decay) * mean of the step's returns of the task."""

    # ---- run -------------------------------------------------------------------------------
    enabled: bool = True
    """`areal-service serve` starts the trainer beside the gateway when it starts the local
    engine (the embedded default). False (or `serve --no-train`): serve only; train with
    `areal-service trainer` or `launch`. Other commands (`demo`, `train`, `launch`) start
    their trainers themselves."""
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

    # ---- weight sync -------------------------------------------------------------------
    weight_sync: Literal["disk", "distributed"] = "disk"
    """How a published version reaches the backends. `disk`: the gateway loads
    `weights/v{N}` (`/update_weights_from_disk`). `distributed`: rank 0 broadcasts the
    weights over a process group the gateway has the backends join (gloo on CPU, nccl on
    GPUs; `/update_weights_from_distributed`); the disk copy is still written, after,
    for resume and fallback (`trainer/weight_broadcast.py`)."""
    weight_sync_bucket_mb: float = Field(1024.0, gt=0)
    """Most tensor bytes per `/update_weights_from_distributed` call (AReaL: 1024 MB)."""
    weight_sync_address: str | None = None
    """Address the backends reach the trainer's rank 0 at for the broadcast. None:
    torchrun's MASTER_ADDR, else this host's name resolved."""
    weight_sync_timeout_s: float = Field(120.0, gt=0)
    """How long an offer stands (the gateway must take it) and the longest a rendezvous
    or broadcast waits; after it the gateway swaps from disk."""

    policy: str = Field(DEFAULT_POLICY, pattern=POLICY_NAME_PATTERN)
    """The policy this trainer process trains (`policies:`): it claims only that policy's
    episodes and publishes under `weights/<policy>/` with its own checkpoints. One
    trainer process per policy."""

    def train_staleness_bound(self) -> int:
        """The staleness above which a claimed episode is dropped: `max_train_staleness`,
        never below the admission window `max_staleness`."""
        return max(self.max_staleness, self.max_train_staleness)

    def unrewarded_return(self) -> float | None:
        """The return an unrewarded session is trained with; None when the policy drops
        it (what export and the console show for such sessions)."""
        if self.unrewarded_policy == "default_reward":
            return self.reward_default_for_unrewarded
        return None

    @model_validator(mode="after")
    def _check(self) -> TrainerConfig:
        if (
            self.unrewarded_policy == "default_reward"
            and self.reward_default_for_unrewarded is None
        ):
            raise ValueError(
                "trainer.unrewarded_policy='default_reward' needs a number in "
                "trainer.reward_default_for_unrewarded (or use unrewarded_policy='drop_group')"
            )
        if (self.overlong_buffer is None) != (self.overlong_max_tokens is None):
            raise ValueError(
                "trainer.overlong_buffer and trainer.overlong_max_tokens go "
                "together (set both, or neither)"
            )
        if (
            self.overlong_buffer is not None
            and self.overlong_max_tokens is not None
            and self.overlong_buffer > self.overlong_max_tokens
        ):
            raise ValueError("trainer.overlong_buffer must be <= trainer.overlong_max_tokens")
        return self
