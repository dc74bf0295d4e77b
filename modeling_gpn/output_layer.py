"""The output embedding a GPN shows while its output follows a wrapped embedding.

A GPN's output matrix is its embedding. While PEFT wraps `embed_tokens` (a LoRA adapter, a `modules_to_save` copy,
trainable tokens) the logits are `last_hidden_state` times the table the wrapped embedding computes
(`GPNForCausalLM.embedding_table`). Tools that score tokens without calling the head read
`get_output_embeddings().weight` and `.bias` (TRL's fused LM head, its distillation loss): PEFT's wrappers have no
`bias`, and a LoRA's `weight` is the unadapted table, so they are shown `EmbeddingTableHead`, a bias-free linear
view whose `weight` is the computed table, with the gradients of whatever the wrapper trains.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Hashable

import torch
import torch.nn.functional as F
from torch import nn


class EmbeddingTableHead(nn.Module):
    """A bias-free linear head whose `weight` is `table()`, the table `embedding` (a PEFT wrapper) computes, with
    its gradients; calling it gives the logits of a `last_hidden_state`. It holds no parameters and is no submodule
    of the model: the parameters stay the wrapper's, trained and saved there.

    The table is a forward of the embedding over the whole vocabulary, and tools read `weight` several times a call
    (TRL's fused head: three, its distillation loss more), so it is computed once and kept while nothing it depends
    on has changed (`_table_state`: the wrapper's parameters, in place too, its active or disabled adapters, grad
    mode); the backward through a kept table drops it, so a table whose graph is spent is never handed out again."""

    bias = None

    def __init__(
        self, table: Callable[[], torch.Tensor], embedding: nn.Module, in_features: int, out_features: int
    ) -> None:
        super().__init__()
        self.table = table  # a bound method, not a module: the model is not registered below this view
        self.__dict__["embedding"] = embedding  # read, not registered (nn.Module would make it a submodule)
        self.in_features = in_features
        self.out_features = out_features
        self._kept: tuple[Hashable, torch.Tensor] | None = None

    @property
    def weight(self) -> torch.Tensor:
        """The (vocab, e) table the wrapped embedding computes."""
        state = _table_state(self.embedding)
        if self._kept is None or self._kept[0] != state:
            table = self.table()
            if table.requires_grad:
                table.register_hook(self._forget)
            self._kept = (state, table)
        return self._kept[1]

    def _forget(self, grad: torch.Tensor) -> None:
        self._kept = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        return F.linear(hidden.to(weight.dtype), weight)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias=False (the embedding's table)"


def _table_state(embedding: nn.Module) -> Hashable:
    """What the table `embedding` computes depends on besides its input: grad mode, training mode, each parameter
    (which one, and its version, which every in-place change such as an optimizer step bumps), and each PEFT
    layer's adapter state (`disable_adapter()`, `set_adapter()`, merged adapters)."""
    adapters = tuple(
        (
            id(module),
            module.__dict__.get("_disable_adapters"),
            repr(module.__dict__.get("_active_adapter")),
            tuple(module.__dict__.get("merged_adapters") or ()),
        )
        for module in embedding.modules()
    )
    parameters = tuple((id(p), p._version) for p in embedding.parameters())
    return torch.is_grad_enabled(), embedding.training, adapters, parameters


def carries_the_embeddings_token_adapter(head: nn.Module, embedding: nn.Module) -> bool:
    """Whether `head` is PEFT's trainable-tokens wrapper of the tied head, tied to the embedding's own token adapter
    (`trainable_token_indices` on a tied model): it multiplies by the table the wrapped embedding computes, and
    has no `bias`."""
    token_adapter = getattr(embedding, "token_adapter", None)
    head_adapter = getattr(head, "token_adapter", None)
    return token_adapter is not None and getattr(head_adapter, "tied_adapter", None) is token_adapter


def output_embeddings(model: nn.Module) -> nn.Module:
    """`GPNForCausalLM.get_output_embeddings()` of `model`: the module whose weight multiplies `last_hidden_state`.
    That is `lm_head`, unless the output follows a wrapped embedding (`output_follows_embedding`: LoRA or a `modules_to_save` copy on
    `embed_tokens`) or the head carries the embedding's token adapter (`trainable_token_indices`): then neither
    `lm_head` (whose weight is the base table) nor a wrapper (which has no `bias`) shows the tools that read them
    (TRL's fused head) the output matrix, so they are shown an `EmbeddingTableHead` of `model.embedding_table`.

    That view is no named module, and PEFT's `all-linear` looks the output embedding up by identity among the named
    modules to leave it out: it is answered `lm_head` (`asked_by_peft_all_linear`), so a second `all-linear` adapter
    adapts every linear layer but the head, whose output stays the wrapped table."""
    head, embedding = model.lm_head, model.model.embed_tokens
    if model.output_follows_embedding() or carries_the_embeddings_token_adapter(head, embedding):
        if asked_by_peft_all_linear():
            return head
        return EmbeddingTableHead(
            model.embedding_table, embedding, model.config.embedding_size, model.config.vocab_size
        )
    return head


# The PEFT function that resolves `target_modules="all-linear"` (PEFT 0.21, `peft.tuners.tuners_utils`): it asks for
# the output embedding only to find its name among `named_modules()` and leave it out. Should PEFT rename it, the
# view is returned and PEFT stops with StopIteration, as it did before (docs/fine-tuning.md), never adapting lm_head.
_PEFT_ALL_LINEAR = ("peft.tuners.tuners_utils", "_maybe_include_all_linear_layers")


def asked_by_peft_all_linear() -> bool:
    """Whether `get_output_embeddings()` is being called by PEFT's `all-linear` resolution (the caller of
    `GPNForCausalLM.get_output_embeddings`, two frames above this one)."""
    caller = sys._getframe(3)  # asked_by_peft_all_linear <- output_embeddings <- get_output_embeddings <- caller
    return (caller.f_globals.get("__name__"), caller.f_code.co_name) == _PEFT_ALL_LINEAR
