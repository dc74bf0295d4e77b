"""Checks of arguments that several `gpn` subcommands share, run before any work starts, so that a bad
argument costs no computation. Its own module below the command (as `formatting.py`), so that the
subcommands' modules can import it without importing the command."""

from __future__ import annotations

import tempfile
from pathlib import Path


def writable_folder(path: str | Path, option: str) -> Path:
    """`path` as a folder that either exists and takes new files, or can be created (its nearest existing
    parent takes new files); nothing is created, so a run refused later leaves no empty folder behind.

    Raises `ValueError` naming `option` when it cannot: a file of that name (or of a parent's name), a folder
    that refuses a file (read-only, a pseudo file system). Checked by writing a scratch file, not by
    `os.access`, which says yes to root on a read-only file system.
    """
    folder = Path(path).expanduser()
    existing = folder
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"{option} {path}: {existing} is a file, not a folder")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        raise ValueError(f"{option} {path}: cannot write in {existing}: {error.strerror or error}") from None
    return folder
