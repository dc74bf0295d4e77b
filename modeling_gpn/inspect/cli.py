"""`gpn inspect`'s command line: load the model and the windows, collect the state, build the report, write
report.json, report.md and the figures."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from ..atomic_files import write_file_atomically
from ..cli.arguments import check_no_earlier_output, torch_device, writable_folder
from ..cli.loading import end_of_text_disagreement, load_model_tokenizer
from ..data.tokenizer import check_tokenizer_path
from .figures import FIGURE_NAMES, write_figures
from .inputs import (
    DEFAULT_DATASET,
    DEFAULT_DATASET_CONFIG,
    load_model,
    load_token_windows,
    trained_with_document_resets,
)
from .markdown import RECORDED, report_markdown
from .report import build_report, report_json
from .states import collect


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `gpn inspect`."""
    parser.add_argument(
        "model",
        help="GPN model: a local folder (save_pretrained), a PEFT adapter folder (its base with the adapter attached; "
        "tokenizer: the adapter folder's own, else the base's), or a Hub repo id",
    )
    parser.add_argument(
        "--data",
        "--dataset",  # (as gpn train spells it)
        default=DEFAULT_DATASET,
        dest="data",
        help="Hub dataset id, or local .txt/.text/.jsonl/.json/.parquet/.csv file(s), a folder or a glob, found as gpn train "
        "--dataset finds them (files and folders named .* or __* left out)",
    )
    parser.add_argument(
        "--data-config",
        "--dataset-config",
        default=None,
        dest="data_config",
        help=f"Hub dataset configuration; None means {DEFAULT_DATASET_CONFIG} for {DEFAULT_DATASET}",
    )
    parser.add_argument("--split", default="train", help="Hub dataset split (streamed); local data is read whole")
    parser.add_argument(
        "--text-column",
        "--text-field",
        dest="text_column",
        default="text",
        help="column holding the text in jsonl/parquet/Hub data",
    )
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder or Hub id; None means the model's own")
    parser.add_argument(
        "--output",
        "--output-dir",  # (as gpn train and gpn eval spell it)
        dest="output",
        required=True,
        help="folder for report.json, report.md and the PNG figures; refused if it holds a report already, "
        "unless --overwrite",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a report already in --output once the new one is made (its figures the new run does not draw "
        "are removed; a run that fails leaves the old report as it was)",
    )
    parser.add_argument(
        "--tokens", type=int, default=16384, help="token budget: this many tokens, cut into windows of --seq-len"
    )
    parser.add_argument(
        "--seq-len", type=int, default=None, help="window length; None means the model's max_length_hint, else 2048"
    )
    parser.add_argument("--batch-size", type=int, default=8, help="windows per forward pass")
    parser.add_argument("--top-k", type=int, default=10, help="decoded tokens of s̄ to report")
    parser.add_argument(
        "--max-geometry-states", type=int, default=16384, help="states sampled for the geometry (the paper used 16k)"
    )
    parser.add_argument(
        "--ablation-tokens",
        type=int,
        default=None,
        help="tokens (first windows) for the causal tests; None means all of --tokens",
    )
    parser.add_argument("--no-ablations", action="store_true", help="skip the causal tests")
    parser.add_argument(
        "--reset-at-document-start",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="start every document inside a window (the token after each EOS) from the zero state, in every "
        "measurement and causal test, as gpn train --reset-at-document-start trains; --no-reset-at-document-start "
        "runs the state on across documents; default: the model's own regime (resets when its run folder's "
        "train_config.json says it was trained with them, none otherwise)",
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="weights' dtype, float32 whatever the saved one (gpn generate's default, auto, keeps the saved one); "
        "the state and memory stay float32",
    )
    parser.add_argument("--trust-remote-code", action="store_true", help="allow the model's own code from the Hub")
    parser.add_argument("--seed", type=int, default=0, help="seed for the sampled states and dimensions")
    parser.add_argument("--quiet", "--no-progress", dest="quiet", action="store_true", help="no progress bars")


def fail(message: object) -> int:
    """A bad argument, or what one names (a model, a tokenizer, data, the output folder) missing or unusable: one
    line, as argparse writes its own errors, and exit status 2."""
    print(f"gpn inspect: error: {message}", file=sys.stderr)
    return 2


def check_numbers(args: argparse.Namespace) -> None:
    """Refuse, naming the option, a count that is not positive (a `None` means "not given"), a count for the
    causal tests that are skipped, and `--data -` (no standard input)."""
    for name in ("tokens", "batch_size", "top_k", "max_geometry_states", "seq_len", "ablation_tokens"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")
    if args.max_geometry_states < 2:  # one state has no spread: the geometry failed with a traceback after the run
        raise ValueError(f"--max-geometry-states must be at least 2, got {args.max_geometry_states}")
    if args.no_ablations and args.ablation_tokens is not None:  # (it was ignored in silence)
        raise ValueError("--ablation-tokens sizes the causal tests, which --no-ablations skips; give one of them")
    if args.data == "-":  # (taken for a Hub dataset id: "Repo id must use alphanumeric chars")
        raise ValueError("--data -: standard input is not read; write the text to a file and give its path")


def check_no_report(output: Path) -> None:
    """Refuse an output folder that holds a report already (report.json, report.md or a figure): it was
    overwritten without notice, and a figure the new run does not draw (ablations.png, under --no-ablations) stayed
    beside the new report as if it were its own."""
    check_no_earlier_output(output, ("report.json", "report.md", *FIGURE_NAMES), "--output", "a report")


def document_regime(option: bool | None, trained_with_resets: bool) -> tuple[bool, str]:
    """Whether the state resets at each document start, and why: `--[no-]reset-at-document-start` when given,
    else the model's own regime (its run folder's train_config.json)."""
    if option is not None:
        return option, "--reset-at-document-start" if option else "--no-reset-at-document-start"
    if trained_with_resets:
        return True, RECORDED
    return False, "the default (no train_config.json records document resets)"


def run(args: argparse.Namespace) -> int:
    """Run `gpn inspect`: collect the states, analyse them and write the report; returns the exit status."""
    started = time.time()
    # The arguments are checked before the model loads (the output folder too: it was created only after the
    # whole analysis, whose results a bad --output then lost to a traceback).
    try:
        check_numbers(args)
        torch_device(args.device)  # (a bad one was a traceback once the model had loaded and was being moved)
        if args.tokenizer:
            check_tokenizer_path(args.tokenizer)
        output = writable_folder(args.output, "--output")
        if not args.overwrite:
            check_no_report(output)
    except ValueError as error:
        return fail(error)
    if args.quiet:  # no progress bar of any library either (transformers' "Loading weights" showed)
        from modeling_gpn.evaluation.runner import progress_bars_off

        with progress_bars_off():
            return inspect_model(args, output, started)
    return inspect_model(args, output, started)


def inspect_model(args: argparse.Namespace, output: Path, started: float) -> int:
    """`run` once its arguments are checked: load, collect, report and write."""
    progress = not args.quiet
    try:  # what the arguments name (a model, a tokenizer, data) missing or unusable: one line, no traceback
        model = load_model(args.model, args.device, args.dtype, args.trust_remote_code)
        tokenizer = load_model_tokenizer(  # (an adapter folder's own, else its base's, as gpn generate and eval)
            args.model, args.tokenizer, trust_remote_code=args.trust_remote_code, require_eos=False
        )
        disagreement = end_of_text_disagreement(args.model, tokenizer)
        if disagreement is not None:  # (a warning: the analysis reads no EOS id of the config; generate() would)
            print(f"gpn inspect: warning: {disagreement}", file=sys.stderr)
        seq_len = args.seq_len or model.config.max_length_hint or 2048
        windows = load_token_windows(
            tokenizer, args.data, seq_len, args.tokens, args.data_config, args.split, args.text_column, progress
        )
    except (OSError, ValueError) as error:
        return fail(error)
    if windows.max() >= model.config.vocab_size:
        return fail(
            f"the tokenizer produced id {int(windows.max())} but the model's vocabulary has "
            f"{model.config.vocab_size} tokens; pass the tokenizer the model was trained with"
        )
    trained_with_resets = trained_with_document_resets(args.model)
    resets, resets_from = document_regime(args.reset_at_document_start, trained_with_resets)
    if resets and tokenizer.eos_token_id is None:  # (documents are found by their EOS)
        return fail(
            f"document resets ({resets_from}) need the tokenizer's EOS token, which marks where documents end, and "
            "this tokenizer has none; pass the tokenizer the model was trained with, or --no-reset-at-document-start"
        )
    reset_after = tokenizer.eos_token_id if resets else None
    collected = collect(model, windows, args.batch_size, progress, reset_after)
    ablation_windows = None if args.ablation_tokens is None else max(1, args.ablation_tokens // seq_len)
    report = build_report(
        model,
        tokenizer,
        windows,
        collected,
        top_k=args.top_k,
        max_geometry_states=args.max_geometry_states,
        ablation_windows=ablation_windows,
        batch_size=args.batch_size,
        run_ablations=not args.no_ablations,
        seed=args.seed,
        progress=progress,
        reset_after=reset_after,
    )
    report["data"]["source"] = args.data
    # which regime ran and why: a model trained to start each document from the zero state, run on across the
    # documents of a window (joined with EOS), is measured outside the regime it was trained in
    report["data"]["trained_with_document_resets"] = trained_with_resets
    report["data"]["document_resets_from"] = resets_from
    report["model"]["name_or_path"] = args.model
    output.mkdir(parents=True, exist_ok=True)
    figures = write_figures(report, output)
    for stale in set(FIGURE_NAMES) - {Path(f).name for f in figures}:  # (--overwrite: an earlier run's figure)
        (output / stale).unlink(missing_ok=True)
    summary = report_json(report)
    summary["figures"] = [Path(f).name for f in figures]
    summary["seconds"] = round(time.time() - started, 1)
    write_file_atomically(output / "report.json", json.dumps(summary, indent=1, allow_nan=False) + "\n")
    write_file_atomically(output / "report.md", report_markdown(report, figures))
    print(report_markdown(report))
    print(f"wrote {output / 'report.json'}, {output / 'report.md'} and {len(figures)} figures to {output}")
    return 0
