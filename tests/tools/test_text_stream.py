"""A streamed answer's text, piece by piece (`modeling_gpn.cli.text_stream.StreamText`, what `gpn serve`'s stream
decodes with), adds up to the answer decoded whole, for any run of LLaMA-2's byte tokens, special tokens skipped
or not. (A real server streaming such answers: tests/tools/test_serve.py; `gpn generate`'s stream:
tests/tools/test_generate_cli.py.)"""

from __future__ import annotations

import logging
import random

import pytest

from ..environment import require_shared
from ..tiny_models import BYTE_RUNS


@pytest.fixture(scope="module")
def llama_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(require_shared("data/llama2-tokenizer"))


def streamed(tokenizer, ids: list[int], skip_special_tokens: bool) -> tuple[list[str | None], str]:
    """Each step's piece, and the rest at the end."""
    from modeling_gpn.cli.text_stream import StreamText

    backend = tokenizer.backend_tokenizer
    text = StreamText(backend, skip_special_tokens)
    return [text.step(backend, token) for token in ids], text.rest()


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_the_pieces_add_up_to_the_whole_answer(llama_tokenizer, skip_special_tokens):
    """Random answers over byte tokens (of a 3-byte and a 4-byte character, and ASCII), words and special tokens:
    the pieces and the rest are the answer decoded whole, as a non-streamed answer is (a special token between
    byte tokens, skipped, joins their runs). tokenizers' `DecodeStream` alone fails most of these."""
    names = ["<0xE9>", "<0xBE>", "<0x98>", "<0xF0>", "<0x41>", "▁hello", "▁a", "é", "</s>", "<s>", "<unk>"]
    pool = llama_tokenizer.convert_tokens_to_ids(names)
    sample = random.Random(0)
    for _ in range(400):
        ids = [sample.choice(pool) for _ in range(sample.randint(1, 10))]
        pieces, rest = streamed(llama_tokenizer, ids, skip_special_tokens)
        whole = llama_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert "".join(piece or "" for piece in pieces) + rest == whole, llama_tokenizer.convert_ids_to_tokens(ids)


def test_a_run_of_byte_tokens_is_sent_with_the_token_that_ends_it(llama_tokenizer):
    """龘 <0xE9><0xBE> "▁hello": nothing until "▁hello", then the run's five replacement characters with it."""
    pieces, rest = streamed(llama_tokenizer, BYTE_RUNS, True)
    assert pieces == [None] * 5 + ["\ufffd" * 5 + " hello"] and rest == ""
    pieces, rest = streamed(llama_tokenizer, BYTE_RUNS[:3], True)  # (an answer ending on 龘: sent at its end)
    assert pieces == [None] * 3 and rest == "龘"


def test_text_that_changes_after_it_was_sent_is_said_and_the_stream_goes_on(llama_tokenizer, caplog):
    """Should `DecodeStream` refuse a token all the same (here made to, by holding nothing back), the answer is
    decoded whole from there and the stream goes on; text already sent that the whole no longer begins with
    cannot be taken back, and the log says so."""
    from modeling_gpn.cli.text_stream import StreamText

    backend = llama_tokenizer.backend_tokenizer
    text = StreamText(backend, skip_special_tokens=True)
    text.held = lambda token: False  # (every byte token given to DecodeStream as it comes, as transformers does)
    world = llama_tokenizer.convert_tokens_to_ids("▁world")
    with caplog.at_level(logging.INFO, logger="modeling_gpn.cli.text_stream"):
        pieces = [text.step(backend, token) for token in [*BYTE_RUNS, world]]
    assert pieces == [None, None, "龘", None, None, None, " world"] and text.stream is None
    assert "changed after it was sent" in caplog.text and "'龘'" in caplog.text
