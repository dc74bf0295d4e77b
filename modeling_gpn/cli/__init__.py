"""The `gpn` console script: one subcommand per job.

Each subcommand lives in its own module, imported only when it runs, which defines
`add_arguments(parser)` and `run(args) -> int | None`. `gpn --help` lists them; `gpn CMD --help`
explains every option of one.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import signal
import sys

from .formatting import HelpFormatter

# name -> (module, one-line help). Keep this interface stable: users script against it.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "convert": ("modeling_gpn.conversion.cli", "convert a reference (JAX) checkpoint to a transformers folder"),
    "train": ("modeling_gpn.train", "train a GPN (or a Llama baseline) on a text corpus"),
    "eval": ("modeling_gpn.evaluation.cli", "evaluate a model with lm-eval-harness beside the paper's baselines"),
    "push": ("modeling_gpn.hub", "publish a model folder to the Hugging Face Hub with a model card"),
    "inspect": ("modeling_gpn.inspect", "analyse a model's single state (geometry, mean direction, horizons, memory)"),
    "bench": ("modeling_gpn.bench", "measure training, prefill and decode speed and memory"),
    "study": ("modeling_gpn.study", "small-scale replication: train and evaluate GPN variants and baselines"),
    "generate": ("modeling_gpn.cli.generate", "generate text from a model folder or Hub repo"),
    "serve": (
        "modeling_gpn.serve.cli",
        "serve a model behind an OpenAI-compatible API (transformers serve), conversations kept as states",
    ),
}


def available_subcommands() -> dict[str, tuple[str, str]]:
    return {name: spec for name, spec in SUBCOMMANDS.items() if importlib.util.find_spec(spec[0]) is not None}


def version_line() -> str:
    """What `gpn --version` prints: this package's version and those of what it runs on, for a bug report."""
    import platform

    import torch
    import transformers

    from modeling_gpn import __version__

    return (
        f"gpn {__version__} (torch {torch.__version__}, transformers {transformers.__version__}, "
        f"Python {platform.python_version()})"
    )


def build_parser(selected: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpn",
        description="Grounded Prediction Networks (arXiv 2605.10643) for the Hugging Face ecosystem.",
    )
    parser.add_argument("--version", action="version", version=version_line())
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in available_subcommands().items():
        sub = subparsers.add_parser(name, help=help_text, description=help_text, formatter_class=HelpFormatter)
        if name == selected:  # import only the module that will run
            module = importlib.import_module(module_name)
            module.add_arguments(sub)
            sub.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    selected = next((arg for arg in argv if not arg.startswith("-")), None)
    parser = build_parser(selected if selected in SUBCOMMANDS else None)
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 0 if args.command is None else 2
    try:
        result = args._run(args)
    except KeyboardInterrupt:  # Ctrl-C where the subcommand has nothing of its own to say: no traceback
        print(f"gpn {args.command}: interrupted (Ctrl-C)", file=sys.stderr)
        return 128 + signal.SIGINT
    except BrokenPipeError:  # the reader went away (`gpn generate ... | head`): stop quietly, as `cat` would
        return 128 + 13  # SIGPIPE's number (the signal module lacks it on Windows): the shell's "ended by SIGPIPE"
    return int(result or 0)
