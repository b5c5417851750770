"""The gateway's OpenAI surface with the real `openai` client, over loopback, in front of
the real local engine (tiny model): chat (plain, streamed with and without usage, n,
length limits, stop, seed, logprobs, unknown fields), Responses, models, bare paths, and
tool-call round trips (plain and streamed) through the fine-tuned tool model."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import openai
import pytest
from support.harness import ADMIN_KEY
from support.tool_model import ANSWER_TEXT, CALL_ARGUMENTS, TOOL_RESULT

from areal_service.types import CompletionRecord

if TYPE_CHECKING:
    from support.harness import Gateway

USER = [{"role": "user", "content": "Hello there"}]


@pytest.fixture()
def gw(
    tmp_path: Path, tiny_model_dir: Path, engine_url: str, gateway_factory: Callable[..., Any]
) -> Iterator[Gateway]:
    """A fresh gateway honouring the client's sampling fields."""
    with gateway_factory(
        tmp_path, tiny_model_dir, [engine_url], "gateway.sampling.mode=client"
    ) as g:
        yield g


def _key(gw: Gateway) -> str:
    return gw.config.gateway.auth.admin_key.get_secret_value()


def _client(gw: Gateway, base_url: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url or gw.v1, api_key=_key(gw), max_retries=0)


def _chat(gw: Gateway, **kwargs: Any) -> Any:
    body = {"model": gw.config.gateway.model_name, "messages": USER, **kwargs}
    return _client(gw).chat.completions.create(**body)


def _record(gw: Gateway, completion_id: str) -> CompletionRecord:
    record = gw.state.store.get_completion(completion_id)
    assert record is not None, f"{completion_id} was not recorded before the reply"
    return record


# ------------------------------------------------------------------ chat


def test_chat_request_id_is_response_id_and_record(gw: Gateway) -> None:
    raw = _client(gw).chat.completions.with_raw_response.create(
        model=gw.config.gateway.model_name, messages=USER, max_tokens=6
    )
    completion = raw.parse()
    assert raw.headers["x-request-id"] == completion.id
    assert completion.id.startswith("chatcmpl-")
    assert completion.object == "chat.completion"
    assert completion.model == gw.config.gateway.model_name
    (choice,) = completion.choices
    assert choice.index == 0 and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length") and choice.logprobs is None
    record = _record(gw, completion.id)
    assert completion.usage.prompt_tokens == len(record.prompt_ids)
    assert completion.usage.completion_tokens == len(record.output_ids) <= 6
    assert completion.usage.total_tokens == len(record.prompt_ids) + len(record.output_ids)


def test_stream_sends_usage_only_when_asked(gw: Gateway) -> None:
    plain = list(_chat(gw, max_tokens=6, stream=True))
    assert all(c.usage is None and c.choices for c in plain)
    assert plain[0].choices[0].delta.role == "assistant"
    assert plain[-1].choices[0].finish_reason in ("stop", "length")
    assert all(c.choices[0].finish_reason is None for c in plain[:-1])
    assert len({c.id for c in plain}) == 1

    chunks = list(_chat(gw, max_tokens=6, stream=True, stream_options={"include_usage": True}))
    *body, last = chunks
    assert last.choices == [] and last.usage is not None
    assert all(c.usage is None and c.choices for c in body)
    record = _record(gw, last.id)
    assert last.usage.prompt_tokens == len(record.prompt_ids)
    assert last.usage.completion_tokens == len(record.output_ids)
    text = "".join(c.choices[0].delta.content or "" for c in body)
    assert text == gw.state.tokenizer.decode(record.output_ids)


def test_n_choices_each_recorded(gw: Gateway) -> None:
    completion = _chat(gw, n=2, max_tokens=5, seed=7)
    assert [c.index for c in completion.choices] == [0, 1]
    first, second = _record(gw, completion.id), _record(gw, f"{completion.id}.1")
    assert first.prompt_ids == second.prompt_ids
    assert completion.usage.completion_tokens == len(first.output_ids) + len(second.output_ids)
    for choice, record in zip(completion.choices, (first, second), strict=True):
        assert choice.message.content == gw.state.tokenizer.decode(record.output_ids)


def test_max_tokens_and_max_completion_tokens(gw: Gateway) -> None:
    """Greedy: a shorter budget yields a prefix of the longer reply, finish `length`;
    `max_completion_tokens` wins over the deprecated `max_tokens`."""
    full = _record(gw, _chat(gw, temperature=0, max_tokens=20).id)
    assert len(full.output_ids) == 20, "the tiny model should not stop within 20 tokens"
    for kwargs in (
        {"max_tokens": 4},
        {"max_completion_tokens": 4},
        {"max_tokens": 50, "max_completion_tokens": 4},
    ):
        completion = _chat(gw, temperature=0, **kwargs)
        assert completion.choices[0].finish_reason == "length"
        assert completion.usage.completion_tokens == 4
        assert _record(gw, completion.id).output_ids == full.output_ids[:4]


def test_stop_string_cuts_reply(gw: Gateway) -> None:
    full = _chat(gw, temperature=0, max_tokens=30).choices[0].message.content
    stop = full.strip()[:2]
    assert stop and full.index(stop) > 0
    for stops in (stop, [stop, "never-seen"]):
        completion = _chat(gw, temperature=0, max_tokens=30, stop=stops)
        assert completion.choices[0].message.content == full[: full.index(stop)]
        assert completion.choices[0].finish_reason == "stop"
    streamed = _chat(gw, temperature=0, max_tokens=30, stop=[stop], stream=True)
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full[: full.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seed_reproduces_sampling(gw: Gateway) -> None:
    def sample(seed: int) -> list[str]:
        completion = _chat(gw, temperature=1.0, max_tokens=12, seed=seed, n=2)
        return [c.message.content for c in completion.choices]

    first = sample(1234)
    assert sample(1234) == first
    assert first[0] != first[1], "choices of one seeded request must differ"
    assert sample(98765) != first


def test_logprobs_only_when_asked(gw: Gateway) -> None:
    assert _chat(gw, max_tokens=4).choices[0].logprobs is None
    assert _chat(gw, max_tokens=4, logprobs=False).choices[0].logprobs is None
    completion = _chat(gw, temperature=0, max_tokens=8, logprobs=True)
    choice = completion.choices[0]
    record = _record(gw, completion.id)
    entries = choice.logprobs.content
    assert len(entries) == len(record.output_ids) == completion.usage.completion_tokens
    assert [e.logprob for e in entries] == pytest.approx(list(record.output_logprobs))
    assert all(e.top_logprobs == [] for e in entries)
    assert b"".join(bytes(e.bytes) for e in entries).decode() == choice.message.content
    assert "".join(e.token for e in entries) == choice.message.content

    streamed = list(_chat(gw, temperature=0, max_tokens=8, logprobs=True, stream=True))
    stream_entries = [
        e for c in streamed if c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    assert [(e.token, e.logprob) for e in stream_entries] == [(e.token, e.logprob) for e in entries]


def test_top_logprobs_alternatives(gw: Gateway) -> None:
    completion = _chat(gw, max_tokens=4, logprobs=True, top_logprobs=3)
    for entry in completion.choices[0].logprobs.content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.logprob
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[2].logprob
    streamed = _chat(gw, max_tokens=4, logprobs=True, top_logprobs=2, stream=True)
    entries = [
        e
        for chunk in streamed
        if chunk.choices and chunk.choices[0].logprobs
        for e in chunk.choices[0].logprobs.content
    ]
    assert entries and all(len(e.top_logprobs) == 2 for e in entries)


def test_unknown_fields_and_headers_accepted(gw: Gateway) -> None:
    client = openai.OpenAI(
        base_url=gw.v1,
        api_key=_key(gw),
        max_retries=0,
        organization="org-x",
        project="proj-y",
        default_headers={"OpenAI-Beta": "assistants=v2", "X-Stainless-Custom": "1"},
    )
    raw = client.chat.completions.with_raw_response.create(
        model=gw.config.gateway.model_name,
        max_completion_tokens=3,
        messages=[
            {"role": "developer", "content": "Be brief."},
            {
                "role": "user",
                "name": "ann",
                "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}],
            },
            {"role": "assistant", "content": "Hello.", "refusal": None},
            {"role": "user", "content": "Again?"},
        ],
        store=True,
        metadata={"team": "rl"},
        user="user-1",
        service_tier="auto",
        reasoning_effort="low",
        response_format={"type": "json_object"},
        parallel_tool_calls=False,
        logit_bias={"5": 1},
        presence_penalty=0.1,
        frequency_penalty=0.1,
        top_p=0.9,
        safety_identifier="sid",
        prompt_cache_key="pck",
        verbosity="low",
        stream_options=None,
        extra_headers={"X-Stainless-Retry-Count": "0"},
        extra_body={"some_future_field": {"x": [1, 2]}, "top_k": 20},
    )
    assert raw.status_code == 200
    record = _record(gw, raw.parse().id)
    assert record.request_json["some_future_field"] == {"x": [1, 2]}
    assert record.top_p == pytest.approx(0.9) and record.top_k == 20


# ------------------------------------------------------------------ responses, models


def test_responses_plain_and_streamed(gw: Gateway) -> None:
    client = _client(gw)
    name = gw.config.gateway.model_name
    raw = client.responses.with_raw_response.create(
        model=name,
        instructions="Be brief.",
        input="Hello there",
        max_output_tokens=5,
        store=False,
        include=[],
        metadata={"k": "v"},
    )
    response = raw.parse()
    assert raw.headers["x-request-id"] == response.id and response.id.startswith("resp_")
    record = _record(gw, response.id)
    assert response.output_text == gw.state.tokenizer.decode(record.output_ids)
    assert response.usage.output_tokens == len(record.output_ids)
    assert response.status == ("incomplete" if len(record.output_ids) == 5 else "completed")

    with client.responses.stream(model=name, input="Hello there", max_output_tokens=5) as s:
        events = list(s)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text == gw.state.tokenizer.decode(_record(gw, final.id).output_ids)


def test_previous_response_id_continues_a_stored_response(gw: Gateway) -> None:
    """A turn naming `previous_response_id` sees the stored conversation (chains of
    any length) rendered exactly as if the client had resent it. Unknown ids and another
    key's responses are 404."""
    client = _client(gw)
    name = gw.config.gateway.model_name
    first = client.responses.create(
        model=name, instructions="Be brief.", input="Hello there", max_output_tokens=4
    )
    second = client.responses.create(
        model=name, input="And then?", max_output_tokens=4, previous_response_id=first.id
    )
    assert second.previous_response_id == first.id
    third = client.responses.create(
        model=name,
        input=[{"role": "user", "content": "More"}],
        max_output_tokens=4,
        previous_response_id=second.id,
    )
    r1, r2, r3 = (_record(gw, r.id) for r in (first, second, third))
    # Instructions are not carried over (as on OpenAI): the second prompt starts with the
    # first one's conversation without its system message.
    expected_messages = [
        {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And then?"},
    ]
    tok = gw.state.tokenizer
    assert list(r2.prompt_ids) == tok.encode(tok.render(expected_messages, None))
    expected_messages += [
        {"role": "assistant", "content": second.output_text},
        {"role": "user", "content": "More"},
    ]
    assert list(r3.prompt_ids) == tok.encode(tok.render(expected_messages, None))

    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model=name, input="x", previous_response_id="resp_nope")
    assert missing.value.code == "previous_response_not_found"
    created = httpx.post(
        gw.url + "/admin/keys",
        json={"name": "other"},
        timeout=30,
        headers={"Authorization": f"Bearer {_key(gw)}"},
    )
    other = created.json()["api_key"]
    stranger = openai.OpenAI(base_url=gw.v1, api_key=other, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        stranger.responses.create(model=name, input="x", previous_response_id=first.id)


def _metric(text: str, name: str) -> float:
    """The value of one sample line `name ...` of a Prometheus text exposition."""
    values = [
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " ")
    ]
    assert len(values) == 1, f"{name} not exposed exactly once"
    return values[0]


def test_prometheus_metrics_count_what_was_served(gw: Gateway) -> None:
    _chat(gw, max_tokens=3)
    list(_chat(gw, max_tokens=3, stream=True))
    with pytest.raises(openai.BadRequestError):
        _chat(gw, n=0)
    text = httpx.get(
        gw.url + "/metrics", timeout=10, headers={"authorization": f"Bearer {_key(gw)}"}
    ).text
    assert _metric(text, 'areal_requests_total{route="chat",status="200"}') == 2
    assert _metric(text, 'areal_requests_total{route="chat",status="400"}') == 1
    assert _metric(text, 'areal_request_latency_seconds_count{route="chat"}') == 3
    assert _metric(text, "areal_time_to_first_token_seconds_count") == 1
    assert _metric(text, "areal_in_flight_requests") == 0
    assert _metric(text, "areal_completion_tokens_total") >= 2
    assert _metric(text, "areal_capture_wait_seconds_count") == 2


def test_models_and_bare_paths(gw: Gateway) -> None:
    name = gw.config.gateway.model_name
    for base in (gw.v1, gw.url):
        client = _client(gw, base)
        models = client.models.list()
        assert [m.id for m in models.data] == [name]
        assert models.data[0].object == "model" and models.data[0].owned_by
        assert client.models.retrieve(name).id == name
        assert client.models.retrieve("any-name").id == "any-name"  # all served (strict: off)
        completion = client.chat.completions.create(model=name, messages=USER, max_tokens=2)
        assert completion.choices[0].message.role == "assistant"
        response = client.responses.create(model=name, input="hi", max_output_tokens=2)
        assert response.object == "response"


# ------------------------------------------------------------------ tool calls


@pytest.fixture()
def calc_request(agent_requests: dict[str, CompletionRecord]) -> dict[str, Any]:
    """The calculator conversation (system prompt, user turn, strict tools) as the Agents
    SDK sent it: the tool model was trained on exactly this prompt."""
    body = agent_requests["chat"].request_json
    return {"messages": body["messages"], "tools": body["tools"]}


def _tool_turn(call_id: str) -> list[dict[str, Any]]:
    return [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": "add", "arguments": CALL_ARGUMENTS},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": TOOL_RESULT},
    ]


def test_tool_call_round_trip(tool_gateway: Gateway, calc_request: dict[str, Any]) -> None:
    client = _client(tool_gateway)
    name = tool_gateway.config.gateway.model_name
    first = client.chat.completions.create(model=name, temperature=0, **calc_request)
    (choice,) = first.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "add"
    assert json.loads(call.function.arguments) == {"a": 2, "b": 3}

    messages = [
        *calc_request["messages"],
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": TOOL_RESULT},
    ]
    second = client.chat.completions.create(
        model=name, temperature=0, messages=messages, tools=calc_request["tools"]
    )
    assert second.choices[0].message.content == ANSWER_TEXT
    assert second.choices[0].finish_reason == "stop"
    assert not second.choices[0].message.tool_calls

    parent, child = _record(tool_gateway, first.id), _record(tool_gateway, second.id)
    assert parent.finish_reason == "tool_calls"
    assert (
        child.prompt_ids[: len(parent.prompt_ids) + len(parent.output_ids)]
        == parent.prompt_ids + parent.output_ids
    )


def test_tool_call_streamed(tool_gateway: Gateway, calc_request: dict[str, Any]) -> None:
    client = _client(tool_gateway)
    name = tool_gateway.config.gateway.model_name
    chunks = list(
        client.chat.completions.create(model=name, temperature=0, stream=True, **calc_request)
    )
    fragments = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or ()]
    head, *rest = fragments
    assert head.index == 0 and head.id.startswith("call_") and head.type == "function"
    assert head.function.name == "add"
    assert rest and all(
        f.index == 0 and f.id is None and f.type is None and f.function.name is None for f in rest
    )
    arguments = (head.function.arguments or "") + "".join(f.function.arguments for f in rest)
    assert json.loads(arguments) == {"a": 2, "b": 3}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)

    messages = [*calc_request["messages"], *_tool_turn(head.id)]
    answer = list(
        client.chat.completions.create(
            model=name, temperature=0, stream=True, messages=messages, tools=calc_request["tools"]
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in answer) == ANSWER_TEXT
    assert answer[-1].choices[0].finish_reason == "stop"


def test_training_sampling_binds_session_turns_only(gateway: Gateway) -> None:
    """`gateway.sampling.mode: training` (the default): a turn in a session samples at the
    training temperature whatever the client asks (its logprobs are trained on); a turn
    outside any session (the admin key: an evaluation, say) samples as asked."""
    model = gateway.config.gateway.model_name
    admin = openai.OpenAI(base_url=gateway.v1, api_key=ADMIN_KEY, max_retries=0)
    started = httpx.post(
        f"{gateway.url}/rl/sessions",
        json={},
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        timeout=30,
    )
    session = openai.OpenAI(base_url=gateway.v1, api_key=started.json()["api_key"], max_retries=0)
    for client, expected in ((admin, 0.0), (session, 1.0)):
        completion = client.chat.completions.create(
            model=model, messages=USER, temperature=0, max_tokens=4
        )
        record = _record(gateway, completion.id)
        assert record.temperature == expected
        assert (record.session_id is None) == (client is admin)
