"""generate() on a GPN: the cache it gets, how it continues from a kept state, and what it refuses.

transformers' `GenerationMixin` is written for attention models with a cache that grows; a GPN's cache is one
fixed-size state a row, updated in place, that cannot be rolled back. `GPNForCausalLM` overrides a few of
generate()'s steps, each a thin call of a function here:

- `generation_cache`: a `GPNCache` for every cache kind it is (dynamic, static), the others refused by name, and
  refusals of what would need a state rolled back (a GPN as assisted decoding's draft, beams from a kept state);
- `continue_from_cache`: a kept state continued with the whole sequence so far or only the new positions
  (`cache.continuation_start` tells them apart), never a position read twice;
- `refuse_hub_decoding_a_state_cannot_run`: DoLa and contrastive search, which transformers 5 loads from the Hub
  (`custom_generate`), refused before anything is fetched; `custom_generate_offline_error`: a Hub decoding method
  under HF_HUB_OFFLINE that is not in the local cache, said so;
- `SyncedPeer`: under `synced_gpus` (DeepSpeed ZeRO-3, FSDP), the forwards a process runs after its rows have all
  finished, only to keep the processes' collectives matched, run on a throwaway copy of the cache;
- checks once per call: the prompt's shapes, PEFT's prompt-learning generate (which would re-read its virtual
  tokens at every token), and the prompt's logits, which must be finite before any token is picked from them.

docs/generate.md and docs/cache.md are the user's pages. Shipped to the Hub with `modeling_gpn.py` as remote code.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn
from transformers.generation.configuration_utils import GenerationMode
from transformers.modeling_outputs import ModelOutput

if TYPE_CHECKING:
    from transformers import GenerationConfig
    from transformers.generation.utils import GenerateOutput

    from .configuration_gpn import GPNConfig

from .arguments import check_cache_type
from .cache import GPNCache, continuation_start
from .tracing import is_tracing

# generate()'s cache kinds a GPNCache is: one state a row updated in place (dynamic), of one size at every length
# (static, so compiled decoding steps keep their shapes)
GENERATION_CACHE_IMPLEMENTATIONS = ("dynamic", "static")


def generation_cache(config: GPNConfig, generation_config: GenerationConfig, model_kwargs: dict) -> GPNCache | None:
    """The cache generate() decodes with: the caller's (checked), else a new `GPNCache` (None without a cache,
    `use_cache=False`). A GPNCache is what `cache_implementation` "dynamic" and "static" ask for; the other kinds
    (offloaded, quantized, sliding-window) are refused, not ignored, as is a cache_implementation beside a cache,
    which transformers refuses too, and a GPN as the draft model of assisted decoding (its cache would have to be
    rolled back)."""
    if getattr(generation_config, "is_assistant", False):
        # transformers refuses a stateful main model itself, but not a stateful draft: it crops the draft's cache
        # to the accepted tokens after every round, which failed deep in transformers' cache code
        raise ValueError(
            "A GPN cannot be the assistant (draft) model of assisted decoding: after every round the draft's cache "
            "is rolled back to the tokens the main model accepted, and a GPN's state cannot be rolled back. "
            "Decode without `assistant_model`"
        )
    user_cache = model_kwargs.get("cache")
    requested = generation_config.cache_implementation
    if requested is not None and user_cache is not None:
        raise ValueError(
            "Passing both `cache_implementation` and `cache` (a GPNCache) is unsupported: use only one of the two"
        )
    if requested not in (None, *GENERATION_CACHE_IMPLEMENTATIONS):
        raise ValueError(
            f"cache_implementation={requested!r} does not apply to a GPN: its cache is one state a row (hidden "
            f"states and memory, {config.state_floats_per_row * 4:,} bytes, the same at every length), "
            f"updated in place; leave cache_implementation unset or use one of {GENERATION_CACHE_IMPLEMENTATIONS}"
        )
    if user_cache is not None:
        check_cache_type(user_cache)
        user_cache.refuse_if_interrupted()  # (before continue_from_cache judges its fingerprint)
        if (generation_config.num_beams or 1) > 1 and user_cache.has_state:
            # Beam search widens the rows but not a given cache, and drops an all-ones attention mask (with it,
            # how many positions the state has read): refused here, not by a row count the caller never chose.
            raise ValueError(
                f"Beam search (num_beams={generation_config.num_beams}) cannot continue from a given cache that "
                f"already holds a state ({user_cache.get_seq_length()} positions read): decode greedily or sample "
                "from a state, or run the beam search on the whole prompt"
            )
        user_cache._is_user_defined = True
        return user_cache
    if generation_config.use_cache is False:
        return None
    return GPNCache(config)


def _token_ids(value: int | list[int] | torch.Tensor | None) -> list[int]:
    """A generation config's token id (an int, a list of them, a tensor or None) as a list of ints."""
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        return [int(v) for v in value.reshape(-1).tolist()]
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


# What beam search preallocates per (row, beam, position) of `max_length` (transformers' `_beam_search`): the
# running and finished sequences (int64) and their beam indices (int32)
BEAM_SEARCH_BYTES_PER_POSITION = 2 * 8 + 2 * 4


def device_memory_bytes(device: torch.device | None) -> int | None:
    """The memory of `device` (a GPU's total, the CPU's physical memory), or None where it cannot be read."""
    try:
        if device is not None and device.type == "cuda":
            return torch.cuda.get_device_properties(device).total_memory
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError, RuntimeError):
        return None


def check_generation_values(
    config: GPNConfig, generation_config: GenerationConfig, batch_size: int, device: torch.device | None
) -> None:
    """Values of the generation config that would be wrong in silence, or fail far from their cause, refused by name:

    - `num_return_sequences` below 1 gave one sequence a row (transformers expands by max(beams, sequences));
    - an `eos_token_id` outside the vocabulary can never be generated (generation ran to its length without a
      word); a `pad_token_id` outside it is written after a row's end and, greedy or sampling, fed back to the
      model, whose id check then blamed the prompt's tokenizer;
    - beam search preallocates its sequences for `max_length` positions: a huge `max_new_tokens` tried to
      allocate terabytes (greedy decoding and sampling allocate as they go, so they are not limited here);
    - a `prefill_chunk_size` that is not a positive integer failed inside torch's `split` after the prompt was
      prepared (0 and negative sizes, a float), and `True` prefilled one position a chunk.
    """
    returned = generation_config.num_return_sequences
    if returned is not None and returned < 1:
        raise ValueError(f"num_return_sequences must be at least 1, got {returned}")
    chunk = getattr(generation_config, "prefill_chunk_size", None)
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ValueError(
            f"prefill_chunk_size must be a positive integer (positions a prefill chunk reads) or None, got {chunk!r}"
        )
    vocab_size = config.vocab_size
    for name in ("eos_token_id", "pad_token_id"):
        outside = [i for i in _token_ids(getattr(generation_config, name)) if not 0 <= i < vocab_size]
        if outside:
            raise ValueError(
                f"{name}={outside[0]} (generation config) is outside the vocabulary [0, {vocab_size}) of this model: "
                + (
                    "it can never be generated, so generation would never stop on it"
                    if name == "eos_token_id"
                    else "generate() writes it after a finished row's end and, greedy or sampling, feeds it back to the model"
                )
                + "; pass the tokenizer's id, or resize the model's embeddings (resize_token_embeddings) first"
            )
    beams = generation_config.num_beams or 1
    if beams > 1 and generation_config.max_length is not None:
        needed = batch_size * beams * generation_config.max_length * BEAM_SEARCH_BYTES_PER_POSITION
        available = device_memory_bytes(device)
        if available is not None and needed > available:
            raise ValueError(
                f"Beam search preallocates its sequences for max_length={generation_config.max_length} positions: "
                f"{batch_size} rows x {beams} beams need {needed / 2**30:,.0f} GiB, more than the "
                f"{available / 2**30:,.0f} GiB of {device or 'the CPU'}; ask for fewer new tokens (max_new_tokens)"
            )


# Decoding methods transformers 5 moved to the Hub (`custom_generate`) that a GPN cannot run, and why
HUB_DECODING_A_STATE_CANNOT_RUN = {
    GenerationMode.DOLA_GENERATION: (
        "DoLa (dola_layers) contrasts the final layer's logits with earlier layers' ones, and a GPN has no earlier "
        "layers: its depth is time (one layer revisited at every token), and its hidden_states are only the "
        "embedding output and the decoded vector"
    ),
    GenerationMode.CONTRASTIVE_SEARCH: (
        "contrastive search (penalty_alpha) runs every candidate token and then rolls the cache back to the chosen "
        "one, and a GPN's state cannot be rolled back"
    ),
}


def refuse_hub_decoding_a_state_cannot_run(generation_mode: GenerationMode | str | None) -> None:
    """DoLa and contrastive search: transformers 5 runs them from Hub repos (`custom_generate`, after asking for
    `trust_remote_code`), code written for attention models; on a GPN they cannot mean what they say (see
    `HUB_DECODING_A_STATE_CANNOT_RUN`). Refused by name before anything is fetched, rather than left to fail deep in
    downloaded code or to decode something else."""
    reason = HUB_DECODING_A_STATE_CANNOT_RUN.get(generation_mode)
    if reason is not None:
        raise ValueError(f"{reason}: decode greedily, sample or use beam search")


def refuse_assisted_decoding(generation_mode: GenerationMode, assistant_model: object = None) -> None:
    """Assisted decoding with a GPN as the main model (`assistant_model`, `prompt_lookup_num_tokens`, `use_mtp`,
    `assistant_early_exit`): after every round the main model's cache is rolled back to the draft tokens it accepted,
    and a GPN's state cannot be rolled back. transformers 5.24 refused it for every stateful model before anything
    ran; 5.25 refuses it only after the first forward, which has advanced a cache the caller passed. Refused here,
    before any forward, on both. An `assistant_model` beside beam search, which transformers only warns it ignores,
    is refused too: transformers hands it on to the forward, which failed naming an unexpected argument."""
    if generation_mode == GenerationMode.ASSISTED_GENERATION:
        raise ValueError(
            "Assisted decoding (assistant_model, prompt_lookup_num_tokens, use_mtp, assistant_early_exit) cannot run "
            "with a GPN as the main model: after every round its cache is rolled back to the draft tokens it "
            "accepted, and a GPN's state cannot be rolled back. Decode without them"
        )
    if assistant_model is not None:
        raise ValueError(
            f"assistant_model with {getattr(generation_mode, 'value', generation_mode)}: transformers assists only "
            "greedy decoding and sampling (it would ignore the assistant here), and a GPN cannot be assisted at all "
            "(its state cannot be rolled back to the accepted draft tokens). Decode without assistant_model"
        )


def custom_generate_offline_error(name: object) -> OSError | None:
    """transformers says a Hub repo given as `custom_generate` "does not contain a `custom_generate` subdirectory"
    whenever it cannot see the file, which under HF_HUB_OFFLINE=1 only means it is not in the local cache: the
    error that says so (None where the original is right: online, or a local folder)."""
    from huggingface_hub import constants

    if not constants.is_offline_mode() or not isinstance(name, str) or os.path.isdir(name):
        return None
    return OSError(
        f"custom_generate={name!r}: HF_HUB_OFFLINE is set and the repo's custom_generate/generate.py is not in the "
        "local Hub cache; download it once online, or pass a local folder that holds custom_generate/generate.py"
    )


def continue_from_cache(
    input_ids: torch.Tensor, generation_config: GenerationConfig, model_kwargs: dict
) -> tuple[torch.Tensor, dict, int]:
    """The prompt generate()'s prefill should run from a given cache, as (input_ids, model_kwargs, positions the
    cache had read); without a state, the call's own arguments and 0.

    transformers' models continue in two ways: with the whole sequence so far (as with a KV cache) or with only
    the new positions (as Mamba and its other recurrent models). A `GPNCache` tells them apart by what it has read
    (`continuation_start`: a fingerprint of fixed size, kept in place) and feeds only the positions after those;
    where it cannot tell, it refuses, saying what to pass. It never feeds a position twice: a recurrent state
    cannot be rolled back. What it cannot judge (new positions that repeat exactly what was read; a cache after
    beam search, whose rows are the last step's beams) is listed in `continuation_start` and docs/cache.md. With
    `num_return_sequences`, a cache of one row a prompt is repeated as the prompts were. Where generate() dropped an
    all-ones mask, `generation_config._mask_length` is set to cover the positions read and those kept, so that the
    prefill takes the kept ones as new.
    """
    cache = model_kwargs.get("cache")
    seen = cache.get_seq_length() if isinstance(cache, GPNCache) and cache.has_state else 0
    if not seen:
        return input_ids, model_kwargs, 0
    embeds = model_kwargs.get("inputs_embeds")
    mask = model_kwargs.get("attention_mask")
    # generate() drops an all-ones mask before the prefill and keeps only its length
    mask_columns = mask.shape[1] if mask is not None else getattr(generation_config, "_mask_length", None)
    # num_return_sequences: transformers repeated each prompt's row n times (rows i*n ... i*n + n - 1) but not a
    # given cache's; a cache of one row a prompt is judged on the prompts' own rows, then repeated in place as they
    # were (`fork`'s order), so a refused call leaves it as it was given
    copies = generation_config.num_return_sequences or 1
    prompt_rows = (input_ids if embeds is None else embeds).shape[0]
    repeat = copies if copies > 1 and cache.state_layer.batch_size * copies == prompt_rows else 1
    start = continuation_start(
        cache,
        seen,
        input_ids[::repeat] if embeds is None else None,
        None if embeds is None else embeds[::repeat],
        None if mask is None else mask[::repeat],
        mask_columns,
    )
    if repeat > 1:
        cache.batch_repeat_interleave(repeat)
    if start and embeds is not None:
        model_kwargs = {**model_kwargs, "inputs_embeds": embeds[:, start:]}
    elif start:
        input_ids = input_ids[:, start:]
    given = (input_ids if embeds is None else embeds).shape[1]
    if mask is None:
        # the length of the all-ones mask generate() dropped, as over the whole sequence (transformers' convention
        # for new positions given with a cache): transformers 5.25's prefill takes ids whose mask is as long as
        # they are for the whole sequence and slices them by the positions the cache read, which would drop
        # positions chosen here (5.24 did not slice for a recurrent cache)
        generation_config._mask_length = seen + given
    if mask is not None and not start and mask.shape[1] == given:
        # a mask over the new positions only: transformers' chunked prefill (`prefill_chunk_size`) slices the mask
        # as one over the whole sequence, read positions first, and gave a chunk the wrong columns; the read
        # positions' columns are put in front (their value is not used: the state has read them)
        mask = torch.cat([mask.new_ones(mask.shape[0], seen), mask], dim=1)
        model_kwargs = {**model_kwargs, "attention_mask": mask}
    return input_ids, model_kwargs, seen


# The model_kwargs entry that hands a synced decoding's `SyncedPeer` to `prepare_inputs_for_generation`: a key
# beyond the decoded token's own, so only a synced decoding leaves the per-token fast path to look at it
SYNCED_PEER = "gpn_synced_peer"


class SyncedPeer:
    """One process's side of a generate() under `synced_gpus`, which transformers turns on by itself for a model
    under DeepSpeed ZeRO-3 or FSDP with more than one process (or the caller does).

    Once this process's rows have all finished, transformers' decoding loops (`_sample`, `_beam_search`) go on
    calling the model's forward on the last tokens until every process has finished, only so that the collectives
    (the sharded weights' gathers) stay matched, and drop what it returns. For a KV cache that only appends entries
    past the returned sequences; a GPN's state would read them, and the cache generate() returns (or advanced in
    place for the caller) would hold a state past its sequences, continued in silence as if it were theirs. Those
    idle forwards run on a copy of the cache instead (`cache_for_forward`): the same forward and collectives, and
    the cache kept holds exactly the state of the sequences returned. Nothing of this runs without `synced_gpus`.
    """

    def __init__(self) -> None:
        self.finished = False  # this process's rows have all finished while others go on: its next forward is idle
        self.kept: GPNCache | None = None  # the cache that holds the sequences' state, from the first idle forward
        self.scratch: GPNCache | None = None  # its copy, which the idle forwards advance

    def cache_for_forward(self, cache: GPNCache) -> GPNCache:
        """The cache the next forward should advance: `cache`, or for an idle forward a throwaway copy of it
        (made once; transformers then hands back that copy, which the later idle forwards advance in turn)."""
        if not self.finished or not isinstance(cache, GPNCache) or not cache.has_state:
            return cache
        if cache is not self.scratch:
            self.kept, self.scratch = cache, cache.fork(1)
        return self.scratch

    def returned(self, result: GenerateOutput | torch.LongTensor) -> GenerateOutput | torch.LongTensor:
        """The decoding loop's result with the kept cache where transformers put the last one it was handed back
        (the throwaway copy, after idle forwards)."""
        if self.scratch is not None and isinstance(result, ModelOutput) and result.get("cache") is self.scratch:
            result["cache"] = self.kept
        return result


def decode_keeping_the_sequences_state(
    model: nn.Module,
    loop: Callable[..., GenerateOutput | torch.LongTensor],
    args: tuple,
    synced_gpus: bool,
    model_kwargs: dict,
) -> GenerateOutput | torch.LongTensor:
    """Run transformers' decoding `loop` (the bound `_sample` or `_beam_search` of `model`'s class). Under
    `synced_gpus` a `SyncedPeer` goes with it: in `model_kwargs` (for `prepare_inputs_for_generation`) and on the
    model (for `_has_unfinished_sequences`, which alone sees whether this process has finished and is not given the
    model_kwargs) while the loop runs, and the result holds the cache of the sequences returned. Either way, a state
    gone non-finite at a decoded token is refused after the loop (`refuse_non_finite_decoded_state`)."""
    if not synced_gpus:
        result = loop(*args, **model_kwargs)
    else:
        peer = model_kwargs[SYNCED_PEER] = SyncedPeer()
        model.__dict__["_gpn_synced_peer"] = peer
        try:
            result = peer.returned(loop(*args, synced_gpus=True, **model_kwargs))
        finally:
            model.__dict__.pop("_gpn_synced_peer", None)
    refuse_non_finite_decoded_state(model, model_kwargs.get("cache"))
    return result


def refuse_peft_prompt_learning_generate(model: nn.Module) -> None:
    """PEFT's generate for its prompt-learning methods (prompt tuning, p-tuning, prefix tuning) swaps in its own
    `prepare_inputs_for_generation`, which looks for the cache under its old name, `past_key_values`: finding none at
    any token, it prepends the virtual tokens again at every decoded token, and the state reads them again (a
    Llama's output is wrong the same way). Refused by name rather than decoded wrong; the base model's generate
    on the prompt's embeddings computes what was meant (docs/fine-tuning.md)."""
    swapped = model.__dict__.get("prepare_inputs_for_generation")
    peft_config = getattr(getattr(swapped, "__self__", None), "active_peft_config", None)
    if getattr(peft_config, "is_prompt_learning", False):
        method = getattr(peft_config.peft_type, "value", peft_config.peft_type)
        raise ValueError(
            f"PEFT's generate() with {method} re-inserts the virtual tokens at every decoded token on "
            "transformers 5 (it looks for the cache as `past_key_values`), which a GPN would read into its state: "
            "generate from the base model instead, on the prompt's embeddings: "
            "peft_model.get_base_model().generate(inputs_embeds=torch.cat([peft_model.get_prompt(batch_size), "
            "peft_model.get_input_embeddings()(input_ids)], 1), attention_mask=..., max_new_tokens=...)"
        )


def check_generate_input_shapes(input_ids: torch.Tensor | None, kwargs: dict) -> None:
    """generate() reads the batch and length off `input_ids` and `attention_mask` before the model sees them, and
    drops an all-ones mask unread: one prompt of shape (seq,) failed with a bare IndexError from inside
    transformers, and an all-ones mask of another batch or length was ignored in silence (a mask that has zeros is
    checked by the forward). Named here instead. A mask longer than the prompt is the whole sequence of a
    continued cache (`continuation_start` judges it)."""
    mask = kwargs.get("attention_mask")
    for name, value in (("input_ids", input_ids), ("attention_mask", mask)):
        if isinstance(value, torch.Tensor) and value.dim() != 2:
            raise ValueError(
                f"generate() takes {name} of shape (batch, seq), got {tuple(value.shape)}"
                + (": for one prompt, add the batch dimension (`ids[None]`)" if value.dim() == 1 else "")
            )
    embeds = kwargs.get("inputs_embeds")
    prompt = input_ids if isinstance(input_ids, torch.Tensor) else embeds
    if not isinstance(mask, torch.Tensor) or not isinstance(prompt, torch.Tensor) or prompt.dim() < 2:
        return
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    continuing = isinstance(cache, GPNCache) and cache.has_state
    batch, length = prompt.shape[:2]
    if mask.shape[0] != batch or (mask.shape[1] != length and not continuing):
        raise ValueError(
            f"attention_mask has shape {tuple(mask.shape)} but the prompt has {batch} rows of {length} positions: it "
            "must have one column a position (or, continuing a cache, one a position read and given)"
        )


def refuse_non_finite_prompt_logits(
    model: nn.Module, logits: torch.Tensor | None, copies: int, continued: bool, embeds: bool
) -> None:
    """generate() picks every token from the logits: NaN or inf there (from NaN or inf weights, `inputs_embeds` or the
    state of a cache it continues) would give tokens in silence (greedy's argmax takes a NaN for the largest). The
    prompt's logits are checked once per call (one host sync; nothing per decoded token): every parameter and the
    whole state reach them, so a non-finite value anywhere shows there. The error names where to look, and the rows
    as the caller numbered them (generate() holds `copies` of each: beams or returned sequences)."""
    if logits is None or is_tracing():
        return
    finite = torch.isfinite(logits[:, -1]).all(dim=-1)
    if bool(finite.all()):
        return
    rows = sorted({row // copies for row in (~finite).nonzero().flatten().tolist()})
    where = [
        f"parameter {name}"
        for name, param in model.named_parameters()
        if type(param.data) is torch.Tensor and param.is_floating_point() and not bool(torch.isfinite(param).all())
    ]
    if not where:  # (the state is overwritten by now: only what may have held them can be named)
        where = (
            ["no parameter"] + ["the prompt's inputs_embeds"] * embeds + ["the state of the given cache"] * continued
        )
    raise ValueError(
        f"generate(): the model's logits after the prompt are not finite (NaN or inf) in rows {rows}, and every token "
        f"would be picked from them meaninglessly; non-finite values: {', '.join(where)}"
        + (float16_overflow_hint(model) if where[0] == "no parameter" else "")
    )


def refuse_non_finite_decoded_state(model: nn.Module, cache: object) -> None:
    """Refuse a `cache` whose state went non-finite at a decoded token, after the decoding loop.

    The prompt's check (`refuse_non_finite_prompt_logits`) cannot see a value that overflows later (float16 weights
    whose largest product passes 65504 on some token): the state turns NaN there and stays NaN (every step reads
    it), and greedy's argmax takes the NaN logits' first entry, so every later token was token 0, or generation
    stopped at an eos of id 0, in silence. The state is NaN-sticky, so one check of the final state after the loop
    (one host sync a call, nothing per token) finds any such token; the error says so (and names float16's range
    where the weights are float16) instead of returning the text."""
    if not isinstance(cache, GPNCache) or not cache.has_state or is_tracing():
        return
    if all(bool(torch.isfinite(part).all()) for part in cache.state_buffers()):
        return
    raise ValueError(
        "generate(): the state went non-finite (NaN or inf) at a decoded token after a finite prompt, and the tokens "
        "from there on were picked from NaN logits meaninglessly" + float16_overflow_hint(model)
    )


def float16_overflow_hint(model: nn.Module) -> str:
    """What to tell a user whose finite float16 model computed NaN or inf: the weights' dtype, not the model, is
    where to look. The state and the memory are float32, but every product runs in the weights' dtype, and
    float16's range ends at 65504 (an FFN's large activations pass it; bfloat16 has float32's range). Empty for
    other dtypes."""
    if not any(param.dtype is torch.float16 for param in model.parameters()):
        return ""
    return (
        "; the weights are float16, whose largest value is 65504: a product in the step overflowed (the state is "
        "float32, the products run in the weights' dtype): load the model in bfloat16 or float32 "
        "(`from_pretrained(..., dtype=torch.bfloat16)`, `gpn generate --dtype bfloat16`)"
    )
