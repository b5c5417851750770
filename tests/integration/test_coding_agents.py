"""The real coding agents from npm against the gateway and the local engine (tiny model):
Codex CLI over Responses (`codex exec`) and Claude Code over the Anthropic Messages API
(`claude -p`), each configured only by its endpoint and key. Each run exits 0, its
completions are captured with its tools rendered into the prompt ids, and a follow-up
turn (`codex exec resume --last`, `claude -p --continue`) is recorded in the same
session as a child of the first turn.

Slow: installs `@openai/codex@0.169.0` and `@anthropic-ai/claude-code@2.1.197` into a
cache directory once (`AREAL_NPM_CACHE`, default `~/.cache/areal-service/npm`), which
needs npm and the registry; skipped with the reason when either is missing. The agents'
own prompts are trimmed by their documented settings (Codex: `model_instructions_file`,
features off; Claude Code: `--system-prompt`, `--tools`) so they fit a tiny model with a
16k context on CPU; everything on the wire is what the binaries send.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.harness import ADMIN_KEY, Gateway, run_gateway, stored_completions
from support.tool_model import ToolExample, reply_ids, train_tool_model

from engine.testing import start_engine_in_thread

pytestmark = pytest.mark.slow

PACKAGES = ("@openai/codex@0.169.0", "@anthropic-ai/claude-code@2.1.197")
OFFLINE_ENV = {
    # Claude Code: no telemetry, error reporting, update checks or other side traffic
    "DISABLE_TELEMETRY": "1",
    "DISABLE_ERROR_REPORTING": "1",
    "DISABLE_AUTOUPDATER": "1",
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "DISABLE_BUG_COMMAND": "1",
    "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "64",
    # Codex: no analytics upload
    "CODEX_DISABLE_ANALYTICS": "1",
}


@pytest.fixture(scope="session")
def agent_bin() -> Path:
    """`node_modules/.bin` with both agents, installed once into the cache directory."""
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm is not installed")
    cache = Path(
        os.environ.get("AREAL_NPM_CACHE", Path.home() / ".cache" / "areal-service" / "npm")
    )
    bin_dir = cache / "node_modules" / ".bin"
    if not ((bin_dir / "codex").exists() and (bin_dir / "claude").exists()):
        cache.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(
            [npm, "install", "--prefix", str(cache), "--no-audit", "--no-fund", *PACKAGES],
            capture_output=True,
            text=True,
            timeout=600,
        )
        if done.returncode != 0:
            pytest.skip(f"npm install failed (registry unreachable?): {done.stderr[-500:]}")
    return bin_dir


def _run(
    cmd: list[str], env: dict[str, str], cwd: Path, check: bool = True
) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        cmd,
        env={**os.environ, **OFFLINE_ENV, **env},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0 or not check, (
        f"{cmd[:3]} exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    )
    return done


class Codex:
    """`codex exec` configured for the gateway: a custom provider, Responses wire API."""

    def __init__(self, bin_dir: Path, root: Path, base_url: str) -> None:
        self.bin = str(bin_dir / "codex")
        self.home, self.work = root / "codex-home", root / "codex-work"
        self.home.mkdir(parents=True)
        self.work.mkdir()
        (self.home / "instructions.md").write_text("You are a coding agent. Be brief.\n")
        (self.home / "config.toml").write_text(codex_config(base_url, self.home))
        self.env = {"CODEX_HOME": str(self.home), "HOME": str(root), "AREAL_API_KEY": ADMIN_KEY}

    def __call__(self, *args: str, check: bool = True) -> None:
        _run([self.bin, "exec", "--skip-git-repo-check", *args], self.env, self.work, check)


def codex_config(base_url: str, home: Path) -> str:
    return f'''model = "gpt-5-codex"
model_provider = "areal"
model_instructions_file = "{home / "instructions.md"}"
web_search = "disabled"
include_permissions_instructions = false
include_environment_context = false

[features]
multi_agent = false
goals = false

[model_providers.areal]
name = "AReaL gateway"
base_url = "{base_url}"
wire_api = "responses"
env_key = "AREAL_API_KEY"
'''


class Claude:
    """`claude -p` against the gateway (`ANTHROPIC_BASE_URL`, `ANTHROPIC_API_KEY`)."""

    FLAGS = ("--system-prompt", "You are a coding agent. Be brief.", "--tools", "Read")

    def __init__(self, bin_dir: Path, root: Path, base_url: str) -> None:
        self.bin = str(bin_dir / "claude")
        self.work = root / "claude-work"
        self.work.mkdir(parents=True)
        self.env = {
            "HOME": str(root),
            "ANTHROPIC_BASE_URL": base_url,
            "ANTHROPIC_API_KEY": ADMIN_KEY,
        }

    def __call__(self, *args: str, check: bool = True) -> None:
        _run([self.bin, "-p", *args, *self.FLAGS], self.env, self.work, check)


@pytest.fixture(scope="module")
def agent_model(tmp_path_factory: pytest.TempPathFactory, agent_bin: Path) -> Path:
    """The tiny model (16k context: the agents' prompts are thousands of tokens of its
    small vocabulary) fine-tuned to answer "hi" and stop on the agents' first prompts,
    recorded by running each agent once in front of the untrained model. A random model
    rarely stops, and both agents treat a reply cut at max_tokens as an error."""
    from transformers import AutoTokenizer

    from engine.tiny_model import TinyModelSpec, make_tiny_model

    root = tmp_path_factory.mktemp("agent-record")
    base = make_tiny_model(root / "tiny16k", TinyModelSpec(max_position_embeddings=16384))
    with (
        start_engine_in_thread(base) as url,
        run_gateway(root / "gw", base, [url], "gateway.sampling.default_max_tokens=4") as gw,
    ):
        Codex(agent_bin, root, gw.v1)("say hi", check=False)
        Claude(agent_bin, root, gw.url)("say hi", check=False)
        prompts = {r.prompt_ids for r in stored_completions(gw.state.store)}
    assert prompts, "neither agent reached the gateway"
    tokenizer = AutoTokenizer.from_pretrained(base)
    examples = [ToolExample(p, reply_ids(tokenizer, "hi")) for p in prompts]
    return train_tool_model(base, root / "hi-model", examples)


@pytest.fixture()
def agent_gateway(tmp_path: Path, agent_model: Path) -> Iterator[Gateway]:
    with (
        start_engine_in_thread(agent_model) as url,
        run_gateway(
            tmp_path / "gw", agent_model, [url], "gateway.sampling.default_max_tokens=24"
        ) as gw,
    ):
        yield gw


def _check_linked(gw: Gateway, tool_name: str) -> None:
    """Both turns captured in one session, the follow-up a child of the first turn, the
    tools rendered into the prompt ids."""
    records = stored_completions(gw.state.store)
    assert len(records) >= 2, [r.request_json for r in records]
    first, last = records[0], records[-1]
    assert first.session_id is not None and last.session_id == first.session_id
    assert last.parent_id is not None
    chain = {r.id: r for r in records}
    node = last
    while node.parent_id is not None:
        node = chain[node.parent_id]
    assert node.id == first.id
    prompt = gw.state.tokenizer.decode(list(first.prompt_ids))
    assert f'"name": "{tool_name}"' in prompt


def test_codex_exec(agent_bin: Path, agent_gateway: Gateway, tmp_path: Path) -> None:
    codex = Codex(agent_bin, tmp_path, agent_gateway.v1)
    codex("say hi")
    codex("resume", "--last", "and again")
    _check_linked(agent_gateway, "exec_command")
    first = stored_completions(agent_gateway.state.store)[0]
    assert first.request_json["store"] is False
    assert first.request_json["client_metadata"]["thread_id"]


def test_claude_print(agent_bin: Path, agent_gateway: Gateway, tmp_path: Path) -> None:
    claude = Claude(agent_bin, tmp_path, agent_gateway.url)
    claude("say hi")
    claude("--continue", "and again")
    _check_linked(agent_gateway, "Read")
    first = stored_completions(agent_gateway.state.store)[0]
    assert first.request_json["stream"] is True and "thinking" in first.request_json
