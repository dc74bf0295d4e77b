"""Convert checkpoints of the reference JAX implementation (`sot` / `sot_m`) to a transformers GPN.

Two sources are understood:

- the reference trainer's `checkpoint.pkl`: a pickled dict whose `params` is the flat Flax parameter
  dict of numpy arrays (beside `step`, `data_position` and `opt_state`). The pickle is untrusted
  input and is read with `RestrictedUnpickler`, which builds only dicts, lists, tuples, numbers,
  strings and numpy arrays and refuses everything else;
- a folder with `params.npz` (+ optional `config.json`), laid out like `fixtures/reference/*`.

The reference stores matrices as (in, out) for `x @ W`; `nn.Linear` weights are the transpose.
"""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from modeling_gpn import GPNConfig, GPNForCausalLM


class CheckpointError(ValueError):
    """A reference checkpoint that cannot be converted; the message says why."""


# --------------------------------------------------------------------------------------------------
# Reading the checkpoint safely
# --------------------------------------------------------------------------------------------------

# The only globals a pickle of dicts/lists/numpy arrays needs. Everything else (os.system, builtins
# eval, arbitrary classes, jax/flax/optax objects) is refused before it can run.
_ALLOWED_GLOBALS = {
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
    ("numpy.core.numeric", "_frombuffer"),
    ("numpy._core.numeric", "_frombuffer"),
    ("builtins", "dict"),
    ("builtins", "list"),
    ("builtins", "tuple"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "int"),
    ("builtins", "float"),
    ("builtins", "complex"),
    ("builtins", "bool"),
    ("builtins", "str"),
    ("builtins", "bytes"),
    ("builtins", "bytearray"),
    ("collections", "OrderedDict"),
    ("_codecs", "encode"),  # numpy pickles byte buffers of arrays through codecs.encode(str, 'latin1')
}
_NUMPY_SCALAR_TYPES = re.compile(r"^(numpy|numpy\.dtypes)$")


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickler that builds only plain containers, numbers, strings and numpy arrays."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        # numpy dtype classes (e.g. numpy.dtypes.Float32DType) appear in pickles of numpy >= 1.25
        if _NUMPY_SCALAR_TYPES.match(module) and name.endswith("DType"):
            return super().find_class(module, name)
        raise CheckpointError(
            f"Refusing to load the checkpoint: its pickle contains the object {module}.{name}, which a reference "
            "checkpoint never holds (only dicts, lists, tuples, numbers, strings and numpy arrays are accepted). "
            "The file may be corrupt or malicious."
        )


def load_pickle_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read a reference `checkpoint.pkl` with `RestrictedUnpickler`."""
    path = Path(path)
    try:
        with path.open("rb") as handle:
            checkpoint = RestrictedUnpickler(handle).load()
    except CheckpointError:
        raise
    except Exception as error:  # truncated, not a pickle, ...
        raise CheckpointError(f"{path} is not a readable reference checkpoint: {type(error).__name__}: {error}") from error
    if not isinstance(checkpoint, dict) or "params" not in checkpoint:
        keys = sorted(checkpoint) if isinstance(checkpoint, dict) else type(checkpoint).__name__
        raise CheckpointError(f"{path} holds no 'params' entry (found {keys}); is it a reference trainer checkpoint?")
    return checkpoint


def read_source(src: str | Path) -> tuple[dict[str, np.ndarray], dict[str, Any] | None]:
    """Return (flat parameter dict, reference config or None) from a `checkpoint.pkl` or a params.npz folder."""
    src = Path(src)
    if not src.exists():
        raise CheckpointError(f"{src} does not exist")
    config = None
    if src.is_dir():
        npz = src / "params.npz"
        if not npz.exists():
            pkl = src / "checkpoint.pkl"
            if pkl.exists():
                return read_source(pkl)
            raise CheckpointError(f"{src} has neither params.npz nor checkpoint.pkl")
        try:
            with np.load(npz, allow_pickle=False) as data:
                params = {key: np.asarray(data[key]) for key in data.files}
        except Exception as error:
            raise CheckpointError(f"{npz} is not a readable npz file: {type(error).__name__}: {error}") from error
        if (src / "config.json").exists():
            config = json.loads((src / "config.json").read_text())
    elif src.suffix == ".npz":
        with np.load(src, allow_pickle=False) as data:
            params = {key: np.asarray(data[key]) for key in data.files}
        if (src.parent / "config.json").exists():
            config = json.loads((src.parent / "config.json").read_text())
    else:
        checkpoint = load_pickle_checkpoint(src)
        params = flatten_params(checkpoint["params"])
        config = checkpoint.get("config") if isinstance(checkpoint.get("config"), dict) else None
    return params, config


def flatten_params(tree: Any, prefix: str = "") -> dict[str, np.ndarray]:
    """Flatten a (possibly nested, e.g. {'params': {...}}) Flax parameter tree to name -> array."""
    if isinstance(tree, dict):
        if set(tree) == {"params"}:
            return flatten_params(tree["params"], prefix)
        flat = {}
        for key, value in tree.items():
            flat.update(flatten_params(value, f"{prefix}{key}/" if isinstance(value, dict) else f"{prefix}{key}"))
        return flat
    if isinstance(tree, np.ndarray) or np.isscalar(tree):
        return {prefix.rstrip("/"): np.asarray(tree)}
    raise CheckpointError(f"Parameter {prefix!r} is a {type(tree).__name__}, not a numpy array")


# --------------------------------------------------------------------------------------------------
# Config and parameter map
# --------------------------------------------------------------------------------------------------


def infer_config(params: dict[str, np.ndarray], reference_config: dict[str, Any] | None = None) -> GPNConfig:
    """Build a `GPNConfig` from the reference config (if given) checked against the parameter shapes."""

    def shape(*names: str) -> tuple[int, ...]:
        """Shape of the first of `names` present (several parameters reveal the same size)."""
        for name in names:
            if name in params:
                return tuple(params[name].shape)
        raise CheckpointError(f"Cannot infer the model size: none of {', '.join(names)} is in the checkpoint")

    vocab_size, embedding_size = shape("embedding")
    hidden_size = shape("fuse_proj_k", "fg_gate_k")[-1]
    use_memory = any(name.startswith("write_") for name in params)
    layer_indices = sorted({int(m.group(1)) for name in params if (m := re.match(r"L(\d+)_", name))})
    prefix = "L0_" if use_memory else ""
    if f"{prefix}ffn_w1_k" in params:  # (d, 2f)
        intermediate_size = shape(f"{prefix}ffn_w1_k")[1] // 2
    else:  # (f, d)
        intermediate_size = shape(f"{prefix}ffn_w2_k")[0]
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        embedding_size=embedding_size,
        intermediate_size=intermediate_size,
        num_predict_layers=max(len(layer_indices), 1),
        use_memory=use_memory,
        use_decoder_bias="decode_bias" in params,
    )
    if use_memory:
        heads = shape("write_A_log", "write_dt_bias", "write_W_beta_k", "write_W_a_k")[-1]
        kwargs.update(
            num_memory_heads=heads,
            memory_key_dim=shape("write_W_k_k", "L0_read_W_q_k", "write_W_k_b", "L0_read_W_q_b")[-1] // heads,
            memory_value_dim=shape("write_W_v_k", "L0_read_W_gate_k", "L0_read_out_norm_w")[-1] // heads,
        )
    if reference_config:
        names = {
            "vocab_size": "vocab_size", "d_state": "hidden_size", "d_emb": "embedding_size",
            "d_ffn": "intermediate_size", "n_heads": "num_memory_heads", "d_key": "memory_key_dim",
            "d_val": "memory_value_dim", "n_layers": "num_predict_layers", "use_decoder_bias": "use_decoder_bias",
        }  # fmt: skip
        disagreements = [
            f"{ref_name}={reference_config[ref_name]} but the parameters say {ours}={kwargs[ours]}"
            for ref_name, ours in names.items()
            if ref_name in reference_config and ours in kwargs and reference_config[ref_name] != kwargs[ours]
        ]
        if disagreements:
            raise CheckpointError("The checkpoint's config.json disagrees with its parameters: " + "; ".join(disagreements))
    return GPNConfig(**kwargs)


def parameter_map(config: GPNConfig) -> dict[str, tuple[str, bool]]:
    """reference name -> (transformers state-dict name, transpose?) for a model of this config."""
    mapping = {
        "embedding": ("model.embed_tokens.weight", False),
        "fuse_norm_w": ("model.fuse_norm.weight", False),
        "fuse_proj_k": ("model.fuse_proj.weight", True),
        "fg_norm_w": ("model.fuse_gate_norm.weight", False),
        "fg_gate_k": ("model.fuse_gate.weight", True),
        "fg_gate_b": ("model.fuse_gate.bias", False),
        "decode_norm_w": ("decode_norm.weight", False),
        "decode_proj_k": ("decode_proj.weight", True),
    }
    if config.use_decoder_bias:
        mapping["decode_bias"] = ("decode_proj.bias", False)
    layer_params = {
        "ffn_norm_w": ("ffn_norm.weight", False),
        "ffn_w1_k": ("ffn_in.weight", True),
        "ffn_w2_k": ("ffn_out.weight", True),
        "pg_norm_w": ("gate_norm.weight", False),
        "pg_gate_k": ("gate.weight", True),
        "pg_gate_b": ("gate.bias", False),
    }
    if config.use_memory:
        layer_params.update({
            "read_norm_w": ("read_norm.weight", False),
            "read_W_q_k": ("read_query.weight", True),
            "read_W_q_b": ("read_query.bias", False),
            "read_W_gate_k": ("read_gate.weight", True),
            "read_out_norm_w": ("read_out_norm.weight", False),
            "read_W_o_k": ("read_out.weight", True),
        })  # fmt: skip
        mapping.update({
            "write_norm_w": ("model.memory_write.norm.weight", False),
            "write_W_k_k": ("model.memory_write.key.weight", True),
            "write_W_k_b": ("model.memory_write.key.bias", False),
            "write_W_v_k": ("model.memory_write.value.weight", True),
            "write_W_beta_k": ("model.memory_write.beta.weight", True),
            "write_W_a_k": ("model.memory_write.decay.weight", True),
            "write_A_log": ("model.memory_write.A_log", False),
            "write_dt_bias": ("model.memory_write.dt_bias", False),
        })  # fmt: skip
        for i in range(config.num_predict_layers):
            for ref_name, (name, transpose) in layer_params.items():
                mapping[f"L{i}_{ref_name}"] = (f"model.predict_layers.{i}.{name}", transpose)
    else:  # the reference's memory-less model has one predict layer and no prefix
        for ref_name, (name, transpose) in layer_params.items():
            mapping[ref_name] = (f"model.predict_layers.0.{name}", transpose)
    return mapping


def convert_params(params: dict[str, np.ndarray], config: GPNConfig) -> GPNForCausalLM:
    """A `GPNForCausalLM` holding the reference parameters; one error lists every problem."""
    model = GPNForCausalLM(config)
    expected = model.state_dict()
    mapping = parameter_map(config)
    missing = sorted(set(mapping) - set(params))
    unexpected = sorted(set(params) - set(mapping))
    misshaped = []
    state_dict = {}
    for ref_name, (name, transpose) in mapping.items():
        if ref_name not in params:
            continue
        array = np.asarray(params[ref_name])
        tensor = torch.from_numpy(np.ascontiguousarray(array.T if transpose else array)).float()
        want = tuple(expected[name].shape)
        if tuple(tensor.shape) != want:
            stored = tuple(array.shape)
            misshaped.append(f"{ref_name}: shape {stored}, expected {want[::-1] if transpose else want}")
            continue
        if not torch.isfinite(tensor).all():
            misshaped.append(f"{ref_name}: contains NaN or inf")
            continue
        state_dict[name] = tensor
    if missing or unexpected or misshaped:
        parts = []
        if missing:
            parts.append(f"missing parameters: {', '.join(missing)}")
        if unexpected:
            parts.append(f"unexpected parameters: {', '.join(unexpected)}")
        if misshaped:
            parts.append(f"bad parameters: {'; '.join(misshaped)}")
        raise CheckpointError("Cannot convert the checkpoint: " + " | ".join(parts))
    model.load_state_dict(state_dict, strict=True)
    return model.eval()


def load_reference_model(src: str | Path) -> GPNForCausalLM:
    """Read a reference checkpoint (pickle or params.npz folder) and return the converted model."""
    params, reference_config = read_source(src)
    config = infer_config(params, reference_config)
    return convert_params(params, config)


def convert(src: str | Path, out: str | Path, tokenizer: str | None = None) -> GPNForCausalLM:
    """Convert SRC to a `save_pretrained` folder OUT (safetensors, config with auto_map, modeling files)."""
    model = load_reference_model(src)
    out = Path(out)
    model.save_pretrained(out)
    if tokenizer:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(tokenizer).save_pretrained(out)
    return model
