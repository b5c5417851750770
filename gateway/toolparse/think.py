"""`<think>...</think>` reasoning at the start of a reply (Qwen3, QwQ, DeepSeek-R1 style,
and the project's ChatML template). It inverts the templates' assistant turn
`<think>\\n{reasoning}\\n</think>\\n\\n{content}`: only a leading block counts, and the
separators it adds are not part of reasoning or content, so a replayed reply re-renders
to the generated text.

Templates whose generation prompt already opens the block (Qwen3 thinking-2507,
DeepSeek-R1's later templates: `...assistant\\n<think>\\n`) get `PromptOpenedThink`: the
reply starts inside reasoning and `</think>` ends it; a reply cut off before `</think>` is
all reasoning (as vLLM's `qwen3` parser reads it)."""

from __future__ import annotations

from typing import ClassVar

from gateway.toolparse.base import ReasoningFormat, held_suffix, is_proper_prefix

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class ThinkReasoning(ReasoningFormat):
    name: ClassVar[str] = "think"
    open: ClassVar[str] = THINK_OPEN
    close: ClassVar[str] = THINK_CLOSE

    def split(self, text: str, final: bool) -> tuple[str | None, str] | None:
        opening, closing = self.open, self.close
        if not text.startswith(opening):
            if not final and is_proper_prefix(text, opening):
                return None
            return None, text
        close = text.find(closing, len(opening))
        body = text[len(opening) :] if close < 0 else text[len(opening) : close]
        body = body.removeprefix("\n")
        if close < 0:
            if not final:
                body = body[: len(body) - held_suffix(body, ("\n" + closing, closing))]
            return body or None, ""
        rest = text[close + len(closing) :]
        if not final and rest in ("", "\n"):
            rest = ""  # cannot tell yet whether the "\n\n" separator follows
        else:
            rest = rest.removeprefix("\n\n")
        return body.removesuffix("\n") or None, rest

    def pending(self, text: str) -> bool:
        return text.startswith(self.open) or self.open.startswith(text)


class MistralThink(ThinkReasoning):
    """Magistral's `[THINK]...[/THINK]` block (special tokens), leading the reply."""

    name: ClassVar[str] = "mistral"
    open: ClassVar[str] = "[THINK]"
    close: ClassVar[str] = "[/THINK]"


class PromptOpenedThink(ThinkReasoning):
    """The generation prompt ends with `<think>`: the reply opens inside the block."""

    name: ClassVar[str] = "think(opened by the prompt)"

    def split(self, text: str, final: bool) -> tuple[str | None, str] | None:
        if not final and is_proper_prefix(text, self.open):
            return None  # the model may be repeating the opening: hold it
        return super().split(self.open + text.removeprefix(self.open), final)

    def pending(self, text: str) -> bool:
        return True


class GlmThink(ThinkReasoning):
    """GLM-4.5+'s block: its template writes an assistant turn as `\\n<think>R</think>`
    then `\\n` + content (or `\\n<tool_call>`), with no newlines inside the block, and an
    empty block for turns whose reasoning it drops. The reply starts after the
    generation prompt `<|assistant|>`, so with that leading "\\n"; a block without it
    (as vLLM's `glm45` corpus writes it) reads the same."""

    name: ClassVar[str] = "glm"

    def split(self, text: str, final: bool) -> tuple[str | None, str] | None:
        if not final and text in ("", "\n"):
            return None  # a block may still open
        body = text[1:] if text.startswith("\n") else text
        if not body.startswith(THINK_OPEN):
            if not final and is_proper_prefix(body, THINK_OPEN):
                return None
            return None, text
        close = body.find(THINK_CLOSE, len(THINK_OPEN))
        if close < 0:
            reasoning = body[len(THINK_OPEN) :]
            if not final:
                reasoning = reasoning[: len(reasoning) - held_suffix(reasoning, (THINK_CLOSE,))]
            return reasoning or None, ""
        rest = body[close + len(THINK_CLOSE) :]
        if not final and rest == "":
            return body[len(THINK_OPEN) : close] or None, ""
        return body[len(THINK_OPEN) : close] or None, rest.removeprefix("\n")

    def pending(self, text: str) -> bool:
        body = text[1:] if text.startswith("\n") else text
        return text == "" or body.startswith(THINK_OPEN) or THINK_OPEN.startswith(body)
