"""The fast path's dispatcher (`fast_recurrence.choose_backends`): it chooses the backends once per window,
from the window's inputs, records them in `model.model.last_recurrence_backends`, and that is what runs.
"""

from __future__ import annotations

import logging

import pytest
import torch

from modeling_gpn import fast_recurrence as fr

from ..backend_observer import FAST_PATH, TRITON, ran
from ..environment import require_c_kernels
from ..tiny_models import perturbed_model, tiny_config
from .recurrences import assert_same, random_problem, run_recurrence
from .triton_launches import launches


def test_the_cpu_window_records_its_backends_and_the_plain_path_none(memory_kernels):
    model = perturbed_model(tiny_config(), seed=4).train()
    problem = random_problem(model, batch=2, length=3, mask_kind="holes", seed=5)
    core = model.model
    plain = run_recurrence(model, False, *problem)
    assert core.last_recurrence_backends is None
    fast = run_recurrence(model, True, *problem)
    memory = fr.C_KERNELS if memory_kernels == "memory-kernels" else fr.TORCH_OPS
    assert core.last_recurrence_backends == fr.Backends(fr.TORCH_OPS, fr.TORCH_OPS, memory, None)
    assert_same(plain, fast)
    with torch.no_grad():
        core.recurrence(*problem[:3])
    # no backward to run; a no-grad window of a few rows runs the whole step on the C step kernels
    step = fr.C_STEP if memory_kernels == "memory-kernels" else fr.TORCH_OPS
    assert core.last_recurrence_backends == fr.Backends(step, None, memory, None)
    # and a plain window after a fast one records none (the first plain run above found the class default)
    core.use_fast_path = False
    with torch.no_grad():
        core.recurrence(*problem[:3])
    assert core.last_recurrence_backends is None


def test_the_c_kernels_are_chosen_once_per_window_not_per_step(monkeypatch):
    """The memory backend of a CPU window is asked for once (it was asked in every step, both ways)."""
    from modeling_gpn import memory_kernels

    if not memory_kernels.available():
        pytest.skip(f"memory kernels unavailable: {memory_kernels.unavailable_reason()}")
    model = perturbed_model(tiny_config(), seed=6).train()
    problem = random_problem(model, batch=2, length=5, mask_kind=None, seed=7)
    asked = []
    real_usable = fr.memory_kernels_usable
    monkeypatch.setattr(fr, "memory_kernels_usable", lambda *tensors: asked.append(1) or real_usable(*tensors))
    run_recurrence(model, True, *problem)
    assert model.model.last_recurrence_backends == fr.Backends(fr.TORCH_OPS, fr.TORCH_OPS, fr.C_KERNELS, None)
    assert len(asked) == 1, f"asked {len(asked)} times for a window of 5 steps"


def test_the_triton_backward_is_chosen_once_per_window_not_per_step(triton_on, monkeypatch):
    """No backward step re-checks its ten or so tensors (`usable_step_backward`, once asked every step): the
    dispatcher chose the Triton backward for the whole window, and every step ran on it."""
    from modeling_gpn import triton_kernels as tk

    model = perturbed_model(tiny_config(), seed=6).train()
    problem = random_problem(model, batch=2, length=5, mask_kind="holes", seed=7)
    asked = []
    real_usable = tk.usable_step_backward
    monkeypatch.setattr(tk, "usable_step_backward", lambda *args: asked.append(1) or real_usable(*args))
    _, n = launches(lambda: run_recurrence(model, True, *problem))
    assert model.model.last_recurrence_backends == fr.Backends(fr.TRITON, fr.TRITON, fr.TRITON, None)
    assert n["ground"] == 5 and n["ground_gate_backward"] == 5
    assert not asked, f"asked {len(asked)} times"


def test_a_strided_gradient_from_autograd_keeps_every_backward_step_on_the_triton_kernels(triton_on):
    """Autograd may hand the window a non-contiguous gradient of the final memory (here a column-major one);
    the dispatcher makes the carried gradients contiguous once, so the backend chosen for the window takes
    every backward step (before, the first one fell back to the torch ops), with the plain path's result."""
    model = perturbed_model(tiny_config(), seed=8).train()
    token_inputs, state, mask, weights = random_problem(model, batch=2, length=4, mask_kind=None, seed=9)
    column_major = weights[3].transpose(2, 3).contiguous().transpose(2, 3)
    results = {}
    for fast in (False, True):
        model.model.use_fast_path = fast
        model.zero_grad(set_to_none=True)
        leaves = [token_inputs.clone().requires_grad_(True), *(x.clone().requires_grad_(True) for x in state)]

        def loss_and_backward():
            outputs, (p, g, memory), _ = model.model.recurrence(leaves[0], tuple(leaves[1:]), mask)  # noqa: B023 (called in this iteration)
            loss = (outputs * weights[0]).sum() + (memory * column_major).sum()  # dL/dM is column-major too
            loss.backward()
            return loss.detach()

        loss, n = launches(loss_and_backward)
        results[fast] = (loss, [x.grad for x in leaves], n)
    (plain_loss, plain_grads, _), (fast_loss, fast_grads, n) = results[False], results[True]
    assert n["ground_gate_backward"] == 4  # every backward step on the kernels
    torch.testing.assert_close(fast_loss, plain_loss, atol=1e-5, rtol=1e-5)
    for got, expected in zip(fast_grads, plain_grads):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


def test_a_window_whose_sizes_the_triton_kernels_do_not_take_says_why(triton_on, caplog):
    """Sizes past the kernels' limits (a key dimension above `MAX_KEY_BLOCK`) keep the window on the torch ops
    and the dispatcher says why, naming the size and the limit: in `last_recurrence_backends.triton_refused`
    and in an info line logged once (not once per window); the window computes what the plain loop computes."""
    from modeling_gpn import triton_kernels as tk

    key_dim = tk.MAX_KEY_BLOCK + 1
    config = tiny_config(num_memory_heads=1, memory_key_dim=key_dim, memory_value_dim=2)
    model = perturbed_model(config, seed=12).train()
    problem = random_problem(model, batch=1, length=2, mask_kind=None, seed=13)
    plain = run_recurrence(model, False, *problem)
    caplog.set_level(logging.INFO, logger=fr.__name__)
    with ran(FAST_PATH, not_ran=(TRITON,)):
        fast = run_recurrence(model, True, *problem)
        run_recurrence(model, True, *problem)
    backends = model.model.last_recurrence_backends
    assert backends[:2] == (fr.TORCH_OPS, fr.TORCH_OPS) and backends.memory != fr.TRITON
    assert f"key dimension {key_dim} is outside the kernels' 1 to {tk.MAX_KEY_BLOCK}" in backends.triton_refused
    assert [r.getMessage() for r in caplog.records if "Triton" in r.getMessage()] == [f"GPN: {backends.triton_refused}"]
    assert_same(plain, fast)


@pytest.mark.parametrize("setting", ["0", None])
def test_triton_is_never_chosen_where_it_is_off(monkeypatch, setting):
    """GPN_TRITON=0, or CPU tensors without the interpreter forced: no part of the window on Triton."""
    if setting is None:
        monkeypatch.delenv("GPN_TRITON", raising=False)
    else:
        monkeypatch.setenv("GPN_TRITON", setting)
    model = perturbed_model(tiny_config(), seed=10)
    with torch.no_grad():
        model.model.recurrence(*random_problem(model, batch=2, length=2, mask_kind=None, seed=11)[:3])
    assert fr.TRITON not in model.model.last_recurrence_backends


def test_each_fast_path_setting_turns_its_backend_off_and_changes_nothing_else(triton_on):
    """The settings users may touch (`use_c_kernels`, `use_triton`, `use_cuda_graphs`, on the model): each one
    off takes its backend out of the dispatcher's choice, and the window computes the same."""
    require_c_kernels()
    from modeling_gpn import cuda_graphs

    model = perturbed_model(tiny_config(), seed=8).eval()
    core = model.model
    ids = torch.randint(0, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        on_triton = model(ids).logits  # (the fixture forces Triton through its interpreter on CPU)
        assert core.last_recurrence_backends.step == fr.TRITON
        core.use_triton = False
        on_c_kernels = model(ids).logits
        assert core.last_recurrence_backends == fr.Backends(fr.C_STEP, None, fr.C_KERNELS, None)
        core.use_c_kernels = False
        on_torch_ops = model(ids).logits
        assert core.last_recurrence_backends == fr.Backends(fr.TORCH_OPS, None, fr.TORCH_OPS, None)
    torch.testing.assert_close(on_c_kernels, on_triton, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(on_torch_ops, on_triton, rtol=1e-4, atol=1e-5)
    # CUDA graphs: opt-in, for every window or ("inference") for the no-grad ones only
    assert not cuda_graphs.asked(core) and not cuda_graphs.asked(core, training=True)
    core.use_cuda_graphs = "inference"
    assert cuda_graphs.asked(core) and not cuda_graphs.asked(core, training=True)
    core.use_cuda_graphs = True
    assert cuda_graphs.asked(core) and cuda_graphs.asked(core, training=True)


def test_tensors_on_another_device_get_the_torch_ops_never_a_kernel(monkeypatch):
    """mps, xpu or meta tensors (a Mac's GPU, an Intel GPU, a model built without memory): neither the C kernels
    (which read CPU memory) nor Triton (CUDA) are chosen for them, even with both forced on; `meta` stands in for
    the devices this machine lacks (the choice reads only the device type)."""
    from modeling_gpn import memory_kernels, triton_kernels

    monkeypatch.setenv("GPN_TRITON", "1")
    monkeypatch.setattr(memory_kernels, "available", lambda: True)  # (as if built: only the device may refuse)
    monkeypatch.setattr(triton_kernels, "available", lambda: True)
    M, U = torch.empty(4, 3, 5, device="meta"), torch.empty(2, 7, 8, device="meta")
    assert not triton_kernels.selected(M, U) and not memory_kernels.usable(M, U)
    assert fr.memory_backend(M, U) == fr.TORCH_OPS
    s = fr.Shapes(batch=2, hidden=8, inter=8, heads=1, key_dim=3, value_dim=5, layers=1, memory=True)
    assert not fr.step_kernels_fit(U, s, False, None, False)
