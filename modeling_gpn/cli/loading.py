"""Loading the model folder a `gpn` subcommand is given (gpn eval, generate, inspect and serve load theirs here):
a path that is no model folder named as such, and a model whose weights do not match its config.json, hold NaN or
inf, or cannot be read refused in one line, where transformers would load it (drawing missing weights at random)
or fail in a traceback.

A local PEFT adapter folder (what a LoRA fine-tune saves: adapter_config.json and the adapter's weights, no
config.json) is a model too, its base (`base_model_name_or_path`) with the adapter: `check_model_path` checks the
base can be found, `load_causal_lm` loads the base and either merges the adapter into it (gpn generate, eval and
serve: exactly the model `merge_and_unload()` gives, so their tokens, scores and state files are the merged
model's, on the fast path) or attaches it (gpn inspect, which reports the adapter's parameters), and
`tokenizer_source` says whose tokenizer goes with it: the adapter folder's own, else the base's (as PEFT's
`AutoPeftModelForCausalLM` reads it)."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch import nn
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

ADAPTER_CONFIG = "adapter_config.json"
LOADED_ADAPTER = "default"  # the name PEFT (and transformers' load_adapter) give the adapter they load
# what a PEFT adapter folder needs installed: peft is no dependency of gpn (a fine-tune brings it, docs/fine-tuning.md);
# this is the PEFT the tests run (pyproject.toml's test extra)
PEFT_REQUIREMENT = "peft>=0.21,<0.22"
# what a saved tokenizer holds, one of them at least (`save_pretrained` writes tokenizer_config.json beside its files)
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model")


class BaseModelNotFoundError(FileNotFoundError):
    """The base model of a PEFT adapter folder cannot be loaded; the message names it and the adapter."""


class PeftNotInstalledError(FileNotFoundError):
    """A PEFT adapter folder given where peft is not installed; the message names the adapter and what to install.
    A `FileNotFoundError`, as `check_model_path`'s other refusals, so every command that checks its model before
    loading it reports it in one line (it was a `ModuleNotFoundError`: a traceback from gpn eval)."""


def require_peft(path: str) -> None:
    """Refuse the PEFT adapter folder `path` where peft is not installed (`PeftNotInstalledError`)."""
    if importlib.util.find_spec("peft") is None:
        raise PeftNotInstalledError(
            f"{path} is a PEFT adapter folder, and loading one needs peft, which is not installed: "
            f"pip install '{PEFT_REQUIREMENT}'"
        )


def adapter_base(path: str) -> str | None:
    """The base model (a folder or Hub id) the local PEFT adapter folder `path` adapts, or None when `path` is no
    adapter folder (one with adapter_config.json and no config.json: a folder with both is a whole model that
    carries an adapter, which transformers loads with it attached). A `FileNotFoundError` naming the adapter when
    its adapter_config.json names no base, or cannot be read."""
    folder = Path(path).expanduser()
    if not (folder / ADAPTER_CONFIG).is_file() or (folder / "config.json").is_file():
        return None
    try:
        base = json.loads((folder / ADAPTER_CONFIG).read_text(encoding="utf-8")).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError) as error:
        raise FileNotFoundError(f"the PEFT adapter {path}: cannot read its {ADAPTER_CONFIG}: {error}") from None
    if not isinstance(base, str) or not base:
        raise FileNotFoundError(
            f"the PEFT adapter {path} names no base model ({ADAPTER_CONFIG}'s base_model_name_or_path is {base!r}): "
            "set it to the base model's folder or Hub id"
        )
    return base


def check_model_path(path: str) -> str:
    """Refuse, naming it, a local path that does not exist or is not a model folder (from_pretrained would take it
    for a malformed Hub id); a Hub id passes. A PEFT adapter folder passes when its base does (`adapter_base`),
    refused naming the base and the adapter otherwise. (gpn eval, generate, inspect and serve check their model
    this way.) Returns the name to load the model by: `path`, its leading `~` expanded (a quoted "~/model" arrives
    as typed, and transformers took it for a malformed Hub id though the folder was there).

    A name that could be either, `owner/name` with no such folder here, is refused where the Hub cannot be asked
    (HF_HUB_OFFLINE=1) and its cache holds no such repo, naming both readings: transformers said only that the
    Hub could not be reached, which reads as a network fault where the user meant a folder they had mistyped or
    run from another folder."""
    from ..data.tokenizer import NEITHER_FOLDER_NOR_CACHED, names_a_local_path, readable_offline

    if path.startswith("~"):  # (never a Hub id)
        path = str(Path(path).expanduser())
    base = adapter_base(path)
    if base is not None:
        require_peft(path)
        if adapter_base(base) is not None:
            raise FileNotFoundError(f"the base model of the PEFT adapter {path}, {base}, is itself an adapter folder")
        try:
            check_model_path(base)
        except FileNotFoundError as error:
            raise FileNotFoundError(f"the base model of the PEFT adapter {path} cannot be found: {error}") from None
        return path
    folder = Path(path)
    if folder.exists() and not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a model folder: it has no config.json")
    if not folder.exists() and names_a_local_path(path):
        raise FileNotFoundError(f"model folder {path} does not exist")
    if not folder.exists() and not readable_offline(path, ("config.json", ADAPTER_CONFIG)):
        raise FileNotFoundError(f"{path} {NEITHER_FOLDER_NOR_CACHED.format(cwd=Path.cwd())}")
    return path


def tokenizer_source(path: str) -> str:
    """Where the tokenizer of the model `path` is read: `path` itself, but for a PEFT adapter folder that holds no
    tokenizer, its base (an SFT run saves the tokenizer it trained with beside the adapter, special tokens and
    chat template included: that one, where it is there)."""
    base = adapter_base(path)
    if base is None or any((Path(path).expanduser() / name).is_file() for name in TOKENIZER_FILES):
        return path
    return base


def load_model_tokenizer(path: str, tokenizer: str | None = None, **kwargs: Any) -> PreTrainedTokenizerBase:
    """`data.load_tokenizer` of `tokenizer`, else of the model `path`'s (`tokenizer_source`); a `DataError` (a
    `ValueError`) naming the file or id, and, where it is a PEFT adapter's base, the adapter too."""
    from ..data import DataError, load_tokenizer

    source = tokenizer or tokenizer_source(path)
    try:
        return load_tokenizer(source, **kwargs)
    except DataError as error:
        if source == path or tokenizer is not None:
            raise
        raise DataError(
            f"cannot load the tokenizer of {source}, the base model of the PEFT adapter {path} (which holds none): "
            f"{error}"
        ) from None


def end_of_text_disagreement(path: str, tokenizer: PreTrainedTokenizerBase) -> str | None:
    """One line, where generate() on the model `path` would not stop at the end of text of `tokenizer` (the one a
    command runs it with): the token ids its generation config ends generate() at (generation_config.json, else
    config.json's `eos_token_id`, as transformers reads them; a PEFT adapter's base's) lack the tokenizer's EOS id,
    and one of them at least is no special token of the tokenizer (ends all special, a chat model's end of turn, are
    its choice). Its text then runs on past the end of text, or stops at an ordinary token: a folder of `gpn convert
    --tokenizer` before its ids followed the tokenizer carries LLaMA-2's 2, whatever the tokenizer. None where they
    agree, where either has no EOS, or where the folder's configs cannot be read (a Hub id offline: the load says
    so). gpn generate and gpn serve refuse such a model (what they print would be cut wrong), gpn eval and gpn
    inspect warn (their scores read no EOS id of the config); gpn push refuses it (`hub.folder.check_end_of_text`)."""
    from transformers import AutoConfig, GenerationConfig

    eos = tokenizer.eos_token_id
    if eos is None:
        return None
    folder = adapter_base(path) or path
    try:
        ends = GenerationConfig.from_pretrained(folder).eos_token_id
    except (OSError, ValueError):  # no generation_config.json: generate() takes config.json's ids
        try:
            ends = GenerationConfig.from_model_config(AutoConfig.from_pretrained(folder)).eos_token_id
        except (OSError, ValueError):
            return None
    ends = [] if ends is None else list(ends) if isinstance(ends, (list, tuple)) else [ends]
    # Ends that are all special tokens of the tokenizer are a choice (a chat model ending at its end of turn,
    # `<|end|>`, not at `<|endoftext|>`); an ordinary token, or an id the tokenizer has not, is no end of text.
    special = set(tokenizer.all_special_ids) | {
        i for i, token in tokenizer.added_tokens_decoder.items() if getattr(token, "special", False)
    }
    if not ends or eos in ends or all(i in special for i in ends):
        return None
    names = ", ".join(f"{i} ({tokenizer.convert_ids_to_tokens(i)!r})" for i in ends)
    return (
        f"{folder}'s generation config ends generate() at token id {names}, not at its tokenizer's end of text "
        f"{eos} ({tokenizer.eos_token!r}), and not only at its special tokens: set eos_token_id in its config.json and generation_config.json to {eos}, "
        "or give the tokenizer the model was trained with"
    )


def adapter_note(path: str, tokenizer: str | None = None) -> str | None:
    """One line saying what a PEFT adapter folder `path` runs as (None for a whole model), for the commands that
    merge it: its base, and whose tokenizer (`tokenizer`, where the command was given one)."""
    base = adapter_base(path)
    if base is None:
        return None
    if tokenizer is not None:
        whose = f"{tokenizer} (--tokenizer)"
    else:
        whose = "the adapter's own" if tokenizer_source(path) == path else f"the base's (none in {path})"
    return f"{path} is a PEFT adapter of {base}: run merged into it; tokenizer: {whose}"


def load_causal_lm(path: str, *, merge_adapter: bool = True, **kwargs: Any) -> PreTrainedModel:
    """The causal LM `path` names (`causal_lm_from_pretrained(path, **kwargs)`); for a PEFT adapter folder, its base
    loaded so (its weights checked as any model's) with the adapter merged into it (`PeftModel.from_pretrained` and
    `merge_and_unload()`, as a user merges one in Python: the same weights, bit for bit) or, without
    `merge_adapter`, attached (the base's modules wrapped by PEFT's, as transformers' `load_adapter` leaves them,
    loaded as PEFT loads it: transformers' `load_adapter` misses DoRA's magnitude vectors). Merged, a `dtype` asked
    for is the merged model's cast to it: the base is loaded as saved, merged, then cast. A base that
    cannot be loaded (a Hub id offline, a folder removed since the check) is a `FileNotFoundError` naming it and
    the adapter, in one line; an adapter whose weights file lacks some of its weights, or holds weights the model
    has no place for, a `ValueError` naming them (`refuse_incomplete_adapter`, `refuse_unplaced_adapter_weights`).
    The adapter's weights file is read once (`_peft_model_from_folder`)."""
    base = adapter_base(path)
    if base is None:
        return causal_lm_from_pretrained(path, **kwargs)
    require_peft(path)  # (before the base loads: gpn serve loads a request's model here, unchecked)
    # Merged, the base is loaded as saved and cast after the merge: merged in another dtype (gpn eval --dtype bfloat16,
    # int8, int4; gpn serve --dtype), the base's weights and the adapter's product were each rounded to it before
    # their sum, which was then rounded again, and the figures were not those of the merged model in that dtype.
    cast = kwargs.get("dtype") if merge_adapter and kwargs.get("dtype") not in (None, "auto") else None
    if cast is not None:
        kwargs["dtype"] = "auto"
    try:
        model = causal_lm_from_pretrained(base, **kwargs)
    except OSError as error:
        reason = " ".join(str(error).split())  # (transformers' own messages run over several lines)
        raise BaseModelNotFoundError(
            f"cannot load {base}, the base model of the PEFT adapter {path}: {reason}"
        ) from None
    folder = str(Path(path).expanduser())
    adapted, weights, loading = _peft_model_from_folder(model, folder, path, base)
    from peft.utils import get_peft_model_state_dict

    # (the weights PEFT saves for this adapter on this base, against those its file holds: PEFT only warns of the
    # ones it lacks, left as initialised, and would merge them so; and drops in silence the ones the model has no
    # place for, as PEFT's own load reports them, its renaming of the file's keys applied)
    expected = get_peft_model_state_dict(adapted, save_embedding_layers=False)
    refuse_incomplete_adapter(sorted(expected.keys() - weights.keys()), path)
    refuse_unplaced_adapter_weights(sorted(loading.unexpected_keys), path)
    if not merge_adapter:
        # The base with PEFT's layers in it, unwrapped from the PeftModel: what transformers' `load_adapter` leaves
        # (its PEFT mixin's flag set, `peft_config` copied in by PEFT), so the model is of its own class still.
        model = adapted.base_model.model
        model._hf_peft_config_loaded = True
        refuse_non_finite_parameters(model, path)
        return model
    model = adapted.merge_and_unload()
    if cast is not None:
        model = model.to(getattr(torch, cast) if isinstance(cast, str) else cast)
    # (an adapter holding NaN makes the merged weights NaN; a merged weight past float16's range, inf once cast)
    refuse_non_finite_parameters(model, path)
    return model


def _peft_model_from_folder(model: nn.Module, folder: str, path: str, base: str):
    """`PeftModel.from_pretrained(model, folder)` as it runs for a local adapter loaded for inference, its weights
    file read once (`load_peft_weights`: safetensors, or a .bin through `torch.load(weights_only=True)`, which runs
    no pickled code) and given to PEFT: the PeftModel, the weights the file holds, and PEFT's load result (its
    `unexpected_keys`), which `from_pretrained` keeps to itself. A `ValueError` in one line naming the file where
    the adapter's adapter_config.json or weights file cannot be read (damaged: cut short, garbage, a header lying
    about its tensors, a value of the wrong type), and naming the adapter and its base where PEFT cannot apply it
    to the base (an adapter of another model: modules or shapes differ)."""
    from peft import PeftConfig, PeftModel, set_peft_model_state_dict
    from peft.auto import MODEL_TYPE_TO_PEFT_MODEL_MAPPING
    from peft.utils import SAFETENSORS_WEIGHTS_NAME, WEIGHTS_NAME, load_peft_weights

    def reason(error: BaseException, named: bool = True) -> str:  # (one line: PEFT's messages run over several)
        return f"{type(error).__name__}: " * named + " ".join(str(error).split())

    try:
        config = PeftConfig.from_pretrained(folder)
        config.inference_mode = True
    except Exception as error:  # noqa: BLE001  (invalid JSON, an unknown peft_type, a value PEFT's checks refuse)
        raise ValueError(f"the PEFT adapter {path}: cannot read its {ADAPTER_CONFIG}: {reason(error)}") from None
    weights_file = SAFETENSORS_WEIGHTS_NAME if (Path(folder) / SAFETENSORS_WEIGHTS_NAME).is_file() else WEIGHTS_NAME
    try:
        weights = load_peft_weights(
            folder, device="cpu", key_mapping=getattr(model, "_checkpoint_conversion_mapping", None) or None
        )
    except Exception as error:  # noqa: BLE001  (safetensors' SafetensorError, torch's unpickling errors)
        raise ValueError(
            f"the PEFT adapter {path}: cannot read its weights file {weights_file}: {reason(error)}"
        ) from None
    try:
        adapted = MODEL_TYPE_TO_PEFT_MODEL_MAPPING.get(config.task_type, PeftModel)(model, config)
    except TypeError as error:  # (a setting of the wrong type, `r` a string: PEFT fails as it builds the layers)
        raise ValueError(
            f"the PEFT adapter {path}: its {ADAPTER_CONFIG} holds a setting of the wrong type: {reason(error)}"
        ) from None
    except (ValueError, RuntimeError, KeyError, AttributeError) as error:  # (modules the base has not)
        raise ValueError(f"cannot apply the PEFT adapter {path} to its base {base}: {reason(error, False)}") from None
    try:
        loading = set_peft_model_state_dict(adapted, weights)
    except (ValueError, RuntimeError, KeyError, TypeError) as error:  # (an adapter of another base: shapes differ)
        raise ValueError(f"cannot apply the PEFT adapter {path} to its base {base}: {reason(error, False)}") from None
    return adapted.eval(), weights, loading


def refuse_incomplete_adapter(missing: list[str], path: str) -> None:
    """A `ValueError` naming the adapter weights `missing` from the weights file of the PEFT adapter
    folder `path` (a file cut short, or edited): PEFT loads such an adapter with only a warning, those weights left
    as initialised (zero or random), and the model merged or attached would be another than the one trained."""
    if missing:
        raise ValueError(
            f"the PEFT adapter {path} is incomplete: its weights file lacks {_first_names(missing, 4)} of the "
            "adapter's weights (PEFT would leave them as initialised); save the adapter again"
        )


def refuse_unplaced_adapter_weights(unexpected: list[str], path: str) -> None:
    """A `ValueError` naming the weights in the weights file of the PEFT adapter folder `path` that the adapted
    model has no place for (`unexpected` as PEFT's load reports them, the adapter's name it inserts taken out
    again): an adapter of other modules, a key renamed by hand. PEFT drops them in silence (transformers'
    `load_adapter` only reports them), and the model merged or attached would lack what was trained."""
    if unexpected:
        names = [re.sub(rf"\.{LOADED_ADAPTER}(?=\.[^.]*$|$)", "", name) for name in unexpected]
        raise ValueError(
            f"the PEFT adapter {path} does not fit its base: its weights file holds {_first_names(names, 4)}, which "
            "the adapted model has no place for (PEFT would drop them); save the adapter again from its model"
        )


def causal_lm_from_pretrained(path: str, **kwargs: Any) -> PreTrainedModel:
    """`AutoModelForCausalLM.from_pretrained(path, **kwargs)`, a damaged weights file refused as an `OSError` naming
    the folder (gpn eval and gpn inspect say it in one line; the reader's own error would be a traceback), and
    weights holding NaN or inf refused as a `ValueError` naming them: every figure computed from them would be NaN
    (gpn eval wrote perplexities of NaN to its results, as if measured)."""
    from transformers import AutoModelForCausalLM

    refuse_stale_single_weights(path)
    try:
        model, loading = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True, **kwargs)
    except (OSError, ValueError):  # a missing file, an unknown model type: transformers' own message names it
        raise
    except Exception as error:  # a damaged weights file (safetensors' SafetensorError, torch's zip RuntimeError)
        raise OSError(f"cannot load a model from {path}: {type(error).__name__}: {error}") from error
    refuse_incomplete_weights(loading, path)
    refuse_non_finite_parameters(model, path)
    return model


def refuse_stale_single_weights(path: str) -> None:
    """A `ValueError` where the folder `path` holds model.safetensors beside a model.safetensors.index.json that names
    other files there: `save_pretrained` with `max_shard_size` into a folder of an earlier unsharded save leaves the
    earlier model.safetensors, and transformers loads it, not the shards, in silence (as `gpn push` refuses such a
    folder). Which of the two is stale cannot be told; an index whose shards are gone (an unsharded save over a
    sharded one, which removes the shards) is left alone: transformers loads the model.safetensors written last."""
    folder = Path(path)
    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if not (single.is_file() and index.is_file()):
        return
    try:
        named = {str(name) for name in json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return  # (transformers does not read the index beside model.safetensors)
    shards = sorted(name for name in named - {single.name} if (folder / name).is_file())
    if shards:
        raise ValueError(
            f"{path} holds both model.safetensors and the shards its model.safetensors.index.json names "
            f"({_first_names(shards, 2)}): one set is left from an earlier save_pretrained into this folder (it "
            "removes neither), and transformers would load model.safetensors; delete the stale files, or save to a "
            "new folder"
        )


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


def refuse_non_finite_parameters(model: nn.Module, path: str) -> None:
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
