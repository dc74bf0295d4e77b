"""What a GPN's forward accepts, and clear errors for what it cannot take.

A GPN is called by tools written for attention models (generate(), Trainer, PEFT, TRL, evaluation harnesses):
they pass arguments a recurrence has no use for, and users pass ids, masks and caches of the wrong kind. The
forward checks its arguments here, before anything runs, so a wrong one is an error naming it instead of an
index error from deep inside or, worse, an argument ignored in silence. `modeling_gpn.py` calls these at the top
of each forward; the one-call decode (`fast_recurrence.py`) and the chunked prefill (`prefill.py`) call the same.

Shipped to the Hub with `modeling_gpn.py` as remote code (it imports only its siblings).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import Cache

if TYPE_CHECKING:
    from .configuration_gpn import GPNConfig

from .cache import GPNCache
from .packing import PACKING_KWARGS
from .state_file import state_shapes
from .tracing import is_tracing

# What generate(), Trainer, PEFT and evaluation harnesses pass for attention models, and a GPN has no use
# for: position and cache positions (a recurrence knows where it is; position ids are read only for where packed
# sequences start, see `packed_sequence_starts`), attention outputs when not asked for (asked for, they are
# refused: `refuse_attention_outputs`), token types, and generate()'s own helpers (`tokenizer` for stop
# strings, `assistant_tokenizer`).
IGNORED_FORWARD_KWARGS = frozenset(
    {
        "position_ids",
        "cache_position",
        "output_attentions",
        "token_type_ids",
        "tokenizer",
        "assistant_tokenizer",
    }
)
# those a decoded token may be given and still run in one C call (position ids may say where packed sequences start)
DECODED_TOKEN_KWARGS = IGNORED_FORWARD_KWARGS - {"position_ids"}


def check_unused_kwargs(kwargs: dict) -> None:
    """Accept the harmless extras of `IGNORED_FORWARD_KWARGS` and the packing arguments (`PACKING_KWARGS`,
    read by `GPNModel.forward`); refuse everything else by name."""
    unknown = set(kwargs) - IGNORED_FORWARD_KWARGS - PACKING_KWARGS
    if unknown:
        raise TypeError(f"GPN forward got unexpected arguments: {sorted(unknown)}")


def refuse_attention_outputs(output_attentions: bool | None, config_default: bool) -> None:
    """`output_attentions=False` (or None) is what tools pass every model; asked for (here or in the config,
    `config_default`), a GPN has none to give, and an `attentions` of None would pass for an answer."""
    if output_attentions if output_attentions is not None else config_default:
        raise ValueError(
            "output_attentions=True: a GPN has no attention layers, so it has no attention weights to return; "
            "what it keeps of the past is its state: ask for `output_predicted_states=True` or, with memory, "
            "`output_memory_decays=True` (each head's retention at every position)"
        )


def pop_cache_alias(cache: Cache | None, kwargs: dict) -> Cache | None:
    """`past_key_values=` is the deprecated name of `cache=` (transformers 5 still accepts it): map it, once."""
    if "past_key_values" not in kwargs:
        return cache
    alias = kwargs.pop("past_key_values")
    if alias is None:
        return cache
    if cache is not None:
        raise ValueError("Pass the cache as `cache` or as `past_key_values` (deprecated), not both")
    if not is_tracing():
        warnings.warn("`past_key_values` is deprecated; pass the GPNCache as `cache`", FutureWarning, stacklevel=3)
    return alias


def check_cache_type(cache: object) -> None:
    """A GPN reads and writes its state only in a `GPNCache`; any other cache (a `DynamicCache` of keys and values,
    as PEFT's prefix tuning builds) is refused by name, not read as if it held one."""
    if cache is not None and not isinstance(cache, GPNCache):
        raise TypeError(
            f"A GPN can only continue from a GPNCache, got {type(cache).__name__}: a GPN has no attention layers, so "
            "a cache of keys and values (a DynamicCache or StaticCache, PEFT's prefix tuning) does not apply. Pass a "
            "GPNCache or none (generate() makes one, for cache_implementation='static' too); of PEFT's methods, "
            "prompt tuning and LoRA apply"
        )


def batch_state_shapes(config: GPNConfig, batch_size: int) -> tuple[tuple[int, ...], ...]:
    """The shapes of the state (p, g, M) of `batch_size` rows of a model of `config` (M is (rows, 0) without
    memory), as `GPNModel.zero_state` makes it: a row's shapes (`state_file.state_shapes`), `batch_size` of them."""
    return tuple((batch_size, *shape) for shape in state_shapes(config).values())


def check_cache_state(state: tuple[torch.Tensor, ...], config: GPNConfig, batch_size: int) -> None:
    """A cache's state (p, g, M) must have the shapes of this model's, for `batch_size` rows: a cache filled by
    another model (another width, other memory heads, or none) failed inside a matrix product or a kernel's
    argument check, naming neither the cache nor the model."""
    rows = state[0].shape[0]
    if rows != batch_size:
        raise ValueError(f"The cache holds {rows} rows but the input has {batch_size}")
    for name, tensor, expected in zip(("p", "g", "memory"), state, batch_state_shapes(config, rows)):
        if tuple(tensor.shape) != expected:
            raise ValueError(
                f"The cache holds a state of another model: its {name} has shape {tuple(tensor.shape)}, this model's "
                f"has {expected} (hidden_size={config.hidden_size}, "
                + (
                    f"memory {config.num_memory_heads} heads of {config.memory_key_dim} x {config.memory_value_dim}"
                    if config.use_memory
                    else "no memory"
                )
                + "); continue a cache only with the model that filled it"
            )


# The id dtypes torch's embedding takes (int32 gives the same outputs as int64); any other, even an integer
# one, is refused by name instead of failing inside the embedding.
EMBEDDING_ID_DTYPES = (torch.int64, torch.int32)


def check_input_ids(input_ids: torch.Tensor, vocab_size: int) -> None:
    """(batch, seq) integer ids, each in [0, vocab_size): the first id outside is named with its
    position (an id from another tokenizer would otherwise fail inside the embedding, or on a GPU, later)."""
    if not isinstance(input_ids, torch.Tensor):  # (a list or an array failed on a missing attribute)
        raise TypeError(
            f"input_ids must be a torch.Tensor of token ids, shape (batch, seq), got {type(input_ids).__name__}: "
            "pass torch.tensor(ids) (a tokenizer's return_tensors='pt' gives one)"
        )
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must have shape (batch, seq), got {tuple(input_ids.shape)}")
    if input_ids.dtype not in EMBEDDING_ID_DTYPES:  # (int16 / uint8 ids failed inside torch's embedding)
        raise ValueError(
            f"input_ids must be integer token ids of dtype torch.int64 (or torch.int32), got dtype {input_ids.dtype}: "
            "pass input_ids.long()"
        )
    if is_tracing():  # a value check cannot be decided on symbolic tensors (the embedding still bounds-checks)
        return
    bad = (input_ids < 0) | (input_ids >= vocab_size)
    if bad.any():
        position = bad.nonzero()[0].tolist()
        value = int(input_ids[tuple(position)])
        raise ValueError(
            f"Token id {value} at (row {position[0]}, position {position[1]}) is outside the vocabulary "
            f"[0, {vocab_size}) of this model (vocab_size={vocab_size}); {int(bad.sum())} ids are out of range. "
            "Was the text tokenized with a different tokenizer?"
        )


def check_labels(labels: torch.Tensor | None, name: str, vocab_size: int) -> None:
    """`labels` / `shift_labels`: int64 token ids in [0, vocab_size), or -100 (ignored). Any other id (from another
    tokenizer, a -1 for padding) failed inside torch's cross-entropy, and on a GPU as a device-side assert that
    ends the process; float or int32 labels failed there by dtype. The first bad one is named with its position."""
    if labels is None:
        return
    if labels.dtype != torch.int64:
        raise ValueError(f"{name} must be token ids of dtype torch.int64 (-100 to ignore), got dtype {labels.dtype}")
    if is_tracing():
        return
    bad = ((labels < 0) | (labels >= vocab_size)) & (labels != -100)
    if bad.any():
        position = bad.nonzero()[0].tolist()
        value = int(labels[tuple(position)])
        # (labels of another shape than (batch, seq) are the loss's to refuse: named here by their index)
        where = f"(row {position[0]}, position {position[1]})" if len(position) == 2 else f"index {tuple(position)}"
        raise ValueError(
            f"{name} holds {value} at {where}: a label must be a token id in "
            f"[0, {vocab_size}) of this model (vocab_size={vocab_size}), or -100 for a position without a loss; "
            f"{int(bad.sum())} labels are out of range"
        )


PROBLEM_TYPES = ("regression", "single_label_classification", "multi_label_classification")


def classification_problem_type(config: GPNConfig, labels: torch.Tensor) -> tuple[str, str]:
    """The problem type transformers' `ForSequenceClassificationLoss` settles for `labels`, and how it was settled:
    `config.problem_type` where set, else regression for `num_labels=1`, single-label classification for integer
    labels (int64 or int32), multi-label classification for any other dtype."""
    if config.problem_type is not None:
        return config.problem_type, f"config.problem_type={config.problem_type!r}"
    how = f"config.problem_type unset, num_labels={config.num_labels}"
    if config.num_labels == 1:
        return "regression", how
    if labels.dtype in (torch.int64, torch.int32):
        return "single_label_classification", f"{how}, integer labels"
    return "multi_label_classification", f"{how}, labels of dtype {labels.dtype}"


def check_classification_labels(labels: object, config: GPNConfig, batch_size: int) -> None:
    """A sequence classifier's `labels`, for the problem type transformers' loss settles (`classification_problem_type`):
    regression, real numbers (batch,) or (batch, 1) for one label, (batch, num_labels) for more; single-label, int64
    class ids (batch,) in [0, num_labels) or -100 (ignored); multi-label, floats (batch, num_labels). Other dtypes and
    shapes failed inside torch's losses naming neither the labels nor the problem type (int32 class ids, ids out of
    range: on a GPU a device-side assert), or, worse, were broadcast against the scores with a warning at most (a
    regression label of another shape, as (batch, 2) or one label for the batch)."""
    if labels is None:
        return
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"labels must be a torch.Tensor, got {type(labels).__name__}")
    problem, how = classification_problem_type(config, labels)
    num_labels, shape, dtype = config.num_labels, tuple(labels.shape), labels.dtype
    if problem not in PROBLEM_TYPES:
        raise ValueError(f"config.problem_type={problem!r} is none of {', '.join(PROBLEM_TYPES)}")
    # one number a row: (batch,) or (batch, 1), and () for a single row (transformers' loss squeezes both sides)
    one_a_row = [(batch_size,), (batch_size, 1)] + ([()] if batch_size == 1 else [])
    expected_shapes = {
        "regression": one_a_row if num_labels == 1 else [(batch_size, num_labels)],
        "single_label_classification": one_a_row,
        "multi_label_classification": [(batch_size, num_labels)],
    }[problem]
    if problem == "regression":
        dtype_ok, wanted, cast = not dtype.is_complex and dtype != torch.bool, "real numbers", "float"
    elif problem == "single_label_classification":
        dtype_ok, wanted, cast = dtype == torch.int64, "class ids of dtype torch.int64", "long"
    else:
        dtype_ok, wanted, cast = dtype.is_floating_point, "floats (1.0 where a class applies)", "float"
    fixes = [] if dtype_ok else [f"pass labels.{cast}()"]
    # where the labels' dtype settled the problem type, what the other dtype would have meant
    if config.problem_type is None and problem == "multi_label_classification" and shape in one_a_row:
        fixes.append("class ids for single-label classification are int64: pass labels.long()")
    elif config.problem_type is None and problem == "single_label_classification" and shape == (batch_size, num_labels):
        fixes.append("the classes of multi-label classification are floats: pass labels.float()")
    if not dtype_ok or shape not in expected_shapes:
        raise ValueError(
            f"labels of dtype {dtype} and shape {shape} do not fit {problem} ({how}): it takes {wanted} of shape "
            + " or ".join(str(s) for s in expected_shapes)
            + "".join(f"; {fix}" for fix in dict.fromkeys(fixes))
        )
    if problem != "single_label_classification" or is_tracing():
        return
    ids = labels.reshape(-1)  # (one a row)
    bad = ((ids < 0) | (ids >= num_labels)) & (ids != -100)
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"labels hold {int(ids[row])} at row {row}: a class id must be in [0, {num_labels}) "
            f"(num_labels={num_labels}), or -100 for a row without a loss"
        )


def positions_to_keep(logits_to_keep: int | torch.Tensor, seq_len: int) -> slice | torch.Tensor:
    """The positions whose logits the causal LM returns, read as transformers' causal LMs read `logits_to_keep`: an
    int keeps the last that many (0: every position), a 1-D integer tensor names the positions to keep (the packed
    form transformers documents). A tensor was read as a count: `torch.tensor([3])` returned the last three
    positions, not position 3, and two indices failed on a tensor's truth value; a negative count kept all but the
    first few. Both are refused by name, as is an index outside the `seq_len` positions."""
    if isinstance(logits_to_keep, torch.Tensor):
        if logits_to_keep.dim() != 1 or logits_to_keep.dtype not in EMBEDDING_ID_DTYPES:
            raise ValueError(
                "logits_to_keep must be an int (keep the last that many positions, 0 for all) or a 1-D integer "
                f"tensor of the positions to keep, got a tensor of shape {tuple(logits_to_keep.shape)} and dtype "
                f"{logits_to_keep.dtype}"
            )
        if not is_tracing() and bool(((logits_to_keep < -seq_len) | (logits_to_keep >= seq_len)).any()):
            raise ValueError(
                f"logits_to_keep names positions {logits_to_keep.tolist()} but the input has {seq_len} positions"
            )
        return logits_to_keep
    if not isinstance(logits_to_keep, int) or logits_to_keep < 0:
        raise ValueError(
            "logits_to_keep must be an int >= 0 (keep the last that many positions, 0 for all) or a 1-D integer "
            f"tensor of the positions to keep, got {logits_to_keep!r}"
        )
    return slice(-logits_to_keep, None)


def check_not_empty(batch_size: int, seq_len: int) -> None:
    """At least one row and one position (of ids or embeddings), with what an empty prompt may have meant: the
    prediction made before any token."""
    if batch_size == 0 or seq_len == 0:
        raise ValueError(
            f"GPN needs at least one row and one token, got input of shape (batch={batch_size}, seq={seq_len}); the "
            "prediction from the empty state, before any token, is `model.empty_state_logits()`"
        )


def check_attention_mask(
    attention_mask: torch.Tensor | None, batch_size: int, seq_len: int, continuing: bool
) -> torch.Tensor | None:
    """Return a (batch, seq) boolean mask of the given positions, or None when every position is real. Continuing
    a cache, the mask may be longer than the input (generate() passes the whole sequence's): its last columns."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2 or attention_mask.shape[0] != batch_size:
        raise ValueError(
            f"attention_mask must have shape (batch={batch_size}, seq) like input_ids, got {tuple(attention_mask.shape)}"
        )
    mask_len = attention_mask.shape[1]
    if mask_len < seq_len or (mask_len > seq_len and not continuing):
        raise ValueError(
            f"attention_mask has {mask_len} columns but input_ids has {seq_len} tokens; a longer mask is only "
            "accepted when continuing from a cache (its last columns are used)"
        )
    mask = attention_mask[:, -seq_len:]
    if is_tracing():  # keep the mask (an all-ones mask computes the same); no value checks on symbolic tensors
        return mask.bool()
    if mask.dtype != torch.bool and not ((mask == 0) | (mask == 1)).all():
        raise ValueError("attention_mask must contain only 0 (padding) and 1 (real token)")
    if bool(mask.bool().all()):
        return None
    return mask.bool()


def refuse_state_not_float32(block: torch.nn.Module, **state: torch.Tensor | None) -> None:
    """Refuse a recurrent state (p, g) or memory M reaching `block`'s forward in another dtype than float32, in one
    line naming the cause. The state never leaves float32 by itself (every projection returns float32): what casts
    it is FSDP2's mixed precision on a block sharded apart (`MixedPrecisionPolicy(cast_forward_inputs=True)`, its
    default, casts every floating input of the block's call to `param_dtype`), which would round the state at every
    token, or fail deep in the memory write ("expected scalar type Float but found BFloat16"). A dtype comparison
    per call of the plain loop, no more (the fast path calls no block)."""
    for name, tensor in state.items():
        if tensor is not None and tensor.dtype != torch.float32:
            block_name = type(block).__name__.removeprefix("FSDP")  # (FSDP2 renames a class it shards apart)
            raise TypeError(
                f"{block_name} got the recurrent {name} in {tensor.dtype}, not float32 (the state is "
                "kept in float32 at every token): FSDP2's mixed precision casts the inputs of a block sharded apart to "
                "its param_dtype; shard it with MixedPrecisionPolicy(cast_forward_inputs=False) (what `gpn train` sets), "
                "or shard the model as one unit"
            )


def output_table_dtype(embedding: torch.nn.Module) -> torch.dtype:
    """The dtype of `embedding`'s weight, which is a GPN's output matrix too. An embedding without a weight tensor is
    refused in one line naming the fix: torch.ao's eager quantized embedding (quantize_dynamic with an nn.Embedding
    qconfig) holds packed rows behind a `weight()` method, no table the output could follow (unchecked, the decode
    fails reading `.dtype` of a method, naming neither the embedding nor the fix)."""
    weight = getattr(embedding, "weight", None)
    if not isinstance(weight, torch.Tensor):
        kind = type(embedding)
        raise TypeError(
            f"model.embed_tokens is a {kind.__module__}.{kind.__qualname__} without a weight tensor, and a "
            "GPN's output matrix is its embedding table: leave the embedding float (quantize_dynamic(model, "
            "{nn.Linear})), or quantize it with torchao's quantize_ and call model.tie_weights()"
        )
    return weight.dtype
