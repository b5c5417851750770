"""Check gateway/tokenizer_mirror.py's transformers-mirroring tables against transformers
releases, without installing them: each release's wheel is downloaded (`pip download
--no-deps`, pip's own configuration and cache) and the tables are read from its source
with `ast`, so one run covers a whole range of versions.

    python scripts/check_tokenizer_tables.py                 # newest patch of every 5.x minor
    python scripts/check_tokenizer_tables.py 5.17.0 5.25.0   # these releases
    python scripts/check_tokenizer_tables.py --newest        # the newest release only

Prints one line per release (`ok`, or what differs) and exits 1 when any differs. When a
new release moves a table, record the change in the version-keyed tables of
gateway/tokenizer_mirror.py (`HUB_CLASS_OVERRIDE_CHANGES`), then run this again over the
range. `tests/unit/test_gateway_tokenizer.py` checks the installed transformers the same
way (it imports it); CI's newest-versions step runs that test against the newest release.
"""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gateway.tokenizer_mirror import (  # noqa: E402 - after the path insert
    CLASS_PIPELINES,
    NAMED_SPECIAL_TOKENS,
    hub_class_overrides,
)

AUTO = "transformers/models/auto/tokenization_auto.py"
QWEN_MODULES = {
    "Qwen2Tokenizer": "transformers/models/qwen2/tokenization_qwen2.py",
    "Qwen3_5Tokenizer": "transformers/models/qwen3_5/tokenization_qwen3_5.py",
}
BASE = "transformers/tokenization_utils_base.py"


def releases(pip: list[str]) -> list[str]:
    """Every transformers 5 release the configured indexes offer, oldest first."""
    out = subprocess.run(
        [*pip, "index", "versions", "transformers"], capture_output=True, text=True, check=True
    ).stdout
    listed = re.search(r"Available versions: (.*)", out)
    if listed is None:
        raise SystemExit(f"cannot read `pip index versions transformers`:\n{out}")
    found = [v.strip() for v in listed.group(1).split(",") if v.strip().startswith("5.")]
    return sorted(found, key=_release)


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version)[:3])


def newest_patches(versions: list[str]) -> list[str]:
    """The newest patch release of each minor version."""
    by_minor: dict[tuple[int, ...], str] = {}
    for version in versions:
        by_minor[_release(version)[:2]] = version
    return list(by_minor.values())


def wheel(pip: list[str], version: str, cache: Path) -> Path:
    subprocess.run(
        [*pip, "download", "-q", "--no-deps", "--only-binary", ":all:", "--dest", str(cache),
         f"transformers=={version}"],
        check=True,
    )  # fmt: skip
    (path,) = cache.glob(f"transformers-{version}-*.whl")
    return path


def _literal(node: ast.expr) -> object:
    """A constant, or the value an `X if is_tokenizers_available() else None` picks."""
    if isinstance(node, ast.IfExp):
        node = node.body
    return ast.literal_eval(node)


def _assigned(tree: ast.Module, name: str) -> ast.expr | None:
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return node.value
    return None


def tables_of(whl: Path) -> dict[str, object]:
    """The release's hub-class overrides, Qwen split regexes and special-token names."""
    with zipfile.ZipFile(whl) as z:
        names = set(z.namelist())

        def tree(name: str) -> ast.Module | None:
            return ast.parse(z.read(name)) if name in names else None

        auto = tree(AUTO)
        assert auto is not None, f"{whl.name} has no {AUTO}"
        mapping_node = _assigned(auto, "TOKENIZER_MAPPING_NAMES")
        assert isinstance(mapping_node, ast.Call) and mapping_node.args
        pairs = mapping_node.args[0]
        assert isinstance(pairs, ast.List | ast.Tuple)
        mapping = {
            _literal(p.elts[0]): _literal(p.elts[1]) for p in pairs.elts if isinstance(p, ast.Tuple)
        }
        incorrect = _assigned(auto, "MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS")
        wrong = set(ast.literal_eval(incorrect)) if incorrect is not None else set()
        regexes = {}
        for cls, module in QWEN_MODULES.items():
            qwen = tree(module)
            node = _assigned(qwen, "PRETOKENIZE_REGEX") if qwen is not None else None
            regexes[cls] = ast.literal_eval(node) if node is not None else None
        base = tree(BASE)
        attrs = _assigned(base, "SPECIAL_TOKENS_ATTRIBUTES") if base is not None else None
    return {
        "hub_class_overrides": {m: mapping.get(m) or "TokenizersBackend" for m in wrong},
        "split_regexes": regexes,
        "special_tokens": ast.literal_eval(attrs) if attrs is not None else None,
    }


def differences(version: str, tables: dict[str, object]) -> list[str]:
    """What the mirror's tables for `version` get wrong about that release."""
    found: list[str] = []
    ours = hub_class_overrides(version)
    theirs = tables["hub_class_overrides"]
    assert isinstance(theirs, dict)
    for model_type in sorted(set(ours) | set(theirs)):
        if ours.get(model_type) != theirs.get(model_type):
            found.append(
                f"hub class of {model_type!r}: ours {ours.get(model_type)}, "
                f"transformers {theirs.get(model_type)}"
            )
    regexes = tables["split_regexes"]
    assert isinstance(regexes, dict)
    for cls, regex in regexes.items():
        if regex is not None and CLASS_PIPELINES[cls].split_regex != regex:
            found.append(f"{cls}.PRETOKENIZE_REGEX differs")
    if tables["special_tokens"] != list(NAMED_SPECIAL_TOKENS):
        found.append(f"SPECIAL_TOKENS_ATTRIBUTES is {tables['special_tokens']}")
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("versions", nargs="*", help="releases to check (default: every minor)")
    parser.add_argument("--newest", action="store_true", help="the newest release only")
    parser.add_argument("--cache", type=Path, help="keep the wheels in this folder")
    args = parser.parse_args()
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    versions = args.versions or releases(pip)
    if args.newest:
        versions = versions[-1:]
    elif not args.versions:
        versions = newest_patches(versions)
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        cache = args.cache or Path(tmp)
        cache.mkdir(parents=True, exist_ok=True)
        for version in versions:
            found = differences(version, tables_of(wheel(pip, version, cache)))
            failed += bool(found)
            sys.stdout.write(f"transformers {version}: {'; '.join(found) or 'ok'}\n")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
