"""Streamed text that adds up to the answer's text: what a stream may send of an answer as its tokens come.

A byte-fallback tokenizer (LLaMA-2's, that of the paper's models) spells a rare character in byte tokens
(龘 is `<0xE9><0xBE><0x98>`), and its decoder reads a run of byte tokens as one: a run that is not UTF-8 as a
whole decodes to one U+FFFD a byte, the characters it completed included. So 龘 followed by `<0xE9><0xBE>` and
"▁hello" decodes to "����� hello": the text of a run is known only once the run ends, and a stream that sent 龘
when its last byte came had sent text the answer does not hold. (tokenizers' `DecodeStream`, which transformers
serve streams with, then refuses the next token: "Invalid prefix encountered while decoding stream", and the
stream died.) A stream here holds back a run of byte tokens until a token that is not one ends it, or the answer
does; skipped special tokens are held with it (decoding leaves them out, so the run goes on across them).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence

    import tokenizers
    import torch
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


class HeldTokens:
    """Whether a token may continue a run of byte tokens, so that text ending in it may not be sent yet: a byte
    token (`<0x..>`, as tokenizers' byte-fallback decoder tells one), or a special token that decoding skips.

    Args:
        tokenizer: a tokenizers `Tokenizer`, or a transformers tokenizer (its Rust backend's, where it has one).
        skip_special_tokens: whether the text is decoded without special tokens.
    """

    def __init__(self, tokenizer: tokenizers.Tokenizer | PreTrainedTokenizerBase, skip_special_tokens: bool):
        backend = tokenizer if hasattr(tokenizer, "id_to_token") else getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            self._token = backend.id_to_token
            specials = {i for i, token in backend.get_added_tokens_decoder().items() if token.special}
        else:  # a tokenizer without a Rust backend
            self._token = tokenizer.convert_ids_to_tokens
            specials = set(tokenizer.all_special_ids)
        self._skipped = specials if skip_special_tokens else set()

    def __call__(self, token: int) -> bool:
        """Whether text ending in `token` may yet change with the tokens after it."""
        if token in self._skipped:
            return True
        name = self._token(token)
        # (the byte-fallback decoder's own test: 6 characters, "<0x", two hex digits, ">")
        return name is not None and len(name) == 6 and name.startswith("<0x") and name.endswith(">") and _hex(name[3:5])


def _hex(digits: str) -> bool:
    try:
        int(digits, 16)
    except ValueError:
        return False
    return True


class StreamText:
    """An answer's text in pieces as its tokens come, which with `rest()` add up to the whole answer decoded.

    A stand-in for tokenizers' `DecodeStream` (the same `step`): the tokens go to a `DecodeStream` (a step a
    token, whatever the answer's length), but a run of byte tokens (`HeldTokens`) only once it has ended. Should
    `DecodeStream` refuse a token all the same, the answer is decoded whole from there, each piece what the
    whole adds to what was sent (from the start with a tokenizer that has no Rust backend). `rest()`, at the
    end, is what the answer's text holds that was not sent: a run still held, or an unfinished character's
    replacement characters (which `DecodeStream` holds back until a token that never comes completes them).

    Args:
        tokenizer: the tokenizers `Tokenizer` that decodes, or a transformers tokenizer (decoding with its Rust
            backend where it has one).
        skip_special_tokens: whether the text is decoded without special tokens.
        context: tokens before the answer (a prompt's last few), decoded with it and their own text left out: the
            answer's text as it continues them (`continuation`: a SentencePiece word-start keeps its space).
    """

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer | PreTrainedTokenizerBase,
        skip_special_tokens: bool,
        context: Sequence[int] = (),
    ):
        from tokenizers.decoders import DecodeStream

        self.tokenizer, self.skip_special_tokens, self.context = tokenizer, skip_special_tokens, list(context)
        self.backend = tokenizer if hasattr(tokenizer, "id_to_token") else getattr(tokenizer, "backend_tokenizer", None)
        self.held = HeldTokens(tokenizer, skip_special_tokens)
        self.stream: DecodeStream | None = None
        if self.backend is not None:
            self.stream = DecodeStream(self.context, skip_special_tokens=skip_special_tokens)
        self.ids: list[int] = []  # every token of the answer (`rest`, and decoding whole once DecodeStream refused)
        self.waiting: list[int] = []  # tokens held back, not given to DecodeStream yet
        self.sent = ""  # the text given out so far
        self.warned = False

    def step(self, tokenizer: object, token: int | list[int]) -> str | None:
        """Read the answer's next token (or tokens): the text that may be sent now, or None. (`tokenizer`, which
        `DecodeStream.step` takes, is not read: the one given at construction decodes.)"""
        tokens = [token] if isinstance(token, int) else list(token)
        self.ids.extend(tokens)
        self.waiting.extend(tokens)
        if not self.waiting or self.held(self.waiting[-1]):
            return None  # (a run of byte tokens that the next token may go on with)
        waiting, self.waiting = self.waiting, []
        if self.stream is not None:
            try:
                piece = self.stream.step(self.backend, waiting)
            except Exception as error:  # noqa: BLE001 - tokenizers' own error, of no narrower type
                logger.info("DecodeStream refused a token (%s): this answer is decoded whole from here", error)
                self.stream = None
            else:
                self.sent += piece or ""
                return piece
        whole = self._decode()
        if whole.endswith("\ufffd"):  # (an unfinished character: sent with the token that completes it)
            return None
        if not whole.startswith(self.sent):
            # text already sent is not how the answer decodes now: it cannot be taken back; said, and the stream
            # goes on from the answer's text as it is
            self._changed(whole)
            return None
        piece, self.sent = whole[len(self.sent) :], whole
        return piece or None

    def rest(self) -> str:
        """What the answer's whole text holds after what was sent (at its end: the text still held back)."""
        whole = self._decode()
        if not whole.startswith(self.sent):
            self._changed(whole)
            return ""
        rest, self.sent = whole[len(self.sent) :], whole
        return rest

    def _changed(self, whole: str) -> None:
        if not self.warned:
            self.warned = True
            logger.warning("a streamed answer's text changed after it was sent: sent %r, now %r", self.sent, whole)
        self.sent = whole

    def _decode(self) -> str:
        return continuation(self.tokenizer, self.context, self.ids, self.skip_special_tokens)


def continuation(
    tokenizer: tokenizers.Tokenizer | PreTrainedTokenizerBase,
    prompt_ids: Sequence[int] | torch.Tensor,
    new_ids: Sequence[int] | torch.Tensor,
    skip_special_tokens: bool = True,
) -> str:
    """The text `new_ids` add after `prompt_ids`: the decoded whole less the decoded prompt.

    Decoding the new tokens alone loses what depends on the token before them: a SentencePiece tokenizer
    (Llama 2's, that of the paper's models) drops the space a word-start piece opens with, so "Hello" and
    " world" printed as "Helloworld".
    """
    prompt, new = _as_list(prompt_ids), _as_list(new_ids)
    if not prompt:
        return tokenizer.decode(new, skip_special_tokens=skip_special_tokens)
    whole = tokenizer.decode(prompt + new, skip_special_tokens=skip_special_tokens)
    before = tokenizer.decode(prompt, skip_special_tokens=skip_special_tokens)
    if whole.startswith(before):
        return whole[len(before) :]
    return tokenizer.decode(new, skip_special_tokens=skip_special_tokens)  # (the prompt's text changed when decoded on)


def _as_list(ids: Sequence[int] | torch.Tensor) -> list[int]:
    return ids.tolist() if hasattr(ids, "tolist") else list(ids)
