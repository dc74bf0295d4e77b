"""Prefill and scoring in bounded memory: a long no-grad forward run a chunk of positions at a time.

A no-grad forward that asks only for the last logits (generate()'s prefill: `logits_to_keep=1`) or for the
chunked loss (labels with `return_logits=False`) runs its positions `model.prefill_chunk_length` at a time,
the state carried between chunks in a cache, so its peak memory does not grow with the prompt: only one
chunk's embeddings, token projections, predicted states and decoded vectors exist at once. The result is that of one pass
(the same state and logits; the loss up to float32 summation order).

`GPNForCausalLM.forward` asks `prefill_chunk_length_for` whether a call chunks, and runs it with
`forward_in_chunks`; both take the causal LM as their first argument.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .arguments import check_attention_mask
from .cache import CLAIM_ATTRIBUTE, ChunkedRead, GPNCache
from .chunked_loss import chunked_causal_lm_loss, divide_loss_sum
from .derived_weights import called_as_is, registered_global_hook
from .packing import packed_sequence_starts, packing_arguments
from .tracing import is_tracing


def prefill_chunk_length_for(
    model: nn.Module,
    input_ids: torch.Tensor | None,
    inputs_embeds: torch.Tensor | None,
    labels: torch.Tensor | None,
    shift_labels: torch.Tensor | None,
    logits_to_keep: int | torch.Tensor,
    return_logits: bool,
    output_hidden_states: bool | None,
    output_memory_decays: bool,
    output_predicted_states: bool = False,
) -> int:
    """The chunk length `model.forward` runs this call in, or 0 for one pass over every position.

    Chunks only what gives the same result in bounded memory: no gradient (training keeps what its
    backward needs), nothing per position asked back (hidden or predicted states, memory decays, all logits), and
    more positions than one chunk; in training mode, only with an input embedding called as it is (a hook on it
    sees the whole input, as in one pass). Malformed inputs take the one-pass path, whose checks name them.
    """
    chunk = model.prefill_chunk_length
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0):
        # (a negative length ran one pass in silence, True chunks of one position; a float or a string failed
        # inside the chunk loop)
        raise ValueError(
            "prefill_chunk_length must be a non-negative integer (positions a chunk reads; 0 or None: one pass), "
            f"got {chunk!r}"
        )
    if not chunk or torch.is_grad_enabled() or is_tracing() or output_memory_decays or output_predicted_states:
        return 0
    if model.training and not embedding_called_as_is(model):
        # a hook on the input embedding would see each chunk as a whole input: NEFTune (a Trainer's
        # `neftune_noise_alpha`, active in training mode) scales its noise by the length of the call it sees, so a
        # no-grad scoring pass in training mode (TRL's old log-probabilities) would be noised as if 2048 positions
        # long. At inference (accelerate's offloading hooks, steering) the chunks keep memory bounded.
        return 0
    if output_hidden_states if output_hidden_states is not None else model.config.output_hidden_states:
        return 0
    if isinstance(input_ids, torch.Tensor) and inputs_embeds is None and input_ids.dim() == 2:
        seq_len = input_ids.shape[1]
    elif inputs_embeds is not None and input_ids is None and inputs_embeds.dim() == 3:
        seq_len = inputs_embeds.shape[1]
    else:
        return 0
    if seq_len <= chunk:
        return 0
    wants_loss = labels is not None or shift_labels is not None
    if wants_loss:
        return chunk if not return_logits else 0
    keeps_a_tail = isinstance(logits_to_keep, int) and not isinstance(logits_to_keep, bool)
    return chunk if keeps_a_tail and 0 < logits_to_keep <= chunk else 0


def embedding_called_as_is(model: nn.Module) -> bool:
    """Whether calling the input embedding of the causal LM `model` runs its class's forward alone (no hook of its
    own or a global one, no `forward` set on the instance)."""
    return called_as_is(model.model.embed_tokens) and registered_global_hook() is None


def forward_in_chunks(
    model: nn.Module,
    chunk_length: int,
    input_ids: torch.Tensor | None,
    inputs_embeds: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    cache: GPNCache | None,
    use_cache: bool | None,
    labels: torch.Tensor | None,
    shift_labels: torch.Tensor | None,
    logits_to_keep: int,
    num_items_in_batch: torch.Tensor | int | None,
    kwargs: dict,
) -> tuple[torch.Tensor | None, torch.Tensor | None, GPNCache | None] | None:
    """`model.forward` over `chunk_length` positions at a time: (loss, logits, cache), or None.

    Each chunk runs the base model from the state the previous chunk left in a cache; only the last
    `logits_to_keep` decoded vectors (`last_hidden_state`), or the running sum of the loss, are kept. Returns None for a packed
    batch (sequences starting inside rows, `packed_sequence_starts`), which `forward` then runs in one pass
    (a chunk's first position continues the cache, so a sequence starting there would not be reset).
    """
    base = model.model
    tokens = input_ids if input_ids is not None else inputs_embeds
    batch_size, seq_len = tokens.shape[:2]
    use_cache = use_cache if use_cache is not None else (model.config.use_cache and not base.training)
    # The checks one pass makes over the whole input, made once here (a chunk sees only its part).
    continuing = isinstance(cache, GPNCache) and cache.has_state
    mask = check_attention_mask(attention_mask, batch_size, seq_len, continuing=continuing)
    packing = packing_arguments(kwargs)
    if (
        packing
        and packed_sequence_starts(batch_size, seq_len, mask, **packing, device=tokens.device, continuing=continuing)
        is not None
    ):
        return None
    kwargs = {name: value for name, value in kwargs.items() if name not in packing}  # (ordinary position ids)
    for name, given in (("labels", labels), ("shift_labels", shift_labels)):
        if given is not None and given.shape != (batch_size, seq_len):
            raise ValueError(f"{name} must have shape {(batch_size, seq_len)}, got {tuple(given.shape)}")
    # The state runs from chunk to chunk through a cache; a cache the caller wants left as it was
    # (use_cache=False) is copied. (Anything but a GPNCache goes to the model, which refuses it.)
    if isinstance(cache, GPNCache) and not use_cache:
        running = cache.fork(1) if cache.has_state else GPNCache(model.config)
    else:
        running = cache if cache is not None else GPNCache(model.config)

    wants_loss = labels is not None or shift_labels is not None
    if wants_loss:  # position t's target, for every position (the last one of `labels` has none)
        targets = shift_labels
        if targets is None:
            targets = torch.cat([labels[:, 1:], labels.new_full((batch_size, 1), -100)], dim=1)
        output_matrix = model.output_matrix()  # None: only calling the (wrapped) head gives the logits
        loss_sum = None
    tail = None  # the last `logits_to_keep` decoded vectors read so far
    # The chunks are one write, as one pass is: the first chunk's forward marks the cache (`start_writing`), no
    # chunk's clears the mark, and it is cleared after the last one, so a read interrupted (or failing) between two
    # chunks leaves the cache refused on its next use rather than holding only the earlier chunks, in silence. This
    # call holds the cache's claim throughout and lends it to one chunk's forward at a time (`ChunkedRead`); as for
    # any claim, taken inside the `try` and released inline in the `finally` (`GPNCache.claim`).
    held, claim = (running.__dict__, ChunkedRead()) if isinstance(running, GPNCache) else ({}, None)
    try:
        if claim is not None:
            running.claim(claim)
        for start in range(0, seq_len, chunk_length):
            stop = min(start + chunk_length, seq_len)
            if claim is not None:
                claim.lend()
            hidden = base(
                input_ids=None if input_ids is None else input_ids[:, start:stop],
                inputs_embeds=None if inputs_embeds is None else inputs_embeds[:, start:stop],
                attention_mask=None if mask is None else mask[:, start:stop],
                cache=running,
                use_cache=True,
                output_hidden_states=False,
                return_dict=True,
                **kwargs,
            ).last_hidden_state
            if wants_loss:
                chunk_targets = targets[:, start:stop]
                if output_matrix is not None:
                    chunk_sum = chunked_causal_lm_loss(
                        hidden, output_matrix, None, shift_labels=chunk_targets, num_items_in_batch=1
                    )
                else:
                    logits = model.logits_of(hidden).float()
                    chunk_sum = F.cross_entropy(
                        logits.reshape(-1, logits.shape[-1]),
                        chunk_targets.reshape(-1),
                        ignore_index=-100,
                        reduction="sum",
                    )
                loss_sum = chunk_sum if loss_sum is None else loss_sum + chunk_sum
            else:
                joined = hidden if tail is None else torch.cat([tail, hidden], dim=1)
                tail = joined[:, -logits_to_keep:].clone()  # not a view: the chunk's states are freed
        if claim is not None:
            running.finish_writing()  # (every chunk read: the state, count and fingerprint are those of one pass)
    finally:
        CLAIM_ATTRIBUTE in held and held[CLAIM_ATTRIBUTE] is claim and held.pop(CLAIM_ATTRIBUTE)
    loss = divide_loss_sum(loss_sum, targets, num_items_in_batch) if wants_loss else None
    logits = None if wants_loss else model.logits_of(tail)
    return loss, logits, running if use_cache else None
