"""Loading the model folder a `gpn` subcommand is given (gpn eval, generate, inspect and serve load theirs here):
a path that is no model folder named as such, and a model whose weights do not match its config.json, hold NaN or
inf, or cannot be read refused in one line, where transformers would load it (drawing missing weights at random)
or fail in a traceback."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def check_model_path(path: str) -> None:
    """Refuse, naming it, a local path that does not exist or is not a model folder (from_pretrained would take it
    for a malformed Hub id); a Hub id passes. (gpn eval, inspect and generate all check their model this way.)"""
    from ..data.tokenizer import names_a_local_path

    folder = Path(path).expanduser()
    if folder.exists() and not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a model folder: it has no config.json")
    if not folder.exists() and names_a_local_path(path):
        raise FileNotFoundError(f"model folder {path} does not exist")


def causal_lm_from_pretrained(path: str, **kwargs: Any):
    """`AutoModelForCausalLM.from_pretrained(path, **kwargs)`, a damaged weights file refused as an `OSError` naming
    the folder (gpn eval and gpn inspect say it in one line; the reader's own error would be a traceback), and
    weights holding NaN or inf refused as a `ValueError` naming them: every figure computed from them would be NaN
    (gpn eval wrote perplexities of NaN to its results, as if measured)."""
    from transformers import AutoModelForCausalLM

    try:
        model, loading = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True, **kwargs)
    except (OSError, ValueError):  # a missing file, an unknown model type: transformers' own message names it
        raise
    except Exception as error:  # a damaged weights file (safetensors' SafetensorError, torch's zip RuntimeError)
        raise OSError(f"cannot load a model from {path}: {type(error).__name__}: {error}") from error
    refuse_incomplete_weights(loading, path)
    refuse_non_finite_parameters(model, path)
    return model


def refuse_incomplete_weights(loading: dict[str, Any], path: str) -> None:
    """A `ValueError` naming the weights the model of `path`'s config.json has and its weights files lack, or hold
    and it has not (`from_pretrained`'s `output_loading_info`): transformers draws the missing ones at random and
    drops the others, saying so only in a load report on stderr, and every figure or text would come from that
    model (a config.json edited to more or fewer layers than were trained, a weights file cut short)."""
    missing, unexpected = sorted(loading.get("missing_keys") or ()), sorted(loading.get("unexpected_keys") or ())
    if not missing and not unexpected:
        return
    problems = ([f"its weights lack {_first_names(missing, 4)}"] if missing else []) + (
        [f"its weights hold {_first_names(unexpected, 4)}, which its config.json has no place for"]
        if unexpected
        else []
    )
    raise ValueError(
        f"the model in {path} does not match its config.json: {'; '.join(problems)} (transformers would draw the "
        "missing weights at random and drop the others); load the folder the weights were saved with"
    )


def refuse_non_finite_parameters(model, path: str) -> None:
    """A `ValueError` naming the floating-point parameters of `model` (loaded from `path`) that hold NaN or inf: in the
    weights file, or made so by the dtype they were loaded in (float16 overflows above 65504)."""
    from ..state_file import stored_tensors

    bad = [  # (a quantized weight by its inner tensors, its scales: torchao's have no isfinite)
        part_name
        for name, param in model.named_parameters()
        if param.device.type != "meta"
        for part_name, part in stored_tensors(name, param.detach())
        if part.is_floating_point() and not bool(torch.isfinite(part).all())
    ]
    if bad:
        raise ValueError(
            f"the model in {path} has parameters holding NaN or inf (loaded as {next(model.parameters()).dtype}): "
            f"{_first_names(bad, 5)}; nothing computed from them would mean anything"
        )


def _first_names(names: list[str], count: int) -> str:
    """The first `count` of `names`, and how many more there are: a model's thousands of weights are not listed."""
    return ", ".join(names[:count]) + (f" and {len(names) - count} more" if len(names) > count else "")
