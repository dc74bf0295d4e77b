"""Study files (`configuration/studies/NAME.json`): the shared recipe, the models to compare, the evaluation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

STUDY_DIR_NAME = "studies"


def study_path(name_or_path: str) -> Path:
    """A study file by name (configuration/studies/NAME.json) or path."""
    path = Path(name_or_path)
    if path.suffix == ".json" and path.exists():
        return path
    from modeling_gpn.configuration import PRESET_DIR

    path = PRESET_DIR / STUDY_DIR_NAME / f"{name_or_path}.json"
    if not path.exists():
        available = sorted(p.stem for p in (PRESET_DIR / STUDY_DIR_NAME).glob("*.json"))
        raise ValueError(f"No study named {name_or_path!r}; available: {', '.join(available)}")
    return path


def load_study(name_or_path: str) -> dict[str, Any]:
    study = json.loads(study_path(name_or_path).read_text())
    for key in ("recipe", "models", "eval"):
        if key not in study:
            raise ValueError(f"Study {name_or_path} lacks the {key!r} section")
    return study
