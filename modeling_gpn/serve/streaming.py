"""transformers serve's streamer, made to send an answer's whole text (`cli.text_stream`).

transformers serve streams with `DirectStreamer`, which decodes each token with tokenizers' `DecodeStream` and
puts the text on the request's queue (through the tool or reasoning parser, when the handler has one). Two things
went wrong with it: a run of byte tokens that is no UTF-8 after a character spelled in byte tokens
(`<0xE9><0xBE><0x98>`, `<0xE9><0xBE>`, "▁hello") made `DecodeStream` refuse the next token, and the stream ended
there with an error; and an answer that ended inside a character never sent its replacement characters
(`DecodeStream` holds them back for a token that never comes). Here its `DecodeStream` is swapped for a
`StreamText`, and its `end` first sends what `StreamText` still holds: the streamed text is then the answer's
text, as the same answer not streamed is decoded. Any other streamer is left as it is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from transformers.cli.serving.utils import DirectStreamer, response_events_to_chunks
from transformers.generation.streamers import BaseStreamer

from ..cli.text_stream import StreamText

if TYPE_CHECKING:
    import torch


def sending_whole_text(streamer: BaseStreamer | None) -> BaseStreamer | None:
    """`streamer`, if it is transformers serve's `DirectStreamer`, decoding with `StreamText` and sending what that
    still holds when generation ends (`streamer` itself otherwise)."""
    if not isinstance(streamer, DirectStreamer):
        return streamer
    # (the streamer decodes without special tokens unless a parser reads them: transformers' own rule)
    text = StreamText(streamer._tokenizer, skip_special_tokens=streamer._parser is None)
    streamer._decode_stream = text
    return _SendingTheRest(streamer, text)


class _SendingTheRest(BaseStreamer):
    """`streamer` as generate() calls it, whose `end` sends what `text` holds back first (as its `put` sends text)."""

    def __init__(self, streamer: DirectStreamer, text: StreamText):
        self.streamer, self.text = streamer, text

    def put(self, value: torch.Tensor) -> None:
        """What generate() made: to the streamer."""
        self.streamer.put(value)

    def end(self) -> None:
        """Generation is over: what the text held back is sent, then the streamer ends."""
        rest = self.text.rest()
        if rest:
            streamer = self.streamer
            if streamer._parser is None:
                streamer._enqueue(rest)
            else:
                for item in response_events_to_chunks(streamer._parser.feed(rest)):
                    streamer._enqueue(item)
        self.streamer.end()
