"""What `gpn push` refuses with: `HubPushError` for a folder it will not publish, `CardError` for a model card
that cannot be built or would not pass the Hub's metadata validation (each message says why)."""

from __future__ import annotations


class HubPushError(RuntimeError):
    """A folder that `gpn push` refuses to publish (the message says why and what to do)."""


class CardError(ValueError):
    """The model card cannot be built or would not pass the Hub's metadata validation."""


def unreachable_hub_errors() -> tuple[type[BaseException], ...]:
    """What huggingface_hub raises when the Hub refuses or cannot be reached: its own HTTP and offline errors,
    `OSError`, and its HTTP client's transport errors, which are none of those (huggingface_hub 2 talks through
    httpx2: a push with no network ended in an `httpx2.ConnectError` traceback). The client is the one
    huggingface_hub imported, looked up when an error is being sorted, so neither is imported here."""
    import sys

    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    clients = (sys.modules.get(name) for name in ("httpx2", "httpx"))
    return (HfHubHTTPError, OfflineModeIsEnabled, OSError, *(c.HTTPError for c in clients if hasattr(c, "HTTPError")))
