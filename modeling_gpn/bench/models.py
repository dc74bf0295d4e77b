"""The models `gpn bench` measures: a GPN preset (random weights, every matrix non-zero), a parameter-matched
`LlamaForCausalLM`, in float32, bfloat16, float16, int8 or int4 (torchao's int8 or int4 weight-only quantization of the
bfloat16 model, every `nn.Linear` but a tied output head: `cli.quantization`, as gpn generate and eval quantize), and
the arithmetic they do per token."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch import nn

    from ..configuration_gpn import GPNConfig

from ..cli.quantization import QUANTIZERS, weight_dtype


def build_gpn(preset: str, dtype: torch.dtype | str, device: str, segment_length: int) -> nn.Module:
    """A GPN of `preset` (name or config JSON) in `dtype` ("int8", "int4": quantized, see `QUANTIZERS`)."""
    from modeling_gpn import GPNForCausalLM
    from modeling_gpn.configuration import load_preset

    quantize = QUANTIZERS.get(dtype) if isinstance(dtype, str) else None
    if isinstance(dtype, str):
        dtype = weight_dtype(dtype)
    config = load_preset(preset)
    config.bptt_segment_length = segment_length or None
    torch.manual_seed(0)
    model = GPNForCausalLM(config).to(device=device, dtype=dtype)
    with torch.no_grad():  # the zero-initialised gates and outputs would make parts of the step trivial
        for param in model.parameters():
            if param.dim() == 2 and not param.any():
                param.normal_(0, 0.02)
    return quantize(model) if quantize else model


# The shapes of the reference fixtures' small GPN+M: the tests' tiny models and the benchmarks that run one.
TINY_SHAPES = dict(
    vocab_size=97,
    hidden_size=48,
    embedding_size=32,
    intermediate_size=64,
    num_memory_heads=3,
    memory_key_dim=8,
    memory_value_dim=16,
    eos_token_id=0,
    bos_token_id=None,
)


def tiny_config(**overrides) -> GPNConfig:
    """A GPN config of `TINY_SHAPES`, with `overrides`."""
    from modeling_gpn import GPNConfig

    return GPNConfig(**{**TINY_SHAPES, **overrides})


def perturbed_gpn(config: GPNConfig, seed: int = 0) -> nn.Module:
    """A GPN of `config` (seeded) whose zero-initialised gates and outputs are perturbed, and its norms and vectors
    moved off their initial values, so that every part of the step does work; in eval mode. (The tests' models and
    the benchmarks that compare paths on them: one recipe, so a figure measured on one is measured on the other.)"""
    from modeling_gpn import GPNForCausalLM

    torch.manual_seed(seed)
    model = GPNForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.1 * torch.randn_like(param))
            elif param.dim() == 1:
                param.add_(0.1 * torch.randn_like(param))
            elif "embed" not in name:
                param.copy_(0.5 * torch.randn_like(param) / param.shape[1] ** 0.5)
    return model.eval()


def weight_bytes(config: GPNConfig, dtype: str) -> int:
    """The bytes of the weights `build_gpn` would allocate for a model of `config` in `--dtype dtype` (counted on the
    meta device: nothing is allocated; int8 and int4 are built in bfloat16 first)."""
    from modeling_gpn import GPNForCausalLM

    with torch.device("meta"):
        model = GPNForCausalLM(config)
    size = torch.empty((), dtype=weight_dtype(dtype)).element_size()
    return sum(param.numel() for param in model.parameters()) * size


def matched_llama(gpn_config: GPNConfig, params: int, dtype: torch.dtype | str, device: str) -> nn.Module:
    """A LlamaForCausalLM with hidden = the GPN's embedding width, tied embeddings, and as many layers as
    bring it closest to `params` parameters."""
    from transformers import LlamaConfig, LlamaForCausalLM

    quantize = QUANTIZERS.get(dtype) if isinstance(dtype, str) else None
    if isinstance(dtype, str):
        dtype = weight_dtype(dtype)
    hidden = gpn_config.embedding_size
    inter = max(64, int(round(8 * hidden / 3 / 64)) * 64)
    heads = max(1, hidden // 64)
    per_layer = 4 * hidden * hidden + 3 * hidden * inter + 2 * hidden
    layers = max(1, round((params - gpn_config.vocab_size * hidden - hidden) / per_layer))
    config = LlamaConfig(
        vocab_size=gpn_config.vocab_size,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=1 << 15,
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device=device, dtype=dtype)
    return quantize(model) if quantize else model


def count_params(model: nn.Module) -> int:
    """The number of parameter values of `model` (a tied matrix once: `parameters()` lists a shared one once)."""
    return sum(p.numel() for p in model.parameters())


def forward_flops_per_token(model: nn.Module, context: float) -> float:
    """Multiply-adds x 2 of one token's forward pass: every nn.Linear's weight once (the output head among
    them, tied to the embedding or not; the embedding's lookup multiplies nothing), and a GPN's memory, or a
    Llama's attention at a mean `context` (q.K and the weighted sum of V: 2 x context x hidden a layer)."""
    config = model.config
    # (the embedding counted beside the linears counted the tied head twice: a fifth of small's figure)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    if config.model_type == "gpn":
        return 2.0 * linear + (6 + 2 * config.num_predict_layers) * config.memory_cells
    return 2.0 * linear + 2.0 * 2 * config.num_hidden_layers * context * config.hidden_size
