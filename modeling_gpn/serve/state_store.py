"""The state store of `gpn serve`: GPN states kept by the token ids they have read.

A GPN's whole context is one `GPNCache` of fixed size, so a server can keep the state a conversation has
reached and answer its next turn by reading only what is new. The OpenAI API is stateless (every chat turn
resends the whole history), so states are found by content: each is kept under a SHA-256 of the model it
belongs to and the token ids it has read, and a request continues from the longest kept prefix of its ids.

- Exact, never approximate: a hit compares the kept ids with the request's, token for token (the hash only
  finds candidates), and `keep` refuses a state whose own fingerprint of what it read (`read_fingerprint`)
  is not that of the ids it is kept under. The model key covers the configuration, the weights' dtype and
  every parameter, so a state is never reused for another model, prefix or dtype.
- Bounded: the states in memory take at most `max_bytes` (state buffers and kept ids); the least recently
  used are evicted first. With a `spill_dir` an evicted state is written there as a state file
  (`GPNCache.save`, beside a small JSON of its ids) and read back (`GPNCache.load`, which checks the file
  belongs to the model) when a request needs it; the folder is bounded too (`spill_max_bytes`): every store
  on it (each server on one `--state-dir`) writes and trims it under a hold on the folder, counting the state
  files every store left there, so the servers together keep to the bound; each finds the states the others
  wrote there. A journal in the folder (`JOURNAL`) tells each store which states the others changed since it
  last held the folder, so a save looks at those alone, not at every file. A server started on a folder that
  holds such files continues from them (a server that stops writes the states still in memory there too:
  `spill_all`).
- Thread-safe: one lock guards the store; every method may be called from any thread.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import re
import secrets
import threading
import time
import weakref
from array import array
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import GPNCache, GPNStateFileError
from ..atomic_files import held, write_file_atomically
from ..configuration_gpn import GPNConfig
from ..state_file import (
    gpn_base_model,
    smallest_state_file_bytes,
    smallest_state_file_bytes_of,
    state_fingerprint,
    state_shapes,
    weights_hash,
    weights_kind,
)

logger = logging.getLogger(__name__)

STATE_SUFFIX = ".gpnstate.safetensors"
IDS_SUFFIX = ".ids.json"
# What an entry costs beyond its buffers and ids (the Python objects, the index); small, but it keeps a
# flood of tiny states from escaping the byte limit.
ENTRY_OVERHEAD_BYTES = 512
# A write (a state file, then its ids) takes well under this: what a killed server left half-done in the folder,
# older than this, is no write in progress (of another server on the folder) and is deleted when a store opens it.
LEFTOVER_AGE_SECONDS = 600
# In the folder: a mark that every store rewrites, under the folder's hold, when it has changed the folder's state
# files ("GENERATION:OFFSET" of the journal below; a server of before the journal writes a random one): a store that
# finds the mark it last saw, or one of the journal's generation it follows, knows what changed from the journal alone.
CHANGE_MARK = ".gpn-state-dir-changed"
# In the folder: the keys of the states each store changed (wrote, deleted, or read and so made the most recently
# used), appended under the folder's hold before the change, one line each after a header naming the journal's
# generation. A store reads the lines added since its last hold and looks at those states' files alone, instead of
# listing the folder (thousands of states: tens of milliseconds a save); it lists the folder again only where the
# journal cannot tell it (another generation, a mark written by an older server, no journal).
JOURNAL = ".gpn-state-dir-journal"
_JOURNAL_HEADER = "gpn-state-dir-journal 1 "
_JOURNAL_LINE = 65  # (a key, 64 hex digits, and its newline)
# the journal starts a new generation (the other stores list the folder once) past this many lines per state held
JOURNAL_LINES_PER_STATE = 4
JOURNAL_LEAST_LINES = 1024
_STATE_NAME = re.compile(rf"^[0-9a-f]{{64}}{re.escape(STATE_SUFFIX)}$")
_HEX = re.compile("[0-9a-f]{64}")
_IDS_NAME = re.compile(rf"^[0-9a-f]{{64}}{re.escape(IDS_SUFFIX)}$")
# the temporary names `atomic_files.replacing` writes under (the ids file, `GPNCache.save`, a new journal's header):
# "." + the file's name + ".tmp-..."
_LEFTOVER_TEMPORARY = re.compile(
    rf"^\.([0-9a-f]{{64}}({re.escape(STATE_SUFFIX)}|{re.escape(IDS_SUFFIX)})|{re.escape(JOURNAL)})\.tmp-"
)

# where the model was read from, and by which transformers: not what it computes
_CONFIG_NOT_MEANING = ("_name_or_path", "transformers_version", "name_or_path")
_model_keys: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_model_keys_lock = threading.Lock()


def model_key(model: torch.nn.Module) -> str:
    """SHA-256 naming a model's states: its class, its whole configuration (a state file records only the fields
    that give a state its meaning), the bytes of every parameter (`state_file.weights_hash`) and buffer; hashed
    once a model, which a server does not edit."""
    with _model_keys_lock:
        known = _model_keys.get(model)
        if known is not None:
            return known
        config = {name: value for name, value in model.config.to_dict().items() if name not in _CONFIG_NOT_MEANING}
        digest = hashlib.sha256(f"{type(model).__name__}{json.dumps(config, sort_keys=True, default=str)}".encode())
        digest.update(weights_hash(model).encode())
        for name, tensor in model.named_buffers():
            data = tensor.detach().to("cpu").contiguous()
            digest.update(f"{name}{tuple(data.shape)}{data.dtype}".encode())
            digest.update(data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b"")
        key = digest.hexdigest()
        _model_keys[model] = key
        return key


def _ids_file(model: str, ids: Sequence[int]) -> bytes:
    """What the ids file beside a spilled state holds: the model's key and the ids, as JSON."""
    return json.dumps({"model": model, "ids": list(ids)}).encode()


def _ids_bytes(ids: Sequence[int]) -> bytes:
    return array("q", ids).tobytes()


def _entry_key(model: str, ids: bytes) -> str:
    return hashlib.sha256(model.encode() + ids).hexdigest()


@dataclass
class _Entry:
    model: str  # `model_key` of the model the state belongs to
    ids: bytes  # the token ids read, int64 (compared exactly on every hit)
    cache: GPNCache | None = None  # in memory; None once spilled to a file
    nbytes: int = 0  # what it counts against its tier's limit

    @property
    def length(self) -> int:
        return len(self.ids) // 8


class _Journal:
    """The folder's journal (`JOURNAL`) as one hold of the folder reads and extends it: its generation (None: no
    journal, or not one this code reads), its bytes, the place up to which its lines were read (`offset`), and
    whether its lines since this store's view are whole (`trusted`: no change of an older server between)."""

    def __init__(self, path: Path) -> None:
        self.path, self.generation, self.size, self.offset = path, None, 0, 0
        self.trusted, self.failed = False, False
        self._reading = self._writing = None
        with contextlib.suppress(OSError, ValueError):
            self._reading = open(path, "rb")  # noqa: SIM115  (closed by `close`, at the hold's end)
            header = self._reading.readline(len(_JOURNAL_HEADER) + 64).decode()
            if header.startswith(_JOURNAL_HEADER) and header.endswith("\n"):
                self.generation = header[len(_JOURNAL_HEADER) : -1]
                self.size = os.fstat(self._reading.fileno()).st_size
                self.offset = self.size

    def lines_since(self, offset: int) -> list[str] | None:
        """The keys appended since `offset` (the place a view last read to), `offset` moved past them; None where
        the journal cannot tell (shorter than that place, or a line that is no key: the folder is read again)."""
        if self.generation is None or self._reading is None or offset > self.size:
            return None
        try:
            self._reading.seek(offset)
            data = self._reading.read(self.size - offset)
        except OSError:
            return None
        whole = len(data) - len(data) % _JOURNAL_LINE  # (a line a killed store left half-written: not read)
        keys = data[:whole].decode("ascii", errors="replace").split("\n")[:-1] if whole else []
        if any(len(key) != 64 or _HEX.fullmatch(key) is None for key in keys):
            return None
        self.offset = offset + whole
        return list(dict.fromkeys(keys))  # (each state looked at once)

    def append(self, key: str, limit: int) -> None:
        """Note `key` as changing; the first note of a hold starts a new generation where this journal cannot
        be extended (none yet, lines not whole since this store's view, a line left half-written, past `limit`
        bytes): the other stores read the folder once, then follow the new one."""
        if self._writing is None:
            self.begin(limit)
        if self.failed:
            return
        try:
            if self._writing is None:
                self._writing = open(self.path, "ab")  # noqa: SIM115  (closed by `close`)
            self._writing.write(f"{key}\n".encode())
            self._writing.flush()
            self.offset = self.size = self.offset + _JOURNAL_LINE
        except OSError:  # (a read-only folder: the mark is left random, so every store reads the folder again)
            self.failed = True

    def begin(self, limit: int) -> bool:
        """Start a new generation where this journal cannot be extended (see `append`); whether it started one."""
        if self.failed or (self.trusted and self.generation is not None and self.offset == self.size <= limit):
            return False
        try:
            generation = secrets.token_hex(8)
            write_file_atomically(self.path, f"{_JOURNAL_HEADER}{generation}\n")
        except OSError:
            self.failed = True
            return False
        self.generation, self.trusted = generation, True
        self.offset = self.size = len(_JOURNAL_HEADER) + len(generation) + 1
        return True

    def mark(self) -> str:
        """The change mark to write after changing the folder: the journal's generation and end, or, where the
        journal could not be written, a random one (as an older server's: the other stores read the folder)."""
        if self.failed or self.generation is None:
            self.generation, self.trusted = None, False
            return secrets.token_hex(8)
        return f"{self.generation}:{self.offset}"

    def close(self) -> None:
        for handle in (self._reading, self._writing):
            if handle is not None:
                with contextlib.suppress(OSError):
                    handle.close()
        self._reading = self._writing = None


@dataclass
class _FolderView:
    """What a store knew of the folder when it last let go of it: the mark it saw or wrote, the journal's generation
    and the place read to, whether that journal was whole, and the folder's states (`StateStore._folder`)."""

    mark: str | None
    generation: str | None
    offset: int
    trusted: bool
    folder: OrderedDict[str, tuple[int, int]]
    folder_bytes: int

    def changed_since(self, mark: str | None, journal: _Journal) -> list[str] | None:
        """The states changed since (their keys, from the journal), or None where the folder must be read again:
        the journal of another generation (started anew, or gone), or a mark neither the one this view saw nor
        one of its generation's (an older server changed the folder: its change is in no journal)."""
        if journal.generation is None or journal.generation != self.generation:
            return [] if journal.generation is None and self.generation is None and mark == self.mark else None
        if mark != self.mark and not (mark or "").startswith(f"{self.generation}:"):
            return None
        return journal.lines_since(self.offset)


@dataclass
class StoreStats:
    """Counts since start: lookups that found a state, and the prompt tokens they spared reading."""

    hits: int = 0
    misses: int = 0
    reused_tokens: int = 0
    kept: int = 0
    evicted: int = 0
    spilled: int = 0
    loaded_from_files: int = 0
    refused: dict[str, int] = field(default_factory=dict)


class StateStore:
    """Bounded store of GPN states (batch 1) keyed by the model and the token ids they have read.

    Args:
        max_bytes: the most the states in memory may take (buffers and ids); least recently used evicted.
        spill_dir: a folder to write evicted states to (state files), read back when a request needs one;
            states already there (from an earlier run) are found too. None: evicted states are dropped.
        spill_max_bytes: the most the folder's state files may take, every store's on it together (`_folder_held`);
            the least recently used are deleted.
    """

    def __init__(self, max_bytes: int, spill_dir: str | os.PathLike | None = None, spill_max_bytes: int | None = None):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        if spill_dir is not None and spill_max_bytes is not None and spill_max_bytes < 1:
            # (0 would write every state and delete it at once, and delete the other servers' states on the folder)
            raise ValueError(f"spill_max_bytes must be at least 1 with a spill_dir, got {spill_max_bytes}")
        self.max_bytes = max_bytes
        self.spill_dir = None if spill_dir is None else Path(spill_dir)
        self.spill_max_bytes = spill_max_bytes
        self._told_too_large = False  # whether a state larger than spill_max_bytes was logged
        self.stats = StoreStats()
        self._lock = threading.RLock()
        self._memory: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._files: OrderedDict[str, _Entry] = OrderedDict()
        self._memory_bytes = 0
        self._file_bytes = 0
        # the folder's state files as every store on it left them (key -> (modification time, bytes), oldest
        # first) and their bytes: None while this store does not hold the folder. Kept between holds (`_view`), with
        # the change mark and the journal's place this store last saw: brought up to date from the journal's new
        # lines, or read again where the journal cannot tell what changed (`_folder_held`).
        self._folder: OrderedDict[str, tuple[int, int]] | None = None
        self._folder_bytes = 0
        self._view: _FolderView | None = None
        self._journal: _Journal | None = None  # (while held: the journal as this store knows it)
        self._changed = False
        self._unusable: set[str] = set()  # another store's states whose ids file could not be read (not retried)
        self._holding = False  # (this store holds the folder: a nested hold is the same one)
        # what reading the folder found of each file (name -> (inode, modification time, bytes)): an ids file is looked
        # at again only where its name is new or names another file (a scan is one listing and a stat of each state
        # file, whose modification time is when a store last read it, not a stat of each file)
        self._seen: dict[str, tuple[int, int, int]] = {}
        self._lengths: dict[str, dict[int, int]] = {}  # model -> {length: entries of that length}, both tiers
        # model key -> what a state file names the model by (`state_fingerprint`), taken while the model was loaded:
        # a server that unloads an idle model (--model-timeout) still writes its states to files
        self._model_fingerprints: dict[str, dict[str, str]] = {}
        if self.spill_dir is not None:
            self.spill_dir.mkdir(parents=True, exist_ok=True)
            self._index_spill_dir()

    # ---- what the server calls ------------------------------------------------------------------------

    def lookup(
        self, model: torch.nn.Module, ids: Sequence[int], max_length: int | None = None
    ) -> tuple[int, GPNCache] | None:
        """The longest kept state whose ids are a prefix of `ids` (at most `max_length` of them), as
        `(length, cache)`: a private copy the caller may advance. None when no kept state fits."""
        key_of_model = model_key(model)
        ids_bytes = _ids_bytes(ids)
        limit = len(ids) if max_length is None else min(max_length, len(ids))
        # (the folder held for the whole lookup, once: the states another store on it wrote or took since are found,
        # and a state file read back cannot be trimmed by another store between the look and the read)
        with self._lock, self._folder_held() if self.spill_dir is not None else contextlib.nullcontext():
            candidates = sorted(length for length in self._lengths.get(key_of_model, {}) if 0 < length <= limit)
            digests, hasher, done = {}, hashlib.sha256(key_of_model.encode()), 0
            for length in candidates:  # one pass over the ids, a digest at each kept length
                hasher.update(ids_bytes[done * 8 : length * 8])
                digests[length], done = hasher.copy().hexdigest(), length
            for length in reversed(candidates):
                key = digests[length]
                entry = self._memory.get(key) or self._files.get(key)
                if entry is None or entry.model != key_of_model or entry.ids != ids_bytes[: length * 8]:
                    continue
                cache = self._take(key, entry, model)
                if cache is None:  # its file could not be read back: dropped, look further
                    continue
                self.stats.hits += 1
                self.stats.reused_tokens += length
                return length, cache
            self.stats.misses += 1
            return None

    def keep(self, model: torch.nn.Module, ids: Sequence[int], cache: GPNCache) -> bool:
        """Keep `cache` (one row, having read exactly `ids`; the store takes it: do not advance it after)
        under `ids`. Returns whether it was kept (a state that does not match its ids is refused, logged)."""
        problem = self._mismatch(ids, cache)
        if problem is not None:
            with self._lock:
                self.stats.refused[problem] = self.stats.refused.get(problem, 0) + 1
            logger.warning("state store: not keeping a state: %s", problem)
            return False
        key_of_model = model_key(model)
        ids_bytes = _ids_bytes(ids)
        key = _entry_key(key_of_model, ids_bytes)
        nbytes = self.entry_bytes(cache, len(ids))
        with self._lock:
            self._remember_model(key_of_model, model)
            self._forget(key)
            if nbytes > self.max_bytes:
                if self.spill_dir is None:
                    return False
                self._count_length(key_of_model, len(ids), +1)  # (taken back if it cannot be written)
                self._spill(key, _Entry(key_of_model, ids_bytes, cache, nbytes))
                self.stats.kept += key in self._files
                return key in self._files
            self._memory[key] = _Entry(key_of_model, ids_bytes, cache, nbytes)
            self._memory_bytes += nbytes
            self._count_length(key_of_model, len(ids), +1)
            self.stats.kept += 1
            self._evict()
            return True

    def spill_all(self) -> None:
        """Write every state in memory to the spill folder, least recently used first (so the folder's limit
        drops those first), for a server that stops: one restarted on the folder continues from them. Nothing
        without a spill folder."""
        if self.spill_dir is None:
            return
        with self._lock, self._folder_held():  # (held once for all: the folder read once, not at every state)
            while self._memory:
                key, entry = self._memory.popitem(last=False)
                self._memory_bytes -= entry.nbytes
                self._spill(key, entry)

    def summary(self) -> dict:
        """Sizes and counts, for logs and tests."""
        with self._lock:
            return {
                "states_in_memory": len(self._memory),
                "memory_bytes": self._memory_bytes,
                "max_bytes": self.max_bytes,
                "states_in_files": len(self._files),
                "file_bytes": self._file_bytes,
                "spill_max_bytes": self.spill_max_bytes,
                **{
                    name: getattr(self.stats, name)
                    for name in ("hits", "misses", "reused_tokens", "kept", "evicted", "spilled", "loaded_from_files")
                },
                "refused": dict(self.stats.refused),
            }

    @staticmethod
    def entry_bytes(cache: GPNCache, length: int) -> int:
        """What keeping `cache` under `length` ids counts against the memory limit."""
        return cache.nbytes() + 8 * length + ENTRY_OVERHEAD_BYTES

    @staticmethod
    def smallest_entry_bytes(config: GPNConfig) -> int:
        """The least `entry_bytes` of a state of a model of `config`: one id read (its buffers, p, g and M, are
        float32 and of one size from the first position on). A `max_bytes` below it keeps no state in memory."""
        return 4 * sum(math.prod(shape) for shape in state_shapes(config).values()) + 8 + ENTRY_OVERHEAD_BYTES

    @staticmethod
    def smallest_files_bytes(config: GPNConfig, dtype: str, quantized: str | None = None) -> int:
        """The fewest bytes the files of one spilled state of a model of `config`, of float `dtype` and quantized as
        `quantized` ("int8", "int4", None), take (its state file, at its smallest, `smallest_state_file_bytes`, and
        the JSON of one id, beside it, as `_spill` writes them): a `spill_max_bytes` below it deletes every state
        once written."""
        return smallest_state_file_bytes(config, dtype, quantized) + len(_ids_file("0" * 64, [0]))  # (a SHA-256 key)

    def refuse_a_model_over_the_folder_bound(self, model: torch.nn.Module, name: str) -> None:
        """A `ValueError` where one state of `model` (as loaded, named `name`) takes more than `spill_max_bytes`:
        every kept conversation would be deleted once written. Exact for any quantization of its weights (the
        state file its fingerprint gives, `smallest_state_file_bytes_of`, and the ids of one token), where the
        configuration alone (`smallest_files_bytes`, checked before the load) is exact for torchao's int8 and int4
        only. Nothing without a spill folder or its bound."""
        if self.spill_dir is None or self.spill_max_bytes is None:
            return
        least = smallest_state_file_bytes_of(gpn_base_model(model)) + len(_ids_file("0" * 64, [0]))
        if self.spill_max_bytes < least:
            raise ValueError(
                f"--state-dir-bytes {self.spill_max_bytes} is smaller than one state of {name} as loaded (its state "
                f"file and ids take at least {least} bytes, its weights {weights_kind(gpn_base_model(model))}): every "
                f"kept conversation would be deleted once written; give --state-dir-bytes {least} or more"
            )

    # ---- inside --------------------------------------------------------------------------------------

    @staticmethod
    def _mismatch(ids: Sequence[int], cache: GPNCache) -> str | None:
        if not isinstance(cache, GPNCache) or not cache.has_state:
            return "not a GPNCache holding a state"
        if cache.state_layer.batch_size != 1:
            return f"{cache.state_layer.batch_size} rows (a kept state has one)"
        if cache.get_seq_length() != len(ids):
            return f"it has read {cache.get_seq_length()} positions, not the {len(ids)} ids it would be kept under"
        read = cache.read_fingerprint()
        if read is None:
            return "it has no record of the positions it read"
        probe = GPNCache()  # the fingerprint of `ids` read, as a cache records it
        probe.record_read(torch.tensor([list(ids)], dtype=torch.long), None)
        if not torch.equal(read.cpu(), probe.read_fingerprint().cpu()):
            return "the positions it read are not the ids it would be kept under"
        return None

    def _take(self, key: str, entry: _Entry, model: torch.nn.Module) -> GPNCache | None:
        """A copy of the entry's state, the entry made most recently used (read back into memory when spilled)."""
        if entry.cache is not None:
            self._memory.move_to_end(key)
            return entry.cache.fork(1)
        path = self._state_path(key)
        try:
            cache = GPNCache.load(path, model)
        except (GPNStateFileError, TypeError) as error:
            logger.warning("state store: dropping %s: %s", path, error)
            self._forget(key)
            return None
        problem = self._mismatch(_ids_from_bytes(entry.ids), cache)
        if problem is not None:
            logger.warning("state store: dropping %s: %s", path, problem)
            self._forget(key)
            return None
        self.stats.loaded_from_files += 1
        nbytes = self.entry_bytes(cache, entry.length)
        if nbytes > self.max_bytes:  # larger than the memory tier: it stays a file
            self._files.move_to_end(key)
            # used now: the folder's trims, by modification time, keep it longer, every store's (a change of the
            # folder, which the others must see: without it they trimmed by their older view, this state first)
            with self._folder_held(), contextlib.suppress(OSError):
                self._changing(key)
                os.utime(path)
                if self._folder is not None and key in self._folder:
                    self._folder_put(key, path.stat().st_mtime_ns, self._files[key].nbytes)  # the newest
            return cache
        # back into memory (most recently used); the file goes, so each state lives in one tier
        self._remember_model(entry.model, model)
        self._forget(key)
        self._memory[key] = _Entry(entry.model, entry.ids, cache.fork(1), nbytes)
        self._memory_bytes += nbytes
        self._count_length(entry.model, entry.length, +1)
        self._evict()
        return cache

    def _evict(self) -> None:
        while self._memory_bytes > self.max_bytes and self._memory:
            key, entry = self._memory.popitem(last=False)
            self._memory_bytes -= entry.nbytes
            self.stats.evicted += 1
            if self.spill_dir is not None:
                self._spill(key, entry)
            else:
                self._count_length(entry.model, entry.length, -1)

    def _spill(self, key: str, entry: _Entry) -> None:
        """Write an evicted state to the folder (the state file, then its ids: both written under a temporary
        name and renamed, so a file's presence means it is whole); drop it when it cannot be written."""
        path, ids_path = self._state_path(key), self._ids_path(key)
        with self._folder_held():
            self._changing(key)
            try:
                # named by the fingerprint taken while the model was loaded: it may have been unloaded since
                entry.cache.save(path, model_fingerprint=self._model_fingerprints.get(entry.model))
                write_file_atomically(ids_path, _ids_file(entry.model, _ids_from_bytes(entry.ids)))
                # both files count against the folder's limit: the ids outweigh the state in a long conversation
                stat = path.stat()
                size = stat.st_size + ids_path.stat().st_size
            except (OSError, ValueError) as error:
                logger.warning("state store: cannot write %s, the state is dropped: %s", path, error)
                _remove(path)
                _remove(ids_path)
                self._count_length(entry.model, entry.length, -1)
                return
            if self.spill_max_bytes is not None and size > self.spill_max_bytes and not self._told_too_large:
                self._told_too_large = True  # (once: every state of the model is as large)
                logger.warning(
                    "state store: a state's files take %d bytes, more than the folder's bound (%d bytes, "
                    "--state-dir-bytes): it is deleted once written, and so is every state this large",
                    size,
                    self.spill_max_bytes,
                )
            self._unindex_file(key)  # (another store's write of this state, found since)
            self._files[key] = _Entry(entry.model, entry.ids, None, size)
            self._file_bytes += size
            self.stats.spilled += 1
            if self._folder is not None:
                self._folder_put(key, stat.st_mtime_ns, size)  # the newest
            self._trim_files()

    @contextlib.contextmanager
    def _folder_held(self) -> Iterator[None]:
        """Hold the spill folder (an flock on it, waited for while another store on it writes or trims) for the
        block, with `_folder` as the stores left it: this store's view brought up to date from the journal's new
        lines (`JOURNAL`: the states another store changed since, each looked at), or the folder read again where
        the journal cannot tell (`_read_folder`); a folder found over `spill_max_bytes` (a store killed between a
        write and its trim) trimmed first. Without a limit on the folder, nothing is held. Reentrant:
        `spill_all` holds it once for all the states it writes."""
        if self.spill_max_bytes is None or self._holding:
            yield
            return
        hold = held(self.spill_dir, "that writes its states", wait=lambda in_use: None)
        try:
            hold.__enter__()
        except OSError as error:  # (the folder gone or unreadable: the write that follows fails and says so)
            logger.warning(
                "state store: cannot hold %s (%s): only this server's files are bounded", self.spill_dir, error
            )
            yield
            return
        with contextlib.ExitStack() as stack:
            stack.push(hold)
            self._holding = True
            mark_path = self.spill_dir / CHANGE_MARK
            try:
                mark = mark_path.read_text(encoding="utf-8")
            except (OSError, ValueError):
                mark = None
            view, self._view, self._changed = self._view, None, False
            journal = _Journal(self.spill_dir / JOURNAL)
            self._journal = journal
            changed = view.changed_since(mark, journal) if view is not None else None
            if changed is not None:
                self._folder, self._folder_bytes = view.folder, view.folder_bytes
                journal.trusted = view.trusted
                for key in changed:  # (what another store changed since this one held the folder: those alone)
                    self._look_again(key)
            else:
                try:
                    self._folder = self._read_folder()
                except OSError as error:
                    logger.warning(
                        "state store: cannot read %s (%s): only this server's files are bounded", self.spill_dir, error
                    )
                    self._folder = None
                # the journal's lines are whole since this listing only where the mark is one a journaling store
                # wrote (an older server's change, after its random mark, is in no journal: a new generation first)
                journal.trusted = journal.generation is not None and (mark or "").startswith(journal.generation + ":")
            try:
                if self._folder is not None and self._folder_bytes > self.spill_max_bytes:
                    # (a store killed between writing a state and trimming left the folder over the bound: trimmed
                    # at the next hold of any store on it, a lookup's too, not only at the next save)
                    self._trim_files()
                yield
            finally:
                folder, self._folder, self._holding = self._folder, None, False
                journal, self._journal = self._journal, None
                journal.close()
                if folder is not None and self._changed:
                    mark = journal.mark()
                    try:
                        mark_path.write_text(mark, encoding="utf-8")
                    except OSError:  # (a read-only folder: nothing kept, the folder is read at the next hold)
                        folder = None
                if folder is not None:
                    self._view = _FolderView(
                        mark, journal.generation, journal.offset, journal.trusted, folder, self._folder_bytes
                    )

    def _changing(self, key: str) -> None:
        """Note in the journal, before the change, that this store changes state `key`'s files (called with the
        folder held): a store that reads the line later looks at what the files are by then, so a store killed
        in the middle of the change leaves nothing uncounted. A journal that cannot be written leaves the mark
        random (as an older server's), so that every store reads the folder again."""
        if self._folder is None or self._journal is None:
            return
        self._changed = True
        self._journal.append(key, self._journal_limit())

    def _journal_limit(self) -> int:
        """The journal's bytes past which a save starts a new generation: lines enough for every state held to
        change a few times, so the other stores' listings of the folder (one each a generation) cost a save little."""
        return _JOURNAL_LINE * max(JOURNAL_LEAST_LINES, JOURNAL_LINES_PER_STATE * len(self._folder))

    def _look_again(self, key: str) -> None:
        """Bring `_folder` up to date for one state another store changed: its files' size and time as they are
        now, or gone (a state this store knew whose files another store deleted leaves its index too; one it did
        not know is found, `_adopt`)."""
        state, ids = self._state_path(key), self._ids_path(key)
        try:
            state_stat, ids_stat = state.stat(), ids.stat()
        except OSError:  # (gone: read back into another store's memory, or trimmed)
            self._folder_drop(key)
            self._unindex_file(key)
            return
        size = state_stat.st_size + ids_stat.st_size
        self._seen[state.name] = (state_stat.st_ino, state_stat.st_mtime_ns, state_stat.st_size)
        self._seen[ids.name] = (ids_stat.st_ino, ids_stat.st_mtime_ns, ids_stat.st_size)
        self._folder_put(key, state_stat.st_mtime_ns, size)
        self._unusable.discard(key)
        self._adopt(key, size)

    def _adopt(self, key: str, size: int) -> None:
        """Index a state another store wrote to the folder (its ids file read and checked against its name), so
        that a lookup here finds it; one this store indexes already has its size brought up to date."""
        entry = self._files.get(key)
        if entry is not None:
            self._file_bytes += size - entry.nbytes
            entry.nbytes = size
            return
        if key in self._memory or key in self._unusable:
            return
        record = self._ids_record(key)
        if record is None:  # (not a state a store wrote: left alone, unused)
            self._unusable.add(key)
            return
        owner, ids_bytes = record
        self._index_file(key, _Entry(owner, ids_bytes, None, size))

    def _ids_record(self, key: str) -> tuple[str, bytes] | None:
        """The model key and ids (as `_ids_bytes`) that state `key`'s ids file holds, or None where it cannot be
        read, does not parse, holds no ids, or its name is not the hash of what it holds (not a state a store
        wrote)."""
        try:
            record = json.loads(self._ids_path(key).read_text(encoding="utf-8"))
            ids_bytes, owner = _ids_bytes([int(token) for token in record["ids"]]), str(record["model"])
        except (OSError, ValueError, KeyError, TypeError, OverflowError):
            return None
        if not ids_bytes or _entry_key(owner, ids_bytes) != key:
            return None
        return owner, ids_bytes

    def _folder_put(self, key: str, mtime: int, size: int) -> None:
        """`_folder` holds `key` as the most recently used state (its time `mtime`, its files `size` bytes)."""
        self._folder_drop(key)
        self._folder[key] = (mtime, size)
        self._folder_bytes += size

    def _folder_drop(self, key: str) -> None:
        known = self._folder.pop(key, None)
        if known is not None:
            self._folder_bytes -= known[1]

    def _read_folder(self) -> OrderedDict[str, tuple[int, int]]:
        """The folder's states (a state file with its ids beside it) as every store on it left them, least
        recently used first: key -> (modification time, bytes of both files), and their bytes in `_folder_bytes`.
        The entries of this store's index whose files are gone (another store took them back into memory, or
        trimmed them) leave the index; the states another store wrote join it (`_adopt`)."""
        with os.scandir(self.spill_dir) as scan:
            entries = {entry.name: entry for entry in scan}
        own = {key: rank for rank, key in enumerate(self._files)}  # (ties of modification time: this store's order)
        found, seen = [], {}
        for name, entry in entries.items():
            ids = entries.get(name[:64] + IDS_SUFFIX) if _STATE_NAME.match(name) else None
            if ids is None:
                continue
            try:
                for file in (entry, ids):
                    known = self._seen.get(file.name)
                    if known is None or known[0] != file.inode() or file is entry:
                        stat = file.stat()
                        known = (file.inode(), stat.st_mtime_ns, stat.st_size)
                    seen[file.name] = known
            except OSError:  # (deleted meanwhile, outside the hold: a state read back into another store's memory)
                continue
            size = seen[name][2] + seen[ids.name][2]
            found.append((seen[name][1], own.get(name[:64], -1), name[:64], size))
        self._seen = seen
        folder = OrderedDict((key, (mtime, size)) for mtime, _, key, size in sorted(found))
        self._folder_bytes = sum(size for _, size in folder.values())
        for key in [key for key in self._files if key not in folder]:
            self._unindex_file(key)
        self._unusable &= folder.keys()
        for key, (_, size) in folder.items():
            self._adopt(key, size)
        return folder

    def _trim_files(self) -> None:
        """Delete the least recently used states of the folder, whichever store wrote them, until the state files
        of every store on it fit `spill_max_bytes` (called with the folder held)."""
        if self.spill_max_bytes is None:
            return
        if self._folder is None:  # (the folder could not be held: this store's files alone, as it knows them)
            while self._file_bytes > self.spill_max_bytes and self._files:
                self._forget(next(iter(self._files)))
            return
        while self._folder_bytes > self.spill_max_bytes and self._folder:
            key = next(iter(self._folder))
            self._changing(key)
            self._folder_drop(key)
            self._unindex_file(key)
            _remove(self._state_path(key))
            _remove(self._ids_path(key))

    def _forget(self, key: str) -> None:
        """Remove an entry from whichever tier holds it (deleting its files)."""
        entry = self._memory.pop(key, None)
        if entry is not None:
            self._memory_bytes -= entry.nbytes
            self._count_length(entry.model, entry.length, -1)
        if self._unindex_file(key) is not None:
            with self._folder_held():  # (a change of the folder, which the other stores on it must see)
                self._changing(key)
                _remove(self._state_path(key))
                _remove(self._ids_path(key))
                if self._folder is not None:
                    self._folder_drop(key)

    def _index_file(self, key: str, entry: _Entry) -> None:
        """Put a state found in the folder (`entry`, its files' bytes as `nbytes`) into this store's index of the
        folder's states, its bytes and its length counted (`_unindex_file` takes it out)."""
        self._files[key] = entry
        self._file_bytes += entry.nbytes
        self._count_length(entry.model, entry.length, +1)

    def _unindex_file(self, key: str) -> _Entry | None:
        """Take `key` out of this store's index of the folder's states (its bytes and its length uncounted), its
        files left as they are; the entry, or None where the index did not hold it."""
        entry = self._files.pop(key, None)
        if entry is not None:
            self._file_bytes -= entry.nbytes
            self._count_length(entry.model, entry.length, -1)
        return entry

    def _remember_model(self, key_of_model: str, model: torch.nn.Module) -> None:
        if key_of_model not in self._model_fingerprints:
            self._model_fingerprints[key_of_model] = state_fingerprint(gpn_base_model(model))

    def _count_length(self, model: str, length: int, change: int) -> None:
        lengths = self._lengths.setdefault(model, {})
        lengths[length] = lengths.get(length, 0) + change
        if lengths[length] <= 0:
            del lengths[length]

    def _delete_leftovers(self) -> None:
        """Delete, once older than `LEFTOVER_AGE_SECONDS`, the temporary files of this store's writes, its state
        files without their ids (a killed write) and its ids files without their state (a server killed between a
        trim's two deletions: never counted against the folder's limit, and never read, so never deleted) (only
        names of this store's own: a user's state file in the folder is left)."""
        now = time.time()
        for path in self.spill_dir.iterdir():
            temporary = _LEFTOVER_TEMPORARY.match(path.name)
            unlisted = _STATE_NAME.match(path.name) and not self._ids_path(path.name[:64]).exists()
            stateless = _IDS_NAME.match(path.name) and not self._state_path(path.name[:64]).exists()
            if not (temporary or unlisted or stateless):
                continue
            try:
                if now - path.stat().st_mtime > LEFTOVER_AGE_SECONDS:
                    path.unlink()
                    logger.warning("state store: deleted %s, left by a write that did not finish", path)
            except OSError:  # (gone meanwhile, or not ours to delete: left as it is)
                continue

    def _state_path(self, key: str) -> Path:
        return self.spill_dir / f"{key}{STATE_SUFFIX}"

    def _ids_path(self, key: str) -> Path:
        return self.spill_dir / f"{key}{IDS_SUFFIX}"

    def _index_spill_dir(self) -> None:
        """Find the states an earlier run left in the folder (oldest first). Files that do not parse, or whose
        name is not the hash of what they say they hold, are left alone (and not used). What a server killed
        while writing left (a temporary file, a state file whose ids were never written) is deleted: counted
        nowhere, it would take the disk beyond the folder's limit, one killed write after another. They are deleted
        under the folder's hold: outside it, a leftover looked at and then deleted could be another store's state
        written in that instant under the same name (its ids, or its state file, deleted: a state its index and the
        others' count, gone)."""
        found = []
        for ids_path in self.spill_dir.glob(f"*{IDS_SUFFIX}"):
            key = ids_path.name.removesuffix(IDS_SUFFIX)
            record = self._ids_record(key)
            if record is None:
                continue
            owner, ids_bytes = record
            try:
                stat = self._state_path(key).stat()
                size = stat.st_size + ids_path.stat().st_size  # both files count, as when they were written
            except OSError:
                continue
            found.append((stat.st_mtime, key, _Entry(owner, ids_bytes, None, size)))
        for _, key, entry in sorted(found, key=lambda item: item[0]):
            self._index_file(key, entry)
        with self._folder_held():
            self._delete_leftovers()
            self._trim_files()
            # a journal this store can follow, started now where there is none whole (the other stores on the
            # folder list it once, then follow it; without it the next save here would start it)
            if self._journal is not None and self._folder is not None and self._journal.begin(self._journal_limit()):
                self._changed = True


def _remove(path: Path) -> None:
    """Delete one of the store's files, if there. One that cannot be deleted (the folder turned read-only: a file
    system remounted so after an error) is left, logged: the entry is gone from the index all the same. (An error
    here failed the request whose state had just been read back from that file, and stopped a store writing its
    other states at shutdown; on a read-only file system deleting a file that is not there fails too.)"""
    try:
        path.unlink(missing_ok=True)
    except OSError as error:
        if path.exists():
            logger.warning("state store: cannot delete %s: %s", path, error.strerror or error)


def _ids_from_bytes(ids: bytes) -> list[int]:
    values = array("q")
    values.frombytes(ids)
    return values.tolist()
