"""PyTorch Grounded Prediction Network (GPN).

"A Single-Layer Model Can Do Language Modeling" (arXiv 2605.10643). One state vector and, for GPN+M,
one matrix memory are revisited at every token; depth comes from time, not from a layer stack.

Read this file beside `GPN.md`. For each token x_t, with the carried predicted state p, the carried
grounded state g' (one step older) and the memory M (all zero before the first token):

1. Ground:   g = sigmoid(W_fg rms(p) + b_fg) * p + W_fuse rms(E[x_t])
2. Write:    M <- e^gamma M + beta k (v - M^T k)       (GPN+M; key from g', the rest from g)
3. Predict:  c = g; per predict layer  c <- sigmoid(W_pg rms(c) + b_pg) * c + FFN(c) (+ read(c, M))
4. Decode:   logits = (W_dec rms(p) (+ b_dec)) E^T     with p = c
5. Carry (p, g, M) to the next token.

`GPNModel` runs steps 1-3 and the decoder's d -> e part, so its `last_hidden_state` is W_dec rms(p) (+ b_dec);
`GPNForCausalLM.lm_head` is E (tied to the embedding), so `logits = lm_head(last_hidden_state)`, the layout
transformers' tools assume. The predicted state p is `output_predicted_states=True`.

transformers convention: `logits[:, t]` predicts token t+1 after reading tokens 0..t, so position t of
this model is position t+1 of the reference implementation (see `GPN.md`).

The recurrent state and memory are float32 whatever the weights' dtype, as in the reference.

This file and `configuration_gpn.py` ship to the Hub as remote code: they import nothing from the
installed `modeling_gpn` package.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import os
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import CausalLMOutputWithPast, ModelOutput, SequenceClassifierOutputWithPast
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers.utils import logging

if TYPE_CHECKING:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import GenerationMode
    from transformers.generation.utils import GenerateOutput

from .arguments import (
    DECODED_TOKEN_KWARGS,
    batch_state_shapes,
    check_attention_mask,
    check_cache_state,
    check_cache_type,
    check_classification_labels,
    check_input_ids,
    check_labels,
    check_not_empty,
    check_unused_kwargs,
    output_table_dtype,
    pop_cache_alias,
    positions_to_keep,
    refuse_attention_outputs,
    refuse_state_not_float32,
)
from .cache import CLAIM_ATTRIBUTE, GPNCache, snapshot_before_call, state_entering_call
from .chunked_loss import chunked_causal_lm_loss, divide_loss_sum
from .configuration_gpn import GPNConfig
from .derived_weights import (
    as_read,
    called_as_is,
    derived_weights_scope,
    keep_with,
    registered_global_hook,
    replaced_method,
    replaced_method_reason,
)
from .fast_recurrence import (
    DERIVED_ATTRIBUTES,
    autograd_mode_blocker,
    fast_decode_token,
    fast_project,
    fast_recurrence,
    foldable_parameter,
    log_once,
    output_logits,
)
from .generation import (
    SYNCED_PEER,
    check_generate_input_shapes,
    check_generation_values,
    continue_from_cache,
    custom_generate_offline_error,
    decode_keeping_the_sequences_state,
    generation_cache,
    refuse_assisted_decoding,
    refuse_hub_decoding_a_state_cannot_run,
    refuse_non_finite_prompt_logits,
    refuse_peft_prompt_learning_generate,
)
from .output_layer import (
    mixed_batch_adapter_names,
    mixed_batch_logits,
    output_embeddings,
    refuse_what_fsdp2_cannot_tie,
)
from .packing import add_packing_parameters, packed_sequence_starts, packing_arguments, refuse_packed_rows
from .peft_layers import refuse_split_alora_offsets
from .prefill import forward_in_chunks, prefill_chunk_length_for
from .sharding import check_sharded_lengths, placement_warning, sharded_save_refusal
from .state_file import GPNStateFileError
from .tracing import is_exporting, is_tracing

logger = logging.get_logger(__name__)

L2_NORM_EPS = 1e-12  # inside the square root of every per-head L2 normalisation, as in the reference
DEFAULT_CHECKPOINT_SEGMENT_LENGTH = 64  # what gradient_checkpointing_enable() sets when bptt_segment_length is unset


# --------------------------------------------------------------------------------------------------
# The two normalisations of the equations
# --------------------------------------------------------------------------------------------------


def plus_eps(total: torch.Tensor, eps: float) -> torch.Tensor:
    """`total + eps`, the epsilon under a normalisation's square root. In an exported program it is added as a
    one-element tensor: torch.onnx.export(dynamo=True) optimizes its graph with onnxscript, whose rule for `x + 0`
    (0.7) takes any scalar within 1e-8 of zero for 0 and dropped the L2 normalisation's 1e-12, so a head whose relu'd
    key or query was all zero gave NaN logits and state in the ONNX model (the rule matches scalars only)."""
    if is_exporting():
        return total + total.new_full((1,), eps)
    return total + eps


class GPNRMSNorm(nn.Module):
    """rms(x; w) = x / sqrt(mean(x^2) + eps) * w, computed in float32 (returns float32)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return x * torch.rsqrt(plus_eps(x.pow(2).mean(-1, keepdim=True), self.eps)) * self.weight.float()

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def _is_fsdp_module(module: nn.Module) -> bool:
    """Whether `module` is sharded by FSDP2 (`fully_shard`), whose parameters are gathered only around its own call."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """l2(x) = x / sqrt(sum(x^2) + 1e-12) over the last axis."""
    return x * torch.rsqrt(plus_eps(x.pow(2).sum(-1, keepdim=True), L2_NORM_EPS))


def project(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Call `module` on `x` in its weights' dtype and return float32 (the state never leaves float32).

    The module is *called* (not its weight read), so whatever wraps or replaces it -- a PEFT LoRA layer,
    a quantized linear, a forward hook -- computes the projection. The input is cast to the weight's
    dtype only when that is a floating dtype (a quantized module's int8 weight takes float input).
    """
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.is_floating_point():
        x = x.to(weight.dtype)
    return module(x).float()


def linear(in_features: int, out_features: int, bias: bool, init_scheme: str = "lecun") -> nn.Linear:
    """An `nn.Linear` tagged with its initialisation: "lecun" (default), "zeros" or "normal" (std 0.02)."""
    layer = nn.Linear(in_features, out_features, bias=bias)
    layer.init_scheme = init_scheme
    return layer


def lecun_normal_(weight: torch.Tensor) -> None:
    """LeCun normal as in Flax: truncated at two standard deviations, variance 1 / fan_in."""
    if getattr(weight, "_is_hf_initialized", False):
        return
    fan_in = weight.shape[1]
    std = math.sqrt(1.0 / fan_in) / 0.87962566103423978  # std of a unit normal truncated at +-2
    init.trunc_normal_(weight, mean=0.0, std=std, a=-2 * std, b=2 * std)


# --------------------------------------------------------------------------------------------------
# The blocks of one step
# --------------------------------------------------------------------------------------------------


class GPNMemoryWrite(nn.Module):
    """Step 2: the gated delta-rule write, once per token, shared by all predict layers.

    k = l2(relu(W_k rms(g') + b_k)),  v = W_v rms(g),  beta = sigmoid(W_beta rms(g)),
    gamma = -exp(A_log) * softplus(W_a rms(g) + dt_bias),
    M <- e^gamma M + beta k (v - M^T k)   -- the error term uses the undecayed M.
    """

    def __init__(self, config: GPNConfig):
        super().__init__()
        d, heads = config.hidden_size, config.num_memory_heads
        self.num_heads, self.key_dim, self.value_dim = heads, config.memory_key_dim, config.memory_value_dim
        self.norm = GPNRMSNorm(d, config.rms_norm_eps)
        self.key = linear(d, heads * self.key_dim, bias=True)
        self.value = linear(d, heads * self.value_dim, bias=False)
        self.beta = linear(d, heads, bias=False)
        self.decay = linear(d, heads, bias=False)
        self.A_log = nn.Parameter(torch.zeros(heads))
        self.dt_bias = nn.Parameter(torch.zeros(heads))

    def keys(self, older_grounded: torch.Tensor) -> torch.Tensor:
        """k (batch, H, dk) from the previous grounded state."""
        key = project(self.key, self.norm(older_grounded)).view(-1, self.num_heads, self.key_dim)
        return l2_normalize(F.relu(key))

    def log_decay(self, normed_grounded: torch.Tensor) -> torch.Tensor:
        """gamma (batch, H) <= 0; the per-head retention of one step is exp(gamma)."""
        rate = project(self.decay, normed_grounded) + self.dt_bias.float()
        return -torch.exp(self.A_log.float()) * F.softplus(rate)

    def forward(
        self, memory: torch.Tensor, older_grounded: torch.Tensor, grounded: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the memory after the write and gamma (batch, H)."""
        refuse_state_not_float32(self, memory=memory, older_grounded=older_grounded, grounded=grounded)
        key = self.keys(older_grounded)
        normed = self.norm(grounded)
        value = project(self.value, normed).view(-1, self.num_heads, self.value_dim)
        beta = torch.sigmoid(project(self.beta, normed))
        gamma = self.log_decay(normed)
        error = value - torch.einsum("bhk,bhkv->bhv", key, memory)
        memory = torch.exp(gamma)[..., None, None] * memory + beta[..., None, None] * (
            key.unsqueeze(-1) * error.unsqueeze(-2)
        )
        return memory, gamma


class GPNPredictLayer(nn.Module):
    """Step 3, one predict layer: c <- sigmoid(W_pg rms(c) + b_pg) * c + FFN(c) (+ read(c, M)).

    FFN(c) = W_2 (silu(a) * b) with [a | b] = W_1 rms(c) (the first half gates).
    read(c, M) = (silu(W_rg rms(c)) * rms(M^T q)) W_o with q = l2(relu(W_q rms(c) + b_q)) per head;
    the output norm runs over the whole flattened H*dv read vector.
    """

    def __init__(self, config: GPNConfig):
        super().__init__()
        d, f = config.hidden_size, config.intermediate_size
        eps = config.rms_norm_eps
        self.gate_norm = GPNRMSNorm(d, eps)
        self.gate = linear(d, d, bias=True, init_scheme="zeros")
        self.ffn_norm = GPNRMSNorm(d, eps)
        self.ffn_in = linear(d, 2 * f, bias=False)
        self.ffn_out = linear(f, d, bias=False, init_scheme="zeros")
        self.use_memory = config.use_memory
        if self.use_memory:
            heads, dk, dv = config.num_memory_heads, config.memory_key_dim, config.memory_value_dim
            self.num_heads, self.key_dim, self.value_dim = heads, dk, dv
            self.read_norm = GPNRMSNorm(d, eps)
            self.read_query = linear(d, heads * dk, bias=True)
            self.read_gate = linear(d, heads * dv, bias=False)
            self.read_out_norm = GPNRMSNorm(heads * dv, eps)
            self.read_out = linear(heads * dv, d, bias=False, init_scheme="normal")

    def ffn(self, state: torch.Tensor) -> torch.Tensor:
        gate_branch, value_branch = project(self.ffn_in, self.ffn_norm(state)).chunk(2, dim=-1)
        return project(self.ffn_out, F.silu(gate_branch) * value_branch)

    def read(self, state: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        normed = self.read_norm(state)
        query = l2_normalize(F.relu(project(self.read_query, normed)).view(-1, self.num_heads, self.key_dim))
        read_vector = torch.einsum("bhk,bhkv->bhv", query, memory).flatten(1)
        return project(self.read_out, F.silu(project(self.read_gate, normed)) * self.read_out_norm(read_vector))

    def forward(self, state: torch.Tensor, memory: torch.Tensor | None) -> torch.Tensor:
        refuse_state_not_float32(self, state=state, memory=memory)
        keep = torch.sigmoid(project(self.gate, self.gate_norm(state)))
        new_state = keep * state + self.ffn(state)
        if self.use_memory:
            new_state = new_state + self.read(state, memory)
        return new_state


# --------------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------------


@dataclass
class GPNModelOutput(ModelOutput):
    """Output of `GPNModel`.

    Args:
        last_hidden_state: the decoded vector W_dec rms(p) (+ b_dec) at every position (batch, seq, e): what the
            tied output matrix multiplies, `logits = lm_head(last_hidden_state)`, as a Llama's base model ends with
            its final norm. In the output matrix's dtype (the embedding's); position t predicts token t+1.
        cache: the `GPNCache` after the last position, when `use_cache`.
        hidden_states: with `output_hidden_states`, transformers' convention for a model of one layer (a GPN's
            step, revisited at every token): (the embedding output, `last_hidden_state`).
        memory_decays: with `output_memory_decays` (GPN+M), gamma (batch, seq, H): the log retention
            of each memory head at each position (retention per step = exp(gamma)).
        predicted_states: with `output_predicted_states`, the predicted state p at every position (batch, seq, d),
            float32: the paper's object of study, before the decoder.
    """

    last_hidden_state: torch.Tensor | None = None
    cache: Cache | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    memory_decays: torch.Tensor | None = None
    predicted_states: torch.Tensor | None = None


@dataclass
class GPNCausalLMOutput(CausalLMOutputWithPast):
    """`CausalLMOutputWithPast` plus the per-head memory decays and the predicted states (see `GPNModelOutput`)."""

    memory_decays: torch.Tensor | None = None
    predicted_states: torch.Tensor | None = None

    @classmethod
    def of_decoded_token(cls, logits: torch.Tensor, cache: GPNCache) -> GPNCausalLMOutput:
        """`cls(logits=logits, cache=cache)` built directly: the same attributes and items, without the
        ModelOutput bookkeeping that walks the dataclass fields at every attribute set, which costs as much
        as a small model's one-call token spends around its kernel."""
        output = cls.__new__(cls)
        values = {"logits": logits, "cache": cache}
        for name in _CAUSAL_LM_OUTPUT_FIELDS:
            value = values.get(name)
            object.__setattr__(output, name, value)
            if value is not None:
                OrderedDict.__setitem__(output, name, value)
        return output


_CAUSAL_LM_OUTPUT_FIELDS = tuple(field.name for field in dataclasses.fields(GPNCausalLMOutput))


@dataclass
class GPNSequenceClassifierOutput(SequenceClassifierOutputWithPast):
    """`SequenceClassifierOutputWithPast` plus the per-head memory decays and the predicted states (see
    `GPNModelOutput`)."""

    memory_decays: torch.Tensor | None = None
    predicted_states: torch.Tensor | None = None


# ---- gradient checkpointing: one BPTT segment is the unit of recomputation ---------------------------


class GPNSegmentLayer(GradientCheckpointingLayer):
    """One segment of the plain time loop, the unit transformers' gradient checkpointing recomputes.

    A GPN has one layer revisited at every token, so it checkpoints *time*: with checkpointing on (and
    training with gradients) the plain loop runs every segment of `config.bptt_segment_length` positions
    through this layer, and `GradientCheckpointingLayer` hands each call to the model's checkpoint
    function (`_gradient_checkpointing_func`, set by `gradient_checkpointing_enable`): only the states at
    segment boundaries are kept, and the backward pass recomputes each segment from its boundary.
    Without checkpointing the plain loop calls it once, over the whole sequence. It holds no weights:
    `steps` is the model's `_plain_steps`, passed as a keyword (the recomputation calls it again).
    """

    def forward(
        self,
        token_inputs: torch.Tensor,
        predicted: torch.Tensor,
        grounded: torch.Tensor,
        memory: torch.Tensor,
        mask: torch.Tensor | None,
        first_position: int,
        output_memory_decays: bool,
        sequence_starts: torch.Tensor | None = None,
        *,
        steps: Callable[..., tuple],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(outputs, p, g, M, gamma or None) after the segment's positions (tensors positional, as reentrant
        checkpointing needs them; `sequence_starts`: where packed sequences start in the segment, or None)."""
        return steps(
            token_inputs, predicted, grounded, memory, mask, first_position, output_memory_decays, sequence_starts
        )


def is_torch_checkpoint(function: Callable) -> bool:
    """Whether `function` is torch.utils.checkpoint.checkpoint, possibly with `use_reentrant` bound (what
    `gradient_checkpointing_enable()` installs without `offload`)."""
    from torch.utils.checkpoint import checkpoint

    if isinstance(function, functools.partial):
        return function.func is checkpoint and not function.args and set(function.keywords) <= {"use_reentrant"}
    return function is checkpoint


# ---- end of gradient checkpointing -------------------------------------------------------------------


def quantized_after_loading(model: PreTrainedModel, state_dict: dict | None = None) -> tuple[str, str] | None:
    """(name, class) of a weight that torchao's `quantize_` quantized after loading, which transformers cannot save,
    or None. transformers saves torchao's tensor subclasses only through the quantizer that `from_pretrained(...,
    quantization_config=TorchAoConfig(...))` attaches (`model.hf_quantizer`), which flattens them into plain tensors;
    without it, `save_pretrained` (transformers 5.24) writes the config and code, then fails reading the first such
    weight's storage ("Attempted to access the data pointer on an invalid python storage"). `state_dict`: what is
    to be saved, when given instead of the model's own weights."""
    if getattr(model, "hf_quantizer", None) is not None:
        return None
    named = state_dict.items() if state_dict is not None else model.named_parameters()
    for name, tensor in named:
        kind = type(tensor)
        if kind.__module__.startswith("torchao."):  # (a DTensor: `sharding.sharded_save_refusal`)
            return name, kind.__name__
    return None


class GPNPreTrainedModel(PreTrainedModel):
    """The base of every GPN model: its config class, weight initialisation and transformers flags."""

    config_class = GPNConfig
    config: GPNConfig
    base_model_prefix = "model"
    # Activation checkpointing recomputes BPTT segments (`GPNSegmentLayer`, `_set_gradient_checkpointing`).
    supports_gradient_checkpointing = True
    # Nothing is named: a GPN is one unit, which this attribute cannot say. transformers' device_map and Accelerate
    # read the top model's set (transformers 5 adds every submodel's to it) and never test the top model's own class.
    # What it names, Accelerate's FSDP2 `TRANSFORMER_BASED_WRAP` (`accelerate config`'s default) shards apart:
    # GPNModel, which holds the embedding that Accelerate 1.16 groups again with the tied head, failed in
    # fully_shard; a block would be gathered at every token of the recurrence. Named nothing, FSDP2 shards the
    # model, PEFT-wrapped too, as one unit. The price: device_map="auto" over several devices may place blocks
    # apart (correct through accelerate's hooks, on the plain recurrence, but slow): `from_pretrained` says so.
    _no_split_modules = []
    _is_stateful = True  # a recurrent state cannot be rolled back (assisted decoding: `_validate_generation_mode`)
    _supports_cache_class = True

    # Folders saved before the decoder moved into the base model hold its keys at the top level (`decode_norm.*`,
    # `decode_proj.*` beside `model.*`). They load as they are, with or without remote code: transformers resolves
    # each checkpoint key with or without the base-model prefix (`model.`) to the name the model has, the rule that
    # loads a causal LM from a base model's folder, and the decoder kept its module names inside `GPNModel`. No
    # renaming is recorded, so such a model is saved in the current layout (tests/model/test_output_layer.py).

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """`PreTrainedModel.from_pretrained`, warning where its `device_map` split the model (`placement_warning`)."""
        loaded = super().from_pretrained(*args, **kwargs)
        model = loaded[0] if isinstance(loaded, tuple) else loaded  # (output_loading_info=True)
        warning = placement_warning(getattr(model, "hf_device_map", None))
        if warning is not None:
            logger.warning(warning)
        return loaded

    def __init__(self, config: GPNConfig, *args, **kwargs):
        # The config was checked when it was built, not since: `config.update(...)`, an attribute written, or
        # `from_pretrained(path, hidden_size=0)` (transformers sets such keyword arguments after construction).
        # Built from it, the modules would fail deep inside (a ZeroDivisionError in an initialiser, a size
        # mismatch report) without naming the value.
        config._check_values(token_ids=False)
        super().__init__(config, *args, **kwargs)

    def _check_and_adjust_attn_implementation(
        self, attn_implementation: str | None, is_init_check: bool = False, allow_all_kernels: bool = False
    ) -> str:
        """`attn_implementation` selects how attention layers run; a GPN has none. Unset or "eager" (what
        transformers records for a model without attention kernels) it is accepted; any other ("sdpa",
        "flash_attention_2", a Hub kernel, as scripts and TRL's `model_init_kwargs` set for attention models) is
        refused by name, not with transformers' message that support for it may come later."""
        if attn_implementation not in (None, "eager"):
            raise ValueError(
                f"attn_implementation={attn_implementation!r} does not apply to a GPN: it has no attention layers, so "
                "there is no attention implementation to choose (its recurrence runs on the fast path by itself); "
                "leave attn_implementation unset"
            )
        return super()._check_and_adjust_attn_implementation(attn_implementation, is_init_check, allow_all_kernels)

    def __prepare_scriptable__(self):
        """Called by `torch.jit.script` before it compiles a module (this model, or one holding it): TorchScript
        cannot compile a GPN (its forward takes **kwargs and returns a ModelOutput holding a GPNCache), and failed on
        the first annotation it could not read ("Unknown type annotation: 'str | None'"). Refused by name, saying
        what works."""
        raise TypeError(
            f"torch.jit.script cannot compile a {type(self).__name__}: TorchScript (deprecated) takes no **kwargs, "
            "ModelOutput or GPNCache. Export it with torch.export.export (a decoding step that takes and returns a "
            "GPNCache: docs/transformers.md, 'torch.compile and torch.export'), or torch.jit.trace a module that "
            "returns its tensors (a traced graph is specific to the sequence length)"
        )

    def __getstate__(self) -> dict:
        """The module's state for `copy.deepcopy` and pickle, without what the fast path derived from the weights
        (`DERIVED_ATTRIBUTES`: C plans hold raw pointers, which neither copies nor pickles): the copy derives
        its own from its own weights at its first call."""
        state = super().__getstate__()
        for name in DERIVED_ATTRIBUTES & state.keys():
            del state[name]
        return state

    def save_pretrained(self, save_directory: str | os.PathLike, *args, **kwargs) -> None:
        """`PreTrainedModel.save_pretrained`, with an `auto_map` naming every auto class a GPN serves.

        transformers records only the saved model's own auto class; the folder then loads through remote
        code (`trust_remote_code=True`, without this package) as `AutoConfig`, `AutoModel`,
        `AutoModelForCausalLM` and `AutoModelForSequenceClassification` alike. The `bptt_segment_length` that
        enabling gradient checkpointing set is not saved (the folder says what the model was given). Weights that
        torchao's `quantize_` quantized after loading are refused before anything is written
        (`quantized_after_loading`), and so are weights FSDP2 shards, without their gathered `state_dict`
        (`sharding.sharded_save_refusal`).
        """
        state_dict = kwargs.get("state_dict", args[1] if len(args) > 1 else None)
        sharded = sharded_save_refusal(self, state_dict)
        if sharded is not None:
            raise ValueError(sharded)
        quantized = quantized_after_loading(self, state_dict)
        if quantized is not None:
            raise ValueError(
                f"{quantized[0]} is a torchao {quantized[1]} quantized after loading (quantize_), which transformers "
                "cannot save (its save_pretrained fails partway, leaving a folder without weights): save the float "
                "model and quantize after loading, or load with quantization_config=TorchAoConfig(...) to save a "
                "quantized one (docs/inference-speed.md)"
            )
        module = type(self).__module__.rsplit(".", 1)[-1]
        auto_map = dict(getattr(self.config, "auto_map", None) or {})
        auto_map.setdefault("AutoModel", f"{module}.GPNModel")
        auto_map.setdefault("AutoModelForCausalLM", f"{module}.GPNForCausalLM")
        auto_map.setdefault("AutoModelForSequenceClassification", f"{module}.GPNForSequenceClassification")
        self.config.auto_map = auto_map
        # The segment length gradient checkpointing set (`_set_gradient_checkpointing`) belongs to this run, not to
        # the model: saved (a Trainer saves with checkpointing on), every load would train in segments.
        config, segment = self.config, self.config.bptt_segment_length
        if getattr(self, "_gpn_segment_length_set_by_checkpointing", False):
            config.bptt_segment_length = None
        try:
            return super().save_pretrained(save_directory, *args, **kwargs)
        finally:
            config.bptt_segment_length = segment

    def _set_gradient_checkpointing(
        self, enable: bool = True, gradient_checkpointing_func: Callable | None = None, every_n_layers: int = 1
    ):
        """What `activation_checkpointing_enable()` / `gradient_checkpointing_enable()` (and
        `TrainingArguments(gradient_checkpointing=True)`) turn on, and `..._disable()` off.

        A GPN has one layer revisited at every token, so it checkpoints *time*, not layers: training keeps
        the state only at the boundaries of segments of `config.bptt_segment_length` tokens and recomputes
        each segment's steps in the backward pass. transformers sets the flag and the checkpoint function
        on `GPNSegmentLayer` (a `GradientCheckpointingLayer`), through which the plain loop runs each
        segment. Enabling sets `bptt_segment_length` to `DEFAULT_CHECKPOINT_SEGMENT_LENGTH` when it is unset
        (disabling puts `None` back). The fast path recomputes the same segments with its own hand-written
        backward, in place of `torch.utils.checkpoint.checkpoint` (which could not free what its autograd
        function keeps); any other checkpoint function (transformers' `offload=True`, DeepSpeed's, your
        own) is honoured: the plain path runs and calls it on every segment (`GPNModel.fast_path_blocker`).
        Gradients are unchanged.
        """
        if gradient_checkpointing_func is None:
            from torch.utils.checkpoint import checkpoint

            gradient_checkpointing_func = checkpoint
        super()._set_gradient_checkpointing(enable, gradient_checkpointing_func, every_n_layers)
        config = self.config
        if enable and config.bptt_segment_length is None:
            config.bptt_segment_length = DEFAULT_CHECKPOINT_SEGMENT_LENGTH
            self._gpn_segment_length_set_by_checkpointing = True
        elif not enable and getattr(self, "_gpn_segment_length_set_by_checkpointing", False):
            config.bptt_segment_length = None
            self._gpn_segment_length_set_by_checkpointing = False

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Initialisation of the reference (GPN.md): "keep half the state, add the token" at step 0.

        transformers visits leaf modules on their own (and, for remote code, skips modules without
        parameters of their own), so every `nn.Linear` carries its scheme in `init_scheme` (see `linear`).
        """
        std = self.config.initializer_range
        if isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, GPNRMSNorm):
            init.ones_(module.weight)
        elif isinstance(module, nn.Linear):
            scheme = getattr(module, "init_scheme", "lecun")
            if scheme == "tied":  # the output head: its weight is the embedding's (initialised as the embedding)
                return
            if scheme == "zeros":
                init.zeros_(module.weight)
            elif scheme == "normal":
                init.normal_(module.weight, mean=0.0, std=std)
            else:
                lecun_normal_(module.weight)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, GPNMemoryWrite):
            if not getattr(module.A_log, "_is_hf_initialized", False):
                module.A_log.copy_(torch.log(torch.empty_like(module.A_log).uniform_(0, 16).clamp_min(1e-4)))
            if not getattr(module.dt_bias, "_is_hf_initialized", False):
                low, high = math.log(1e-3), math.log(1e-1)
                dt = torch.exp(torch.empty_like(module.dt_bias).uniform_(low, high)).clamp_min(1e-4)
                module.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)


def _why_not_foldable(name: str, module: nn.Module, allowed: tuple[type, ...]) -> str:
    """The reason `GPNModel.fast_path_blocker` gives for `module`."""
    if type(module) not in allowed:
        return f"{name} is a {type(module).__module__}.{type(module).__qualname__}, not a plain module the fast path can fold"
    if module._forward_pre_hooks or module._forward_hooks or module._backward_pre_hooks or module._backward_hooks:
        return f"{name} has hooks"
    if "forward" in module.__dict__:
        return f"{name} has a forward of its own (set on the module)"
    method = replaced_method(module, RECURRENCE_METHODS)
    if method is not None:
        return replaced_method_reason(name, method)
    param_name, param = next((n, p) for n, p in module._parameters.items() if not foldable_parameter(module, n, p))
    return f"{name}.{param_name} is a {type(param).__qualname__}, not a plain nn.Parameter (nor a weight the fast path takes)"


class GPNModel(GPNPreTrainedModel):
    """The GPN recurrence and its decoder: token ids in, the decoded vector W_dec rms(p) (+ b_dec) at every
    position out (`last_hidden_state`, what the tied output matrix multiplies), the predicted state p on request
    (`output_predicted_states`)."""

    def __init__(self, config: GPNConfig):
        super().__init__(config)
        d, e, eps = config.hidden_size, config.embedding_size, config.rms_norm_eps
        self.embed_tokens = nn.Embedding(config.vocab_size, e)
        self.fuse_norm = GPNRMSNorm(e, eps)
        self.fuse_proj = linear(e, d, bias=False)
        self.fuse_gate_norm = GPNRMSNorm(d, eps)
        self.fuse_gate = linear(d, d, bias=True, init_scheme="zeros")
        self.memory_write = GPNMemoryWrite(config) if config.use_memory else None
        self.predict_layers = nn.ModuleList(GPNPredictLayer(config) for _ in range(config.num_predict_layers))
        self.segment_layer = (
            GPNSegmentLayer()
        )  # the plain loop's segments; see GPNPreTrainedModel._set_gradient_checkpointing
        # Step 4's d -> e part, the base model's last modules (as a Llama's base model ends with its final norm)
        self.decode_norm = GPNRMSNorm(d, eps)
        self.decode_proj = linear(d, e, bias=config.use_decoder_bias)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        """The token embedding table."""
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        """Replace the token embedding table."""
        self.embed_tokens = value

    # ---- pieces of one step, in the order of the equations ----------------------------------------

    def token_inputs(self, embeddings: torch.Tensor) -> torch.Tensor:
        """W_fuse rms(E[x]) for every position at once: the token side has no recurrence."""
        return fast_project(self.fuse_proj, self.fuse_norm(embeddings), self.few_row_kernels())  # (project; see decode)

    def ground(self, predicted: torch.Tensor, token_input: torch.Tensor) -> torch.Tensor:
        """Step 1: g = sigmoid(W_fg rms(p) + b_fg) * p + W_fuse rms(E[x])."""
        keep = torch.sigmoid(project(self.fuse_gate, self.fuse_gate_norm(predicted)))
        return keep * predicted + token_input

    def predict(self, grounded: torch.Tensor, memory: torch.Tensor | None) -> torch.Tensor:
        """Step 3: run the predict layers from c = g; every layer reads the same memory."""
        state = grounded
        for layer in self.predict_layers:
            state = layer(state, memory)
        return state

    def decoded(self, predicted_states: torch.Tensor) -> torch.Tensor:
        """Step 4 up to the output matrix: W_dec rms(p) (+ b_dec), in the output matrix's dtype (the embedding's)."""
        # (a few rows, as in decoding, on the fast path's kernels: `fast_recurrence.fast_project`)
        decoded = fast_project(self.decode_proj, self.decode_norm(predicted_states), self.few_row_kernels())
        dtype = output_table_dtype(self.embed_tokens)
        return decoded.to(dtype) if dtype.is_floating_point else decoded

    def step(
        self,
        predicted: torch.Tensor,
        older_grounded: torch.Tensor,
        memory: torch.Tensor,
        token_input: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One token: (p, g', M) and W_fuse rms(E[x_t]) -> (p_next, g, M_next, gamma)."""
        grounded = self.ground(predicted, token_input)
        gamma = None
        if self.memory_write is not None:
            memory, gamma = self.memory_write(memory, older_grounded, grounded)
        return self.predict(grounded, memory if self.memory_write is not None else None), grounded, memory, gamma

    # ---- the state ------------------------------------------------------------------------------

    def zero_state(self, batch_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(p, g, M) before the first token: all zero, float32."""
        return tuple(
            torch.zeros(shape, device=device, dtype=torch.float32)
            for shape in batch_state_shapes(self.config, batch_size)
        )

    # The fast path's settings, one name each (docs/speed.md), set on a model (`model.model.use_c_kernels = False`)
    # or on the class. (GPN_MEMORY_KERNELS, GPN_STEP_KERNELS, GPN_TRITON and GPN_CUDA_GRAPHS remain for tests
    # and benchmarks: a kernel runs only where its setting and its variable both allow it.)
    use_fast_path: bool = True  # False: the plain loop, which calls every module
    use_c_kernels: bool = True  # CPU: the C step and memory kernels (built at first use with the system's cc)
    use_triton: bool = True  # CUDA: the Triton kernels (after their self-check on the run's sizes)
    use_cuda_graphs: bool | str = (
        False  # True: windows without padding as CUDA graph replays; "inference": no-grad ones only
    )

    last_recurrence_path: str | None = None  # "fast" or "plain": what the last eager call ran
    last_recurrence_backends = None  # on the fast path, the backends its last window ran (`fast_recurrence.Backends`)

    # Children the fast path does not fold: it calls them as modules, like the plain path (the decoder runs
    # after the recurrence on either path). (The segment layer, which only the plain path calls, is checked on
    # its own in `fast_path_blocker`.)
    _CALLED_CHILDREN = ("embed_tokens", "fuse_norm", "fuse_proj", "segment_layer", "decode_norm", "decode_proj")

    def few_row_kernels(self) -> bool:
        """Whether the products of a few rows outside the recurrence (the token and decoder projections, the logits
        of a decoded token) may run on the C kernels (`fast_recurrence.fast_project`, `output_logits`): not under
        forward-mode AD or a torch.func transform, whose tangents and wrappers the kernels drop
        (`autograd_mode_blocker`)."""
        return self.use_fast_path and self.use_c_kernels and autograd_mode_blocker() is None

    def fast_path_blocker(self) -> str | None:
        """Why the fast path cannot run on this model now, or None when it can.

        The fast path folds the weights of the step's modules into a few matrices and never calls those
        modules, so it computes the model only when each of them is exactly what it folds: an
        `nn.Linear` or `GPNRMSNorm` of that exact class (a subclass, a PEFT LoRA wrapper or a quantized
        replacement is not), with plain `nn.Parameter` weights (no tensor subclass, no parametrization),
        and no forward or backward hooks on it or registered globally; and each method of the equations the
        plain loop would call (`RECURRENCE_METHODS`: `ground`, `ffn`, ...) as written here, not replaced on
        an instance, overridden or assigned to its class. Anything else runs the plain path, which calls
        every module and method. So does gradient checkpointing with a checkpoint function other than
        `torch.utils.checkpoint.checkpoint` (whose work the fast path does itself), and a hook on the
        segment layer: the plain path calls them on every segment. And so do forward-mode AD and torch.func's
        transforms, whose tangents and wrapped tensors only torch ops carry (`autograd_mode_blocker`).
        """
        mode = autograd_mode_blocker()  # (forward-mode AD, a torch.func transform: what the plain path honours)
        if mode is not None:
            return mode
        global_hook = registered_global_hook()
        if global_hook is not None:
            return f"a global module hook is registered ({global_hook})"
        blocker = self._segment_layer_blocker()
        if blocker is not None:
            return blocker
        method = replaced_method(self, RECURRENCE_METHODS)
        if method is not None:
            return replaced_method_reason("model", method)
        # (the norms' class is looked at once, as they are many; a forward set on one of them, in the loop below)
        if GPNRMSNorm.forward is not RECURRENCE_METHODS[GPNRMSNorm]["forward"]:
            return replaced_method_reason("GPNRMSNorm", "forward")
        allowed = (nn.Linear, GPNRMSNorm, nn.ModuleList, GPNMemoryWrite, GPNPredictLayer)
        modules = self._folded_modules()
        plain_parameters = {type(p) for module in modules for p in module._parameters.values()} <= {
            nn.Parameter,
            type(None),
        }
        for module in modules:
            if (
                type(module) not in allowed
                or "forward" in module.__dict__  # (a forward patched on the instance: it must be called)
                or (type(module) in (GPNMemoryWrite, GPNPredictLayer) and replaced_method(module, RECURRENCE_METHODS))
                or module._forward_pre_hooks
                or module._forward_hooks
                or module._backward_pre_hooks
                or module._backward_hooks
                or not (
                    plain_parameters or all(foldable_parameter(module, n, p) for n, p in module._parameters.items())
                )
            ):
                name = next(n for n, m in self.named_modules() if m is module)
                return _why_not_foldable(name, module, allowed)
        return None

    def _folded_modules(self) -> list[nn.Module]:
        """The modules whose weights the fast path folds, as it reads them: a flat walk over the model's children
        (but those it calls) and the two levels of modules below them (the blocks and their projections), each
        PEFT LoRA layer whose forward is provably its base layer's (merged in place) taken as that base layer
        (`as_read`), whose weight and bias it shows. Runs before every fast call (decoding too); any other
        wrapper fails on its own type in `fast_path_blocker`, so what it wraps need not be visited."""
        modules = []
        for child_name, child in self._modules.items():
            if child_name in self._CALLED_CHILDREN or child is None:
                continue
            child = as_read(child)
            modules.append(child)
            for block in map(as_read, child._modules.values()):
                modules.append(block)
                if block is not None:
                    modules.extend(map(as_read, block._modules.values()))
        return modules

    def _segment_layer_blocker(self) -> str | None:
        """Why the segment layer (gradient checkpointing's unit) needs the plain path, or None."""
        segment = self.segment_layer
        if (
            segment._forward_pre_hooks
            or segment._forward_hooks
            or segment._backward_pre_hooks
            or segment._backward_hooks
        ):
            return "segment_layer has hooks"
        method = replaced_method(segment, RECURRENCE_METHODS)
        if method is not None:
            return replaced_method_reason("segment_layer", method)
        if self.checkpointing_segments() and not is_torch_checkpoint(segment._gradient_checkpointing_func):
            return "gradient checkpointing runs a checkpoint function other than torch.utils.checkpoint.checkpoint"
        return None

    def checkpointing_segments(self) -> bool:
        """Whether this call recomputes BPTT segments in the backward pass (gradient checkpointing on, training
        mode, gradients enabled), as `GradientCheckpointingLayer` decides."""
        return self.segment_layer.gradient_checkpointing and self.training and torch.is_grad_enabled()

    def recurrence_path(self) -> str:
        """ "fast" or "plain": the path `recurrence` takes for the next call (see `fast_path_blocker`)."""
        if not self.use_fast_path or is_tracing():
            return "plain"
        blocker = self.fast_path_blocker()
        if blocker is None:
            return "fast"
        log_once(logger, self, f"GPN runs the plain (module-calling) recurrence instead of the fast path: {blocker}")
        return "plain"

    def recurrence(
        self,
        token_inputs: torch.Tensor,
        state: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None,
        output_memory_decays: bool = False,
        sequence_starts: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor | None]:
        """The time loop: `fast_recurrence.fast_recurrence` when `recurrence_path()` is "fast", else `recurrence_plain`.

        Both compute the same function with the same gradients (tests/fast_path/test_fast_path.py). The plain path
        runs when `use_fast_path` is False, under torch.compile / torch.export, and whenever a module the
        fast path would fold is wrapped, replaced or hooked (`fast_path_blocker`); `last_recurrence_path`
        says which ran. `sequence_starts` (batch, seq) bool: reset the state to zero before these positions
        (packed sequences, `packed_sequence_starts`), on either path.
        """
        path = self.recurrence_path()
        if not is_tracing():
            object.__setattr__(
                self, "last_recurrence_path", path
            )  # (nn.Module's __setattr__ is slow on a per-token path)
            if path != "fast":  # (the fast path records the backends it chooses itself)
                object.__setattr__(self, "last_recurrence_backends", None)
        if path == "fast":
            return fast_recurrence(
                self,
                token_inputs,
                state,
                mask,
                output_memory_decays=output_memory_decays,
                sequence_starts=sequence_starts,
            )
        return self.recurrence_plain(
            token_inputs, state, mask, output_memory_decays=output_memory_decays, sequence_starts=sequence_starts
        )

    def recurrence_plain(
        self,
        token_inputs: torch.Tensor,
        state: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None,
        output_memory_decays: bool = False,
        sequence_starts: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor | None]:
        """The plain time loop, one step per position (the path every faster one is tested against).

        Positions where `mask` is 0 leave (p, g, M) exactly unchanged; their output is the carried p.
        Right before the positions where `sequence_starts` is True (packed sequences) (p, g, M) is reset to
        the zero state: nothing of what came before reaches them, in the forward values or the gradients.
        With `config.bptt_truncation_length = K` the carried state is detached before every position
        t > 0 with t % K == 0 (truncated BPTT; the forward values are unchanged).
        With gradient checkpointing on (training), each segment of `config.bptt_segment_length` positions
        is one call of `segment_layer`, which runs it inside the checkpoint function: only the states at
        segment boundaries are kept. Otherwise the whole sequence is one call.
        Returns the predicted states (batch, seq, d), the final state and, if asked, gamma (batch, seq, H).
        """
        seq_len = token_inputs.shape[1]
        checkpointing = self.checkpointing_segments()
        segment = (self.config.bptt_segment_length or DEFAULT_CHECKPOINT_SEGMENT_LENGTH) if checkpointing else seq_len
        outputs, decays = [], []
        for start in range(0, seq_len, segment):
            stop = min(start + segment, seq_len)
            segment_mask = None if mask is None else mask[:, start:stop]
            segment_starts = None if sequence_starts is None else sequence_starts[:, start:stop]
            segment_outputs, *state, segment_decays = self.segment_layer(
                token_inputs[:, start:stop],
                *state,
                segment_mask,
                start,
                output_memory_decays,
                segment_starts,
                steps=self._plain_steps,
            )
            outputs.append(segment_outputs)
            if segment_decays is not None:
                decays.append(segment_decays)
        memory_decays = torch.cat(decays, dim=1) if decays else None
        return torch.cat(outputs, dim=1), tuple(state), memory_decays

    def _plain_steps(
        self,
        token_inputs: torch.Tensor,
        predicted: torch.Tensor,
        grounded: torch.Tensor,
        memory: torch.Tensor,
        mask: torch.Tensor | None,
        first_position: int,
        output_memory_decays: bool,
        sequence_starts: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Positions first_position.. of the plain loop: (outputs, p, g, M, gamma or None)."""
        outputs, decays = [], []
        truncation = self.config.bptt_truncation_length
        for offset in range(token_inputs.shape[1]):
            t = first_position + offset
            if truncation and t > 0 and t % truncation == 0:
                predicted, grounded, memory = predicted.detach(), grounded.detach(), memory.detach()
            if sequence_starts is not None:  # a packed sequence starts here: from the zero state
                starting = sequence_starts[:, offset]
                predicted = predicted.masked_fill(starting[:, None], 0.0)
                grounded = grounded.masked_fill(starting[:, None], 0.0)
                memory = memory.masked_fill(starting.view(-1, *([1] * (memory.dim() - 1))), 0.0)
            new_predicted, new_grounded, new_memory, gamma = self.step(
                predicted, grounded, memory, token_inputs[:, offset]
            )
            if mask is None:
                predicted, grounded, memory = new_predicted, new_grounded, new_memory
            else:
                real = mask[:, offset].bool()
                predicted = torch.where(real[:, None], new_predicted, predicted)
                grounded = torch.where(real[:, None], new_grounded, grounded)
                if self.memory_write is not None:
                    memory = torch.where(real[:, None, None, None], new_memory, memory)
            outputs.append(predicted)
            if output_memory_decays and gamma is not None:
                decays.append(gamma)
        memory_decays = torch.stack(decays, dim=1) if decays else None
        return torch.stack(outputs, dim=1), predicted, grounded, memory, memory_decays

    # ---- forward --------------------------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: GPNCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        output_memory_decays: bool = False,
        output_predicted_states: bool = False,
        return_dict: bool | None = None,
        *,
        position_ids: torch.LongTensor | None = None,
        seq_idx: torch.Tensor | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs,
    ) -> GPNModelOutput | tuple:
        """Run the recurrence over `input_ids` (or `inputs_embeds`), starting from `cache` if it holds a state, and
        decode every predicted state: `last_hidden_state` is W_dec rms(p) (+ b_dec), which the output matrix
        multiplies.

        Args:
            input_ids: (batch, seq) token ids in [0, vocab_size).
            attention_mask: (batch, seq) with 1 for real tokens and 0 for padding, anywhere in the row;
                padded positions leave the state exactly unchanged. With a cache it may be longer than
                `input_ids` (as `generate()` passes it): its last `seq` columns are used.
            cache: a `GPNCache` to continue from and to update (created when `use_cache` and missing).
            inputs_embeds: (batch, seq, embedding_size) instead of `input_ids`.
            use_cache: return the state after the last position in a `GPNCache`.
            output_hidden_states: also return `hidden_states` = (the embedding output, `last_hidden_state`),
                transformers' convention for a model of one layer.
            output_memory_decays: also return gamma (batch, seq, H), GPN+M only.
            output_predicted_states: also return the predicted state p at every position (batch, seq, d),
                float32, as `predicted_states` (the paper's object of study, before the decoder).
            position_ids, seq_idx: packed (padding-free) batches: `position_ids` restarting inside a row, or
                `seq_idx` (batch, seq) the index of the sequence each position belongs to, say where the sequences
                packed into a row start, and the state resets to zero there (see `packed_sequence_starts`).
                Position ids that count up from 0 (ordinary ones) change nothing: a GPN has no positions.
                Parameters, not keywords, so that `Trainer` keeps a pre-packed dataset's columns
                (`add_packing_parameters`).
            logits_to_keep: checked, and otherwise without effect: the base model has no logits and decodes every
                position, as transformers' base models do; it is taken because tools give the base model what
                they give the causal LM (TRL's `DistillationTrainer` passes it to `base_model` and keeps the
                positions it wants itself).
            **kwargs: `past_key_values` (deprecated alias of `cache`); `cu_seq_lens_q/k` (with `max_length_q/k`),
                FlashAttention's form of the packed starts; what `generate()` and transformers' tools pass for
                attention models, ignored (see `arguments.IGNORED_FORWARD_KWARGS`); anything else raises a
                TypeError.
        """
        add_packing_parameters(kwargs, position_ids, seq_idx)
        cache = pop_cache_alias(cache, kwargs)
        check_cache_type(cache)
        check_unused_kwargs(kwargs)
        refuse_attention_outputs(kwargs.get("output_attentions"), self.config.output_attentions)
        packing = packing_arguments(kwargs)
        config = self.config
        use_cache = use_cache if use_cache is not None else (config.use_cache and not self.training)
        return_dict = return_dict if return_dict is not None else True
        output_hidden_states = output_hidden_states if output_hidden_states is not None else config.output_hidden_states

        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of input_ids or inputs_embeds")
        if input_ids is not None:
            check_input_ids(input_ids, config.vocab_size)
            embeddings = self.embed_tokens(input_ids)
        else:
            if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != config.embedding_size:
                raise ValueError(
                    f"inputs_embeds must have shape (batch, seq, {config.embedding_size}), "
                    f"got {tuple(inputs_embeds.shape)}"
                )
            if not inputs_embeds.dtype.is_floating_point:  # (ids passed as embeddings were cast and run)
                raise ValueError(
                    f"inputs_embeds must be floating-point embeddings, got dtype {inputs_embeds.dtype}: token ids "
                    "go in input_ids"
                )
            embeddings = inputs_embeds
        batch_size, seq_len = embeddings.shape[:2]
        check_not_empty(batch_size, seq_len)
        positions_to_keep(logits_to_keep, seq_len)  # (a wrong value is refused here as by the causal LM)
        check_sharded_lengths(self, seq_len, self._CALLED_CHILDREN, embeddings.device)  # (FSDP2: blocks apart)
        refuse_split_alora_offsets(self, seq_len)  # (PEFT's aLoRA masks positions the step's layers never see)

        # one call at a time advances a cache: another call reading or writing it meanwhile (a second thread, a hook
        # calling the model) would compute from a half-written state in silence (`GPNCache.claim` refuses it)
        # (claimed inside the `try` and released inline in the `finally`: `GPNCache.claim` says why)
        # (nothing claimed while tracing: a compiled or exported program's cache is its own input)
        claimable = cache is not None and not is_tracing()
        held, claim = (cache.__dict__, object()) if claimable else ({}, None)
        lent = False  # True: one chunk of a read in chunks, whose write the reader finishes (`ChunkedRead`)
        try:
            if claim is not None:
                lent = cache.claim(claim, borrow=True)
            state = cache.get_state() if cache is not None else None
            if state is not None:
                check_cache_state(state, config, batch_size)
            mask = check_attention_mask(attention_mask, batch_size, seq_len, continuing=state is not None)
            sequence_starts = (
                packed_sequence_starts(
                    batch_size, seq_len, mask, **packing, device=embeddings.device, continuing=state is not None
                )
                if packing
                else None
            )
            if state is None:
                state = self.zero_state(batch_size, embeddings.device)
            # with gradients, a kept state stays attached to the graph of the calls that computed it, so that a later
            # call's loss reaches them (BPTT across calls); a spent graph is refused, naming cache.detach()
            state, graph_probe = state_entering_call(cache, state, self, embeddings, keeps_state=use_cache)

            # the weights as this call is about to read them, for `GPNCache.save` (where this model is new to the cache)
            snapshot = snapshot_before_call(cache, self) if use_cache else None
            # what the fast path derives from the parameters (folded matrices, ...) lives for this call, the
            # generate() call around it, or the cache it continues (a decode loop derives once): derived_weights.py
            with derived_weights_scope(self, kept_by=cache) as derived:
                predicted_states, final_state, memory_decays = self.recurrence(
                    self.token_inputs(embeddings),
                    state,
                    mask,
                    output_memory_decays=output_memory_decays,
                    sequence_starts=sequence_starts,
                )

            if use_cache:
                if cache is None:
                    cache = GPNCache(config)
                # several writes in place (p, g, M, the count, the fingerprint): an interrupt between two of them
                # leaves the cache marked, and refused from then on, rather than holding what its count does not
                cache.start_writing()
                cache.update_state(*final_state, num_new_tokens=seq_len, graph_probe=graph_probe)
                cache.record_read(input_ids, mask)
                cache.note_model(self, snapshot=snapshot)  # whose state this is, for GPNCache.save
                keep_with(self, cache, derived)  # the next call that continues this cache reuses them
                if not lent:
                    cache.finish_writing()
        finally:
            # (released inline, no call before the pop: `GPNCache.claim`)
            CLAIM_ATTRIBUTE in held and held[CLAIM_ATTRIBUTE] is claim and held.pop(CLAIM_ATTRIBUTE)
        decoded = self.decoded(predicted_states)
        output = GPNModelOutput(
            last_hidden_state=decoded,
            cache=cache if use_cache else None,
            hidden_states=(embeddings, decoded) if output_hidden_states else None,
            memory_decays=memory_decays,
            predicted_states=predicted_states if output_predicted_states else None,
        )
        return output if return_dict else output.to_tuple()


def _is_plain_linear(module: nn.Module) -> bool:
    """Whether `module` computes x W^T (+ b) from its own `weight` (FSDP2's sharding subclass included): not a
    wrapper (a PEFT adapter) nor a replacement that overrides `forward` (a quantized linear)."""
    return isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward


def _is_plain_embedding(module: nn.Module) -> bool:
    """Whether `module` looks its rows up in its own `weight` parameter (FSDP2's sharding subclass included): not a
    `weight` computed from others (a parametrization, pruning, the older weight norm), whose table the output follows."""
    return (
        isinstance(module, nn.Embedding)
        and type(module).forward is nn.Embedding.forward
        and "weight" in module._parameters
    )


def _runs_more_than_its_forward(module: nn.Module) -> bool:
    """Whether calling `module` runs more than its class's forward (a hook of its own or a global one, a `forward`
    set on its instance), which reading its weight instead would skip."""
    return not called_as_is(module) or registered_global_hook() is not None


class GPNForCausalLM(GPNPreTrainedModel, GenerationMixin):
    """GPN with its output head: logits = lm_head(GPNModel(...).last_hidden_state) = (W_dec rms(p) (+ b_dec)) E^T.

    `lm_head` is a bias-free `nn.Linear` whose weight *is* the embedding table (`model.embed_tokens.weight`,
    tied as transformers ties every model's: `_tied_weights_keys`), so the tools that score tokens from the
    base model's last hidden state and the output embedding's weight (TRL's fused LM head, fused
    linear-cross-entropy losses, PEFT's `all-linear`, FSDP's tied-embedding handling) see exactly the model.

    A GPN's output matrix is its embedding, so the output follows a wrapped or replaced embedding (a PEFT LoRA or
    `modules_to_save` copy of `embed_tokens`) while `lm_head` is still the plain tied linear: the logits are then
    `last_hidden_state` times the table the embedding computes (`embedding_table`), the input and output sides
    match, and `merge_and_unload()` gives the same model. A wrapped or replaced head (PEFT's tied adapter of
    `ensure_weight_tying=True`, a quantized module, hooks) is called as it is.
    """

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    # Never saved (it is the embedding), so the Trainer's resume, which loads a checkpoint's state dict, re-ties it
    # instead of warning "missing keys ['lm_head.weight']".
    _keys_to_ignore_on_save = ["lm_head.weight"]

    def __init__(self, config: GPNConfig):
        super().__init__(config)
        self.model = GPNModel(config)
        # Tied to the embedding in post_init, so it is made on the meta device: never allocated, nothing drawn.
        self.lm_head = nn.Linear(config.embedding_size, config.vocab_size, bias=False, device="meta")
        self.lm_head.init_scheme = "tied"
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        """The base model's token embedding table."""
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        """Replace the base model's token embedding table."""
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Module:
        """`lm_head`, or, while the output follows a wrapped embedding, a bias-free view whose weight is the table
        it computes, for the tools that multiply by that weight (TRL's fused head): `output_layer.output_embeddings`."""
        return output_embeddings(self)

    def set_output_embeddings(self, new_embeddings: nn.Module) -> None:
        """Replace the output head."""
        self.lm_head = new_embeddings

    def tie_weights(self, *args, **kwargs) -> None:
        """transformers' tying; what FSDP2's preparation could not tie is refused by name first."""
        refuse_what_fsdp2_cannot_tie(self)
        super().tie_weights(*args, **kwargs)

    def output_follows_embedding(self) -> bool:
        """Whether the output matrix is the table of a wrapped or replaced embedding (see the class), not
        `lm_head`'s weight."""
        return _is_plain_linear(self.lm_head) and not _is_plain_embedding(self.model.embed_tokens)

    def embedding_table(self, adapter_name: str | None = None) -> torch.Tensor:
        """The (vocab, e) table the embedding module computes: its forward on every id (a wrapper's adapted table),
        with the gradients of whatever it trains. Hooks on the input embedding are input-side by transformers'
        convention (NEFTune noise, `enable_input_require_grads`) and do not run here. `adapter_name`: the table of
        that PEFT adapter alone ("__base__": of none), as PEFT's mixed-batch inference computes a row's embedding."""
        embedding = self.model.embed_tokens
        ids = torch.arange(self.config.vocab_size, device=next(embedding.parameters()).device)
        if adapter_name is not None:  # (one row of every id, its adapter named)
            return embedding.forward(ids[None], adapter_names=[adapter_name])[0]
        if _is_fsdp_module(embedding):
            # FSDP2 shards the table; only the module's own call gathers it (in its pre-forward hook) and
            # reduces its gradient (in its backward hook), so here the hooks must run.
            return embedding(ids)
        return embedding.forward(ids)

    def _check_tied(self) -> None:
        """Refuse a plain head left with a weight other than the plain embedding's (an embedding replaced or loaded
        without `tie_weights()`): it would read a stale table. A tensor-subclass weight (a quantized head) is a
        deliberate replacement, called as it is; a meta one is an offloaded head's (`device_map` offloading), which
        accelerate's hook loads, from the embedding's tied weights, when the head is called."""
        head, embedding = self.lm_head, self.model.embed_tokens
        if (
            _is_plain_linear(head)
            and _is_plain_embedding(embedding)
            and head.weight is not embedding.weight
            and type(head.weight) is nn.Parameter
            and not head.weight.is_meta
        ):
            raise ValueError(
                "lm_head.weight is no longer model.embed_tokens.weight (a GPN's output matrix is its embedding, the only "
                "one saved): after replacing or loading the embedding, call `model.tie_weights()`. A head trained apart "
                "from the embedding (a merged PEFT `modules_to_save` copy of lm_head) cannot be kept, and `tie_weights()` "
                "drops it: train `embed_tokens` instead (`modules_to_save=['embed_tokens']` trains both sides)"
            )

    def save_pretrained(self, save_directory: str | os.PathLike, *args, **kwargs) -> None:
        """`GPNPreTrainedModel.save_pretrained`, refusing a head that holds a table other than the embedding's, as the
        forward refuses it (`_check_tied`): only the embedding is saved, so that table would be lost in silence."""
        self._check_tied()
        return super().save_pretrained(save_directory, *args, **kwargs)

    def logits_of(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of decoded vectors (rows of `last_hidden_state`): `lm_head(hidden)`, the head called as a module,
        or `hidden` times the wrapped embedding's table while the output follows it."""
        if self.output_follows_embedding():
            adapter_names = mixed_batch_adapter_names(self.model.embed_tokens)
            if adapter_names is not None:  # (PEFT's mixed batch: each row's output follows its own adapter)
                return mixed_batch_logits(hidden, adapter_names, self.embedding_table)
            table = self.embedding_table()
            return F.linear(hidden.to(table.dtype), table)
        self._check_tied()
        head = self.lm_head
        weight = getattr(head, "weight", None)
        if (
            _is_plain_linear(head)
            and head.bias is None
            and not _runs_more_than_its_forward(head)
            and type(weight) is nn.Parameter
        ):
            # a plain tied head: F.linear, a few rows (decoding) on the fast path's kernels (`output_logits`)
            return output_logits(hidden.float(), weight, self.model.few_row_kernels())
        if isinstance(weight, torch.Tensor) and weight.is_floating_point():
            hidden = hidden.to(weight.dtype)
        return head(hidden)

    def decode(self, predicted_states: torch.Tensor) -> torch.Tensor:
        """Step 4: logits for every given predicted state p (..., d): lm_head(W_dec rms(p) (+ b_dec))."""
        return self.logits_of(self.model.decoded(predicted_states))

    def empty_state_logits(self, batch_size: int = 1) -> torch.Tensor:
        """Logits predicted from the empty (zero) state: the reference's position 0 (batch, vocab)."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 0:
            # (torch's zeros named neither the argument nor the method: "zeros() takes 1 positional argument")
            raise ValueError(
                f"empty_state_logits needs a batch size that is a non-negative integer, got {batch_size!r}"
            )
        predicted = torch.zeros(batch_size, self.config.hidden_size, device=self.device)
        return self.decode(predicted)

    def generate(self, *args, **kwargs) -> GenerateOutput | torch.LongTensor:
        """`GenerationMixin.generate`, with the fast path's weights derived from the parameters (folded and
        prepacked matrices, CUDA graphs' copies) once for the whole call: the prompt's forward derives them,
        every decoded token reuses them, and they are dropped when the call returns (`derived_weights.py`), so
        the next call sees the parameters as they are then, however they were edited."""
        refuse_peft_prompt_learning_generate(self)
        check_generate_input_shapes(args[0] if args else kwargs.get("inputs", kwargs.get("input_ids")), kwargs)
        with derived_weights_scope(self.model):
            return super().generate(*args, **kwargs)

    def _valid_auto_compile_criteria(self, model_kwargs: dict, generation_config: GenerationConfig) -> bool:
        """generate() compiles a GPN's decoding forward only when asked (`compile_config`). transformers compiles it
        on CUDA for every compileable cache (a GPNCache is one), which would trace the plain recurrence in place of
        the fast path the dispatcher chooses (Triton kernels, CUDA graphs), pay a compile at the first call, and
        leave the cache without its record of what it read."""
        if generation_config.compile_config is None:
            return False
        return super()._valid_auto_compile_criteria(model_kwargs, generation_config)

    def _get_deprecated_gen_repo(
        self,
        generation_mode: GenerationMode | str | None,
        trust_remote_code: bool | None,
        custom_generate: str | Callable | None = None,
    ) -> str | None:
        """transformers' step that sends DoLa and contrastive search to their Hub repos (called on every generate()
        call, once the mode is known): for a GPN these two are refused first, by name, before anything is fetched
        (`generation.refuse_hub_decoding_a_state_cannot_run`)."""
        refuse_hub_decoding_a_state_cannot_run(generation_mode)
        return super()._get_deprecated_gen_repo(generation_mode, trust_remote_code, custom_generate)

    def _validate_generation_mode(self, generation_mode: GenerationMode, *args, **kwargs) -> None:
        """transformers' check of the decoding method, before any forward: assisted decoding is refused by name
        (`generation.refuse_assisted_decoding`), as is an assistant beside beam search."""
        mode_kwargs = args[1] if len(args) > 1 else kwargs.get("generation_mode_kwargs")
        refuse_assisted_decoding(generation_mode, (mode_kwargs or {}).get("assistant_model"))
        return super()._validate_generation_mode(generation_mode, *args, **kwargs)

    def load_custom_generate(
        self,
        pretrained_model_name_or_path: str | os.PathLike | None = None,
        trust_remote_code: bool | None = None,
        **kwargs,
    ) -> Callable | None:
        """transformers' loader of a `custom_generate` decoding method, which under HF_HUB_OFFLINE=1 says a Hub repo
        not in the local cache has no such method: said as it is instead (`generation.custom_generate_offline_error`)."""
        try:
            return super().load_custom_generate(pretrained_model_name_or_path, trust_remote_code, **kwargs)
        except OSError as error:
            offline = custom_generate_offline_error(pretrained_model_name_or_path)
            if offline is None:
                raise
            raise offline from error

    def _prepare_cache_for_generation(
        self, generation_config: GenerationConfig, model_kwargs: dict, *args, **kwargs
    ) -> None:
        """generate() gets a `GPNCache` (not a `DynamicCache`) unless the caller passed one; cache kinds a GPN does
        not have, and what would roll its state back, are refused (`generation.generation_cache`); so are generation
        values that would be wrong in silence (`generation.check_generation_values`)."""
        cache = generation_cache(self.config, generation_config, model_kwargs)
        # (transformers passes the generation mode, the batch size before beams and the cache's length)
        batch_size = args[1] if len(args) > 1 else kwargs.get("batch_size", 1)
        check_generation_values(self.config, generation_config, batch_size, self.device)
        if cache is not None:
            model_kwargs["cache"] = cache

    def _prepare_position_ids_for_generation(self, inputs_tensor: torch.Tensor, model_kwargs: dict) -> None:
        """No position ids from generate(): it builds them from the attention mask for every model whose forward
        names `position_ids` (a GPN's does, for `Trainer`: `add_packing_parameters`) and passes them at every
        token, which a GPN, having no positions, would only read for packed starts, off the one-call decode. Those
        the caller passes (a packed prompt) are passed on as given."""
        return None

    def init_continuous_batching(self, *args, **kwargs) -> NoReturn:
        """Refused: transformers' continuous batching (`generate_batch`, `generate(cache_implementation="paged")`,
        `transformers serve --continuous-batching`) schedules requests over a paged attention cache. A GPN keeps one
        fixed-size state a row: batch prompts in one `generate()` call (left-padded), or serve with `gpn serve`."""
        raise ValueError(
            "continuous batching (generate_batch, cache_implementation='paged') needs a paged attention cache, which a "
            "GPN does not have: it keeps one fixed-size state a row. Batch prompts in one generate() call (left-padded), "
            "or serve with `gpn serve`, which keeps each conversation's state"
        )

    def prepare_inputs_for_generation(
        self,
        input_ids: torch.LongTensor,
        next_sequence_length: int | None = None,
        cache: GPNCache | None = None,
        attention_mask: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        is_first_iteration: bool | None = False,
        position_ids: torch.LongTensor | None = None,
        **kwargs,
    ) -> dict:
        """transformers' `prepare_inputs_for_generation`, and for a decoded token (one new position a row, from a
        GPNCache that holds a state, nothing beyond `use_cache` and `logits_to_keep` to pass on) the same inputs
        built directly: the last ids (a contiguous copy), the cache, the mask if any, the kwargs. transformers'
        generic version asks the config and the model's device afresh at every token, which on a small GPN
        costs more than a tenth of the token. (`position_ids` is None unless the caller passed some to generate():
        `_prepare_position_ids_for_generation`.)"""
        if (
            next_sequence_length == 1
            and not is_first_iteration
            and inputs_embeds is None
            and position_ids is None
            and isinstance(cache, GPNCache)
            and cache.has_state
            and kwargs.keys() <= {"use_cache", "logits_to_keep"}
            and input_ids.device == cache.state_buffers()[0].device  # (else transformers moves them to the model)
        ):
            inputs = {"input_ids": input_ids[:, -1:].clone(memory_format=torch.contiguous_format), "cache": cache}
            if attention_mask is not None:
                inputs["attention_mask"] = attention_mask
            return inputs | kwargs
        if is_first_iteration and isinstance(cache, GPNCache) and cache.has_state:
            # the prefill from a kept state: `_prefill` has chosen the positions to read (`continue_from_cache`);
            # transformers 5.25 slices them again by the positions the cache read, as if they were the whole
            # sequence (always for inputs_embeds), which would drop new positions (5.24 did not, for a recurrent cache)
            next_sequence_length = None
        peer = kwargs.pop(SYNCED_PEER, None)
        if peer is not None:  # a synced decoding (`_sample`, `_beam_search`): its idle forwards advance a copy
            return self.prepare_inputs_for_generation(
                input_ids,
                next_sequence_length,
                peer.cache_for_forward(cache),
                attention_mask,
                inputs_embeds,
                is_first_iteration,
                position_ids,
                **kwargs,
            )
        return super().prepare_inputs_for_generation(
            input_ids,
            next_sequence_length=next_sequence_length,
            cache=cache,
            attention_mask=attention_mask,
            inputs_embeds=inputs_embeds,
            is_first_iteration=is_first_iteration,
            position_ids=position_ids,
            **kwargs,
        )

    def _sample(self, *args, synced_gpus: bool = False, **kwargs):
        """transformers' greedy and sampling loop. Under `synced_gpus`, the forwards this process runs after its rows
        have all finished (to keep the collectives matched) advance a throwaway copy of the cache, so the cache kept
        and returned holds the sequences' state (`generation.SyncedPeer`); without it, the loop as it is. Either way,
        a state gone non-finite at a decoded token is refused after the loop (float16's overflow: see
        `generation.refuse_non_finite_decoded_state`)."""
        return decode_keeping_the_sequences_state(self, super()._sample, args, synced_gpus, kwargs)

    def _beam_search(self, *args, synced_gpus: bool = False, **kwargs):
        """transformers' beam search, with `_sample`'s handling of `synced_gpus`."""
        return decode_keeping_the_sequences_state(self, super()._beam_search, args, synced_gpus, kwargs)

    def _has_unfinished_sequences(self, this_peer_finished: bool, synced_gpus: bool, device: torch.device) -> bool:
        """transformers' test at the top of every decoding step; under `synced_gpus` it also notes for `SyncedPeer`
        whether this process's next forward is idle (its rows have all finished while others go on), which only
        this step sees."""
        unfinished = super()._has_unfinished_sequences(this_peer_finished, synced_gpus, device)
        peer = self.__dict__.get("_gpn_synced_peer") if synced_gpus else None
        if peer is not None:
            peer.finished = bool(this_peer_finished) and unfinished
        return unfinished

    def _prefill(
        self, input_ids: torch.Tensor, generation_config: GenerationConfig, model_kwargs: dict, *args, **kwargs
    ):
        """Continue generation from a returned cache, given the whole sequence or only the new positions, never
        a position read twice (`generation.continue_from_cache`); then check the prompt's logits are finite."""
        input_ids, model_kwargs, seen = continue_from_cache(input_ids, generation_config, model_kwargs)
        outputs = super()._prefill(input_ids, generation_config, model_kwargs, *args, **kwargs)
        refuse_non_finite_prompt_logits(
            self,
            getattr(outputs, "logits", None),
            copies=max(generation_config.num_beams or 1, generation_config.num_return_sequences or 1),
            continued=seen > 0,
            embeds=model_kwargs.get("inputs_embeds") is not None,
        )
        return outputs

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: GPNCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        output_memory_decays: bool = False,
        output_predicted_states: bool = False,
        return_dict: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        return_logits: bool = True,
        num_items_in_batch: torch.Tensor | int | None = None,
        *,
        position_ids: torch.LongTensor | None = None,
        seq_idx: torch.Tensor | None = None,
        **kwargs,
    ) -> GPNCausalLMOutput | tuple:
        """Next-token logits at every position (or the last `logits_to_keep`), and the causal LM loss
        when `labels` or `shift_labels` are given, as transformers' `ForCausalLMLoss` computes it.

        Args:
            logits_to_keep: the logits returned, as in transformers' causal LMs: an int keeps the last that many
                positions (0: all), a 1-D integer tensor the positions it names. The loss is over every position.
            labels: (batch, seq) token ids; the loss at position t targets `labels[:, t + 1]` (-100 ignored).
            shift_labels (keyword): (batch, seq) targets already shifted (position t targets
                `shift_labels[:, t]`), as context-parallel training passes them; they take precedence over
                `labels`. A keyword, not a parameter, as in transformers' models: `Trainer` takes every
                parameter named like a label for a required label column.
            num_items_in_batch: the number of counted targets in the whole (accumulated) batch, as
                `Trainer` passes it: the loss is then the sum over this call's targets divided by it, so
                gradient accumulation gives exactly the loss of the whole batch. Without it, the mean.
            return_logits: with a loss and `return_logits=False` (training), the loss is computed in
                chunks of positions and never holds the (batch, seq, vocab) logits; `logits` is then None.
            Other arguments: see `GPNModel.forward` (`past_key_values` is a deprecated alias of `cache`).
        """
        add_packing_parameters(kwargs, position_ids, seq_idx)  # (read as keywords from here on, as by the base model)
        return_dict = return_dict if return_dict is not None else True
        cache = pop_cache_alias(cache, kwargs)
        shift_labels = kwargs.pop("shift_labels", None)
        check_labels(labels, "labels", self.config.vocab_size)
        check_labels(shift_labels, "shift_labels", self.config.vocab_size)
        refuse_attention_outputs(kwargs.get("output_attentions"), self.config.output_attentions)
        asks_only_logits = (
            inputs_embeds is None
            and labels is None
            and shift_labels is None
            and return_logits
            and not (output_memory_decays or output_predicted_states)
            and not (output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states)
            and (use_cache if use_cache is not None else self.config.use_cache and not self.training)
            and kwargs.keys() <= DECODED_TOKEN_KWARGS
            # (positions named by a tensor, or a count that names none, are checked by the one-pass path)
            and isinstance(logits_to_keep, int)
            and logits_to_keep >= 0
        )
        if asks_only_logits and isinstance(input_ids, torch.Tensor) and not is_tracing():
            # a decoded token (one a row, from a cache): the whole of it in one C call where it is plain
            logits = fast_decode_token(
                self, input_ids, attention_mask, cache, norm_class=GPNRMSNorm, methods=DECODED_TOKEN_METHODS
            )
            if logits is not None:
                output = GPNCausalLMOutput.of_decoded_token(logits, cache)
                return output if return_dict else output.to_tuple()
        chunk_length = prefill_chunk_length_for(
            self,
            input_ids,
            inputs_embeds,
            labels,
            shift_labels,
            logits_to_keep,
            return_logits,
            output_hidden_states,
            output_memory_decays,
            output_predicted_states,
        )
        if chunk_length:  # (aLoRA's offsets count the whole call's positions, not a chunk's: checked on the whole)
            refuse_split_alora_offsets(self.model, (input_ids if input_ids is not None else inputs_embeds).shape[1])
        chunked = chunk_length and forward_in_chunks(
            self,
            chunk_length,
            input_ids,
            inputs_embeds,
            attention_mask,
            cache,
            use_cache,
            labels,
            shift_labels,
            logits_to_keep,
            num_items_in_batch,
            kwargs,
        )
        if chunked:  # (None: a packed batch, which runs in one pass)
            loss, logits, cache = chunked
            output = GPNCausalLMOutput(loss=loss, logits=logits, cache=cache)
            return output if return_dict else output.to_tuple()
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_hidden_states=output_hidden_states,
            output_memory_decays=output_memory_decays,
            output_predicted_states=output_predicted_states,
            return_dict=True,
            **kwargs,
        )
        hidden = outputs.last_hidden_state
        for name, given in (("labels", labels), ("shift_labels", shift_labels)):
            if given is not None and given.shape != hidden.shape[:2]:
                raise ValueError(f"{name} must have shape {tuple(hidden.shape[:2])}, got {tuple(given.shape)}")
        extras = dict(
            cache=outputs.cache,
            hidden_states=outputs.hidden_states,
            memory_decays=outputs.memory_decays,
            predicted_states=outputs.predicted_states,
        )
        wants_loss = labels is not None or shift_labels is not None
        if wants_loss and not return_logits:
            loss = self._chunked_loss(hidden, labels, shift_labels, num_items_in_batch)
            output = GPNCausalLMOutput(loss=loss, **extras)
            return output if return_dict else output.to_tuple()
        keeps_all = isinstance(logits_to_keep, int) and logits_to_keep == 0
        logits = self.logits_of(hidden if keeps_all else hidden[:, positions_to_keep(logits_to_keep, hidden.shape[1])])

        loss = None
        if wants_loss:
            full_logits = logits if keeps_all else self.logits_of(hidden)
            loss = causal_lm_loss(full_logits, labels, shift_labels, num_items_in_batch)

        output = GPNCausalLMOutput(loss=loss, logits=logits, **extras)
        return output if return_dict else output.to_tuple()

    # A long no-grad forward that asks only for the last logits or the chunked loss runs its positions this
    # many at a time, in bounded memory (prefill.py); 0 (on a model or the class) turns chunking off.
    prefill_chunk_length: int = 2048

    def output_matrix(self) -> torch.Tensor | None:
        """The (vocab, e) matrix the logits multiply `last_hidden_state` by, for reading directly (as the chunked
        loss does): `lm_head`'s weight, or the wrapped embedding's table while the output follows it; None where
        only calling `lm_head` computes the output (a wrapped, replaced, biased or hooked head), or each row has its own
        (PEFT's mixed-batch inference with an adapter on the embedding).

        Under FSDP2 a weight still sharded is gathered (`full_tensor()`, whose backward reduce-scatters the
        gradient), as TRL's fused head does; an FSDP2 module's own hooks are its sharding, not a change of output.
        """
        if self.output_follows_embedding():
            if mixed_batch_adapter_names(self.model.embed_tokens) is not None:
                return None  # (one matrix per row's adapter: `logits_of` computes them)
            return self.embedding_table()
        head = self.lm_head
        if not _is_plain_linear(head) or head.bias is not None:
            return None
        # (an FSDP2 module's own hooks are its sharding; a forward set on its instance is still a change)
        if _runs_more_than_its_forward(head) if not _is_fsdp_module(head) else "forward" in head.__dict__:
            return None
        self._check_tied()
        weight = head.weight
        return weight.full_tensor() if hasattr(weight, "full_tensor") else weight

    def _chunked_loss(
        self,
        hidden: torch.Tensor,
        labels: torch.Tensor | None,
        shift_labels: torch.Tensor | None,
        num_items_in_batch: torch.Tensor | int | None,
    ) -> torch.Tensor:
        """`causal_lm_loss` of lm_head(hidden) without holding the logits (`chunked_causal_lm_loss`); through the
        full logits where only calling the head computes them (`output_matrix`)."""
        matrix = self.output_matrix()
        if matrix is None:
            return causal_lm_loss(self.logits_of(hidden), labels, shift_labels, num_items_in_batch)
        return chunked_causal_lm_loss(
            hidden, matrix, labels, shift_labels=shift_labels, num_items_in_batch=num_items_in_batch
        )


# generate() inspects the forward's signature at every token of a model defined outside transformers (does it
# take `cache_position`?): computed once here, as `inspect.signature` returns a function's `__signature__`
GPNForCausalLM.forward.__signature__ = inspect.signature(GPNForCausalLM.forward)


def _as_written(cls: type, *names: str) -> dict:
    return {name: cls.__dict__[name] for name in names}


# The methods the fast path computes without calling them, by class, as written here: those the plain loop
# (`recurrence_plain`) calls. One set on an instance (`model.model.ground = ...`), overridden by a subclass or
# assigned to the class (an interpretability patch of a step, a steering `ffn`) takes effect only where it is
# called, so the plain path then runs (`GPNModel.fast_path_blocker`).
RECURRENCE_METHODS = {
    GPNRMSNorm: _as_written(GPNRMSNorm, "forward"),
    GPNMemoryWrite: _as_written(GPNMemoryWrite, "forward", "keys", "log_decay"),
    GPNPredictLayer: _as_written(GPNPredictLayer, "forward", "ffn", "read"),
    GPNSegmentLayer: _as_written(GPNSegmentLayer, "forward"),
    GPNModel: _as_written(GPNModel, "recurrence_plain", "_plain_steps", "step", "ground", "predict"),
}
# A decoded token in one C call (`fast_recurrence.fast_decode_token`) computes more without calling it: the base
# model's forward (its token side, recurrence and decoder) and the logits. Those replaced, the forward runs.
DECODED_TOKEN_METHODS = RECURRENCE_METHODS | {
    GPNModel: RECURRENCE_METHODS[GPNModel] | _as_written(GPNModel, "forward", "token_inputs", "recurrence", "decoded"),
    GPNForCausalLM: _as_written(GPNForCausalLM, "logits_of"),
}


def causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor | None,
    shift_labels: torch.Tensor | None = None,
    num_items_in_batch: torch.Tensor | int | None = None,
) -> torch.Tensor:
    """transformers' `ForCausalLMLoss` for (batch, seq, vocab) logits: float32 cross-entropy of position t
    against `labels[:, t + 1]` (or `shift_labels[:, t]`), -100 ignored; the mean, or the sum divided by
    `num_items_in_batch` when given (exact gradient accumulation)."""
    if shift_labels is None:
        logits, targets = logits[:, :-1], labels[:, 1:]
    else:
        targets = shift_labels
    targets = targets.reshape(-1).to(logits.device)
    logits = logits.float().reshape(-1, logits.shape[-1])
    if num_items_in_batch is None:
        return F.cross_entropy(logits, targets, ignore_index=-100)
    return divide_loss_sum(
        F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum"), targets, num_items_in_batch
    )


class GPNForSequenceClassification(GPNPreTrainedModel):
    """GPN with a score head on the decoded vector (`last_hidden_state`) at each row's last real token: sequence
    classification and regression (`config.num_labels`, `config.problem_type`, transformers' loss), and reward
    models (`num_labels=1`, as TRL's `RewardTrainer` builds them).

    A row's last real token is the last position its `attention_mask` marks 1 (padding may sit anywhere in the
    row, as in the causal LM: padded positions leave the state unchanged; transformers' own classifiers read the ids
    alone, and skip a real last token that is the pad token, which a GPN scores); without a mask, the rightmost
    token that is not `config.pad_token_id`, as in transformers' models (one row without a pad token set: its last
    token; several are refused, as transformers refuses them). Without a mask, padding is read as tokens: pass the
    mask with padded batches. A row holds one sequence: rows that pack several (padding-free batches: position ids
    restarting, `cu_seq_lens_q/k`, `seq_idx`) are refused, as their one score would be the last sequence's.
    Continuing a cache, the new positions are scored with what the cache read (the mask may cover both). Labels
    that do not fit the problem type are refused by name (`arguments.check_classification_labels`).
    """

    # The loss is a mean over the batch's rows, not a sum over counted tokens: `Trainer` then divides it by the
    # gradient-accumulation steps itself instead of passing `num_items_in_batch`.
    accepts_loss_kwargs = False

    def __init__(self, config: GPNConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = GPNModel(config)
        self.score = linear(config.embedding_size, config.num_labels, bias=False, init_scheme="normal")
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        """The base model's token embedding table."""
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        """Replace the base model's token embedding table."""
        self.model.embed_tokens = value

    def refuse_unknown_padding(
        self, batch_size: int, attention_mask: torch.Tensor | None, input_ids: torch.Tensor | None
    ) -> None:
        """Several rows whose padding nothing shows are refused: neither an attention mask nor `config.pad_token_id`
        (transformers' sequence classifiers refuse these too), or embeddings without a mask (transformers warns,
        once). A padded row would be scored at its last position, a pad token, in silence (a tokenizer given a pad
        token that the config was not, the mask left out)."""
        if attention_mask is not None or batch_size == 1:
            return
        if self.config.pad_token_id is None:
            why = "rows without an attention_mask, and config.pad_token_id is None"
        elif input_ids is None:
            why = "rows of inputs_embeds without an attention_mask (no token ids to find the pad token in)"
        else:
            return
        raise ValueError(
            f"{type(self).__name__} got {batch_size} {why}: it cannot tell where a padded row's real tokens end. "
            "Pass the attention_mask (the tokenizer returns it)"
            + (", or set config.pad_token_id to the id the rows are padded with" if input_ids is not None else "")
        )

    def last_real_positions(
        self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None, batch_size: int, seq_len: int
    ) -> torch.Tensor:
        """(batch,) index of each row's last real position among the call's `seq_len` positions (see the class);
        a row with none (all padding) gives its last position, whose output is the state carried in."""
        positions = torch.arange(seq_len)
        if attention_mask is not None:
            real = attention_mask[:, -seq_len:].bool()
        elif input_ids is not None and self.config.pad_token_id is not None:
            real = input_ids != self.config.pad_token_id
        else:
            return torch.full((batch_size,), seq_len - 1, dtype=torch.long)
        positions = positions.to(real.device)
        last = torch.where(real, positions, -1).amax(dim=-1)
        return torch.where(last < 0, seq_len - 1, last)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: GPNCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        output_memory_decays: bool = False,
        output_predicted_states: bool = False,
        return_dict: bool | None = None,
        *,
        position_ids: torch.LongTensor | None = None,
        seq_idx: torch.Tensor | None = None,
        **kwargs,
    ) -> GPNSequenceClassifierOutput | tuple:
        """Scores (batch, num_labels) at each row's last real token, and transformers' sequence-classification
        loss when `labels` are given (regression for `num_labels=1`, else single- or multi-label by
        `config.problem_type` or the labels' dtype). `margin` (TRL's `RewardTrainer` passes a preference dataset's
        margins with the batch, for its loss) is accepted and not read. Other arguments: see `GPNModel.forward`
        (named `position_ids` and `seq_idx` that pack several sequences in a row are refused: one score a row)."""
        add_packing_parameters(kwargs, position_ids, seq_idx)
        return_dict = return_dict if return_dict is not None else True
        cache = pop_cache_alias(cache, kwargs)
        # TRL's RewardTrainer passes its batch whole, with the pairs' `margin` when the dataset has that column: its
        # own loss reads it from the batch, the scores do not depend on it (a Llama's forward drops it too)
        kwargs.pop("margin", None)
        rows = input_ids if input_ids is not None else inputs_embeds
        if isinstance(rows, torch.Tensor) and rows.dim() >= 2:  # (other inputs are the base model's to refuse)
            self.refuse_unknown_padding(rows.shape[0], attention_mask, input_ids)
            check_classification_labels(labels, self.config, rows.shape[0])
        continuing = isinstance(cache, GPNCache) and cache.has_state  # (before the call below updates the cache)
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_hidden_states=output_hidden_states,
            output_memory_decays=output_memory_decays,
            output_predicted_states=output_predicted_states,
            return_dict=True,
            **kwargs,
        )
        hidden = outputs.last_hidden_state
        batch_size, seq_len = hidden.shape[:2]
        mask = None if attention_mask is None else attention_mask[:, -seq_len:].bool()
        refuse_packed_rows(
            batch_size, seq_len, mask, kwargs, "GPNForSequenceClassification", hidden.device, continuing=continuing
        )
        last = self.last_real_positions(input_ids, attention_mask, batch_size, seq_len).to(hidden.device)
        pooled = hidden[torch.arange(batch_size, device=hidden.device), last]
        weight = self.score.weight
        logits = self.score(pooled.to(weight.dtype) if weight.is_floating_point() else pooled)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, pooled_logits=logits, config=self.config)
        output = GPNSequenceClassifierOutput(
            loss=loss,
            logits=logits,
            cache=outputs.cache,
            hidden_states=outputs.hidden_states,
            memory_decays=outputs.memory_decays,
            predicted_states=outputs.predicted_states,
        )
        return output if return_dict else output.to_tuple()


GPNConfig.register_for_auto_class()
GPNForCausalLM.register_for_auto_class("AutoModelForCausalLM")
GPNForSequenceClassification.register_for_auto_class("AutoModelForSequenceClassification")
GPNModel.register_for_auto_class("AutoModel")
# The tools that ask "is this a causal LM?" read transformers' table of them, which `register` does not extend:
# the Trainer shifts the labels of its label smoothing only for the models named there (without it a GPN learns to
# predict the token it reads), lm-eval picks its causal backend from it. Here, so the Hub's remote code does it too.
MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.setdefault(GPNConfig.model_type, GPNForCausalLM.__name__)

__all__ = [
    "GPNCache",
    "GPNForCausalLM",
    "GPNForSequenceClassification",
    "GPNModel",
    "GPNPreTrainedModel",
    "GPNStateFileError",
]
