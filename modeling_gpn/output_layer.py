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

from .derived_weights import version_of
from .peft_layers import hook_keyword


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
        self._kept: tuple[Hashable, torch.Tensor, list] | None = None

    @property
    def weight(self) -> torch.Tensor:
        """The (vocab, e) table the wrapped embedding computes."""
        if mixed_batch_adapter_names(self.embedding) is not None:
            raise ValueError(
                "PEFT's mixed-batch inference (adapter_names=...) gives each row the output matrix of its own adapter, "
                "so there is no one output weight: call the model (its logits follow each row's adapter)"
            )
        state, parameters = _table_state(self.embedding)
        if self._kept is None or self._kept[0] != state:
            table = self.table()
            if table.requires_grad:
                table.register_hook(self._forget)
            # (the parameters kept alive with the table: the state names them by id, which a parameter made after
            # one freed could take again)
            self._kept = (state, table, parameters)
        return self._kept[1]

    def _forget(self, grad: torch.Tensor) -> None:
        self._kept = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of `hidden` against the embedding table."""
        weight = self.weight
        return F.linear(hidden.to(weight.dtype), weight)

    def extra_repr(self) -> str:
        """The table's size, for the module's repr."""
        return f"in_features={self.in_features}, out_features={self.out_features}, bias=False (the embedding's table)"


def _table_state(embedding: nn.Module) -> tuple[Hashable, list]:
    """What the table `embedding` computes depends on besides its input: grad mode, training mode, each parameter
    (which one, its storage, and its version, which every in-place change such as an optimizer step bumps; None
    for an inference tensor, which tracks none: such a table is never reused), and each PEFT layer's adapter state
    (`disable_adapter()`, `set_adapter()`, merged adapters); and the parameters."""
    adapters = tuple(
        (
            id(module),
            module.__dict__.get("_disable_adapters"),
            repr(module.__dict__.get("_active_adapter")),
            tuple(module.__dict__.get("merged_adapters") or ()),
        )
        for module in embedding.modules()
    )
    parameters = list(embedding.parameters())
    keys = tuple((id(p), p.data_ptr(), version_of(p)) for p in parameters)
    if any(key[2] is None for key in keys):
        return object(), parameters  # (unequal to any other state)
    return (torch.is_grad_enabled(), embedding.training, adapters, keys), parameters


def mixed_batch_adapter_names(embedding: nn.Module) -> list | None:
    """The adapter of each row (a name, or "__base__" for none) while PEFT's mixed-batch inference runs
    (`peft_model(..., adapter_names=[...])`, its generate() too), else None. PEFT hands them to each adapted layer
    in a forward pre-hook holding them as its `adapter_names` keyword; the output side computes the table without
    calling the embedding's hooks (`GPNForCausalLM.embedding_table`), so it reads them there, or every row's logits
    would follow the active adapter whatever adapter its input side used."""
    return hook_keyword(embedding, "adapter_names")


def mixed_batch_logits(
    hidden: torch.Tensor, adapter_names: list, table_of: Callable[[str], torch.Tensor]
) -> torch.Tensor:
    """The logits of `hidden` (batch, ..., e), each row against `table_of(its adapter's name)`, the table the wrapped
    embedding computes with that adapter alone (PEFT's mixed-batch inference)."""
    if len(adapter_names) != hidden.shape[0]:
        raise ValueError(
            f"adapter_names names {len(adapter_names)} adapters for {hidden.shape[0]} rows: give one per row"
        )
    parts = []
    for name in dict.fromkeys(adapter_names):
        rows = torch.tensor([i for i, n in enumerate(adapter_names) if n == name], device=hidden.device)
        table = table_of(name)
        parts.append((rows, F.linear(hidden[rows].to(table.dtype), table)))
    logits = parts[0][1].new_empty(*hidden.shape[:-1], parts[0][1].shape[-1])
    for rows, part in parts:
        logits = logits.index_copy(0, rows, part)
    return logits


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

    That view is no named module, so a tool that asks for the output embedding to find it among the named modules
    (`asked_for_the_named_head`) is answered `lm_head`: PEFT's `all-linear` leaves it out (a second `all-linear`
    adapter adapts every linear layer but the head, whose output stays the wrapped table), and Accelerate's FSDP2
    sees it tied to the wrapped embedding and shards the two in one group (the view would split them, and FSDP
    refuse the shared table in the first forward). Trainable tokens, whose tied head and embedding share a token
    adapter, FSDP2 cannot shard: refused by name (`refuse_trainable_tokens_under_fsdp2`)."""
    head, embedding = model.lm_head, model.model.embed_tokens
    carries_token_adapter = carries_the_embeddings_token_adapter(head, embedding)
    if model.output_follows_embedding() or carries_token_adapter:
        asker = asked_for_the_named_head()
        if asker == FSDP2_PREPARE and carries_token_adapter:
            refuse_trainable_tokens_under_fsdp2()
        if asker is not None:
            return head
        return EmbeddingTableHead(
            model.embedding_table, embedding, model.config.embedding_size, model.config.vocab_size
        )
    return head


# The callers that ask for the output embedding only to find it among `named_modules()` (PEFT 0.21's resolution of
# `target_modules="all-linear"`, to leave it out; Accelerate 1.16's FSDP2 preparation, to shard it with the
# embedding it is tied to), by module and function. Should either be renamed, the view is returned as to anyone
# else: PEFT stops with StopIteration and FSDP2 in its first forward, as before (docs/fine-tuning.md), neither
# ever adapting or sharding lm_head apart in silence.
PEFT_ALL_LINEAR = ("peft.tuners.tuners_utils", "_maybe_include_all_linear_layers")
FSDP2_PREPARE = ("accelerate.utils.fsdp_utils", "fsdp2_prepare_model")


def asked_for_the_named_head() -> tuple[str, str] | None:
    """`PEFT_ALL_LINEAR` or `FSDP2_PREPARE` where that is the caller of `GPNForCausalLM.get_output_embeddings`, else
    None."""
    caller = sys._getframe(3)  # asked_for_the_named_head <- output_embeddings <- get_output_embeddings <- caller
    asker = (caller.f_globals.get("__name__"), caller.f_code.co_name)
    return asker if asker in (PEFT_ALL_LINEAR, FSDP2_PREPARE) else None


def refuse_trainable_tokens_under_fsdp2() -> None:
    """FSDP2 cannot shard PEFT's trainable tokens on a tied model (Accelerate 1.16, torch 2.13: the tied head's and
    the embedding's wrappers share one token adapter, and sharding them fails deep in `fully_shard`, or earlier in
    transformers' `tie_weights`, which finds no `embed_tokens.weight` on the wrapper)."""
    raise ValueError(
        "FSDP2 cannot shard a GPN whose embedding carries PEFT trainable tokens (`trainable_token_indices`: the tied "
        "head shares their adapter): train them under DDP (accelerate launch --multi_gpu), or train the embedding "
        'under FSDP2 with a LoRA on "embed_tokens" or `modules_to_save=["embed_tokens"]`'
    )


def refuse_what_fsdp2_cannot_tie(model: nn.Module) -> None:
    """Called by `GPNForCausalLM.tie_weights`: where Accelerate's FSDP2 preparation ties the weights (it does before
    sharding, with its default `cpu_ram_efficient_loading`) of a model whose embedding carries trainable tokens,
    transformers would fail finding no `embed_tokens.weight` on PEFT's wrapper; refused by name instead."""
    caller = sys._getframe(2)  # refuse_what_fsdp2_cannot_tie <- tie_weights <- caller
    if (caller.f_globals.get("__name__"), caller.f_code.co_name) != FSDP2_PREPARE:
        return
    if carries_the_embeddings_token_adapter(model.lm_head, model.model.embed_tokens):
        refuse_trainable_tokens_under_fsdp2()
