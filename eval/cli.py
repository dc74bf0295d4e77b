"""`gpn eval MODEL`: lm-eval-harness plus the paper's protocols, beside the paper's published Table 1.

Runs on any causal LM folder or Hub repo (a GPN, or transformers' own `LlamaForCausalLM` as a
Transformer++ baseline). Writes two files into `--output-dir`:

`eval_results.json` (schema_version 1; read by the model card generator)::

    {
      "schema_version": 1,
      "model": str,                  # the MODEL argument (folder path or Hub repo id)
      "adapter": {"base_model": str, "merged": true, "tokenizer": str} | null,
                                     # MODEL a PEFT adapter folder: scored merged into its base; the tokenizer read
      "model_type": str,             # config.model_type ("gpn", "llama", ...)
      "architecture": str,           # model class name
      "n_params": int,               # distinct parameters (tied weights once)
      "layers": int | null,          # GPN: predict layers; others: num_hidden_layers
      "state_dim": int | null,       # config.hidden_size
      "max_length": int,             # context length given to lm-eval (GPN default: config.max_length_hint)
      "dtype": str, "device": str, "batch_size": int, "limit": int | null,
      "quantization": {              # null for float weights; read from the weights (--dtype int8 | int4, or a
        "weights": str,              #   folder saved quantized): "int8" or "int4"
        "scheme": str,               # in words (torchao's config, what shares a scale)
        "group_sizes": [int, ...],   # weights per scale (int4: 32, a row's length where it is no multiple of 32)
        "quantized_linears": int, "head": str,  # the tied head stays float (its dtype)
        "summary": str} | null,      # one line of the above (the report's)
      "tasks": {task: {metric: float, ...}, ...},
      "protocols": {task: str, ...}, # one line per task: what the numbers mean
      "data": {task: str, ...},      # local path(s) or "hf://name (config, split)"
      "wall_time_s": {task: float, ...},
      "lm_eval_version": str,
      "published_baselines": [       # the paper's Table 1 (baselines.json "rows")
        {"model": str, "layers": int, "state_dim": int, "params": int,
         "fineweb_ppl": float, "lambada_acc": float, "lambada_ppl": float}, ...],
      "baselines_citation": str,
      "baseline_metrics": {column: {"task": str, "metric": str, "higher_is_better": bool, "protocol": str}},
      "comparison": {
        "measured": {column: float},                           # columns of Table 1 that were measured
        "ratio_to_published": {baseline_model: {column: float}}  # measured / published
      },
      "failed": {task: str}          # only where a task failed (its error): the tasks before it, kept
    }

Tasks and their metrics:

- `lambada_openai` (lm-eval): `acc` (whole last word greedy), `perplexity` (per-example summed NLL).
- `lambada_paper` (paper, `protocols.py`): `acc` (top-1 of the first subword of the last word),
  `ppl` (pooled over the last word's subwords), `acc_whole_word`, `ppl_per_example`, `examples`,
  `target_tokens`, `truncated_examples` (contexts left-truncated to `max_length`, as lm-eval's).
- `fineweb_paper` (paper, `protocols.py`): `ppl` (the reported convention), `ppl_all_positions`
  (GPN: first token from the empty state), `ppl_excluding_first`, `tokens_scored`, `windows`,
  `window`, `first_window`, `stream_tokens`, `dropped_tail_tokens`, `documents`.
- `wikitext`, `gpn_rolling_ppl` (lm-eval rolling): `word_perplexity`, `byte_perplexity`, `bits_per_byte`.

`eval_report.md`: the published rows and the measured row side by side, ratios to each published
row, every metric with its wall time, and each row's protocol.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
from pathlib import Path

import torch

from modeling_gpn.atomic_files import held, write_file_atomically
from modeling_gpn.cli.arguments import ADAPTER_FOLDER_HELP, check_no_earlier_output
from modeling_gpn.cli.quantization import DTYPES

from .runner import DEFAULT_FINEWEB_MAX_DOCUMENTS, DEFAULT_TASKS, TASKS, EvalSettings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `gpn eval`."""
    parser.add_argument(
        "model",
        help=f"model folder or Hub repo id (a GPN or any transformers causal LM), or {ADAPTER_FOLDER_HELP}",
    )
    parser.add_argument(
        "--tasks",
        default=",".join(DEFAULT_TASKS),
        help=f"comma-separated tasks from: {', '.join(TASKS)}",
    )
    parser.add_argument(
        "--data-dir",
        default=None,
        help="read every task's data from local files laid out as lambada/lambada_test.jsonl, "
        "fineweb-edu/*.jsonl, wikitext-2-raw/wiki.test.raw; without it, lm-eval's Hub datasets",
    )
    parser.add_argument(
        "--task-data",
        action="append",
        default=[],
        metavar="TASK=SOURCE",
        help="data of one task: local file(s) (comma-separated; .jsonl/.json/.parquet/.csv/.txt/.raw) or a "
        "Hub dataset NAME[:CONFIG[:SPLIT]]; repeatable; wins over --data-dir",
    )
    parser.add_argument("--text-field", default="text", help="text column for fineweb_paper and gpn_rolling_ppl")
    parser.add_argument(
        "--output-dir",
        "--output",  # (as gpn inspect and gpn study spell it)
        dest="output_dir",
        default=None,
        help="where to write eval_results.json and eval_report.md; without it ./eval-<model name>; refused if it "
        "holds them already, unless --overwrite",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the eval_results.json and eval_report.md already in --output-dir (an earlier run's)",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=8,
        help="examples or windows per forward pass (the figures do not depend on it)",
    )
    parser.add_argument(
        "--limit", type=int, default=None, help="first N examples of each LAMBADA/lm-eval task (testing only)"
    )
    parser.add_argument(
        "--device",
        # (as gpn generate, inspect and bench: a GPU machine's eval ran on its CPU unless told)
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="torch device, e.g. cpu or cuda:0 (default: cuda where available, else cpu)",
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=DTYPES,
        help="weights' dtype, float32 whatever the saved one (gpn generate's default, auto, keeps the saved one; a "
        "folder saved quantized stays so); a GPN's state stays float32. int8 or int4: torchao's weight-only "
        "quantization (int8: a scale per row; int4: groups of 32) of every nn.Linear of the bfloat16 model but the "
        "tied head, as gpn generate --dtype (needs torchao); the log-likelihoods are taken as for float weights and "
        "the results say how the weights were quantized",
    )
    parser.add_argument(
        "--max-length",
        type=int,
        default=None,
        help="context length for lm-eval and lambada_paper (longer contexts are left-truncated); without it config.max_length_hint for a GPN (its training window), else the model's positional limit",
    )
    parser.add_argument(
        "--fineweb-window", type=int, default=2048, help="window length of the FineWeb protocol (paper: 2048)"
    )
    parser.add_argument("--fineweb-max-windows", type=int, default=None, help="stop after this many windows")
    parser.add_argument(
        "--fineweb-max-documents",
        type=int,
        default=None,
        help=f"read at most this many documents (default {DEFAULT_FINEWEB_MAX_DOCUMENTS}; with --fineweb-held-out-fraction "
        "all of them: gpn train's held-out windows are the end of the whole corpus)",
    )
    parser.add_argument(
        "--fineweb-held-out-fraction",
        type=float,
        default=None,
        help="score only the last fraction of the windows: gpn train's held-out split of the same corpus "
        "(use the training seq_len as --fineweb-window and the training --val-fraction)",
    )
    parser.add_argument(
        "--fineweb-skip-documents",
        type=int,
        default=0,
        help="skip this many documents first (the Hub default streams the start of sample-10BT, which gpn train's "
        "default corpus also reads: skip past the training documents, or use --fineweb-held-out-fraction)",
    )
    parser.add_argument(
        "--fineweb-max-tokens",
        type=int,
        default=None,
        help="cut the token stream after this many tokens (as gpn train --max-tokens)",
    )
    parser.add_argument(
        "--fineweb-token-cache",
        default=None,
        metavar="DIR",
        help="score the windows of a gpn train run's own token stream (the folder its data line printed: "
        "'tokenized at DIR' or 'cached at DIR'), whatever its corpus (a Hub one too, offline): with "
        "--fineweb-held-out-fraction its --val-fraction, the run's held-out windows",
    )
    parser.add_argument(
        "--cache-dir",
        default=None,
        help="gpn train's token cache (as its --cache-dir; default $GPN_CACHE or ~/.cache/gpn): with "
        "--fineweb-held-out-fraction on a local corpus, its tokens are read from there (tokenized into it "
        "where missing)",
    )
    parser.add_argument(
        "--fineweb-separator",
        default="eos",
        choices=["eos", "bos", "none"],
        help="token between documents in the stream",
    )
    parser.add_argument(
        "--first-position",
        default=None,
        choices=["empty_state", "skip"],
        help="how the first token of a FineWeb window counts in `ppl`; without it empty_state for a GPN (the paper's "
        "convention), skip otherwise",
    )
    parser.add_argument(
        "--bootstrap-iters", type=int, default=0, help="lm-eval bootstrap iterations for standard errors (0: none)"
    )
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder or repo; without it the model's")
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run the modeling code a Hub repo ships (a GPN or Llama folder or repo needs none: this package "
        "registers GPN with transformers' Auto classes)",
    )
    # the old opt-out, kept so that scripts using it still run: it is now the default, so it is not shown
    parser.add_argument(
        "--no-trust-remote-code", dest="trust_remote_code", action="store_false", default=False, help=argparse.SUPPRESS
    )
    parser.add_argument("--num-threads", type=int, default=None, help="torch CPU threads; without it torch's choice")
    parser.add_argument(
        "--quiet",
        "--no-progress",  # (as gpn train and gpn study spell it)
        dest="quiet",
        action="store_true",
        help="no progress bars: neither this command's nor those of transformers, datasets and lm-eval (lm-eval's "
        "warnings still show)",
    )


def parse_task_data(items: list[str]) -> dict[str, str]:
    """`["lambada_openai=path", ...]` -> dict, with clear errors."""
    mapping = {}
    for item in items:
        task, sep, source = item.partition("=")
        if not sep or not task or not source:
            raise ValueError(f"--task-data expects TASK=SOURCE, got {item!r}")
        if task not in TASKS:
            raise ValueError(f"--task-data names unknown task {task!r}; tasks: {sorted(TASKS)}")
        mapping[task] = source
    return mapping


def settings_from_args(args: argparse.Namespace) -> EvalSettings:
    """The `EvalSettings` of the parsed options; a ValueError for options that cut the FineWeb stream two ways."""
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    max_documents = args.fineweb_max_documents
    if args.fineweb_held_out_fraction is not None:
        # gpn train holds out the last windows of the whole corpus: the last windows of its first N documents
        # (the default cap) are training windows, scored as if held out.
        cutting = [
            f"--fineweb-{name} {value}"
            for name, value in (("max-documents", max_documents), ("skip-documents", args.fineweb_skip_documents))
            if value
        ]
        if cutting:
            raise ValueError(
                f"--fineweb-held-out-fraction scores gpn train's held-out windows, the end of the whole corpus: "
                f"{' and '.join(cutting)} would cut the token stream elsewhere (use --fineweb-max-tokens as gpn "
                "train's --max-tokens)"
            )
    elif max_documents is None and args.fineweb_token_cache is None:
        max_documents = DEFAULT_FINEWEB_MAX_DOCUMENTS
    return EvalSettings(
        tasks=tasks,
        data_dir=args.data_dir,
        task_data=parse_task_data(args.task_data),
        text_field=args.text_field,
        batch_size=args.batch_size,
        limit=args.limit,
        device=args.device,
        dtype=args.dtype,
        max_length=args.max_length,
        fineweb_window=args.fineweb_window,
        fineweb_max_windows=args.fineweb_max_windows,
        fineweb_max_documents=max_documents,
        fineweb_separator=args.fineweb_separator,
        fineweb_held_out_fraction=args.fineweb_held_out_fraction,
        fineweb_max_tokens=args.fineweb_max_tokens,
        fineweb_skip_documents=args.fineweb_skip_documents,
        cache_dir=args.cache_dir,
        fineweb_token_cache=args.fineweb_token_cache,
        first_position=args.first_position,
        bootstrap_iters=args.bootstrap_iters,
        trust_remote_code=args.trust_remote_code,
        tokenizer=args.tokenizer,
        progress=not args.quiet,
    )


OUTPUT_FILES = ("eval_results.json", "eval_report.md")  # what a run writes into --output-dir


def write_outputs(results: dict, output_dir: str | Path) -> tuple[Path, Path]:
    """Write `eval_results.json` and `eval_report.md`; returns their paths."""
    from .report import render_report

    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path, report_path = (out / name for name in OUTPUT_FILES)
    # each replaced whole (a reader, gpn push reading the model folder's eval_results.json, never sees half of one)
    write_file_atomically(json_path, json.dumps(results, indent=2, allow_nan=True) + "\n")
    write_file_atomically(report_path, render_report(results))
    return json_path, report_path


def hold_output_folder(output_dir: Path, holds: contextlib.ExitStack) -> None:
    """Hold `output_dir` (an flock on the folder, `atomic_files.held`) until the run ends, creating it if need be
    (and removing it again, while held, if the run wrote nothing). Two runs into one folder (the default,
    ./eval-<the model folder's name>, is the same for runs/a/model and runs/b/model) both found it free at their
    start, and the later one's results replaced the earlier's in silence, or its eval_results.json and
    eval_report.md were each the other run's: a second run is now refused at its start, naming the first."""
    top = output_dir
    while not top.parent.exists():
        top = top.parent
    created = not top.exists()
    output_dir.mkdir(parents=True, exist_ok=True)
    try:
        holds.enter_context(
            held(
                output_dir,
                "that writes an evaluation into it (gpn eval)",
                "wait for it to end, or give another --output-dir",
            )
        )
    finally:
        if created:  # (runs after the hold is released when it was taken: the ExitStack unwinds last in, first out)
            holds.callback(_remove_if_empty, output_dir, top)


def _remove_if_empty(folder: Path, top: Path) -> None:
    """Remove `folder` and its parents up to `top` that this run created, where nothing was written in them."""
    while True:
        with contextlib.suppress(OSError):  # (not empty: something was written, kept)
            folder.rmdir()
        if folder == top or folder.exists():
            return
        folder = folder.parent


def keep_finished_tasks(finished: dict, tasks: list[str], message: object, output_dir: Path) -> str:
    """Write the results of the tasks that finished before one failed (`finished`, as `evaluate` filled it), the
    failed task named under `failed`; returns what became of them, for the error line."""
    from .runner import compare_with_baselines, load_baselines

    failed = next(task for task in tasks if task not in finished["tasks"])
    finished["failed"] = {failed: str(message)}
    finished["comparison"] = compare_with_baselines(finished, load_baselines())
    done = ", ".join(finished["tasks"])
    try:
        json_path, _ = write_outputs(finished, output_dir)
    except OSError as error:
        return f"the figures of {done}, finished before {failed} failed, could not be written: {error}"
    return f"{done}, finished before {failed} failed, written to {json_path.parent}"


def check_no_results(output_dir: Path) -> None:
    """Refuse an output folder that holds an earlier run's results: they were replaced without notice (the default
    folder, ./eval-<the model folder's name>, is the same for runs/a/model and runs/b/model, so evaluating the
    second lost the first's figures; so did a second run with other --tasks)."""
    check_no_earlier_output(output_dir, OUTPUT_FILES, "--output-dir", "an evaluation")


def fail(message: object) -> int:
    """A bad argument, or what one names (a model, data, a tokenizer, the output folder) missing or unusable:
    one line, as argparse writes its own errors, and exit status 2 (as gpn inspect and generate)."""
    print(f"gpn eval: error: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    """Run `gpn eval`: load the model, run its tasks and write the results; returns the exit status."""
    with contextlib.ExitStack() as holds:
        return _run(args, holds)


def _run(args: argparse.Namespace, holds: contextlib.ExitStack) -> int:
    from modeling_gpn.cli.arguments import torch_device, writable_folder
    from modeling_gpn.cli.loading import adapter_note, check_model_path
    from modeling_gpn.data.tokenizer import check_tokenizer_path

    from .runner import check_settings, data_source, evaluate

    # Everything the arguments say is checked before the model loads: a bad one costs no computation.
    try:
        settings = settings_from_args(args)
        check_settings(settings)
        if args.num_threads is not None and args.num_threads < 1:
            raise ValueError(f"--num-threads must be at least 1, got {args.num_threads}")
        torch_device(args.device)
        if args.dtype in ("int8", "int4"):  # (torchao missing: one line before the model loads)
            from modeling_gpn.cli.quantization import require_torchao

            require_torchao(args.dtype)
        args.model = check_model_path(args.model)
        if args.tokenizer:
            check_tokenizer_path(args.tokenizer)
        for task in settings.tasks:  # a --data-dir without a task's files
            data_source(task, settings)
        output_dir = writable_folder(args.output_dir or f"eval-{Path(args.model.rstrip('/')).name}", "--output-dir")
        hold_output_folder(output_dir, holds)
        if not args.overwrite:
            check_no_results(output_dir)
    except (OSError, ValueError) as error:
        return fail(error)
    if args.num_threads:
        import torch

        torch.set_num_threads(args.num_threads)
    note = adapter_note(args.model, args.tokenizer)
    if note is not None:  # (which base the figures are of, and whose tokenizer: eval_results.json says it too)
        print(f"gpn eval: {note}", file=sys.stderr)
    finished: dict = {}  # the figures of each task once it is done
    try:
        results = evaluate(args.model, settings, finished=finished)
    except (OSError, ValueError, KeyError) as error:  # a missing model or data file, bad data: one line, no traceback
        message = error.args[0] if isinstance(error, KeyError) and error.args else error
        if finished.get("tasks"):  # the tasks before the one that failed are kept, not lost with it
            message = f"{message}; {keep_finished_tasks(finished, settings.tasks, message, output_dir)}"
        return fail(message)
    except KeyboardInterrupt:  # Ctrl-C: the tasks finished before it are kept too
        if not finished.get("tasks"):
            raise  # (the command's own one line, exit status 130)
        kept = keep_finished_tasks(finished, settings.tasks, "interrupted (Ctrl-C)", output_dir)
        print(f"gpn eval: interrupted (Ctrl-C); {kept}", file=sys.stderr)
        return 128 + signal.SIGINT
    for task, metrics in results["tasks"].items():
        shown = ", ".join(f"{k}={v:.4g}" for k, v in metrics.items() if isinstance(v, float))
        print(f"{task:16s} {shown}  ({results['wall_time_s'][task]:.1f}s)")
    try:
        json_path, report_path = write_outputs(results, output_dir)
    except OSError as error:  # checked writable before, so rare (a full disk): the figures above are printed
        print(f"gpn eval: error: cannot write the results to {output_dir}: {error}", file=sys.stderr)
        return 1
    print(f"wrote {json_path} and {report_path}")
    return 0
