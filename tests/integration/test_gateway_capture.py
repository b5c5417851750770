"""What the gateway records is exactly what was served: for chat (plain, streamed, n=2),
Responses (plain, streamed) and a stream interrupted by a pause, the stored prompt ids
equal the chat template's rendering of the request, the stored output ids decode to the
returned text, and the stored behaviour logprobs equal a separate transformers forward
over prompt + output at the recorded temperature. Each record is read back from the
database file through a second store right after the reply (or `[DONE]`) arrives."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from areal_service.store import TrajectoryStore, create_store_engine
from areal_service.types import CompletionRecord

if TYPE_CHECKING:
    from support.harness import Gateway

Factory = Callable[..., AbstractContextManager["Gateway"]]
SYSTEM = {"role": "system", "content": "You are terse."}
USER = {"role": "user", "content": "How many apples are left?"}


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> Any:
    """The served checkpoint loaded by plain transformers, apart from the engine."""
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture()
def client_gw(
    tmp_path: Path, tiny_model_dir: Path, engine_url: str, gateway_factory: Factory
) -> Iterator[Gateway]:
    with gateway_factory(
        tmp_path, tiny_model_dir, [engine_url], "gateway.sampling.mode=client"
    ) as gw:
        yield gw


class Checker:
    """Reads records through its own store and checks them against the request."""

    def __init__(self, gw: Gateway, reference: Any, tokenizer: Any) -> None:
        self.gw = gw
        self.store = TrajectoryStore(create_store_engine(gw.config.database_url()))
        self.reference = reference
        self.tokenizer = tokenizer

    def record(self, completion_id: str) -> CompletionRecord:
        record = self.store.get_completion(completion_id)
        assert record is not None, f"{completion_id} not durable when the reply arrived"
        return record

    def check(
        self,
        completion_id: str,
        messages: list[dict[str, Any]],
        text: str,
        temperature: float,
        reasoning: str | None = None,
    ) -> CompletionRecord:
        """The record of `completion_id`: template prompt ids, output decoding to `text`
        (or, where the reply carried `reasoning`, to a leading `<think>` block holding it
        and then `text`: the random tiny model samples `<think>` now and then),
        behaviour logprobs equal to a reference forward at `temperature`."""
        record = self.record(completion_id)
        rendered = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        assert list(record.prompt_ids) == self.tokenizer.encode(rendered, add_special_tokens=False)
        assert record.prompt_tokens == len(record.prompt_ids)
        assert record.temperature == pytest.approx(temperature)
        assert (
            len(record.output_ids)
            == len(record.output_logprobs)
            == len(record.output_versions)
            == record.completion_tokens
            > 0
        )
        decoded = self.tokenizer.decode(record.output_ids, skip_special_tokens=True)
        if reasoning:
            assert decoded.lstrip().startswith("<think>") and reasoning.strip() in decoded, decoded
            assert decoded.endswith(text.strip()), (decoded, text)
        else:
            assert decoded == text
        expected = self.logprobs(record.prompt_ids, record.output_ids, record.temperature)
        assert list(record.output_logprobs) == pytest.approx(expected, abs=1e-4)
        return record

    def logprobs(
        self, prompt: tuple[int, ...], output: tuple[int, ...], temperature: float
    ) -> list[float]:
        """log softmax(logits / T) at each output token; greedy (T = 0) reports T = 1."""
        with torch.no_grad():
            logits = self.reference(torch.tensor([[*prompt, *output]])).logits[0].float()
        scale = temperature if temperature >= 1e-6 else 1.0
        logp = torch.log_softmax(logits[len(prompt) - 1 : -1] / scale, dim=-1)
        return logp.gather(1, torch.tensor(output)[:, None]).squeeze(1).tolist()

    def close(self) -> None:
        self.store.close()


@pytest.fixture()
def checker(gateway: Gateway, reference: Any, hf_tokenizer: Any) -> Iterator[Checker]:
    """Checks records of the default gateway (sampling mode `training`, T = 1)."""
    c = Checker(gateway, reference, hf_tokenizer)
    yield c
    c.close()


@pytest.fixture()
def client_checker(client_gw: Gateway, reference: Any, hf_tokenizer: Any) -> Iterator[Checker]:
    """Checks records of a gateway that honours the client's sampling fields."""
    c = Checker(client_gw, reference, hf_tokenizer)
    yield c
    c.close()


def _client(gw: Gateway) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=gw.v1, api_key=gw.config.gateway.auth.admin_key.get_secret_value(), max_retries=0
    )


def _session_client(gw: Gateway) -> openai.OpenAI:
    """A client on a fresh RL session's key (turns that may be trained on)."""
    admin = gw.config.gateway.auth.admin_key.get_secret_value()
    started = httpx.post(
        f"{gw.url}/rl/sessions", json={}, headers={"Authorization": f"Bearer {admin}"}, timeout=30
    )
    return openai.OpenAI(base_url=gw.v1, api_key=started.json()["api_key"], max_retries=0)


def test_chat_record_matches_served_tokens(checker: Checker) -> None:
    """Training mode, a turn in a session: the client's temperature is overridden, and
    the recorded one (1.0) is the one the logprobs were computed at."""
    messages = [SYSTEM, USER]
    completion = _session_client(checker.gw).chat.completions.create(
        model=checker.gw.config.gateway.model_name,
        messages=messages,
        max_tokens=12,
        temperature=0.2,
    )
    record = checker.check(
        completion.id, messages, completion.choices[0].message.content, temperature=1.0
    )
    assert record.request_json["temperature"] == 0.2
    assert record.response_json["id"] == completion.id
    assert record.finish_reason == completion.choices[0].finish_reason


def test_client_temperature_is_recorded(client_checker: Checker) -> None:
    messages = [USER]
    completion = _client(client_checker.gw).chat.completions.create(
        model=client_checker.gw.config.gateway.model_name,
        messages=messages,
        max_tokens=12,
        temperature=0.6,
        seed=3,
    )
    record = client_checker.check(
        completion.id, messages, completion.choices[0].message.content, temperature=0.6
    )
    at_one = client_checker.logprobs(record.prompt_ids, record.output_ids, 1.0)
    assert list(record.output_logprobs) != pytest.approx(at_one, abs=1e-3)


def test_n2_records_every_choice(checker: Checker) -> None:
    messages = [USER]
    name = checker.gw.config.gateway.model_name
    client = _client(checker.gw)
    completion = client.chat.completions.create(model=name, messages=messages, n=2, max_tokens=8)
    for choice, rid in zip(completion.choices, (completion.id, f"{completion.id}.1"), strict=True):
        checker.check(
            rid,
            messages,
            choice.message.content or "",
            temperature=1.0,
            reasoning=getattr(choice.message, "reasoning_content", None),
        )

    texts, reasonings = ["", ""], ["", ""]
    stream = client.chat.completions.create(
        model=name, messages=messages, n=2, max_tokens=8, stream=True
    )
    stream_id = ""
    for chunk in stream:
        stream_id = chunk.id
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            reasonings[c.index] += getattr(c.delta, "reasoning_content", None) or ""
    for index, rid in enumerate((stream_id, f"{stream_id}.1")):
        checker.check(rid, messages, texts[index], temperature=1.0, reasoning=reasonings[index])


def test_stream_is_durable_before_done(checker: Checker) -> None:
    """Read the record the moment `data: [DONE]` arrives, on a raw SSE connection."""
    gw = checker.gw
    body = {
        "model": gw.config.gateway.model_name,
        "messages": [USER],
        "max_tokens": 10,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {gw.config.gateway.auth.admin_key.get_secret_value()}"}
    texts, completion_id, record = [], "", None
    with httpx.stream(
        "POST", gw.v1 + "/chat/completions", json=body, headers=headers, timeout=60
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line == "data: [DONE]":
                record = checker.record(completion_id)
                break
            if line.startswith("data: "):
                chunk = json.loads(line[6:])
                completion_id = chunk["id"]
                texts += [c["delta"].get("content") or "" for c in chunk["choices"]]
    assert record is not None and response.headers["x-request-id"] == completion_id
    checker.check(completion_id, [USER], "".join(texts), temperature=1.0)


def test_responses_records(checker: Checker) -> None:
    client = _client(checker.gw)
    name = checker.gw.config.gateway.model_name
    messages = [{"role": "system", "content": "Count."}, USER]
    response = client.responses.create(
        model=name, instructions="Count.", input=USER["content"], max_output_tokens=9
    )
    checker.check(response.id, messages, response.output_text, temperature=1.0)

    with client.responses.stream(
        model=name,
        instructions="Count.",
        input=[{"role": "user", "content": USER["content"]}],
        max_output_tokens=9,
    ) as stream:
        final = stream.get_final_response()
    checker.check(final.id, messages, final.output_text, temperature=1.0)


def test_stream_interrupted_by_pause_is_recorded_whole(
    client_checker: Checker, engine_url: str
) -> None:
    """A pause (abort mode, as in a weight swap) in the middle of a stream: the gateway
    resubmits prompt + partial output, the client sees one stream, and the record holds
    every token with logprobs that match a single uninterrupted forward."""
    gw = client_checker.gw
    stream = _client(gw).chat.completions.create(
        model=gw.config.gateway.model_name,
        messages=[USER],
        max_tokens=150,
        temperature=0,
        stream=True,
    )
    texts: list[str] = []
    finish, completion_id, resumed = None, "", threading.Event()
    for chunk in stream:
        completion_id = chunk.id
        delta = chunk.choices[0].delta.content or ""
        texts.append(delta)
        finish = chunk.choices[0].finish_reason or finish
        if delta and not resumed.is_set():
            httpx.post(
                engine_url + "/pause_generation", json={"mode": "abort"}, timeout=30
            ).raise_for_status()
            timer = threading.Timer(
                0.3,
                lambda: (
                    httpx.post(engine_url + "/continue_generation", timeout=30),
                    resumed.set(),
                ),
            )
            timer.start()
    timer.join()
    assert resumed.is_set() and finish == "length"
    assert gw.state.metrics.registry.get_sample_value("areal_resubmissions_total") >= 1
    record = client_checker.check(completion_id, [USER], "".join(texts), temperature=0.0)
    assert len(record.output_ids) == 150


async def test_concurrent_requests_record_their_own_tokens(checker: Checker) -> None:
    """Eight requests at once (batched together by the engine), half streamed: each
    record holds its own prompt and output, logprobs as a lone forward computes them."""
    gw = checker.gw
    client = openai.AsyncOpenAI(
        base_url=gw.v1, max_retries=0, api_key=gw.config.gateway.auth.admin_key.get_secret_value()
    )
    prompts = [
        [{"role": "user", "content": f"What is {i} + {i * 7}?" + " please" * i}] for i in range(8)
    ]

    async def one(i: int) -> tuple[str, str]:
        kwargs = {
            "model": gw.config.gateway.model_name,
            "messages": prompts[i],
            "max_tokens": 6 + 3 * i,
        }
        if i % 2:
            stream = await client.chat.completions.create(stream=True, **kwargs)
            parts = [(c.id, c.choices[0].delta.content or "") async for c in stream]
            return parts[0][0], "".join(p for _, p in parts)
        completion = await client.chat.completions.create(**kwargs)
        return completion.id, completion.choices[0].message.content

    results = await asyncio.gather(*(one(i) for i in range(8)))
    await client.close()
    for i, (completion_id, text) in enumerate(results):
        checker.check(completion_id, prompts[i], text, temperature=1.0)
