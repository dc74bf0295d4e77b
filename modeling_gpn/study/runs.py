"""Each model of a study through the same pipelines: trained by `gpn train`'s, evaluated by `gpn eval`'s; then
`run_study` writes the comparison (study_results.json, study_report.md, training_curves.png)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from ..evaluation.runner import EvalSettings

from ..atomic_files import replacing, write_file_atomically
from .comparison import PAPER_TABLE, ratios, reading, table_row
from .definition import EvaluationError, StoppedAfterModel, StudyError, load_study
from .report import plot_curves, render_report

STUDY_RECORD = "study_run.json"  # in each model's folder: what a later run of the study reuses


def run_study(
    study_name: str,
    output: str | Path,
    data_dir: str | None = None,
    only: list[str] | None = None,
    overrides: dict[str, Any] | None = None,
    show_progress: bool = True,
) -> dict[str, Any]:
    """Train and evaluate every model of the study, then write the comparison report. Returns its results."""
    from modeling_gpn.evaluation.runner import load_model
    from modeling_gpn.train import TrainingStopped, latest_checkpoint

    study = load_study(study_name)
    study["recipe"].update(overrides or {})
    unknown = [name for name in only or () if name not in study["models"]]
    if unknown:
        raise StudyError(f"The study has no model named {', '.join(unknown)}; it has {', '.join(study['models'])}")
    names = [name for name in study["models"] if not only or name in only]
    if not names:
        raise StudyError(f"No model selected; the study has {', '.join(study['models'])}")
    output = Path(output)
    check_evaluation_data(study, data_dir)
    records = {}
    for name in names:  # every model's settings, before anything is written (not a traceback models later)
        config = training_config(name, study["models"][name], study, output)
        check_held_out_windows(study, config)
        records[name] = earlier_record(name, config, output)
    check_same_study(study_name, output)
    output.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    runs: dict[str, dict] = {}
    reused: list[str] = []
    # (held_out: records of studies evaluated before the held-out windows were gpn train's own, whose FineWeb
    # figures scored the end of the whole corpus, are evaluated again; max_length: before every model read LAMBADA
    # through the training window, the Gated DeltaNet read it through 32,768 tokens, the others through seq_len)
    evaluation = {"eval": study["eval"], "data_dir": data_dir, "held_out": "gpn train's split", "max_length": "seq_len"}
    for name in names:
        # A study stopped part-way (Ctrl-C, SIGTERM, a crash) continues where it stopped when run again: the
        # models it finished are reused, the one it was training resumes from its checkpoint.
        record = records[name] or {}
        if record.get("evaluation") == evaluation:
            print(f"== {name}: trained and evaluated by an earlier run of this study (reused)", flush=True)
            runs[name] = record["run"]
            reused.append(name)
            continue
        if "train" in record:
            print(f"== {name}: trained by an earlier run of this study (reused)", flush=True)
        else:
            checkpoint = latest_checkpoint(output / name)
            resume = checkpoint is not None
            print(f"== {name}: training" + (" (resumed from its last checkpoint)" if resume else ""), flush=True)
            # the training time before a stop this study saw (Ctrl-C, SIGTERM), counted in the model's wall time
            # (a resumed model's was the time since it resumed alone)
            before = record.get("trained_before_stop_s", 0.0) if resume else 0.0
            # the settings first: a later run continues this training only with the same ones
            record = {"config": record_of(training_config(name, study["models"][name], study, output))}
            record["trained_before_stop_s"] = before
            (output / name).mkdir(exist_ok=True)
            write_record(output / name, record)
            started = time.perf_counter()
            try:
                summary = train_one(name, study["models"][name], study, output, show_progress, resume=resume)
            except TrainingStopped:
                record["trained_before_stop_s"] = before + time.perf_counter() - started
                write_record(output / name, record)
                raise
            summary["wall_time_s"] += before
            if resume:  # (the report says so beside its wall time)
                summary["resumed_at_step"] = int(checkpoint.name.removeprefix("step-"))
            stop_signal = summary.pop("stop_signal", None)
            record["train"] = summary
            write_record(output / name, record)
            if stop_signal:  # (Ctrl-C in its last step: the model is kept, the next run evaluates it)
                raise StoppedAfterModel(stop_signal, name)
        print(f"== {name}: evaluating", flush=True)
        try:  # (gpn eval's one-line errors: the Hub unreachable, a data file without the column a task reads)
            model, tokenizer = load_model(str(output / name / "model"))
            token_cache = record["train"].get("token_cache")  # (None: trained before its summary named it)
            eval_results = evaluate_one(name, study, output, data_dir, show_progress, model, tokenizer, token_cache)
        except (OSError, ValueError, KeyError) as error:
            raise EvaluationError(name, output / name, error) from error
        runs[name] = {
            "train": record["train"],
            "params": parameter_counts(model),
            "shape": describe(model),
            "eval": eval_results,
        }
        del model, tokenizer
        record.update(evaluation=evaluation, run=runs[name])
        write_record(output / name, record)
    # The report covers the whole study, not only this run's models (`--only`): the other models an earlier run
    # of it finished in this folder are in the table, and the ones it lacks are named as left out.
    others = [name for name in study["models"] if name not in names]
    finished, left_out = finished_earlier(others, study, output, evaluation)
    runs.update(finished)
    reused += list(finished)
    runs = {name: runs[name] for name in study["models"] if name in runs}  # (the study's order)
    rows = {name: table_row(name, run) for name, run in runs.items()}
    ratio_rows = ratios(rows)
    recipe = study["recipe"]
    results = {
        "study": study_name,
        "recipe": recipe,
        "eval": study["eval"],
        "tokens_per_model": recipe["steps"] * recipe["batch_size"] * recipe["seq_len"],
        # (each logged loss, the curves' points, is the mean of this many steps: the recipe is every model's)
        "log_interval": training_config(names[0], study["models"][names[0]], study, output)["log_interval"],
        "wall_time_s": time.perf_counter() - start,
        "reused": reused,  # (trained and evaluated by an earlier run: their time is not in wall_time_s)
        "left_out": left_out,  # model -> why it is not in the table
        "rows": rows,
        "ratios": ratio_rows,
        "paper": PAPER_TABLE,
        "held_out_data": held_out_data(study, output, data_dir, [run["eval"] for run in runs.values()]),
        "reading": reading(rows, ratio_rows),
    }
    write_report(results, runs, output)
    return results


def write_report(results: dict[str, Any], runs: dict[str, dict], output: Path) -> None:
    """study_results.json, training_curves.png and study_report.md, each replaced whole or not at all: a study
    stopped (or a disk filled) while writing them leaves the previous run's files whole."""
    write_file_atomically(output / "study_results.json", json.dumps(results, indent=2, default=str))
    plot_curves(runs, output / "training_curves.png")
    write_file_atomically(output / "study_report.md", render_report(results))


def training_config(name: str, model_config: dict, study: dict, output: Path) -> dict[str, Any]:
    """`gpn train`'s settings for one model of the study, checked (`StudyError` naming the model and what is
    wrong: a bad recipe or `--steps` is refused before any model trains)."""
    from modeling_gpn.train import resolve_config, validate_config

    config = resolve_config(argparse.Namespace())  # the built-in defaults
    config.update(study["recipe"])
    config.update(model=model_config, model_type=None, output_dir=str(output / name))
    try:
        validate_config(config)
    except ValueError as error:
        raise StudyError(f"model {name}: {error}") from None
    return config


def write_record(folder: Path, record: dict[str, Any]) -> None:
    """A model's record (`STUDY_RECORD`) in its folder, replaced whole."""
    write_file_atomically(folder / STUDY_RECORD, json.dumps(record, indent=1, default=str))


def record_of(config: dict) -> dict[str, Any]:
    """`config` as its record reads it back (JSON: tuples as lists, paths as strings)."""
    return json.loads(json.dumps(config, default=str))


def earlier_record(name: str, config: dict, output: Path) -> dict[str, Any] | None:
    """What an earlier run of the study left of this model (`OUTPUT/<model>/study_run.json`: its training
    settings from the start of its training, its training summary once trained, its figures once evaluated), or
    None. A record of other settings is a `StudyError`: reusing or resuming it would put a model trained
    otherwise in the table."""
    path = output / name / STUDY_RECORD
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise StudyError(f"Cannot read {path}, left by an earlier run of the study: {error}") from None
    earlier, now = record.get("config", {}), record_of(config)
    # A setting the earlier run's gpn train did not have yet (loss_figure) had its built-in value there.
    from modeling_gpn.train.settings import OPTION_BY_KEY

    built_in = {key: option.default for key, option in OPTION_BY_KEY.items()}
    changed = sorted(
        key for key in {*earlier, *now} if earlier.get(key, built_in.get(key)) != now.get(key, built_in.get(key))
    )
    if changed:
        raise StudyError(
            f"{output / name} holds model {name} trained by an earlier run with other settings "
            f"({', '.join(changed)}): choose another --output, or move that folder away"
        )
    return record


def check_same_study(study_name: str, output: Path) -> None:
    """A folder holding another study's report (`study_results.json`) is refused (`StudyError`): this study's would
    replace it, its figures and curves, in silence (studies are told apart by their file's name: `toy` and
    `configuration/studies/toy.json` are one study)."""
    path = output / "study_results.json"
    if not path.exists():
        return
    try:
        earlier = json.loads(path.read_text(encoding="utf-8")).get("study")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as error:
        raise StudyError(f"Cannot read {path}, left by an earlier study: {error}") from None
    if earlier is not None and Path(str(earlier)).stem != Path(study_name).stem:
        raise StudyError(
            f"{output} holds the report of another study ({earlier}): this one's would replace it; choose another "
            "--output"
        )


def finished_earlier(
    names: list[str], study: dict, output: Path, evaluation: dict
) -> tuple[dict[str, dict], dict[str, str]]:
    """The models of `names` that an earlier run of the study trained and evaluated in `output` with the study's
    present settings (name -> its figures), and the others (name -> why each is left out of the report)."""
    finished, left_out = {}, {}
    for name in names:
        try:
            record = earlier_record(name, training_config(name, study["models"][name], study, output), output)
        except StudyError:  # (other settings, or a record that cannot be read: not this study's model)
            left_out[name] = "its folder holds a run with other settings"
            continue
        if record and record.get("evaluation") == evaluation and "run" in record:
            finished[name] = record["run"]
        else:
            left_out[name] = "not finished in this folder"
    return finished, left_out


def train_one(
    name: str, model_config: dict, study: dict, output: Path, show_progress: bool, resume: bool = False
) -> dict[str, Any]:
    """Train one model of the study through `gpn train`'s pipeline (`resume`: from the newest checkpoint in
    its folder); returns its training summary."""
    from modeling_gpn.train import train

    config = training_config(name, model_config, study, output)
    start = time.perf_counter()
    summary = train(config, resume=resume or None, show_progress=show_progress)
    summary["wall_time_s"] = time.perf_counter() - start
    log = [
        json.loads(line)
        for line in (output / name / "log.jsonl").read_text(encoding="utf-8").splitlines()
        if line.strip()
    ]
    summary["curve"] = [
        (row["tokens"], row["loss"]) for row in log if "tokens" in row and "loss" in row and "lr" in row
    ]
    speeds = [row["tokens_per_s"] for row in log if "tokens_per_s" in row]
    summary["tokens_per_s"] = sorted(speeds)[len(speeds) // 2] if speeds else None
    summary["tokens_trained"] = config["steps"] * config["batch_size"] * config["seq_len"]
    summary["first_loss"] = summary["curve"][0][1] if summary["curve"] else None
    summary["last_loss"] = summary["curve"][-1][1] if summary["curve"] else None
    return summary


def evaluate_one(
    name: str,
    study: dict,
    output: Path,
    data_dir: str | None,
    show_progress: bool,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    token_cache: str | None = None,
) -> dict[str, Any]:
    """Run the study's evaluation tasks on one trained (already loaded) model through `gpn eval`'s pipeline; its
    held-out perplexity on the windows its training held out of `token_cache`, the token stream it read."""
    from modeling_gpn.evaluation.cli import write_outputs
    from modeling_gpn.evaluation.runner import evaluate

    settings = study_eval_settings(study, data_dir, progress=show_progress)
    trained = training_config(name, study["models"][name], study, output)
    if settings.max_length is None:
        # every model reads LAMBADA's contexts through the training window (a model's own default differs: a
        # Qwen3-Next config's is 32,768 tokens, so the Gated DeltaNet alone read whole passages)
        settings.max_length = trained["seq_len"]
    held_out = held_out_source(study, output)
    if token_cache is not None and "fineweb_paper" in settings.tasks:
        # the paper's FineWeb protocol on the windows gpn train held out of the very tokens it read, whatever the
        # corpus (a Hub corpus's too: scored from FineWeb-Edu's start, they were documents it trained on)
        settings.fineweb_token_cache, settings.fineweb_max_documents = token_cache, None
    elif held_out and "fineweb_paper" in settings.tasks:  # (a model trained before its summary named its cache)
        # the paper's FineWeb protocol on the training corpus's own held-out windows
        settings.task_data = {**settings.task_data, "fineweb_paper": held_out}
        settings.fineweb_max_documents = None
        # the stream gpn train cut at its max_tokens, read from its token cache: the windows it held out (without
        # these, a recipe's max_tokens was ignored and the last windows of the whole corpus were scored, under a
        # protocol that said "gpn train's held-out split")
        settings.fineweb_max_tokens, settings.cache_dir = trained["max_tokens"], trained["cache_dir"]
    results = evaluate(str(output / name / "model"), settings, model=model, tokenizer=tokenizer)
    write_outputs(results, output / name / "eval")
    return results


def study_eval_settings(study: dict, data_dir: str | None, **overrides: Any) -> EvalSettings:
    """The study's `gpn eval` settings (`overrides` set over them), reading `data_dir` (`gpn study --data-dir`)
    where the study names no data folder of its own: what each model's evaluation reads, and what the checks
    before training and the report say it reads."""
    from modeling_gpn.evaluation.runner import EvalSettings

    settings = EvalSettings(**{**study["eval"], **overrides})
    if data_dir and not settings.data_dir:
        settings.data_dir = data_dir
    return settings


def check_evaluation_data(study: dict, data_dir: str | None) -> None:
    """The study names evaluation tasks gpn eval has, and every one finds its data (a misspelt --data-dir was a
    traceback once the first model had trained); `StudyError` otherwise. `fineweb_paper` needs none: it scores
    each model's own token stream."""
    from modeling_gpn.evaluation.runner import check_tasks, data_source

    settings = study_eval_settings(study, data_dir)
    try:  # (an unknown task, or none, failed each model's evaluation once it had trained)
        check_tasks(settings.tasks)
    except ValueError as error:
        raise StudyError(f"the study's eval.tasks: {error}") from None
    for task in settings.tasks:
        if task == "fineweb_paper":  # (the held-out windows of each model's own token stream)
            continue
        try:
            data_source(task, settings)
        except FileNotFoundError:
            raise StudyError(
                f"--data-dir {settings.data_dir} has no data for the study's task {task!r} (a folder laid out "
                "like ../shared/data: lambada/, fineweb-edu/)"
            ) from None


def check_held_out_windows(study: dict, config: dict[str, Any]) -> None:
    """A study scores the FineWeb protocol on gpn train's held-out windows (`evaluate_one`): its evaluation must cut
    the windows as training did (`fineweb_window` = `seq_len`, `fineweb_held_out_fraction` = `val_fraction`) and,
    where it reads a local corpus again (a model trained before its summary named its token cache), read the
    recipe's `text_field`; else it would score other windows or other text, training ones among them; `StudyError`
    otherwise."""
    from modeling_gpn.evaluation.runner import EvalSettings

    settings = EvalSettings(**study["eval"])
    if "fineweb_paper" not in settings.tasks:
        return
    pairs = [("fineweb_window", "seq_len"), ("fineweb_held_out_fraction", "val_fraction")]
    if trains_on_a_local_corpus(study) and study["recipe"].get("dataset") != "shakespeare":  # (its copy has "text")
        pairs.insert(0, ("text_field", "text_field"))  # (in a jsonl/parquet/csv corpus, another column is another text)
    for eval_key, train_key in pairs:
        if getattr(settings, eval_key) != config[train_key]:
            raise StudyError(
                f"the study's eval.{eval_key} is {getattr(settings, eval_key)}, its recipe's {train_key} "
                f"{config[train_key]}: the held-out windows of the training corpus are scored as gpn train read and "
                f"cut them, so eval.{eval_key} must be {config[train_key]}"
            )


def trains_on_a_local_corpus(study: dict) -> bool:
    """Whether the study's corpus is local (the built-in Shakespeare, or a file), so that its held-out windows are
    evaluated from it (`held_out_source`) and not from the Hub."""
    dataset = study["recipe"].get("dataset")
    return dataset == "shakespeare" or bool(dataset and Path(dataset).exists())


def held_out_data(study: dict, output: Path, data_dir: str | None, evaluations: list[dict] | None = None) -> str:
    """What the held-out perplexity scored, for the report: the training corpus's held-out windows (read from each
    model's token cache where `evaluations` say so), else the `fineweb_paper` data the evaluation read
    (`--data-dir`'s files, the study's own, or FineWeb-Edu from the Hub)."""
    from modeling_gpn.evaluation.runner import data_source

    if evaluations and all("fineweb_paper" in evaluation.get("token_cache", {}) for evaluation in evaluations):
        return f"the held-out windows of the training corpus ({study['recipe'].get('dataset')}), from its token cache"
    if held_out_source(study, output):
        return f"the held-out windows of the training corpus ({study['recipe'].get('dataset')})"
    source = data_source("fineweb_paper", study_eval_settings(study, data_dir))
    return "FineWeb-Edu from the Hub" if source is None else f"the documents of {source}"


def held_out_source(study: dict, output: Path) -> str | None:
    """A local file holding the training corpus, for evaluating on `gpn train`'s held-out windows.

    Hub corpora return None (the evaluation then reads FineWeb-Edu from the Hub)."""
    if not trains_on_a_local_corpus(study):
        return None
    dataset = study["recipe"].get("dataset")
    if dataset == "shakespeare":
        from modeling_gpn.data import shakespeare_documents

        path = output / "corpus.jsonl"
        if not path.exists():  # whole or not at all: a study killed while writing it must not evaluate on a part
            with replacing(path, "w") as handle:
                for document in shakespeare_documents():
                    handle.write(json.dumps({"text": document}) + "\n")
        return str(path)
    return str(dataset)


def parameter_counts(model: PreTrainedModel) -> dict[str, int]:
    """Total parameters and those outside the token embedding (tied output matrices counted once)."""
    from modeling_gpn.evaluation.runner import count_parameters

    total = count_parameters(model)
    return {"total": total, "non_embedding": total - model.get_input_embeddings().weight.numel()}


def describe(model: PreTrainedModel) -> dict[str, Any]:
    """Layers, state width and memory cells, as the paper's table reports them."""
    config = model.config
    if config.model_type == "gpn":
        return {
            "layers": config.num_predict_layers,
            "state_dim": config.hidden_size,
            "memory_cells": config.memory_cells,
        }
    cells = 0
    if config.model_type == "qwen3_next":  # every layer: H_v heads of (dk x dv) gated-delta state
        cells = (
            config.num_hidden_layers
            * config.linear_num_value_heads
            * config.linear_key_head_dim
            * config.linear_value_head_dim
        )
    return {"layers": config.num_hidden_layers, "state_dim": config.hidden_size, "memory_cells": cells}
