"""Dataset files on disk become driver samples: JSONL, JSON, Parquet, Arrow, an HF
`save_to_disk` folder; prompt columns and templates."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from areal_service.datasets import DatasetConfig, load_samples

ROWS = [
    {"question": "1 + 1?", "answer": "#### 2"},
    {"question": "2 * 3?", "answer": "#### 6", "id": "q-two"},
]


def _write_all(tmp_path):
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS) + "\n")
    (tmp_path / "d.json").write_text(json.dumps(ROWS))
    table = pa.Table.from_pylist([{**r, "id": r.get("id")} for r in ROWS])
    pq.write_table(table, tmp_path / "d.parquet")
    with (
        pa.OSFile(str(tmp_path / "d.arrow"), "wb") as sink,
        pa.ipc.new_file(sink, table.schema) as writer,
    ):
        writer.write_table(table)
    folder = tmp_path / "hf"  # what datasets.save_to_disk writes: stream-format shards
    folder.mkdir()
    with (
        pa.OSFile(str(folder / "data-00000-of-00001.arrow"), "wb") as sink,
        pa.ipc.new_stream(sink, table.schema) as writer,
    ):
        writer.write_table(table)
    return ["d.jsonl", "d.json", "d.parquet", "d.arrow", "hf"]


def test_every_format_gives_the_same_samples(tmp_path):
    for name in _write_all(tmp_path):
        samples = load_samples(DatasetConfig(path=tmp_path / name, name="math"))
        assert [s["messages"] for s in samples] == [
            [{"role": "user", "content": "1 + 1?"}],
            [{"role": "user", "content": "2 * 3?"}],
        ], name
        assert [s["answer"] for s in samples] == ["#### 2", "#### 6"], name
        assert samples[1]["id"] == "q-two" and samples[1]["question"] == "2 * 3?", name
    # a row without an id gets `<name>-<index>` (null ids in columnar files too)
    assert load_samples(DatasetConfig(path=tmp_path / "d.jsonl"))[0]["id"] == "d-0"


def test_messages_prompt_template_system_prompt_and_limit(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"messages": [{"role": "user", "content": "hi"}], "label": "x"},
                {"prompt": "plain", "label": "y"},
                {
                    "prompt": [
                        {"role": "system", "content": "s"},
                        {"role": "user", "content": "u"},
                    ],
                    "label": "z",
                },
            ]
        )
    )
    cfg = DatasetConfig(
        path=path, answer_field="label", system_prompt="be brief", prompt_template="Q: {prompt}"
    )
    a, b, c = load_samples(cfg)
    assert (
        a["messages"]
        == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
        and a["answer"] == "x"
    )
    assert b["messages"][1] == {"role": "user", "content": "Q: plain"}
    assert c["messages"][0] == {"role": "system", "content": "s"} and len(c["messages"]) == 2
    assert len(load_samples(cfg.model_copy(update={"limit": 1}))) == 1


def test_bad_inputs_say_what_is_wrong(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_samples(DatasetConfig(path=tmp_path / "missing.jsonl"))
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unknown dataset format"):
        load_samples(DatasetConfig(path=tmp_path / "x.csv"))
    (tmp_path / "np.jsonl").write_text('{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match="no prompt column"):
        load_samples(DatasetConfig(path=tmp_path / "np.jsonl"))


def test_a_malformed_line_is_named_by_file_and_line(tmp_path):
    """json's own message counted lines within the one line it was given ("line 2 column
    1" for a row on line 6 of the file) and named no file."""
    path = tmp_path / "train.jsonl"
    rows = [json.dumps(r) for r in ROWS]
    path.write_text("\n".join([*rows, "", rows[0], '{"question": "5" "answer": "5"}']) + "\n")
    with pytest.raises(ValueError) as bad:
        load_samples(DatasetConfig(path=path))
    assert str(bad.value) == (
        f"{path}, line 5: not valid JSON: Expecting ',' delimiter (column 18)"
    )
    path.write_text(rows[0] + "\n" + '{"question": "5", "answer": "5"\n')  # cut short
    with pytest.raises(ValueError) as cut:
        load_samples(DatasetConfig(path=path))
    assert str(cut.value) == f"{path}, line 2: not valid JSON: Expecting ',' delimiter (column 32)"
    path.write_text(rows[0] + "\n[1, 2]\n")
    with pytest.raises(ValueError, match=r"line 2: a JSONL dataset row must be a JSON object"):
        load_samples(DatasetConfig(path=path))
    (tmp_path / "d.json").write_text('[\n  {"question": "1"},\n  {"question": "2"\n]\n')
    with pytest.raises(ValueError) as array:
        load_samples(DatasetConfig(path=tmp_path / "d.json"))
    assert str(array.value) == (
        f"{tmp_path / 'd.json'}, line 4: not valid JSON: Expecting ',' delimiter (column 1)"
    )
