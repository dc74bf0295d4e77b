"""Where the data pipeline keeps what it computed once (token shards, trained tokenizers): the cache folder,
the content key of a cached folder, and writing such a folder whole or not at all."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path


def default_cache_dir() -> Path:
    """`$GPN_CACHE` or `~/.cache/gpn`: where token shards and trained tokenizers are kept."""
    return Path(os.environ.get("GPN_CACHE", Path.home() / ".cache" / "gpn"))


def content_hash(value) -> str:
    """A short key for `value` (JSON-able): what names a cached folder after what it was made from."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def write_folder_atomically(folder: Path, writer) -> None:
    """Run `writer(tmp_folder)` and rename the folder into place (a crash never leaves half a cache)."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    try:
        writer(tmp)
        try:
            os.replace(tmp, folder)
        except OSError:  # another process finished first: keep theirs
            if not folder.exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
