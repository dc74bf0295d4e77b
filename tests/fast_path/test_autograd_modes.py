"""Autograd modes the fast path's kernels cannot honour: forward-mode AD (which propagates tangents under `no_grad`
too) and torch.func's transforms (whose tensors are wrappers without storage). The C kernels and the custom
autograd Function would drop tangents in silence or fail obscurely, so these modes run the plain path and the
torch ops (`fast_recurrence.autograd_mode_blocker`): each test compares with the plain path's result and shows
which ran (`tests/backend_observer.py`)."""

from __future__ import annotations

import contextlib

import torch
import torch.autograd.forward_ad as fwAD
from torch.func import functional_call

from ..backend_observer import C_PRODUCTS, DECODE_CALLS, FAST_PATH, PLAIN_PATH, ran
from ..environment import require_c_kernels
from ..tiny_models import perturbed_model, tiny_config


def tiny_model():
    return perturbed_model(tiny_config(), seed=41).eval()


def on_path(model, fast: bool):
    model.model.use_fast_path = fast
    return model


def test_forward_ad_under_no_grad_carries_the_plain_paths_tangents():
    """Dual inputs_embeds under no_grad: the kernels (the step's and the few-row products') once returned the
    primal alone, the logits without a tangent."""
    require_c_kernels()
    model = tiny_model()
    embeds = torch.randn(2, 3, model.config.embedding_size, generator=torch.Generator().manual_seed(1))
    direction = torch.randn_like(embeds)

    def tangent(fast: bool):
        with torch.no_grad(), fwAD.dual_level():
            logits = on_path(model, fast)(inputs_embeds=fwAD.make_dual(embeds, direction), use_cache=False).logits
            return fwAD.unpack_dual(logits).tangent

    expected = tangent(False)
    with ran(PLAIN_PATH, not_ran=(FAST_PATH, C_PRODUCTS)):
        got = tangent(True)
    assert got is not None
    torch.testing.assert_close(got, expected)


def test_a_decoded_token_continuing_a_dual_state_keeps_its_tangent():
    """A cache whose state holds tangents (a token run with dual parameters), continued by one decoded token with
    the model's own parameters: the one-call decode, whose lane the scope kept from before, once ran on it."""
    require_c_kernels()
    model = tiny_model()
    ids = torch.randint(1, 97, (2, 3), generator=torch.Generator().manual_seed(2))
    params = {name: p.detach() for name, p in model.named_parameters()}
    directions = {name: torch.randn_like(p) for name, p in params.items()}

    def tangent(fast: bool, dual_part_ran=contextlib.nullcontext):
        on_path(model, fast)
        with torch.no_grad():
            cache = model(ids, use_cache=True).cache
            cache = model(ids[:, :1], cache=cache, use_cache=True).cache  # (the decode lane, on the fast path)
            with fwAD.dual_level(), dual_part_ran():
                duals = {name: fwAD.make_dual(p, directions[name]) for name, p in params.items()}
                cache = functional_call(model, duals, (ids[:, 1:2],), {"cache": cache, "use_cache": True}).cache
                logits = model(ids[:, 2:3], cache=cache, use_cache=True).logits
                return fwAD.unpack_dual(logits).tangent

    expected = tangent(False)
    with ran(DECODE_CALLS):  # (the lane was built before the dual level)
        got = tangent(True, lambda: ran(PLAIN_PATH, not_ran=(FAST_PATH, DECODE_CALLS, C_PRODUCTS)))
    torch.testing.assert_close(got, expected)


def test_torch_func_grad_and_jvp_give_the_plain_paths_derivatives():
    """`torch.func.grad` through the model's own parameters (the kernels cannot read its wrapped inputs), and
    `jvp` over parameters swapped in by `functional_call` with the default cache (whose note of the weights once
    read the wrappers' missing storage)."""
    model = tiny_model()
    embeds = torch.randn(2, 3, model.config.embedding_size, generator=torch.Generator().manual_seed(3))
    ids = torch.randint(1, 97, (2, 3), generator=torch.Generator().manual_seed(4))
    params = {name: p.detach() for name, p in model.named_parameters()}
    directions = {name: torch.randn_like(p) for name, p in params.items()}

    def derivatives(fast: bool):
        on_path(model, fast)
        grad = torch.func.grad(lambda e: model(inputs_embeds=e, use_cache=False).logits.square().sum())(embeds)
        _, jvp = torch.func.jvp(lambda p: functional_call(model, p, (ids,)).logits, (params,), (directions,))
        return grad, jvp

    expected = derivatives(False)
    with ran(PLAIN_PATH, not_ran=(FAST_PATH,)):
        got = derivatives(True)
    torch.testing.assert_close(got, expected)
