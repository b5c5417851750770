"""GLM-4.5 / 4.6 / 4.7 tool calls: `<tool_call>` blocks holding the function name and
key/value tags,

    <tool_call>NAME
    <arg_key>KEY</arg_key>
    <arg_value>VALUE</arg_value>
    </tool_call>

(GLM-4.7 writes them without the newlines). A value is text typed by the request's tool
schema, as for Qwen3-Coder and as vLLM's `glm45` parser types it. The family's templates
read a replayed call's `arguments` as a mapping and write non-string values with
`tojson`, so the JSON values are handed back as they are.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from gateway.toolparse.base import OpenCall, arguments_prefix, tool_properties
from gateway.toolparse.hermes import TOOL_CLOSE, TaggedToolFormat, open_block_body
from gateway.toolparse.qwen3_coder import coerce, schema_types

_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>\s*", re.DOTALL)


class GlmToolFormat(TaggedToolFormat):
    name: ClassVar[str] = "glm45"
    arguments_as_mapping: ClassVar[bool] = True
    value_ends: ClassVar[tuple[str, ...]] = ("</arg_value>", TOOL_CLOSE)

    def open_call(
        self, text: str, done: int, tools: Sequence[Mapping[str, Any]] | None
    ) -> OpenCall | None:
        # Streamed a key/value pair at a time: a value's type is known once it is complete.
        body = open_block_body(text)
        if body is None:
            return None
        tag = text.find("<arg_key>", body)
        name = "" if tag < 0 else text[body:tag].strip()
        if not name or any(c.isspace() for c in name) or "<" in name:
            return None  # the name is known once its first key starts
        props = tool_properties(tools, name) or {}
        args: dict[str, Any] = {}
        pos = tag
        for match in _ARG.finditer(text, tag):
            if match.start() != pos:
                break  # stray text: the final parse decides
            args[match.group(1).strip()] = coerce(
                match.group(2), schema_types(props.get(match.group(1).strip()))
            )
            pos = match.end()
        return OpenCall(done, None, name, -1, arguments_prefix(args))

    def parse_block(
        self, block: str, tools: Sequence[Mapping[str, Any]] | None
    ) -> tuple[str, str] | None:
        head, tag, _ = block.partition("<arg_key>")
        name = head.strip()
        if not name or any(c.isspace() for c in name) or "<" in name:
            return None
        props = tool_properties(tools, name) or {}
        args: dict[str, Any] = {}
        pos = len(head)
        if tag:
            for match in _ARG.finditer(block, pos):
                if match.start() != pos:
                    return None  # stray text between the tags: not this format
                key = match.group(1).strip()
                args[key] = coerce(match.group(2), schema_types(props.get(key)))
                pos = match.end()
        if block[pos:].strip():
            return None
        return name, json.dumps(args, ensure_ascii=False)
