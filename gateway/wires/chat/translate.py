"""The chat wire's translate in: the request is already in chat form (messages, nested
tools); only the legacy `functions` / `function_call` are rewritten, by the request
model (`ChatCompletionRequest.chat_tools`, `.chat_tool_choice`)."""

from __future__ import annotations

from gateway.pipeline import Conversation
from gateway.wires.chat.protocol import ChatCompletionRequest


def conversation(request: ChatCompletionRequest) -> Conversation:
    """The request's messages (plain dicts), tools and tool choice."""
    return Conversation(request.message_dicts(), request.chat_tools(), request.chat_tool_choice())
