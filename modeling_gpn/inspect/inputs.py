"""What `gpn inspect` reads: a GPN (refused with a clear error for other models) and token windows cut from
local files or a Hub dataset (streamed), each window from the zero state as in training."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..data.corpus import (
    DEFAULT_DATASET,
    DEFAULT_DATASET_CONFIG,
    LOCAL_SUFFIXES,
    CorpusSpec,
    row_text,
    text_file_pieces,
)
from ..data.tokenizer import PieceEncoder

LOCAL_EXTENSIONS = LOCAL_SUFFIXES  # (the kinds of local file gpn train reads, and the `datasets` builder of each)


def load_model(
    name: str, device: str = "cpu", dtype: str = "float32", trust_remote_code: bool = False
) -> PreTrainedModel:
    """Load a GPN causal LM from a local folder or the Hub, in eval mode. Clear error for other models.

    A local PEFT adapter folder (adapter_config.json, no config.json) loads as its base model with the adapter
    attached, not merged (`cli.loading.load_causal_lm`, the other commands' rule): every part of the analysis calls
    the adapted modules, and the report counts the adapter's parameters apart.
    """
    import modeling_gpn  # noqa: F401  (registers GPN with the Auto classes)
    from modeling_gpn.cli.loading import check_model_path, load_causal_lm

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in dtypes:  # (before anything loads; a bare KeyError named only the value)
        raise ValueError(f"dtype must be one of {sorted(dtypes)}, got {dtype!r}")
    name = check_model_path(name)
    torch_dtype = dtypes[dtype]
    model = load_causal_lm(name, merge_adapter=False, dtype=torch_dtype, trust_remote_code=trust_remote_code)
    if getattr(model.config, "model_type", None) != "gpn" or not hasattr(getattr(model, "model", None), "token_inputs"):
        raise ValueError(
            f"gpn inspect analyses GPN models; {name!r} is a {type(model).__name__} "
            f"(model_type={getattr(model.config, 'model_type', None)!r})"
        )
    return model.to(device).eval()


def trained_with_document_resets(name: str) -> bool:
    """Whether the model folder `name` is the model of a `gpn train --reset-at-document-start` run (its state reset
    at each document's start in training): its run folder's `train_config.json` says so (gpn train writes it
    beside RUN/model; the folder itself is looked in too, for a model copied with it). A Hub id, or a folder
    without the file, tells nothing: False."""
    import json

    folder = Path(name).expanduser()
    for candidate in (folder / "train_config.json", folder.parent / "train_config.json"):
        try:
            config = json.loads(candidate.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        return isinstance(config, dict) and config.get("reset_at_document_start") is True
    return False


def _local_files(data: str) -> list[Path] | None:
    """The local files `data` names (a file, a folder, or a glob), or None if it names no local data.

    Found as `gpn train --data` finds them (`data.CorpusSpec.local_files`): the same kinds of file, files and
    folders named `.*` or `__*` (Jupyter's `.ipynb_checkpoints/` copies, `__pycache__/`) left out, each
    checked to be readable and non-empty; so a folder inspected is exactly the corpus a run trained on."""
    spec = CorpusSpec(data)
    return spec.local_files() if spec.kind == "local" else None


def iter_documents(
    data: str,
    config: str | None = None,
    split: str = "train",
    text_column: str = "text",
    safe_cut: Callable[[str, str], bool] | None = None,
) -> Iterator[tuple[str, bool, bool]]:
    """Yield (text, continues the previous piece, ends its document) from local files or a Hub dataset (streamed).

    A plain-text file is one document, read in pieces as `gpn train` reads it (`data.corpus.text_file_pieces`:
    cut at line ends where `safe_cut(line before, line after)` agrees, so that `PieceEncoder` gives the tokens of
    the whole document); a jsonl / json / parquet / csv row is one document (its `text_column`).
    """
    files = _local_files(data)
    if files is not None:
        given = [
            option for option, value in (("--data-config", config), ("--split", split)) if value not in (None, "train")
        ]
        if given:  # (they choose a Hub dataset's rows: local files are read whole, as gpn train reads them)
            verb = "applies" if len(given) == 1 else "apply"
            raise ValueError(f"{' and '.join(given)} {verb} to a Hub dataset; {data} is local data, read whole")
        for file in files:
            kind = LOCAL_EXTENSIONS[file.suffix.lower()]
            if kind == "text":
                yield from text_file_pieces(file, safe_cut)  # (a DataError, a ValueError, names the file)
            else:
                from datasets import load_dataset

                rows = load_dataset(kind, data_files=str(file), split="train", streaming=True)
                yield from _rows_text(rows, text_column, str(file))
        return
    looks_local = (
        data.startswith((".", "/", "~")) or Path(data).suffix.lower() in LOCAL_EXTENSIONS or data.count("/") > 1
    )
    if looks_local:
        raise ValueError(f"data path {data!r} does not exist (a Hub dataset id looks like 'owner/name')")
    from datasets import load_dataset

    if config is None and data == DEFAULT_DATASET:
        config = DEFAULT_DATASET_CONFIG
    rows = load_dataset(data, config, split=split, streaming=True)
    yield from _rows_text(rows, text_column, data)


def _rows_text(rows: Iterable[dict], text_column: str, source: str) -> Iterator[tuple[str, bool, bool]]:
    """Yield (text, False, True) for each non-blank row: a row is a whole document, as `iter_documents` says."""
    for number, row in enumerate(rows, start=1):
        # a row without text refused by its number, as gpn train refuses it (skipped, the corpus inspected would
        # not be the one trained on)
        text = row_text(row, number, source, text_column, option="--text-column")
        if text.strip():  # a blank row is no document, as in gpn train's and gpn eval's token streams
            yield text, False, True


def load_token_windows(
    tokenizer: PreTrainedTokenizerBase,
    data: str,
    seq_len: int,
    max_tokens: int,
    config: str | None = None,
    split: str = "train",
    text_column: str = "text",
    progress: bool = True,
) -> torch.Tensor:
    """Tokenize documents (no special tokens; EOS after each document when the tokenizer has one),
    concatenate them and cut the first `max_tokens // seq_len` non-overlapping windows (n, seq_len)."""
    from tqdm.auto import tqdm

    if seq_len < 2:
        raise ValueError(f"--seq-len must be at least 2, got {seq_len}")
    num_windows = max_tokens // seq_len
    if num_windows < 1:
        raise ValueError(f"--tokens ({max_tokens}) must be at least one window of --seq-len ({seq_len}) tokens")
    needed = num_windows * seq_len
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    encoder = PieceEncoder(tokenizer)  # (a long text file's pieces tokenized as the whole file, as in training)
    with tqdm(total=needed, desc="tokenizing", unit="tok", disable=not progress) as bar:
        for text, continues, ends_document in iter_documents(data, config, split, text_column, encoder.safe_cut):
            new = encoder.encode([(text, continues)])[0]
            if new is None:  # safe_cut checked this cut: the tokenizer changed its mind
                raise ValueError(f"cannot tokenize {data!r} in pieces with this tokenizer")
            if ends_document and eos is not None:
                new = new + [eos]
            bar.update(min(len(new), needed - len(ids)))
            ids.extend(new)
            if len(ids) >= needed:
                break
    if len(ids) < seq_len:
        raise ValueError(f"{data!r} gave only {len(ids)} tokens, fewer than one window of {seq_len}")
    num_windows = min(num_windows, len(ids) // seq_len)
    return torch.tensor(ids[: num_windows * seq_len], dtype=torch.long).view(num_windows, seq_len)
