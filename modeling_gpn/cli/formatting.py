"""The help formatter and parser class of the `gpn` command and of the entry points that bypass it
(`python -m modeling_gpn.train`).

Its own module below both, so that the training program can share it without importing the command (which
imports the training program)."""

from __future__ import annotations

import argparse
import itertools
import re
import sys
import textwrap

_PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n")


def _wrap(text: str, width: int, indent: str = "") -> list[str]:
    """`text`'s words in lines of at most `width` characters, broken only at spaces: argparse's own wrapping also
    breaks after a hyphen, and split option names, recipe names and paths ("--max-skipped-" / "steps") in any help
    longer than a line; a word longer than the line is left whole (a path copied from the help must still work)."""
    words = " ".join(text.split())
    return textwrap.wrap(
        words,
        max(width, 1),
        initial_indent=indent,
        subsequent_indent=indent,
        break_on_hyphens=False,
        break_long_words=False,
    )


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's help with its default, where it has one. An option without one (None, or an empty list: a
    repeatable option given no value) says in its own help what happens when it is not given; "(default: None)" or
    "(default: [])" after that says nothing, or contradicts it. A flag (an option that takes no value) has no
    default to show: "--no-stream ... (default: True)" read as if it were on.

    Text is wrapped to the terminal's width at spaces only (`_wrap`). A description or epilog keeps its paragraphs
    (blank-line separated: argparse ran them into one), and a line that is indented, a command to copy (the
    epilog's example), is printed as written, unwrapped at any width."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return _wrap(text, width)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        paragraphs = []
        for paragraph in _PARAGRAPH_BREAK.split(text.strip("\n")):
            lines: list[str] = []
            for indented, run in itertools.groupby(paragraph.splitlines(), key=lambda line: line[:1].isspace()):
                run = list(run)
                lines += [indent + line for line in run] if indented else _wrap(" ".join(run), width, indent)
            paragraphs.append("\n".join(lines))
        return "\n\n".join(paragraphs)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default == [] or (action.option_strings and action.nargs == 0):
            return action.help
        return super()._get_help_string(action)


class AliasArgumentParser(argparse.ArgumentParser):
    """argparse's parser, but an abbreviation that matches only spellings of one option is that option.

    Several subcommands accept two spellings of one option (an alias: `gpn inspect --output` or `--output-dir`,
    as `gpn eval` spells it; each page of docs/ names its own). argparse counts an abbreviation that matches both as
    ambiguous ("--out could match --output, --output-dir"), so adding an alias would have broken the
    abbreviation `--out` that worked before it. Matches that name different options stay ambiguous, as before.

    Help, usage and version printed into a closed pipe raise the BrokenPipeError that the `gpn` command ends
    quietly with 141 (argparse ignored the failed write; as the command's own parser, `gpn_cli.ArgumentParser`)."""

    def _print_message(self, message: str, file: object = None) -> None:
        stream = file or sys.stderr
        if message and stream is not None:  # (None: the stream was closed when the process started)
            stream.write(message)

    def _get_option_tuples(self, option_string: str) -> list[tuple]:
        # Each match is a tuple whose first item is the option's action (its other items differ by Python version).
        first_match_of_each_option: dict[int, tuple] = {}
        for match in super()._get_option_tuples(option_string):
            first_match_of_each_option.setdefault(id(match[0]), match)
        return list(first_match_of_each_option.values())
