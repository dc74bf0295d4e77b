"""Tokenizers: one `load_tokenizer` for the whole project (training, inspection), a byte-level BPE trained on a
corpus, and `PieceEncoder`, which encodes a long document's pieces to the tokens of the whole document.

`load_tokenizer` loads any Hugging Face tokenizer by name or path, or (`bpe`) trains a byte-level BPE on the
corpus with `tokenizers` (cached, and saved with the model at the end). Training joins documents with EOS,
so there it must have an EOS token.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from .cache import content_hash, default_cache_dir, tell_on_stderr, write_folder_atomically, writing_alone
from .corpus import CorpusSpec
from .errors import DataError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

DEFAULT_TOKENIZER = "meta-llama/Llama-2-7b-hf"
# the files a saved tokenizer folder holds one of at least (transformers' fast, SentencePiece and BPE formats)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
BPE_EOS = "<|endoftext|>"


def train_bpe_tokenizer(documents: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE `PreTrainedTokenizerFast` trained on `documents`, with EOS `<|endoftext|>` = id 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 257:
        raise DataError(f"A byte-level BPE needs a vocabulary of at least 257 tokens, got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BPE_EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=BPE_EOS, pad_token=BPE_EOS, model_max_length=int(1e9)
    )


def names_a_local_path(name: str) -> bool:
    """Whether `name` can only be a local path, never a Hub id (`owner/name`): it starts with `/`, `.` or `~`,
    or has more than one `/`. (The rule every gpn command applies to a model or tokenizer argument.)"""
    return name.startswith((".", "/", "~")) or name.count("/") > 1


# why a name that is no folder here cannot be read as a Hub repo either (with offline Hub access), the cwd filled in
NEITHER_FOLDER_NOR_CACHED = (
    "is neither a folder here (in {cwd}) nor a Hub repo in the local cache, and HF_HUB_OFFLINE=1 keeps the Hub "
    "from being asked: give the folder's path, or download the repo first (without HF_HUB_OFFLINE)"
)


def readable_offline(repo_id: str, files: tuple[str, ...]) -> bool:
    """False only where the Hub cannot be asked (HF_HUB_OFFLINE=1) and its local cache holds none of `files` of
    `repo_id`; True otherwise, for a name that is no valid repo id too (its load names that). A name that is no
    folder here and cannot be read from the Hub either was refused by transformers as a network fault only ("We
    couldn't connect to 'https://huggingface.co'"), where the user had mistyped a folder or run from another one."""
    import huggingface_hub
    from huggingface_hub.errors import HFValidationError

    if not huggingface_hub.constants.HF_HUB_OFFLINE:
        return True
    try:
        return any(isinstance(huggingface_hub.try_to_load_from_cache(repo_id, name), str) for name in files)
    except HFValidationError:
        return True


def check_tokenizer_path(name: str) -> None:
    """Refuse, naming it, a local path (`names_a_local_path`) that does not exist: transformers would take it for
    a malformed Hub id ("Repo id must be in the form 'repo_name'..."). A Hub id passes, but offline only when the
    local Hub cache holds it (`readable_offline`)."""
    if names_a_local_path(name) and not Path(name).expanduser().exists():
        raise DataError(f"tokenizer folder {name} does not exist")
    if not Path(name).expanduser().exists() and not readable_offline(name, TOKENIZER_FILES):
        raise DataError(f"Cannot load tokenizer {name!r}: it {NEITHER_FOLDER_NOR_CACHED.format(cwd=Path.cwd())}")


def load_tokenizer(
    name_or_path: str,
    corpus: CorpusSpec | None = None,
    bpe_vocab_size: int = 8192,
    bpe_max_documents: int | None = 100_000,
    cache_dir: Path | None = None,
    *,
    trust_remote_code: bool = False,
    require_eos: bool = True,
    tell: Callable[[str], None] | None = tell_on_stderr,
) -> PreTrainedTokenizerBase:
    """The tokenizer named `name_or_path` (a Hub id or a folder), or (`"bpe"`, given a `corpus`) a byte-level
    BPE trained on `corpus` and cached. Where another process is training the same BPE into the same cache, wait
    for it (`tell` says whom for) and read what it wrote, rather than train it a second time
    (`cache.writing_alone`). A process killed meanwhile releases the wait, and this one trains it.

    Raises `DataError` if it cannot be loaded or (with `require_eos`, as training needs) has no EOS token.
    """
    from transformers import AutoTokenizer

    if name_or_path == "bpe" and corpus is not None:
        key = content_hash({"corpus": corpus.fingerprint(), "vocab": bpe_vocab_size, "docs": bpe_max_documents, "v": 1})
        folder = Path(cache_dir or default_cache_dir()) / "tokenizers" / f"bpe-{bpe_vocab_size}-{key}"
        if (folder / "tokenizer.json").exists():  # (trained before: read without a hold, a read-only cache serves)
            return _cached_bpe(folder)
        with writing_alone(folder, "the BPE tokenizer", tell):
            if (folder / "tokenizer.json").exists():  # trained by the process this one waited for
                return _cached_bpe(folder)
            tokenizer = train_bpe_tokenizer(_bpe_training_texts(corpus, bpe_max_documents), bpe_vocab_size)
            write_folder_atomically(folder, tokenizer.save_pretrained)
        return tokenizer
    check_tokenizer_path(name_or_path)
    folder = Path(name_or_path).expanduser()
    if folder.is_dir() and not any((folder / name).is_file() for name in TOKENIZER_FILES):
        # (transformers would say it cannot build a backend tokenizer and ask for sentencepiece)
        raise DataError(
            f"{name_or_path} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}): save the tokenizer "
            "beside the model (tokenizer.save_pretrained), or name one with --tokenizer"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            str(folder) if folder.exists() else name_or_path, trust_remote_code=trust_remote_code
        )
    except Exception as error:  # noqa: BLE001
        raise DataError(f"Cannot load tokenizer {name_or_path!r}: {_one_line(error)}") from error
    if require_eos and tokenizer.eos_token_id is None:
        raise DataError(
            f"Tokenizer {name_or_path!r} has no EOS token: documents are joined with EOS, so set `eos_token` "
            "in its tokenizer_config.json or use --tokenizer bpe"
        )
    return tokenizer


def _cached_bpe(folder: Path) -> PreTrainedTokenizerBase:
    """The BPE tokenizer trained and cached in `folder`; a `DataError` naming the folder where it cannot be read."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as error:  # noqa: BLE001  (a file of it damaged: a JSON error naming no file)
        raise DataError(
            f"The cached BPE tokenizer {folder} cannot be loaded ({_one_line(error)}): delete "
            "that folder and run again to train it anew"
        ) from error


def _one_line(error: Exception) -> str:
    """`error` as one line, its type first (transformers' offline message runs over two)."""
    return f"{type(error).__name__}: {' '.join(str(error).split())}"


def _bpe_training_texts(corpus: CorpusSpec, max_documents: int | None) -> Iterator[str]:
    """The texts of the first `max_documents` documents, a long one in pieces (the byte-level
    pre-tokenizer splits at the pieces' line breaks anyway, so the trainer counts the same words)."""
    documents = 0
    for text, _continues, ends in corpus.document_pieces():
        if max_documents is not None and documents >= max_documents:
            return
        yield text
        documents += ends


class PieceEncoder:
    """Token ids of document pieces as they are inside the whole document.

    A piece that continues a document starts just after a line break; it is encoded after a line break
    (`"\n" + piece`) and that line break's own tokens are dropped, so a tokenizer that marks the start
    of a text (SentencePiece's leading "▁") sees the piece as it sees it mid-document. `safe_cut(before,
    after)` says whether a cut between two lines keeps the tokens of the two lines whole.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer
        self.newline_ids = self._encode(["\n"])[0]

    def _encode(self, texts: list[str]) -> list[list[int]]:
        return self.tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]

    def encode(self, pieces: list[tuple[str, bool]]) -> list[list[int] | None]:
        """ids of each (text, continues) piece; None where the line break's tokens are not a prefix."""
        encoded = self._encode(["\n" + text if continues else text for text, continues in pieces])
        width = len(self.newline_ids)
        out: list[list[int] | None] = []
        for (_text, continues), ids in zip(pieces, encoded):
            if continues:
                out.append(ids[width:] if ids[:width] == self.newline_ids else None)
            else:
                out.append(ids)
        return out

    def safe_cut(self, before: str, after: str) -> bool:
        """Whether cutting the text between `before` and `after` keeps the tokens the same."""
        whole, left, right = self.encode([(before + after, True), (before, True), (after, True)])
        return None not in (whole, left, right) and whole == left + right


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """What identifies a tokenizer for the token cache: its whole definition and its EOS id."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    content = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    return content_hash({"tokenizer": content, "eos": tokenizer.eos_token_id})


def continuation_ids(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> list[list[int]]:
    """The token ids of each of `texts` as text that follows other text: what the tokenizer makes of it in the
    middle of a document (no special tokens added), to continue a saved state with.

    Tokenized alone, a SentencePiece tokenizer (Llama 2's, that of the paper's models) puts a word-start piece
    "▁" in front of a text, as for a document's first word: "\\nUser:" read after a state as " \\nUser:" and
    "ing" as " ing", ids that the same text read in one piece never holds. Each text is tokenized behind one of
    the tokenizer's special tokens instead (the text after it is no document's start, and nothing merges across
    it), which is then dropped; a tokenizer with no special token of one id, or that still adds a piece after one,
    gives what tokenizing the text alone gives. A word cut at the boundary ("Hel" then "lo") still tokenizes as
    two words: the text before is not read again."""
    marker = next(
        (
            (token, ids[0])
            for token in tokenizer.all_special_tokens
            if len(ids := tokenizer(token, add_special_tokens=False)["input_ids"]) == 1
        ),
        None,
    )
    result = []
    for text in texts:
        ids = None
        if marker is not None:
            marked = tokenizer(marker[0] + text, add_special_tokens=False)["input_ids"]
            ids = marked[1:] if marked[:1] == [marker[1]] else None
        result.append(ids if ids is not None else tokenizer(text, add_special_tokens=False)["input_ids"])
    return result
