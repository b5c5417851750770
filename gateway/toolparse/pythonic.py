"""Llama 4's pythonic tool calls: the whole reply is a Python list of calls with keyword
arguments, `[get_weather(city="Paris", days=3), search(query="rain")]`, optionally
between `<|python_start|>` and `<|python_end|>` (special tokens: replies are decoded
keeping them). Values are Python (or JSON-style `true`/`false`/`null`) literals; the
arguments become their JSON object, as vLLM's `llama4_pythonic` gives them.

As for Llama 3's JSON calls, a reply is a call only when it is nothing but the call list,
so the calls come with the last streamed delta; the family's templates read a replayed
call's `arguments` as a mapping.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from gateway.toolparse.base import ToolCall, ToolFormat, tool_call_id

PY_START, PY_END = "<|python_start|>", "<|python_end|>"
_JSON_NAMES = {"true": True, "false": False, "null": None}


class PythonicToolFormat(ToolFormat):
    name: ClassVar[str] = "llama4_pythonic"
    special_markers: ClassVar[bool] = True
    arguments_as_mapping: ClassVar[bool] = True

    def split(
        self, text: str, final: bool, id_seed: str, tools: Sequence[Mapping[str, Any]] | None
    ) -> tuple[str, tuple[ToolCall, ...]]:
        head = text.lstrip()
        if not (head.startswith(("[", PY_START)) or PY_START.startswith(head)):
            return text, ()
        if not final:
            return "", ()  # a call list, or content that starts like one: known at the end
        calls = _calls(head, id_seed)
        return ("", calls) if calls else (text, ())

    def plain_prefix(self, text: str, scan: int) -> tuple[str, int] | None:
        if scan > 0:
            return text, scan  # decided: the reply did not start with a call
        head = text.lstrip()
        if not head or PY_START.startswith(head):
            return "", 0  # undecided: held
        if head.startswith(("[", PY_START)):
            return None
        return text, 1


def _calls(text: str, id_seed: str) -> tuple[ToolCall, ...]:
    """The calls of a reply that is only a call list, else ()."""
    body = text.strip()
    if body.startswith(PY_START):
        body = body[len(PY_START) :].removesuffix(PY_END).strip()
    if not body.startswith("["):
        return ()
    try:
        tree = ast.parse(body, mode="eval").body
    except (SyntaxError, ValueError):
        return ()
    if not isinstance(tree, ast.List) or not tree.elts:
        return ()
    calls: list[ToolCall] = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or node.args:
            return ()
        name = _dotted(node.func)
        try:
            args = {kw.arg: _literal(kw.value) for kw in node.keywords}
        except ValueError:
            return ()
        if name is None or None in args:
            return ()
        calls.append(
            ToolCall(tool_call_id(id_seed, len(calls)), name, json.dumps(args, ensure_ascii=False))
        )
    return tuple(calls)


def _dotted(node: ast.expr) -> str | None:
    """`a.b.c` of a call target made of names and attributes, else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _literal(node: ast.expr) -> Any:
    """A JSON value from a literal node; ValueError for anything else (names other than
    true/false/null, calls, operators)."""
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.Dict):
        if any(not isinstance(k, ast.Constant) or not isinstance(k.value, str) for k in node.keys):
            raise ValueError("dict keys must be strings")
        return {k.value: _literal(v) for k, v in zip(node.keys, node.values, strict=True)}  # type: ignore[union-attr]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        value = _literal(node.operand)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -value
        raise ValueError("not a number")
    if isinstance(node, ast.Constant) and (
        node.value is None or isinstance(node.value, (str, int, float, bool))
    ):
        return node.value
    raise ValueError("not a literal")
