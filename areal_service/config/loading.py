"""Loading the config tree: sources, lowest to highest priority: field defaults, a YAML
file (`--config`), environment variables (`AREAL_` prefix, `__` between levels, e.g.
`AREAL_GATEWAY__PORT=9000`; `DATABASE_URL` for the store), then CLI overrides
(`--set gateway.port=9000`). Also saving it for child processes, and the admin key in
force."""

from __future__ import annotations

import copy
import logging
import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import SecretStr, ValidationError

from areal_service.admin_key import KEY_FILE, resolve_admin_key
from areal_service.config.service import ServiceConfig
from areal_service.config_errors import ConfigError, config_error, yaml_error
from areal_service.config_renames import move_flat_in_tree, move_flat_override, warn_moved

log = logging.getLogger(__name__)


def _set_path(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """Set `dotted` in `tree`; a numeric part indexes a list already there
    (`eval.datasets.0.limit=5`), any other part names a section (made when missing)."""
    *parents, leaf = dotted.split(".")
    node: Any = tree
    for key in parents:
        if isinstance(node, list):
            node = _list_item(node, key, dotted)
            continue
        node = node.setdefault(key, {})
        if not isinstance(node, dict | list):
            raise ConfigError(f"override {dotted!r}: {key!r} is not a section")
    if isinstance(node, list):
        node[_list_index(node, leaf, dotted)] = value
    else:
        node[leaf] = value


def _list_index(node: list[Any], key: str, dotted: str) -> int:
    if not key.isdigit() or int(key) >= len(node):
        raise ConfigError(
            f"override {dotted!r}: {key!r} is not an index of a list of "
            f"{len(node)} item(s) (0 to {len(node) - 1})"
        )
    return int(key)


def _list_item(node: list[Any], key: str, dotted: str) -> Any:
    item = node[_list_index(node, key, dotted)]
    if not isinstance(item, dict):
        raise ConfigError(f"override {dotted!r}: item {key} is not a section")
    return item


def _override_value(item: str) -> tuple[str, Any]:
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {item!r} must look like section.key=value")
    try:
        return key.strip(), yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError as exc:
        raise yaml_error(f"--set {item}", exc) from None


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """Turn `["a.b=1", "c=x"]` into a nested dict; values are parsed as YAML scalars."""
    tree: dict[str, Any] = {}
    for item in overrides:
        _set_path(tree, *_override_value(item))
    return tree


def apply_overrides(tree: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """`tree` with `--set` overrides applied in order (a copy; `tree` is unchanged).
    Unlike merging `parse_overrides`, a numeric part reaches into a list of the tree."""
    out = copy.deepcopy(tree)
    for item in overrides:
        _set_path(out, *_override_value(item))
    return out


def deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """`base` with `top` merged in, section by section (`top` wins); neither is changed."""
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _env_tree() -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for name, value in os.environ.items():
        if not name.startswith("AREAL_"):
            continue
        dotted = name[6:].lower().replace("__", ".")
        # Only variables naming a section or field of the tree are config; others that
        # share the prefix (AREAL_TEST_POSTGRES_URL, a tool's own settings) are not ours.
        if dotted.split(".")[0] in ServiceConfig.model_fields:
            _set_path(tree, dotted, yaml.safe_load(value))
    if os.environ.get("DATABASE_URL"):
        _set_path(tree, "store.url", os.environ["DATABASE_URL"])
    return tree


def read_config_file(path: Path | str | None) -> dict[str, Any]:
    """The YAML config file as a tree ({} for no file); ConfigError (naming the file,
    line and column) for a syntax error, or unless it holds a mapping at the top level."""
    if path is None:
        return {}
    try:
        with open(path, encoding="utf-8") as f:  # a stream, so YAML errors name the file
            loaded = yaml.safe_load(f) or {}
    except yaml.YAMLError as exc:
        raise yaml_error(path, exc) from None
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc.strerror}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    return loaded


def load_config(
    path: Path | str | None = None, overrides: list[str] | None = None
) -> ServiceConfig:
    """Resolve the config: defaults < YAML file < environment < CLI overrides. The
    default admin key becomes the data dir's generated one only if that exists: creating
    it is for what serves (`with_admin_key`), not for every command that loads a config."""
    return config_from_tree(read_config_file(path), overrides, source=path)


def config_from_tree(
    tree: dict[str, Any],
    overrides: list[str] | None = None,
    *,
    source: Path | str | None = None,
    top_level: tuple[str, ...] = (),
) -> ServiceConfig:
    """`load_config` of a tree already read (e.g. a file whose other sections belong to
    the dataset driver); `source` names that file in errors and `top_level` lists those
    other sections' names. Mistakes raise ConfigError: one line per setting, with the
    closest known name for a misspelt one."""
    # The previous release's flat gateway keys move per source, before the sources merge,
    # so an old key in one source and its new path in another keep their priorities.
    moved: set[str] = set()
    tree = deep_merge(move_flat_in_tree(tree, moved), move_flat_in_tree(_env_tree(), moved))
    tree = apply_overrides(tree, [move_flat_override(o, moved) for o in overrides or []])
    warn_moved(moved)
    try:
        config = ServiceConfig.model_validate(tree)
    except ValidationError as exc:
        raise config_error(exc, ServiceConfig, source, top_level=top_level) from None
    return with_admin_key(config, create=False)


def configure_logging(config: ServiceConfig) -> None:
    """Root logging for a command's process (and each gateway worker): `log_level`, one
    line per record, chatty libraries held at WARNING."""
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for noisy in ("alembic", "httpx", "httpx2", "httpcore", "openai", "aiohttp.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def save_config(config: ServiceConfig, path: Path) -> Path:
    """The resolved config as YAML (secrets included, file mode 0600), for the processes
    a command starts (engine, trainer, gateway workers) to `load_config`."""
    tree = config.model_dump(mode="json")
    tree["gateway"]["auth"]["admin_key"] = config.gateway.auth.admin_key.get_secret_value()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600)
    path.chmod(0o600)  # before the secrets are written
    path.write_text(yaml.safe_dump(tree, sort_keys=False))
    return path


def with_admin_key(
    config: ServiceConfig, *, binding: bool = False, create: bool = True
) -> ServiceConfig:
    """`config` with the admin key in force (`areal_service/admin_key.py`): the shipped
    default becomes the data dir's generated key on loopback (created, 0600, and logged
    once when new; `create=False` only reads an existing one); `binding` refuses the
    default on any other address. Call it (creating) where a gateway is served or started:
    the gateway itself, `serve`, and the demo / driver / eval configs."""
    key, created = resolve_admin_key(
        config.gateway.auth.admin_key.get_secret_value(),
        config.gateway.host,
        config.data_dir,
        binding=binding,
        create=create,
    )
    if created:
        log.warning(
            "generated an admin key for local use: %s (kept in %s, mode 0600; set "
            "gateway.auth.admin_key to use your own)",
            key,
            config.data_dir / KEY_FILE,
        )
    if key == config.gateway.auth.admin_key.get_secret_value():
        return config
    return with_gateway_section(config, "auth", admin_key=SecretStr(key))


def with_gateway_section(config: ServiceConfig, section: str, **values: Any) -> ServiceConfig:
    """`config` with `gateway.<section>.<name>` = value for each of `values` (copies of the
    three models on the way; like `model_copy`, nothing is validated again)."""
    old = getattr(config.gateway, section)
    gateway = config.gateway.model_copy(update={section: old.model_copy(update=values)})
    return config.model_copy(update={"gateway": gateway})
