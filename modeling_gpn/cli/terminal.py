"""The terminal the commands print to: a character its encoding cannot show is written as an escape, said once on
stderr, instead of failing the command.

Under a locale that is not UTF-8 with Python's UTF-8 mode off (`LC_ALL=C PYTHONUTF8=0`, an old server's ssh
session), standard output is ASCII: a trained model's sample, or `gpn generate`'s text, holding one Chinese
character or emoji ended the command with `UnicodeEncodeError` (after a `gpn train` run had saved its model: exit 1
and no loss figure). Such characters are now written as Python escapes (`\\u4e2d`), visible and reversible, and
the first one escaped prints a note naming the encoding and what to set; bytes the locale could not decode (lone
surrogates, as Python reads such a command line) are written back as they came (`surrogateescape`, Python's own
choice for such a terminal).
"""

from __future__ import annotations

import argparse
import codecs
import os
import sys

ERROR_HANDLER = "gpn-escape"
_noted: list[bool] = []  # (one note a process)


def _escape(error: UnicodeError) -> tuple[bytes, int]:
    """The codec error handler: bytes that came in undecodable (lone surrogates U+DC80..U+DCFF) go back out as they
    came, any other character as its escape, the first time with a note on stderr."""
    if not isinstance(error, UnicodeEncodeError):
        raise error
    out = bytearray()
    for character in error.object[error.start : error.end]:
        if 0xDC80 <= ord(character) <= 0xDCFF:
            out.append(ord(character) - 0xDC00)
            continue
        out += character.encode("ascii", "backslashreplace")
        if not _noted:
            _noted.append(True)
            sys.stderr.write(
                f"gpn: note: this terminal's encoding ({error.encoding}) cannot show some characters of the output: "
                "they are written as escapes (\\u4e2d for U+4E2D); run with a UTF-8 locale (LANG=C.UTF-8) or "
                "PYTHONUTF8=1 to see them\n"
            )
            sys.stderr.flush()
    return bytes(out), error.end


def escape_what_stdout_cannot_show() -> None:
    """Make standard output write the characters its encoding lacks as escapes (see the module's docstring). A
    UTF-8 output, or one that cannot be reconfigured (a test's capture), is left as it is."""
    try:
        codecs.lookup_error(ERROR_HANDLER)
    except LookupError:
        codecs.register_error(ERROR_HANDLER, _escape)
    stream = sys.stdout
    encoding = getattr(stream, "encoding", None)
    if encoding is None or codecs.lookup(encoding).name == "utf-8" or not hasattr(stream, "reconfigure"):
        return
    stream.reconfigure(errors=ERROR_HANDLER)


def line_buffered_output() -> None:
    """Make standard output write each line as it is printed, into a pipe or file too (Python writes those in 8 KB
    blocks): `gpn train ... | tee train.log` showed no line until the run ended (each evaluation's loss held back
    for hours), and a run killed meanwhile (out of memory, `kill -9`) lost them. The commands print few lines; a
    stream that cannot be reconfigured (a test's capture) is left as it is."""
    stream = sys.stdout
    if stream is not None and hasattr(stream, "reconfigure") and not stream.line_buffering:
        stream.reconfigure(line_buffering=True)


def colours_wanted() -> bool:
    """Whether a command may colour what it prints with escape codes: only where standard output and standard error
    are both terminals, and NO_COLOR (https://no-color.org) is unset or empty. (uvicorn, under `gpn serve`, asked
    standard output alone, and wrote its log lines to standard error: `gpn serve 2> server.log` at a terminal filled
    the file with escape codes, and NO_COLOR changed nothing.)"""
    if os.environ.get("NO_COLOR"):
        return False
    streams = (sys.stdout, sys.stderr)
    return all(stream is not None and getattr(stream, "isatty", lambda: False)() for stream in streams)


# the options by which a subcommand turns its progress bars off (`gpn eval` and `gpn inspect` spell it --quiet too)
PROGRESS_OPTIONS = ("no_progress", "quiet")


def progress_bars_off_by_environment() -> bool:
    """Whether the environment turns progress bars off as the Hugging Face libraries read it: huggingface_hub's
    HF_HUB_DISABLE_PROGRESS_BARS (or its `disable_progress_bars()`, which transformers' bars follow), or tqdm's
    TQDM_DISABLE (any non-empty value, as tqdm reads it)."""
    if os.environ.get("TQDM_DISABLE"):
        return True
    from huggingface_hub.utils import are_progress_bars_disabled

    return are_progress_bars_disabled()


def honour_progress_bar_environment(args: argparse.Namespace) -> None:
    """Give a subcommand's `--no-progress` when the environment turns progress bars off: the bars of transformers
    and huggingface_hub went, and the command's own (training, tokenizing, bench, inspect and eval) stayed."""
    if progress_bars_off_by_environment():
        for option in PROGRESS_OPTIONS:
            if hasattr(args, option):
                setattr(args, option, True)
