"""transformers' own tokenizer of the checkpoint under test: the reference the gateway's
tokenizer (`ChatTokenizer`, loaded as production loads it, without transformers) is
compared with. The `tok` fixture in conftest.py sets it; test helpers read it here."""

from __future__ import annotations

from typing import Any

_reference: list[Any] = []


def set_reference(tokenizer: Any) -> None:
    _reference[:] = [tokenizer]


def hf() -> Any:
    """The reference tokenizer (a transformers `PreTrainedTokenizerBase`)."""
    assert _reference, "request the `tok` fixture first"
    return _reference[0]
