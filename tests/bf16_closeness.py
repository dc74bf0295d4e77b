"""How close a fast path under bf16 must come to the exact result: as close as the plain loop under the same
bf16 setting (`assert_bf16_close`, the bar of the bf16 tests of the fast path and of packed batches)."""

from __future__ import annotations

import torch


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12)).item()


def assert_bf16_close(fast, plain, exact, params) -> None:
    """The fast path under bf16 is as close to the exact (float32) result as the plain loop under the same
    bf16 setting: loss within 5e-3 and log-probs within 0.03 nats of the plain loop's (the defect: 1-14 nats
    off, or NaN); the whole gradient no further from the float32 one than 1.5x the plain loop's own bf16
    error + 0.005 of its norm (about 1% here) and at cosine > 0.9995 to the plain loop's; each parameter's
    gradient no further than 1.5x the plain loop's + 0.1; every gradient finite and in its parameter's dtype."""
    (loss_f, lp_f, grads_f), (loss_p, lp_p, grads_p), (_, _, grads_x) = fast, plain, exact
    assert torch.isfinite(loss_f) and torch.isfinite(lp_f).all()
    torch.testing.assert_close(loss_f, loss_p, atol=5e-3, rtol=0)
    diff = (lp_f - lp_p).abs()
    assert diff.max() < 0.03 and diff.mean() < 0.003, f"log-probs differ: max {diff.max():.4f}, mean {diff.mean():.5f}"
    assert_bf16_gradients_close(grads_f, grads_p, grads_x, params)


def assert_bf16_gradients_close(grads_f: dict, grads_p: dict, grads_x: dict, params: dict) -> None:
    """The gradients' part of `assert_bf16_close` (name -> gradient, each of the tensor of that name in `params`):
    the whole no further from the exact one than 1.5x the plain loop's error + 0.005 of its norm and at cosine >
    0.9995 to the plain loop's; each one no further than 1.5x the plain loop's + 0.1, finite, in its tensor's dtype."""
    assert grads_f.keys() == grads_p.keys() == grads_x.keys()
    for name, grad in grads_x.items():
        assert grads_f[name].dtype == params[name].dtype and torch.isfinite(grads_f[name]).all(), name
        fast_error, plain_error = relative_error(grads_f[name], grad), relative_error(grads_p[name], grad)
        assert fast_error < 1.5 * plain_error + 0.1, (
            f"gradient of {name}: error {fast_error:.3f}, plain {plain_error:.3f}"
        )
    flat_f, flat_p, flat_x = (torch.cat([g[n].float().flatten() for n in grads_x]) for g in (grads_f, grads_p, grads_x))
    fast_error, plain_error = relative_error(flat_f, flat_x), relative_error(flat_p, flat_x)
    assert fast_error < 1.5 * plain_error + 0.005, f"gradient error {fast_error:.4f}, plain loop's {plain_error:.4f}"
    assert torch.nn.functional.cosine_similarity(flat_f, flat_p, dim=0) > 0.9995
