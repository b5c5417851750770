"""Qwen3-Coder (and Qwen3.5+) XML tool calls, inside the same `<tool_call>` blocks as
Hermes:

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

A value is text; its JSON type comes from the request's tool schema as vLLM's `qwen3_xml`
parser gives it (string unless the schema says integer, number, boolean, null, object or
array and the text reads as one; no schema: string). The family's templates read a
replayed call's `arguments` as a mapping and write each value with `|string` (scalars) or
`|tojson` (objects, arrays), so `template_arguments` hands scalars back as their JSON text:
`true` and `3` re-render as the model wrote them, not as Python's `True`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from gateway.toolparse.base import (
    OpenCall,
    arguments_prefix,
    json_object_or_none,
    tool_properties,
)
from gateway.toolparse.hermes import TOOL_CLOSE, TaggedToolFormat, open_block_body

_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>\n?(.*?)</function>\s*", re.DOTALL)
_PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>\s*", re.DOTALL)
_TYPE_PRIORITY = ("null", "integer", "number", "boolean", "object", "array", "string")
_FUNCTION_HEAD = re.compile(r"\s*<function=([^>\n]+)>\n?")


class Qwen3CoderToolFormat(TaggedToolFormat):
    name: ClassVar[str] = "qwen3_coder"
    arguments_as_mapping: ClassVar[bool] = True
    value_ends: ClassVar[tuple[str, ...]] = ("</parameter>", TOOL_CLOSE)

    def parse_block(
        self, block: str, tools: Sequence[Mapping[str, Any]] | None
    ) -> tuple[str, str] | None:
        match = _FUNCTION.fullmatch(block)
        if match is None:
            return None
        name, body = match.group(1).strip(), match.group(2)
        props = tool_properties(tools, name) or {}
        args: dict[str, Any] = {}
        pos = 0
        for param in _PARAM.finditer(body):
            if body[pos : param.start()].strip():
                return None  # stray text between parameters: not this format
            pos = param.end()
            value = param.group(2).removeprefix("\n").removesuffix("\n")
            key = param.group(1).strip()
            args[key] = coerce(value, schema_types(props.get(key)))
        if body[pos:].strip():
            return None
        return name, json.dumps(args, ensure_ascii=False)

    def open_call(
        self, text: str, done: int, tools: Sequence[Mapping[str, Any]] | None
    ) -> OpenCall | None:
        # Streamed a parameter at a time: a value's type is known once it is complete.
        body = open_block_body(text)
        head = None if body is None else _FUNCTION_HEAD.match(text, body)
        if head is None:
            return None
        name = head.group(1).strip()
        props = tool_properties(tools, name) or {}
        args: dict[str, Any] = {}
        pos = head.end()
        for param in _PARAM.finditer(text, pos):
            if text[pos : param.start()].strip():
                break  # stray text: the final parse decides
            pos = param.end()
            value = param.group(2).removeprefix("\n").removesuffix("\n")
            key = param.group(1).strip()
            args[key] = coerce(value, schema_types(props.get(key)))
        return OpenCall(done, None, name, -1, arguments_prefix(args))

    def template_arguments(self, arguments: str) -> Any:
        args = json_object_or_none(arguments)
        if args is None:
            return arguments  # not an object: the template's own error names it
        return {
            k: v if isinstance(v, (str, dict, list)) else json.dumps(v) for k, v in args.items()
        }


def schema_types(schema: Any) -> set[str]:
    """JSON-schema types a property allows (`type`, `enum` values, any/one/allOf)."""
    if not isinstance(schema, Mapping):
        return {"string"}
    types: set[str] = set()
    kind = schema.get("type")
    if isinstance(kind, str):
        types.add(kind)
    elif isinstance(kind, list):
        types.update(t for t in kind if isinstance(t, str))
    for value in schema.get("enum") or ():
        types.add(_json_type(value))
    for key in ("anyOf", "oneOf", "allOf"):
        for sub in schema.get(key) or ():
            types.update(schema_types(sub))
    return types or {"string"}


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    containers: dict[type, str] = {dict: "object", list: "array"}
    return containers.get(type(value), "string")


def coerce(value: str, types: set[str]) -> Any:
    """`value` as the first of `types` it reads as, in vLLM's priority order."""
    for kind in _TYPE_PRIORITY:
        if kind not in types:
            continue
        if kind == "string":
            return value
        if kind == "null" and value.lower() == "null":
            return None
        if kind == "integer":
            try:
                return int(value)
            except ValueError:
                continue
        if kind == "number":
            try:
                number = float(value)
            except ValueError:
                continue
            if math.isfinite(number):
                return int(number) if number == int(number) else number
        if kind == "boolean" and value.strip().lower() in ("true", "1", "false", "0"):
            return value.strip().lower() in ("true", "1")
        if kind in ("object", "array"):
            try:
                parsed = json.loads(value)
            except ValueError:
                continue
            if isinstance(parsed, dict if kind == "object" else list):
                return parsed
    return value
