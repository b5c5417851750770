"""Datasets for the dataset driver and evaluation (torch-free).

Reads a file or folder on disk into a list of samples, each a plain dict holding the
row's own fields plus three the driver relies on:

- `messages`: the chat to send (a `messages` column; else a `prompt` column, a string
  becoming one user message; else `question`, GSM8K's column), optionally through
  `prompt_template` (`str.format` over the row) and after a `system_prompt`;
- `answer`: the reference (`answer_field`), or None;
- `id`: the row's `id` column, else `<name>-<row index>`.

Formats: JSONL (`.jsonl`), a JSON array (`.json`), Parquet (`.parquet`, via pyarrow),
Arrow IPC (`.arrow`, file or stream format, as HF `datasets` writes them), and a folder
written by HF `datasets.save_to_disk` (with `datasets` when it is installed, else its
Arrow shards are read with pyarrow). Rows are read whole into memory: the driver shuffles
and indexes them, and eval sets are small.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

DatasetFormat = Literal["auto", "jsonl", "json", "parquet", "arrow", "hf"]


class DatasetConfig(BaseModel):
    """One dataset: where it is and how its rows become chats and answers."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    path: Path
    """File (.jsonl, .json, .parquet, .arrow) or folder (HF `save_to_disk`)."""
    name: str | None = None
    """Label in progress lines and eval tables. None: the file name without suffix."""
    format: DatasetFormat = "auto"
    """`auto` picks by suffix (a folder is `hf`)."""
    prompt_field: str | None = None
    """Column holding the chat or prompt. None: `messages`, else `prompt`, else `question`."""
    answer_field: str = "answer"
    """Column holding the reference answer."""
    prompt_template: str | None = None
    """`str.format` template over the row's columns for the user message, e.g.
    `"{question}\\nGive the final answer after ####."`. Ignored for `messages` rows."""
    system_prompt: str | None = None
    """A system message put before every chat that has none."""
    limit: int | None = Field(None, ge=1)
    """Use only the first `limit` rows."""

    def label(self) -> str:
        """The dataset's name for tables and logs."""
        return self.name or self.path.name.split(".")[0]


def load_samples(config: DatasetConfig) -> list[dict[str, Any]]:
    """The dataset's samples (see the module docstring), in file order."""
    rows = read_rows(config.path, config.format)
    if config.limit is not None:
        rows = rows[: config.limit]
    label = config.label()
    return [to_sample(row, index, config, label) for index, row in enumerate(rows)]


def read_rows(path: Path, fmt: DatasetFormat = "auto") -> list[dict[str, Any]]:
    """Every row of the file or folder at `path` as a dict."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"dataset {path} does not exist")
    if fmt == "auto":
        fmt = _format_of(path)
    if fmt == "jsonl":
        return _read_jsonl(path)
    if fmt == "json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"{path}, line {exc.lineno}: not valid JSON: {exc.msg} (column {exc.colno})"
            ) from None
        if not isinstance(data, list):
            raise ValueError(f"{path}: a .json dataset must hold a list of rows")
        return data
    if fmt == "parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if fmt == "arrow":
        return _read_arrow(path)
    return _read_hf_folder(path)


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    """One object per non-blank line; a bad line is named by its file and its line number
    in the file (json's own "line 2 column 1" counts within the one line it was given)."""
    rows = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                column = exc.colno if exc.lineno == 1 else len(line.rstrip("\r\n")) + 1
                raise ValueError(
                    f"{path}, line {number}: not valid JSON: {exc.msg} (column {column})"
                ) from None
            if not isinstance(row, dict):
                raise ValueError(
                    f"{path}, line {number}: a JSONL dataset row must be a JSON object, "
                    f"not {type(row).__name__}"
                )
            rows.append(row)
    return rows


def _format_of(path: Path) -> DatasetFormat:
    if path.is_dir():
        return "hf"
    suffix = path.suffix.lower()
    formats: dict[str, DatasetFormat] = {
        ".jsonl": "jsonl",
        ".json": "json",
        ".parquet": "parquet",
        ".arrow": "arrow",
    }
    if suffix not in formats:
        raise ValueError(
            f"{path}: unknown dataset format {suffix!r} (use .jsonl, .json, "
            ".parquet, .arrow or an HF save_to_disk folder, or set format)"
        )
    return formats[suffix]


def _read_arrow(path: Path) -> list[dict[str, Any]]:
    import pyarrow as pa

    with pa.memory_map(str(path)) as source:
        try:
            table = pa.ipc.open_file(source).read_all()
        except pa.ArrowInvalid:  # HF datasets writes the stream format
            source.seek(0)
            table = pa.ipc.open_stream(source).read_all()
    return table.to_pylist()


def _read_hf_folder(path: Path) -> list[dict[str, Any]]:
    try:
        import datasets  # optional: only to read what it wrote
    except ImportError:
        shards = sorted(path.glob("*.arrow"))
        if not shards:
            raise ValueError(
                f"{path}: no .arrow shards (is it a `save_to_disk` folder of one split?)"
            ) from None
        return [row for shard in shards for row in _read_arrow(shard)]
    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        raise ValueError(
            f"{path} holds several splits ({', '.join(loaded)}); point `path` at one split's folder"
        )
    return list(loaded)


def to_sample(row: dict[str, Any], index: int, config: DatasetConfig, label: str) -> dict[str, Any]:
    """One row as a driver sample: the row's fields plus `messages`, `answer`, `id`."""
    sample = dict(row)
    sample["messages"] = _messages(row, config)
    answer = row.get(config.answer_field)
    sample["answer"] = None if answer is None else str(answer)
    sample["id"] = str(row.get("id", f"{label}-{index}"))
    return sample


def _messages(row: dict[str, Any], config: DatasetConfig) -> list[dict[str, Any]]:
    field = config.prompt_field or next(
        (f for f in ("messages", "prompt", "question") if f in row), None
    )
    if field is None or field not in row:
        raise ValueError(
            f"row has no prompt column ({config.prompt_field or 'messages, prompt or question'}); "
            f"its columns: {sorted(row)}"
        )
    value = row[field]
    if isinstance(value, list):
        messages = [dict(m) for m in value]
    else:
        text = config.prompt_template.format(**row) if config.prompt_template else str(value)
        messages = [{"role": "user", "content": text}]
    if config.system_prompt and not any(m.get("role") == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": config.system_prompt})
    return messages
