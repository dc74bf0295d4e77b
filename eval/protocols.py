"""The paper's two evaluation protocols, computed directly from a causal LM's log-probabilities.

lm-eval's request types return one summed log-likelihood (and a whole-continuation greedy flag) per
request, and its rolling perplexity scores each document in windows that overlap by one token. Neither
can express the paper's numbers exactly, so they are computed here, token by token, from the model's
own forward pass:

- `lambada_paper` (GPN.md, Table 1, LAMBADA columns). Tokens are made exactly as lm-eval's
  `lambada_openai` makes them (`HFLM._encode_pair`): context = all words but the last, target = " " +
  last word; ``whole = tok(context + target)``, ``ctx = tok(context)`` with the tokenizer's default
  special tokens (LLaMA-2: ``<s>`` in front), and the last word's subwords are ``whole[len(ctx):]``.
  **acc** = fraction of examples where the arg-max of the distribution predicting the last word's
  *first* subword equals that subword. **ppl** = exp(sum over all examples and all last-word subwords of
  -log p / total number of last-word subwords), i.e. the cross-entropy is pooled over tokens, not
  averaged per example. ``acc_whole_word`` (greedy match of every subword, lm-eval's ``acc``) and
  ``ppl_per_example`` (exp of the mean per-example summed NLL, lm-eval's ``perplexity``) come from the
  same numbers as a cross-check against `lambada_openai`.
- `fineweb_paper` (GPN.md, Table 1, FineWeb column). Documents are tokenized without special tokens,
  each followed by a separator token (default: EOS), and concatenated into one token stream, which is
  cut into non-overlapping windows of `window` tokens (the incomplete tail is dropped and counted). Each
  window starts from the model's zero/empty state (no state crosses a window). Token-level perplexity =
  exp(total NLL / tokens scored). The first token of a window has no context: under the paper's
  convention (``first_position="empty_state"``, GPN only) it is predicted from the empty state by
  `GPNForCausalLM.empty_state_logits()`, so all `window` positions are scored (the reference's
  convention: its position 0 is the prediction from the zero state); under ``"skip"`` (any causal LM)
  it is not scored and each window contributes `window - 1` tokens. Both numbers are reported for a GPN.

Batches are right-padded without an attention mask, as lm-eval does: for a causal model (and for the
GPN recurrence) padding after the last real token cannot change any scored position.

The FineWeb windows never hold a (batch, window, vocab) tensor of logits (at the paper's 2048 window
and a 32k vocabulary that is 2 GB per batch of 8, and its float64 copies 8 GB more): the model's last
hidden states are decoded `logit_chunk_rows` positions at a time, by the model's own output head (a GPN's
`lm_head` through `logits_of`, a Llama's `lm_head`), and each chunk's log-softmax is taken in float64 as before
(`summed_next_token_nll`). A model whose decoder is not known falls back to its full logits, still
without the float64 copies.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

if TYPE_CHECKING:
    from collections.abc import Callable

    from transformers import PreTrainedModel, PreTrainedTokenizerBase

PAPER_FIRST_POSITION = "empty_state"
SKIP_FIRST_POSITION = "skip"


# --------------------------------------------------------------------------------------------------
# Paper LAMBADA
# --------------------------------------------------------------------------------------------------


@dataclass
class LambadaExample:
    """One LAMBADA text as token ids: the model reads `context_ids + target_ids[:-1]`."""

    context_ids: list[int]
    target_ids: list[int]


def split_lambada(text: str) -> tuple[str, str]:
    """lm-eval's `lambada_openai` split: context = all words but the last, target = ' ' + last word."""
    words = text.split(" ")
    if len(words) < 2 or not words[-1]:
        raise ValueError(f"LAMBADA text needs at least two space-separated words ending in a word, got {text[:80]!r}")
    return " ".join(words[:-1]), " " + words[-1]


def encode_lambada(tokenizer: PreTrainedTokenizerBase, text: str) -> LambadaExample:
    """Tokenize one LAMBADA text exactly as lm-eval's HFLM does for a causal model (see module doc)."""
    context, target = split_lambada(text)
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        target, context = context[-n_spaces:] + target, context[:-n_spaces]
    whole = tokenizer.encode(context + target)
    context_ids = tokenizer.encode(context)
    target_ids = whole[len(context_ids) :]
    if not target_ids:
        raise ValueError(f"the last word of {text[:80]!r} produced no tokens")
    return LambadaExample(context_ids=context_ids, target_ids=target_ids)


@dataclass
class LambadaScore:
    """Per-example numbers: log-probs of the last word's subwords and whether each was the arg-max."""

    target_logprobs: list[float]
    target_is_top1: list[bool]

    @property
    def loglikelihood(self) -> float:
        """The summed log-probability of the target's subwords."""
        return sum(self.target_logprobs)


def _batches(order: Sequence[int], batch_size: int) -> Iterable[list[int]]:
    for start in range(0, len(order), batch_size):
        yield list(order[start : start + batch_size])


def _forward_logits(model: PreTrainedModel, rows: list[list[int]], device: torch.device | str) -> torch.Tensor:
    """Right-pad `rows` with token 0 (no mask, as lm-eval) and return float32 logits (B, T, V)."""
    length = max(len(row) for row in rows)
    batch = torch.zeros(len(rows), length, dtype=torch.long)
    for i, row in enumerate(rows):
        batch[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    with torch.no_grad():
        return model(input_ids=batch.to(device), use_cache=False).logits.float()


def score_lambada(
    model: PreTrainedModel,
    examples: Sequence[LambadaExample],
    batch_size: int = 8,
    max_length: int | None = None,
    device: torch.device | str = "cpu",
    progress: bool = True,
) -> list[LambadaScore]:
    """Score every example's last-word subwords (left-truncating the input to `max_length` as lm-eval)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    inputs = []
    for example in examples:
        row = (example.context_ids + example.target_ids)[:-1]
        if max_length is not None:
            row = row[-max_length:]
        if len(example.target_ids) > len(row):
            raise ValueError(
                f"max_length={max_length} is shorter than a LAMBADA target ({len(example.target_ids)} tokens)"
            )
        inputs.append(row)
    order = sorted(range(len(examples)), key=lambda i: -len(inputs[i]))  # longest first, like lm-eval
    scores: list[LambadaScore | None] = [None] * len(examples)
    bar = tqdm(total=len(examples), desc="lambada_paper", disable=not progress)
    for indices in _batches(order, batch_size):
        logits = _forward_logits(model, [inputs[i] for i in indices], device)
        for row, i in enumerate(indices):
            target = examples[i].target_ids
            end = len(inputs[i])
            window = logits[row, end - len(target) : end]  # position t predicts token t+1
            logprobs = F.log_softmax(window.double(), dim=-1)
            target_tensor = torch.tensor(target, device=window.device)
            picked = logprobs.gather(-1, target_tensor[:, None])[:, 0]
            top1 = window.argmax(dim=-1) == target_tensor
            scores[i] = LambadaScore(picked.tolist(), top1.tolist())
        bar.update(len(indices))
    bar.close()
    return scores  # type: ignore[return-value]


def truncated_lambada_examples(examples: Sequence[LambadaExample], max_length: int | None) -> int:
    """How many examples `score_lambada` left-truncates to `max_length` (as lm-eval does): the paper reads every
    context whole (at most 244 LLaMA-2 tokens), so each of them is scored otherwise than the paper's."""
    if max_length is None:
        return 0
    return sum(len(example.context_ids) + len(example.target_ids) - 1 > max_length for example in examples)


def lambada_metrics(scores: Sequence[LambadaScore]) -> dict[str, float]:
    """The paper's LAMBADA acc and pooled-token ppl, plus lm-eval's whole-word acc and per-example ppl."""
    if not scores:
        raise ValueError("no LAMBADA examples were scored")
    n = len(scores)
    n_tokens = sum(len(s.target_logprobs) for s in scores)
    total_nll = -sum(s.loglikelihood for s in scores)
    return {
        "acc": sum(s.target_is_top1[0] for s in scores) / n,
        "ppl": math.exp(total_nll / n_tokens),
        "acc_whole_word": sum(all(s.target_is_top1) for s in scores) / n,
        "ppl_per_example": math.exp(total_nll / n),
        "examples": n,
        "target_tokens": n_tokens,
    }


# --------------------------------------------------------------------------------------------------
# Paper FineWeb windows
# --------------------------------------------------------------------------------------------------


def token_stream(
    tokenizer: PreTrainedTokenizerBase, texts: Iterable[str], separator: str = "eos", max_tokens: int | None = None
) -> tuple[list[int], int]:
    """Concatenate documents into one token stream: each tokenized without special tokens, then
    followed by EOS (`separator="eos"`), preceded by BOS (`"bos"`), or joined with nothing (`"none"`); a blank
    document is left out (as `gpn train` leaves it out of its token stream, so the streams are the same).
    Stops once `max_tokens` are reached. Returns (stream, number of documents used)."""
    if separator not in ("eos", "bos", "none"):
        raise ValueError(f"separator must be 'eos', 'bos' or 'none', got {separator!r}")
    special = {"eos": tokenizer.eos_token_id, "bos": tokenizer.bos_token_id}.get(separator)
    if separator != "none" and special is None:
        raise ValueError(f"the tokenizer has no {separator.upper()} token; choose another separator")
    from modeling_gpn.data import PieceEncoder, split_document

    encoder = PieceEncoder(tokenizer)  # a long document is tokenized in pieces, to the same tokens
    stream: list[int] = []
    used = 0
    for text in texts:
        if not text.strip():  # as gpn train, whose held-out windows --fineweb-held-out-fraction scores, skips it
            continue
        used += 1
        ids: list[int] = []
        for piece, continues, _ends in split_document(text, encoder.safe_cut):
            (piece_ids,) = encoder.encode([(piece, continues)])
            if piece_ids is None:  # split_document checked this cut: the tokenizer changed its mind
                raise ValueError("cannot tokenize a long document in pieces with this tokenizer")
            ids.extend(piece_ids)
            if max_tokens is not None and len(stream) + len(ids) >= max_tokens:
                break  # the stream ends inside this document: the rest of a long one is not tokenized
        if separator == "bos":
            stream.append(special)
        stream.extend(ids)
        if separator == "eos":
            stream.append(special)
        if max_tokens is not None and len(stream) >= max_tokens:
            return stream[:max_tokens], used
    return stream, used


# Models whose logits are exactly `lm_head(base_model(...).last_hidden_state)` (no soft-capping, no scale).
PLAIN_LM_HEAD_MODEL_TYPES = {"llama"}


def hidden_states_and_decoder(
    model: PreTrainedModel, input_ids: torch.Tensor
) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]] | None:
    """(last hidden states (B, T, h), the callable mapping rows of them to logits), or None when the
    model's logits are not known to be a row-wise function of its last hidden states."""
    if callable(getattr(model, "logits_of", None)) and has_empty_state(model):  # a GPN: logits = lm_head(decoded)
        states = model.model(input_ids=input_ids, use_cache=False).last_hidden_state
        return states, model.logits_of
    config = getattr(model, "config", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if (
        getattr(config, "model_type", None) in PLAIN_LM_HEAD_MODEL_TYPES
        and isinstance(head, torch.nn.Linear)
        and getattr(config, "final_logit_softcapping", None) is None
        and hasattr(model, "model")
    ):
        states = model.model(input_ids=input_ids, use_cache=False).last_hidden_state
        return states, head
    return None


def summed_next_token_nll(model: PreTrainedModel, input_ids: torch.Tensor, chunk_rows: int | None = None) -> float:
    """Sum over rows and positions t >= 1 of -log p(token t | tokens < t), in float64.

    Equal to ``F.cross_entropy(logits[:, :-1].double(), ids[:, 1:], reduction="sum")`` on the model's
    full logits, but only `chunk_rows` positions' logits exist at a time (see the module docstring).
    """
    targets = input_ids[:, 1:].reshape(-1)
    with torch.no_grad():
        found = hidden_states_and_decoder(model, input_ids)
        if found is None:  # unknown decoder: the model's own logits, upcast chunk by chunk
            states, decode = model(input_ids=input_ids, use_cache=False).logits, (lambda rows: rows)
        else:
            states, decode = found
        states = states[:, :-1].reshape(-1, states.shape[-1])
        vocab = int(getattr(model.config, "vocab_size", 0) or states.shape[-1])
        chunk_rows = chunk_rows or max(16, (1 << 22) // vocab)  # about 16 MB of float32 logits per chunk
        total = 0.0
        for start in range(0, states.shape[0], chunk_rows):
            logits = decode(states[start : start + chunk_rows]).double()
            total += F.cross_entropy(
                logits, targets[start : start + chunk_rows].to(logits.device), reduction="sum"
            ).item()
    return total


def has_empty_state(model: PreTrainedModel) -> bool:
    """Whether the model can predict the first token from its empty state (a GPN)."""
    return callable(getattr(model, "empty_state_logits", None))


def windowed_perplexity(
    model: PreTrainedModel,
    stream: Sequence[int],
    window: int = 2048,
    batch_size: int = 8,
    device: torch.device | str = "cpu",
    max_windows: int | None = None,
    first_position: str = PAPER_FIRST_POSITION,
    held_out_fraction: float | None = None,
    progress: bool = True,
) -> dict[str, float]:
    """The paper's FineWeb perplexity over non-overlapping `window`-token windows of `stream`.

    Returns ``ppl_excluding_first`` (window - 1 scored tokens per window), and for a model with
    `empty_state_logits` also ``ppl_all_positions`` (all `window` tokens, the first predicted from the
    empty state: the paper's convention). ``ppl`` is the `first_position` convention
    ("empty_state", the paper's, needs a GPN; "skip" works for any causal LM); ``tokens_scored`` counts
    the tokens behind ``ppl``.

    `held_out_fraction` keeps only the last max(1, floor(n_windows * fraction)) windows: the held-out
    split `gpn train` makes of the same stream (`modeling_gpn.data.WindowDataset`), so a model can be
    evaluated on exactly the windows it never trained on when window = its training seq_len.
    """
    if first_position not in (PAPER_FIRST_POSITION, SKIP_FIRST_POSITION):
        raise ValueError(f"first_position must be 'empty_state' or 'skip', got {first_position!r}")
    if first_position == PAPER_FIRST_POSITION and not has_empty_state(model):
        raise ValueError(
            f"first_position='empty_state' needs a model with empty_state_logits() (a GPN); "
            f"{type(model).__name__} has none: use first_position='skip'"
        )
    if window < 2:
        raise ValueError(f"window must be at least 2 tokens, got {window}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    total_windows = len(stream) // window
    if total_windows == 0:
        raise ValueError(f"the token stream has {len(stream)} tokens, fewer than one window of {window}")
    first_window = 0
    if held_out_fraction is not None:
        if not 0 < held_out_fraction <= 1:
            raise ValueError(f"held_out_fraction must be in (0, 1], got {held_out_fraction}")
        first_window = total_windows - max(1, int(math.floor(total_windows * held_out_fraction)))
    n_windows = total_windows - first_window
    if max_windows is not None:
        n_windows = min(n_windows, max_windows)
    start_token = first_window * window
    tokens = torch.as_tensor(np.asarray(stream[start_token : start_token + n_windows * window], dtype=np.int64))
    tokens = tokens.view(n_windows, window)

    first_nll = None
    if has_empty_state(model):
        with torch.no_grad():
            empty = F.log_softmax(model.empty_state_logits(1).double()[0], dim=-1).cpu()
        first_nll = -empty[tokens[:, 0]].sum().item()

    rest_nll = 0.0
    bar = tqdm(total=n_windows, desc="fineweb_paper", disable=not progress)
    for start in range(0, n_windows, batch_size):
        batch = tokens[start : start + batch_size]
        rest_nll += summed_next_token_nll(model, batch.to(device))
        bar.update(len(batch))
    bar.close()

    rest_tokens = n_windows * (window - 1)
    result = {
        "ppl_excluding_first": math.exp(rest_nll / rest_tokens),
        "windows": n_windows,
        "window": window,
        "first_window": first_window,
        "stream_tokens": len(stream),
        "dropped_tail_tokens": len(stream) - total_windows * window,
    }
    if first_nll is not None:
        result["ppl_all_positions"] = math.exp((rest_nll + first_nll) / (n_windows * window))
    if first_position == PAPER_FIRST_POSITION:
        result["ppl"], result["tokens_scored"] = result["ppl_all_positions"], n_windows * window
    else:
        result["ppl"], result["tokens_scored"] = result["ppl_excluding_first"], rest_tokens
    return result
