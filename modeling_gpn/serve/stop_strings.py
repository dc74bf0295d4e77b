"""Answers cut before their `stop` sequence, as the OpenAI API returns them.

transformers serve hands `stop` to `generate()` as `stop_strings`: generation ends at the token that completes
one, and that token's text is sent whole, so an answer ends with the stop sequence (and whatever else the
token holds after it). The OpenAI API returns the text before it: "the returned text will not contain the stop
sequence", which clients rely on (an agent's `stop=["\\nObservation:"]` reads the answer as it is). Here the
answer is cut at the first stop sequence it holds: a non-streamed answer whole, a streamed one as it goes,
holding back the end of the text that could still become a stop sequence until the next piece tells.
"""

from __future__ import annotations

from typing import Any


def stop_sequences(body: dict[str, Any]) -> list[str]:
    """The request's `stop` as a list (a string, or a list of strings; checked by `validation`)."""
    stop = body.get("stop")
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """`text` up to the first of `stops` it holds, and whether it held one."""
    found = [position for position in (text.find(stop) for stop in stops) if position >= 0]
    if not found:
        return text, False
    return text[: min(found)], True


class StreamCutter:
    """Cuts a streamed answer before its first stop sequence: `feed` each piece of text, get what may be sent
    now; `flush` at the end gives what was held back. Once a stop sequence is found, nothing more is sent."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.stopped = False
        self._held = ""

    def feed(self, piece: str) -> str:
        """The text of `piece` that may be sent now: cut at a stop string, holding back a possible start of one."""
        if self.stopped:
            return ""
        text, self.stopped = cut_at_stop(self._held + piece, self.stops)
        if self.stopped:
            self._held = ""
            return text
        # hold back the longest end of the text that begins a stop sequence: the next piece may complete it
        keep = max(
            (size for stop in self.stops for size in range(1, len(stop)) if text.endswith(stop[:size])), default=0
        )
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """The text held back, at the end of the stream (nothing after a stop)."""
        held, self._held = self._held, ""
        return "" if self.stopped else held
