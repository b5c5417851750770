"""Virtual API keys: generation, hashing and display. Only SHA-256 hashes are stored.

Constant-time comparison matters only for the admin key (compared in plaintext);
virtual keys are looked up by hash, which leaks nothing useful by timing.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import uuid

from areal_service.types import ApiKeyRecord, KeyKind

KEY_PREFIX = "sk-areal-"


def hash_key(plaintext: str) -> str:
    """Hex SHA-256 of a plaintext key: the only form a key is stored in."""
    return hashlib.sha256(plaintext.encode()).hexdigest()


def display_key(plaintext: str) -> str:
    """A recognisable but useless form for lists: `sk-areal-…7sFA`."""
    return f"{plaintext[:9]}…{plaintext[-4:]}"


def admin_key_matches(given: str, admin_key: str) -> bool:
    """Constant-time check of the admin key."""
    return hmac.compare_digest(given.encode(), admin_key.encode())


def new_api_key(
    *, name: str = "", kind: KeyKind = "user", session_id: str | None = None
) -> tuple[str, ApiKeyRecord]:
    """A fresh key: (plaintext shown once, record to store)."""
    plaintext = KEY_PREFIX + secrets.token_urlsafe(24)
    record = ApiKeyRecord(
        id=f"key_{uuid.uuid4().hex[:16]}",
        key_hash=hash_key(plaintext),
        display=display_key(plaintext),
        name=name,
        kind=kind,
        session_id=session_id,
    )
    return plaintext, record
