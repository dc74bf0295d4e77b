"""Presets: plain JSON model configurations (installed as `modeling_gpn.configuration`).

Each `*.json` here loads with `GPNConfig.from_json_file(path)` or `GPNConfig.from_pretrained(path)`;
the `_comment` field says where each size comes from. `preset_path("tiny")` finds one by name.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from modeling_gpn.configuration_gpn import GPNConfig

PRESET_DIR = Path(__file__).resolve().parent


def list_presets() -> list[str]:
    """Names of the presets shipped with the package."""
    return sorted(path.stem for path in PRESET_DIR.glob("*.json"))


def preset_path(name_or_path: str) -> Path:
    """Path of a preset given its name (e.g. "gpn-m-1l-130m") or a path to a JSON file."""
    candidate = Path(name_or_path)
    if candidate.suffix == ".json" and candidate.exists():
        return candidate
    path = PRESET_DIR / f"{name_or_path}.json"
    if not path.exists():
        raise FileNotFoundError(f"No preset named {name_or_path!r}; available: {', '.join(list_presets())}")
    return path


def load_preset(name_or_path: str) -> GPNConfig:
    """The `GPNConfig` of a model preset."""
    from modeling_gpn import GPNConfig

    path = preset_path(name_or_path)
    values = json.loads(path.read_text())
    if not isinstance(values, dict):  # (a list or a number failed inside GPNConfig(**values) with a TypeError)
        raise ValueError(f"{path} holds a JSON {type(values).__name__}, not an object of config values")
    config = GPNConfig.from_json_file(str(path))
    # Another model's config (a Llama's config.json) loads as a GPNConfig too, every size it does not share
    # left at the defaults: refused, or a default GPN would pass for it.
    declared = values.get("model_type", GPNConfig.model_type)
    if declared != GPNConfig.model_type:
        raise ValueError(f"{path} is the config of a {declared!r} model, not a GPN ({GPNConfig.model_type!r})")
    if hasattr(config, "_comment"):  # documentation of the preset, not part of the model
        del config._comment
    return config
