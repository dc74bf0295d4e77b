"""Answers cut before their `stop` sequence, as the OpenAI API returns them.

transformers serve hands `stop` to `generate()` as `stop_strings`: generation ends at the token that completes
one, and that token's text is sent whole, so an answer ends with the stop sequence (and whatever else the
token holds after it). The OpenAI API returns the text before it: "the returned text will not contain the stop
sequence", which clients rely on (an agent's `stop=["\\nObservation:"]` reads the answer as it is). Here the
answer is cut at the first stop sequence it holds: a non-streamed answer whole, a streamed one as it goes,
holding back the end of the text that could still become a stop sequence until the next piece tells.

Generation itself stops at the same place (`StopInAnswer`): at the token with which the answer's text, decoded
token by token, first holds a stop sequence. transformers' own check (`StopStringCriteria`) reads the
prompt too, so a stop sequence begun by the prompt's end and completed by the answer's first tokens ("lo" + "龘"
for `stop: ["lo龘"]` after a prompt ending in "hello") ended the answer there, "stop", though its text holds no
stop sequence and the API goes on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from transformers import StoppingCriteria

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


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


class AnswerText:
    """One answer's text as its tokens come, and whether it holds one of `stops` yet.

    Decoded token by token with tokenizers' `DecodeStream` (a step a token, whatever the length), which gives a
    character spelled in byte tokens whole, with the token that completes it (so a stop sequence counts once its
    last byte is made; the stream itself sends a run of byte tokens once it has ended: `streaming`), and the
    first token's text as `decode` of the answer alone gives it (a SentencePiece word-start without its space). A
    tokenizer without a Rust backend decodes the whole answer each time (transformers serve streams only with one),
    as does an answer whose tokens DecodeStream refuses.
    Special tokens are read as their text, as transformers' check reads them: `stop: ["<|user|>"]` ends an answer
    at that token, though the text sent leaves it out.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stops: list[str]):
        from tokenizers.decoders import DecodeStream

        self.tokenizer, self.stops = tokenizer, stops
        self.backend = getattr(tokenizer, "backend_tokenizer", None)
        self.stream = DecodeStream([], skip_special_tokens=False) if self.backend is not None else None
        self.ids: list[int] = []  # (to decode whole, without a backend or after DecodeStream refused a token)
        self.read = 0  # the tokens given to `add`
        self.text = ""
        self.longest = max(len(stop) for stop in stops)
        self.stopped = False

    def add(self, ids: list[int]) -> bool:
        """Read `ids`, the answer's next tokens; whether its text holds a stop sequence now."""
        self.read += len(ids)
        for token in ids:
            if self.stopped:
                break
            self.ids.append(token)
            before = len(self.text)
            if self.stream is not None:
                try:
                    self.text += self.stream.step(self.backend, token) or ""
                except Exception:  # noqa: BLE001 - tokenizers' own error, of no narrower type
                    # DecodeStream refuses some runs of byte tokens that are no UTF-8 ("Invalid prefix
                    # encountered while decoding stream"): from here on the answer is decoded whole
                    self.stream = None
            if self.stream is None:
                self.text, before = self.tokenizer.decode(self.ids).rstrip("\ufffd"), 0
            # only a stop sequence that the new text ends can be new: look at it and what may begin one before it
            tail = self.text[max(0, before - self.longest + 1) :]
            self.stopped = any(stop in tail for stop in self.stops)
        return self.stopped


def stop_position(tokenizer: PreTrainedTokenizerBase, answer_ids: list[int], stops: list[str]) -> int | None:
    """The index of the answer's token with which its text first holds one of `stops` (`AnswerText`), or None."""
    text = AnswerText(tokenizer, stops)
    return next((position for position, token in enumerate(answer_ids) if text.add([token])), None)


class StopInAnswer(StoppingCriteria):
    """Stops a row of `generate()` once its answer (the tokens after the first `prompt_length`) holds one of `stops`
    in its text (`AnswerText`): where the answer's text is cut (`cut_at_stop`), and never on a stop sequence the
    prompt begins. One `AnswerText` a row, fed each call the row's new tokens; beam search reorders its rows
    between calls, so with `beams` each row's answer is decoded afresh each call."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stops: list[str], prompt_length: int, beams: bool = False):
        self.tokenizer, self.stops, self.prompt_length, self.beams = tokenizer, stops, prompt_length, beams
        self.rows: list[AnswerText] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        """Whether each row's answer holds a stop sequence now."""
        if self.beams or len(self.rows) != input_ids.shape[0]:
            self.rows = [AnswerText(self.tokenizer, self.stops) for _ in range(input_ids.shape[0])]
        stopped = []
        for row, text in enumerate(self.rows):
            stopped.append(text.stopped or text.add(input_ids[row, self.prompt_length + text.read :].tolist()))
        return torch.tensor(stopped, dtype=torch.bool, device=input_ids.device)
