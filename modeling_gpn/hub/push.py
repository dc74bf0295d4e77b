"""The network boundary: `push_folder` builds the checked upload folder (`folder.prepare_folder`) and hands it
to `huggingface_hub` (`upload`: create the repo and branch, upload the folder), or with `dry_run` only
writes it. The token goes to `huggingface_hub.HfApi` only: never printed, never written."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from ..atomic_files import held
from .checks import WEIGHTS_INDEX
from .errors import HubPushError
from .folder import TOKENIZER_FILES, prepare_folder

if TYPE_CHECKING:
    from huggingface_hub import CommitInfo

    from .folder import PreparedFolder

#: The repo's files an upload replaces as a set (huggingface_hub's `delete_patterns`, matched against the repo's top
#: level by fnmatch; a file uploaded again is kept): `upload_folder` only adds, so a push over an earlier one would
#: leave the earlier weights or tokenizer files beside the new ones, and transformers loads a stale model.safetensors
#: before the shards an index names, or a stale chat_template.jinja / added_tokens.json with the new tokenizer.
#: An earlier push of pickled weights (`pytorch_model.bin`, or its shards and index: transformers 4's
#: `safe_serialization=False`) goes too: `from_pretrained(..., use_safetensors=False)` would load it in place of the
#: new weights. Other files of the repo (a user's own, `.gitattributes`) are left alone.
REPLACED_FILES = (
    "model*.safetensors",
    WEIGHTS_INDEX,
    "pytorch_model*.bin",
    "pytorch_model.bin.index.json",
    *TOKENIZER_FILES,
)


def upload(
    folder: str | Path,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    commit_message: str | None = None,
    token: str | None = None,
    create_pr: bool = False,
) -> CommitInfo:
    """`create_repo` (+ `create_branch` for a new revision) and `upload_folder`, which removes the repo's earlier
    weights and tokenizer files that this upload does not replace (`REPLACED_FILES`); returns the CommitInfo."""
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
        delete_patterns=list(REPLACED_FILES),
    )


def check_repo_id(repo_id: str) -> None:
    """Refuse what the Hub would refuse as a repo id (huggingface_hub's own rule), a dry run included: a dry run
    that accepts "bad repo id" promises an upload that cannot happen."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        if not repo_id or repo_id.endswith("/"):
            raise HFValidationError("it is empty or ends with '/'")
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise HubPushError(f"{repo_id!r} is not a Hub repo id (expected 'name' or 'owner/name'): {error}") from None


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
    eval_results: str | Path | None = None,
    base_model: str | None = None,
) -> PreparedFolder | CommitInfo:
    """Publish the model folder `folder` to `repo_id` (or, with `dry_run=OUT`, only write OUT).

    Returns the `PreparedFolder` for a dry run, else huggingface_hub's `CommitInfo`. Raises
    `HubPushError` for a folder it refuses (see the module docstring). `token` defaults to the
    `HF_TOKEN` environment variable or the cached `hf auth login`.
    """
    check_repo_id(repo_id)
    commit_message = commit_message or f"Upload {model_name or repo_id.split('/')[-1]} (GPN) with gpn push"
    options = dict(
        license=license,
        datasets=datasets,
        tags=tags,
        model_name=model_name,
        tokenizer=tokenizer,
        token=token,
        eval_results=eval_results,
        base_model=base_model,
    )
    say = (lambda *a: None) if quiet else print
    if dry_run is not None:
        out = Path(dry_run)
        if out.resolve() == Path(folder).resolve():
            raise HubPushError("--dry-run OUT must be a new folder, not MODEL_DIR")
        created = not out.exists()
        # OUT is held (an flock) from the check that it is empty to the end of the write: two dry runs into one new
        # folder both found it empty and wrote into it, each file the last writer's, in silence. A second one
        # meanwhile is refused, naming the first.
        with contextlib.ExitStack() as holding:
            try:
                out.mkdir(parents=True, exist_ok=True)
                holding.enter_context(
                    held(out, "that writes a prepared upload into it (gpn push --dry-run)", "wait for it to end")
                )
            except OSError as error:  # (a folder that cannot be created, or one another process holds)
                raise HubPushError(f"--dry-run {out}: {error.strerror or error}") from error
            was_empty = not any(out.iterdir())  # (a folder with files is refused, untouched)
            try:
                prepared = prepare_folder(folder, out, repo_id, **options)
            except BaseException:
                # nothing half-written is left: a refused folder's weights and code would read as a dry run's output
                # and make the next try refuse OUT as not empty
                if created and out.exists():
                    shutil.rmtree(out)
                elif was_empty:
                    for path in out.iterdir():
                        if path.is_dir() and not path.is_symlink():
                            shutil.rmtree(path)
                        else:
                            path.unlink()
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
            prepared.path,
            repo_id,
            private=private,
            revision=revision,
            commit_message=commit_message,
            token=token,
            create_pr=create_pr,
        )
    pr_url = getattr(info, "pr_url", None)
    say(f"Uploaded to https://huggingface.co/{repo_id}" + (f" (revision {revision})" if revision else ""))
    if pr_url:
        say(f"Pull request: {pr_url}")
    return info
