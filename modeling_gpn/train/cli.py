"""`gpn train`'s command line (also `python -m modeling_gpn.train` and `accelerate launch -m modeling_gpn.train`):
one flag per option of the settings table, and one exit code per way a run ends."""

from __future__ import annotations

import argparse
import signal
import sys

from ..cli.formatting import AliasArgumentParser, HelpFormatter
from ..cli.terminal import escape_what_stdout_cannot_show, honour_progress_bar_environment, line_buffered_output
from .distributed import RunStage
from .errors import RUN_ERRORS, CollectiveError, TrainingStopped
from .settings import OPTIONS, list_recipes, resolve_config
from .training import train

# How to start several processes, which the launcher's own flags do not make obvious on CPU (`accelerate launch
# --cpu --num_processes 2` starts one process).
MULTI_PROCESS_HELP = (
    " Several processes (the same options): `accelerate launch --multi_gpu --num_processes N -m modeling_gpn.train "
    "...` (DDP; FSDP2: `--use_fsdp --fsdp_version 2` instead of --multi_gpu); on CPU prefix ACCELERATE_USE_CPU=1 and "
    "add --num_machines 1 (`accelerate launch --cpu` starts one process). Details: docs/training.md."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `gpn train` (also `accelerate launch -m modeling_gpn.train`)."""
    parser.description = (
        "Train a GPN (or a LlamaForCausalLM baseline) with Accelerate. Settings come from the built-in defaults, "
        "then --recipe, then --config, then the options below. Recipes: " + ", ".join(list_recipes()) + ". "
        "Example: `gpn train --recipe tiny-cpu` (the tiny preset on Shakespeare, about a minute on 2 CPU cores); "
        "`accelerate launch -m modeling_gpn.train --recipe paper-130m` (the paper's run)." + MULTI_PROCESS_HELP
    )
    parser.add_argument("--recipe", help="a recipe name (" + ", ".join(list_recipes()) + ") or a recipe JSON path")
    parser.add_argument(
        "--config", help="a JSON file of option values (keys as below with underscores); overrides the recipe"
    )
    parser.add_argument(
        "--hub-data",
        action="store_true",
        help="use the Hub defaults for data and tokenizer "
        "(FineWeb-Edu sample-10BT streamed, meta-llama/Llama-2-7b-hf) whatever the recipe says",
    )
    parser.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=None,
        metavar="CHECKPOINT",
        help="continue from the newest checkpoint in the output directory (or from CHECKPOINT); "
        "settings that change the data, the model or the optimisation must match the checkpoint's",
    )
    parser.add_argument(
        "--skip-nonfinite",
        action="store_true",
        help="skip an optimizer step whose loss or gradient is NaN/inf instead of stopping (at most "
        "--max-skipped-steps of them; the count is logged and reported at the end)",
    )
    parser.add_argument(
        "--prepare-data-only",
        action="store_true",
        help="tokenize and cache the data, then exit (run once before a multi-process launch of a large corpus)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    group = parser.add_argument_group("settings (default shown is the built-in one; a recipe may set another)")
    for option in OPTIONS:
        # SUPPRESS: an option not given stays unset, so the recipe / config file value is kept.
        # An option whose built-in is None says in its own help what unset means ("[built-in: None]" said
        # nothing, and beside "(default runs/<recipe name>)" contradicted it).
        built_in = "" if option.default is None else f" [built-in: {option.default}]"
        kwargs = {"dest": option.key, "default": argparse.SUPPRESS, "help": option.help + built_in}
        if option.choices:
            kwargs["choices"] = option.choices
        if option.type is bool:  # --X or --no-X: either overrides what a recipe or config file set
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = option.type
        group.add_argument("--" + option.key.replace("_", "-"), *option.aliases, **kwargs)


def run(args: argparse.Namespace) -> int:
    """Run `gpn train` with the parsed options; returns the exit status."""
    from modeling_gpn.data import DataError

    config = None
    try:
        config = resolve_config(args)
        summary = train(
            config,
            resume=args.resume,
            skip_nonfinite=args.skip_nonfinite,
            prepare_only=args.prepare_data_only,
            show_progress=not args.no_progress,
        )
    except (DataError, *RUN_ERRORS, FileExistsError, FileNotFoundError, ValueError) as error:
        print(
            f"gpn train: error: {error}"
            + (
                ". Checkpoints written so far are intact: continue with --resume"
                if isinstance(error, CollectiveError)
                else ""
            ),
            file=sys.stderr,
        )
        return 1
    except TrainingStopped as stop:
        print(f"gpn train: {stop}", file=sys.stderr)
        return 128 + stop.signum  # the shell's code for "ended by this signal": 143 SIGTERM, 130 SIGINT
    except KeyboardInterrupt:
        print(
            "gpn train: interrupted (Ctrl-C) before a checkpoint could be written; the last checkpoint, if any, "
            "is intact: continue with the same command plus --resume",
            file=sys.stderr,
        )
        return 128 + signal.SIGINT
    if summary.get("processes", 1) > 1:
        # The process is about to exit: joining threads and atexit handlers must not hold the job either.
        RunStage(watchdog_s=config["ddp_timeout"] + 60).enter("exiting (joining threads, atexit handlers)", watch=True)
    if summary.get("stop_signal"):  # (in the last step or the final phase: the run finished all the same)
        name = signal.Signals(summary["stop_signal"]).name
        print(
            f"gpn train: {name} received after the last step began: the run finished, its model saved", file=sys.stderr
        )
        return 128 + summary["stop_signal"]
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m modeling_gpn.train` / `accelerate launch -m modeling_gpn.train`."""
    parser = AliasArgumentParser(prog="modeling_gpn.train", formatter_class=HelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    escape_what_stdout_cannot_show()  # (as `gpn` does: the sample on an ASCII terminal failed the run at its end)
    honour_progress_bar_environment(args)  # (as `gpn` does)
    line_buffered_output()  # (as `gpn` does: an accelerate launch's lines through a pipe as they come)
    return run(args)
