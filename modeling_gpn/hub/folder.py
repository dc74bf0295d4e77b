"""The upload folder: everything `gpn push` publishes for a model folder, built and checked before anything
touches the network (`prepare_folder`; `--dry-run OUT` writes it and stops).

In order: the source folder is checked (a folder, no pickles, a config that loads, weights that match it);
the weights are copied byte for byte; the remote code is copied from the installed package the way
`save_pretrained` does, with an `auto_map` in config.json; the generation config and the tokenizer are
copied (or derived, or loaded from `--tokenizer`) and must load; the model card is generated and validated;
and the whole folder passes `check_prepared_folder`.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from ..configuration_gpn import GPNConfig

from ..cli.loading import end_of_text_disagreement
from .checks import (
    WEIGHTS_INDEX,
    check_prepared_folder,
    check_remote_code,
    check_weights,
    load_folder_config,
    pickle_files,
    weight_files,
)
from .errors import HubPushError
from .model_card import EvalInfo, build_card, read_eval_results, read_training_info, validate_card

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
EVAL_RESULTS_FILE = "eval_results.json"

#: Load-time options that transformers 5 saves into tokenizer_config.json; they describe the machine
#: that saved the tokenizer (or carry a credential), not the tokenizer, so they are not published.
TOKENIZER_LOAD_OPTIONS = (
    "is_local",
    "local_files_only",
    "cache_dir",
    "token",
    "use_auth_token",
    "_commit_hash",
    "force_download",
    "proxies",
)


@dataclass
class PreparedFolder:
    """The folder that is (or would be) uploaded."""

    path: Path
    files: list[str]
    n_params: int
    card_metadata: dict[str, Any]


def prepare_folder(
    model_dir: str | Path,
    out: str | Path,
    repo_id: str,
    *,
    license: str = "mit",
    datasets: list[str] | tuple[str, ...] = (),
    tags: list[str] | tuple[str, ...] = (),
    model_name: str | None = None,
    tokenizer: str | None = None,
    token: str | None = None,
    eval_results: str | Path | None = None,
    base_model: str | None = None,
) -> PreparedFolder:
    """Write into the empty folder `out` exactly what `push` uploads for `model_dir`, checked. The card's evaluation
    is `eval_results` (`gpn eval`'s eval_results.json), else the one in `model_dir` when there is one; its
    `base_model` is `base_model`, else the one named by the card a Trainer or TRL wrote into `model_dir`."""
    model_dir, out = Path(model_dir), Path(out)
    config, raw_config, weights, n_params = check_source_folder(model_dir)
    base_model = check_base_model(base_model) if base_model else card_base_model(model_dir)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        raise HubPushError(f"{out} is not empty; give a new or empty folder")
    for path in weights:
        shutil.copyfile(path, out / path.name)
    if (model_dir / WEIGHTS_INDEX).is_file():
        shutil.copyfile(model_dir / WEIGHTS_INDEX, out / WEIGHTS_INDEX)
    write_remote_code(out, raw_config)
    write_generation_config(model_dir, out, config)
    tokenizer_name = write_tokenizer(model_dir, out, config, tokenizer)
    evaluation = read_evaluation(model_dir, eval_results, n_params)
    training = read_training_info(model_dir)
    card = build_card(
        config,
        repo_id,
        n_params=n_params,
        evaluation=evaluation,
        training=training,
        license=license,
        datasets=list(datasets),
        tags=list(tags),
        model_name=model_name,
        tokenizer_name=tokenizer_name,
        base_model=base_model,
    )
    metadata = validate_card(card)
    (out / "README.md").write_text(card, encoding="utf-8")
    files = check_prepared_folder(out, token=token)
    return PreparedFolder(path=out, files=files, n_params=n_params, card_metadata=metadata)


def check_base_model(base_model: str) -> str:
    """`--base-model`, a Hub repo id (the Hub links only those; a local path would publish a dead link)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(base_model)
    except HFValidationError as error:
        raise HubPushError(f"--base-model {base_model!r} is not a Hub repo id ('owner/name'): {error}") from None
    return base_model


def card_base_model(model_dir: Path) -> str | None:
    """The `base_model` of the README.md that transformers' Trainer or TRL's trainers write beside a fine-tune's
    weights (replaced by gpn push's card, which would otherwise drop it), when it is one Hub repo id."""
    from huggingface_hub import ModelCard

    path = model_dir / "README.md"
    if not path.is_file():
        return None
    try:
        found = ModelCard.load(path).data.to_dict().get("base_model")
        if isinstance(found, list) and len(found) == 1:
            found = found[0]
        return check_base_model(found) if isinstance(found, str) else None
    except Exception:  # noqa: BLE001 - a card that does not parse, or names no repo, names no base model
        return None


def read_evaluation(model_dir: Path, eval_results: str | Path | None, n_params: int) -> EvalInfo | None:
    """The evaluation the card publishes: `eval_results`, else `model_dir`'s eval_results.json, else none. One that
    counts other parameters than this model's is refused: it is another model's (an eval_results.json copied beside
    the wrong weights), and its figures would be published as this model's in the model-index."""
    path = Path(eval_results) if eval_results is not None else model_dir / EVAL_RESULTS_FILE
    if not path.is_file():
        if eval_results is not None:
            raise HubPushError(f"--eval-results {path} is not a file (gpn eval writes OUTPUT_DIR/{EVAL_RESULTS_FILE})")
        return None
    evaluation = read_eval_results(path)
    if evaluation.n_params is not None and evaluation.n_params != n_params:
        raise HubPushError(
            f"{path} evaluated a model of {evaluation.n_params:,} parameters ({evaluation.model}), not this one of "
            f"{n_params:,}: its results would be published as this model's; run gpn eval on {model_dir}"
        )
    return evaluation


def check_source_folder(model_dir: Path) -> tuple[GPNConfig, dict, list[Path], int]:
    """(config, raw config.json, weight files, parameter count) of a folder `gpn push` accepts to publish."""
    if not model_dir.is_dir():
        raise HubPushError(f"{model_dir} is not a folder")
    pickles = pickle_files(model_dir, recursive=False)
    if pickles:
        raise HubPushError(
            f"{model_dir} holds pickle files ({', '.join(pickles)}); pickles can run code when loaded, so gpn push "
            "publishes safetensors only. Move or delete them (the safetensors weights are what gets uploaded)."
        )
    if (model_dir / "adapter_config.json").is_file():
        raise HubPushError(
            f"{model_dir} is a PEFT adapter (adapter_config.json), not a whole model: gpn push publishes whole GPNs; "
            "merge it into its base first (PeftModel.from_pretrained(base, DIR).merge_and_unload().save_pretrained("
            "OUT), with the tokenizer) and push OUT with --base-model naming the base"
        )
    config, raw_config = load_folder_config(model_dir)
    quantization = raw_config.get("quantization_config")
    if quantization:  # its tensors are not the config's (torchao: `*._weight_qdata`, `*._weight_scale`)
        method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else "?"
        raise HubPushError(
            f"{model_dir} holds quantized weights (config.json's quantization_config, {method}); gpn push publishes "
            "unquantized weights: push the float folder, and quantize after loading (docs/inference-speed.md)"
        )
    weights = weight_files(model_dir)
    n_params = check_weights(weights, config)
    return config, raw_config, weights, n_params


def write_remote_code(out: Path, raw_config: dict) -> None:
    """The remote code: what save_pretrained ships, from the installed package (relative imports followed), and
    config.json with the `auto_map` that points at it; both checked."""
    from transformers.dynamic_module_utils import custom_object_save

    from ..configuration_gpn import GPNConfig
    from ..modeling_gpn import GPNForCausalLM, GPNForSequenceClassification, GPNModel

    for cls in (GPNConfig, GPNForCausalLM):
        custom_object_save(cls, out)
    raw_config = dict(raw_config)
    # Every auto class a GPN serves, and only those, pointing at the code shipped here: the folder's own auto_map is
    # not kept, as a folder whose config was saved apart from the model (config.save_pretrained beside weights an
    # FSDP or Accelerate run wrote) names AutoConfig alone, and one saved from another repo's code may name that repo.
    raw_config["auto_map"] = {
        auto: f"{cls.__module__.rsplit('.', 1)[-1]}.{cls.__name__}"
        for auto, cls in (
            ("AutoConfig", GPNConfig),
            ("AutoModel", GPNModel),
            ("AutoModelForCausalLM", GPNForCausalLM),
            ("AutoModelForSequenceClassification", GPNForSequenceClassification),
        )
    }
    (out / "config.json").write_text(json.dumps(raw_config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    check_remote_code(out)
    load_folder_config(out)


def write_generation_config(model_dir: Path, out: Path, config: GPNConfig) -> None:
    """The folder's generation_config.json, or one derived from the config; it must load."""
    from transformers import GenerationConfig

    if (model_dir / "generation_config.json").is_file():
        shutil.copyfile(model_dir / "generation_config.json", out / "generation_config.json")
    else:
        GenerationConfig.from_model_config(config).save_pretrained(out)
    try:
        GenerationConfig.from_pretrained(out)
    except Exception as error:  # noqa: BLE001
        raise HubPushError(f"generation_config.json does not load: {error}") from error


def write_tokenizer(model_dir: Path, out: Path, config: GPNConfig, tokenizer: str | None) -> str:
    """The tokenizer files (from `tokenizer`, else the folder's own), cleaned of load-time options; they must load
    and fit the vocabulary. Returns the name the card gives the tokenizer."""
    from transformers import AutoTokenizer

    if tokenizer:
        try:
            AutoTokenizer.from_pretrained(tokenizer).save_pretrained(out)
        except Exception as error:  # noqa: BLE001
            reason = " ".join(str(error).split())  # one line: transformers' offline message runs over two
            raise HubPushError(f"cannot load the tokenizer {tokenizer!r}: {reason}") from error
    else:
        present = [name for name in TOKENIZER_FILES if (model_dir / name).is_file()]
        if not present:
            raise HubPushError(
                f"{model_dir} has no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}); pass --tokenizer NAME_OR_PATH "
                "(e.g. the LLaMA-2 tokenizer the paper used) so the published model can be used"
            )
        for name in present:
            shutil.copyfile(model_dir / name, out / name)
    _clean_tokenizer_config(out / "tokenizer_config.json")
    try:
        loaded_tokenizer = AutoTokenizer.from_pretrained(out)
    except Exception as error:  # noqa: BLE001
        raise HubPushError(f"the tokenizer files do not load with AutoTokenizer: {error}") from error
    if len(loaded_tokenizer) > config.vocab_size:
        raise HubPushError(
            f"the tokenizer has {len(loaded_tokenizer):,} tokens but the model's vocabulary is {config.vocab_size:,}"
        )
    check_end_of_text(out, loaded_tokenizer)
    tokenizer_name = tokenizer if tokenizer and not Path(tokenizer).exists() else None
    return tokenizer_name or f"{type(loaded_tokenizer).__name__}, {len(loaded_tokenizer):,} tokens"


def check_end_of_text(out: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    """generate() stops at the generation config's eos ids: the tokenizer's end of text must be one of them (or they
    all special tokens of it, a chat model's end of turn), or the published model stops at an ordinary token (a
    config left with LLaMA-2's id 2 beside another tokenizer). The rule gpn generate and gpn serve refuse by
    (`cli.loading.end_of_text_disagreement`)."""
    problem = end_of_text_disagreement(str(out), tokenizer)
    if problem is not None:
        raise HubPushError(problem)


def _clean_tokenizer_config(path: Path) -> None:
    if not path.is_file():
        return
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise HubPushError(f"{path.name} is not valid JSON: {error}") from error
    if isinstance(data, dict) and any(key in data for key in TOKENIZER_LOAD_OPTIONS):
        data = {k: v for k, v in data.items() if k not in TOKENIZER_LOAD_OPTIONS}
        path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
