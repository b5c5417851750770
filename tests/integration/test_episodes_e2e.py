"""Episodes end to end through the real gateway and engine: many concurrent agents,
interleaved rewards, export, and claims by two trainers at once."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import openai
from support.harness import ADMIN_KEY

from areal_service.store.claims import EpisodeClaimer

AGENTS = 32
TURNS = 3


async def _agent(gw, http: httpx.AsyncClient, session: dict, index: int) -> list[str]:
    client = openai.AsyncOpenAI(base_url=gw.v1, api_key=session["api_key"], max_retries=0)
    auth = {"authorization": f"Bearer {session['api_key']}"}
    messages = [{"role": "user", "content": f"agent {index} says hi"}]
    ids = []
    try:
        for turn in range(TURNS):
            reply = await client.chat.completions.create(
                model="areal-policy", max_tokens=4, messages=messages
            )
            ids.append(reply.id)
            r = await http.post(
                "/v1/rewards",
                headers=auth,
                json={
                    "id": f"{session['session_id']}-t{turn}",
                    "completion_id": reply.id,
                    "value": 0.1 * turn,
                },
            )
            assert r.status_code == 201, r.text
            messages += [
                {"role": "assistant", "content": reply.choices[0].message.content},
                {"role": "user", "content": f"turn {turn + 1}"},
            ]
        r = await http.post(
            "/v1/rewards",
            headers=auth,
            json={
                "session_id": session["session_id"],
                "value": float(index % 2),
                "end_session": True,
            },
        )
        assert r.status_code == 201, r.text
    finally:
        await client.close()
    return ids


def test_concurrent_agents_rewards_and_double_claims(gateway, tmp_path):
    async def drive():
        async with httpx.AsyncClient(base_url=gateway.url, timeout=120) as http:
            started = await http.post(
                "/rl/sessions",
                json={"group_size": AGENTS // 4},
                headers={"authorization": f"Bearer {ADMIN_KEY}"},
            )
            groups = [started.json()["sessions"]]
            for _ in range(3):
                more = await http.post(
                    "/rl/sessions",
                    json={"group_size": AGENTS // 4},
                    headers={"authorization": f"Bearer {ADMIN_KEY}"},
                )
                groups.append(more.json()["sessions"])
            sessions = [s for g in groups for s in g]
            ids = await asyncio.gather(
                *(_agent(gateway, http, s, i) for i, s in enumerate(sessions))
            )
            return sessions, ids

    sessions, ids = asyncio.run(drive())
    store = gateway.state.store
    linked = 0
    for session, completion_ids in zip(sessions, ids, strict=True):
        stored = store.list_completions(session["session_id"])
        assert [c.id for c in stored] == completion_ids  # each completion in exactly one session
        assert len(store.list_rewards(session_id=session["session_id"])) == 1
        assert sum(len(store.list_rewards(completion_id=c)) for c in completion_ids) == TURNS
        # A turn's parent is the previous turn exactly when that turn's prompt+output ids
        # prefix this prompt (a random model's reply may re-tokenize differently when the
        # client replays it as text, or be cut off by max_tokens: then no parent).
        for parent, child in zip(stored, stored[1:], strict=False):
            full = parent.prompt_ids + parent.output_ids
            is_prefix = child.prompt_ids[: len(full)] == full
            assert (child.parent_id == parent.id) == is_prefix
            linked += is_prefix

    assert linked > 0, "no multi-turn chain linked at all"

    # Two trainers claim at once: every session is claimed exactly once.
    claimed: dict[str, list[str]] = {"a": [], "b": []}

    def claim(name: str) -> None:
        claimer = EpisodeClaimer(store)
        for _ in range(10):
            result = claimer.claim_groups(
                group_size=AGENTS // 4,
                max_groups=1,
                current_version=0,
                max_staleness=None,
                claimer=name,
            )
            for group in result.groups:
                claimed[name].extend(group.session_ids)

    threads = [threading.Thread(target=claim, args=(n,)) for n in claimed]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    everything = claimed["a"] + claimed["b"]
    assert sorted(everything) == sorted(s["session_id"] for s in sessions)

    # Export: one JSONL row per training sequence, ids/masks/logprobs from the store.
    out = tmp_path / "export.jsonl"
    from areal_service.export import export_sequences

    rows = export_sequences(store, fmt="jsonl", out=out)
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert rows == len(lines) >= AGENTS
    for row in lines:
        assert len(row["input_ids"]) == len(row["loss_mask"]) == len(row["logprobs"])
