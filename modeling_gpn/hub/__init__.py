"""`gpn push MODEL_DIR REPO_ID`: publish a GPN folder to the Hugging Face Hub with a model card.

The upload is one folder built from MODEL_DIR and checked before anything touches the network:

- weights: the safetensors file(s) of MODEL_DIR (and their index), copied byte for byte; their tensor
  names and shapes must match the model the config describes;
- `config.json` with an `auto_map` and the self-contained remote code (`configuration_gpn.py`,
  `modeling_gpn.py` and every file they import relatively) copied from the installed package the
  way `save_pretrained` does (`transformers.dynamic_module_utils.custom_object_save`); each shipped
  file may import only torch, transformers, the standard library and the other shipped files;
- tokenizer files (from MODEL_DIR, or `--tokenizer NAME_OR_PATH`), `generation_config.json` (from
  MODEL_DIR, or derived from the config), and a generated `README.md` model card (see `model_card.py`):
  it reads `eval_results.json` and a training log (`training_config.json`, `trainer_state.json`,
  `train_log.jsonl`, other `*.jsonl` with loss rows, `gpn convert`'s `conversion.json`) when present.

Only top-level files of MODEL_DIR are considered (sub-folders such as training checkpoints are never
uploaded). Refused, each with an error naming the problem: pickle files at the top level (`*.bin`,
`*.pt`, `*.pth`, `*.pkl`, `*.pickle`, `*.ckpt`), a PEFT adapter (merge it first), no safetensors weights, a
config that does not load, quantized weights (a `quantization_config`),
weights that do not match the config, a tokenizer that does not load, is larger than the vocabulary or
whose end of text is not where generate() stops,
remote code that imports the installed `modeling_gpn`, and a card whose metadata fails
`huggingface_hub`'s parsing. `--dry-run OUT` writes exactly the folder that would be uploaded and
stops. The token is passed to `huggingface_hub.HfApi` only: never printed, never written.

Where its parts live (this face re-exports their public names):

    folder.py         the upload folder: `prepare_folder` (`PreparedFolder`)
    checks.py         the checks of the source folder and of the upload folder
    push.py           `push_folder` and `upload` (the network boundary)
    model_card.py     the model card (`build_card`), with card_inputs.py (eval results, training log) and
                      card_metadata.py (the model-index, `validate_card`)
    errors.py         `HubPushError`, `CardError`
    cli.py            `add_arguments`, `run`
"""

from __future__ import annotations

from .checks import (
    ALLOWED_CODE_IMPORTS,
    PICKLE_SUFFIXES,
    check_prepared_folder,
    check_remote_code,
    check_weights,
    load_folder_config,
    weight_files,
)
from .cli import add_arguments, run
from .errors import CardError, HubPushError
from .folder import EVAL_RESULTS_FILE, TOKENIZER_FILES, TOKENIZER_LOAD_OPTIONS, PreparedFolder, prepare_folder
from .model_card import build_card, read_eval_results, read_training_info, validate_card
from .push import push_folder, upload

__all__ = [
    "ALLOWED_CODE_IMPORTS",
    "CardError",
    "EVAL_RESULTS_FILE",
    "HubPushError",
    "PICKLE_SUFFIXES",
    "PreparedFolder",
    "TOKENIZER_FILES",
    "TOKENIZER_LOAD_OPTIONS",
    "add_arguments",
    "build_card",
    "check_prepared_folder",
    "check_remote_code",
    "check_weights",
    "load_folder_config",
    "prepare_folder",
    "push_folder",
    "read_eval_results",
    "read_training_info",
    "run",
    "upload",
    "validate_card",
    "weight_files",
]
