"""The help formatter and parser class of the `gpn` command and of the entry points that bypass it
(`python -m modeling_gpn.train`).

Its own module below both, so that the training program can share it without importing the command (which
imports the training program)."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's help with its default, where it has one. An option without one (None, or an empty list: a
    repeatable option given no value) says in its own help what happens when it is not given; "(default: None)" or
    "(default: [])" after that says nothing, or contradicts it. A flag (an option that takes no value) has no
    default to show: "--no-stream ... (default: True)" read as if it were on."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default == [] or (action.option_strings and action.nargs == 0):
            return action.help
        return super()._get_help_string(action)


class AliasArgumentParser(argparse.ArgumentParser):
    """argparse's parser, but an abbreviation that matches only spellings of one option is that option.

    Several subcommands accept two spellings of one option (an alias: `gpn inspect --output` or `--output-dir`,
    as `gpn eval` spells it; each page of docs/ names its own). argparse counts an abbreviation that matches both as
    ambiguous ("--out could match --output, --output-dir"), so adding an alias would have broken the
    abbreviation `--out` that worked before it. Matches that name different options stay ambiguous, as before."""

    def _get_option_tuples(self, option_string: str) -> list[tuple]:
        # Each match is a tuple whose first item is the option's action (its other items differ by Python version).
        first_match_of_each_option: dict[int, tuple] = {}
        for match in super()._get_option_tuples(option_string):
            first_match_of_each_option.setdefault(id(match[0]), match)
        return list(first_match_of_each_option.values())
