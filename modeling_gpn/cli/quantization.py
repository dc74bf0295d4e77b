"""The weights' dtypes the tools take (`--dtype` of gpn bench, generate and eval) and the quantization behind int8 and
int4: torchao's weight-only quantization of the bfloat16 model, every `nn.Linear` but a tied output head, with the
refusals of a folder already quantized otherwise, and the record of how a model's weights were quantized (eval's
results and model card). One place, so that a model generate, eval and bench each quantize is the same model."""

from __future__ import annotations

import torch

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
    `QUANTIZERS` names of those they make, any other tensor subclass by its class name, as a state file names them
    (`state_file.quantized_kind`: the one definition); empty for a float model. torchao cannot quantize a quantized
    weight again (quantize_ fails inside its dispatch) and `quantize_int4` leaves any quantized weight as it is, so
    a caller asked for one kind checks this first."""
    from modeling_gpn.state_file import quantized_kinds

    return quantized_kinds(model)


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
