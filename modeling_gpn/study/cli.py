"""`gpn study`'s command line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .definition import EvaluationError, StoppedAfterModel, StudyError
from .report import render_report
from .runs import run_study

# (not `gpn train`'s "--resume": gpn study has no such option, and needs none)
CONTINUE = (
    "Run the same gpn study command again to continue: the models finished in {output} are reused and the one "
    "stopped resumes from its last checkpoint."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `gpn study`."""
    parser.add_argument("--study", default="cpu-small", help="a study name (configuration/studies/NAME.json) or path")
    parser.add_argument(
        "--output",
        "--output-dir",  # (as gpn train and gpn eval spell it)
        dest="output",
        default="runs/study",
        help="folder for every run and the comparison report (one study a folder)",
    )
    parser.add_argument(
        "--data-dir",
        default=None,
        help="local evaluation data laid out like ../shared/data (lambada/; the held-out PPL scores each model's own "
        "training token stream, docs/study.md); default: the study's own eval settings (Hub data)",
    )
    parser.add_argument("--only", nargs="+", default=None, help="train and evaluate only these models of the study")
    parser.add_argument("--steps", type=int, default=None, help="override the study's optimizer steps (budget)")
    parser.add_argument(
        "--dataset",
        default=None,
        help="override the study's training corpus, as gpn train --dataset takes it (a local file, folder or glob, "
        "shakespeare, or a Hub dataset name): every model trains on it and is scored on its held-out windows",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    """Run `gpn study`: train and evaluate each of its models, then write the report; returns the exit status."""
    import signal

    from modeling_gpn.data import DataError
    from modeling_gpn.train import RUN_ERRORS, ResumeMismatchError, TrainingStopped

    overrides = {"steps": args.steps} if args.steps is not None else {}  # (--steps 0 is refused, not ignored)
    if args.dataset is not None:
        overrides["dataset"] = args.dataset
    try:
        results = run_study(args.study, args.output, args.data_dir, args.only, overrides, not args.no_progress)
    except StudyError as error:  # (raised before anything is trained)
        print(f"gpn study: error: {error}", file=sys.stderr)
        return 2
    except ResumeMismatchError as error:  # (a model stopped part-way, its corpus or settings changed since)
        model_dir = error.checkpoint.parent.parent
        print(
            f"gpn study: error: model {model_dir.name} cannot resume from {error.checkpoint}: "
            f"{'; '.join(error.changes)}. Restore them to continue it, or move {model_dir} away (or choose "
            "another --output) to train it afresh",
            file=sys.stderr,
        )
        return 1
    except EvaluationError as error:  # (its training is kept: the next run evaluates it)
        print(
            f"gpn study: error: {error}. Mend that and run the same gpn study command again: the models trained in "
            f"{args.output} are reused",
            file=sys.stderr,
        )
        return 1
    # (DataError: a corpus that cannot be read, the Hub offline, a missing file; FileExistsError: a model's folder
    # holds a run)
    except (DataError, *RUN_ERRORS, FileExistsError) as error:
        print(f"gpn study: error: {error}", file=sys.stderr)
        return 1
    except TrainingStopped as stop:  # SIGTERM/SIGINT: `gpn train` checkpointed the model it was training
        print(
            f"gpn study: stopped by {signal.Signals(stop.signum).name} after step {stop.step}; the training state "
            f"is saved in {stop.checkpoint}. {CONTINUE.format(output=args.output)}",
            file=sys.stderr,
        )
        return 128 + stop.signum
    except StoppedAfterModel as stop:  # (its model finished: kept, evaluated by the next run)
        print(f"gpn study: {stop}. {CONTINUE.format(output=args.output)}", file=sys.stderr)
        return 128 + stop.signum
    except KeyboardInterrupt:  # a second Ctrl-C, or one outside training (evaluation, the report)
        print(f"gpn study: interrupted (Ctrl-C). {CONTINUE.format(output=args.output)}", file=sys.stderr)
        return 128 + signal.SIGINT
    print(render_report(results))
    print(f"Report: {Path(args.output) / 'study_report.md'}")
    return 0
