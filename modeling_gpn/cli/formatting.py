"""The help formatter of the `gpn` command and of the entry points that bypass it (`python -m modeling_gpn.train`).

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
