"""Policies created at runtime (issue 29): `POST /admin/policies` on the real app, bad
input refused in the OpenAI error shape (400, and 409 for a name or model name taken,
the config's included), `GET /admin/policies` listing both kinds, keys and sessions
bound to a new policy at once, a policy another process stored picked up without a
restart, and one created through the API trained by its own trainer (run with the
registry's config, as `trainer --policy` does) and swapped in on the real local engine."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from support.harness import ADMIN_KEY, run_gateway

from areal_service.policy_registry import with_runtime_policies
from areal_service.types import PolicyRecord
from engine.testing import start_engine_in_thread

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
POLICIES = (
    "trainer.lora.rank=4",
    "policies=[{name: solver, model_names: [solver-model]}]",
)


@pytest.fixture(scope="module")
def gw(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, engine_url: str
) -> Iterator[Any]:
    with run_gateway(
        tmp_path_factory.mktemp("runtime-policies"), tiny_model_dir, [engine_url], *POLICIES
    ) as gateway:
        yield gateway


def _post(gw: Any, path: str, body: Any, key: str | None = None) -> httpx.Response:
    headers = ADMIN if key is None else {"Authorization": f"Bearer {key}"}
    return httpx.post(gw.url + path, json=body, headers=headers, timeout=60)


def _listed(gw: Any) -> dict[str, dict[str, Any]]:
    listed = httpx.get(gw.url + "/admin/policies", headers=ADMIN, timeout=30)
    assert listed.status_code == 200, listed.text
    return {p["name"]: p for p in listed.json()["data"]}


def test_create_and_list_a_runtime_policy(gw: Any) -> None:
    created = _post(
        gw,
        "/admin/policies",
        {
            "name": "critic",
            "lora": {"rank": 2, "alpha": 4, "target_modules": ["q_proj", "v_proj"]},
            "model_names": ["critic-model"],
        },
    )
    assert created.status_code == 201, created.text
    view = created.json()
    assert view["name"] == "critic" and view["source"] == "runtime"
    assert (view["lora_rank"], view["lora_alpha"]) == (2, 4.0)
    assert view["target_modules"] == ["q_proj", "v_proj"]
    assert view["model_names"] == ["critic-model"] and view["latest_version"] is None
    # Without a shape of its own it takes trainer.lora's.
    plain = _post(gw, "/admin/policies", {"name": "judge"})
    assert plain.status_code == 201 and plain.json()["lora_rank"] == 4
    views = _listed(gw)
    assert list(views)[:3] == ["default", "solver", "critic"]
    assert views["solver"]["source"] == "config" and views["critic"]["source"] == "runtime"
    assert views["critic"]["created_at"] is not None and views["solver"]["created_at"] is None
    records = {r.name: r for r in gw.state.store.policies.list_policies()}
    assert records["critic"].lora["rank"] == 2 and records["critic"].model_names == (
        "critic-model",
    )
    assert "solver" not in records  # the config's policies are not stored


@pytest.mark.parametrize(
    ("body", "status", "code", "param"),
    [
        ({"name": "Bad Name"}, 400, "invalid_policy_name", "name"),
        ({"name": "default"}, 400, "invalid_policy_name", "name"),
        ({"name": "areal-lora"}, 400, "invalid_policy_name", "name"),
        ({"name": "v7"}, 400, "invalid_policy_name", "name"),
        ({"name": "x" * 64}, 400, None, "name"),
        ({"name": "new-one", "colour": "red"}, 400, None, "colour"),
        ({"name": "new-one", "lora": {"rank": 0}}, 400, None, "lora.rank"),
        ({"name": "new-one", "lora": {"rank": "big"}}, 400, None, "lora.rank"),
        ({"name": "new-one", "lora": {"target_modules": []}}, 400, None, "lora.target_modules"),
        ({"name": "new-one", "lora": {"rank": 4, "bias": "all"}}, 400, None, "lora.bias"),
        (
            {"name": "new-one", "lora": {"target_modules": ["q_proj", "nope"]}},
            400,
            "invalid_lora",
            "lora.target_modules",
        ),
        ({"name": "new-one", "model_names": ["m", "m"]}, 400, "invalid_model_names", "model_names"),
        ({}, 400, None, "name"),
        ({"name": "solver"}, 409, "policy_exists", "name"),
        (
            {"name": "new-one", "model_names": ["solver-model"]},
            409,
            "model_name_taken",
            "model_names",
        ),
    ],
)
def test_bad_policies_are_refused_in_the_openai_shape(
    gw: Any, body: dict[str, Any], status: int, code: str | None, param: str
) -> None:
    refused = _post(gw, "/admin/policies", body)
    assert refused.status_code == status, refused.text
    error = refused.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    assert "new-one" not in _listed(gw)


def test_runtime_names_and_model_names_are_taken_too(gw: Any) -> None:
    first = _post(gw, "/admin/policies", {"name": "twin", "model_names": ["twin-model"]})
    assert first.status_code == 201, first.text
    again = _post(gw, "/admin/policies", {"name": "twin"})
    assert again.status_code == 409 and again.json()["error"]["code"] == "policy_exists"
    alias = _post(gw, "/admin/policies", {"name": "twin-2", "model_names": ["twin-model"]})
    assert alias.status_code == 409 and alias.json()["error"]["code"] == "model_name_taken"
    bad_json = httpx.post(
        gw.url + "/admin/policies",
        content=b"{not json",
        headers={**ADMIN, "content-type": "application/json"},
        timeout=30,
    )
    assert bad_json.status_code == 400 and bad_json.json()["error"]["type"]


def test_only_the_admin_creates_policies(gw: Any) -> None:
    key = _post(gw, "/admin/keys", {"name": "user"}).json()["api_key"]
    for headers in ({"Authorization": f"Bearer {key}"}, {}):
        refused = httpx.post(
            gw.url + "/admin/policies", json={"name": "sneaky"}, headers=headers, timeout=30
        )
        assert refused.status_code in (401, 403), refused.text
        assert refused.json()["error"]["message"]
    assert "sneaky" not in _listed(gw)


def test_keys_sessions_and_model_names_use_a_new_policy_at_once(gw: Any) -> None:
    assert _post(
        gw, "/admin/policies", {"name": "planner", "model_names": ["plan-model"]}
    ).is_success
    key = _post(gw, "/admin/keys", {"name": "p", "policy": "planner"})
    assert key.status_code == 201 and key.json()["policy"] == "planner"
    group = _post(gw, "/rl/sessions", {"policy": "planner", "group_size": 1})
    assert group.status_code == 201, group.text
    session = group.json()["sessions"][0]
    assert session["policy"] == "planner"
    # The session's completions are served (and recorded) under the policy, and a
    # model name of the new policy picks it for another key's request.
    client = openai.OpenAI(base_url=gw.v1, api_key=session["api_key"], max_retries=0)
    reply = client.chat.completions.create(
        model="my-agent", max_tokens=4, messages=[{"role": "user", "content": "plan"}]
    )
    assert gw.state.store.get_completion(reply.id).model == "planner"
    other = openai.OpenAI(base_url=gw.v1, api_key=ADMIN_KEY, max_retries=0)
    aliased = other.chat.completions.create(
        model="plan-model", max_tokens=4, messages=[{"role": "user", "content": "plan"}]
    )
    assert aliased.choices[0].message is not None
    assert gw.state.model_policies["plan-model"] == "planner"


def test_a_policy_stored_by_another_process_is_seen_without_a_restart(gw: Any) -> None:
    # Another gateway worker (or the CLI) writes the store; this one has not read it.
    gw.state.store.policies.add_policy(PolicyRecord(name="elsewhere", model_names=("far",)))
    assert "elsewhere" not in gw.state.policy_registry
    # Choosing it for a key looks it up at once...
    key = _post(gw, "/admin/keys", {"policy": "elsewhere"})
    assert key.status_code == 201, key.text
    # ...and the refresher picks up one nobody has asked for, off the request path.
    gw.state.store.policies.add_policy(PolicyRecord(name="later", model_names=("late",)))
    deadline = time.monotonic() + 10
    while "late" not in gw.state.model_policies:
        assert time.monotonic() < deadline, "the refresher never read the new policy"
        time.sleep(0.1)
    assert gw.state.policy_registry.source("later") == "runtime"


TRAIN = (
    "trainer.group_size=2",
    "trainer.batch_groups=1",
    "trainer.lr=1e-2",
    "trainer.total_steps=1",
    "gateway.sessions.staleness_gate=false",
    "trainer.lora.rank=8",
)


def test_a_runtime_policy_trains_and_swaps_on_the_local_engine(
    tmp_path: Path, tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No `policies:` in the config at all: the policy exists only because the API made
    it; its trainer runs with the registry's config and its own (rank 2) shape. Deleted,
    a trainer of it started by hand (no launcher to stop it) stops by itself."""
    from trainer.train import main

    with (
        start_engine_in_thread(tiny_model_dir) as engine,  # its own: adapters stay loaded
        run_gateway(tmp_path, tiny_model_dir, [engine], *TRAIN) as gw,
    ):
        made = _post(gw, "/admin/policies", {"name": "critic", "lora": {"rank": 2, "alpha": 4}})
        assert made.status_code == 201, made.text
        key = _post(gw, "/admin/keys", {"policy": "critic"}).json()["api_key"]
        started = _post(gw, "/rl/sessions", {"group_size": 2, "policy": "critic"})
        assert started.status_code == 201, started.text
        for j, s in enumerate(started.json()["sessions"]):
            client = openai.OpenAI(base_url=gw.v1, api_key=s["api_key"], max_retries=0)
            client.chat.completions.create(
                model="m", max_tokens=6, messages=[{"role": "user", "content": f"go {j}"}]
            )
            reward = _post(
                gw,
                "/v1/rewards",
                {"session_id": s["session_id"], "value": float(j), "end_session": True},
                key=s["api_key"],
            )
            assert reward.status_code == 201, reward.text
        config = with_runtime_policies(gw.config, gw.state.store.policies.list_policies(), "critic")
        failure: list[BaseException] = []

        def run() -> None:
            try:
                main(config)
            except BaseException as exc:  # surfaced below
                failure.append(exc)

        trainer = threading.Thread(target=run, name="trainer-critic")
        trainer.start()
        trainer.join(timeout=240)
        assert not trainer.is_alive() and not failure, failure
        published = tmp_path / "weights" / "critic" / "v1"
        adapter = json.loads((published / "adapter_config.json").read_text())
        assert adapter["r"] == 2  # the policy's own shape, not trainer.lora's 8
        deadline = time.monotonic() + 60
        while gw.state.policy_versions.get("critic", 0) < 1:
            assert time.monotonic() < deadline, "critic v1 never went live"
            time.sleep(0.05)
        assert gw.state.live_version == 0  # the default policy was not touched
        client = openai.OpenAI(base_url=gw.v1, api_key=key, max_retries=0)
        reply = client.chat.completions.create(
            model="m", max_tokens=4, messages=[{"role": "user", "content": "again"}]
        )
        served = gw.state.store.get_completion(reply.id)
        assert served.model == "critic" and set(served.output_versions) == {1}
        assert _listed(gw)["critic"]["latest_version"] == 1

        # An endless trainer of it, waiting for episodes; the policy is then deleted.
        endless = config.model_copy(
            update={"trainer": config.trainer.model_copy(update={"total_steps": None})}
        )
        waiting = threading.Thread(target=main, args=(endless,), name="trainer-critic-2")
        waiting.start()
        time.sleep(2)
        assert waiting.is_alive()
        gone = httpx.delete(gw.url + "/admin/policies/critic", headers=ADMIN, timeout=30)
        assert gone.status_code == 200, gone.text
        waiting.join(timeout=60)
        assert not waiting.is_alive(), "the deleted policy's trainer did not stop"
        said = [r.getMessage() for r in caplog.records if "was deleted" in r.getMessage()]
        assert "policy critic was deleted (its sessions were dropped): the trainer stops" in said
        again = httpx.post(
            gw.v1 + "/chat/completions",
            headers={"authorization": f"Bearer {key}"},
            json={"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]},
            timeout=30,
        )
        assert again.status_code == 403 and again.json()["error"]["code"] == "policy_deleted"
