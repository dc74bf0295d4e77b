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

transformers convention: `logits[:, t]` predicts token t+1 after reading tokens 0..t, so position t of
this model is position t+1 of the reference implementation (see `GPN.md`).

The recurrent state and memory are float32 whatever the weights' dtype, as in the reference.

This file and `configuration_gpn.py` ship to the Hub as remote code: they import nothing from the
installed `modeling_gpn` package.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache, LinearAttentionLayer
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import CausalLMOutputWithPast, ModelOutput
from transformers.utils import logging

from .chunked_loss import chunked_causal_lm_loss, divide_loss_sum
from .configuration_gpn import GPNConfig
from .derived_weights import derived_weights_scope, keep_with
from .fast_recurrence import fast_project, fast_recurrence, foldable_parameter, output_logits

logger = logging.get_logger(__name__)

L2_NORM_EPS = 1e-12  # inside the square root of every per-head L2 normalisation, as in the reference
DEFAULT_CHECKPOINT_SEGMENT_LENGTH = 64  # what gradient_checkpointing_enable() sets when bptt_segment_length is unset


def is_tracing() -> bool:
    """Whether torch.compile, torch.export, torch.jit or torch.fx is tracing the current call.

    Under tracing the plain path runs (the fast path reads data pointers and calls C kernels) and input
    checks that depend on tensor values are left out (they cannot be decided on symbolic tensors).
    """
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return True
    is_exporting = getattr(torch.compiler, "is_exporting", None)
    if is_exporting is not None and is_exporting():
        return True
    is_fx_symbolic_tracing = getattr(torch.fx._symbolic_trace, "is_fx_symbolic_tracing", None)
    return bool(is_fx_symbolic_tracing is not None and is_fx_symbolic_tracing())


# --------------------------------------------------------------------------------------------------
# The two normalisations of the equations
# --------------------------------------------------------------------------------------------------


class GPNRMSNorm(nn.Module):
    """rms(x; w) = x / sqrt(mean(x^2) + eps) * w, computed in float32 (returns float32)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()

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
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + L2_NORM_EPS)


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
# The recurrent cache: (p, g, M) per row, its size independent of the sequence length
# --------------------------------------------------------------------------------------------------


# ---- what a cache has read: a fingerprint, to tell generate()'s two ways of continuing apart ------------

_FINGERPRINT_MODULUS = 2**31 - 1  # a prime; products of two residues fit in int64
_FINGERPRINT_BASES = (1_000_003, 998_244_353 % (2**31 - 1))  # two independent polynomial hashes: ~62 bits
_PADDING_VALUE = 1  # a padded position's value in the hash (a token id t counts as t + 2)


def token_fingerprint(token_ids: torch.Tensor, mask: torch.Tensor | None, start: torch.Tensor | None = None) -> torch.Tensor:
    """(batch, 2) int64: two polynomial hashes of each row's positions (a padded position counts as padding,
    whatever its id), continuing `start` (the fingerprint of the positions before these) when given.

    The same positions give the same fingerprint however they were split into calls.
    """
    modulus = _FINGERPRINT_MODULUS
    values = token_ids.long() + 2
    if mask is not None:
        values = torch.where(mask.bool(), values, torch.full_like(values, _PADDING_VALUE))
    length = values.shape[1]
    # powers[i] = base^(length-1-i) mod p, built by doubling (log2(length) steps)
    powers = torch.ones(1, 2, dtype=torch.int64, device=values.device)
    while powers.shape[0] < length:
        step = torch.tensor([pow(b, powers.shape[0], modulus) for b in _FINGERPRINT_BASES], device=values.device)
        powers = torch.cat([powers * step % modulus, powers])
    powers = powers[-length:]
    folded = (values[:, :, None] * powers % modulus).sum(dim=1) % modulus
    if start is not None:
        shift = torch.tensor([pow(b, length, modulus) for b in _FINGERPRINT_BASES], device=values.device)
        folded = (folded + start.to(values.device) * shift % modulus) % modulus
    return folded


class ReadFingerprint:
    """The fingerprint of every position a cache has read (`token_fingerprint`), or "unknown".

    Decoding appends one token a call: those are kept as they come (one small tensor a call) and folded
    into the fingerprint every `FOLD_EVERY` calls or when it is asked for; longer calls fold at once. It
    becomes unknown when the cache reads positions given as `inputs_embeds`, or is rebuilt without its
    history (pytree unflattening: a traced or exported program's cache).
    """

    FOLD_EVERY = 64

    def __init__(self, known: bool = True):
        self.known = known
        self.folded: torch.Tensor | None = None  # (batch, 2), None before any position
        self.pending: list[tuple[torch.Tensor, torch.Tensor | None]] = []

    def record(self, token_ids: torch.Tensor | None, mask: torch.Tensor | None) -> None:
        if token_ids is None or not self.known:
            self.forget()
            return
        self.pending.append((token_ids.detach().clone(), None if mask is None else mask.detach().clone()))
        if len(self.pending) >= self.FOLD_EVERY or token_ids.shape[1] > 1:  # a prompt is folded at once, not kept
            self.value()

    def forget(self) -> None:
        self.known, self.folded, self.pending = False, None, []

    def value(self) -> torch.Tensor | None:
        """(batch, 2) fingerprint of everything read, or None when unknown."""
        if not self.known:
            return None
        if self.pending:
            ids = torch.cat([ids for ids, _ in self.pending], dim=1)
            mask = torch.cat([torch.ones_like(i, dtype=torch.bool) if m is None else m.bool() for i, m in self.pending], dim=1)
            self.folded, self.pending = token_fingerprint(ids, mask, self.folded), []
        return self.folded

    def select_rows(self, select) -> None:
        """Apply a row operation (beam search's reordering, repeat_interleave) to the fingerprint."""
        folded = self.value()
        if folded is not None:
            self.folded = select(folded)


# ---- end of the fingerprint ----------------------------------------------------------------------


class GPNStateLayer(LinearAttentionLayer):
    """The single cache layer of a GPN: three recurrent states in fixed buffers updated in place.

    state 0: the predicted state p (batch, d); state 1: the grounded state g (batch, d);
    state 2: the memory M (batch, H, dk, dv), a (batch, 0) placeholder without memory.
    """

    PREDICTED, GROUNDED, MEMORY = 0, 1, 2

    def __init__(self, **kwargs):
        super().__init__(number_of_states=3)
        self.seen_tokens = 0
        self.fingerprint = ReadFingerprint()  # of the positions read (see GPNForCausalLM._prefill)

    def store(self, predicted: torch.Tensor, grounded: torch.Tensor, memory: torch.Tensor) -> None:
        for index, tensor in ((self.PREDICTED, predicted), (self.GROUNDED, grounded), (self.MEMORY, memory)):
            stored = self.recurrent_states[index]
            if stored is not None and stored.shape != tensor.shape:
                raise ValueError(
                    f"GPNCache holds a state of shape {tuple(stored.shape)} but the model produced "
                    f"{tuple(tensor.shape)}: the batch size changed between calls that share a cache"
                )
            self.update_recurrent_state(tensor.detach(), state_idx=index)
            # The stock layer only marks a state as present on conv updates; GPN has no conv.
            self.has_previous_state[index] = True
            if self.device is None:
                self.device, self.dtype = tensor.device, tensor.dtype

    def reset(self) -> None:
        super().reset()
        self.seen_tokens = 0
        self.fingerprint = ReadFingerprint()

    def get_seq_length(self) -> int:
        seen = self.seen_tokens  # a 0-dim tensor only inside a traced program (see the pytree functions)
        return int(seen) if isinstance(seen, torch.Tensor) and not is_tracing() else seen

    @property
    def is_croppable(self) -> bool:
        return False  # a recurrent state cannot be rolled back

    @property
    def batch_size(self) -> int:
        state = self.recurrent_states[self.PREDICTED]
        return -1 if state is None else state.shape[0]

    def batch_repeat_interleave(self, repeats: int) -> None:
        for index in range(self.number_of_states):
            if self.is_recurrent_states_initialized[index]:
                self.recurrent_states[index] = self.recurrent_states[index].repeat_interleave(repeats, dim=0)
        self.fingerprint.select_rows(lambda rows: rows.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        for index in range(self.number_of_states):
            if self.is_recurrent_states_initialized[index]:
                self.recurrent_states[index] = self.recurrent_states[index][indices, ...]
        self.fingerprint.select_rows(lambda rows: rows[indices.to(rows.device)])


class GPNCache(Cache):
    """transformers `Cache` holding a GPN's recurrent state (p, g, M) for every row.

    Its size depends on the batch and the model, never on the number of tokens seen. Beam search
    reorders it through the stock `reorder_cache`; it cannot be cropped (assisted decoding is refused).
    """

    def __init__(self, config: GPNConfig | None = None, **kwargs):
        super().__init__(layers=[GPNStateLayer()])

    @property
    def state_layer(self) -> GPNStateLayer:
        return self.layers[0]

    @property
    def has_state(self) -> bool:
        return all(self.state_layer.has_previous_state.values())

    def get_state(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(p, g, M) as copies (the model never mutates the cache's buffers), or None if empty."""
        if not self.has_state:
            return None
        layer = self.state_layer
        return tuple(layer.recurrent_states[i].clone() for i in range(3))

    def update_state(
        self, predicted: torch.Tensor, grounded: torch.Tensor, memory: torch.Tensor, num_new_tokens: int
    ) -> None:
        """Store the state after `num_new_tokens` more tokens (in place, so addresses stay static)."""
        self.state_layer.store(predicted, grounded, memory)
        seen = self.state_layer.seen_tokens
        if is_tracing() and not isinstance(seen, torch.Tensor):
            # a tensor while tracing, so the count of a dynamic-length program is computed, not frozen (see pytree)
            seen = torch.zeros((), dtype=torch.int64)
        self.state_layer.seen_tokens = seen + num_new_tokens

    def record_read(self, token_ids: torch.Tensor | None, mask: torch.Tensor | None) -> None:
        """Fold the positions just read into the cache's fingerprint (`token_ids` None: positions given as
        embeddings, which make it unknown). `mask` (batch, seq) bool, or None when every position is real."""
        if is_tracing():
            self.state_layer.fingerprint.forget()
        else:
            self.state_layer.fingerprint.record(token_ids, mask)

    def read_fingerprint(self) -> torch.Tensor | None:
        """(batch, 2) fingerprint of the positions read (`token_fingerprint`), or None when unknown."""
        return self.state_layer.fingerprint.value()

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Number of token positions this cache has consumed (padding included)."""
        return self.state_layer.get_seq_length()

    def nbytes(self) -> int:
        """Bytes held by the state buffers."""
        layer = self.state_layer
        return sum(
            layer.recurrent_states[i].numel() * layer.recurrent_states[i].element_size()
            for i in range(3)
            if layer.recurrent_states[i] is not None
        )

    # ---- a state kept: fork, save, load ---------------------------------------------------------------
    # The whole context of a GPN is this state, so it can be copied into N rows (N continuations of one
    # prompt), written to a file and read back in another process. `GPNModel.forward` stamps the cache
    # with the model that fills it (a weak reference), so `save` can record which model the state belongs to.

    def fork(self, num_copies: int) -> GPNCache:
        """A new cache with every row repeated `num_copies` times: rows i*n .. i*n + n - 1 hold row i.

        The forked rows have read the same positions as the original (`get_seq_length()` is unchanged)
        and continue independently: N sampled or beamed continuations of one prompt without reading the
        prompt N times. The original cache is left as it is; `fork(1)` is a copy.
        """
        if isinstance(num_copies, bool) or not isinstance(num_copies, int) or num_copies < 1:
            raise ValueError(f"fork needs a positive number of copies, got {num_copies!r}")
        if not self.has_state:
            raise ValueError("This GPNCache holds no state to fork: run the model on a prompt with it first")
        layer = self.state_layer
        forked = GPNCache()
        forked.update_state(
            *(layer.recurrent_states[i].repeat_interleave(num_copies, dim=0) for i in range(3)),
            num_new_tokens=self.get_seq_length(),
        )
        read = self.read_fingerprint()  # each copy has read what its original row read
        forked.state_layer.fingerprint = ReadFingerprint(known=read is not None)
        if read is not None:
            forked.state_layer.fingerprint.folded = read.repeat_interleave(num_copies, dim=0)
        forked._gpn_model_ref = getattr(self, "_gpn_model_ref", None)
        return forked

    def save(self, path: str | os.PathLike) -> None:
        """Write the state to `path` as safetensors (never pickle), with what identifies its model.

        The file holds p, g and M for every row (float32) and, as metadata, the number of positions read,
        the fingerprint of the model that computed the state (`state_fingerprint`: the configuration
        fields that give the state its meaning, the weights' dtype and a hash of the model's vector
        parameters) and a checksum of the tensors. It is written under a temporary name and renamed,
        so an interrupted save never leaves a partial file at `path`. `GPNCache.load(path, model)` reads it.
        """
        path = Path(path)
        if not self.has_state:
            raise ValueError(f"Cannot save {path}: this GPNCache holds no state (run the model on a prompt first)")
        model_ref = getattr(self, "_gpn_model_ref", None)
        model = model_ref() if model_ref is not None else None
        if model is None:
            raise ValueError(
                f"Cannot save {path}: this GPNCache does not know the model that filled it (it was not filled by "
                "a GPN forward in this process, or that model was deleted), so the file could not say whose state it is"
            )
        layer = self.state_layer
        tensors = {
            name: layer.recurrent_states[index].detach().to("cpu", copy=True).contiguous()
            for index, name in enumerate(STATE_TENSOR_NAMES)
        }
        if not all(bool(torch.isfinite(tensor).all()) for tensor in tensors.values()):
            raise ValueError(f"Cannot save {path}: the state holds NaN or infinite values")
        # what it read (for generate()'s two ways of continuing, `continuation_start`), or "unknown"
        read = self.read_fingerprint()
        read_fingerprint = json.dumps(read.tolist()) if read is not None else "unknown"
        metadata = {
            "format": STATE_FILE_FORMAT,
            "format_version": str(STATE_FILE_VERSION),
            "positions_read": str(self.get_seq_length()),
            "batch_size": str(tensors["predicted"].shape[0]),
            "read_fingerprint": read_fingerprint,
            "checksum": _state_checksum(tensors, read_fingerprint),
            **state_fingerprint(model),
        }
        payload = safetensors.torch.save(tensors, metadata=metadata)
        temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            with open(temporary, "wb") as file:
                file.write(payload)
                file.flush()
                os.fsync(file.fileno())
            os.replace(temporary, path)
        finally:
            temporary.unlink(missing_ok=True)

    @classmethod
    def load(cls, path: str | os.PathLike, model: nn.Module) -> GPNCache:
        """Read a state written by `save` onto `model`'s device, after checking it belongs to `model`.

        Refuses, with a `GPNStateFileError` naming the file: a file that is not a complete GPN state file
        (truncated, damaged: the checksum recorded at save time does not match), the state of another model
        (another configuration, weights dtype or weights), and a state holding NaN or infinite values.
        Continue from it as from the cache `generate()` returns: the new tokens, with an attention mask
        covering `cache.get_seq_length()` positions more.
        """
        path = Path(path)
        base = getattr(model, "base_model", model)
        if not isinstance(base, GPNModel):
            raise TypeError(f"GPNCache.load needs the GPN model the state belongs to, got {type(model).__name__}")
        try:
            payload = path.read_bytes()
        except OSError as error:
            raise GPNStateFileError(f"Cannot read the GPN state file {path}: {error.strerror or error}") from error
        metadata = _state_file_metadata(payload, path)
        try:
            tensors = safetensors.torch.load(payload)
        except Exception as error:  # noqa: BLE001 - safetensors raises its own error types for damaged files
            raise GPNStateFileError(f"{path} is damaged or truncated: safetensors cannot read it ({error})") from error
        if sorted(tensors) != sorted(STATE_TENSOR_NAMES):
            raise GPNStateFileError(f"{path} is not a GPN state file: it holds tensors {sorted(tensors)}, not {list(STATE_TENSOR_NAMES)}")
        read_fingerprint = metadata.get("read_fingerprint", "unknown")
        if metadata.get("checksum") != _state_checksum(tensors, read_fingerprint):
            raise GPNStateFileError(f"{path} is damaged: its tensors do not match the checksum recorded when it was saved")
        _check_state_belongs_to(metadata, base, path)
        batch_size = tensors["predicted"].shape[0]
        expected = {name: (batch_size, *shape) for name, shape in state_shapes(base.config).items()}
        for name, tensor in tensors.items():
            if tuple(tensor.shape) != expected[name] or tensor.dtype != torch.float32:
                raise GPNStateFileError(
                    f"{path} holds {name} of shape {tuple(tensor.shape)} ({tensor.dtype}); this model's is "
                    f"{expected[name]} (float32)"
                )
            if not bool(torch.isfinite(tensor).all()):
                raise GPNStateFileError(f"{path} holds a state with NaN or infinite values (in {name}): it cannot be continued")
        try:
            positions_read = int(metadata.get("positions_read", ""))
        except ValueError:
            positions_read = -1
        if positions_read < 1:
            raise GPNStateFileError(f"{path} does not say how many positions its state has read")
        cache = cls()
        cache.update_state(
            *(tensors[name].to(base.device) for name in STATE_TENSOR_NAMES), num_new_tokens=positions_read
        )
        if read_fingerprint != "unknown":
            read = torch.tensor(json.loads(read_fingerprint), dtype=torch.int64, device=base.device)
            if tuple(read.shape) != (batch_size, 2):
                raise GPNStateFileError(f"{path} holds a read fingerprint of shape {tuple(read.shape)}, not ({batch_size}, 2)")
            cache.state_layer.fingerprint.folded = read
        else:
            cache.state_layer.fingerprint.forget()
        cache._gpn_model_ref = weakref.ref(base)
        return cache


# ---- pytree registration (torch.export / torch.compile) -------------------------------------------
# The children are the state (p, g, M) and the number of positions read, as a 0-dim int64 tensor; the
# context is only whether a state is held. A count in the context would be a SymInt in a program exported
# with a dynamic sequence length (not serializable: torch.export.save failed with "Object of type SymInt
# is not JSON serializable"), and a constant frozen into the program's output spec at tracing time.


def _seen_tokens_tensor(seen: int | torch.Tensor) -> torch.Tensor:
    return seen if isinstance(seen, torch.Tensor) else torch.tensor(seen, dtype=torch.int64)


def _flatten_gpn_cache(cache: GPNCache):
    """pytree children of a `GPNCache`: (p, g, M) when it holds a state, then the positions read (a tensor)."""
    state = [cache.state_layer.recurrent_states[i] for i in range(3)] if cache.has_state else []
    return [*state, _seen_tokens_tensor(cache.state_layer.seen_tokens)], bool(state)


def _unflatten_gpn_cache(children, context) -> GPNCache:
    has_state = context
    *state, seen_tokens = children
    cache = GPNCache()
    layer = cache.state_layer
    if has_state:
        for index, tensor in enumerate(state):
            layer.recurrent_states[index] = tensor
            layer.is_recurrent_states_initialized[index] = True
            layer.has_previous_state[index] = True
        layer.device, layer.dtype = state[0].device, state[0].dtype
    layer.fingerprint = ReadFingerprint(known=False)  # what it read is not part of the pytree
    layer.seen_tokens = seen_tokens  # stays a tensor (no int() on a traced value); get_seq_length() gives an int
    return cache


# A registered pytree, so torch.export and torch.compile can return a cache from forward (and take one in).
# Each import of this file (the package, or a remote-code copy) defines its own GPNCache class to register.
pytree.register_pytree_node(
    GPNCache,
    _flatten_gpn_cache,
    _unflatten_gpn_cache,
    serialized_type_name=f"{__name__}.GPNCache",
    flatten_with_keys_fn=lambda cache: (
        [(pytree.SequenceKey(i), child) for i, child in enumerate(_flatten_gpn_cache(cache)[0])],
        _flatten_gpn_cache(cache)[1],
    ),
)
# ---- end of the pytree registration ---------------------------------------------------------------


# --------------------------------------------------------------------------------------------------
# The state file of `GPNCache.save` / `GPNCache.load`
# --------------------------------------------------------------------------------------------------

STATE_FILE_FORMAT = "gpn-state"
STATE_FILE_VERSION = 1
STATE_TENSOR_NAMES = ("predicted", "grounded", "memory")  # p, g, M: the order of GPNStateLayer's states
# The configuration fields that give a state its meaning (what the recurrence computes and the shapes it
# keeps); training settings (BPTT, token ids, the window hint) do not change it.
STATE_CONFIG_FIELDS = (
    "model_type", "vocab_size", "hidden_size", "embedding_size", "intermediate_size", "num_predict_layers",
    "use_memory", "num_memory_heads", "memory_key_dim", "memory_value_dim", "rms_norm_eps",
)  # fmt: skip


class GPNStateFileError(ValueError):
    """A GPN state file that cannot be continued from: damaged, truncated, another model's, or non-finite."""


def state_shapes(config: GPNConfig) -> dict[str, tuple[int, ...]]:
    """The shape of each state tensor of one row (p, g, M; M is (0,) without memory)."""
    memory = (
        (config.num_memory_heads, config.memory_key_dim, config.memory_value_dim) if config.use_memory else (0,)
    )
    return {"predicted": (config.hidden_size,), "grounded": (config.hidden_size,), "memory": memory}


def state_fingerprint(model: GPNModel) -> dict[str, str]:
    """What identifies the model a state belongs to, as safetensors metadata (strings).

    `state_config`: the `STATE_CONFIG_FIELDS` as JSON; `config_fingerprint`: its SHA-256; `weights_dtype`;
    `weights_fingerprint`: SHA-256 of the model's vector parameters (norm weights, biases, memory decay
    parameters) as float32, in order -- cheap, and different for any two trained or initialised models.
    """
    config = {name: getattr(model.config, name) for name in STATE_CONFIG_FIELDS}
    config_json = json.dumps(config, sort_keys=True)
    vectors = [parameter.detach() for parameter in model.parameters() if parameter.dim() == 1]
    digest = hashlib.sha256()
    for vector in vectors:
        digest.update(vector.to("cpu", torch.float32).contiguous().numpy().tobytes())
    return {
        "state_config": config_json,
        "config_fingerprint": hashlib.sha256(config_json.encode()).hexdigest(),
        "weights_dtype": str(model.dtype).removeprefix("torch."),
        "weights_fingerprint": digest.hexdigest(),
    }


def _state_checksum(tensors: dict[str, torch.Tensor], read_fingerprint: str) -> str:
    """SHA-256 over the state tensors' names, shapes and bytes, in `STATE_TENSOR_NAMES` order, and the
    fingerprint of the positions read (a damaged one could make a continuation feed positions twice)."""
    digest = hashlib.sha256(read_fingerprint.encode())
    for name in STATE_TENSOR_NAMES:
        tensor = tensors[name]
        digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
        digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def _state_file_metadata(payload: bytes, path: Path) -> dict[str, str]:
    """The `__metadata__` of a safetensors file's header, checked to be a GPN state file's."""
    try:
        header_length = int.from_bytes(payload[:8], "little")
        if len(payload) < 8 or header_length > len(payload) - 8:
            raise ValueError(f"the header claims {header_length} bytes but the file has {len(payload)}")
        header = json.loads(payload[8 : 8 + header_length])
        metadata = header.get("__metadata__") or {}
    except (ValueError, AttributeError, UnicodeDecodeError) as error:
        raise GPNStateFileError(f"{path} is damaged or truncated, or not a safetensors file ({error})") from error
    if not isinstance(metadata, dict) or metadata.get("format") != STATE_FILE_FORMAT:
        raise GPNStateFileError(f"{path} is not a GPN state file (written by GPNCache.save)")
    if metadata.get("format_version") != str(STATE_FILE_VERSION):
        raise GPNStateFileError(
            f"{path} is a GPN state file of format version {metadata.get('format_version')}; this code reads version {STATE_FILE_VERSION}"
        )
    return metadata


def _check_state_belongs_to(metadata: dict[str, str], model: GPNModel, path: Path) -> None:
    """Refuse the state of another model: another configuration, weights dtype, or weights."""
    ours = state_fingerprint(model)
    if metadata.get("config_fingerprint") != ours["config_fingerprint"]:
        try:
            theirs = json.loads(metadata.get("state_config", "{}"))
        except ValueError:
            theirs = {}
        mine = json.loads(ours["state_config"])
        differences = [f"{name} {theirs.get(name)!r} (this model: {mine[name]!r})" for name in mine if theirs.get(name) != mine[name]]
        raise GPNStateFileError(f"{path} holds the state of another model: {'; '.join(differences) or 'another configuration'}")
    if metadata.get("weights_dtype") != ours["weights_dtype"]:
        raise GPNStateFileError(
            f"{path} holds a state computed with {metadata.get('weights_dtype')} weights; this model's are {ours['weights_dtype']}"
        )
    if metadata.get("weights_fingerprint") != ours["weights_fingerprint"]:
        raise GPNStateFileError(
            f"{path} holds the state of another model: same configuration, other weights (weights fingerprint differs)"
        )


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
        last_hidden_state: the predicted state p at every position (batch, seq, d), float32;
            position t is the state that predicts token t+1.
        cache: the `GPNCache` after the last position, when `use_cache`.
        hidden_states: with `output_hidden_states`, a one-element tuple holding the predicted states
            (a GPN has a single state, not a stack of layers).
        memory_decays: with `output_memory_decays` (GPN+M), gamma (batch, seq, H): the log retention
            of each memory head at each position (retention per step = exp(gamma)).
    """

    last_hidden_state: torch.Tensor | None = None
    cache: Cache | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    memory_decays: torch.Tensor | None = None


@dataclass
class GPNCausalLMOutput(CausalLMOutputWithPast):
    """`CausalLMOutputWithPast` plus the per-head memory decays (see `GPNModelOutput`)."""

    memory_decays: torch.Tensor | None = None


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
        steps,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(outputs, p, g, M, gamma or None) after the segment's positions (tensors positional, as reentrant
        checkpointing needs them; `sequence_starts`: where packed sequences start in the segment, or None)."""
        return steps(
            token_inputs, predicted, grounded, memory, mask, first_position, output_memory_decays, sequence_starts
        )


def is_torch_checkpoint(function) -> bool:
    """Whether `function` is torch.utils.checkpoint.checkpoint, possibly with `use_reentrant` bound (what
    `gradient_checkpointing_enable()` installs without `offload`)."""
    from torch.utils.checkpoint import checkpoint

    if isinstance(function, functools.partial):
        return function.func is checkpoint and not function.args and set(function.keywords) <= {"use_reentrant"}
    return function is checkpoint


# ---- end of gradient checkpointing -------------------------------------------------------------------


class GPNPreTrainedModel(PreTrainedModel):
    config_class = GPNConfig
    config: GPNConfig
    base_model_prefix = "model"
    # Activation checkpointing recomputes BPTT segments (`GPNSegmentLayer`, `_set_gradient_checkpointing`).
    supports_gradient_checkpointing = True
    _no_split_modules = ["GPNModel"]
    _is_stateful = True  # generate() refuses assisted decoding: a recurrent state cannot be rolled back
    _supports_cache_class = True

    def save_pretrained(self, save_directory, *args, **kwargs):
        """`PreTrainedModel.save_pretrained`, with an `auto_map` naming every auto class a GPN serves.

        transformers records only the saved model's own auto class; the folder then loads through remote
        code (`trust_remote_code=True`, without this package) as `AutoConfig`, `AutoModel` and
        `AutoModelForCausalLM` alike.
        """
        module = type(self).__module__.rsplit(".", 1)[-1]
        auto_map = dict(getattr(self.config, "auto_map", None) or {})
        auto_map.setdefault("AutoModel", f"{module}.GPNModel")
        auto_map.setdefault("AutoModelForCausalLM", f"{module}.GPNForCausalLM")
        self.config.auto_map = auto_map
        return super().save_pretrained(save_directory, *args, **kwargs)

    def _set_gradient_checkpointing(self, enable: bool = True, gradient_checkpointing_func=None, every_n_layers: int = 1):
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
    param_name, param = next((n, p) for n, p in module._parameters.items() if not foldable_parameter(module, n, p))
    return f"{name}.{param_name} is a {type(param).__qualname__}, not a plain nn.Parameter (nor a weight the fast path takes)"


class GPNModel(GPNPreTrainedModel):
    """The GPN recurrence: token ids in, the predicted state p at every position out."""

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
        self.segment_layer = GPNSegmentLayer()  # the plain loop's segments; see GPNPreTrainedModel._set_gradient_checkpointing
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    # ---- pieces of one step, in the order of the equations ----------------------------------------

    def token_inputs(self, embeddings: torch.Tensor) -> torch.Tensor:
        """W_fuse rms(E[x]) for every position at once: the token side has no recurrence."""
        return fast_project(self.fuse_proj, self.fuse_norm(embeddings), self.use_fast_path)  # (project; see decode)

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
        config = self.config
        d = config.hidden_size
        if config.use_memory:
            memory_shape = (batch_size, config.num_memory_heads, config.memory_key_dim, config.memory_value_dim)
        else:
            memory_shape = (batch_size, 0)
        zeros = lambda *shape: torch.zeros(*shape, device=device, dtype=torch.float32)  # noqa: E731
        return zeros(batch_size, d), zeros(batch_size, d), zeros(*memory_shape)

    use_fast_path: bool = True  # set False on a model (or its class) to run the plain loop
    last_recurrence_path: str | None = None  # "fast" or "plain": what the last eager call ran
    last_recurrence_backends = None  # on the fast path, the backends its last window ran (`fast_recurrence.Backends`)

    # Children the fast path does not fold: it calls them as modules, like the plain path. (The segment
    # layer, which only the plain path calls, is checked on its own in `fast_path_blocker`.)
    _CALLED_CHILDREN = ("embed_tokens", "fuse_norm", "fuse_proj", "segment_layer")

    def fast_path_blocker(self) -> str | None:
        """Why the fast path cannot run on this model now, or None when it can.

        The fast path folds the weights of the step's modules into a few matrices and never calls those
        modules, so it computes the model only when each of them is exactly what it folds: an
        `nn.Linear` or `GPNRMSNorm` of that exact class (a subclass, a PEFT LoRA wrapper or a quantized
        replacement is not), with plain `nn.Parameter` weights (no tensor subclass, no parametrization),
        and no forward or backward hooks on it or registered globally. Anything else runs the plain path,
        which calls every module. So does gradient checkpointing with a checkpoint function other than
        `torch.utils.checkpoint.checkpoint` (whose work the fast path does itself), and a hook on the
        segment layer: the plain path calls them on every segment.
        """
        module_hooks = torch.nn.modules.module
        for name in ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks", "_global_backward_hooks"):
            if getattr(module_hooks, name, None):
                return f"a global module hook is registered ({name.strip('_')})"
        blocker = self._segment_layer_blocker()
        if blocker is not None:
            return blocker
        allowed = (nn.Linear, GPNRMSNorm, nn.ModuleList, GPNMemoryWrite, GPNPredictLayer)
        # Runs before every fast call (decoding too): a flat walk over the two levels of modules below the
        # model's children (the blocks and their projections); a wrapper fails on its own type, so what it
        # wraps need not be visited. Names are looked up only once something is found.
        modules = []
        for child_name, child in self._modules.items():
            if child_name in self._CALLED_CHILDREN or child is None:
                continue
            modules.append(child)
            for block in child._modules.values():
                modules.append(block)
                modules.extend(block._modules.values())
        plain_parameters = {type(p) for module in modules for p in module._parameters.values()} <= {nn.Parameter, type(None)}
        for module in modules:
            if (
                type(module) not in allowed
                or module._forward_pre_hooks
                or module._forward_hooks
                or module._backward_pre_hooks
                or module._backward_hooks
                or not (plain_parameters or all(foldable_parameter(module, n, p) for n, p in module._parameters.items()))
            ):
                name = next(n for n, m in self.named_modules() if m is module)
                return _why_not_foldable(name, module, allowed)
        return None

    def _segment_layer_blocker(self) -> str | None:
        """Why the segment layer (gradient checkpointing's unit) needs the plain path, or None."""
        segment = self.segment_layer
        if segment._forward_pre_hooks or segment._forward_hooks or segment._backward_pre_hooks or segment._backward_hooks:
            return "segment_layer has hooks"
        if self.checkpointing_segments() and not is_torch_checkpoint(segment._gradient_checkpointing_func):
            return "gradient checkpointing runs a checkpoint function other than torch.utils.checkpoint.checkpoint"
        return None

    def checkpointing_segments(self) -> bool:
        """Whether this call recomputes BPTT segments in the backward pass (gradient checkpointing on, training
        mode, gradients enabled), as `GradientCheckpointingLayer` decides."""
        return self.segment_layer.gradient_checkpointing and self.training and torch.is_grad_enabled()

    def recurrence_path(self) -> str:
        """"fast" or "plain": the path `recurrence` takes for the next call (see `fast_path_blocker`)."""
        if not self.use_fast_path or is_tracing():
            return "plain"
        blocker = self.fast_path_blocker()
        if blocker is None:
            return "fast"
        logged = self.__dict__.setdefault("_gpn_logged_blockers", set())
        if blocker not in logged:
            logged.add(blocker)
            logger.info(f"GPN runs the plain (module-calling) recurrence instead of the fast path: {blocker}")
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

        Both compute the same function with the same gradients (tests/test_fast_path.py). The plain path
        runs when `use_fast_path` is False, under torch.compile / torch.export, and whenever a module the
        fast path would fold is wrapped, replaced or hooked (`fast_path_blocker`); `last_recurrence_path`
        says which ran. `sequence_starts` (batch, seq) bool: reset the state to zero before these positions
        (packed sequences, `packed_sequence_starts`), on either path.
        """
        path = self.recurrence_path()
        if not is_tracing():
            object.__setattr__(self, "last_recurrence_path", path)  # (nn.Module's __setattr__ costs ~5 us a call)
            if path != "fast":  # (the fast path records the backends it chooses itself)
                object.__setattr__(self, "last_recurrence_backends", None)
        if path == "fast":
            return fast_recurrence(
                self, token_inputs, state, mask, output_memory_decays=output_memory_decays, sequence_starts=sequence_starts
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
                token_inputs[:, start:stop], *state, segment_mask, start, output_memory_decays, segment_starts,
                steps=self._plain_steps,
            )  # fmt: skip
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
        return_dict: bool | None = None,
        **kwargs,
    ) -> GPNModelOutput | tuple:
        """Run the recurrence over `input_ids` (or `inputs_embeds`), starting from `cache` if it holds a state.

        Args:
            input_ids: (batch, seq) token ids in [0, vocab_size).
            attention_mask: (batch, seq) with 1 for real tokens and 0 for padding, anywhere in the row;
                padded positions leave the state exactly unchanged. With a cache it may be longer than
                `input_ids` (as `generate()` passes it): its last `seq` columns are used.
            cache: a `GPNCache` to continue from and to update (created when `use_cache` and missing).
            inputs_embeds: (batch, seq, embedding_size) instead of `input_ids`.
            use_cache: return the state after the last position in a `GPNCache`.
            output_hidden_states: also return the predicted states as `hidden_states`.
            output_memory_decays: also return gamma (batch, seq, H), GPN+M only.
            **kwargs: `past_key_values` (deprecated alias of `cache`); packed (padding-free) batches:
                `position_ids` restarting inside a row, `cu_seq_lens_q/k` (with `max_length_q/k`) or
                `seq_idx` say where the sequences packed into a row start, and the state resets to zero there
                (see `packed_sequence_starts`); what `generate()` and transformers' tools pass for attention
                models, ignored (see `_IGNORED_FORWARD_KWARGS`); anything else raises a TypeError.
        """
        cache = _pop_cache_alias(cache, kwargs)
        _check_unused_kwargs(kwargs)
        packing = {name: kwargs[name] for name in ("position_ids", *_PACKING_KWARGS) if kwargs.get(name) is not None}
        config = self.config
        use_cache = use_cache if use_cache is not None else (config.use_cache and not self.training)
        return_dict = return_dict if return_dict is not None else True
        output_hidden_states = (
            output_hidden_states if output_hidden_states is not None else config.output_hidden_states
        )

        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of input_ids or inputs_embeds")
        if input_ids is not None:
            self.check_input_ids(input_ids)
            embeddings = self.embed_tokens(input_ids)
        else:
            if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != config.embedding_size:
                raise ValueError(
                    f"inputs_embeds must have shape (batch, seq, {config.embedding_size}), "
                    f"got {tuple(inputs_embeds.shape)}"
                )
            embeddings = inputs_embeds
        batch_size, seq_len = embeddings.shape[:2]
        if batch_size == 0 or seq_len == 0:
            raise ValueError(f"GPN needs at least one row and one token, got input of shape (batch={batch_size}, seq={seq_len})")

        state = cache.get_state() if cache is not None else None
        if state is not None and state[0].shape[0] != batch_size:
            raise ValueError(f"The cache holds {state[0].shape[0]} rows but the input has {batch_size}")
        mask = self.check_attention_mask(attention_mask, batch_size, seq_len, continuing=state is not None)
        sequence_starts = (
            packed_sequence_starts(batch_size, seq_len, mask, **packing, device=embeddings.device) if packing else None
        )
        if state is None:
            state = self.zero_state(batch_size, embeddings.device)

        # what the fast path derives from the parameters (folded matrices, ...) lives for this call, the
        # generate() call around it, or the cache it continues (a decode loop derives once): derived_weights.py
        with derived_weights_scope(self, kept_by=cache) as derived:
            predicted_states, final_state, memory_decays = self.recurrence(
                self.token_inputs(embeddings), state, mask, output_memory_decays=output_memory_decays,
                sequence_starts=sequence_starts,
            )  # fmt: skip

        if use_cache:
            if cache is None:
                cache = GPNCache(config)
            cache.update_state(*final_state, num_new_tokens=seq_len)
            cache.record_read(input_ids, mask)
            cache._gpn_model_ref = weakref.ref(self)  # whose state this is, for GPNCache.save
            keep_with(self, cache, derived)  # the next call that continues this cache reuses them
        output = GPNModelOutput(
            last_hidden_state=predicted_states,
            cache=cache if use_cache else None,
            hidden_states=(predicted_states,) if output_hidden_states else None,
            memory_decays=memory_decays,
        )
        return output if return_dict else output.to_tuple()

    # ---- input checks (clear errors instead of index errors from deep inside) --------------------

    def check_input_ids(self, input_ids: torch.Tensor) -> None:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must have shape (batch, seq), got {tuple(input_ids.shape)}")
        if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
            raise ValueError(f"input_ids must be integer token ids, got dtype {input_ids.dtype}")
        if input_ids.numel() == 0:
            raise ValueError(f"GPN needs at least one row and one token, got input_ids of shape {tuple(input_ids.shape)}")
        vocab_size = self.config.vocab_size
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

    def check_attention_mask(
        self, attention_mask: torch.Tensor | None, batch_size: int, seq_len: int, continuing: bool
    ) -> torch.Tensor | None:
        """Return a (batch, seq) mask, or None when every position is real."""
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


# --------------------------------------------------------------------------------------------------
# Packed (padding-free) batches: where each row's sequences start
# --------------------------------------------------------------------------------------------------

# The arguments by which padding-free collators (transformers' DataCollatorWithFlattening, TRL's SFTTrainer with
# packing) say where the sequences packed into a row start, besides `position_ids` restarting inside a row.
_PACKING_KWARGS = {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx"}


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


def _as_index_tensor(value, name: str, device: torch.device) -> torch.Tensor:
    tensor = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool:
        raise ValueError(f"{name} must hold integers, got dtype {tensor.dtype}")
    return tensor.to(device)


def _starts_from_cu_seq_lens(
    cu_seq_lens: torch.Tensor, name: str, batch_size: int, seq_len: int, validate: bool
) -> torch.Tensor:
    """Boundaries (batch, seq) from cumulative sequence lengths over the flattened batch (FlashAttention's
    varlen convention): sequence i holds flattened positions cu[i]..cu[i+1]-1."""
    total = batch_size * seq_len
    if cu_seq_lens.dim() != 1 or cu_seq_lens.numel() < 2:
        raise ValueError(
            f"{name} must be a 1-D tensor [0, end of sequence 1, ..., {total}], got shape {tuple(cu_seq_lens.shape)}"
        )
    if not validate:
        boundaries = torch.zeros(total + 1, dtype=torch.bool, device=cu_seq_lens.device)
        return boundaries.index_fill(0, cu_seq_lens.long().clamp(0, total), True)[:total].view(batch_size, seq_len)
    first, last = int(cu_seq_lens[0]), int(cu_seq_lens[-1])
    if first != 0 or last != total:
        raise ValueError(
            f"{name} must run from 0 to the number of tokens in the batch ({batch_size} x {seq_len} = {total}), "
            f"got {first} .. {last}"
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
) -> torch.Tensor | None:
    """Where packed sequences start inside the rows: (batch, seq) bool, True at the first real token of every
    sequence but the first of its row, or None when no row packs more than one sequence.

    The recurrence resets (p, g, M) to the zero state right before each such token, so every packed sequence
    runs as if alone. A row's first sequence starts from the state the row already has: the zero state, or
    the cache's when continuing from one (so a packed prefill can be continued, the last sequence of each row).
    Three ways of saying where sequences start are understood, alone or together (they must then agree):

    - `position_ids` (batch or 1, seq): a sequence starts where the position id does not exceed that of the
      row's previous real token (`DataCollatorWithFlattening` numbers each sequence from 0, or from
      `position_ids_start`). Ordinary position ids (increasing over the real tokens) mark nothing.
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
        if position_ids.dim() != 2 or position_ids.shape[0] not in (1, batch_size) or position_ids.shape[1] < seq_len:
            raise ValueError(
                f"position_ids must have shape (batch={batch_size} or 1, seq={seq_len}) like input_ids, got "
                f"{tuple(position_ids.shape)}"
            )
        positions = position_ids[:, -seq_len:].expand(batch_size, seq_len)
        previous = _previous_real_index(real)
        position_at_previous = positions.gather(1, previous.clamp(min=0))
        derived.append(("position_ids", real & (previous >= 0) & (positions <= position_at_previous)))

    cu_given = {name: value for name, value in (("cu_seq_lens_q", cu_seq_lens_q), ("cu_seq_lens_k", cu_seq_lens_k))
                if value is not None}  # fmt: skip
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
            says = lambda s: "starts" if bool(s[row, column]) else "does not start"  # noqa: E731
            raise ValueError(
                f"{first_name} and {name} disagree on where the packed sequences start: at (row {row}, position "
                f"{column}) a sequence {says(starts)} by {first_name} but {says(other)} by {name}"
            )
    return starts if bool(starts.any()) else None


# What generate(), Trainer, PEFT and evaluation harnesses pass for attention models, and a GPN has no use
# for: position and cache positions (a recurrence knows where it is; position ids are read only for where packed
# sequences start, see `packed_sequence_starts`), attention outputs (it has none),
# token types, and generate()'s own helpers (`tokenizer` for stop strings, `assistant_tokenizer`).
_IGNORED_FORWARD_KWARGS = {
    "position_ids", "cache_position", "output_attentions", "token_type_ids", "tokenizer", "assistant_tokenizer",
}  # fmt: skip


def _check_unused_kwargs(kwargs: dict) -> None:
    """Accept the harmless extras of `_IGNORED_FORWARD_KWARGS` and the packing arguments (`_PACKING_KWARGS`,
    read by `GPNModel.forward`); refuse everything else by name."""
    unknown = set(kwargs) - _IGNORED_FORWARD_KWARGS - _PACKING_KWARGS
    if unknown:
        raise TypeError(f"GPN forward got unexpected arguments: {sorted(unknown)}")


def _pop_cache_alias(cache: Cache | None, kwargs: dict) -> Cache | None:
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


class GPNForCausalLM(GPNPreTrainedModel, GenerationMixin):
    """GPN with its decoder: logits = (W_dec rms(p) (+ b_dec)) E^T, the embedding tied through d -> e."""

    def __init__(self, config: GPNConfig):
        super().__init__(config)
        self.model = GPNModel(config)
        self.decode_norm = GPNRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.decode_proj = linear(config.hidden_size, config.embedding_size, bias=config.use_decoder_bias)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def output_embedding_weight(self) -> torch.Tensor:
        """The (vocab, e) output matrix: the embedding table, as the embedding module computes it.

        A plain `nn.Embedding` gives its weight. A wrapped or replaced embedding (a PEFT LoRA layer, a
        quantized embedding) computes its whole table (its forward on every id), so the tied output sees
        the same adapted embedding as the input. Hooks on the input embedding are input-side by
        transformers' convention (NEFTune noise, `enable_input_require_grads`) and do not run here.
        """
        embedding = self.model.embed_tokens
        if type(embedding) is nn.Embedding and type(embedding.weight) is nn.Parameter:
            return embedding.weight
        device = next(embedding.parameters()).device
        ids = torch.arange(self.config.vocab_size, device=device)
        if _is_fsdp_module(embedding):
            # FSDP2 shards the table; only the module's own call gathers it (in its pre-forward hook) and
            # reduces its gradient (in its backward hook), so here the hooks must run.
            return embedding(ids)
        return embedding.forward(ids)

    def decode(self, predicted_states: torch.Tensor) -> torch.Tensor:
        """Step 4: logits for every given predicted state (the embedding is the output matrix)."""
        # project / F.linear; a few rows (decoding) on the fast path's kernels (fast_recurrence.fast_project)
        fast = self.model.use_fast_path
        decoded = fast_project(self.decode_proj, self.decode_norm(predicted_states), fast)
        return output_logits(decoded, self.output_embedding_weight(), fast)

    def empty_state_logits(self, batch_size: int = 1) -> torch.Tensor:
        """Logits predicted from the empty (zero) state: the reference's position 0 (batch, vocab)."""
        predicted = torch.zeros(batch_size, self.config.hidden_size, device=self.device)
        return self.decode(predicted)

    def generate(self, *args, **kwargs):
        """`GenerationMixin.generate`, with the fast path's weights derived from the parameters (folded and
        prepacked matrices, CUDA graphs' copies) once for the whole call: the prompt's forward derives them,
        every decoded token reuses them, and they are dropped when the call returns (`derived_weights.py`), so
        the next call sees the parameters as they are then, however they were edited."""
        with derived_weights_scope(self.model):
            return super().generate(*args, **kwargs)

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs) -> None:
        """generate() gets a `GPNCache` (not a `DynamicCache`) unless the caller passed a cache."""
        user_cache = model_kwargs.get("cache")
        if user_cache is not None:
            if not isinstance(user_cache, GPNCache):
                raise TypeError(f"A GPN can only continue from a GPNCache, got {type(user_cache).__name__}")
            user_cache._is_user_defined = True
            return
        if generation_config.use_cache is False:
            return
        model_kwargs["cache"] = GPNCache(self.config)

    def _prefill(self, input_ids: torch.Tensor, generation_config, model_kwargs: dict, *args, **kwargs):
        """Continue generation from a returned cache, given the whole sequence or only the new positions.

        transformers' models continue in two ways: with the whole sequence so far (as with a KV cache) or
        with only the new positions (as Mamba and its other recurrent models). A `GPNCache` tells them
        apart by what it has read (`continuation_start`) and feeds only the positions after those; where it
        cannot tell, it refuses. It never feeds a position twice: a recurrent state cannot be rolled back.
        """
        cache = model_kwargs.get("cache")
        seen = cache.get_seq_length() if isinstance(cache, GPNCache) and cache.has_state else 0
        if seen:
            embeds = model_kwargs.get("inputs_embeds")
            mask = model_kwargs.get("attention_mask")
            # generate() drops an all-ones mask before the prefill and keeps only its length
            mask_columns = mask.shape[1] if mask is not None else getattr(generation_config, "_mask_length", None)
            start = continuation_start(cache, seen, input_ids if embeds is None else None, embeds, mask, mask_columns)
            if start and embeds is not None:
                model_kwargs = {**model_kwargs, "inputs_embeds": embeds[:, start:]}
            elif start:
                input_ids = input_ids[:, start:]
        return super()._prefill(input_ids, generation_config, model_kwargs, *args, **kwargs)

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
        return_dict: bool | None = None,
        logits_to_keep: int = 0,
        return_logits: bool = True,
        num_items_in_batch: torch.Tensor | int | None = None,
        **kwargs,
    ) -> GPNCausalLMOutput | tuple:
        """Next-token logits at every position (or the last `logits_to_keep`), and the causal LM loss
        when `labels` or `shift_labels` are given, as transformers' `ForCausalLMLoss` computes it.

        Args:
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
        return_dict = return_dict if return_dict is not None else True
        cache = _pop_cache_alias(cache, kwargs)
        shift_labels = kwargs.pop("shift_labels", None)
        chunk_length = self._prefill_chunk_length_for(
            input_ids, inputs_embeds, labels, shift_labels, logits_to_keep, return_logits,
            output_hidden_states, output_memory_decays,
        )  # fmt: skip
        if chunk_length:
            output = self._forward_in_chunks(
                chunk_length, input_ids, inputs_embeds, attention_mask, cache, use_cache, labels, shift_labels,
                logits_to_keep, num_items_in_batch, kwargs,
            )  # fmt: skip
            if output is not None:  # (None: a packed batch, which runs in one pass)
                return output if return_dict else output.to_tuple()
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_hidden_states=output_hidden_states,
            output_memory_decays=output_memory_decays,
            return_dict=True,
            **kwargs,
        )
        predicted_states = outputs.last_hidden_state
        for name, given in (("labels", labels), ("shift_labels", shift_labels)):
            if given is not None and given.shape != predicted_states.shape[:2]:
                raise ValueError(f"{name} must have shape {tuple(predicted_states.shape[:2])}, got {tuple(given.shape)}")
        wants_loss = labels is not None or shift_labels is not None
        if wants_loss and not return_logits:
            decoded = project(self.decode_proj, self.decode_norm(predicted_states))
            loss = self._chunked_loss(decoded, labels, shift_labels, num_items_in_batch)
            output = GPNCausalLMOutput(
                loss=loss, cache=outputs.cache, hidden_states=outputs.hidden_states, memory_decays=outputs.memory_decays
            )
            return output if return_dict else output.to_tuple()
        kept = predicted_states if not logits_to_keep else predicted_states[:, -logits_to_keep:]
        logits = self.decode(kept)

        loss = None
        if wants_loss:
            full_logits = logits if not logits_to_keep else self.decode(predicted_states)
            loss = causal_lm_loss(full_logits, labels, shift_labels, num_items_in_batch)

        output = GPNCausalLMOutput(
            loss=loss,
            logits=logits,
            cache=outputs.cache,
            hidden_states=outputs.hidden_states,
            memory_decays=outputs.memory_decays,
        )
        return output if return_dict else output.to_tuple()

    # ---- prefill and scoring in bounded memory --------------------------------------------------
    # A no-grad forward that asks only for the last logits (generate()'s prefill: logits_to_keep=1) or
    # for the chunked loss (labels with return_logits=False) runs its positions a chunk at a time, the
    # state carried between chunks in a cache, so its peak memory does not grow with the prompt: only
    # one chunk's embeddings, token projections and predicted states exist at once.

    prefill_chunk_length: int = 2048  # positions per chunk; 0 (on a model or the class) turns chunking off

    def _prefill_chunk_length_for(
        self,
        input_ids: torch.Tensor | None,
        inputs_embeds: torch.Tensor | None,
        labels: torch.Tensor | None,
        shift_labels: torch.Tensor | None,
        logits_to_keep,
        return_logits: bool,
        output_hidden_states: bool | None,
        output_memory_decays: bool,
    ) -> int:
        """The chunk length `forward` runs this call in, or 0 for one pass over every position.

        Chunks only what gives the same result in bounded memory: no gradient (training keeps what its
        backward needs), nothing per position asked back (hidden states, memory decays, all logits), and
        more positions than one chunk. Malformed inputs take the one-pass path, whose checks name them.
        """
        chunk = self.prefill_chunk_length
        if not chunk or torch.is_grad_enabled() or is_tracing() or output_memory_decays:
            return 0
        if output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states:
            return 0
        if input_ids is not None and inputs_embeds is None and input_ids.dim() == 2:
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

    def _forward_in_chunks(
        self,
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
    ) -> GPNCausalLMOutput | None:
        """`forward` over `chunk_length` positions at a time (see `_prefill_chunk_length_for` for when).

        Each chunk runs `GPNModel.forward` from the state the previous chunk left in a cache; only the
        last `logits_to_keep` predicted states, or the running sum of the loss, are kept. The result is
        that of one pass: the same state and logits, and the loss up to float32 summation order.
        Returns None for a packed batch (sequences starting inside rows, `packed_sequence_starts`), which
        `forward` then runs in one pass (a chunk's first position continues the cache, so a sequence
        starting there would not be reset).
        """
        tokens = input_ids if input_ids is not None else inputs_embeds
        batch_size, seq_len = tokens.shape[:2]
        use_cache = use_cache if use_cache is not None else (self.config.use_cache and not self.model.training)
        # The checks one pass makes over the whole input, made once here (a chunk sees only its part).
        continuing = isinstance(cache, GPNCache) and cache.has_state
        mask = self.model.check_attention_mask(attention_mask, batch_size, seq_len, continuing=continuing)
        packing = {name: kwargs[name] for name in ("position_ids", *_PACKING_KWARGS) if kwargs.get(name) is not None}
        if packing and packed_sequence_starts(batch_size, seq_len, mask, **packing, device=tokens.device) is not None:
            return None
        kwargs = {name: value for name, value in kwargs.items() if name not in packing}  # (ordinary position ids)
        for name, given in (("labels", labels), ("shift_labels", shift_labels)):
            if given is not None and given.shape != (batch_size, seq_len):
                raise ValueError(f"{name} must have shape {(batch_size, seq_len)}, got {tuple(given.shape)}")
        # The state runs from chunk to chunk through a cache; a cache the caller wants left as it was
        # (use_cache=False) is copied. (Anything but a GPNCache goes to the model, which refuses it.)
        if isinstance(cache, GPNCache) and not use_cache:
            running = cache.fork(1) if cache.has_state else GPNCache(self.config)
        else:
            running = cache if cache is not None else GPNCache(self.config)

        wants_loss = labels is not None or shift_labels is not None
        if wants_loss:  # position t's target, for every position (the last one of `labels` has none)
            targets = shift_labels
            if targets is None:
                targets = torch.cat([labels[:, 1:], labels.new_full((batch_size, 1), -100)], dim=1)
            output_embedding = self.output_embedding_weight()
            loss_sum = None
        tail = None  # the last `logits_to_keep` predicted states read so far
        for start in range(0, seq_len, chunk_length):
            stop = min(start + chunk_length, seq_len)
            predicted_states = self.model(
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
                decoded = project(self.decode_proj, self.decode_norm(predicted_states))
                chunk_sum = chunked_causal_lm_loss(
                    decoded, output_embedding, None, shift_labels=targets[:, start:stop], num_items_in_batch=1
                )
                loss_sum = chunk_sum if loss_sum is None else loss_sum + chunk_sum
            else:
                joined = predicted_states if tail is None else torch.cat([tail, predicted_states], dim=1)
                tail = joined[:, -logits_to_keep:].clone()  # not a view: the chunk's states are freed
        return GPNCausalLMOutput(
            loss=divide_loss_sum(loss_sum, targets, num_items_in_batch) if wants_loss else None,
            logits=None if wants_loss else self.decode(tail),
            cache=running if use_cache else None,
        )

    def _chunked_loss(
        self,
        decoded: torch.Tensor,
        labels: torch.Tensor | None,
        shift_labels: torch.Tensor | None,
        num_items_in_batch: torch.Tensor | int | None,
    ) -> torch.Tensor:
        """`causal_lm_loss` of logits = decoded E^T without holding the logits (`chunked_causal_lm_loss`)."""
        embedding = self.output_embedding_weight()
        return chunked_causal_lm_loss(
            decoded, embedding, labels, shift_labels=shift_labels, num_items_in_batch=num_items_in_batch
        )


# ---- continuing from a cache: the whole sequence or only the new positions ----------------------------


def continuation_start(
    cache: GPNCache,
    seen: int,
    input_ids: torch.Tensor | None,
    inputs_embeds: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    mask_columns: int | None = None,
) -> int:
    """How many leading positions of what generate() was given the cache has already read: `seen` when it
    is the whole sequence so far, 0 when it is only the new positions. Raises where it cannot tell.

    Certain: an attention mask over `seen` + given columns means the new positions alone (transformers'
    convention); fewer positions given than read, or as many with another fingerprint, can only be new
    ones. With more positions than read, the fingerprint of the first `seen` (token ids and padding,
    `token_fingerprint`) decides: the cache's own in every row means the whole sequence, in no row only new
    positions. Embeddings (nothing to fingerprint), a cache whose fingerprint is unknown (it read
    embeddings, or was rebuilt by a traced program) and rows that disagree are refused.
    """
    given = (input_ids if input_ids is not None else inputs_embeds).shape[1]
    if mask_columns is None:
        mask_columns = None if attention_mask is None else attention_mask.shape[1]
    how = (
        "Pass only the new positions with an attention_mask covering the whole sequence "
        f"({seen} + new columns), or the whole sequence as token ids to a cache filled from token ids."
    )
    if mask_columns is not None and mask_columns != given:
        if mask_columns == seen + given:
            return 0
        raise ValueError(
            f"generate() got {given} positions and an attention_mask of {mask_columns} columns with a "
            f"cache that has read {seen}: the mask must cover the given positions ({given}) or the whole sequence "
            f"({seen + given})."
        )
    known = cache.read_fingerprint()
    if given <= seen:  # the whole sequence would be longer than what was read
        if given == seen and input_ids is not None and known is not None:
            if bool((token_fingerprint(input_ids, attention_mask) == known.to(input_ids.device)).all()):
                raise ValueError(
                    f"generate() got the {seen} positions the cache has already read and nothing new. A GPN state "
                    "cannot be rolled back to an earlier position; pass new positions to continue."
                )
        return 0
    if input_ids is None:
        raise ValueError(
            f"generate() got {given} positions as inputs_embeds with a cache that has read {seen}: embeddings cannot "
            f"be matched against what the cache read, so it cannot tell the whole sequence from new positions. {how}"
        )
    if known is None:
        raise ValueError(
            f"generate() got {given} positions with a cache that has read {seen} without a record of them (it read "
            f"inputs_embeds, or was rebuilt by a traced program): it cannot tell the whole sequence from new "
            f"positions. Pass only the new positions with an attention_mask covering the whole sequence "
            f"({seen} + new columns)."
        )
    prefix_mask = None if attention_mask is None else attention_mask[:, :seen]
    matches = (token_fingerprint(input_ids[:, :seen], prefix_mask) == known.to(input_ids.device)).all(dim=1)
    if bool(matches.all()):
        return seen
    if not bool(matches.any()):
        return 0
    raise ValueError(
        f"generate() got {given} positions with a cache that has read {seen}: rows "
        f"{matches.nonzero()[:, 0].tolist()} begin with what the cache read (the whole sequence) and the others "
        f"do not (new positions). {how}"
    )


# ---- end of continuing from a cache ------------------------------------------------------------------


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
    return divide_loss_sum(F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum"), targets, num_items_in_batch)


GPNConfig.register_for_auto_class()
GPNForCausalLM.register_for_auto_class("AutoModelForCausalLM")
GPNModel.register_for_auto_class("AutoModel")

__all__ = ["GPNCache", "GPNForCausalLM", "GPNModel", "GPNPreTrainedModel", "GPNStateFileError"]
