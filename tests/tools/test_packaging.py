"""What `pip install .` ships: a wheel holds only the packages pyproject.toml lists and the package data it
declares, while the tests and CI run an editable install, which imports whatever the source tree holds. A new
subpackage left out of `packages`, or a new preset, recipe, study or task file outside `package-data`, passes
every other test and is missing for a user (`gpn train --recipe NAME`: no such recipe). Read statically from
pyproject.toml and the tree: nothing is built (a wheel takes seconds; the full check of a built wheel in a fresh
environment is CONTRIBUTING.md's, by hand)."""

from __future__ import annotations

import tomllib
from pathlib import Path

from ..environment import REPO_ROOT


def unshipped(root: Path) -> list[str]:
    """The files under the folders pyproject.toml maps to packages that a wheel built from `root` would leave out: a
    module whose folder is not a listed package, a data file no `package-data` pattern of its package matches.
    Empty when the wheel holds the whole tree."""
    settings = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapped = settings.get("package-dir", {})
    owner = {
        (root / mapped.get(package, package.replace(".", "/"))).resolve(): package for package in settings["packages"]
    }
    data = settings.get("package-data", {})
    problems = []
    for path in sorted({path for folder in owner for path in folder.rglob("*") if path.is_file()}):
        name = path.relative_to(root.resolve())
        if any(part.startswith(".") or part == "__pycache__" for part in name.parts):
            continue
        if path.suffix == ".py":
            if path.parent not in owner:
                problems.append(f"{name}: its folder is no package listed in pyproject.toml")
            continue
        # package data belongs to the nearest listed package above it, and ships where one of its patterns matches
        nearest = next(folder for folder in path.parents if folder in owner)
        if not any(path in set(nearest.glob(pattern)) for pattern in data.get(owner[nearest], [])):
            problems.append(f"{name}: no package-data pattern of {owner[nearest]} matches it")
    return problems


def test_the_wheel_ships_every_subpackage_and_data_file_of_the_tree():
    """Every folder of modules under modeling_gpn/, configuration/, conversion/ and eval/ is a listed package, and
    every other file there (presets, recipes, studies, lm-eval tasks, baselines) is declared package data; the
    files the code opens at run time are among them."""
    assert unshipped(REPO_ROOT) == []
    opened = ["configuration/tiny.json", "configuration/recipes/tiny-cpu.json", "configuration/studies/toy.json"]
    opened += ["eval/baselines.json", "eval/tasks/gpn_rolling_ppl.yaml"]
    assert all((REPO_ROOT / name).is_file() for name in opened)
