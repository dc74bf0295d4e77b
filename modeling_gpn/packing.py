"""Packed (padding-free) batches: where the sequences packed into each row start.

Padding-free collators (transformers' `DataCollatorWithFlattening`, TRL's `SFTTrainer` with packing) put
several sequences in one row and say where each starts, by position ids restarting inside the row,
FlashAttention's cumulative lengths (`cu_seq_lens_q/k`) or a sequence index (`seq_idx`).
`packed_sequence_starts` turns any of them into the positions where the recurrence resets (p, g, M) to
the zero state, so every packed sequence runs as if alone, and refuses inconsistent ones by name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from collections.abc import Sequence

from .tracing import is_tracing

# The arguments by which padding-free collators (transformers' DataCollatorWithFlattening, TRL's SFTTrainer with
# packing) say where the sequences packed into a row start, besides `position_ids` restarting inside a row.
PACKING_KWARGS = {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx"}


def add_packing_parameters(kwargs: dict, position_ids: torch.Tensor | None, seq_idx: torch.Tensor | None) -> dict:
    """`kwargs` with the packing arguments a forward names as parameters added, those given (not None), where the
    rest of the forward reads them with the others (`packing_arguments`).

    A forward names `position_ids` and `seq_idx`, the two a dataset's rows may carry, because `Trainer` keeps only
    the dataset columns its model's forward names (`remove_unused_columns`, on by default): a pre-packed dataset's
    column taken as a keyword would be dropped, and its rows trained as one sequence each, with an info line only.
    """
    for name, value in (("position_ids", position_ids), ("seq_idx", seq_idx)):
        if value is not None:
            kwargs[name] = value
    return kwargs


def packing_arguments(kwargs: dict) -> dict:
    """Those of a forward's `kwargs` that may say where packed sequences start (`position_ids` and
    `PACKING_KWARGS`), the ones given (not None): what `packed_sequence_starts` takes."""
    return {name: kwargs[name] for name in ("position_ids", *PACKING_KWARGS) if kwargs.get(name) is not None}


def _previous_real_index(real: torch.Tensor) -> torch.Tensor:
    """(batch, seq) long: the index of the row's last real position before each position, -1 where none."""
    seq_len = real.shape[1]
    indices = torch.arange(seq_len, device=real.device).expand_as(real)
    last_real = torch.where(real, indices, -1).cummax(dim=1).values
    return torch.cat([last_real.new_full((real.shape[0], 1), -1), last_real[:, :-1]], dim=1)


def _starts_at_real_tokens(boundaries: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """Sequence starts as the recurrence takes them, from `boundaries` (batch, seq) bool marking the first
    position of every packed sequence (possibly a padded one): True at each real token that has an earlier
    real token in its row and a boundary after that one, up to and including itself."""
    count = boundaries.long().cumsum(dim=1)
    previous = _previous_real_index(real)
    count_at_previous = count.gather(1, previous.clamp(min=0))
    return real & (previous >= 0) & (count > count_at_previous)


def _as_index_tensor(value: torch.Tensor | Sequence[int], name: str, device: torch.device) -> torch.Tensor:
    tensor = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool:
        raise ValueError(f"{name} must hold integers, got dtype {tensor.dtype}")
    return tensor.to(device)


# How cumulative lengths come to be cut short in training: Accelerate's batch dispatcher, which `Trainer` uses for an
# IterableDataset, cuts every tensor of a batch to the batch's rows, so a packed batch's cu_seq_lens (one row: its
# input is (1, tokens)) to its first entry. Named in the refusals, with the way out, as `str.format`s of the name.
DISPATCHER_CUT = (
    "with an IterableDataset, Trainer's batch dispatcher (Accelerate's) cuts {name} to the batch's rows: pass "
    'TrainingArguments(accelerator_config={{"dispatch_batches": False}}), or leave the FlashAttention arguments out of '
    "the collator (the position ids say where the sequences start)"
)


def _starts_from_cu_seq_lens(
    cu_seq_lens: torch.Tensor, name: str, batch_size: int, seq_len: int, validate: bool
) -> torch.Tensor:
    """Boundaries (batch, seq) from cumulative sequence lengths over the flattened batch (FlashAttention's
    varlen convention): sequence i holds flattened positions cu[i]..cu[i+1]-1."""
    total = batch_size * seq_len
    if cu_seq_lens.dim() != 1 or cu_seq_lens.numel() < 2:
        raise ValueError(
            f"{name} must be a 1-D tensor [0, end of sequence 1, ..., {total}], got shape {tuple(cu_seq_lens.shape)}"
            + ("; " + DISPATCHER_CUT.format(name=name) if cu_seq_lens.dim() == 1 else "")
        )
    if not validate:
        boundaries = torch.zeros(total + 1, dtype=torch.bool, device=cu_seq_lens.device)
        return boundaries.index_fill(0, cu_seq_lens.long().clamp(0, total), True)[:total].view(batch_size, seq_len)
    first, last = int(cu_seq_lens[0]), int(cu_seq_lens[-1])
    if first != 0 or last != total:
        raise ValueError(
            f"{name} must run from 0 to the number of tokens in the batch ({batch_size} x {seq_len} = {total}), "
            f"got {first} .. {last}"
            + (
                f": the input has {total - last} more positions than the packed sequences, as when tokens are put "
                "in front of a packed batch after its collator counted it (PEFT's prompt tuning prepends its virtual "
                "tokens so): pack without prompt tuning, or train it on padded batches; "
                + DISPATCHER_CUT.format(name=name)
                if first == 0 and 0 < last < total
                else ""
            )
        )
    lengths = cu_seq_lens[1:] - cu_seq_lens[:-1]
    if bool((lengths <= 0).any()):
        raise ValueError(
            f"{name} must be strictly increasing (every packed sequence holds a token), got {cu_seq_lens.tolist()}"
        )
    boundaries = torch.zeros(total, dtype=torch.bool, device=cu_seq_lens.device)
    boundaries[cu_seq_lens[:-1].long()] = True
    boundaries = boundaries.view(batch_size, seq_len)
    if not bool(boundaries[:, 0].all()):
        row = int((~boundaries[:, 0]).nonzero()[0])
        raise ValueError(
            f"{name} has a sequence running from row {row - 1} into row {row}: a GPN runs each row from its own "
            f"state, so every row must start a sequence (put each row start, a multiple of {seq_len}, in {name})"
        )
    return boundaries


def packed_sequence_starts(
    batch_size: int,
    seq_len: int,
    mask: torch.Tensor | None,
    position_ids: torch.Tensor | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    max_length_q: int | None = None,
    max_length_k: int | None = None,
    seq_idx: torch.Tensor | None = None,
    device: torch.device | None = None,
    continuing: bool = False,
) -> torch.Tensor | None:
    """Where packed sequences start inside the rows: (batch, seq) bool, True at the first real token of every
    sequence but the first of its row, or None when no row packs more than one sequence.

    The recurrence resets (p, g, M) to the zero state right before each such token, so every packed sequence
    runs as if alone. A row's first sequence starts from the state the row already has: the zero state, or
    the cache's when continuing from one (so a packed prefill can be continued, the last sequence of each row).
    Three ways of saying where sequences start are understood, alone or together (they must then agree):

    - `position_ids` (batch or 1, seq): a sequence starts where the position id does not exceed that of the
      row's previous real token (`DataCollatorWithFlattening` numbers each sequence from 0, or from
      `position_ids_start`). Ordinary position ids (increasing over the real tokens) mark nothing. Longer
      ones only when `continuing` a cache, as for the attention mask: their last `seq` columns.
    - `cu_seq_lens_q` / `cu_seq_lens_k`: FlashAttention's cumulative lengths over the flattened batch,
      [0, ..., batch * seq]; every row start must be one of them. `max_length_q/k`, if given, must be at least
      the longest sequence.
    - `seq_idx` (batch, seq): the index of the sequence each position belongs to; a sequence starts where it
      changes.

    A boundary at a padded position (`mask` False) takes effect at the next real token, so padded positions
    still leave the state exactly unchanged. Inconsistent arguments raise a ValueError naming the problem
    (under torch.compile / torch.export these value checks are left out, and the starts are always returned).
    """
    validate = not is_tracing()
    real = mask if mask is not None else torch.ones(batch_size, seq_len, dtype=torch.bool, device=device)
    device = real.device
    derived: list[tuple[str, torch.Tensor]] = []  # (what, starts) for every form given

    if position_ids is not None:
        position_ids = _as_index_tensor(position_ids, "position_ids", device)
        # Longer ones are taken (their last columns) only when continuing a cache, as the attention mask is: without
        # one they belong to another input (ids cut at the right, their position ids not), and their last columns
        # would put the starts elsewhere, in silence.
        columns = position_ids.shape[-1]
        if (
            position_ids.dim() != 2
            or position_ids.shape[0] not in (1, batch_size)
            or columns < seq_len
            or (columns > seq_len and not continuing)
        ):
            raise ValueError(
                f"position_ids must have shape (batch={batch_size} or 1, seq={seq_len}) like input_ids, got "
                f"{tuple(position_ids.shape)}"
                + ("; longer ones only when continuing from a cache" if columns > seq_len and not continuing else "")
            )
        positions = position_ids[:, -seq_len:].expand(batch_size, seq_len)
        previous = _previous_real_index(real)
        position_at_previous = positions.gather(1, previous.clamp(min=0))
        derived.append(("position_ids", real & (previous >= 0) & (positions <= position_at_previous)))

    cu_given = {
        name: value
        for name, value in (("cu_seq_lens_q", cu_seq_lens_q), ("cu_seq_lens_k", cu_seq_lens_k))
        if value is not None
    }
    for name, bound in (("max_length_q", max_length_q), ("max_length_k", max_length_k)):
        cu_name = "cu_seq_lens_" + name[-1]
        if bound is not None and cu_name not in cu_given:
            raise ValueError(f"{name} was given without {cu_name}: it bounds the lengths {cu_name} gives")
    cu_tensors = {name: _as_index_tensor(value, name, device) for name, value in cu_given.items()}
    if validate and len(cu_tensors) == 2 and not torch.equal(cu_tensors["cu_seq_lens_q"], cu_tensors["cu_seq_lens_k"]):
        raise ValueError(
            "cu_seq_lens_q and cu_seq_lens_k differ: a GPN reads each packed sequence once (self-attention's "
            "query and key sequences are the same), so they must be equal"
        )
    if cu_tensors:
        name, cu_seq_lens = next(iter(cu_tensors.items()))
        boundaries = _starts_from_cu_seq_lens(cu_seq_lens, name, batch_size, seq_len, validate)
        longest = int((cu_seq_lens[1:] - cu_seq_lens[:-1]).max()) if validate else 0
        for bound_name, bound in (("max_length_q", max_length_q), ("max_length_k", max_length_k)):
            if validate and bound is not None and int(bound) < longest:
                raise ValueError(
                    f"{bound_name}={int(bound)} is shorter than the longest packed sequence ({longest} tokens)"
                )
        derived.append((name, _starts_at_real_tokens(boundaries, real)))

    if seq_idx is not None:
        seq_idx = _as_index_tensor(seq_idx, "seq_idx", device)
        if seq_idx.shape != (batch_size, seq_len):
            raise ValueError(f"seq_idx must have shape (batch={batch_size}, seq={seq_len}), got {tuple(seq_idx.shape)}")
        boundaries = torch.ones_like(real)
        boundaries[:, 1:] = seq_idx[:, 1:] != seq_idx[:, :-1]
        derived.append(("seq_idx", _starts_at_real_tokens(boundaries, real)))

    if not derived:
        return None
    (first_name, starts), *others = derived
    if not validate:
        return starts
    for name, other in others:
        disagree = starts != other
        if bool(disagree.any()):
            row, column = (int(i) for i in disagree.nonzero()[0])
            says = lambda s: "starts" if bool(s[row, column]) else "does not start"  # noqa: B023 (called in this iteration)
            raise ValueError(
                f"{first_name} and {name} disagree on where the packed sequences start: at (row {row}, position "
                f"{column}) a sequence {says(starts)} by {first_name} but {says(other)} by {name}"
            )
    return starts if bool(starts.any()) else None


def refuse_packed_rows(
    batch_size: int,
    seq_len: int,
    mask: torch.Tensor | None,
    kwargs: dict,
    reader: str,
    device: torch.device,
    continuing: bool = False,
) -> None:
    """Raise a ValueError when the packing arguments among `kwargs` say a row holds several sequences, for a
    `reader` that reads one result a row (a sequence classifier's score at the row's last real token): it would
    silently read only the last sequence of each row. Ordinary position ids, and packing arguments whose every
    row holds one sequence, pass. (Under torch.compile / torch.export nothing is checked, as for the other
    value checks.)"""
    packing = packing_arguments(kwargs)
    if not packing or is_tracing():
        return
    starts = packed_sequence_starts(batch_size, seq_len, mask, **packing, device=device, continuing=continuing)
    if starts is not None:
        row, position = (int(i) for i in starts.nonzero()[0])
        raise ValueError(
            f"{reader} reads one result a row, but these rows pack several sequences ({', '.join(sorted(packing))} "
            f"start one at row {row}, position {position}): every sequence but the last of a row would go unread. "
            "Give each sequence its own row (pad them, with the attention mask)"
        )


# Documents joined with EOS in a token window (gpn train --reset-at-document-start, gpn inspect): each starts at the
# token after an EOS, which the recurrence takes as a packed sequence's start when the position ids restart there.


def document_starts(windows: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """(batch, seq) bool: True at the first token after every EOS of the token windows (batch, seq), where a document
    joined with EOS starts (a window's first position is its own start: not marked). The token after an EOS stays a
    target: it is predicted at the EOS, from the previous document's state, as without resets (so losses and
    perplexities stay comparable)."""
    starts = torch.zeros_like(windows, dtype=torch.bool)
    starts[:, 1:] = windows[:, :-1] == eos_token_id
    return starts


def document_position_ids(windows: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """Position ids (batch, seq) counting from 0 at each window's start and at every `document_starts`: a GPN reads
    ids restarting inside a row as packed sequences (`packed_sequence_starts`) and resets (p, g, M) to the zero
    state where each starts, so every document of the window runs from the zero state."""
    positions = torch.arange(windows.shape[1], device=windows.device).expand_as(windows)
    last_start = torch.where(document_starts(windows, eos_token_id), positions, 0).cummax(dim=1).values
    return positions - last_start
