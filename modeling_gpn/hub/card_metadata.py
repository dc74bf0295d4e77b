"""The card's YAML metadata as the Hub reads it: the model-index built from the evaluation results
(`eval_results_for_model_index`) and the check that the card parses the way the Hub parses it
(`validate_card`)."""

from __future__ import annotations

import math
import re
from typing import Any

from .card_inputs import EvalInfo, is_number
from .errors import CardError

#: Known evaluation tasks -> (Hub dataset id, dataset name, dataset config, split) for the model-index.
KNOWN_DATASETS: list[tuple[str, tuple[str, str, str | None, str | None]]] = [
    ("lambada", ("EleutherAI/lambada_openai", "LAMBADA (OpenAI)", "default", "test")),
    ("fineweb", ("HuggingFaceFW/fineweb-edu", "FineWeb-Edu", "sample-10BT", "train")),
    ("wikitext", ("EleutherAI/wikitext_document_level", "WikiText-2", "wikitext-2-raw-v1", "test")),
    ("shakespeare", ("karpathy/tiny_shakespeare", "Tiny Shakespeare", None, "test")),
]

#: Counts that evaluation tools report beside metrics (shown in the table, not in the model-index).
COUNT_METRICS = frozenset(
    {
        "examples",
        "target_tokens",
        "tokens_scored",
        "windows",
        "window",
        "stream_tokens",
        "dropped_tail_tokens",
        "documents",
        "first_window",  # where fineweb_paper's held-out windows start: an index, not a measurement
    }
)

#: Tasks whose examples `gpn eval --limit N` does not cut (fineweb_paper's windows have options of their own).
UNLIMITED_TASKS = frozenset({"fineweb_paper"})


def _limited(
    spec: tuple[str, str, str | None, str | None], limit: int | None
) -> tuple[str, str, str | None, str | None]:
    """The dataset of a task scored on its first `limit` examples, as the model-index states it: the split in
    datasets' slice notation (`test[:40]`), so the Hub does not show a partial score as the whole split's."""
    if limit is None:
        return spec
    dataset_type, dataset_name, dataset_config, split = spec
    return (dataset_type, dataset_name, dataset_config, f"{split or 'test'}[:{limit}]")


def _dataset_for(task: str, source: str | None = None) -> tuple[str, str, str | None, str | None]:
    """(Hub id, name, config, split) of a task: from `gpn eval`'s "hf://NAME (CONFIG, SPLIT)", else by name."""
    match = re.fullmatch(r"hf://([\w.-]+/[\w.-]+)(?:\s*\(([^,()]*)(?:,\s*([^()]*))?\))?", (source or "").strip())
    if match:
        name, config, split = match.group(1), match.group(2), match.group(3)
        return (name, name.split("/")[-1], (config or "").strip() or None, (split or "").strip() or None)
    for needle, spec in KNOWN_DATASETS:
        if needle in task.lower():
            return spec
    return (task, task, None, None)


def eval_results_for_model_index(evaluation: EvalInfo) -> list:
    """`huggingface_hub.EvalResult`s for every metric of every task (counts such as `examples` left out).

    The Hub groups results by (task type, dataset, config, split), so two tasks on one dataset (lm-eval's
    `lambada_openai` and the paper's `lambada_paper`) share an entry: their metric types are then
    prefixed with the task (`lambada_paper_acc`) so none is ambiguous, and the entry's task name lists
    both. Every metric's display name is "TASK METRIC". A run with `--limit N` states its split as `test[:N]`.
    """
    from huggingface_hub import EvalResult

    specs = {
        task: _limited(
            _dataset_for(task, evaluation.data.get(task)), None if task in UNLIMITED_TASKS else evaluation.limit
        )
        for task in evaluation.tasks
    }
    sharing: dict[tuple, list[str]] = {}
    for task, spec in specs.items():
        sharing.setdefault(spec, []).append(task)
    results = []
    for task, metrics in evaluation.tasks.items():
        dataset_type, dataset_name, dataset_config, split = specs[task]
        group = sharing[specs[task]]
        for metric, value in metrics.items():
            if metric in COUNT_METRICS:
                continue
            try:
                result = EvalResult(
                    task_type="text-generation",
                    task_name=", ".join(group),
                    dataset_type=dataset_type,
                    dataset_name=dataset_name,
                    dataset_config=dataset_config,
                    dataset_split=split,
                    metric_type=metric if len(group) == 1 else f"{task}_{metric}",
                    metric_name=f"{task} {metric}",
                    metric_value=value,
                )
            except (TypeError, ValueError) as error:
                raise CardError(f"task {task!r}, metric {metric!r} cannot enter the model-index: {error}") from error
            results.append(result)
    return results


def validate_card(text: str) -> dict[str, Any]:
    """Parse the card as the Hub does; return its metadata or raise `CardError` naming the problem.

    Checks: the YAML block parses with `huggingface_hub.ModelCard`; `library_name` and `pipeline_tag`
    are set; a `model-index` converts with `huggingface_hub.repocard_data.model_index_to_eval_results`
    and every metric value is a finite number; `metadata_eval_result` rebuilds the same model-index.
    """
    from huggingface_hub import ModelCard, metadata_eval_result
    from huggingface_hub.repocard_data import model_index_to_eval_results

    try:
        card = ModelCard(text, ignore_metadata_errors=False)
    except Exception as error:  # noqa: BLE001 - any parse failure is the same refusal
        raise CardError(f"the model card's metadata does not parse: {error}") from error
    metadata = card.data.to_dict()
    for key, want in (("library_name", "transformers"), ("pipeline_tag", "text-generation")):
        if metadata.get(key) != want:
            raise CardError(f"the model card's metadata must have {key}: {want}, got {metadata.get(key)!r}")
    model_index = metadata.get("model-index")
    if model_index is not None:
        try:
            name, results = model_index_to_eval_results(model_index)
        except Exception as error:  # noqa: BLE001
            raise CardError(f"the model card's model-index is invalid: {error!r}") from error
        for result in results:
            if not is_number(result.metric_value) or not math.isfinite(result.metric_value):
                raise CardError(
                    f"the model card's model-index has a non-finite or non-numeric value for "
                    f"{result.task_name or result.dataset_name}/{result.metric_type}: {result.metric_value!r}"
                )
        for result in results:  # the single-result helper the Hub documents must accept each one
            try:
                metadata_eval_result(
                    model_pretty_name=name,
                    task_pretty_name=result.task_name or result.task_type,
                    task_id=result.task_type,
                    metrics_pretty_name=result.metric_name or result.metric_type,
                    metrics_id=result.metric_type,
                    metrics_value=result.metric_value,
                    dataset_pretty_name=result.dataset_name,
                    dataset_id=result.dataset_type,
                )
            except Exception as error:  # noqa: BLE001
                raise CardError(f"the model card's eval result {result} is invalid: {error!r}") from error
    return metadata
