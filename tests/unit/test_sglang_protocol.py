"""The one model of SGLang's protocol: what goes on the wire, what parses, and that both
servers the gateway is tested against (local engine, echo backend) serve every endpoint
the gateway relies on."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from areal_service.sglang_protocol import (
    ENDPOINTS,
    ErrorResponse,
    FinishReason,
    GenerateResponse,
    MetaInfo,
    SamplingParams,
)
from engine.echo_backend import start_echo_backend
from engine.server import router as engine_router
from gateway.backends import TokenRequest
from gateway.backends.sglang import sglang_body
from gateway.errors import OpenAIError
from gateway.generation import generate_requests
from gateway.translate import SamplingSpec


def test_a_request_sends_only_what_was_set_and_keeps_unknown_keys() -> None:
    req = TokenRequest.for_tokens(
        (5, 6),
        {"max_new_tokens": 3, "frequency_penalty": 0.5, "json_schema": "{}"},
        rid="r-000",
        top_logprobs_num=2,
        lora_path="a",
    )
    wire = json.loads(sglang_body(req, stream=True)[1])
    assert wire == {
        "input_ids": [5, 6],
        "rid": "r-000",
        "return_logprob": True,
        "top_logprobs_num": 2,
        "stream": True,
        "lora_path": "a",
        "sampling_params": {"max_new_tokens": 3, "frequency_penalty": 0.5, "json_schema": "{}"},
    }
    assert json.loads(sglang_body(req, stream=False)[1])["stream"] is False


def test_sampling_values_sglang_rejects_fail_with_its_message() -> None:
    with pytest.raises(ValidationError, match="top_k must be -1"):
        SamplingParams(top_k=0)
    assert SamplingParams.model_validate({"seed": 7}).sampling_seed == 7
    # In the gateway the same check is a 400 for the client, never a 500.
    spec = SamplingSpec(
        max_new_tokens=8,
        temperature=1.0,
        top_p=1.0,
        top_k=-5,
        seed=None,
        stop=(),
        n=1,
        mode="client",
    )
    with pytest.raises(OpenAIError) as err:
        generate_requests([1, 2], spec, "c")
    assert err.value.status == 400 and "top_k must be -1" in str(err.value)


def test_replies_parse_as_sglang_sends_them_and_serialize_back() -> None:
    """The reference's final chunk (with keys this model ignores), and an abort of a
    queued request, which carries only `completion_tokens`."""
    final = GenerateResponse.model_validate_json(
        json.dumps(
            {
                "text": " Paris.",
                "output_ids": [12095, 13, 151645],
                "meta_info": {
                    "id": "r1",
                    "finish_reason": {"type": "stop", "matched": 151645},
                    "prompt_tokens": 9,
                    "completion_tokens": 3,
                    "cached_tokens": 0,
                    "reasoning_tokens": 0,
                    "num_retractions": 0,
                    "weight_version": "7",
                    "output_token_logprobs": [
                        [-0.1, 12095, None],
                        [-0.2, 13, None],
                        [-0.3, 151645, None],
                    ],
                    "output_top_logprobs": [[[-0.1, 12095, None], [-2.0, 5, None]], None, []],
                    "e2e_latency": 0.5,
                },
            }
        )
    )
    assert final.finish_reason == FinishReason("stop", matched=151645) and final.cumulative
    assert final.output_logprobs() == (-0.1, -0.2, -0.3)
    assert final.output_top_logprobs() == (((12095, -0.1), (5, -2.0)), (), ())
    queued = GenerateResponse.model_validate(
        {
            "text": "",
            "output_ids": [],
            "meta_info": {
                "finish_reason": {"type": "abort", "message": "Abort in waiting queue"},
                "completion_tokens": 0,
            },
        }
    )
    assert queued.finish_reason == FinishReason("abort", message="Abort in waiting queue")
    # Serialized, each finish type has SGLang's keys only; absent optionals are left out.
    meta = json.loads(
        MetaInfo(
            id="r", finish_reason=FinishReason("length", length=4), weight_version="1"
        ).model_dump_json()
    )
    assert meta == {
        "id": "r",
        "finish_reason": {"type": "length", "length": 4},
        "prompt_tokens": 0,
        "completion_tokens": 0,
        "cached_tokens": 0,
        "weight_version": "1",
    }
    with pytest.raises(ValidationError):  # an unknown finish type is a malformed reply
        GenerateResponse.model_validate(
            {"output_ids": [], "meta_info": {"finish_reason": {"type": "paused"}}}
        )


def test_the_local_engine_serves_every_endpoint() -> None:
    served = {
        (method, route.path)
        for route in engine_router.routes
        for method in getattr(route, "methods", ())
    }
    for e in ENDPOINTS:
        for path in filter(None, (e.path, e.legacy_path)):
            assert (e.method, path) in served, f"{e.method} {path}"


def test_the_echo_backend_serves_every_endpoint(tmp_path: Path) -> None:
    bodies = {
        "/generate": {"input_ids": [3], "sampling_params": {"max_new_tokens": 1}},
        "/update_weights_from_disk": {"model_path": str(tmp_path)},
    }
    with start_echo_backend() as echo, httpx.Client(base_url=echo.url) as http:
        for e in ENDPOINTS:
            r = http.request(e.method, e.path, json=bodies.get(e.path, {}))
            if "weight" in e.path and e.path != "/update_weights_from_disk":
                # served, and refused: the echo backend has no weights to receive into
                assert r.status_code == 400 and r.json()["success"] is False, (e.path, r.text)
                continue
            assert r.status_code == 200, (e.path, r.text)
    with start_echo_backend(legacy_info=True) as old, httpx.Client(base_url=old.url) as http:
        for e in ENDPOINTS:  # an older SGLang: only the legacy names answer
            if e.legacy_path is not None:
                assert http.request(e.method, e.legacy_path).status_code == 200


def test_a_logprob_sglang_writes_as_null_is_recorded_at_the_floor() -> None:
    """SGLang serialises -inf as null (orjson); a pushed-down token may also come as a
    huge negative. Both are recorded at LOGPROB_FLOOR; finite ones pass unchanged."""
    from areal_service.sglang_protocol import LOGPROB_FLOOR, GenerateResponse

    reply = GenerateResponse.model_validate_json(
        '{"output_ids": [1, 2, 3], "meta_info": {"completion_tokens": 3, '
        '"output_token_logprobs": [[-0.5, 1, null], [null, 2, null], [-1e30, 3, null]]}}'
    )
    assert reply.output_logprobs() == (-0.5, LOGPROB_FLOOR, LOGPROB_FLOOR)
    assert reply.output_logprobs(2) == (LOGPROB_FLOOR,)
    nan_first = GenerateResponse.model_validate(  # NaN defeats min(): checked one by one
        {
            "output_ids": [1, 2],
            "meta_info": {
                "completion_tokens": 2,
                "output_token_logprobs": [[float("nan"), 1, None], [-0.5, 2, None]],
            },
        }
    )
    assert nan_first.output_logprobs() == (LOGPROB_FLOOR, -0.5)
    clean = GenerateResponse.model_validate_json(
        '{"output_ids": [1], "meta_info": {"completion_tokens": 1, '
        '"output_token_logprobs": [[-2.25, 1, null]]}}'
    )
    assert clean.output_logprobs() == (-2.25,)


def test_both_error_envelopes_sglang_answers_are_read() -> None:
    """`{"error": {"message"}}`, and the bare string SGLang 0.5.23 answers a rejected
    `sampling_params` with (captured from the real server)."""
    nested = {"error": {"message": "The input (9000 tokens) is longer than the model's"}}
    bare = {"error": "unknown field `bogus`, expected one of `max_new_tokens`, `stop`"}
    assert ErrorResponse.model_validate_json(json.dumps(nested)).error.message.startswith("The")
    assert ErrorResponse.model_validate_json(json.dumps(bare)).error.message == bare["error"]
