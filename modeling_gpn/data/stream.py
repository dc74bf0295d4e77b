"""The token stream on disk: a corpus tokenized once, documents joined with EOS (`doc EOS doc EOS ...`), in
memory-mapped shards (`tokens-00000.bin`, uint16 or uint32) with a `meta.json`.

The cache folder's key is made of the corpus, the tokenizer and the token budget: a second run with the
same inputs memory-maps the shards instead of tokenizing again (each shard's size and a digest of a few slices
of it are checked against `meta.json`; a damaged cache is an error naming the file and the folder to delete). A long document is
tokenized piece by piece (`corpus.text_file_pieces`, `tokenizer.PieceEncoder`) to the tokens of the whole
document, so memory stays bounded by the piece size.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

from . import corpus as corpus_module  # (its PIECE_CHARS read at call time: one setting for both modules)
from .cache import content_hash, default_cache_dir, tell_on_stderr, write_folder_atomically, writing_alone
from .corpus import CorpusSpec
from .errors import DataError
from .tokenizer import PieceEncoder, tokenizer_fingerprint

CACHE_FORMAT_VERSION = 1
SHARD_TOKENS = 1 << 24  # tokens per cache shard file


class TokenStream:
    """A tokenized corpus memory-mapped from its shards; `tokens(start, stop)` reads across shards."""

    def __init__(self, folder: Path):
        """Open the cache in `folder`; a damaged `meta.json` or a shard whose size disagrees with it is a
        `DataError` naming the file and how to rebuild the cache."""
        self.folder = Path(folder)
        meta_path = self.folder / "meta.json"
        try:
            self.meta = json.loads(meta_path.read_text(encoding="utf-8"))
            dtype = np.dtype(self.meta["dtype"])
            names, lengths = list(self.meta["shards"]), [int(n) for n in self.meta["shard_tokens"]]
            self.vocab_size = int(self.meta["vocab_size"])
            if dtype not in (np.uint16, np.uint32) or len(names) != len(lengths) or min(lengths, default=0) < 0:
                raise ValueError(f"dtype {dtype}, {len(names)} shards, lengths {lengths[:4]}...")
            if any(not isinstance(name, str) or Path(name).name != name for name in names):
                raise ValueError(f"shard names {names[:4]}... are not file names")
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise DataError(
                f"The token cache file {meta_path} is damaged ({type(error).__name__}: {error}); {self.rebuild_hint}"
            ) from error
        self.paths = [self.folder / name for name in names]
        for path, length in zip(self.paths, lengths):
            try:
                size = path.stat().st_size
            except OSError as error:
                raise DataError(
                    f"The token cache shard {path} is missing or unreadable ({error}); {self.rebuild_hint}"
                ) from error
            if size != length * dtype.itemsize:
                raise DataError(
                    f"The token cache shard {path} is damaged: it has {size:,} bytes, but {meta_path} says {length:,} "
                    f"{dtype.name} tokens ({length * dtype.itemsize:,} bytes); {self.rebuild_hint}"
                )
        self.shards = [
            np.memmap(path, dtype=dtype, mode="r", shape=(length,)) for path, length in zip(self.paths, lengths)
        ]
        # A shard of the right size overwritten with ids the tokenizer has (zeros: a block lost in a crash) only
        # shows in its content: a few slices of each are checked against the digest written with it. (Caches
        # written before the digest have none to check.)
        for path, shard, expected in zip(self.paths, self.shards, self.meta.get("shard_sample_sha256") or []):
            if shard_sample_digest(shard) != expected:
                raise DataError(
                    f"The token cache shard {path} is damaged: its tokens differ from those written ({meta_path} "
                    f"holds a digest of a few slices of each shard); {self.rebuild_hint}"
                )
        self.offsets = np.cumsum([0] + lengths)
        self.reused = False

    @property
    def rebuild_hint(self) -> str:
        """What to do when the cached stream is damaged: the folder to delete."""
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

    def __getitem__(self, index: slice) -> np.ndarray:
        """`stream[start:stop]`: the tokens as int64, as `tokens(start, stop)` (so the stream reads like a
        sequence of token ids, as the evaluation's windows read it)."""
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError(f"a TokenStream is read by contiguous slices, not {index!r}")
        start, stop, _ = index.indices(len(self))
        return self.tokens(start, max(start, stop))


def build_token_stream(
    corpus: CorpusSpec,
    tokenizer: PreTrainedTokenizerBase,
    cache_dir: Path | None = None,
    max_tokens: int | None = None,
    show_progress: bool = True,
    tell: Callable[[str], None] | None = tell_on_stderr,
) -> TokenStream:
    """Tokenize `corpus` once (documents joined with EOS) into memory-mapped shards, or reuse the cache. Where
    another process is writing the same cache, wait for it (`tell` says whom for) and read what it wrote.

    Raises `DataError` when the corpus yields no tokens or its files cannot be read.
    """
    if tokenizer.eos_token_id is None:
        raise DataError("The tokenizer has no EOS token: documents are joined with EOS")
    made_from = {
        "corpus": corpus.fingerprint(),
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "max_tokens": max_tokens,
    }
    key = content_hash({**made_from, "version": CACHE_FORMAT_VERSION})
    folder = Path(cache_dir or default_cache_dir()) / "tokens" / key
    if (folder / "meta.json").exists():  # (a cache written: read without a hold, so a read-only cache folder serves)
        return _reused(folder, made_from)
    with writing_alone(folder, "the token cache", tell):
        if (folder / "meta.json").exists():  # written by the process this one waited for
            return _reused(folder, made_from)
        write_folder_atomically(folder, lambda tmp: tokenize_into(tmp, corpus, tokenizer, max_tokens, show_progress))
    return TokenStream(folder)


def _reused(folder: Path, made_from: dict) -> TokenStream:
    """The cache written in `folder`, checked to be made from `made_from`."""
    stream = TokenStream(folder)
    # The folder's name is the key, its meta.json says what it was written from: another cache's files put in
    # its place (another tokenizer's ids, another corpus) would be read as this corpus's tokens, in silence.
    written = {name: stream.meta.get(name) for name in made_from}
    # (each compared as meta.json gives it back, through JSON: a tuple in a fingerprint reads as a list)
    differ = [name for name in made_from if json.loads(json.dumps(made_from[name])) != written[name]]
    if differ:
        raise DataError(
            f"The token cache {folder / 'meta.json'} was written for another {' and '.join(differ)} than this "
            f"run's (files of another cache put in its place?); {stream.rebuild_hint}"
        )
    stream.reused = True
    return stream


def tokenize_into(
    folder: Path, corpus: CorpusSpec, tokenizer: PreTrainedTokenizerBase, max_tokens: int | None, show_progress: bool
) -> None:
    """Write the shards of `corpus` (at most `max_tokens` tokens) and their `meta.json` into `folder`."""
    from tqdm.auto import tqdm

    vocab = len(tokenizer)
    dtype = np.uint16 if vocab <= np.iinfo(np.uint16).max + 1 else np.uint32
    eos = tokenizer.eos_token_id
    shards = ShardWriter(folder)
    documents = total = 0
    bar = tqdm(
        desc="tokenizing",
        unit="tok",
        unit_scale=True,
        total=max_tokens,
        disable=not show_progress,
        mininterval=1.0,
    )
    encoder = PieceEncoder(tokenizer)
    pieces = corpus.document_pieces(encoder.safe_cut)
    try:
        for batch in _batched_by_size(pieces, 256, corpus_module.PIECE_CHARS):
            encoded = encoder.encode([(text, continues) for text, continues, _ends in batch])
            for (_text, _continues, ends), ids in zip(batch, encoded):
                if ids is None:  # safe_cut checked this cut: the tokenizer changed its mind
                    raise DataError(f"Cannot tokenize {corpus.describe()} in pieces with this tokenizer")
                ids = np.asarray(ids + [eos] if ends else ids, dtype=dtype)
                truncated = max_tokens is not None and total + ids.size >= max_tokens
                if truncated:
                    ids = ids[: max_tokens - total]
                shards.append(ids)
                total += ids.size
                documents += ends or truncated
                bar.update(ids.size)
                if truncated:
                    break
            if max_tokens is not None and total >= max_tokens:
                break
    finally:
        shards.close()
    bar.close()
    if total == 0:
        raise DataError(f"{corpus.describe()} yielded no tokens")
    meta = {
        "corpus": corpus.fingerprint(),
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "eos_token_id": eos,
        "vocab_size": vocab,
        "dtype": np.dtype(dtype).name,
        "shards": shards.names,
        "shard_tokens": shards.lengths,
        "shard_sample_sha256": [
            shard_sample_digest(np.memmap(folder / name, dtype=dtype, mode="r", shape=(length,)))
            for name, length in zip(shards.names, shards.lengths)
        ],
        "documents": documents,
        "tokens": total,
        "max_tokens": max_tokens,
    }
    with open(folder / "meta.json", "w", encoding="utf-8") as handle:
        handle.write(json.dumps(meta, indent=1))
        handle.flush()
        os.fsync(handle.fileno())  # (the shards are fsynced as they close): on disk before the folder is renamed


SAMPLE_SLICES, SAMPLE_SLICE_TOKENS = 16, 256


def sample_digest(total: int, read: Callable[[int, int], np.ndarray], slices: int, slice_tokens: int = 256) -> str:
    """SHA-256 of a token sequence's length `total` and `slices` slices of `slice_tokens` spread evenly over it (the
    first and the last included), each `read(start, stop)`: a few reads whatever its size, and any change of its
    length, or of the tokens at those places, shows. (A shard's own check below; `gpn train`'s checkpoints compare
    the whole stream's on --resume, `train.checkpoints.data_fingerprint`.)"""
    digest = hashlib.sha256(str(total).encode())
    room = max(0, total - slice_tokens)
    for index in range(slices):
        start = room * index // (slices - 1)
        digest.update(np.ascontiguousarray(read(start, min(total, start + slice_tokens))).tobytes())
    return digest.hexdigest()


def shard_sample_digest(shard: np.ndarray) -> str:
    """`sample_digest` of one shard, `SAMPLE_SLICES` slices of its tokens as stored."""
    return sample_digest(len(shard), lambda start, stop: shard[start:stop], SAMPLE_SLICES, SAMPLE_SLICE_TOKENS)


class ShardWriter:
    """Token ids written to shard files of `SHARD_TOKENS` tokens each (a new file when one is full): nothing is
    buffered, so memory does not grow with the corpus."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.names: list[str] = []
        self.lengths: list[int] = []
        self._file = None

    def append(self, ids: np.ndarray) -> None:
        """Write `ids`, opening a new shard file whenever the current one is full."""
        while ids.size:
            if self._file is None:
                self.names.append(f"tokens-{len(self.names):05d}.bin")
                self.lengths.append(0)
                self._file = open(self.folder / self.names[-1], "wb")
            take = min(SHARD_TOKENS - self.lengths[-1], ids.size)
            ids[:take].tofile(self._file)
            self.lengths[-1] += take
            ids = ids[take:]
            if self.lengths[-1] == SHARD_TOKENS:
                self.close()

    def close(self) -> None:
        """Flush, fsync and close the current shard."""
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None


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
