"""A tiny model that deterministically calls a tool: seconds of supervised fine-tuning of
the project's tiny Qwen2 so that, for given rendered prompts, greedy decoding emits
exactly a target (a `<tool_call>` block, or the final answer after the tool result).

Used by the gateway's integration tests to drive real tool-call round trips through the
real engine and gateway (nothing faked); also holds the calculator conversation and the
Agents SDK agent those tests share, so training data and tests cannot drift apart.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

IM_END = "<|im_end|>"
CALL_ARGUMENTS = '{"a": 2, "b": 3}'
CALL_TEXT = f'<tool_call>\n{{"name": "add", "arguments": {CALL_ARGUMENTS}}}\n</tool_call>'
TOOL_RESULT = "5"
TOOL_TURN_TEXT = (
    f"\n<|im_start|>user\n<tool_response>\n{TOOL_RESULT}\n</tool_response>"
    f"{IM_END}\n<|im_start|>assistant\n"
)
"""What the chat template renders after the assistant's `<|im_end|>` for one tool result
message, up to the next generation prompt."""
ANSWER_TEXT = "The answer is 5."
AGENT_INSTRUCTIONS = "You are a calculator agent. Always use the add tool."
AGENT_INPUT = "Please add 2 and 3."


@dataclass(frozen=True, slots=True)
class ToolExample:
    """One training pair: the prompt ids as the gateway renders them, and the exact ids
    greedy decoding must produce after them (ending with `<|im_end|>`)."""

    prompt_ids: tuple[int, ...]
    target_ids: tuple[int, ...]


def reply_ids(tokenizer: Any, text: str) -> tuple[int, ...]:
    """Ids of an assistant reply `text` followed by `<|im_end|>`."""
    return tuple(tokenizer.encode(text + IM_END, add_special_tokens=False))


def round_trip_examples(tokenizer: Any, first_prompt_ids: Sequence[int]) -> list[ToolExample]:
    """The two turns of a tool round trip that starts at `first_prompt_ids`: → the
    `add(2, 3)` call; then (that prompt + the call + the tool result `5`, the next prompt
    exactly when the gateway keeps its prefix property) → the final answer."""
    call = reply_ids(tokenizer, CALL_TEXT)
    second = (*first_prompt_ids, *call, *tokenizer.encode(TOOL_TURN_TEXT, add_special_tokens=False))
    return [
        ToolExample(tuple(first_prompt_ids), call),
        ToolExample(second, reply_ids(tokenizer, ANSWER_TEXT)),
    ]


def _pack(examples: Sequence[ToolExample]) -> list[tuple[list[int], list[tuple[int, int]]]]:
    """Rows of (ids, target spans): an example whose prompt extends another's
    prompt + target shares its row (a multi-turn chat trains in one sequence)."""
    rows: list[tuple[list[int], list[tuple[int, int]]]] = []
    for ex in sorted(examples, key=lambda e: len(e.prompt_ids)):
        for ids, spans in rows:
            if tuple(ex.prompt_ids[: len(ids)]) == tuple(ids):
                ids.extend(ex.prompt_ids[len(ids) :])
                spans.append((len(ids), len(ids) + len(ex.target_ids)))
                ids.extend(ex.target_ids)
                break
        else:
            n = len(ex.prompt_ids)
            rows.append(([*ex.prompt_ids, *ex.target_ids], [(n, n + len(ex.target_ids))]))
    return rows


def _margins(model: Any, batch: Any, labels: Any) -> Any:
    """Per target position: logit(target) − best other logit (> 0 means greedy picks it)."""
    import torch

    with torch.no_grad():
        logits = model(input_ids=batch).logits[:, :-1].float()
    tgt = labels[:, 1:]
    mask = tgt >= 0
    chosen = logits.gather(2, tgt.clamp(min=0)[..., None]).squeeze(-1)
    others = logits.scatter(2, tgt.clamp(min=0)[..., None], float("-inf")).amax(-1)
    return (chosen - others)[mask]


def _fit(
    model: Any, batch: Any, attention: Any, labels: Any, *, steps: int, lr: float, min_margin: float
) -> tuple[int, float]:
    """AdamW steps until every target's margin reaches `min_margin`: (steps, margin)."""
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    margin = float("-inf")
    for step in range(1, steps + 1):
        model.train()
        loss = model(input_ids=batch, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 5 == 0:
            model.eval()
            margin = float(_margins(model, batch, labels).min())
            if margin >= min_margin:
                return step, margin
    return steps, margin


def train_tool_model(
    base_dir: Path | str,
    out_dir: Path | str,
    examples: Sequence[ToolExample],
    *,
    steps: int = 400,
    lr: float = 3e-3,
    min_margin: float = 3.0,
    seed: int = 0,
) -> Path:
    """Fine-tune the model in `base_dir` (AdamW, cross-entropy on target tokens only, all
    examples in one right-padded batch, multi-turn examples packed into one row) until greedy decoding reproduces every target
    with a logit margin of at least `min_margin` (robust to batched-KV float noise), and
    save it with its tokenizer files to `out_dir`. Raises if `steps` do not get there."""
    import torch
    from transformers import AutoModelForCausalLM

    base, out = Path(base_dir), Path(out_dir)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    rows = _pack(examples)
    width = max(len(ids) for ids, _ in rows)
    batch = torch.full((len(rows), width), model.config.pad_token_id or 0, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (ids, spans) in enumerate(rows):
        batch[i, : len(ids)] = torch.tensor(ids)
        attention[i, : len(ids)] = 1
        for start, end in spans:
            labels[i, start:end] = batch[i, start:end]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 1M-parameter model: more threads only contend (2 cores)
    try:
        done, margin = _fit(
            model, batch, attention, labels, steps=steps, lr=lr, min_margin=min_margin
        )
    finally:
        torch.set_num_threads(threads)
    if margin < min_margin:
        raise RuntimeError(
            f"tool model did not converge in {steps} steps (min margin {margin:.2f} < {min_margin})"
        )
    log.info("tool model trained in %d steps (min margin %.2f)", done, margin)
    model.save_pretrained(out, safe_serialization=True)
    for f in base.iterdir():
        if f.is_file() and (
            f.name.startswith("tokenizer")
            or f.name
            in (
                "special_tokens_map.json",
                "chat_template.jinja",
                "vocab.json",
                "merges.txt",
                "added_tokens.json",
                "generation_config.json",
            )
        ):
            shutil.copy2(f, out / f.name)
    return out


def calculator_agent(model: Any, calls: list[tuple[str, int, int]]) -> Any:
    """The Agents SDK agent of the agent tests: `add` and `multiply` function tools that
    log each invocation into `calls`; `model` is any agents `Model` (or a name)."""
    from agents import Agent, function_tool

    def logged(name: str, op: Callable[[int, int], int]) -> Callable[[int, int], int]:
        def run(a: int, b: int) -> int:
            calls.append((name, a, b))
            return op(a, b)

        return run

    add_impl, mul_impl = logged("add", lambda a, b: a + b), logged("multiply", lambda a, b: a * b)

    @function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return add_impl(a, b)

    @function_tool
    def multiply(a: int, b: int) -> int:
        """Multiply two integers."""
        return mul_impl(a, b)

    return Agent(
        name="calculator", instructions=AGENT_INSTRUCTIONS, model=model, tools=[add, multiply]
    )


async def record_agent_requests(base_url: str, api_key: str, model_name: str) -> None:
    """Run the calculator agent once over Chat Completions and once over Responses
    against the gateway at `base_url`, one output token each, so the gateway records the
    first-turn prompts exactly as the Agents SDK sends them (the untrained model answers
    with text, so each run ends after one model call)."""
    from agents import (
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        RunConfig,
        Runner,
        set_tracing_disabled,
    )
    from agents.exceptions import ModelBehaviorError
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    settings = RunConfig(model_settings=ModelSettings(temperature=0, max_tokens=1))
    for model in (
        OpenAIChatCompletionsModel(model=model_name, openai_client=client),
        OpenAIResponsesModel(model=model_name, openai_client=client),
    ):
        try:
            await Runner.run(calculator_agent(model, []), AGENT_INPUT, run_config=settings)
        except ModelBehaviorError:
            pass  # Responses: one token is `incomplete` (max_output_tokens); recorded anyway
    await client.close()
