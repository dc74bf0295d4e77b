"""The models `gpn bench` measures: a GPN preset (random weights, every matrix non-zero), a parameter-matched
`LlamaForCausalLM`, in float32, bfloat16, float16, int8 or int4 (torchao's int8 or int4 weight-only quantization of the
bfloat16 model, every `nn.Linear` but a tied output head), and the arithmetic they do per token."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch import nn

    from ..configuration_gpn import GPNConfig

DTYPES = ("float32", "bfloat16", "float16", "int8", "int4")


def weight_dtype(name: str) -> torch.dtype:
    """The dtype a model is built in for `--dtype name` (int8 and int4 quantize a bfloat16 model)."""
    return {
        "float32": torch.float32,
        "bfloat16": torch.bfloat16,
        "float16": torch.float16,
        "int8": torch.bfloat16,
        "int4": torch.bfloat16,
    }[name]


def quantize_int8(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with every nn.Linear but its output head quantized by torchao's int8 weight-only config (int8
    weights, one scale per output row; activations stay in the model's dtype), in place. The head
    (`get_output_embeddings()`: a GPN's is its embedding, as is the bench's Llama's) is left as it is: quantizing
    it would untie it. Without torchao: ImportError, saying what to install."""
    quantization = _torchao("int8")
    quantization.quantize_(model, quantization.Int8WeightOnlyConfig(), filter_fn=_linears_but_the_head(model))
    return model


INT4_GROUP = 32  # weights sharing a scale and a zero point (torchao's default group for int4)


def quantize_int4(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with every nn.Linear but its output head quantized by torchao's low-bit weight-only config to int4
    (`IntxWeightOnlyConfig`, torchao's int4 with a CPU path: values in [-8, 7], a scale and a zero point per group
    of `INT4_GROUP` weights of a row, or per row where a row's length is not a multiple of it), in place; the head
    as in `quantize_int8`. Its linear multiplies the dequantized matrix (`recurrence_step.dequantized_by_linear`);
    the fast path's C kernels read the int4 values packed where they take them (`memory_kernels.int4_operand`), and
    the same dequantized matrix elsewhere. Without torchao: ImportError, saying what to install."""
    quantization = _torchao("int4")
    from torchao.quantization.granularity import PerAxis, PerGroup

    linears = _linears_but_the_head(model)
    for granularity, fits in ((PerGroup(INT4_GROUP), True), (PerAxis(0), False)):
        config = quantization.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=granularity)
        quantization.quantize_(
            model,
            config,
            filter_fn=lambda m, fqn, fits=fits: (
                linears(m, fqn) and type(m.weight) is torch.nn.Parameter and (m.in_features % INT4_GROUP == 0) == fits
            ),
        )
    return model


QUANTIZERS = {"int8": quantize_int8, "int4": quantize_int4}  # --dtype name -> what quantizes the bfloat16 model


def quantized_as(model: torch.nn.Module) -> set[str]:
    """How `model`'s weights are already quantized (a folder saved through transformers' `TorchAoConfig`): the
    `QUANTIZERS` names of those they make ("int8": torchao's int8 weight-only weight, `int8_weight_parts`; "int4":
    its int4 weight-only one, `dequantized_by_linear` with int4 values), any other tensor subclass by its class name;
    empty for a float model. torchao cannot quantize a quantized weight again (quantize_ fails inside its dispatch)
    and `quantize_int4` leaves any quantized weight as it is, so a caller asked for one kind checks this first."""
    from modeling_gpn.recurrence_step import dequantized_by_linear, int8_weight_parts

    kinds = set()
    for parameter in model.parameters():
        if type(parameter) is torch.nn.Parameter or type(parameter) is torch.Tensor:
            continue
        if int8_weight_parts(parameter) is not None:
            kinds.add("int8")
        elif dequantized_by_linear(parameter) and getattr(parameter, "target_dtype", None) is torch.int4:
            kinds.add("int4")
        else:
            kinds.add(type(parameter).__name__)
    return kinds


def quantize_for(model: torch.nn.Module, kind: str, source: str = "the model") -> torch.nn.Module:
    """`model` quantized to `kind` ("int8", "int4": `QUANTIZERS`, of the model cast to bfloat16), for `--dtype KIND`
    of `gpn generate` and `gpn eval` alike. A model saved quantized already (`TorchAoConfig`) is returned as saved
    when it is of that kind, and refused otherwise: torchao cannot quantize its weights again (it fails deep in its
    dispatch), and `quantize_int4` leaves int8 weights as they are, which would pass an int8 model for an int4 one
    in silence. Every refusal, torchao missing included, is a ValueError in one line naming the problem."""
    if kind not in QUANTIZERS:
        raise ValueError(f"cannot quantize to {kind!r}: one of {', '.join(QUANTIZERS)}")
    kinds = quantized_as(model)
    if kinds == {kind}:
        return model
    if kinds:
        # (--dtype of the saved kind runs it as saved, in gpn generate and gpn eval alike; gpn eval has no auto)
        saved = f"use --dtype {'/'.join(sorted(kinds))} to run it as saved, or " if kinds <= QUANTIZERS.keys() else ""
        raise ValueError(
            f"{source} is saved quantized already ({', '.join(sorted(kinds))} weights): --dtype {kind} quantizes a "
            f"float model; {saved}give the float model"
        )
    try:
        return QUANTIZERS[kind](model.to(torch.bfloat16))
    except ImportError as error:
        raise ValueError(str(error)) from None


def quantization_of(model: torch.nn.Module) -> dict | None:
    """What a report says of `model`'s quantized weights, read from the weights themselves (so that a folder saved
    quantized is described as it is, whatever was asked): None for a float model, else `weights` (the
    `quantized_as` kinds, joined), `scheme` (in words), `group_sizes` (weights sharing a scale: int4's groups, the
    whole row where a row's length is no multiple of `INT4_GROUP`; int8's one scale per row), `quantized_linears`,
    `head` (the output head's dtype: it stays float, tied to the embedding) and `summary` (one line of all that)."""
    kinds = quantized_as(model)
    if not kinds:
        return None
    # (a weight's scale covers a group, part of its row, or its whole row: told apart by its own row's length, as a
    # row shorter than a group is a whole row, not a smaller group)
    groups, whole, count = set(), set(), 0
    for parameter in model.parameters():
        if type(parameter) is torch.nn.Parameter or type(parameter) is torch.Tensor:
            continue
        count += 1
        row = int(parameter.shape[-1])
        block = getattr(parameter, "block_size", None)
        size = int(block[-1]) if block is not None else row
        (groups if size < row else whole).add(size)
    schemes = {
        "int8": "int8 weight-only (torchao Int8WeightOnlyConfig: one scale per output row)",
        "int4": "int4 weight-only (torchao IntxWeightOnlyConfig: values in [-8, 7], a scale and a zero point per group)",
    }
    scheme = "; ".join(schemes.get(kind, f"{kind} weights") for kind in sorted(kinds))
    head = model.get_output_embeddings()
    head_dtype = str(head.weight.dtype).removeprefix("torch.") if head is not None else None
    sizes = sorted(groups | whole)
    grouping = ""  # (int8's scheme says it: one scale per row)
    if "int4" in kinds:  # (IntxWeightOnlyConfig's groups; a row whose length is no multiple of them is one group)
        rows = [str(size) for size in sorted(whole) if not any(size % group == 0 for group in groups)]
        if groups:
            named = ", ".join(str(size) for size in sorted(groups))
            grouping = f", groups of {named}" + (f" (rows of {', '.join(rows)}: whole)" if rows else "")
        else:
            grouping = ", each row one group"
    return {
        "weights": "+".join(sorted(kinds)),
        "scheme": scheme,
        "group_sizes": sizes,
        "quantized_linears": count,
        "head": head_dtype,
        "summary": f"{scheme}{grouping}, {count} linears; head {head_dtype}",
    }


def require_torchao(kind: str) -> None:
    """Refuse `--dtype kind` (int8, int4) where torchao cannot be imported: a ValueError in one line saying what to
    install, for a command to raise before it loads a model (`quantize_for` refuses so too, later)."""
    if kind in QUANTIZERS:
        try:
            _torchao(kind)
        except ImportError as error:
            raise ValueError(str(error)) from None


def _torchao(name: str):
    """torchao's quantization module, or ImportError saying what `--dtype name` needs installed."""
    try:
        import torchao.quantization
    except ImportError as error:
        raise ImportError(
            f"--dtype {name} needs torchao (pip install -e '.[int8]', or torchao==0.18.0): {error}"
        ) from None
    return torchao.quantization


def _linears_but_the_head(model: torch.nn.Module):
    """A `quantize_` filter: the model's nn.Linear modules but its output head (`get_output_embeddings()`)."""
    output = model.get_output_embeddings()
    head = {id(output)} if isinstance(output, torch.nn.Linear) else set()
    return lambda m, fqn: isinstance(m, torch.nn.Linear) and id(m) not in head


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
