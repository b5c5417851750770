"""Issue "Episodes": a multi-turn, tool-using episode through the gateway with the real
`openai` client, a reward over REST, and the exported training row equal, token for
token, to what the engine produced (ids, loss mask, logprobs, versions)."""

from __future__ import annotations

import json

import httpx
import openai
import torch
from support.harness import ADMIN_KEY
from support.tool_model import ANSWER_TEXT, TOOL_RESULT
from transformers import AutoModelForCausalLM

from areal_service.export import export_sequences


def test_tool_episode_export_matches_engine(tool_gateway, agent_requests, tool_model_dir, tmp_path):
    body = agent_requests["chat"].request_json
    http = httpx.Client(base_url=tool_gateway.url, timeout=60)
    session = http.post(
        "/rl/sessions", json={"task_id": "calc"}, headers={"authorization": f"Bearer {ADMIN_KEY}"}
    ).json()
    client = openai.OpenAI(base_url=tool_gateway.v1, api_key=session["api_key"], max_retries=0)
    name = tool_gateway.config.gateway.model_name

    first = client.chat.completions.create(
        model=name, temperature=0, messages=body["messages"], tools=body["tools"]
    )
    (call,) = first.choices[0].message.tool_calls
    messages = [
        *body["messages"],
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": TOOL_RESULT},
    ]
    second = client.chat.completions.create(
        model=name, temperature=0, messages=messages, tools=body["tools"]
    )
    assert second.choices[0].message.content == ANSWER_TEXT

    auth = {"authorization": f"Bearer {session['api_key']}"}
    posted = http.post(
        "/v1/rewards",
        headers=auth,
        json={"session_id": session["session_id"], "value": 1.0, "end_session": True},
    )
    assert posted.status_code == 201, posted.text

    store = tool_gateway.state.store
    parent, child = store.get_completion(first.id), store.get_completion(second.id)
    assert child.parent_id == parent.id

    out = tmp_path / "export.jsonl"
    assert export_sequences(store, fmt="jsonl", out=out) == 1
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["session_id"] == session["session_id"] and row["reward"] == 1.0

    # One merged sequence: the child's prompt and output, no retokenization anywhere.
    assert row["input_ids"] == list(child.prompt_ids + child.output_ids)
    p0, o0 = len(parent.prompt_ids), len(parent.output_ids)
    p1, o1 = len(child.prompt_ids), len(child.output_ids)
    expected_mask = [0] * p0 + [1] * o0 + [0] * (p1 - p0 - o0) + [1] * o1
    assert row["loss_mask"] == expected_mask
    generated = [i for i, m in enumerate(expected_mask) if m]
    assert [row["logprobs"][i] for i in generated] == list(
        parent.output_logprobs + child.output_logprobs
    )
    assert [row["versions"][i] for i in generated] == [0] * (o0 + o1)
    assert all(
        row["logprobs"][i] == 0.0 and row["versions"][i] == -1
        for i, m in enumerate(expected_mask)
        if not m
    )

    # ... and those logprobs are the engine's: a separate forward pass agrees (greedy
    # sampling reports log_softmax of the raw logits, as SGLang does).
    model = AutoModelForCausalLM.from_pretrained(tool_model_dir)
    with torch.no_grad():
        logits = model(torch.tensor([row["input_ids"]])).logits[0].float()
    ref = torch.log_softmax(logits, dim=-1)
    for i in generated:
        assert abs(ref[i - 1, row["input_ids"][i]].item() - row["logprobs"][i]) < 1e-4
