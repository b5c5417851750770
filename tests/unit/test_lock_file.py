"""constraints.txt, the lock file the README and CI install with, stays in step with
pyproject.toml: every requirement of `.[dev]` (extras followed) is pinned once, to a
version its range allows, with the CPU torch's plain release and nothing of CUDA's. A
dependency added or re-ranged without `scripts/lock_deps.sh` fails here, not on a fresh
machine."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "areal-service"


def _pins() -> dict[str, Version]:
    pins: dict[str, Version] = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        assert re.fullmatch(r"[A-Za-z0-9._-]+==[^\s;]+", line), f"not a plain pin: {line!r}"
        name, version = line.split("==")
        assert canonicalize_name(name) not in pins, f"pinned twice: {name}"
        pins[canonicalize_name(name)] = Version(version)
    return pins


def _dev_requirements() -> list[Requirement]:
    """`.[dev]`'s requirements, the project's own extras expanded."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras: dict[str, list[str]] = project["optional-dependencies"]
    found, todo, seen = [Requirement(r) for r in project["dependencies"]], ["dev"], set()
    while todo:
        extra = todo.pop()
        seen.add(extra)
        for req in map(Requirement, extras[extra]):
            if canonicalize_name(req.name) == PROJECT:
                todo += [e for e in req.extras if e not in seen]
            else:
                found.append(req)
    return found


def test_every_dev_requirement_is_pinned_within_its_range() -> None:
    pins = _pins()
    for req in _dev_requirements():
        name = canonicalize_name(req.name)
        assert name in pins, f"{req} is not in constraints.txt: run scripts/lock_deps.sh"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"constraints.txt pins {name}=={pins[name]}, outside pyproject's {req}: "
            "run scripts/lock_deps.sh"
        )


def test_the_lock_holds_the_cpu_torch_and_not_the_project() -> None:
    pins = _pins()
    assert pins["torch"] == Version("2.13.0")  # README's and CI's; no `+cpu`: GPU indexes match
    assert not [n for n in pins if n.startswith("nvidia-")]  # the CUDA build's packages
    assert PROJECT not in pins
