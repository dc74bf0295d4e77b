"""`DataError`: bad training data or a bad tokenizer, reported before training starts (one line, naming
the file or the name and what to do)."""

from __future__ import annotations


class DataError(ValueError):
    """Bad training data or tokenizer, reported before training starts."""
