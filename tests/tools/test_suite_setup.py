"""The suite's own setup: it writes no cache of the user's (tests/environment.py): every cache a library or gpn keeps
under the home folder by default is, for the tests and the processes they launch, a folder under the temporary one;
and it runs each test module in one pytest-xdist worker, or refuses to start (tests/conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from ..subprocesses import refuse_modules_split_between_workers

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_the_caches_the_suite_writes_are_under_the_temporary_folder_not_the_users_home():
    import datasets.config
    import huggingface_hub.constants
    from transformers.utils import HF_MODULES_CACHE

    from modeling_gpn.data import default_cache_dir

    # (the datasets library's lock files under ~/.cache/huggingface/datasets were seen after a run, as were
    # trust_remote_code's module copies, gpn's token shards, the C kernels and Triton's sm_90 builds)
    caches = {
        "datasets": datasets.config.HF_DATASETS_CACHE,
        "hub": huggingface_hub.constants.HF_HUB_CACHE,
        "modules": HF_MODULES_CACHE,
        "gpn": default_cache_dir(),
        "kernels": os.environ.get("GPN_KERNEL_CACHE"),
        "triton": os.environ.get("TRITON_CACHE_DIR"),
        "matplotlib": os.environ.get("MPLCONFIGDIR"),
    }
    temporary = Path(tempfile.gettempdir()).resolve()
    for name, folder in caches.items():
        assert folder is not None, name
        assert temporary in Path(folder).resolve().parents, (name, folder)


def test_two_workers_that_may_split_a_module_are_refused_before_any_test():
    # (a real pytest with the suite's own conftest, `-n 2` alone: pytest-xdist's default then is `--dist load`, which
    # splits a module between workers, whose module fixtures would both start its background processes,
    # `tests/subprocesses.py`)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", __file__ + "::test_nothing"],
        cwd=REPO_ROOT,
        env={name: value for name, value in os.environ.items() if name != "PYTEST_ADDOPTS"},  # (the options above only)
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == pytest.ExitCode.USAGE_ERROR, run.stdout + run.stderr
    assert "--dist load may split a test module between workers" in run.stderr
    assert "--dist loadfile" in run.stderr


@pytest.mark.parametrize("dist", ["load", "loadscope", "worksteal", "each"])
def test_every_distribution_that_may_split_modules_is_refused(dist):
    with pytest.raises(pytest.UsageError, match=f"--dist {dist} may split a test module"):
        refuse_modules_split_between_workers(dist)
    refuse_modules_split_between_workers("loadfile")
    refuse_modules_split_between_workers("no")


def test_nothing():
    """(what the refused run above is asked to run)"""
