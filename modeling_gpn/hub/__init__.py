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
  `train_log.jsonl`, other `*.jsonl` with loss rows) when present.

Only top-level files of MODEL_DIR are considered (sub-folders such as training checkpoints are never
uploaded). Refused, each with an error naming the problem: pickle files at the top level (`*.bin`,
`*.pt`, `*.pth`, `*.pkl`, `*.pickle`, `*.ckpt`), no safetensors weights, a config that does not load,
weights that do not match the config, a tokenizer that does not load or is larger than the vocabulary,
remote code that imports the installed `modeling_gpn`, and a card whose metadata fails
`huggingface_hub`'s parsing. `--dry-run OUT` writes exactly the folder that would be uploaded and
stops. The token is passed to `huggingface_hub.HfApi` only: never printed, never written.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .model_card import CardError, build_card, read_eval_results, read_training_info, validate_card

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
)  # fmt: skip
EVAL_RESULTS_FILE = "eval_results.json"
# safetensors is a dependency of transformers itself (GPNCache.save / load write and read state files with it).
ALLOWED_CODE_IMPORTS = frozenset({"torch", "transformers", "safetensors", "__future__"}) | frozenset(sys.stdlib_module_names)


class HubPushError(RuntimeError):
    """A folder that `gpn push` refuses to publish (the message says why and what to do)."""


@dataclass
class PreparedFolder:
    """The folder that is (or would be) uploaded."""

    path: Path
    files: list[str]
    n_params: int
    card_metadata: dict[str, Any]


# --------------------------------------------------------------------------------------------------
# Checks on the source folder


def _pickle_files(folder: Path, recursive: bool) -> list[str]:
    paths = folder.rglob("*") if recursive else folder.iterdir()
    return sorted(str(p.relative_to(folder)) for p in paths if p.is_file() and p.name.lower().endswith(PICKLE_SUFFIXES))


def load_folder_config(model_dir: Path):
    """The `GPNConfig` of `model_dir`, or `HubPushError` saying why it does not load."""
    from ..configuration_gpn import GPNConfig

    path = model_dir / "config.json"
    if not path.is_file():
        raise HubPushError(f"{model_dir} has no config.json: is it a folder written by save_pretrained / gpn train / gpn convert?")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise HubPushError(f"{path} is not valid JSON: {error}") from error
    if not isinstance(raw, dict) or raw.get("model_type") != GPNConfig.model_type:
        found = raw.get("model_type") if isinstance(raw, dict) else None
        raise HubPushError(f"{path} has model_type {found!r}; gpn push publishes GPN models (model_type 'gpn')")
    try:
        config = GPNConfig.from_pretrained(model_dir)
    except Exception as error:  # noqa: BLE001 - any failure means the config does not load
        raise HubPushError(f"{path} does not load as a GPNConfig: {error}") from error
    return config, raw


def weight_files(model_dir: Path) -> list[Path]:
    """The top-level safetensors weights of `model_dir` (single file or shards + index)."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise HubPushError(
            f"{model_dir} has no *.safetensors weights; gpn push uploads safetensors only "
            "(re-save the model with save_pretrained, which writes model.safetensors)"
        )
    return files


def check_weights(files: list[Path], config) -> int:
    """Tensor names and shapes of `files` match the model `config` describes; returns the parameter count."""
    import torch
    from safetensors import safe_open

    from ..modeling_gpn import GPNForCausalLM

    with torch.device("meta"):
        model = GPNForCausalLM(config)
    tied = set(model.all_tied_weights_keys)  # lm_head.weight is the embedding: not stored
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items() if name not in tied}
    found: dict[str, tuple[int, ...]] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():
                    # an older folder's decoder keys lack the base model's prefix; transformers loads them as these
                    name_in_model = f"model.{name}" if name not in expected and f"model.{name}" in expected else name
                    found[name_in_model] = tuple(handle.get_slice(name).get_shape())
        except Exception as error:  # noqa: BLE001
            raise HubPushError(f"{path} is not a readable safetensors file: {error}") from error
    problems = []
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    misshaped = [f"{n}: {found[n]} vs config {expected[n]}" for n in sorted(set(found) & set(expected)) if found[n] != expected[n]]
    if missing:
        problems.append(f"missing tensors: {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {', '.join(unexpected)}")
    if misshaped:
        problems.append(f"shapes differ: {'; '.join(misshaped)}")
    if problems:
        raise HubPushError("the weights do not match config.json: " + " | ".join(problems))
    n_params = 0
    for shape in found.values():
        count = 1
        for size in shape:
            count *= size
        n_params += count
    return n_params


def check_remote_code(folder: Path) -> list[str]:
    """Every shipped .py file imports only torch/transformers/safetensors/stdlib and shipped files; returns their names."""
    from transformers.dynamic_module_utils import get_imports, get_relative_imports

    code_files = sorted(p.name for p in folder.glob("*.py"))
    problems = []
    for name in code_files:
        path = folder / name
        foreign = sorted(set(get_imports(path)) - ALLOWED_CODE_IMPORTS)
        if foreign:
            hint = " (the installed package never ships: import it relatively)" if "modeling_gpn" in foreign else ""
            problems.append(f"{name} imports {', '.join(foreign)}{hint}")
        for relative in get_relative_imports(path):
            if not (folder / f"{relative}.py").is_file():
                problems.append(f"{name} imports .{relative}, which is not in the folder")
    if problems:
        raise HubPushError("the remote code is not self-contained: " + "; ".join(problems))
    return code_files


def _token_values(token: str | None) -> list[str]:
    values = [token, os.environ.get("HF_TOKEN"), os.environ.get("HUGGING_FACE_HUB_TOKEN")]
    return [v for v in values if v and len(v) >= 8]


def check_prepared_folder(folder: str | Path, token: str | None = None) -> list[str]:
    """The last checks before an upload; returns the relative file list. Raises `HubPushError`."""
    folder = Path(folder)
    pickles = _pickle_files(folder, recursive=True)
    if pickles:
        raise HubPushError(f"refusing to upload pickle files: {', '.join(pickles)}")
    files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    for required in ("config.json", "README.md", "generation_config.json", "configuration_gpn.py", "modeling_gpn.py"):
        if required not in files:
            raise HubPushError(f"the upload folder lacks {required}")
    check_remote_code(folder)
    try:
        validate_card((folder / "README.md").read_text(encoding="utf-8"))
    except CardError as error:
        raise HubPushError(str(error)) from error
    secrets = [secret.encode() for secret in _token_values(token)]
    for name in files:
        if secrets and _file_contains(folder / name, secrets):
            raise HubPushError(f"{name} contains the Hub token; refusing to upload it")
    return files


def _file_contains(path: Path, needles: list[bytes], chunk_size: int = 1 << 22) -> bool:
    """Whether any of `needles` occurs in the file (streamed: weights files can be many GB)."""
    overlap = max(len(n) for n in needles) - 1
    tail = b""
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_size):
            window = tail + chunk
            if any(n in window for n in needles):
                return True
            tail = window[-overlap:] if overlap else b""
    return False


# --------------------------------------------------------------------------------------------------
# Building the folder

#: Load-time options that transformers 5 saves into tokenizer_config.json; they describe the machine
#: that saved the tokenizer (or carry a credential), not the tokenizer, so they are not published.
TOKENIZER_LOAD_OPTIONS = ("is_local", "local_files_only", "cache_dir", "token", "use_auth_token", "_commit_hash", "force_download", "proxies")


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
) -> PreparedFolder:
    """Write into the empty folder `out` exactly what `push` uploads for `model_dir`, checked."""
    from transformers import AutoTokenizer, GenerationConfig
    from transformers.dynamic_module_utils import custom_object_save

    from ..configuration_gpn import GPNConfig
    from ..modeling_gpn import GPNForCausalLM, GPNModel

    model_dir, out = Path(model_dir), Path(out)
    if not model_dir.is_dir():
        raise HubPushError(f"{model_dir} is not a folder")
    pickles = _pickle_files(model_dir, recursive=False)
    if pickles:
        raise HubPushError(
            f"{model_dir} holds pickle files ({', '.join(pickles)}); pickles can run code when loaded, so gpn push "
            "publishes safetensors only. Move or delete them (the safetensors weights are what gets uploaded)."
        )
    config, raw_config = load_folder_config(model_dir)
    weights = weight_files(model_dir)
    n_params = check_weights(weights, config)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        raise HubPushError(f"{out} is not empty; give a new or empty folder")

    for path in weights:
        shutil.copyfile(path, out / path.name)
    if (model_dir / "model.safetensors.index.json").is_file():
        shutil.copyfile(model_dir / "model.safetensors.index.json", out / "model.safetensors.index.json")

    # The remote code: what save_pretrained ships, from the installed package (relative imports followed).
    for cls in (GPNConfig, GPNForCausalLM):
        custom_object_save(cls, out)
    raw_config = dict(raw_config)
    auto_map = dict(raw_config.get("auto_map") or {})
    auto_map.update(
        {
            "AutoConfig": f"{GPNConfig.__module__.rsplit('.', 1)[-1]}.{GPNConfig.__name__}",
            "AutoModel": f"{GPNModel.__module__.rsplit('.', 1)[-1]}.{GPNModel.__name__}",
            "AutoModelForCausalLM": f"{GPNForCausalLM.__module__.rsplit('.', 1)[-1]}.{GPNForCausalLM.__name__}",
        }
    )
    raw_config["auto_map"] = auto_map
    (out / "config.json").write_text(json.dumps(raw_config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    check_remote_code(out)
    load_folder_config(out)

    if (model_dir / "generation_config.json").is_file():
        shutil.copyfile(model_dir / "generation_config.json", out / "generation_config.json")
    else:
        GenerationConfig.from_model_config(config).save_pretrained(out)
    try:
        GenerationConfig.from_pretrained(out)
    except Exception as error:  # noqa: BLE001
        raise HubPushError(f"generation_config.json does not load: {error}") from error

    if tokenizer:
        try:
            AutoTokenizer.from_pretrained(tokenizer).save_pretrained(out)
        except Exception as error:  # noqa: BLE001
            raise HubPushError(f"cannot load the tokenizer {tokenizer!r}: {error}") from error
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
        raise HubPushError(f"the tokenizer has {len(loaded_tokenizer):,} tokens but the model's vocabulary is {config.vocab_size:,}")
    tokenizer_name = tokenizer if tokenizer and not Path(tokenizer).exists() else None
    tokenizer_name = tokenizer_name or f"{type(loaded_tokenizer).__name__}, {len(loaded_tokenizer):,} tokens"

    evaluation = read_eval_results(model_dir / EVAL_RESULTS_FILE) if (model_dir / EVAL_RESULTS_FILE).is_file() else None
    training = read_training_info(model_dir)
    card = build_card(
        config, repo_id, n_params=n_params, evaluation=evaluation, training=training, license=license,
        datasets=list(datasets), tags=list(tags), model_name=model_name, tokenizer_name=tokenizer_name,
    )  # fmt: skip
    metadata = validate_card(card)
    (out / "README.md").write_text(card, encoding="utf-8")
    files = check_prepared_folder(out, token=token)
    return PreparedFolder(path=out, files=files, n_params=n_params, card_metadata=metadata)


# --------------------------------------------------------------------------------------------------
# The network boundary


def upload(
    folder: str | Path,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    commit_message: str | None = None,
    token: str | None = None,
    create_pr: bool = False,
):
    """`create_repo` (+ `create_branch` for a new revision) and `upload_folder`; returns the CommitInfo."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    repo_url = api.create_repo(repo_id=repo_id, repo_type="model", private=True if private else None, exist_ok=True)
    repo_id = getattr(repo_url, "repo_id", None) or repo_id
    if revision and revision != "main" and not create_pr:
        api.create_branch(repo_id=repo_id, repo_type="model", branch=revision, exist_ok=True)
    return api.upload_folder(
        repo_id=repo_id,
        repo_type="model",
        folder_path=str(folder),
        revision=revision,
        commit_message=commit_message,
        create_pr=create_pr,
    )


def push_folder(
    folder: str | Path,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    commit_message: str | None = None,
    token: str | None = None,
    create_pr: bool = False,
    dry_run: str | Path | None = None,
    license: str = "mit",
    datasets: list[str] | tuple[str, ...] = (),
    tags: list[str] | tuple[str, ...] = (),
    model_name: str | None = None,
    tokenizer: str | None = None,
    quiet: bool = False,
):
    """Publish the model folder `folder` to `repo_id` (or, with `dry_run=OUT`, only write OUT).

    Returns the `PreparedFolder` for a dry run, else huggingface_hub's `CommitInfo`. Raises
    `HubPushError` for a folder it refuses (see the module docstring). `token` defaults to the
    `HF_TOKEN` environment variable or the cached `hf auth login`.
    """
    if not repo_id or repo_id.count("/") > 1 or repo_id.startswith("/") or repo_id.endswith("/"):
        raise HubPushError(f"{repo_id!r} is not a Hub repo id (expected 'name' or 'owner/name')")
    commit_message = commit_message or f"Upload {model_name or repo_id.split('/')[-1]} (GPN) with gpn push"
    options = dict(license=license, datasets=datasets, tags=tags, model_name=model_name, tokenizer=tokenizer, token=token)
    say = (lambda *a: None) if quiet else print
    if dry_run is not None:
        out = Path(dry_run)
        if out.resolve() == Path(folder).resolve():
            raise HubPushError("--dry-run OUT must be a new folder, not MODEL_DIR")
        created = not out.exists()
        try:
            prepared = prepare_folder(folder, out, repo_id, **options)
        except BaseException:
            if created and out.exists():
                shutil.rmtree(out)
            raise
        size = sum((out / f).stat().st_size for f in prepared.files)
        say(f"Dry run: wrote {len(prepared.files)} files ({size / 2**20:.1f} MiB) to {out}; nothing was uploaded.")
        for name in prepared.files:
            say(f"  {name}")
        say(f"Would upload to {repo_id}" + (f" (revision {revision})" if revision else "") + f": {commit_message!r}")
        return prepared
    with tempfile.TemporaryDirectory(prefix="gpn-push-") as tmp:
        prepared = prepare_folder(folder, Path(tmp) / "upload", repo_id, **options)
        say(f"Uploading {len(prepared.files)} files ({prepared.n_params:,} parameters) to {repo_id} ...")
        info = upload(
            prepared.path, repo_id, private=private, revision=revision, commit_message=commit_message,
            token=token, create_pr=create_pr,
        )  # fmt: skip
    pr_url = getattr(info, "pr_url", None)
    say(f"Uploaded to https://huggingface.co/{repo_id}" + (f" (revision {revision})" if revision else ""))
    if pr_url:
        say(f"Pull request: {pr_url}")
    return info


# --------------------------------------------------------------------------------------------------
# CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", help="a GPN folder (save_pretrained / gpn train / gpn convert output) with safetensors weights")
    parser.add_argument("repo_id", help="the Hub repo, 'owner/name' (created if missing)")
    parser.add_argument("--private", action="store_true", help="create the repo as private (an existing repo keeps its visibility)")
    parser.add_argument("--revision", default=None, help="branch to push to, created if missing (None: main)")
    parser.add_argument("--commit-message", default=None, help="commit message (None: 'Upload NAME (GPN) with gpn push')")
    parser.add_argument(
        "--token", default=None,
        help="Hub token with write access (None: $HF_TOKEN or the cached `hf auth login`; prefer those: a token "
        "on the command line lands in shell history). Never printed or written.",
    )  # fmt: skip
    parser.add_argument("--create-pr", action="store_true", help="open a pull request instead of committing directly")
    parser.add_argument("--dry-run", metavar="OUT", default=None, help="write the exact folder that would be uploaded to OUT and stop (no network)")
    parser.add_argument("--license", default="mit", help="license in the card's metadata (a Hub license id)")
    parser.add_argument("--dataset", action="append", default=[], help="Hub dataset id the model was trained on (repeatable; added to those the training log names)")
    parser.add_argument("--tag", action="append", default=[], help="extra tag for the card's metadata (repeatable)")
    parser.add_argument("--model-name", default=None, help="name in the card's title and model-index (None: the repo name)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer name or path to publish when MODEL_DIR has none")


def run(args: argparse.Namespace) -> int:
    try:
        push_folder(
            args.model_dir, args.repo_id, private=args.private, revision=args.revision,
            commit_message=args.commit_message, token=args.token, create_pr=args.create_pr, dry_run=args.dry_run,
            license=args.license, datasets=args.dataset, tags=args.tag, model_name=args.model_name,
            tokenizer=args.tokenizer,
        )  # fmt: skip
    except (HubPushError, CardError) as error:
        print(f"gpn push: {error}", file=sys.stderr)
        return 1
    except Exception as error:  # noqa: BLE001 - network / auth errors from huggingface_hub
        from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

        if isinstance(error, (HfHubHTTPError, OfflineModeIsEnabled, OSError)):
            message = str(error)
            for secret in _token_values(args.token):
                message = message.replace(secret, "***")
            print(f"gpn push: the Hub refused or could not be reached: {message}", file=sys.stderr)
            return 1
        raise
    return 0


__all__ = ["HubPushError", "PreparedFolder", "check_prepared_folder", "prepare_folder", "push_folder", "upload"]
