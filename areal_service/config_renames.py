"""Keys of the previous releases, still read from every config source with one
deprecation warning per key naming its new path: the flat `gateway` keys
(`gateway.workers` is `gateway.scale.workers`) and the keys moved to another section
(`trainer.lora` is `default_policy.lora`). Each goes one release after its move: delete
its table entry (and, with the last, this module and its calls in `config/`)."""

from __future__ import annotations

import copy
import warnings
from typing import Any

from areal_service.config_errors import ConfigError

GATEWAY_MOVED: dict[str, str] = {
    "admin_key": "auth.admin_key",
    "public_docs": "auth.public_docs",
    "public_metrics": "auth.public_metrics",
    "forwarded_allow_ips": "auth.forwarded_allow_ips",
    "auth_free_failures": "auth.free_failures",
    "auth_backoff_s": "auth.backoff_s",
    "auth_max_backoff_s": "auth.max_backoff_s",
    "auth_throttle_sync_s": "auth.throttle_sync_s",
    "key_usage_interval_s": "auth.key_usage_interval_s",
    "max_request_bytes": "limits.max_request_bytes",
    "control_body_bytes": "limits.control_body_bytes",
    "anonymous_body_bytes": "limits.anonymous_body_bytes",
    "header_timeout_s": "limits.header_timeout_s",
    "body_timeout_s": "limits.body_timeout_s",
    "max_connections": "limits.max_connections",
    "max_anonymous_requests": "limits.max_anonymous_requests",
    "max_n_tokens": "limits.max_n_tokens",
    "max_messages": "limits.max_messages",
    "max_choices_in_flight": "limits.max_choices_in_flight",
    "offload_prompt_chars": "limits.offload_prompt_chars",
    "offload_messages": "limits.offload_messages",
    "offload_max_prompts": "limits.offload_max_prompts",
    "reward_max_abs": "limits.reward_max_abs",
    "key_limits_sync_s": "limits.key_limits_sync_s",
    "auto_session": "sessions.auto_open",
    "session_from": "sessions.sources",
    "session_idle_timeout_s": "sessions.idle_timeout_s",
    "session_sweep_interval_s": "sessions.sweep_interval_s",
    "staleness_gate": "sessions.staleness_gate",
    "admit_wait_s": "sessions.admit_wait_s",
    "token_continuity": "continuity.enabled",
    "token_continuity_cache_mb": "continuity.cache_mb",
    "sampling": "sampling.mode",
    "training_temperature": "sampling.training_temperature",
    "default_max_tokens": "sampling.default_max_tokens",
    "backends": "router.backends",
    "router_url": "router.url",
    "request_timeout_s": "router.request_timeout_s",
    "backend_unavailable_deadline_s": "router.backend_unavailable_deadline_s",
    "health_interval_s": "router.health_interval_s",
    "no_backend_fail_fast_s": "router.no_backend_fail_fast_s",
    "weight_poll_interval_s": "router.weight_poll_interval_s",
    "workers": "scale.workers",
    "replicas": "scale.replicas",
    "leader_lease_s": "scale.leader_lease_s",
    "gil_switch_interval_ms": "scale.gil_switch_interval_ms",
}
"""Flat `gateway` keys of the previous release and where each now lives (relative to
`gateway`)."""


MOVED: dict[str, str] = {"trainer.lora": "default_policy.lora"}
"""Keys moved to another section (`section.key` -> its new dotted path): `trainer.lora`
is the default policy's adapter shape, declared as the named policies' are."""


class ConfigDeprecationWarning(FutureWarning):
    """A setting of the previous release, still accepted; the message names its new path.
    A FutureWarning (shown by default): it is meant for the person writing the config."""


def warn_moved(moved: set[str]) -> None:
    """One ConfigDeprecationWarning per key in `moved`. Python shows a given warning once
    per place it is raised, so a key is named once per process however often configs
    are loaded."""
    for old in sorted(moved):
        # A flat gateway key is noted by its name, a moved key by its dotted path.
        was, now = (
            (old, MOVED[old])
            if old in MOVED
            else (f"gateway.{old}", f"gateway.{GATEWAY_MOVED[old]}")
        )
        warnings.warn(
            f"{was} is deprecated: use {now}",
            ConfigDeprecationWarning,
            stacklevel=3,
        )


def _is_flat(key: str, value: Any) -> bool:
    """Whether `gateway.<key>` = `value` is a flat key of the previous release. `sampling`
    is both the old mode (a string) and the new section (a mapping)."""
    return key in GATEWAY_MOVED and not (key == "sampling" and isinstance(value, dict))


def move_flat_gateway_keys(
    gateway: dict[str, Any], *, warn: bool = False, moved: set[str] | None = None
) -> dict[str, Any]:
    """One source's `gateway` section with the previous release's flat keys moved into
    their sections (a copy; `gateway` is unchanged). Each key moved is added to `moved`,
    and warned about when `warn`. A flat key and its new path in one source: ConfigError,
    as nothing says which was meant."""
    out = copy.deepcopy(gateway)
    found = {key for key, value in gateway.items() if _is_flat(key, value)}
    for old in sorted(found):
        section, leaf = GATEWAY_MOVED[old].split(".")
        value = out.pop(old)  # first: `sampling` is both the old key and its section
        node = out.setdefault(section, {})
        if not isinstance(node, dict):
            raise ConfigError(
                f"gateway.{section} must be a section (it holds "
                f"gateway.{GATEWAY_MOVED[old]} and its neighbours)"
            )
        if leaf in node:
            raise ConfigError(
                f"gateway.{old} and gateway.{GATEWAY_MOVED[old]} are both set; "
                f"keep gateway.{GATEWAY_MOVED[old]}"
            )
        node[leaf] = value
    if moved is not None:
        moved |= found
    if warn:
        warn_moved(found)
    return out


def move_flat_in_tree(tree: dict[str, Any], moved: set[str]) -> dict[str, Any]:
    """One source's whole tree (a file's, the environment's) with its `gateway` section's
    flat keys moved (`move_flat_gateway_keys`) and the keys moved to another section
    (`move_in_tree`); `tree` is unchanged."""
    tree = move_in_tree(tree, moved)
    gateway = tree.get("gateway")
    if not isinstance(gateway, dict):
        return tree
    return {**tree, "gateway": move_flat_gateway_keys(gateway, moved=moved)}


def move_in_tree(tree: dict[str, Any], moved: set[str], *, warn: bool = False) -> dict[str, Any]:
    """`tree` with each key of `MOVED` it holds at its new path (a copy where one moved;
    `tree` is unchanged), added to `moved` and warned about when `warn`. The old key and
    its new path in one source: ConfigError, as nothing says which was meant."""
    found = set()
    out = tree
    for old, new in MOVED.items():
        section, leaf = old.split(".")
        node = tree.get(section)
        if not isinstance(node, dict) or leaf not in node:
            continue
        if out is tree:
            out = copy.deepcopy(tree)
        value = out[section].pop(leaf)
        *parents, last = new.split(".")
        target = out
        for part in parents:
            target = target.setdefault(part, {})
            if not isinstance(target, dict):
                raise ConfigError(f"{part} must be a section (it holds {new})")
        if last in target:
            raise ConfigError(f"{old} and {new} are both set; keep {new}")
        target[last] = value
        found.add(old)
    moved |= found
    if warn:
        warn_moved(found)
    return out


def move_flat_override(item: str, moved: set[str]) -> str:
    """`--set gateway.<old>...=v` as `gateway.<section>.<leaf>...=v`, and a moved key
    (`--set trainer.lora.rank=8`) at its new path (`default_policy.lora.rank=8`)."""
    key, sep, raw = item.partition("=")
    parts = key.strip().split(".")
    for old, new in MOVED.items():
        if parts[:2] == old.split("."):
            moved.add(old)
            return ".".join([new, *parts[2:]]) + sep + raw
    if (
        len(parts) < 2
        or parts[0] != "gateway"
        or parts[1] not in GATEWAY_MOVED
        or (parts[1] == "sampling" and len(parts) > 2)
    ):
        return item
    moved.add(parts[1])
    return ".".join(["gateway", *GATEWAY_MOVED[parts[1]].split("."), *parts[2:]]) + sep + raw
