"""A checkpoint's chat template, found and rendered as transformers 5 finds and renders it
(`chat_template.jinja`, `additional_chat_templates/`, `tokenizer_config.json`; the sandboxed
jinja2 environment of `apply_chat_template(..., tokenize=False)`), without importing
transformers. Pure text: no tokens, no HTTP.

`engine.chat_template` replaces the checkpoint's template(s) (`template_setting_text`): a
path to a Jinja file, or a built-in (`BUILTIN_TEMPLATES`). What each one supports:

- the checkpoint's own (the default): whatever its authors wrote. Many small chat models'
  templates (SmolLM2's ChatML one, for instance) render no `tools`, so tool definitions
  never reach the model (the gateway warns at start-up: `ChatTokenizer.renders_tools`), and
  some cannot render an assistant turn that has only tool calls, or a role they do not know.
- `builtin:chatml-tools` (`engine/chat_template.jinja`, the project's tiny model's own):
  ChatML (`<|im_start|>role ... <|im_end|>`) with Qwen2.5/Hermes-style tools: the tool
  list in the system turn, assistant calls as `<tool_call>{"name", "arguments"}</tool_call>`
  (the form `gateway/toolparse/hermes.py` parses back), `<think>` reasoning, tool results as
  `<tool_response>` in a user turn; system/developer, user, assistant and tool messages.
  Fits any ChatML checkpoint whose tokenizer has `<|im_start|>`/`<|im_end|>` (Qwen2.5,
  SmolLM2, ...); a model not trained on this tool format still has to learn it.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

if TYPE_CHECKING:
    import jinja2.parser

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

BUILTIN_PREFIX = "builtin:"
BUILTIN_TEMPLATES = {"chatml-tools": ("engine", "chat_template.jinja")}
"""`builtin:<name>` values of `engine.chat_template`: (package, file) of the template. The
file is package data read by path, not imported: the gateway imports no peer package, and
`engine/` ships in the same distribution."""


def template_setting_text(setting: str) -> str:
    """The template text `engine.chat_template` names: `builtin:<name>`, or a path to a
    Jinja file (`~` expanded). ValueError naming the setting when it cannot be read."""
    if setting.startswith(BUILTIN_PREFIX):
        name = setting[len(BUILTIN_PREFIX) :]
        if name not in BUILTIN_TEMPLATES:
            known = ", ".join(BUILTIN_PREFIX + n for n in sorted(BUILTIN_TEMPLATES))
            raise ValueError(
                f"engine.chat_template: unknown built-in template {setting!r} "
                f"(known: {known}; or give a path to a Jinja file)"
            )
        package, file = BUILTIN_TEMPLATES[name]
        path = Path(__file__).resolve().parents[1] / package / file
    else:
        path = Path(setting).expanduser()
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(
            f"engine.chat_template: cannot read the template file {str(path)!r} "
            f"({exc.strerror or exc})"
        ) from exc


def load_chat_template(path: str | Path, config: Mapping[str, Any]) -> str | dict[str, str] | None:
    """The checkpoint's template(s): `chat_template.jinja` (default) and
    `additional_chat_templates/*.jinja` (named) win over tokenizer_config's `chat_template`,
    a string or a list of {name, template}. One default template comes back as a string."""
    path = Path(path)
    files: dict[str, str] = {}
    if (path / "chat_template.jinja").is_file():
        files["default"] = (path / "chat_template.jinja").read_text(encoding="utf-8")
    extra_dir = path / "additional_chat_templates"
    if extra_dir.is_dir():
        for f in sorted(extra_dir.glob("*.jinja")):
            files[f.name.removesuffix(".jinja")] = f.read_text(encoding="utf-8")
    if files:
        return files["default"] if list(files) == ["default"] else files
    template = config.get("chat_template")
    if isinstance(template, list):
        return {t["name"]: t["template"] for t in template}
    return template


class ChatTemplate:
    """A checkpoint's chat template(s), compiled once. `render` equals transformers'
    `apply_chat_template(messages, tools=tools, add_generation_prompt=...,
    tokenize=False)`: None-valued message keys dropped, inputs rebuilt as plain data,
    reasoning aliased, the named special tokens (`bos_token`, ...) passed as variables;
    with several named templates, `tool_use` is chosen when tools are given, else `default`."""

    def __init__(
        self, template: str | Mapping[str, str] | None, special_tokens: Mapping[str, str]
    ) -> None:
        if isinstance(template, Mapping):
            self._named = {name: _compile(t) for name, t in template.items()}
            self._single = None
        else:
            self._named = {}
            self._single = None if template is None else _compile(template)
        self._special = _plain(dict(special_tokens))
        sources = template.values() if isinstance(template, Mapping) else [template or ""]
        # A template that reads the clock renders differently over time: never memoized.
        self._memo = None if any("strftime_now" in t for t in sources) else RenderMemo()

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        *,
        add_generation_prompt: bool = True,
    ) -> str:
        """The text of one conversation; `tools` are JSON-schema dicts (or None)."""
        template = self._select(tools is not None)
        if not messages:
            raise ValueError("Cannot apply chat template to an empty conversation.")
        if tools is not None and not all(isinstance(t, Mapping) for t in tools):
            raise ValueError("Tools should be JSON-schema dicts.")
        chat = _alias_reasoning(
            _plain([{k: v for k, v in m.items() if v is not None} for m in messages])
        )
        plain_tools = _plain(tools)
        memo = self._memo
        if memo is None:
            return template.render(
                messages=chat,
                tools=plain_tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self._special,
            )
        # After `_plain` the inputs are plain data, whose repr is exact (types, order,
        # float digits): equal keys render equal text with a template that has no clock.
        key = f"{add_generation_prompt}{chat!r}{plain_tools!r}"
        text = memo.get(key)
        if text is None:
            text = template.render(
                messages=chat,
                tools=plain_tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self._special,
            )
            memo.put(key, text)
        return text

    @property
    def memo_hits(self) -> int:
        """Renders answered from the memo so far (0 when the template reads the clock)."""
        return 0 if self._memo is None else self._memo.hits

    def _select(self, with_tools: bool) -> jinja2.Template:
        if self._single is not None:
            return self._single
        if with_tools and "tool_use" in self._named:
            return self._named["tool_use"]
        if "default" in self._named:
            return self._named["default"]
        if not self._named:
            raise ValueError("The tokenizer has no chat template (chat_template is not set).")
        raise ValueError(
            f"This model has multiple chat templates and no default: {sorted(self._named)}"
        )


class RenderMemo:
    """The last renders' texts by their inputs (oldest out first, `max_chars` of keys and
    texts in all; a conversation over `max_entry_chars` is not kept). A Jinja render of
    a short chat costs ~70 us; the same prompt comes back often (a GRPO group sends one
    prompt to each of its episodes; agents resend one system prompt and tool list). Safe
    from several threads (large prompts render off the event loop)."""

    def __init__(self, max_chars: int = 4 << 20, max_entry_chars: int = 64 << 10) -> None:
        self._max_chars = max_chars
        self._max_entry_chars = max_entry_chars
        self._texts: dict[str, str] = {}
        self._chars = 0
        self._lock = threading.Lock()
        self.hits = 0

    def get(self, key: str) -> str | None:
        """The text rendered for `key`, or None."""
        text = self._texts.get(key)
        if text is not None:
            self.hits += 1
        return text

    def put(self, key: str, text: str) -> None:
        """Keep `text` for `key`, dropping the oldest entries past the budget."""
        size = len(key) + len(text)
        if size > self._max_entry_chars:
            return
        with self._lock:
            if key in self._texts:
                return
            self._texts[key] = text
            self._chars += size
            while self._chars > self._max_chars:
                oldest = next(iter(self._texts))
                self._chars -= len(oldest) + len(self._texts.pop(oldest))


# The environment below mirrors transformers' `_cached_compile_jinja_template`.


def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(template)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`, transformers' assistant-mask marker:
    renders its body unchanged (no masks are computed here)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes; transformers replaces it with plain json.dumps.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:  # noqa: A002 - templates call it by this name
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict` inside templates: builds dicts, exposes nothing else."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace()` rejecting underscore attributes (no path to CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Namespace's own trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                "Chat templates cannot store underscore-prefixed attributes on a namespace, "
                f"but got {name!r}."
            )


def _plain(value: Any) -> Any:
    """What a template may see, rebuilt from plain data as transformers'
    `_plain_template_data` rebuilds it: str/int/float subclasses reduced to the base type,
    pydantic models dumped, anything else a `<TypeName>` placeholder."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _alias_reasoning(chat: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Fill `reasoning_content` (and `thinking`, which gpt-oss templates read) from
    whichever reasoning field a message carries, in transformers' key order."""
    out = []
    for message in chat:
        reasoning = next(
            (message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None
        )
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out
