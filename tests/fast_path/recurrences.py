"""The recurrence problems the fast path's tests share: a random problem (token inputs, a nonzero carried
state, a mask of holes or padding on either side, and the weights of a random linear objective), its run on
the plain or the fast path (outputs, final state and every gradient), and the comparison of two runs."""

from __future__ import annotations

import torch


def run_recurrence(model, fast: bool, token_inputs, state, mask, weights):
    """Outputs and final state of `GPNModel.recurrence` on the chosen path, plus the gradients of a
    random linear function of all of them w.r.t. the parameters, the token inputs and the initial state."""
    core = model.model
    core.use_fast_path = fast
    model.zero_grad(set_to_none=True)
    token_inputs = token_inputs.clone().requires_grad_(True)
    state = tuple(x.clone().requires_grad_(True) for x in state)
    outputs, final, _ = core.recurrence(token_inputs, state, mask)
    objective = (outputs * weights[0]).sum() + sum((x * w).sum() for x, w in zip(final, weights[1:]))
    objective.backward()
    grads = {name: p.grad for name, p in core.named_parameters() if p.grad is not None}
    grads["token_inputs"] = token_inputs.grad
    for name, x in zip(("p0", "g0", "M0"), state):
        grads[name] = x.grad
    return outputs.detach(), tuple(x.detach() for x in final), grads


def random_problem(model, batch: int, length: int, mask_kind: str | None, seed: int):
    generator = torch.Generator().manual_seed(seed)
    config = model.config
    d = config.hidden_size
    token_inputs = torch.randn(batch, length, d, generator=generator)
    state = model.model.zero_state(batch, torch.device("cpu"))
    state = tuple(torch.randn(x.shape, generator=generator) for x in state)  # a nonzero carried state
    mask = None
    if mask_kind == "holes":
        mask = torch.rand(batch, length, generator=generator) > 0.3
    elif mask_kind == "left":
        mask = torch.ones(batch, length, dtype=torch.bool)
        mask[0, : length // 2] = False
    elif mask_kind == "right":  # the last row ends early
        mask = torch.ones(batch, length, dtype=torch.bool)
        mask[-1, length - length // 2 :] = False
    elif mask_kind == "hole":  # padding between real tokens of the last row (length 3 or more)
        mask = torch.ones(batch, length, dtype=torch.bool)
        mask[-1, 1 : length - 1] = False
    outputs_shape = (batch, length, d)
    weights = [torch.randn(outputs_shape, generator=generator)] + [
        torch.randn(x.shape, generator=generator) for x in state
    ]
    return token_inputs, state, mask, weights


def assert_same(plain, fast, atol=2e-5, rtol=2e-4):
    torch.testing.assert_close(fast[0], plain[0], atol=atol, rtol=rtol)
    for a, b in zip(fast[1], plain[1]):
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol)
    assert plain[2].keys() == fast[2].keys()
    for name in plain[2]:
        if plain[2][name] is None or plain[2][name].numel() == 0:  # e.g. the empty memory of a GPN
            assert fast[2][name] is None or not fast[2][name].any(), name
            continue
        scale = plain[2][name].abs().max().clamp_min(1e-6)
        err = (fast[2][name] - plain[2][name]).abs().max() / scale
        assert err < 1e-4, f"gradient of {name} differs by {err:.2e} (relative to its max)"


KERNEL_MODES = ["memory-kernels", "torch-ops"]  # the `memory_kernels` fixture's modes (tests/fast_path/conftest.py)
