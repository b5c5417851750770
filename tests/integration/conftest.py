"""Real servers on loopback for integration tests: the local engine (tiny model) and the
gateway, each in a background thread of this process, stopped by handle."""

from __future__ import annotations

import asyncio
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import uvicorn
from sqlalchemy import select
from sqlalchemy.orm import Session

from areal_service.config import ServiceConfig, load_config
from areal_service.engine.testing import start_engine_in_thread
from areal_service.schema import CompletionRow
from areal_service.store import TrajectoryStore, completion_from_row
from areal_service.types import CompletionRecord
from gateway.app import create_app
from gateway.state import GatewayState

sys.path.insert(0, str(Path(__file__).parent))  # test helper modules (tool_model)
from tool_model import record_agent_requests, round_trip_examples, train_tool_model  # noqa: E402

ADMIN_KEY = "sk-test-admin"


@dataclass
class Gateway:
    url: str
    app: object
    config: ServiceConfig

    @property
    def state(self) -> GatewayState:
        return self.app.state.gateway  # type: ignore[attr-defined]

    @property
    def v1(self) -> str:
        return f"{self.url}/v1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def run_gateway(tmp_dir: Path, model_dir: Path, backends: list[str],
                *overrides: str) -> Iterator[Gateway]:
    """A gateway on a free loopback port with its own SQLite store under `tmp_dir`."""
    port = _free_port()
    cfg = load_config(overrides=[
        f"data_dir={tmp_dir}", f"engine.model={model_dir}", f"gateway.port={port}",
        f"gateway.backends={backends}", f"gateway.admin_key={ADMIN_KEY}",
        "gateway.backend_unavailable_deadline_s=2", *overrides])
    app = create_app(cfg)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True, name="gateway-uvicorn")
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("gateway did not start")
        time.sleep(0.02)
    try:
        yield Gateway(f"http://127.0.0.1:{port}", app, cfg)
    finally:
        server.should_exit = True
        thread.join(timeout=30)


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


def stored_completions(store: TrajectoryStore) -> list[CompletionRecord]:
    """Every completion in `store`, oldest first (tests read what the gateway recorded)."""
    with Session(store.engine) as session:
        rows = session.scalars(select(CompletionRow).order_by(CompletionRow.created_at,
                                                              CompletionRow.id))
        return [completion_from_row(row) for row in rows]


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
def agent_requests(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path,
                   engine_url: str) -> dict[str, CompletionRecord]:
    """The calculator agent's first turn as the Agents SDK sends it, recorded by a gateway
    in front of the untrained model: {"chat": record, "responses": record}."""
    with run_gateway(tmp_path_factory.mktemp("agent-record"), tiny_model_dir, [engine_url],
                     "gateway.sampling=client") as gw:
        asyncio.run(record_agent_requests(gw.v1, ADMIN_KEY, gw.config.gateway.model_name))
        records = stored_completions(gw.state.store)
    by_kind = {("chat" if "messages" in r.request_json else "responses"): r for r in records}
    assert len(records) == 2 and set(by_kind) == {"chat", "responses"}, records
    return by_kind


@pytest.fixture(scope="session")
def tool_model_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path,
                   agent_requests: dict[str, CompletionRecord]) -> Path:
    """The tiny model fine-tuned to call `add(2, 3)` and then answer "The answer is 5."
    on the recorded agent prompts (chat and Responses renderings)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    examples = [ex for r in agent_requests.values()
                for ex in round_trip_examples(tokenizer, r.prompt_ids)]
    return train_tool_model(tiny_model_dir, tmp_path_factory.mktemp("models") / "tool",
                            examples)


@pytest.fixture(scope="session")
def tool_engine_url(tool_model_dir: Path) -> Iterator[str]:
    """The local engine serving the tool model for the whole test session."""
    with start_engine_in_thread(tool_model_dir) as url:
        yield url


@pytest.fixture()
def tool_gateway(tmp_path: Path, tool_model_dir: Path, tool_engine_url: str
                 ) -> Iterator[Gateway]:
    """A fresh gateway in front of the tool model's engine, honouring client sampling
    (tests ask for temperature 0: greedy, deterministic)."""
    with run_gateway(tmp_path, tool_model_dir, [tool_engine_url],
                     "gateway.sampling=client") as gw:
        yield gw
