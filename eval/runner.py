"""Run the GPN task set on one causal LM folder or Hub repo and collect the numbers (see `cli.py`).

lm-eval tasks (`lambada_openai`, `wikitext`, `gpn_rolling_ppl`) run through `lm_eval.simple_evaluate`
with an `HFLM` around the already-loaded model; the paper's protocols (`lambada_paper`,
`fineweb_paper`) are computed by `protocols.py` from the same model. Data come from the Hub by
default (lm-eval's own dataset names); `data_dir` / `task_data` point a task at local files instead.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import json
import math
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from unittest import mock

import torch

from modeling_gpn.cli.loading import (
    adapter_base,
    check_model_path,
    end_of_text_disagreement,
    load_causal_lm,
    load_model_tokenizer,
    tokenizer_source,
)

from . import protocols

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from modeling_gpn.data import CorpusSpec, TokenStream

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
BASELINES_PATH = Path(__file__).resolve().parent / "baselines.json"

LAMBADA_HUB = ("EleutherAI/lambada_openai", "default", "test")
FINEWEB_HUB = ("HuggingFaceFW/fineweb-edu", "sample-10BT", "train")
WIKITEXT_HUB = ("EleutherAI/wikitext_document_level", "wikitext-2-raw-v1", "test")

# task -> (kind, one-line protocol). "lm_eval": run by lm-eval; "direct": computed in protocols.py.
TASKS: dict[str, tuple[str, str]] = {
    "lambada_openai": (
        "lm_eval",
        "lm-eval lambada_openai: acc = greedy match of every subword of the last word; "
        "perplexity = exp(mean over examples of the summed NLL of the last word)",
    ),
    "lambada_paper": (
        "direct",
        "paper LAMBADA (GPN.md): acc = top-1 match of the first subword of the last word; "
        "ppl = exp(NLL of the last word's subwords pooled over all examples / their number); "
        "tokens as lm-eval's lambada_openai",
    ),
    "fineweb_paper": (
        "direct",
        "paper FineWeb: documents -> one token stream -> non-overlapping {window}-token windows, each from "
        "the zero state; ppl = exp(total NLL / tokens scored); first position of a window: {first}",
    ),
    "wikitext": (
        "lm_eval",
        "lm-eval wikitext: loglikelihood_rolling per document (windows of max_length, one token of "
        "overlap, first token predicted from the prefix token, the tokenizer's own BOS not added); "
        "word/byte perplexity, bits per byte",
    ),
    "gpn_rolling_ppl": (
        "lm_eval",
        "lm-eval loglikelihood_rolling over any text dataset (windows of max_length, first token predicted "
        "from the prefix token, the tokenizer's own BOS not added); word/byte perplexity, bits per byte",
    ),
}
DEFAULT_TASKS = ("lambada_openai", "lambada_paper", "fineweb_paper", "wikitext")

FIRST_POSITION_TEXT = {
    protocols.PAPER_FIRST_POSITION: "predicted from the empty state (paper's convention, all positions scored)",
    protocols.SKIP_FIRST_POSITION: "not scored (window - 1 tokens per window)",
}


DEFAULT_FINEWEB_MAX_DOCUMENTS = 2000  # fineweb_paper reads at most this many documents unless told otherwise


@dataclass
class EvalSettings:
    """Everything `evaluate` needs besides the model; mirrors `gpn eval`'s options."""

    tasks: list[str] = field(default_factory=lambda: list(DEFAULT_TASKS))
    data_dir: str | None = None
    task_data: dict[str, str] = field(default_factory=dict)
    text_field: str = "text"
    batch_size: int = 8
    limit: int | None = None
    device: str = "cpu"
    dtype: str = "float32"
    max_length: int | None = None
    fineweb_window: int = 2048
    fineweb_max_windows: int | None = None
    fineweb_max_documents: int | None = DEFAULT_FINEWEB_MAX_DOCUMENTS
    fineweb_separator: str = "eos"
    fineweb_held_out_fraction: float | None = None
    fineweb_max_tokens: int | None = None
    fineweb_skip_documents: int = 0
    cache_dir: str | None = None  # gpn train's token cache, read for held-out windows (default: as gpn train's)
    fineweb_token_cache: str | None = None  # one gpn train token stream (its folder): fineweb_paper scores its windows
    first_position: str | None = None  # None: the paper's where the model allows, else "skip"
    bootstrap_iters: int = 0
    trust_remote_code: bool = False  # a Hub repo's own code runs only when asked for (--trust-remote-code)
    tokenizer: str | None = None
    progress: bool = True


# --------------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------------


def load_model(
    path: str,
    device: str = "cpu",
    dtype: str = "float32",
    trust_remote_code: bool = False,
    tokenizer: str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load any causal LM (a GPN folder, a Hub repo, a LlamaForCausalLM folder, a PEFT adapter folder: its base with
    the adapter merged) and its tokenizer (`tokenizer`, else the model's: an adapter folder's own, else its base's)."""
    import modeling_gpn  # noqa: F401  (registers the GPN Auto classes for folders without remote code)
    from modeling_gpn.cli.quantization import DTYPES, QUANTIZERS, quantize_for, weight_dtype

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    path = check_model_path(path)
    # (int8, int4: the bfloat16 model quantized on its device as gpn generate's --dtype quantizes it, one function;
    # the head stays bfloat16, the scores float32 as ever)
    model = load_causal_lm(path, dtype=weight_dtype(dtype), trust_remote_code=trust_remote_code)
    model = model.to(device).eval()
    if dtype in QUANTIZERS:
        model = quantize_for(model, dtype, path)
    tok = load_model_tokenizer(path, tokenizer, trust_remote_code=trust_remote_code, require_eos=False)
    disagreement = end_of_text_disagreement(path, tok)
    if disagreement is not None:  # (a warning: the scores read no EOS id of the config, generated text would)
        print(f"gpn eval: warning: {disagreement}", file=sys.stderr)
    return model, tok


def adapter_summary(model_path: str, tokenizer: str | None) -> dict[str, str] | None:
    """What `eval_results.json` says of a PEFT adapter folder evaluated (None for a whole model): the base it was
    merged into and the tokenizer read."""
    base = adapter_base(model_path)
    if base is None:
        return None
    return {"base_model": base, "merged": True, "tokenizer": tokenizer or tokenizer_source(model_path)}


def count_parameters(model: PreTrainedModel) -> int:
    """Number of distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())


def default_max_length(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> int:
    """The training window for a GPN (`config.max_length_hint`), else what lm-eval would resolve."""
    hint = getattr(model.config, "max_length_hint", None)
    if hint:
        return int(hint)
    from lm_eval.models.utils import resolve_max_length

    return int(resolve_max_length(model.config, tokenizer, default=2048))


# --------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------


def local_default(task: str, data_dir: str) -> str | None:
    """The file of `task` inside a `--data-dir` laid out like the project's shared data folder."""
    root = Path(data_dir)
    candidates = {
        "lambada_openai": ["lambada/lambada_test.jsonl", "lambada_test.jsonl"],
        "lambada_paper": ["lambada/lambada_test.jsonl", "lambada_test.jsonl"],
        "fineweb_paper": ["fineweb-edu/*.jsonl", "fineweb-edu/*.parquet", "fineweb*.jsonl"],
        "wikitext": ["wikitext-2-raw/wiki.test.raw", "wiki.test.raw"],
    }.get(task, [])
    for pattern in candidates:
        matches = sorted(glob.glob(str(root / pattern)))
        if matches:
            return matches[0] if len(matches) == 1 else ",".join(matches)
    return None


def data_source(task: str, settings: EvalSettings) -> str | None:
    """A local path (comma-separated for several files), a Hub dataset name, or None for the default."""
    if task in settings.task_data:
        return settings.task_data[task]
    if settings.data_dir:
        found = local_default(task, settings.data_dir)
        if found is None:
            raise FileNotFoundError(
                f"--data-dir {settings.data_dir} has no data for task {task!r}; pass --task-data {task}=PATH"
            )
        return found
    return None


def _is_local(source: str) -> bool:
    return all(Path(part).exists() for part in source.split(","))


# The files `--task-data` reads (`_builder`): a source ending so names a file, never a Hub dataset.
DATA_FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".txt", ".raw")


def check_task_data(task: str, source: str) -> None:
    """Refuse, naming it, a `--task-data` source that names local files that are not there: a list of several, a
    path (`names_a_local_path`) or a data file's name. It would otherwise be taken for a Hub dataset's name and
    fail only when its task's turn came, after the model loaded and the tasks before it ran, their figures lost.
    (A glob that matches, `gpn train`'s reader's way of naming a corpus, passes.)"""
    from modeling_gpn.data.tokenizer import names_a_local_path

    parts = source.split(",")
    for part in parts:
        names_a_file = len(parts) > 1 or names_a_local_path(part) or Path(part).suffix.lower() in DATA_FILE_SUFFIXES
        if names_a_file and not Path(part).exists() and not glob.glob(part):
            raise FileNotFoundError(f"--task-data {task}={source}: {part} does not exist")


def _builder(paths: list[str]) -> str:
    suffix = Path(paths[0]).suffix.lower()
    return {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}.get(suffix, "text")


def load_texts(
    source: str | None,
    hub_default: tuple[str, str, str],
    field_name: str,
    limit: int | None = None,
    streaming: bool = False,
    skip: int = 0,
) -> list[str]:
    """Texts of one column from local files or a Hub dataset (`name[:config[:split]]`), after skipping
    the first `skip` rows, at most `limit` of them."""
    import datasets

    if source is not None and _is_local(source):
        paths = source.split(",")
        builder = _builder(paths)
        kwargs = {"sample_by": "document"} if builder == "text" else {}
        data = datasets.load_dataset(builder, data_files={"test": paths}, split="test", **kwargs)
        column = field_name if builder != "text" else "text"
    else:
        name, config, split = hub_default
        if source is not None:
            parts = source.split(":")
            name, config, split = (
                parts[0],
                (parts[1] if len(parts) > 1 else None),
                (parts[2] if len(parts) > 2 else split),
            )
        data = datasets.load_dataset(name, config, split=split, streaming=streaming)
        column = field_name
    texts = []
    for index, row in enumerate(data):
        if limit is not None and len(texts) >= limit:  # before the row is taken: a limit of 0 takes none
            break
        if index < skip:
            continue
        if column not in row:
            raise KeyError(f"dataset {source or hub_default[0]} has no column {column!r}; columns: {sorted(row)}")
        texts.append(row[column])
    return texts


WIKITEXT_HEADING = re.compile(r"^ = [^=].* = $")


def wikitext_pages(raw_text: str) -> list[str]:
    """Split a raw WikiText file into articles at its top-level ` = Title = ` headings (the
    `EleutherAI/wikitext_document_level` layout: one `page` per article, lines joined with newlines)."""
    pages, current = [], []
    for line in raw_text.splitlines(keepends=True):
        if WIKITEXT_HEADING.match(line.rstrip("\n")) and current:
            pages.append("".join(current))
            current = []
        if line.strip():
            current.append(line)
    if current:
        pages.append("".join(current))
    return pages


# --------------------------------------------------------------------------------------------------
# lm-eval tasks
# --------------------------------------------------------------------------------------------------


LM_EVAL_TASK_FILES = {
    "lambada_openai": ("lm_eval", "lambada/lambada_openai.yaml"),
    "wikitext": ("lm_eval", "wikitext/wikitext.yaml"),
    "gpn_rolling_ppl": ("gpn", "gpn_rolling_ppl.yaml"),
}


def lm_eval_task_yaml(task: str) -> Path:
    """The YAML file defining an lm-eval task of the GPN set (lm-eval's own file for its tasks)."""
    owner, relative = LM_EVAL_TASK_FILES[task]
    if owner == "gpn":
        return TASKS_DIR / relative
    import lm_eval

    return Path(lm_eval.__file__).resolve().parent / "tasks" / relative


def _lm_eval_task_config(task: str, source: str | None, settings: EvalSettings, workdir: Path) -> dict:
    """The task's inline config: the YAML as lm-eval ships it, its dataset pointed at `source`.

    Inline configs spare lm-eval from indexing its thousands of task files on every run.
    """
    from lm_eval.tasks._yaml_loader import load_yaml

    config = load_yaml(lm_eval_task_yaml(task))
    config.pop("tag", None)
    if task == "gpn_rolling_ppl" and source is not None:
        # local .txt/.raw files are read by datasets' text builder, whose one column is `text` (as load_texts reads them)
        plain_text = _is_local(source) and _builder(source.split(",")) == "text"
        column = "text" if plain_text else settings.text_field
        config["doc_to_target"] = "{{" + column + "}}"
        config["doc_to_decontamination_query"] = "{{" + column + "}}"
    if source is None:
        return config
    if not _is_local(source):  # another Hub dataset: name[:config[:split]]
        parts = source.split(":")
        config["dataset_path"], config["dataset_name"] = parts[0], (parts[1] if len(parts) > 1 else None)
        if len(parts) > 2:
            config["test_split"] = parts[2]
        config.pop("dataset_kwargs", None)
        return config
    paths = source.split(",")
    if task == "wikitext" and _builder(paths) == "text":
        pages = []
        for path in paths:
            pages += wikitext_pages(Path(path).read_text(encoding="utf-8"))
        local = workdir / "wikitext_pages.jsonl"
        local.write_text("".join(json.dumps({"page": page}) + "\n" for page in pages), encoding="utf-8")
        paths = [str(local)]
    builder = _builder(paths)
    _check_column(task, paths, builder, settings.text_field)
    config["dataset_path"], config["dataset_name"] = builder, None
    config["dataset_kwargs"] = {
        "data_files": {"test": paths},
        **({"sample_by": "document"} if builder == "text" else {}),
    }
    config["test_split"] = "test"
    for split in ("training_split", "validation_split", "fewshot_split"):
        config.pop(split, None)
    return config


# The column each lm-eval task's YAML reads (gpn_rolling_ppl reads --text-field).
LM_EVAL_TASK_COLUMNS = {"lambada_openai": "text", "wikitext": "page"}


def _check_column(task: str, paths: list[str], builder: str, text_field: str) -> None:
    """Refuse local data without the column the task reads, naming it and the columns there are: lm-eval would
    fail only inside its prompt templates, with a bare `page` or a jinja traceback."""
    if builder == "text":  # read by datasets' text builder: the column is always `text`
        return
    import datasets

    column = LM_EVAL_TASK_COLUMNS.get(task, text_field)
    columns = datasets.load_dataset(builder, data_files={"test": paths}, split="test").column_names
    if column not in columns:
        option = "--text-field" if task == "gpn_rolling_ppl" else f"task {task}"
        raise ValueError(f"{','.join(paths)} has no column {column!r} ({option} reads it); columns: {sorted(columns)}")


def _flatten_lm_eval_metrics(results: dict[str, Any]) -> dict[str, float]:
    metrics = {}
    for key, value in results.items():
        if key == "alias" or not isinstance(value, (int, float)) or "," not in key:
            continue
        name, _filter = key.split(",", 1)
        metrics[name] = float(value)
    return metrics


# lm-eval's rolling perplexity holds a batch's full logits and their log-softmax, (batch, max_length,
# vocab) float32 twice: at 2048 x 32k that is 0.5 GB per row. Rows per batch are capped so the two stay
# under this budget (the figures do not depend on the batch size; only the speed does).
ROLLING_LOGITS_BUDGET_BYTES = 1 << 30


def rolling_batch_size(batch_size: int, max_length: int, vocab_size: int) -> int:
    """`batch_size`, lowered so that a rolling window batch's logits and log-softmax fit the budget."""
    per_row = 2 * 4 * max_length * vocab_size
    return max(1, min(batch_size, ROLLING_LOGITS_BUDGET_BYTES // per_row))


# The lm-eval modules whose progress bars a run shows (building a task's requests, tokenizing, scoring them).
# lm-eval's simple_evaluate offers no switch for them (its `disable_tqdm` reaches only some of them, and not
# from simple_evaluate), so --quiet hands these modules a `tqdm` that is switched off, for the run only.
LM_EVAL_PROGRESS_MODULES = ("lm_eval.api.task", "lm_eval.api.model", "lm_eval.models.huggingface")


def _switched_off(tqdm: type) -> Callable[..., Any]:
    """`tqdm`, switched off whatever its caller asks (lm-eval passes its own `disable=`)."""

    def silent(*args: Any, **kwargs: Any) -> Any:
        return tqdm(*args, **{**kwargs, "disable": True})

    return silent


@contextlib.contextmanager
def progress_bars_off() -> Iterator[None]:
    """No progress bars while inside: transformers' (loading weights), datasets' (reading data) and lm-eval's;
    each library's own setting is restored on the way out."""
    import importlib

    import datasets
    from tqdm import tqdm
    from transformers.utils import logging as transformers_logging

    transformers_on = transformers_logging.is_progress_bar_enabled()
    datasets_off = datasets.are_progress_bars_disabled()
    transformers_logging.disable_progress_bar()
    datasets.disable_progress_bars()
    with contextlib.ExitStack() as patches:
        for name in LM_EVAL_PROGRESS_MODULES:
            module = importlib.import_module(name)
            if getattr(module, "tqdm", None) is tqdm:
                patches.enter_context(mock.patch.object(module, "tqdm", _switched_off(tqdm)))
        try:
            yield
        finally:
            if transformers_on:
                transformers_logging.enable_progress_bar()
            if not datasets_off:
                datasets.enable_progress_bars()


@functools.cache
def float32_logits_hflm() -> type:
    """lm-eval's `HFLM`, its model's logits upcast to float32 before lm-eval scores them.

    HFLM takes the log-softmax of the logits, gathers the continuation's log-probabilities and sums them in the
    logits' dtype: with `--dtype bfloat16` every log-likelihood would come out rounded to bfloat16 (8 bits of
    mantissa: a LAMBADA example's -18.23 read as -18.25, a window's summed log-likelihood kept to 3 digits), while
    the paper's protocols score the same logits in float64. Upcast, lm-eval's figures are those of the model's
    own logits, whatever the weights' dtype; a float32 model's logits are returned as they are.
    """
    from lm_eval.models.huggingface import HFLM

    class Float32LogitsHFLM(HFLM):
        def _model_call(
            self, inps: torch.Tensor, attn_mask: torch.Tensor | None = None, labels: torch.Tensor | None = None
        ) -> torch.Tensor:
            return super()._model_call(inps, attn_mask, labels).float()

    return Float32LogitsHFLM


def quiet_git_commit_hash() -> str | None:
    """The current folder's git commit, as lm-eval records it in its results, or None outside a checkout.

    lm-eval's own lookup runs `git describe` with git's stderr left on the terminal: outside a git checkout
    (the usual place to run `gpn eval` or `gpn study`) every task printed "fatal: not a git repository"."""
    try:
        described = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True, check=False)
    except OSError:  # (no git on the machine)
        return None
    return (described.stdout.strip() or None) if described.returncode == 0 else None


def run_lm_eval(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: str,
    source: str | None,
    settings: EvalSettings,
    max_length: int,
) -> tuple[dict, dict]:
    """Run one lm-eval task; returns (metrics, the raw simple_evaluate output)."""
    import lm_eval
    import lm_eval.evaluator
    from lm_eval.tasks import TaskManager

    task_manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False)
    # Rolling perplexity: lm-eval already puts the prefix token (BOS) in front of every document; with the
    # tokenizer's own BOS added as well, the BOS would be scored as the document's first token.
    rolling = task in ("wikitext", "gpn_rolling_ppl")
    batch_size = (
        rolling_batch_size(settings.batch_size, max_length, model.config.vocab_size) if rolling else settings.batch_size
    )
    lm = float32_logits_hflm()(
        pretrained=model,
        tokenizer=tokenizer,
        batch_size=batch_size,
        max_length=max_length,
        device=settings.device,
        add_bos_token=False if rolling else None,
    )
    with (
        tempfile.TemporaryDirectory() as workdir,
        mock.patch.object(lm_eval.evaluator, "get_git_commit_hash", quiet_git_commit_hash),
    ):
        spec = _lm_eval_task_config(task, source, settings, Path(workdir))
        output = lm_eval.simple_evaluate(
            model=lm,
            tasks=[spec],
            limit=settings.limit,
            bootstrap_iters=settings.bootstrap_iters,
            task_manager=task_manager,
            log_samples=True,
            verbosity="WARNING",
        )
    return _flatten_lm_eval_metrics(output["results"][task]), output


# --------------------------------------------------------------------------------------------------
# The whole run
# --------------------------------------------------------------------------------------------------


def check_tasks(tasks: list[str]) -> None:
    """Refuse an unknown task, or none at all (`--tasks ,` loaded the model, scored nothing and wrote a report of
    dashes, exit status 0)."""
    if not tasks:
        raise ValueError(f"--tasks names no task; the GPN task set is {sorted(TASKS)}")
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"unknown task(s) {unknown}; the GPN task set is {sorted(TASKS)}")


# setting -> the least value it takes (None, where allowed, means "not given" and is not checked)
SETTING_MINIMUMS = {
    "batch_size": 1,
    "limit": 1,
    "max_length": 1,
    "fineweb_window": 2,
    "fineweb_max_windows": 1,
    "fineweb_max_documents": 1,
    "fineweb_max_tokens": 1,
    "fineweb_skip_documents": 0,
    "bootstrap_iters": 0,
}


def check_settings(settings: EvalSettings) -> None:
    """Refuse, naming the option, a setting out of range, before any model or data is loaded (a `--limit 0`
    would otherwise score one example and report it as a result)."""
    check_tasks(settings.tasks)
    for task, source in settings.task_data.items():
        check_task_data(task, source)
    for name, least in SETTING_MINIMUMS.items():
        value = getattr(settings, name)
        if value is not None and value < least:
            raise ValueError(f"--{name.replace('_', '-')} must be at least {least}, got {value}")
    fraction = settings.fineweb_held_out_fraction
    if fraction is not None and not 0 < fraction <= 1:
        raise ValueError(f"--fineweb-held-out-fraction must be in (0, 1], got {fraction}")
    if settings.fineweb_token_cache is not None and "fineweb_paper" in settings.tasks:
        ignored = {  # (each cuts or joins the documents: a token cache holds them cut and joined already)
            "--fineweb-max-documents": settings.fineweb_max_documents is not None,
            "--fineweb-skip-documents": bool(settings.fineweb_skip_documents),
            "--fineweb-max-tokens": settings.fineweb_max_tokens is not None,
            "--fineweb-separator": settings.fineweb_separator != "eos",
            "--task-data fineweb_paper=...": "fineweb_paper" in settings.task_data,
        }
        if any(ignored.values()):
            named = ", ".join(name for name, given in ignored.items() if given)
            raise ValueError(
                f"--fineweb-token-cache reads a token stream gpn train cut already: {named} would be ignored beside it"
            )
        if not (Path(settings.fineweb_token_cache) / "meta.json").is_file():
            raise ValueError(
                f"--fineweb-token-cache {settings.fineweb_token_cache} is not a gpn train token cache (no meta.json "
                "there): give the folder its data line printed ('tokenized at ...' or 'cached at ...')"
            )
    if fraction is not None and settings.fineweb_separator != "eos":
        raise ValueError(
            "--fineweb-held-out-fraction scores gpn train's held-out windows, of a stream that joins documents with "
            f"EOS: --fineweb-separator {settings.fineweb_separator} would shift every window"
        )
    if (
        fraction is not None
        and "fineweb_paper" in settings.tasks
        and settings.fineweb_token_cache is None
        and settings.fineweb_max_documents is None
        and settings.fineweb_max_tokens is None
        and training_corpus(data_source("fineweb_paper", settings), settings) is None
    ):
        raise ValueError(
            "the held-out windows of a Hub corpus are the end of what gpn train read from it: pass "
            "--fineweb-max-tokens with the token count its data line printed (else the whole dataset is streamed), or "
            "--fineweb-token-cache with the folder it printed (the run's own tokens, read offline)"
        )


def load_baselines(path: str | Path = BASELINES_PATH) -> dict:
    """The paper's Table 1 (`baselines.json`): citation, metric protocols and rows."""
    return json.loads(Path(path).read_text(encoding="utf-8"))


def evaluate(
    model_path: str,
    settings: EvalSettings,
    model: PreTrainedModel = None,
    tokenizer: PreTrainedTokenizerBase = None,
    finished: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run `settings.tasks` on one model; returns the `eval_results.json` dictionary (schema in `cli`).
    Without `settings.progress`, no library shows a progress bar meanwhile. `finished`, where given, is that
    dictionary as it fills, each task's figures in it once the task is done (without `comparison` until all are):
    when a later task fails, its caller still holds those of the tasks before it."""
    check_settings(settings)
    with contextlib.nullcontext() if settings.progress else progress_bars_off():
        return _evaluate(model_path, settings, model, tokenizer, {} if finished is None else finished)


def _evaluate(
    model_path: str,
    settings: EvalSettings,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    results: dict[str, Any],
) -> dict[str, Any]:
    import lm_eval

    from modeling_gpn.cli.quantization import quantization_of
    from modeling_gpn.data import build_token_stream

    if model is None:
        model, tokenizer = load_model(
            model_path, settings.device, settings.dtype, settings.trust_remote_code, settings.tokenizer
        )
    max_length = settings.max_length or default_max_length(model, tokenizer)
    first_position = settings.first_position or (
        protocols.PAPER_FIRST_POSITION if protocols.has_empty_state(model) else protocols.SKIP_FIRST_POSITION
    )
    baselines = load_baselines()
    results |= {
        "schema_version": 1,
        "model": model_path,
        # (a PEFT adapter folder is scored merged into its base: which base, and whose tokenizer went with it)
        "adapter": adapter_summary(model_path, settings.tokenizer),
        "model_type": getattr(model.config, "model_type", type(model).__name__),
        "architecture": type(model).__name__,
        "n_params": count_parameters(model),
        "layers": getattr(model.config, "num_predict_layers", getattr(model.config, "num_hidden_layers", None)),
        "state_dim": getattr(model.config, "hidden_size", None),
        "max_length": max_length,
        "dtype": settings.dtype,
        # (read from the weights: a quantized row is never taken for the float model's, a folder saved quantized
        # included, whatever --dtype said)
        "quantization": quantization_of(model),
        "device": settings.device,
        "batch_size": settings.batch_size,
        "limit": settings.limit,
        "tasks": {},
        "protocols": {},
        "data": {},
        "wall_time_s": {},
        "lm_eval_version": lm_eval.__version__ if hasattr(lm_eval, "__version__") else _package_version("lm_eval"),
        "published_baselines": baselines["rows"],
        "baselines_citation": baselines["citation"],
        "baseline_metrics": baselines["metrics"],
    }
    for task in settings.tasks:
        kind, protocol = TASKS[task]
        reads_a_token_cache = task == "fineweb_paper" and settings.fineweb_token_cache is not None
        source = settings.fineweb_token_cache if reads_a_token_cache else data_source(task, settings)
        start = time.perf_counter()
        if task in ("lambada_paper",):
            texts = load_texts(source, LAMBADA_HUB, "text", limit=settings.limit)
            examples = [protocols.encode_lambada(tokenizer, text) for text in texts]
            scores = protocols.score_lambada(
                model, examples, settings.batch_size, max_length, settings.device, settings.progress
            )
            metrics = protocols.lambada_metrics(scores)
            # (a GPN has no context limit; max_length is its training window, which can be shorter than a context)
            metrics["truncated_examples"] = protocols.truncated_lambada_examples(examples, max_length)
            protocol += f"; contexts left-truncated to max_length={max_length} as lm-eval's"
        elif task == "fineweb_paper":
            streaming = source is None or not _is_local(source)
            token_cache = None
            if reads_a_token_cache:  # the stream a gpn train run read, whatever its corpus (a Hub one too)
                stream = read_token_cache(settings.fineweb_token_cache, tokenizer)
                used, token_cache = stream.meta["documents"], str(stream.folder)
                source = f"{token_cache} (gpn train's tokens of {corpus_named(stream.meta.get('corpus'))})"
            elif settings.fineweb_held_out_fraction is not None and (corpus := training_corpus(source, settings)):
                # gpn train's own token stream of the corpus, from its cache (tokenized into it as gpn train
                # would, where missing): the held-out windows are the ones it held out, read without holding
                # the corpus's tokens in memory
                stream = build_token_stream(
                    corpus, tokenizer, settings.cache_dir, settings.fineweb_max_tokens, settings.progress
                )
                used, token_cache = stream.meta["documents"], str(stream.folder)
            else:
                texts = load_texts(
                    source,
                    FINEWEB_HUB,
                    settings.text_field,
                    limit=settings.fineweb_max_documents,
                    streaming=streaming,
                    skip=settings.fineweb_skip_documents,
                )
                max_tokens = settings.fineweb_max_tokens
                if settings.fineweb_max_windows and settings.fineweb_held_out_fraction is None:
                    budget = settings.fineweb_max_windows * settings.fineweb_window
                    max_tokens = budget if max_tokens is None else min(max_tokens, budget)
                stream, used = protocols.token_stream(
                    tokenizer, texts, settings.fineweb_separator, max_tokens=max_tokens
                )
            metrics = protocols.windowed_perplexity(
                model,
                stream,
                settings.fineweb_window,
                settings.batch_size,
                settings.device,
                settings.fineweb_max_windows,
                first_position,
                settings.fineweb_held_out_fraction,
                settings.progress,
            )
            metrics["documents"] = used
            if token_cache:
                results["token_cache"] = {task: token_cache}
            protocol = protocol.format(window=settings.fineweb_window, first=FIRST_POSITION_TEXT[first_position])
            protocol += f"; documents tokenized without special tokens, separator {settings.fineweb_separator!r}"
            if settings.fineweb_skip_documents:
                protocol += f"; first {settings.fineweb_skip_documents} documents skipped"
            if settings.fineweb_held_out_fraction is not None:
                protocol += (
                    f"; only the last {settings.fineweb_held_out_fraction:g} of the windows (gpn train's held-out split), "
                    f"from window {metrics['first_window']}"
                )
        else:
            metrics, _ = run_lm_eval(model, tokenizer, task, source, settings, max_length)
            protocol += f"; max_length={max_length}"
        results["wall_time_s"][task] = round(time.perf_counter() - start, 3)
        results["tasks"][task] = metrics
        results["protocols"][task] = protocol
        results["data"][task] = source or _hub_name(task)
    results["comparison"] = compare_with_baselines(results, baselines)
    return results


def read_token_cache(folder: str, tokenizer: PreTrainedTokenizerBase) -> TokenStream:
    """The token stream of a `gpn train` run in `folder` (its token cache: `meta.json` and shards), checked to be
    the tokens of `tokenizer` (else its ids would be read as other tokens): `ValueError` naming the folder."""
    from modeling_gpn.data import TokenStream
    from modeling_gpn.data.tokenizer import tokenizer_fingerprint

    stream = TokenStream(Path(folder))  # (check_settings saw it is a token cache)
    if stream.meta.get("tokenizer") != tokenizer_fingerprint(tokenizer):
        raise ValueError(
            f"--fineweb-token-cache {folder} holds the tokens of another tokenizer than the model's: its ids would be "
            "read as other tokens"
        )
    return stream


def corpus_named(fingerprint: dict | None) -> str:
    """The corpus a token cache's `meta.json` fingerprints, as a reader names it: its file (and how many more), the
    built-in corpus's name, or the Hub dataset's `hf://` name."""
    fingerprint = fingerprint if isinstance(fingerprint, dict) else {}
    kind = fingerprint.get("kind")
    if kind == "local" and fingerprint.get("files"):
        files = fingerprint["files"]
        return str(files[0][0]) + (f" and {len(files) - 1} more files" if len(files) > 1 else "")
    if kind == "hub":
        return f"hf://{fingerprint.get('name')} ({fingerprint.get('config')}, {fingerprint.get('split')})"
    return str(fingerprint.get("name") or "an unnamed corpus")


def training_corpus(source: str | None, settings: EvalSettings) -> CorpusSpec | None:
    """The local corpus `source` as `gpn train --dataset SOURCE` reads it (a file, a folder, a glob), for scoring
    its held-out windows; None for a Hub dataset or a comma-separated list (which gpn train does not take)."""
    from modeling_gpn.data import CorpusSpec

    if source is None or "," in source:
        return None
    corpus = CorpusSpec(source=source, text_field=settings.text_field)
    return corpus if corpus.kind == "local" else None


def _hub_name(task: str) -> str:
    name, config, split = {
        "lambada_openai": LAMBADA_HUB,
        "lambada_paper": LAMBADA_HUB,
        "fineweb_paper": FINEWEB_HUB,
        "wikitext": WIKITEXT_HUB,
        "gpn_rolling_ppl": WIKITEXT_HUB,
    }[task]
    return f"hf://{name} ({config}, {split})"


def _package_version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def compare_with_baselines(results: dict[str, Any], baselines: dict) -> dict[str, Any]:
    """Measured values of Table 1's columns and their ratio (measured / published) to every row."""
    measured = {}
    for column, spec in baselines["metrics"].items():
        value = results["tasks"].get(spec["task"], {}).get(spec["metric"])
        if value is not None:
            measured[column] = value
    ratios = {}
    for row in baselines["rows"]:
        ratios[row["model"]] = {
            column: (value / row[column] if row.get(column) else math.nan) for column, value in measured.items()
        }
    return {"measured": measured, "ratio_to_published": ratios}
