"""What `gpn push` refuses with: `HubPushError` for a folder it will not publish, `CardError` for a model card
that cannot be built or would not pass the Hub's metadata validation (each message says why)."""

from __future__ import annotations


class HubPushError(RuntimeError):
    """A folder that `gpn push` refuses to publish (the message says why and what to do)."""


class CardError(ValueError):
    """The model card cannot be built or would not pass the Hub's metadata validation."""
