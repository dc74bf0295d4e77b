"""Shared test setup: the environment (tests/environment.py, imported before torch), one thread, and the
fixtures the layers share. Helpers live in modules named for what they hold (tests/environment.py,
tests/tiny_models.py, tests/backend_observer.py, ...), imported where used; each layer's own fixtures are in
its conftest.py (tests/fast_path/conftest.py: the backends; tests/tools/conftest.py: training runs)."""

from __future__ import annotations

# First, before torch: importing it sets TRITON_INTERPRET (which torch's import of triton.language reads) and
# the offline hub.
from .environment import require_shared
from .subprocesses import refuse_modules_split_between_workers

# isort: split
import gc

import pytest
import torch

# One thread: on 2 shared cores, small-op recurrences run several times slower with 2 threads.
torch.set_num_threads(1)


@pytest.fixture
def one_thread():
    """One thread for the test (as set above), and the count as it was afterwards: for modules whose tests
    must not inherit a count another test raised (`pytestmark = pytest.mark.usefixtures("one_thread")`)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def shared():
    return require_shared


def pytest_collection_finish(session):
    """What collection left alive (the packages imported, the test modules and items: alive to the end of the
    session) frozen out of the garbage collector's passes. Every full collection walks every object tracked: the
    explicit ones (two at the end of each in-process `gpn train` run, accelerate's `free_memory` and
    loop.end_process_group's own; transformers' test tear-downs) and the automatic ones walked the whole session's
    heap, most of it these objects, and took most of a short in-process run late in the suite. Objects made later,
    by the tests, are collected as before; a frozen object is never freed, and these live to the end anyway."""
    gc.collect()
    gc.freeze()


def pytest_unconfigure(config):
    # (given back to the collector before the interpreter ends, which frees what it holds: triton's nanobind
    # objects left frozen printed leak warnings at exit)
    gc.unfreeze()


def pytest_configure(config):
    # (pytest-xdist's `-n` without `--dist` has made it "load" by now, in its pytest_cmdline_main)
    refuse_modules_split_between_workers(config.getoption("dist", "no"))
    # The marks of transformers' tests/test_modeling_common.py (tests/ecosystem/test_transformers_common.py runs
    # it), registered as transformers' own conftest registers them.
    for mark in ("accelerate_tests", "flash_attn_test", "flash_attn_3_test", "flash_attn_4_test", "torch_compile_test"):
        config.addinivalue_line("markers", f"{mark}: a mark of transformers' common model tests")
