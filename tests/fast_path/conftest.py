"""The fast path's fixtures: the backend a test runs on (the C memory kernels or the torch ops they replace;
the Triton kernels forced on CPU through Triton's interpreter)."""

from __future__ import annotations

import os

import pytest

from modeling_gpn import triton_kernels as tk

from ..backend_observer import C_KERNELS, C_KERNELS_BACKWARD, ran
from ..environment import TRITON_INTERPRETER_AT_START, require_c_kernels
from .recurrences import KERNEL_MODES


@pytest.fixture(params=KERNEL_MODES)
def memory_kernels(request, monkeypatch):
    """Run with the fused C memory kernels (where they build: a test with them fails unless they ran) and
    with the torch ops they replace (a test with those fails if a kernel ran)."""
    if request.param == "memory-kernels":
        require_c_kernels()
        with ran(C_KERNELS):
            yield request.param
    else:
        monkeypatch.setenv("GPN_MEMORY_KERNELS", "0")
        with ran(not_ran=(C_KERNELS, C_KERNELS_BACKWARD)):
            yield request.param


@pytest.fixture
def triton_on(monkeypatch):
    """The Triton backend forced on CPU tensors through the interpreter (which must have been on when torch
    was imported: tests/environment.py sees to it unless TRITON_INTERPRET=0 was set)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("GPN_TRITON", "1")
    message = None
    if not TRITON_INTERPRETER_AT_START:
        message = "TRITON_INTERPRET was not 1 when torch (and with it triton.language) was imported"
    elif not tk.available():
        message = f"triton unavailable: {tk.unavailable_reason()}"
    if message:
        if os.environ.get("GPN_REQUIRE_TRITON") == "1":
            pytest.fail(message)
        pytest.skip(message)
    assert tk._built_interpreted, "the kernels must run through Triton's interpreter on CPU"
    return tk
