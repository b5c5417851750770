"""The served model's tokenizer without transformers or torch: `tokenizer.json` through the
Rust `tokenizers` library, set up as transformers 5's `AutoTokenizer.from_pretrained(dir)`
sets it up (added/special tokens from `tokenizer_config.json`, the Qwen classes' rebuilt
pipeline), and the chat template rendered by `gateway/chat_template.py`: the checkpoint's
own, or the one the `engine.chat_template` setting names (a Jinja file, or
`builtin:chatml-tools`, the project's ChatML + `<tool_call>` template; what each supports:
`gateway/chat_template.py`). `ChatTokenizer` adds the hot path's caches, says whether the
template renders tool definitions (`renders_tools`; a warning at load when it does not),
and turns a template's failure to render a request into `ChatTemplateError` (a 400). A
checkpoint this loader cannot reproduce exactly (no `tokenizer.json`, remote code, another
model-specific class) loads through transformers, imported lazily.
"""

from __future__ import annotations

import functools
import json
import logging
import sys
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

from tokenizers import Tokenizer, decoders, models
from tokenizers import pre_tokenizers as pre

from gateway.chat_template import ChatTemplate, load_chat_template, template_setting_text
from gateway.protocol import TEXT_PART_TYPES, InvalidRequestError
from gateway.tokenizer_mirror import (
    CLASS_PIPELINES,
    ClassPipeline,
    clean_up_tokenization,
    loader_choice,
    non_bpe_reason,
    read_json,
    set_up_backend,
)
from gateway.toolparse import THINK_CLOSE, OutputParser, default_parser
from gateway.toolparse.registry import select_parser

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase
    from typing_extensions import TypeIs

log = logging.getLogger(__name__)

PROBE_TOOL_NAME = "areal_probe_tool_4f1c"
"""A tool name no template writes by itself: `renders_tools` looks for it in a render."""


class ChatTemplateError(InvalidRequestError):
    """The chat template raised on a request's conversation (an undefined field, the
    template's own `raise_exception`, an unsupported role...): a 400 naming the cause,
    never a 500. The template's exception is the `__cause__`."""

    def __init__(self, cause: Exception) -> None:
        super().__init__(
            "the model's chat template cannot render this conversation: "
            f"{type(cause).__name__}: {cause}",
            code="chat_template_error",
        )


class TokenizerCore(Protocol):
    """What `ChatTokenizer` needs from a tokenizer. `added_tokens`: id -> content of every
    added (incl. special) token; `byte_level`: pieces are GPT-2 byte-level strings."""

    added_tokens: Mapping[int, str]
    byte_level: bool

    def encode(self, text: str) -> list[int]:
        """Ids of `text`, no special tokens added (special tokens in it still match)."""
        ...

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """`encode` of each text, in one call (the Rust tokenizer runs them in parallel)."""
        ...

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        """Text of ids, special tokens skipped unless not `skip_special` (transformers'
        `skip_special_tokens`)."""
        ...

    def id_to_piece(self, token_id: int) -> str | None:
        """The vocabulary string of one id (None when out of range)."""
        ...

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        *,
        add_generation_prompt: bool = True,
    ) -> str:
        """The chat template's text for `messages` plus (by default) the generation
        prompt."""
        ...


def _is_transformers(
    core: TokenizerCore | PreTrainedTokenizerBase,
) -> TypeIs[PreTrainedTokenizerBase]:
    """A transformers tokenizer (a `TokenizerCore` has no `apply_chat_template`)."""
    return hasattr(core, "apply_chat_template")


class ChatTokenizer:
    """The served model's tokenizer plus the caches the hot path needs.

    Cost per request: the Jinja render is O(all messages) (~0.05 ms for a short chat);
    encoding is O(new text) because the rendered prompt is encoded per `<|im_start|>`
    segment through an LRU: an agent's next turn, a GRPO group's G identical prompts and
    retries only encode what they have not seen. Encoding a segment alone equals encoding
    it in place because special tokens split the input before pre-tokenization; a probe
    at construction checks that and falls back to whole-prompt encoding if not.
    """

    def __init__(
        self,
        core: TokenizerCore | PreTrainedTokenizerBase,
        *,
        cache_bytes: int = 64 * 2**20,
        output_parser: OutputParser | None = None,
    ) -> None:
        # A transformers tokenizer is wrapped: tests compare the two loaders through it.
        self.core: TokenizerCore = TransformersTokenizer(core) if _is_transformers(core) else core
        # Segment text -> its ids as 4-byte unsigned ints (a tuple of Python ints costs
        # ~10x that: 8 bytes a slot plus a 32-byte object per id above 256). Bounded by
        # the bytes held, text and ids (`_entry_bytes`); a segment over an eighth of the
        # bound is never kept (one huge prompt would evict every agent's history).
        self._cache: OrderedDict[str, array[int]] = OrderedDict()
        self._cache_bytes = 0
        self._cache_limit = cache_bytes
        self._lock = threading.Lock()
        self._token_info: dict[int, tuple[str, tuple[int, ...]]] = {}
        self._byte_decoder = _byte_level_decoder() if self.core.byte_level else None
        self._fast_decode = self.core.decode  # bound once: the stream decodes twice a token
        self._skip_special = True
        """Replies are decoded without special tokens, unless the model's parser reads
        markers that are special tokens (`ToolFormat.special_markers`)."""
        self._split_at = (
            "<|im_start|>" if "<|im_start|>" in self.core.added_tokens.values() else None
        )
        if self._split_at and not self._segments_encode_alone():
            self._split_at = None
        self.output_parser: OutputParser = default_parser()
        """This model's tool-call and reasoning format (`use_parser`)."""
        self.think_close_id: int | None = None
        """The one token that ends reasoning (None: none, or more than one token)."""
        self.use_parser(output_parser or self.output_parser)
        self.chars_per_token: int | None = (
            max_chars_per_token(self.core.backend) if isinstance(self.core, RustTokenizer) else None
        )
        """At most this many characters of input per token (None: no such bound for this
        tokenizer): a prompt's length in tokens is at least its characters over this."""
        self.rendered_roles: tuple[str, ...] = (
            self._rendered_roles() if self.chars_per_token else ()
        )
        """Roles whose message text this chat template is seen to render (trimmed at
        most): only their text counts toward `min_prompt_tokens`."""
        self.renders_tools: bool = self._renders_tools()
        """Whether the chat template writes a request's tool definitions into the prompt
        (seen in one render with a probe tool). False: `tools` never reach the model."""

    def use_parser(self, parser: OutputParser) -> None:
        """Parse this model's replies with `parser` (chosen once, at load)."""
        self.output_parser = parser
        self._skip_special = not parser.tools.special_markers
        self._fast_decode = (
            self.core.decode
            if self._skip_special
            else functools.partial(self.core.decode, skip_special=False)
        )
        close = parser.reasoning.close
        close_ids = self.core.encode(close) if close else []
        self.think_close_id = close_ids[0] if len(close_ids) == 1 else None

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        chat_template: str | None = None,
        tool_parser: str | None = None,
        reasoning_parser: str | None = None,
    ) -> ChatTokenizer:
        """Load a checkpoint directory as `AutoTokenizer.from_pretrained(path)` would,
        without transformers where `load_tokenizer_core` can. `chat_template`: the
        `engine.chat_template` setting (a Jinja file or `builtin:<name>`) in place of the
        checkpoint's template; None keeps the checkpoint's. The output parser is chosen
        from the template and `config.json` (`toolparse.registry`), `tool_parser` /
        `reasoning_parser` overriding it. Logs one warning when the template renders no
        tool definitions, and one when it renders tool calls in a format not parsed."""
        path = Path(path)
        tokenizer = cls(load_tokenizer_core(path, chat_template=chat_template))
        template = (
            template_setting_text(chat_template)
            if chat_template is not None
            else load_chat_template(path, read_json(path / "tokenizer_config.json"))
        )
        selection = select_parser(
            template,
            read_json(path / "config.json"),
            renders_tools=tokenizer.renders_tools,
            generation_prompt=tokenizer._generation_prompt(),
            tool_parser=tool_parser,
            reasoning_parser=reasoning_parser,
            source=(
                f"the chat template {chat_template}"
                if chat_template is not None
                else f"the chat template of {path}"
            ),
        )
        tokenizer.use_parser(selection.parser)
        log.info(
            "tool calls and reasoning of %s parsed as %s (%s)",
            path,
            selection.parser.name,
            selection.reason,
        )
        if not tokenizer.renders_tools:
            log.warning(
                "the chat template of %s (%s) does not render tool definitions: `tools` sent "
                "to the gateway will not reach the model. Set engine.chat_template to a "
                "template that renders them, e.g. builtin:chatml-tools (ChatML with "
                "<tool_call> JSON calls) or a Jinja file",
                path,
                chat_template or "the checkpoint's own",
            )
        return tokenizer

    @property
    def hf(self) -> PreTrainedTokenizerBase:
        """The wrapped transformers tokenizer; only when built from one."""
        if isinstance(self.core, TransformersTokenizer):
            return self.core.hf
        raise AttributeError("this ChatTokenizer was loaded without transformers (no .hf)")

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        *,
        add_generation_prompt: bool = True,
    ) -> str:
        """The chat template's text for `messages` (normalized) plus (by default) the
        generation prompt (token continuity renders a prefix without it). Any failure of
        the template raises `ChatTemplateError` (a 400 on every wire API)."""
        if self.output_parser.tools.arguments_as_mapping:
            messages = self._mapping_arguments(messages)
        try:
            return self.core.render(
                messages, tools or None, add_generation_prompt=add_generation_prompt
            )
        except Exception as exc:  # noqa: BLE001 - whatever the template raised: the request's
            raise ChatTemplateError(exc) from exc

    def _generation_prompt(self) -> str:
        """The end of a one-message prompt ("" when the template cannot render one)."""
        try:
            return self.render([{"role": "user", "content": "x"}], None)[-64:]
        except ChatTemplateError:
            return ""

    def _mapping_arguments(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Replayed tool calls with `arguments` as this family's template reads them (a
        mapping, not the API's JSON string); messages without calls pass as they are."""
        to_template = self.output_parser.tools.template_arguments
        out = []
        for m in messages:
            calls = m.get("tool_calls")
            if calls:
                m = {
                    **m,
                    "tool_calls": [
                        {
                            **c,
                            "function": {
                                **c["function"],
                                "arguments": to_template(c["function"]["arguments"]),
                            },
                        }
                        if isinstance(c.get("function", {}).get("arguments"), str)
                        else c
                        for c in calls
                    ],
                }
            out.append(m)
        return out

    def encode(self, text: str) -> list[int]:
        """Ids of rendered prompt text, without adding special tokens (no double BOS)."""
        if self._split_at is None:
            return self.core.encode(text)
        marker = self._split_at
        segments = [marker + s if i else s for i, s in enumerate(text.split(marker))]
        segments = [s for s in segments if s]
        with self._lock:
            found: dict[str, Sequence[int]] = {
                s: self._cache[s] for s in segments if s in self._cache
            }
            for s in found:
                self._cache.move_to_end(s)
        missing = list(dict.fromkeys(s for s in segments if s not in found))
        if missing:  # one batched call: the Rust tokenizer encodes the misses in parallel
            encoded = self.core.encode_batch(missing)
            new = dict(zip(missing, encoded, strict=True))
            found.update(new)
            self._remember(new)
        if len(segments) == 1:
            return list(found[segments[0]])
        return [i for s in segments for i in found[s]]

    @property
    def cache_bytes(self) -> int:
        """Bytes the segment cache holds now (text and ids)."""
        return self._cache_bytes

    def decode(self, ids: Sequence[int]) -> str:
        """Text of generated ids; special tokens (`<|im_end|>`) dropped, markers kept."""
        return self._fast_decode(list(ids))

    def decode_stream(self) -> TextStream:
        """An incremental decoder of one generation: `push(ids)` returns the text those
        ids complete. The Rust `DecodeStream` (O(1) per token, ~1.5 us) where the
        tokenizer is a plain Rust one; else a window re-decode (two decodes a push)."""
        backend = getattr(self.core, "stream_backend", None)
        if backend is not None:
            return _RustTextStream(backend, skip_special=self._skip_special)
        return _WindowTextStream(self)

    def token_info(self, token_id: int) -> tuple[str, tuple[int, ...]]:
        """(display string, exact UTF-8 bytes) of one token, for OpenAI logprobs."""
        info = self._token_info.get(token_id)
        if info is None:
            piece = self.core.id_to_piece(token_id)
            added = self.core.added_tokens.get(token_id)
            if added is not None:
                raw = added.encode()
            elif (
                self._byte_decoder is not None
                and piece is not None
                and all(c in self._byte_decoder for c in piece)
            ):
                raw = bytes(self._byte_decoder[c] for c in piece)
            else:
                raw = self.core.decode([token_id]).encode()
            info = (raw.decode("utf-8", errors="backslashreplace"), tuple(raw))
            self._token_info[token_id] = info
        return info

    def min_prompt_tokens(self, messages: Sequence[Mapping[str, Any]]) -> int:
        """A lower bound on the tokens of the prompt `messages` render to, without
        rendering or tokenizing: the characters of the text of `rendered_roles`
        messages (their ends' whitespace left out: templates may trim; of an assistant
        text, only what follows its last `</think>`) over
        `chars_per_token`, rounded up. 0 when there is no bound. Cost: O(messages), plus
        a copy of a text that has whitespace at its ends (~5 ms for 30 MB)."""
        if not self.chars_per_token:
            return 0
        chars = 0
        for message in messages:
            if message.get("role") not in self.rendered_roles:
                continue
            content = message.get("content")
            if isinstance(content, str):
                if message["role"] == "assistant" and THINK_CLOSE in content:
                    # Reasoning templates (Qwen3) drop a past turn's thinking.
                    content = content.rpartition(THINK_CLOSE)[2]
                chars += len(content.strip())
            elif isinstance(content, list):
                for part in content:
                    text = part.get("text") if isinstance(part, Mapping) else None
                    if isinstance(text, str) and part.get("type") in TEXT_PART_TYPES:
                        if message["role"] == "assistant" and THINK_CLOSE in text:
                            text = text.rpartition(THINK_CLOSE)[2]
                        chars += len(text.strip())
        return -(-chars // self.chars_per_token)

    def _rendered_roles(self) -> tuple[str, ...]:
        """Which of the system, user, assistant and tool messages the template renders
        verbatim: one render of a short conversation with marked texts per role (a
        template that drops or rewrites one, or cannot render it, leaves that role
        out)."""
        call = {"id": "call_0", "type": "function", "function": {"name": "probe", "arguments": {}}}
        marks = {
            role: f"\u27e6{role}-text\u27e7" for role in ("system", "user", "assistant", "tool")
        }
        conversations: dict[str, list[dict[str, Any]]] = {
            "system": [
                {"role": "system", "content": f" {marks['system']} "},
                {"role": "user", "content": "hi"},
            ],
            "user": [
                {"role": "user", "content": f" {marks['user']} "},
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": f" {marks['user']} "},
            ],
            "assistant": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": f" {marks['assistant']} "},
                {"role": "user", "content": "go on"},
            ],
            "tool": [
                {"role": "user", "content": "go"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_0", "content": marks["tool"]},
            ],
        }
        roles = []
        for role, messages in conversations.items():
            try:
                text = self.render(messages, None)
            except Exception:  # a template that cannot render it: that role is out
                continue
            if text.count(marks[role]) == sum(m["role"] == role for m in messages):
                roles.append(role)
        return tuple(roles)

    def _renders_tools(self) -> bool:
        """One render of a one-message chat with a probe tool: does its name appear?"""
        tool = {
            "type": "function",
            "function": {
                "name": PROBE_TOOL_NAME,
                "description": "Probe.",
                "parameters": {"type": "object", "properties": {}},
            },
        }
        try:
            text = self.render([{"role": "user", "content": "hi"}], [tool])
        except ChatTemplateError:
            return False
        return PROBE_TOOL_NAME in text

    def _remember(self, new: Mapping[str, Sequence[int]]) -> None:
        largest = self._cache_limit // 8
        kept = {
            s: array("I", ids) for s, ids in new.items() if _entry_bytes(s, len(ids)) <= largest
        }
        with self._lock:
            for s, ids in kept.items():
                if s not in self._cache:
                    self._cache[s] = ids
                    self._cache_bytes += _entry_bytes(s, len(ids))
            while self._cache_bytes > self._cache_limit and self._cache:
                old, ids = self._cache.popitem(last=False)
                self._cache_bytes -= _entry_bytes(old, len(ids))

    def _segments_encode_alone(self) -> bool:
        probe = (
            "<|im_start|>system\nBe brief. <|im_end|>\n<|im_start|>user\n"
            "  Hi there\n\n<|im_end|>\n\n<|im_start|>assistant\n"
        )
        parts = ["<|im_start|>" + p for p in probe.split("<|im_start|>") if p]
        whole = self.core.encode(probe)
        return whole == [i for p in parts for i in self.core.encode(p)]


def _entry_bytes(text: str, n_ids: int) -> int:
    """What one cache entry holds: the text object, its ids at 4 bytes each, and the
    array and dict-slot overhead (~150 bytes)."""
    return sys.getsizeof(text) + 4 * n_ids + 150


class TextStream(Protocol):
    """Incremental decoding of one generation (`ChatTokenizer.decode_stream`)."""

    def push(self, ids: Sequence[int]) -> str:
        """The text that `ids`, appended, make final (never half a UTF-8 character)."""
        ...


class _RustTextStream:
    """`tokenizers.decoders.DecodeStream`: keeps the ids since the last complete
    character and decodes only those (what vLLM's prefix/read offsets do, in Rust)."""

    def __init__(self, backend: Tokenizer, *, skip_special: bool = True) -> None:
        self._backend = backend
        self._stream = decoders.DecodeStream(skip_special_tokens=skip_special)

    def push(self, ids: Sequence[int]) -> str:
        step, backend = self._stream.step, self._backend
        if len(ids) == 1:
            return step(backend, ids[0]) or ""
        return "".join(step(backend, i) or "" for i in ids)


class _WindowTextStream:
    """The fallback: decodes the ids since the last stable point twice per push (with
    and without the new ones); a trailing U+FFFD (half a character) is held."""

    def __init__(self, tokenizer: ChatTokenizer) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def push(self, ids: Sequence[int]) -> str:
        self._ids.extend(ids)
        prefix_text = self._tok.decode(self._ids[self._prefix : self._read])
        new_text = self._tok.decode(self._ids[self._prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return new_text[len(prefix_text) :]
        return ""


def _byte_level_decoder() -> dict[str, int]:
    """Inverse of GPT-2's byte -> printable-unicode map (byte-level BPE pieces -> bytes)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


# ---------------------------------------------------------------- loading


def load_tokenizer_core(path: str | Path, *, chat_template: str | None = None) -> TokenizerCore:
    """The tokenizer of checkpoint directory `path`, encoding, decoding and rendering as
    transformers' `AutoTokenizer.from_pretrained(path)` does: the Rust loader when the
    class transformers would pick is the generic fast tokenizer or a class whose rebuild
    is reproduced here (`CLASS_PIPELINES`), else transformers itself (imports torch).
    `chat_template`: the `engine.chat_template` setting, replacing the checkpoint's
    template(s) (`template_setting_text`; ValueError when it cannot be read)."""
    path = Path(path)
    template = None if chat_template is None else template_setting_text(chat_template)
    config = read_json(path / "tokenizer_config.json")
    reason, class_name = loader_choice(path, config)
    if reason is not None:
        return TransformersTokenizer.load(path, reason, chat_template=template)
    backend = Tokenizer.from_file(str(path / "tokenizer.json"))
    pipeline = CLASS_PIPELINES.get(class_name or "")
    if pipeline is not None and not isinstance(backend.model, models.BPE):
        return TransformersTokenizer.load(path, non_bpe_reason(class_name), chat_template=template)
    return RustTokenizer.build(backend, path, config, pipeline, chat_template=template)


class RustTokenizer:
    """A `tokenizers.Tokenizer` set up as transformers sets up its backend, plus the chat
    template: encode/decode are the Rust calls transformers' own methods make."""

    def __init__(
        self, backend: Tokenizer, template: ChatTemplate, *, clean_up_spaces: bool = False
    ) -> None:
        self._backend = backend
        self._template = template
        self._clean_up = clean_up_spaces
        self.added_tokens: Mapping[int, str] = {
            i: t.content for i, t in backend.get_added_tokens_decoder().items()
        }
        self.byte_level = isinstance(backend.decoder, decoders.ByteLevel)
        self.stream_backend: Tokenizer | None = None if clean_up_spaces else backend
        """For `DecodeStream` (None when decode post-processes the text in Python)."""

    @property
    def backend(self) -> Tokenizer:
        """The Rust tokenizer (read-only use: `max_chars_per_token`)."""
        return self._backend

    @classmethod
    def build(
        cls,
        backend: Tokenizer,
        path: Path,
        config: Mapping[str, Any],
        pipeline: ClassPipeline | None,
        *,
        chat_template: str | None = None,
    ) -> RustTokenizer:
        """Set up `backend` (loaded from `path/tokenizer.json`) as transformers would
        (`tokenizer_mirror.set_up_backend`). `chat_template`: a template text in place
        of the checkpoint's."""
        named, clean_up = set_up_backend(backend, path, config, pipeline)
        template = ChatTemplate(
            load_chat_template(path, config) if chat_template is None else chat_template, named
        )
        return cls(backend, template, clean_up_spaces=clean_up)

    # `encode_batch_fast` skips offset tracking: the same ids ~30% sooner than `encode`.
    def encode(self, text: str) -> list[int]:
        """Ids of `text`, no special tokens added."""
        return self._backend.encode_batch_fast([text], add_special_tokens=False)[0].ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """`encode` of each text in one parallel call."""
        return [e.ids for e in self._backend.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        """Text of ids, special tokens skipped (unless not `skip_special`)."""
        text = self._backend.decode(ids, skip_special_tokens=skip_special)
        return clean_up_tokenization(text) if self._clean_up else text

    def id_to_piece(self, token_id: int) -> str | None:
        """The vocabulary string of one id."""
        return self._backend.id_to_token(token_id)

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        *,
        add_generation_prompt: bool = True,
    ) -> str:
        """The chat template's text plus (by default) the generation prompt."""
        return self._template.render(messages, tools, add_generation_prompt=add_generation_prompt)


NORMALIZER_SHRINK = {"NFC": 3, "NFKC": 3, "NFD": 1, "NFKD": 1}
"""How many characters a Unicode normalization may turn into one: composition joins at
most three (Hangul L+V+T jamo into a syllable); decomposition never joins. Other
normalizers (Strip, Replace, BERT's clean-up, precompiled maps) may delete text: no bound."""

_COVERING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Split", "Digits", "Punctuation"})
"""Pre-tokenizers that only cut the text (none drops a byte, unless `Removed`)."""


def max_chars_per_token(backend: Tokenizer) -> int | None:
    """Most characters of input one token can stand for, or None when this tokenizer
    gives no such bound. Byte-level BPE covers every byte of its normalized input with
    exactly one token (its vocabulary has all 256 byte symbols; splits drop nothing), a
    vocabulary piece covers as many bytes as it has characters (one per byte), an added
    token its UTF-8 bytes, and a character is at least one byte; normalization may join
    up to `NORMALIZER_SHRINK` characters into one. Whitespace-stripping added tokens
    (`lstrip`/`rstrip`) could swallow any amount of text: no bound. O(vocabulary), once."""
    if not isinstance(backend.model, models.BPE):
        return None
    shrink = _normalizer_shrink(backend.normalizer)
    steps = _pipeline_steps(backend.pre_tokenizer)
    if shrink is None or steps is None or "ByteLevel" not in steps:
        return None
    vocab = backend.get_vocab(with_added_tokens=False)
    if not all(symbol in vocab for symbol in pre.ByteLevel.alphabet()):
        return None  # a byte without a token would be dropped
    added = list(backend.get_added_tokens_decoder().values())
    if any(token.lstrip or token.rstrip for token in added):
        return None
    longest = max([*map(len, vocab), *(len(t.content.encode()) for t in added)])
    return longest * shrink


def _normalizer_shrink(normalizer: Any) -> int | None:
    if normalizer is None:
        return 1
    shrink = 1
    for step in _flatten(json.loads(normalizer.__getstate__()), "normalizers"):
        factor = NORMALIZER_SHRINK.get(step.get("type", ""))
        if factor is None:
            return None
        shrink *= factor
    return shrink


def _pipeline_steps(pre_tokenizer: Any) -> list[str] | None:
    """The pre-tokenizer step types, or None when one of them may drop text."""
    if pre_tokenizer is None:
        return None
    steps = _flatten(json.loads(pre_tokenizer.__getstate__()), "pretokenizers")
    if any(
        step.get("type") not in _COVERING_PRE_TOKENIZERS or step.get("behavior") == "Removed"
        for step in steps
    ):
        return None
    return [step["type"] for step in steps]


def _flatten(config: dict[str, Any], key: str) -> list[dict[str, Any]]:
    """The steps of a (possibly nested) `Sequence` config."""
    if config.get("type") != "Sequence":
        return [config]
    return [step for child in config.get(key, []) for step in _flatten(child, key)]


# ---------------------------------------------------------------- the transformers fallback


class TransformersTokenizer:
    """A transformers tokenizer behind `TokenizerCore`: slow-only checkpoints, and tests
    that compare against transformers. Importing transformers imports torch (~200 MB)."""

    def __init__(self, hf: PreTrainedTokenizerBase) -> None:
        self.hf = hf
        self.added_tokens: Mapping[int, str] = {
            i: t.content for i, t in hf.added_tokens_decoder.items()
        }
        backend = getattr(hf, "backend_tokenizer", None)
        self.byte_level = backend is not None and isinstance(backend.decoder, decoders.ByteLevel)
        # The Rust decoder directly: transformers' wrapper costs ~5x the decode itself.
        # Same text unless clean-up is on.
        self._rust_decode: Callable[..., str] | None = (
            None
            if backend is None or getattr(hf, "clean_up_tokenization_spaces", False)
            else backend.decode
        )
        self.stream_backend: Tokenizer | None = None if self._rust_decode is None else backend

    @classmethod
    def load(
        cls, path: str | Path, reason: str, *, chat_template: str | None = None
    ) -> TransformersTokenizer:
        """`AutoTokenizer.from_pretrained(path)`, transformers imported here;
        `chat_template` (a template text) replaces the checkpoint's."""
        try:
            from transformers import AutoTokenizer
        except ModuleNotFoundError as exc:  # a `[gateway]` install: say what to add, once
            raise RuntimeError(
                f"the tokenizer of {path} needs transformers ({reason}), which is not "
                f"installed: install areal-service[train] (pip install "
                f'"areal-service[train]")'
            ) from exc

        log.info("loading the tokenizer of %s with transformers: %s", path, reason)
        hf = AutoTokenizer.from_pretrained(str(path))
        if chat_template is not None:
            hf.chat_template = chat_template
        return cls(hf)

    # The casts below: transformers types its results for every input shape at once
    # (Any, or str | list[str]); for the one shape passed here they are as annotated.

    def encode(self, text: str) -> list[int]:
        """Ids of `text`, no special tokens added."""
        return cast("list[int]", self.hf.encode(text, add_special_tokens=False))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """`encode` of each text in one call."""
        return cast("list[list[int]]", self.hf(texts, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        """Text of ids, special tokens skipped (unless not `skip_special`)."""
        if self._rust_decode is not None:
            return self._rust_decode(ids, skip_special_tokens=skip_special)
        return cast(str, self.hf.decode(ids, skip_special_tokens=skip_special))

    def id_to_piece(self, token_id: int) -> str | None:
        """The vocabulary string of one id."""
        return cast("str | None", self.hf.convert_ids_to_tokens(token_id))

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        *,
        add_generation_prompt: bool = True,
    ) -> str:
        """`apply_chat_template(..., tokenize=False)`, by default with the generation
        prompt."""
        # ignore: transformers types `tools` as an invariant list of dict | Callable; a
        # list of dicts is what it reads.
        text = self.hf.apply_chat_template(
            messages,
            tools=tools,  # type: ignore[arg-type]
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
        )
        assert isinstance(text, str)
        return text
