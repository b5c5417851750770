"""Large prompts rendered and tokenized off the event loop.

Rendering the chat template and tokenizing cost O(text) CPU, about 0.6 s per MB of text
on this project's machine: on the event loop, a 30 MB request would stall every other
request (health checks included) for ~20 s. A conversation with more text than
`gateway.limits.offload_prompt_chars` is prepared on one worker thread instead. The GIL still
serialises Python work, but the interpreter switches threads every
`gil_switch_interval_ms`, so the loop keeps answering (measured: at most ~60 ms of loop
lag while a 10 MB prompt was tokenized). At most `gateway.limits.offload_max_prompts` large
prompts are admitted at once; one more gets 503 `server_busy` with retry-after rather
than an unbounded backlog of multi-MB bodies in memory. Small prompts stay on the loop:
a thread hop would cost them more than it saves.

Before any of that, `refuse_overlong` answers a prompt that is surely too long for the
context with 400 `context_length_exceeded` from its character count alone (the
tokenizer's `min_prompt_tokens`), so a multi-MB prompt for a 32k model costs no render
and no tokenization at all.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from gateway.errors import OpenAIError
from gateway.protocol import InvalidRequestError

if TYPE_CHECKING:
    from gateway.tokenizer import ChatTokenizer

T = TypeVar("T")


def text_chars(items: Iterable[Any], limit: int) -> int:
    """Characters of every string in `items` (messages, tools: nested dicts and lists),
    counted until `limit` is passed (the walk stops there: O(min(size, limit)) work)."""
    total = 0
    stack: list[Any] = list(items)
    while stack and total <= limit:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, Mapping):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return total


def refuse_overlong(
    tokenizer: ChatTokenizer,
    messages: Sequence[Mapping[str, Any]],
    context_length: int,
    *,
    param: str,
) -> None:
    """Raise 400 `context_length_exceeded` when the prompt `messages` render to has at
    least `context_length` tokens by the character bound: the exact check after
    tokenization (`translate.resolve_sampling`) would refuse it too, so nothing it
    accepts is refused here. Costs no render and no tokenization."""
    least = tokenizer.min_prompt_tokens(messages)
    if least >= context_length:
        raise InvalidRequestError(
            f"This model's maximum context length is {context_length} tokens. However, your "
            f"messages resulted in at least {least} tokens. Please reduce the length of the "
            "messages.",
            param=param,
            code="context_length_exceeded",
        )


def server_busy(retry_after_s: int = 1) -> OpenAIError:
    """503 for a large request while the large-prompt worker is saturated."""
    return OpenAIError(
        503,
        "too many large requests are being prepared; retry shortly",
        type="server_error",
        code="server_busy",
        headers={"retry-after": str(retry_after_s)},
    )


def _malloc_trim() -> Callable[[], object] | None:
    """glibc's `malloc_trim(0)` (None elsewhere)."""
    try:
        return functools.partial(ctypes.CDLL("libc.so.6").malloc_trim, 0)
    except (OSError, AttributeError):
        return None


def _then_trim(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)`, then hand the C heap's free memory back to the system. A large
    prompt's transient buffers (its rendered text, the tokenizer's threads' work, the
    id lists: hundreds of MB for 10 MB of text) are freed into malloc arenas that glibc
    keeps otherwise, so each large request would leave the process that much bigger.
    Costs a few ms, once per large prompt, on the worker thread."""
    try:
        return fn(*args)
    finally:
        trim = _malloc_trim()
        if trim is not None:
            trim()


class LargePrompts:
    """One worker thread for large prompts, with a bounded number admitted at once."""

    def __init__(
        self, threshold_chars: int, max_prompts: int, threshold_messages: int = 1_000
    ) -> None:
        self.threshold_chars = threshold_chars
        self.threshold_messages = threshold_messages
        self.max_prompts = max_prompts
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="large-prompt")
        self._admitted = 0  # touched only on the event loop

    def is_large(
        self, messages: Iterable[Any], tools: Iterable[Any] | None, at_most: int | None = None
    ) -> bool:
        """Whether this conversation's text, or its message count, is over the offload
        threshold. `at_most`: a bound on its characters known beforehand (the size of
        the JSON body it was read from: a character takes at least one byte there);
        within the threshold, the walk over every string (~6 µs a small chat) is
        skipped."""
        messages = list(messages)
        if len(messages) > self.threshold_messages:
            return True
        limit = self.threshold_chars
        if at_most is not None and at_most <= limit:
            return False
        return text_chars([messages, list(tools or ())], limit) > limit

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the worker thread; 503 `server_busy` when the bound is reached."""
        if self._admitted >= self.max_prompts:
            raise server_busy()
        self._admitted += 1
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._pool, functools.partial(_then_trim, fn, *args))
        finally:
            self._admitted -= 1

    def close(self) -> None:
        """Stop the worker (queued work is cancelled; a running render finishes)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
