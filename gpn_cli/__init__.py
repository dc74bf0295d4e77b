"""The `gpn` console script: one subcommand per job.

Each subcommand lives in its own module, imported only when it runs, which defines
`add_arguments(parser)` and `run(args) -> int | None`. `gpn --help` lists them; `gpn CMD --help`
explains every option of one.

This package sits outside `modeling_gpn` on purpose: importing anything inside `modeling_gpn` first runs the
package's `__init__`, which registers GPN with transformers' Auto classes and so imports torch and transformers
(seconds). The registration cannot be deferred (it needs the model classes themselves, and
`import modeling_gpn; AutoModelForCausalLM.from_pretrained(folder)` must keep working), so the command's own
entry point imports nothing of `modeling_gpn` until a subcommand is chosen: `gpn`, `gpn --help` and a
mistyped command answer at once. `python -m gpn_cli` is the same command. (Nothing in `modeling_gpn` imports
this package: it sits above every tool it dispatches to.)
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import signal
import sys

from .upstream_noise import quiet_known_upstream_noise

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


# name -> what `gpn CMD --help` ends with: a command to start from, short enough that the help's 80 columns do not
# break it (each parses: tests/tools/test_docs.py). `gpn train` shows its own in its description, beside its recipes.
EXAMPLES: dict[str, str] = {
    "convert": "gpn convert path/to/checkpoint.pkl converted/ --tokenizer TOKENIZER",
    "train": "gpn train --recipe tiny-cpu",
    "eval": "gpn eval runs/tiny-cpu/model --data-dir ../shared/data --limit 100",
    "push": "gpn push runs/tiny-cpu/model me/gpn-tiny --dry-run upload/",
    "inspect": "gpn inspect runs/tiny-cpu/model --data my_text.jsonl --output inspect/",
    "bench": "gpn bench --preset tiny small --impl fast llama --repeats 3",
    "study": "gpn study --study cpu-small --data-dir ../shared/data",
    "generate": 'gpn generate runs/tiny-cpu/model "ROMEO:" --max-new-tokens 60 --sample',
    "serve": "gpn serve runs/tiny-cpu/model --host 127.0.0.1 --port 8000",
}


def available_subcommands() -> dict[str, tuple[str, str]]:
    """The subcommands whose module is installed. (Looking a module up imports the packages above it, that is
    `modeling_gpn` with torch and transformers: only for a command that will run.)"""
    return {name: spec for name, spec in SUBCOMMANDS.items() if importlib.util.find_spec(spec[0]) is not None}


def version_line() -> str:
    """What `gpn --version` prints: this package's version and those of what it runs on, for a bug report.

    Read from the installed packages' metadata, as `pip show` reads them: importing torch and transformers to ask
    them takes seconds (benchmarks/RESULTS.md, "Figures that were in the code's docstrings"). Only a package run
    from a source tree pip did not install (no metadata) is imported."""
    import platform

    return (
        f"gpn {_installed_version('gpn', 'modeling_gpn')} (torch {_installed_version('torch')}, "
        f"transformers {_installed_version('transformers')}, Python {platform.python_version()})"
    )


def _installed_version(distribution: str, module: str | None = None) -> str:
    """`distribution`'s version as pip installed it, else the `__version__` of its module imported."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return str(getattr(importlib.import_module(module or distribution), "__version__", "unknown"))


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, but help, usage and version printed into a closed pipe (`gpn --help | head -1`) raise the
    BrokenPipeError that `main` ends quietly with 141, as every command's output does: argparse ignored the failed
    write and exited 0 (or, the text still buffered, Python's flush at exit failed: status 120). The subcommands'
    parser class (`modeling_gpn.cli.formatting.AliasArgumentParser`) does the same."""

    def _print_message(self, message: str, file: object = None) -> None:
        stream = file or sys.stderr
        if message and stream is not None:  # (None: the stream was closed when the process started)
            stream.write(message)


class VersionAction(argparse.Action):
    """argparse's `version` action, but the line is made when the option is given: only then are the installed
    packages' versions looked up."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs) -> None:
        kwargs.setdefault("help", "show program's version number and exit")
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        """Print the version line (gpn's and its stack's) and exit."""
        formatter = parser._get_formatter()
        formatter.add_text(version_line())
        parser._print_message(formatter.format_help(), sys.stdout)
        parser.exit()


def build_parser(selected: str | None = None) -> argparse.ArgumentParser:
    """The command's parser; `selected`'s module is imported and gives its subcommand's options. With no
    subcommand selected, nothing of `modeling_gpn` (so no torch) is imported."""
    return _build_parsers(selected)[0]


def _build_parsers(selected: str | None) -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """`build_parser`'s parser and its subcommands' parsers by name (to refuse an option by its subcommand)."""
    parser = ArgumentParser(
        prog="gpn",
        description="Grounded Prediction Networks (arXiv 2605.10643) for the Hugging Face ecosystem.",
    )
    parser.add_argument("--version", action=VersionAction)
    # a subcommand that is not selected never prints its help nor parses its options
    parser_class, formatter_class, listed = ArgumentParser, argparse.HelpFormatter, SUBCOMMANDS
    if selected is not None:
        from modeling_gpn.cli.formatting import AliasArgumentParser, HelpFormatter

        parser_class, formatter_class, listed = AliasArgumentParser, HelpFormatter, available_subcommands()
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=parser_class)
    subcommand_parsers = {}
    for name, (module_name, help_text) in listed.items():
        # (indented: a line of its own that the formatter never wraps, so that it copies whole at any width)
        epilog = f"example:\n  {EXAMPLES[name]}" if name in EXAMPLES else None
        sub = subparsers.add_parser(
            name, help=help_text, description=help_text, epilog=epilog, formatter_class=formatter_class
        )
        subcommand_parsers[name] = sub
        if name == selected:  # import only the module that will run
            module = importlib.import_module(module_name)
            module.add_arguments(sub)
            sub.set_defaults(_run=module.run)
    return parser, subcommand_parsers


def main(argv: list[str] | None = None) -> int:
    """The `gpn` command: parse `argv` (default: sys.argv), run the subcommand, return its exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    quiet_known_upstream_noise()  # before any subcommand imports transformers (which imports torchao)
    selected = next((arg for arg in argv if not arg.startswith("-")), None)
    selected = selected if selected in SUBCOMMANDS else None
    # Ctrl-C is caught around the parsing too: a subcommand's parser imports its module (torch and transformers,
    # seconds), and a Ctrl-C then, at `gpn train --help` or at any command's start, printed a traceback.
    try:
        code = _parse_and_run(argv, selected)
        if sys.stdout is not None:  # (here, not at exit: a reader that went away shows as a BrokenPipeError below)
            sys.stdout.flush()
    except KeyboardInterrupt:  # Ctrl-C where the subcommand has nothing of its own to say: no traceback
        print(f"gpn{f' {selected}' if selected else ''}: interrupted (Ctrl-C)", file=sys.stderr)
        return 128 + signal.SIGINT
    except BrokenPipeError:  # the reader went away (`gpn generate ... | head`): stop quietly, as `cat` would
        code = CLOSED_PIPE_STATUS
    except SystemExit:  # argparse's --help, --version and usage errors (it ignores a write into a closed pipe)
        if _silence_closed_pipes():
            raise SystemExit(CLOSED_PIPE_STATUS) from None
        raise
    return CLOSED_PIPE_STATUS if _silence_closed_pipes() else code


# SIGPIPE's number (the signal module lacks it on Windows): the shell's "ended by SIGPIPE"
CLOSED_PIPE_STATUS = 128 + 13


def _silence_closed_pipes() -> bool:
    """Point standard output and error, where the reader of either has gone, at os.devnull, as Python's
    documentation advises (https://docs.python.org/3/library/signal.html#note-on-sigpipe); True when one had gone.

    What a command printed into a closed pipe stays in the stream's buffer, and Python flushes the buffer at exit:
    `gpn bench | head -1` (any command, `gpn --help` too) ended in "Exception ignored in: <_io.TextIOWrapper
    name='<stdout>'> BrokenPipeError" and exit status 120. (Not where PYTHONUNBUFFERED=1 is set, as it was where
    the commands were tested: nothing is kept in a buffer then.)"""
    closed = False
    for stream in (sys.stdout, sys.stderr):
        if stream is None:
            continue
        try:
            stream.flush()
        except BrokenPipeError:
            closed = True
            try:
                devnull = os.open(os.devnull, os.O_WRONLY)
                try:
                    os.dup2(devnull, stream.fileno())
                finally:
                    os.close(devnull)
            except (OSError, ValueError):  # (a stream without a file descriptor, as a test's capture)
                pass
        except (OSError, ValueError):  # (a stream closed, or failing otherwise: nothing to flush at exit either)
            pass
    return closed


def _parse_and_run(argv: list[str], selected: str | None) -> int:
    parser, subcommand_parsers = _build_parsers(selected)
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # refused by the subcommand's parser, whose usage it shows (the top one said "gpn: error: ...")
        subcommand_parsers.get(args.command, parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    if not getattr(args, "_run", None):
        parser.print_help()
        return 0 if args.command is None else 2
    from modeling_gpn.cli.terminal import (
        escape_what_stdout_cannot_show,
        honour_progress_bar_environment,
        line_buffered_output,
    )

    escape_what_stdout_cannot_show()  # (a sample of Chinese text on an ASCII terminal failed the command)
    line_buffered_output()  # (`gpn train | tee log`: each line as it comes, not at the end)
    honour_progress_bar_environment(args)  # (HF_HUB_DISABLE_PROGRESS_BARS=1, TQDM_DISABLE=1: --no-progress)
    return int(args._run(args) or 0)
