"""Study files (`configuration/studies/NAME.json`): the shared recipe, the models to compare, the evaluation."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

STUDY_DIR_NAME = "studies"


class StudyError(ValueError):
    """A study that cannot be run as asked: no such study, a file that is not a study, no model selected."""


class EvaluationError(RuntimeError):
    """A trained model of the study that could not be evaluated (the Hub unreachable, a data file without the column
    a task reads): its training is kept, and the same command evaluates it once that is mended."""

    def __init__(self, name: str, folder: Path, error: BaseException) -> None:
        reason = error.args[0] if isinstance(error, KeyError) and error.args else error
        super().__init__(f"model {name} is trained ({folder}), but its evaluation failed: {reason}")


class StoppedAfterModel(Exception):
    """SIGTERM or SIGINT arrived in a model's last training step or its final phase: that model finished and is
    kept, and the study stops there instead of going on to the next."""

    def __init__(self, signum: int, name: str) -> None:
        self.signum, self.name = signum, name
        super().__init__(f"stopped by {signal.Signals(signum).name} once model {name} had finished training")


def study_path(name_or_path: str) -> Path:
    """A study file by name (configuration/studies/NAME.json) or path."""
    path = Path(name_or_path)
    if path.suffix == ".json" and path.exists():
        return path
    from modeling_gpn.configuration import PRESET_DIR

    path = PRESET_DIR / STUDY_DIR_NAME / f"{name_or_path}.json"
    if not path.exists():
        available = sorted(p.stem for p in (PRESET_DIR / STUDY_DIR_NAME).glob("*.json"))
        raise StudyError(f"No study named {name_or_path!r}; available: {', '.join(available)}")
    return path


def load_study(name_or_path: str) -> dict[str, Any]:
    """The study `name_or_path` names (configuration/studies/NAME.json or a path), checked."""
    path = study_path(name_or_path)
    try:
        study = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise StudyError(f"Cannot read the study {path}: {error}") from None
    if not isinstance(study, dict):
        raise StudyError(f"The study {path} is not a JSON object")
    for key in ("recipe", "models", "eval"):
        if key not in study:
            raise StudyError(f"Study {name_or_path} lacks the {key!r} section")
    return study
