"""The documentation tells the truth about the code it is generated from or points at:
the configuration reference is current, the README stays a front door, and its links
and the examples' READMEs resolve. (Links between pages under docs/ are checked by
`mkdocs build --strict` in CI.)"""

from __future__ import annotations

import re
import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_config_reference_is_current():
    # docs/config.md is rendered from areal_service/config/'s field docstrings; a
    # setting added, removed or re-documented without re-rendering fails here.
    render = runpy.run_path(str(ROOT / "scripts" / "config_reference.py"))["render"]
    assert (ROOT / "docs" / "config.md").read_text() == render(), (
        "docs/config.md is stale: run `python scripts/config_reference.py`"
    )


def test_readme_is_a_front_door():
    lines = README.splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines (at most 250)"
    first_screen = "\n".join(lines[:60])
    assert "## Set-up: two commands" in first_screen
    assert ".venv/bin/areal-service demo" in first_screen
    assert ".venv/bin/python -m pytest\n" in first_screen
    assert "docs/architecture.md" in README
    assert "mkdocs serve" in README


def _relative_targets(markdown: str) -> list[str]:
    targets = re.findall(r"\]\(([^)\s]+)\)", markdown)
    return [
        t.split("#", 1)[0]
        for t in targets
        if not t.startswith(("http://", "https://", "#", "mailto:"))
    ]


def test_readme_and_example_links_resolve():
    pages = [ROOT / "README.md", *sorted((ROOT / "examples").glob("*/README.md"))]
    for page in pages:
        for target in _relative_targets(page.read_text()):
            assert (page.parent / target).exists(), f"{page.relative_to(ROOT)}: {target}"


def test_every_example_has_a_readme():
    for folder in sorted((ROOT / "examples").iterdir()):
        if folder.is_dir() and not folder.name.startswith(("_", ".")):
            assert (folder / "README.md").is_file(), f"{folder.name} has no README.md"
