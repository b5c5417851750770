"""Which install extra provides a missing import, so a command run from a partial install
(`pip install "areal-service[gateway]"`: no torch) ends with one line naming the extra to
install instead of a traceback. The extras themselves are defined in pyproject.toml."""

from __future__ import annotations

# Top-level import names -> the extra that installs them (pyproject's optional-dependencies).
EXTRA_OF_MODULE: dict[str, str] = {
    **dict.fromkeys(
        (
            "fastapi",
            "starlette",
            "uvicorn",
            "aiohttp",
            "httptools",
            "tokenizers",
            "jinja2",
            "prometheus_client",
        ),
        "gateway",
    ),
    **dict.fromkeys(
        (
            "torch",
            "transformers",
            "safetensors",
            "tensorboard",
            "gguf",
            "accelerate",
            "peft",
            "openai",
            "agents",
            "math_verify",
        ),
        "train",
    ),
    "psycopg": "postgres",
}


def missing_extra(exc: ModuleNotFoundError) -> str | None:
    """One line naming the extra that provides the module `exc` could not import, or None
    when no extra does (a genuine bug: the caller re-raises it)."""
    top = (exc.name or "").split(".")[0]
    extra = EXTRA_OF_MODULE.get(top)
    if extra is None:
        return None
    return (
        f"this command needs {top}, which is not installed: "
        f'install areal-service[{extra}] (pip install "areal-service[{extra}]")'
    )
