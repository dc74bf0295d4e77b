"""The training tests' fixtures: one token cache per test module, the tinyshakespeare corpus already
tokenized into it, and Accelerate on CPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from modeling_gpn import train as train_module

from ..environment import require_shared
from .train_runs import parse, small_args


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gpn-cache")


@pytest.fixture(scope="module")
def shakespeare(cache) -> Path:
    data = require_shared("data/tinyshakespeare/input.txt")
    # Tokenize once for the whole module, so every run (and subprocess) starts from the cache.
    config = train_module.resolve_config(parse(small_args(data, cache / "prepare", cache)))
    train_module.train(config, prepare_only=True, show_progress=False)
    return data


@pytest.fixture
def accelerate_on_cpu(monkeypatch):
    """ACCELERATE_USE_CPU=1, as a run (and a launch of 2 processes) on a machine without GPUs needs it."""
    monkeypatch.setenv("ACCELERATE_USE_CPU", "1")
