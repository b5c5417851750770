"""`gateway` in sections (auth, limits, sessions, continuity, sampling, router, scale): the
nested keys from every source, and the previous release's flat keys still read from every
source with one deprecation warning per key naming the new path."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from areal_service.config import GatewayConfig, config_from_tree, load_config, save_config
from areal_service.config_errors import ConfigError
from areal_service.config_renames import GATEWAY_MOVED, ConfigDeprecationWarning
from launcher.cli import app

FLAT_YAML = """\
gateway:
  max_request_bytes: 2048
  workers: 3
  admin_key: sk-flat-admin
  auth_free_failures: 9
  token_continuity: false
  session_from: [header]
  sampling: client
  router_url: http://router:1
"""
NESTED_YAML = """\
gateway:
  limits: {max_request_bytes: 2048}
  scale: {workers: 3}
  auth: {admin_key: sk-flat-admin, free_failures: 9}
  continuity: {enabled: false}
  sessions: {sources: [header]}
  sampling: {mode: client}
  router: {url: "http://router:1"}
"""


def _load(path: Path | None = None, overrides: list[str] | None = None) -> tuple[dict, list[str]]:
    """The resolved config as a tree, and every deprecation warning the load raised (the
    "always" filter: a key warned twice would show twice)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = load_config(path, overrides or [])
    tree = config.model_dump(mode="json")
    tree["gateway"]["auth"]["admin_key"] = config.gateway.auth.admin_key.get_secret_value()
    return tree, [str(w.message) for w in caught if w.category is ConfigDeprecationWarning]


def test_flat_yaml_keys_load_with_the_same_values_and_one_warning_each(tmp_path: Path) -> None:
    flat, nested = tmp_path / "flat.yaml", tmp_path / "nested.yaml"
    flat.write_text(FLAT_YAML)
    nested.write_text(NESTED_YAML)
    old, warned = _load(flat)
    new, none = _load(nested)
    assert old == new and none == []
    assert new["gateway"]["limits"]["max_request_bytes"] == 2048
    assert new["gateway"]["sampling"]["mode"] == "client"
    assert sorted(warned) == sorted(
        [
            "gateway.max_request_bytes is deprecated: use gateway.limits.max_request_bytes",
            "gateway.workers is deprecated: use gateway.scale.workers",
            "gateway.admin_key is deprecated: use gateway.auth.admin_key",
            "gateway.auth_free_failures is deprecated: use gateway.auth.free_failures",
            "gateway.token_continuity is deprecated: use gateway.continuity.enabled",
            "gateway.session_from is deprecated: use gateway.sessions.sources",
            "gateway.sampling is deprecated: use gateway.sampling.mode",
            "gateway.router_url is deprecated: use gateway.router.url",
        ]
    )


@pytest.mark.parametrize(
    ("old", "new", "values", "warning"),
    [
        (
            "gateway.max_request_bytes",
            "gateway.limits.max_request_bytes",
            (2048, 4096, 8192),
            "gateway.max_request_bytes is deprecated: use gateway.limits.max_request_bytes",
        ),
        # `trainer.lora` is the default policy's adapter shape now.
        (
            "trainer.lora.rank",
            "default_policy.lora.rank",
            (4, 8, 16),
            "trainer.lora is deprecated: use default_policy.lora",
        ),
    ],
)
def test_a_moved_key_in_several_sources_warns_once(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    old: str,
    new: str,
    values: tuple[int, int, int],
    warning: str,
) -> None:
    section, *rest = old.split(".")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(json.dumps({section: _nested(rest, values[0])}))
    monkeypatch.setenv("AREAL_" + old.upper().replace(".", "__"), str(values[1]))
    tree, warned = _load(cfg, [f"{old}={values[2]}"])
    node: Any = tree
    for part in new.split("."):
        node = node[part]
    assert node == values[2]  # CLI > env > YAML
    assert warned == [warning]


def _nested(parts: list[str], value: object) -> object:
    return value if not parts else {parts[0]: _nested(parts[1:], value)}


def test_flat_and_nested_keys_keep_their_sources_priorities(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A flat key in one source and its new path in another: the higher source wins, as
    if both were spelt the same way."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "gateway:\n  sampling: client\n  limits: {max_request_bytes: 2048}\n  workers: 2\n"
    )
    monkeypatch.setenv("AREAL_GATEWAY__MAX_REQUEST_BYTES", "4096")  # old env over new YAML
    monkeypatch.setenv("AREAL_GATEWAY__SCALE__WORKERS", "5")  # new env over old YAML
    tree, _ = _load(cfg, ["gateway.sampling.mode=training"])  # new CLI over old YAML
    assert tree["gateway"]["limits"]["max_request_bytes"] == 4096
    assert tree["gateway"]["scale"]["workers"] == 5
    assert tree["gateway"]["sampling"]["mode"] == "training"
    tree, _ = _load(None, ["gateway.sampling.mode=training", "gateway.sampling=client"])
    assert tree["gateway"]["sampling"]["mode"] == "client"  # the later --set wins


def test_nested_keys_from_every_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "gateway:\n  limits:\n    max_messages: 77\n  router:\n    backends: [http://a:1]\n"
    )
    monkeypatch.setenv("AREAL_GATEWAY__AUTH__PUBLIC_DOCS", "true")
    tree, warned = _load(
        cfg,
        [
            "gateway.limits.max_request_bytes=4096",
            "gateway.sessions.auto_open=false",
            "gateway.router.backends.0=http://b:2",
        ],
    )
    gw = tree["gateway"]
    assert gw["limits"]["max_messages"] == 77 and gw["limits"]["max_request_bytes"] == 4096
    assert gw["auth"]["public_docs"] is True and gw["sessions"]["auto_open"] is False
    assert gw["router"]["backends"] == ["http://b:2"]
    assert warned == []


def test_an_unknown_nested_key_gets_a_suggestion() -> None:
    with pytest.raises(
        ConfigError,
        match="`gateway.limits.max_request_byte` is not a setting; "
        "did you mean `gateway.limits.max_request_bytes`",
    ):
        load_config(None, ["gateway.limits.max_request_byte=4096"])
    with pytest.raises(ConfigError, match="did you mean `gateway.scale`"):
        load_config(None, ["gateway.scael.workers=2"])
    with pytest.raises(ConfigError, match="did you mean `gateway.limits.max_messages`"):
        load_config(None, ["gateway.max_message=2"])  # a setting one level too high


def test_a_flat_key_and_its_new_path_in_one_source_is_an_error(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("gateway:\n  workers: 2\n  scale: {workers: 3}\n")
    with pytest.raises(
        ConfigError,
        match="gateway.workers and gateway.scale.workers are both set; keep gateway.scale.workers",
    ):
        load_config(cfg)


def test_config_show_prints_the_nested_form() -> None:
    """The CLI names a renamed setting in one plain line on stderr, the JSON on stdout."""
    result = CliRunner().invoke(
        app,
        [
            "config",
            "show",
            "--set",
            "gateway.max_request_bytes=2048",
            "--set",
            "gateway.limits.max_messages=9",
        ],
    )
    assert result.exit_code == 0, result.output
    assert result.stderr == (
        "areal-service: warning: gateway.max_request_bytes is deprecated: "
        "use gateway.limits.max_request_bytes\n"
    )
    shown = json.loads(result.stdout)
    assert shown["gateway"]["limits"]["max_request_bytes"] == 2048
    assert shown["gateway"]["limits"]["max_messages"] == 9
    assert not set(shown["gateway"]) & (set(GATEWAY_MOVED) - {"sampling"})


def test_a_saved_config_reloads_without_warnings(tmp_path: Path) -> None:
    """What a command hands its child processes is already nested: they do not warn."""
    old, _ = _load(None, ["gateway.workers=2", "gateway.admin_key=sk-saved"])
    saved = save_config(
        load_config(None, ["gateway.scale.workers=2", "gateway.auth.admin_key=sk-saved"]),
        tmp_path / "saved.yaml",
    )
    again, warned = _load(saved)
    assert warned == [] and again == old


def test_every_moved_key_names_a_setting_and_left_the_top() -> None:
    for old, new in GATEWAY_MOVED.items():
        section, leaf = new.split(".")
        sub = GatewayConfig.model_fields[section].annotation
        assert leaf in sub.model_fields, f"gateway.{new} (from gateway.{old}) is no setting"
        assert old == section or old not in GatewayConfig.model_fields


def test_a_gateway_built_from_flat_keywords_still_works() -> None:
    with pytest.warns(ConfigDeprecationWarning, match="use gateway.sessions.staleness_gate"):
        gw = GatewayConfig(staleness_gate=True)
    assert gw.sessions.staleness_gate is True


def test_the_old_trainer_lora_key_and_its_new_path_in_one_source_is_an_error() -> None:
    with pytest.raises(ConfigError, match="both set; keep default_policy.lora"):
        config_from_tree({"trainer": {"lora": {}}, "default_policy": {"lora": {}}})
