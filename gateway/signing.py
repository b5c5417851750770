"""Signed opaque values handed to clients and read back: Anthropic `thinking` block
signatures and Responses `reasoning.encrypted_content` (Codex sends `store: false` and
replays the reasoning it was given as `encrypted_content`).

The value is the reasoning text itself (base64 of UTF-8) plus an HMAC-SHA256 tag under a
key derived from the gateway's admin key, so a client cannot slip text into the prompt
as if the policy had generated it, and every replica of one deployment accepts what
another issued. Not encryption: the text was already sent to the client in clear.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import hmac

_CONTEXT = b"areal-service reasoning v1"


class Signer:
    """HMAC signing under a key derived from `secret` (the admin key)."""

    def __init__(self, secret: str) -> None:
        self._key = hmac.new(secret.encode(), _CONTEXT, hashlib.sha256).digest()

    def sign(self, text: str) -> str:
        """The tag of `text` (urlsafe base64, no padding)."""
        tag = hmac.new(self._key, text.encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(tag).decode().rstrip("=")

    def verify(self, text: str, signature: str) -> bool:
        return hmac.compare_digest(self.sign(text), signature)

    def seal(self, text: str) -> str:
        """`text` as an opaque token: base64(text) "." tag."""
        body = base64.urlsafe_b64encode(text.encode()).decode()
        return f"{body}.{self.sign(text)}"

    def open(self, token: str) -> str | None:
        """The text sealed in `token`, or None when it is malformed or its tag is wrong."""
        body, dot, tag = token.rpartition(".")
        if not dot:
            return None
        try:
            text = base64.urlsafe_b64decode(body.encode()).decode()
        except (binascii.Error, ValueError):
            return None
        return text if self.verify(text, tag) else None


@functools.lru_cache(maxsize=8)
def signer_for(secret: str) -> Signer:
    """The `Signer` of `secret`, built once (a key derivation per request is avoidable)."""
    return Signer(secret)
