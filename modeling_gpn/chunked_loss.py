"""The causal-LM loss of the tied decoder without materialising batch x length x vocab logits.

`chunked_causal_lm_loss` is the cross-entropy of logits = decoded E^T (E the tied embedding) computed in
chunks of rows (`ChunkedTiedCrossEntropy`), with its gradients computed in the same pass; `GPNForCausalLM`
uses it when the loss is asked for without the logits (`return_logits=False`, as training does). `divide_loss_sum` is transformers' mean-or-`num_items_in_batch`
division, shared with the model's plain loss.

This file ships to the Hub with the model: it imports only torch and typing.
"""

from __future__ import annotations

import torch


class ChunkedTiedCrossEntropy(torch.autograd.Function):
    """Sum of cross-entropies of logits = h E^T over rows, computed in chunks.

    h (N, e), E (V, e), targets (N,) with -100 ignored. The logits of at most `chunk` rows exist at any
    time. Logits are float32 as in the plain loss (which upcasts them). With `with_grads` (training) the
    gradients for h and E are computed in the same pass over each chunk, while its logits are at hand
    (the loss is a scalar, so backward only scales them): three matmuls per chunk instead of four, since
    backward would otherwise recompute the logits. Without it only one log-sum-exp per row is kept.
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        h: torch.Tensor,
        E: torch.Tensor,
        targets: torch.Tensor,
        chunk: int,
        with_grads: bool,
    ) -> torch.Tensor:
        """The summed cross-entropy of h @ E^T against `targets` (-100 ignored), chunk by chunk."""
        N = h.shape[0]
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        valid = targets != -100
        safe = torch.where(valid, targets, torch.zeros_like(targets))
        dh = torch.empty(h.shape, dtype=torch.float32, device=h.device) if with_grads else None
        dE = torch.zeros(E.shape, dtype=torch.float32, device=E.device) if with_grads else None
        for start in range(0, N, chunk):
            rows = slice(start, start + chunk)
            logits = torch.matmul(h[rows], E.t()).float()
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, safe[rows, None])[:, 0]
            total += ((lse - picked) * valid[rows]).sum()
            if with_grads:  # d total / d logits = softmax - onehot on counted rows
                probs = logits.sub_(lse[:, None]).exp_()
                probs.scatter_add_(1, safe[rows, None], -torch.ones_like(probs[:, :1]))
                probs *= valid[rows, None]
                g = probs.to(E.dtype)
                dh[rows] = torch.matmul(g, E).float()
                dE += torch.matmul(g.t(), h[rows]).float()
        ctx.save_for_backward(dh, dE)
        ctx.h_dtype, ctx.E_dtype = h.dtype, E.dtype
        return total

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_total: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """The gradients of h and E the forward computed, scaled by `grad_total`."""
        dh, dE = ctx.saved_tensors
        if dh is None:
            raise RuntimeError("ChunkedTiedCrossEntropy was called with with_grads=False: it has no gradients")
        return (
            (dh * grad_total).to(ctx.h_dtype) if ctx.needs_input_grad[0] else None,
            (dE * grad_total).to(ctx.E_dtype) if ctx.needs_input_grad[1] else None,
            None,
            None,
            None,
        )


def chunked_causal_lm_loss(
    decoded: torch.Tensor,
    embedding: torch.Tensor,
    labels: torch.Tensor | None,
    chunk_rows: int | None = None,
    shift_labels: torch.Tensor | None = None,
    num_items_in_batch: torch.Tensor | int | None = None,
) -> torch.Tensor:
    """Shifted cross-entropy of logits = decoded E^T (decoded (B, T, e), labels (B, T), -100 ignored): position
    t against `labels[:, t + 1]` (or `shift_labels[:, t]` when given); the mean, or the sum divided by
    `num_items_in_batch` when given (transformers' exact gradient accumulation).

    Equals `F.cross_entropy(logits[:, :-1].float(), labels[:, 1:])` without holding the (B, T, V) logits.
    """
    V, e = embedding.shape
    if chunk_rows is None:
        chunk_rows = max(64, (1 << 20) // V)  # about 4 MB of float32 logits: the chunk stays in cache
    rows, targets = (decoded, shift_labels) if shift_labels is not None else (decoded[:, :-1], labels[:, 1:])
    h = rows.reshape(-1, e).to(embedding.dtype)
    targets = targets.reshape(-1).to(decoded.device)
    with_grads = torch.is_grad_enabled() and (h.requires_grad or embedding.requires_grad)
    total = ChunkedTiedCrossEntropy.apply(h, embedding, targets, chunk_rows, with_grads)
    return divide_loss_sum(total, targets, num_items_in_batch)


def divide_loss_sum(
    total: torch.Tensor, targets: torch.Tensor, num_items_in_batch: torch.Tensor | int | None
) -> torch.Tensor:
    """The summed loss over `num_items_in_batch` when given, else over this call's counted targets (the mean)."""
    if num_items_in_batch is None:
        return total / (targets != -100).sum()  # nan when nothing is counted, as F.cross_entropy
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch
