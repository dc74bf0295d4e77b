"""`gpn study`: the paper's central comparison at a scale that runs here.

One study file (`configuration/studies/NAME.json`) names a shared training recipe (data, tokenizer,
windows, steps, optimiser, seed), the models to compare (GPN without memory, 1-layer GPN+M, 2-layer
GPN+M, a Transformer++ = `LlamaForCausalLM`, a Gated DeltaNet = Qwen3-Next with every layer
gated-delta linear attention and a dense MLP) and the evaluation settings. Every model goes through
the same `gpn train` pipeline (same tokenizer, token stream, budget, recipe and seed) and the same
`gpn eval` tasks; the study then writes one comparison report:

    OUTPUT/study_report.md     the table in the paper's shape, ratios beside the paper's, a reading
    OUTPUT/study_results.json  every number
    OUTPUT/training_curves.png loss against tokens for every model
    OUTPUT/<model>/            each model's run directory (model/, log.jsonl, eval/)

Parameter counts are reported with and without the token embedding (the study matches models on
non-embedding parameters, since at this scale the embedding would dominate a total-count match).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

STUDY_DIR_NAME = "studies"

# Published at 130M parameters (paper Table 1): FineWeb PPL, LAMBADA acc, LAMBADA PPL (paper variant).
PAPER_TABLE = {
    "transformer++": {"fineweb_ppl": 16.05, "lambada_acc": 0.223, "lambada_ppl": 18.99},
    "gated-deltanet": {"fineweb_ppl": 15.34, "lambada_acc": 0.208, "lambada_ppl": 17.23},
    "gpn-m-1l": {"fineweb_ppl": 18.06, "lambada_acc": 0.146, "lambada_ppl": 33.45},
    "gpn-m-2l": {"fineweb_ppl": 16.95, "lambada_acc": 0.160, "lambada_ppl": 27.39},
    "gpn": {"fineweb_ppl": 23.51, "lambada_acc": 0.015, "lambada_ppl": 263.6},
}
BASELINES = ("transformer++", "gated-deltanet")


def study_path(name_or_path: str) -> Path:
    """A study file by name (configuration/studies/NAME.json) or path."""
    path = Path(name_or_path)
    if path.suffix == ".json" and path.exists():
        return path
    from modeling_gpn.configuration import PRESET_DIR

    path = PRESET_DIR / STUDY_DIR_NAME / f"{name_or_path}.json"
    if not path.exists():
        available = sorted(p.stem for p in (PRESET_DIR / STUDY_DIR_NAME).glob("*.json"))
        raise ValueError(f"No study named {name_or_path!r}; available: {', '.join(available)}")
    return path


def load_study(name_or_path: str) -> dict[str, Any]:
    study = json.loads(study_path(name_or_path).read_text())
    for key in ("recipe", "models", "eval"):
        if key not in study:
            raise ValueError(f"Study {name_or_path} lacks the {key!r} section")
    return study


# --------------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------------


def parameter_counts(model) -> dict[str, int]:
    """Total parameters and those outside the token embedding (tied output matrices counted once)."""
    from modeling_gpn.evaluation.runner import count_parameters

    total = count_parameters(model)
    return {"total": total, "non_embedding": total - model.get_input_embeddings().weight.numel()}


def describe(model) -> dict[str, Any]:
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
        cells = config.num_hidden_layers * config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim
    return {"layers": config.num_hidden_layers, "state_dim": config.hidden_size, "memory_cells": cells}


# --------------------------------------------------------------------------------------------------
# The study
# --------------------------------------------------------------------------------------------------


def train_one(name: str, model_config: dict, study: dict, output: Path, show_progress: bool) -> dict[str, Any]:
    """Train one model of the study through `gpn train`'s pipeline; returns its training summary."""
    from modeling_gpn import train as trainer

    config = trainer.resolve_config(argparse.Namespace())  # the built-in defaults
    config.update(study["recipe"])
    config.update(model=model_config, model_type=None, output_dir=str(output / name))
    trainer._validate(config)
    start = time.perf_counter()
    summary = trainer.train(config, show_progress=show_progress)
    summary["wall_time_s"] = time.perf_counter() - start
    log = [json.loads(line) for line in (output / name / "log.jsonl").read_text().splitlines() if line.strip()]
    summary["curve"] = [(row["tokens"], row["loss"]) for row in log if "tokens" in row and "loss" in row and "lr" in row]
    speeds = [row["tokens_per_s"] for row in log if "tokens_per_s" in row]
    summary["tokens_per_s"] = sorted(speeds)[len(speeds) // 2] if speeds else None
    summary["tokens_trained"] = config["steps"] * config["batch_size"] * config["seq_len"]
    summary["first_loss"] = summary["curve"][0][1] if summary["curve"] else None
    summary["last_loss"] = summary["curve"][-1][1] if summary["curve"] else None
    return summary


def evaluate_one(
    name: str, study: dict, output: Path, data_dir: str | None, show_progress: bool, model, tokenizer
) -> dict[str, Any]:
    """Run the study's evaluation tasks on one trained (already loaded) model through `gpn eval`'s pipeline."""
    from modeling_gpn.evaluation.cli import write_outputs
    from modeling_gpn.evaluation.runner import EvalSettings, evaluate

    settings = EvalSettings(**{**study["eval"], "progress": show_progress})
    if data_dir and not settings.data_dir:
        settings.data_dir = data_dir
    held_out = held_out_source(study, output)
    if held_out and "fineweb_paper" in settings.tasks:
        # the paper's FineWeb protocol on the training corpus's own held-out windows
        settings.task_data = {**settings.task_data, "fineweb_paper": held_out}
        settings.fineweb_max_documents = None
    results = evaluate(str(output / name / "model"), settings, model=model, tokenizer=tokenizer)
    write_outputs(results, output / name / "eval")
    return results


def held_out_source(study: dict, output: Path) -> str | None:
    """A local file holding the training corpus, for evaluating on `gpn train`'s held-out windows.

    Hub corpora return None (the evaluation then reads FineWeb-Edu from the Hub)."""
    dataset = study["recipe"].get("dataset")
    if dataset == "shakespeare":
        from modeling_gpn.data import shakespeare_documents

        path = output / "corpus.jsonl"
        if not path.exists():
            with path.open("w") as handle:
                for document in shakespeare_documents():
                    handle.write(json.dumps({"text": document}) + "\n")
        return str(path)
    if dataset and Path(dataset).exists():
        return str(dataset)
    return None


def pick(metrics: dict, *names: str) -> float | None:
    for key in names:
        if key in metrics and metrics[key] is not None:
            return float(metrics[key])
    return None


def table_row(name: str, run: dict) -> dict[str, Any]:
    tasks = run["eval"]["tasks"]
    fineweb, paper, openai = tasks.get("fineweb_paper", {}), tasks.get("lambada_paper", {}), tasks.get("lambada_openai", {})
    return {
        "model": name,
        **run["shape"],
        "params": run["params"]["total"],
        "non_embedding_params": run["params"]["non_embedding"],
        "fineweb_ppl": pick(fineweb, "ppl"),
        "lambada_acc": pick(paper, "acc"),
        "lambada_ppl": pick(paper, "ppl"),
        "lm_eval_lambada_acc": pick(openai, "acc"),
        "lm_eval_lambada_ppl": pick(openai, "perplexity"),
        "train_tokens_per_s": run["train"]["tokens_per_s"],
        "train_wall_s": run["train"]["wall_time_s"],
        "first_loss": run["train"]["first_loss"],
        "last_loss": run["train"]["last_loss"],
        "val_ppl": run["train"]["val_ppl"],
    }


def ratios(rows: dict[str, dict]) -> list[dict[str, Any]]:
    """Each GPN's perplexity as a multiple of each baseline's, beside the paper's published multiple."""
    out = []
    for name, row in rows.items():
        if name in BASELINES:
            continue
        for baseline in BASELINES:
            if baseline not in rows:
                continue
            for metric in ("fineweb_ppl", "lambada_ppl"):
                ours, theirs = row.get(metric), rows[baseline].get(metric)
                published = None
                if name in PAPER_TABLE:
                    published = PAPER_TABLE[name][metric] / PAPER_TABLE[baseline][metric]
                out.append({
                    "model": name, "baseline": baseline, "metric": metric,
                    "measured": ours / theirs if ours and theirs else None, "published": published,
                })  # fmt: skip
    return out


def reading(rows: dict[str, dict], ratio_rows: list[dict]) -> list[str]:
    """A short, mechanical reading of which of the paper's claims hold at this scale."""
    lines = []

    def fineweb(name):
        return rows.get(name, {}).get("fineweb_ppl")

    ranked = sorted((r["fineweb_ppl"], n) for n, r in rows.items() if r.get("fineweb_ppl"))
    if ranked:
        lines.append("Held-out perplexity ranks the models " + " < ".join(f"{n} ({p:.2f})" for p, n in ranked) + ".")
    if fineweb("gpn-m-1l") and fineweb("gpn"):
        holds = fineweb("gpn-m-1l") < fineweb("gpn")
        lines.append(
            f"Memory helps (paper: GPN+M 18.06 vs GPN 23.51): {'holds' if holds else 'does not hold'} here "
            f"({fineweb('gpn-m-1l'):.2f} vs {fineweb('gpn'):.2f})."
        )
    if fineweb("gpn-m-2l") and fineweb("gpn-m-1l"):
        holds = fineweb("gpn-m-2l") < fineweb("gpn-m-1l")
        lines.append(
            f"A second predict layer helps (paper: 16.95 vs 18.06): {'holds' if holds else 'does not hold'} here "
            f"({fineweb('gpn-m-2l'):.2f} vs {fineweb('gpn-m-1l'):.2f})."
        )
    for row in ratio_rows:
        if row["metric"] == "fineweb_ppl" and row["model"] == "gpn-m-1l" and row["measured"] and row["published"]:
            if row["measured"] < 1:
                verdict = "the GPN+M is ahead here, where the paper has it behind"
            elif row["measured"] < row["published"]:
                verdict = "behind, by less than in the paper"
            else:
                verdict = "behind, by more than in the paper"
            lines.append(
                f"GPN+M (1 layer) / {row['baseline']} held-out perplexity: {row['measured']:.3f} here, "
                f"{row['published']:.3f} in the paper: {verdict}."
            )
    accuracies = {name: row.get("lambada_acc") for name, row in rows.items() if row.get("lambada_acc") is not None}
    if accuracies and max(accuracies.values()) < 0.01:
        lines.append(
            "LAMBADA first-subword accuracy is below 1% for every model, so the paper's LAMBADA claims (including "
            "the collapse without memory, 0.015 vs 0.146) cannot be judged at this scale; LAMBADA perplexity "
            "still ranks the models."
        )
    elif "gpn" in accuracies and "gpn-m-1l" in accuracies:
        lines.append(
            f"LAMBADA first-subword accuracy without memory {accuracies['gpn']:.3f} vs with memory "
            f"{accuracies['gpn-m-1l']:.3f} (paper: 0.015 vs 0.146, the collapse without memory)."
        )
    return lines


def fmt(value, pattern="{:.3f}") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    return pattern.format(value)


def render_report(results: dict[str, Any]) -> str:
    rows, recipe = results["rows"], results["recipe"]
    lines = [
        f"# GPN small-scale replication: {results['study']}",
        "",
        f"Every model: same tokenizer ({recipe.get('tokenizer')}), data ({recipe.get('dataset')}), "
        f"{results['tokens_per_model']:,} training tokens ({recipe['steps']} steps x {recipe['batch_size']} windows x "
        f"{recipe['seq_len']} tokens), recipe and seed {recipe.get('seed', 0)}. Wall time of the whole study: "
        f"{results['wall_time_s'] / 60:.1f} min.",
        "",
        "Parameters are matched on the non-embedding count (the token embedding dominates at this scale).",
        "",
        "| model | layers | state dim | memory cells | params (non-emb.) | held-out PPL | LAMBADA acc | LAMBADA PPL "
        "| lm-eval LAMBADA acc | lm-eval LAMBADA PPL | train tok/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        lines.append(
            f"| {name} | {row['layers']} | {row['state_dim']} | {row['memory_cells']:,} | {row['params']:,} "
            f"({row['non_embedding_params']:,}) | {fmt(row['fineweb_ppl'], '{:.2f}')} | {fmt(row['lambada_acc'])} | "
            f"{fmt(row['lambada_ppl'], '{:.2f}')} | {fmt(row['lm_eval_lambada_acc'])} | "
            f"{fmt(row['lm_eval_lambada_ppl'], '{:.1f}')} | {fmt(row['train_tokens_per_s'], '{:,.0f}')} |"
        )
    lines += [
        "",
        f"Held-out PPL: the paper's FineWeb protocol on {results['held_out_data']} (non-overlapping windows, each "
        "from the zero state, every position scored; a GPN's first position from the empty state). LAMBADA acc / PPL: the "
        "paper's variant (first subword of the last word; PPL pooled over the last word's subwords). lm-eval "
        "columns: the standard `lambada_openai` (whole-word greedy match, per-example perplexity).",
        "",
        "## Gaps as ratios (perplexity of the GPN / perplexity of the baseline)",
        "",
        "| model | baseline | metric | measured here | paper (130M) |",
        "|---|---|---|---|---|",
    ]
    for row in results["ratios"]:
        lines.append(
            f"| {row['model']} | {row['baseline']} | {row['metric']} | {fmt(row['measured'])} | {fmt(row['published'])} |"
        )
    lines += ["", "## Training", "", "![loss against tokens](training_curves.png)", ""]
    lines += ["| model | first loss | last loss | held-out PPL | wall time |", "|---|---|---|---|---|"]
    for name, row in rows.items():
        lines.append(
            f"| {name} | {fmt(row['first_loss'])} | {fmt(row['last_loss'])} | {fmt(row['val_ppl'], '{:.2f}')} | "
            f"{row['train_wall_s'] / 60:.1f} min |"
        )
    lines += ["", "## Reading", ""] + [f"- {line}" for line in results["reading"]]
    lines += [
        "",
        "At this scale and budget the numbers test the pipeline and the direction of the paper's claims, not "
        "their size: the paper trains 130M-parameter models on ~2.6B tokens.",
    ]
    return "\n".join(lines) + "\n"


def plot_curves(runs: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, run in runs.items():
        curve = run["train"]["curve"]
        if curve:
            tokens, losses = zip(*curve)
            ax.plot(tokens, losses, label=name, linewidth=1.6)
    ax.set_xlabel("training tokens")
    ax.set_ylabel("training loss (nats/token)")
    ax.set_title("Training curves, same data, tokenizer, recipe and seed")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


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

    study = load_study(study_name)
    study["recipe"].update(overrides or {})
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    names = [name for name in study["models"] if not only or name in only]
    if not names:
        raise ValueError(f"No model selected; the study has {', '.join(study['models'])}")
    start = time.perf_counter()
    runs: dict[str, dict] = {}
    for name in names:
        print(f"== {name}: training", flush=True)
        train_summary = train_one(name, study["models"][name], study, output, show_progress)
        print(f"== {name}: evaluating", flush=True)
        model, tokenizer = load_model(str(output / name / "model"))
        eval_results = evaluate_one(name, study, output, data_dir, show_progress, model, tokenizer)
        runs[name] = {"train": train_summary, "params": parameter_counts(model), "shape": describe(model), "eval": eval_results}
        del model, tokenizer
    rows = {name: table_row(name, run) for name, run in runs.items()}
    ratio_rows = ratios(rows)
    recipe = study["recipe"]
    results = {
        "study": study_name,
        "recipe": recipe,
        "eval": study["eval"],
        "tokens_per_model": recipe["steps"] * recipe["batch_size"] * recipe["seq_len"],
        "wall_time_s": time.perf_counter() - start,
        "rows": rows,
        "ratios": ratio_rows,
        "paper": PAPER_TABLE,
        "held_out_data": (
            f"the held-out windows of the training corpus ({recipe.get('dataset')})"
            if held_out_source(study, output) else "FineWeb-Edu from the Hub"
        ),
        "reading": reading(rows, ratio_rows),
    }
    (output / "study_results.json").write_text(json.dumps(results, indent=2, default=str))
    plot_curves(runs, output / "training_curves.png")
    (output / "study_report.md").write_text(render_report(results))
    return results


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--study", default="cpu-small", help="a study name (configuration/studies/NAME.json) or path")
    parser.add_argument("--output", default="runs/study", help="folder for every run and the comparison report")
    parser.add_argument("--data-dir", default=None, help="local evaluation data laid out like ../shared/data "
                        "(lambada/, fineweb-edu/); default: the study's own eval settings (Hub data)")  # fmt: skip
    parser.add_argument("--only", nargs="+", default=None, help="train and evaluate only these models of the study")
    parser.add_argument("--steps", type=int, default=None, help="override the study's optimizer steps (budget)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    import signal

    from modeling_gpn.train import NonFiniteLossError, StorageError, TrainingStopped

    overrides = {"steps": args.steps} if args.steps else {}
    try:
        results = run_study(args.study, args.output, args.data_dir, args.only, overrides, not args.no_progress)
    except (NonFiniteLossError, StorageError) as error:
        print(f"gpn study: error: {error}", file=sys.stderr)
        return 1
    except TrainingStopped as stop:  # SIGTERM/SIGINT: `gpn train` checkpointed the model it was training
        print(f"gpn study: {stop} (models finished before it are complete in {args.output})", file=sys.stderr)
        return 128 + stop.signum
    except KeyboardInterrupt:  # a second Ctrl-C, or one outside training (evaluation, the report)
        print(f"gpn study: interrupted (Ctrl-C); models finished so far are complete in {args.output}", file=sys.stderr)
        return 128 + signal.SIGINT
    print(render_report(results))
    print(f"Report: {Path(args.output) / 'study_report.md'}")
    return 0
