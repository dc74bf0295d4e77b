"""`gpn serve`'s state store and generation hook, in this process: what the server keeps, finds and forks.

- The store (`modeling_gpn/serve/state_store.py`): the longest kept prefix is found, exactly (ids compared,
  never another model's or dtype's state); memory is bounded in bytes, least recently used evicted; evicted
  states spill to a folder as state files, are read back, survive a restart, and the folder is bounded too.
- The hook (`modeling_gpn/serve/generation.py`): generate() through the store gives the tokens of generate()
  on the whole prompt, keeps the states before the prompt's last token and after the answer, and `n`
  answers fork one state (the prompt is read once).
- Saving one state file from several threads at once.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from modeling_gpn import GPNCache
from modeling_gpn.serve.generation import StateKeepingModel
from modeling_gpn.serve.state_store import STATE_SUFFIX, StateStore

from ..environment import small_disk
from ..subprocesses import another_process_holding
from ..tiny_models import perturbed_model, tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return perturbed_model(tiny_config(eos_token_id=None), seed=21)


def state_after(model, ids: list[int]) -> GPNCache:
    with torch.no_grad():
        return model(torch.tensor([ids]), use_cache=True, logits_to_keep=1).cache


def state_bytes(model) -> int:
    return StateStore.entry_bytes(state_after(model, [1]), len(IDS))


def same_state(a: GPNCache, b: GPNCache) -> bool:
    return a.get_seq_length() == b.get_seq_length() and all(
        torch.equal(x, y) for x, y in zip(a.get_state(), b.get_state())
    )


IDS = [5, 17, 3, 44, 8, 9, 60, 2, 31, 12]


def test_the_longest_kept_prefix_is_found_exactly(model):
    store = StateStore(1 << 20)
    for length in (3, 6):
        assert store.keep(model, IDS[:length], state_after(model, IDS[:length]))
    length, cache = store.lookup(model, IDS)
    assert length == 6 and same_state(cache, state_after(model, IDS[:6]))
    assert store.lookup(model, IDS, max_length=5)[0] == 3  # what the server asks: a prefix shorter than the prompt
    diverging = IDS[:4] + [90] + IDS[5:]
    assert store.lookup(model, diverging)[0] == 3
    assert store.lookup(model, [IDS[0] + 1] + IDS[1:]) is None
    # a private copy: advancing it leaves the kept state as it was
    with torch.no_grad():
        model(torch.tensor([IDS[6:8]]), attention_mask=torch.ones(1, 8, dtype=torch.long), cache=cache, use_cache=True)
    assert same_state(store.lookup(model, IDS)[1], state_after(model, IDS[:6]))


def test_a_state_is_never_used_for_another_model_or_dtype_or_other_ids(model):
    store = StateStore(1 << 20)
    assert store.keep(model, IDS[:6], state_after(model, IDS[:6]))
    other_weights = perturbed_model(tiny_config(eos_token_id=None), seed=22)
    assert store.lookup(other_weights, IDS) is None
    same_vectors = perturbed_model(tiny_config(eos_token_id=None), seed=21)  # only a matrix differs, as a merged LoRA
    with torch.no_grad():
        same_vectors.model.embed_tokens.weight[0, 0] += 1.0
    assert store.lookup(same_vectors, IDS) is None
    assert store.lookup(perturbed_model(tiny_config(eos_token_id=None), seed=21).to(torch.float64), IDS) is None
    assert (
        store.lookup(perturbed_model(tiny_config(eos_token_id=None), seed=21), IDS)[0] == 6
    )  # the same model, reloaded
    # a state is kept only under the ids it has read
    assert not store.keep(model, IDS[:6], state_after(model, IDS[1:7]))
    assert not store.keep(model, IDS[:5], state_after(model, IDS[:6]))
    assert store.summary()["refused"]


def test_memory_is_bounded_least_recently_used_evicted(model):
    cost = state_bytes(model)
    store = StateStore(2 * cost + cost // 2)  # room for two states
    for length in (2, 3, 4):
        store.keep(model, IDS[:length], state_after(model, IDS[:length]))
    assert store.summary()["states_in_memory"] == 2 and store.summary()["memory_bytes"] <= store.max_bytes
    assert store.lookup(model, IDS[:2]) is None  # the oldest went
    assert store.lookup(model, IDS[:3])[0] == 3  # used: now the most recent
    store.keep(model, IDS[:5], state_after(model, IDS[:5]))
    assert store.lookup(model, IDS[:4])[0] == 3  # 4 went (least recently used), 3 stayed
    assert store.lookup(model, IDS[:5])[0] == 5


def test_evicted_states_spill_to_files_and_come_back_after_a_restart(model, tmp_path):
    cost = state_bytes(model)
    store = StateStore(cost + cost // 2, spill_dir=tmp_path)  # one state in memory
    for length in (2, 3, 4):
        store.keep(model, IDS[:length], state_after(model, IDS[:length]))
    assert store.summary()["states_in_files"] == 2 and len(list(tmp_path.glob(f"*{STATE_SUFFIX}"))) == 2
    length, cache = store.lookup(model, IDS[:3])  # read back from its file
    assert length == 3 and same_state(cache, state_after(model, IDS[:3]))
    assert store.summary()["loaded_from_files"] == 1
    restarted = StateStore(cost + cost // 2, spill_dir=tmp_path)
    length, cache = restarted.lookup(model, IDS[:5])
    assert length in (2, 4) and same_state(cache, state_after(model, IDS[:length]))  # what was left in files
    assert restarted.lookup(perturbed_model(tiny_config(eos_token_id=None), seed=22), IDS) is None


def test_states_of_an_unloaded_model_still_spill_to_files(model, tmp_path):
    """An unpinned server unloads an idle model (--model-timeout): its states, evicted by another model's or
    written when the server stops, go to files all the same, and the model loaded again continues from them."""
    import gc

    cost = state_bytes(model)
    store = StateStore(cost + cost // 2, spill_dir=tmp_path)  # one state in memory
    unloaded = perturbed_model(tiny_config(eos_token_id=None), seed=23)
    for length in (3, 4):
        assert store.keep(unloaded, IDS[:length], state_after(unloaded, IDS[:length]))
    expected = {length: state_after(unloaded, IDS[:length]) for length in (3, 4)}
    del unloaded
    gc.collect()
    assert store.keep(model, IDS[:2], state_after(model, IDS[:2]))  # evicts the unloaded model's state of 4 ids
    store.spill_all()  # as the server does when it stops
    assert store.summary()["states_in_files"] == 3
    reloaded = perturbed_model(tiny_config(eos_token_id=None), seed=23)
    restarted = StateStore(cost + cost // 2, spill_dir=tmp_path)
    for length in (4, 3):
        found, cache = restarted.lookup(reloaded, IDS[:length])
        assert found == length and same_state(cache, expected[length])


def test_two_servers_on_one_state_dir_never_answer_from_a_state_another_removed(model, tmp_path):
    """Two servers on one --state-dir (two stores sharing nothing but the folder, as two processes would). Files are
    named by the model and the ids they hold, so both write the same state under the same name (whole: renamed
    into place); one server reads the files another's index knew at its start. A file the other server has since
    taken back into memory (deleting it) or trimmed is gone: the lookup drops it, logged, and continues from the
    longest state still there, never failing the request nor answering from another state."""
    first = StateStore(10 * state_bytes(model), spill_dir=tmp_path)
    for length in (3, 5):
        first.keep(model, IDS[:length], state_after(model, IDS[:length]))
    first.spill_all()  # (as a server that stops writes them: here, for the second server to find)
    second = StateStore(0, spill_dir=tmp_path)
    assert second.summary()["states_in_files"] == 2
    assert first.lookup(model, IDS[:5])[0] == 5  # back into the first's memory: its file deleted
    found, cache = second.lookup(model, IDS[:6])
    assert found == 3 and same_state(cache, state_after(model, IDS[:3]))
    assert second.summary()["states_in_files"] == 1


def test_servers_sharing_a_state_dir_keep_together_to_its_limit(model, tmp_path):
    """Each server bounded what it knew of a shared --state-dir by its --state-dir-bytes, so the folder held up to
    the sum of the servers' limits. A store writes and trims the folder under a hold on it (an flock, waited for:
    a real second process holding it keeps the write waiting), counting every store's state files: the folder
    stays within the limit, the least recently used states go, whichever server wrote them, and a server's index
    drops what the other trimmed."""

    def states() -> list:  # (the state files and their ids, beside the mark and journal the stores change)
        return [path for path in tmp_path.iterdir() if not path.name.startswith(".")]

    def on_disk() -> int:
        return sum(path.stat().st_size for path in states())

    sizing = StateStore(0, spill_dir=tmp_path / "sizing")
    assert sizing.keep(model, IDS[:9], state_after(model, IDS[:9]))
    pair = sum(path.stat().st_size for path in (tmp_path / "sizing").iterdir())  # the largest state's two files
    shutil.rmtree(tmp_path / "sizing")
    limit = 3 * pair + pair // 2  # three states, whoever wrote them
    first, second = (StateStore(0, spill_dir=tmp_path, spill_max_bytes=limit) for _ in range(2))  # files only
    with another_process_holding(tmp_path):
        writing = threading.Thread(target=first.keep, args=(model, IDS[:2], state_after(model, IDS[:2])))
        writing.start()
        writing.join(0.3)
        assert writing.is_alive() and on_disk() == 0  # waiting for the folder
    writing.join(60)
    assert first.summary()["states_in_files"] == 1
    for length in range(3, 9):  # the two servers in turn
        assert (first if length % 2 == 0 else second).keep(model, IDS[:length], state_after(model, IDS[:length]))
        assert on_disk() <= limit, (length, on_disk(), limit)
    assert sorted(path.name.endswith(STATE_SUFFIX) for path in states()) == [False] * 3 + [True] * 3
    assert first.lookup(model, IDS[:8])[0] == 8 and second.lookup(model, IDS[:7])[0] == 7  # the newest stay
    assert first.lookup(model, IDS[:5]) is None  # the oldest went, of both
    second.keep(model, IDS[:9], state_after(model, IDS[:9]))  # (the folder read again: the first's trimmed leave)
    assert second.summary()["file_bytes"] <= limit and on_disk() <= limit


def test_a_state_one_server_read_from_a_shared_state_dir_is_trimmed_last_by_the_other(model, tmp_path):
    """A state larger than the memory tier (here every state: `--state-store-bytes` below one) is read from its file
    and stays there, its modification time made now so that the folder's trims, least recently used first, keep it
    longer. The other server on the folder kept its view of the folder (the change mark unchanged) and the times it
    had read: it trimmed the state just read first, and kept the least recently used."""
    sizing = StateStore(0, spill_dir=tmp_path / "sizing")
    sizing.keep(model, IDS[:2], state_after(model, IDS[:2]))
    pair = sum(path.stat().st_size for path in (tmp_path / "sizing").iterdir())
    folder = tmp_path / "shared"
    first = StateStore(0, spill_dir=folder, spill_max_bytes=3 * pair + pair // 2)  # three states
    for length in (2, 3, 4):
        first.keep(model, IDS[:length], state_after(model, IDS[:length]))
        time.sleep(0.01)  # (modification times apart, on any file system's clock)
    second = StateStore(0, spill_dir=folder, spill_max_bytes=3 * pair + pair // 2)
    time.sleep(0.01)
    assert first.lookup(model, IDS[:2])[0] == 2  # the oldest written, read now
    assert second.keep(model, IDS[:5], state_after(model, IDS[:5]))
    assert second.lookup(model, IDS[:3])[0] == 2  # the state of 3 ids went (least recently used), that of 2 stayed


def pair_bytes(model, folder) -> int:
    """The bytes of the largest state of `IDS[:9]` (its state file and ids), as a store spills it."""
    StateStore(0, spill_dir=folder).keep(model, IDS[:9], state_after(model, IDS[:9]))
    size = sum(path.stat().st_size for path in folder.iterdir() if not path.name.startswith("."))
    shutil.rmtree(folder)
    return size


def written_elsewhere(model, ids, folder) -> None:
    """Move the files of the state after `ids` into `folder`, the newest there, as a store that neither journals nor
    marks its change would leave them (an older server's write, before its mark; one killed after its files)."""
    import os

    elsewhere = folder.parent / f"elsewhere-{len(ids)}"
    StateStore(0, spill_dir=elsewhere).keep(model, ids, state_after(model, ids))
    for path in elsewhere.iterdir():
        if not path.name.startswith("."):
            os.replace(path, folder / path.name)
            os.utime(folder / path.name)


def written_keys(model, ids_lists) -> list[str]:
    """The names (keys) of the files of the states after each of `ids_lists`."""
    from modeling_gpn.serve.state_store import _entry_key, _ids_bytes, model_key

    return [_entry_key(model_key(model), _ids_bytes(ids)) for ids in ids_lists]


@contextlib.contextmanager
def a_save_cut_off_after_its_files() -> Iterator[None]:
    """The block's save is cut off (KeyboardInterrupt, as a kill) once its files are written: before its mark and
    its trim."""
    import modeling_gpn.serve.state_store as state_store

    writing = state_store.write_file_atomically

    def killed_after_the_ids(path, data):
        writing(path, data)
        raise KeyboardInterrupt

    with pytest.MonkeyPatch.context() as patch, pytest.raises(KeyboardInterrupt):
        patch.setattr(state_store, "write_file_atomically", killed_after_the_ids)
        yield


def on_disk_bytes(folder) -> int:
    return sum(path.stat().st_size for path in folder.iterdir() if not path.name.startswith("."))


def test_a_save_into_a_shared_state_dir_reads_what_changed_not_the_folder(model, tmp_path, monkeypatch):
    """Two servers on one --state-dir listed the whole folder at each save (each found the other's mark): tens of
    thousands of states, hundreds of milliseconds a save. Each now reads the journal's lines added since its last
    hold and looks at those states alone: the folder is listed once, when a store opens it, however the two take
    turns; the bound still holds over both servers' states, and each finds the states the other wrote (looked up
    in the other's files) and no longer the ones the other deleted."""
    limit = 3 * pair_bytes(model, tmp_path / "sizing") + 100  # three states, whoever wrote them
    folder = tmp_path / "shared"
    first, second = (StateStore(0, spill_dir=folder, spill_max_bytes=limit) for _ in range(2))  # files only
    listings = []
    read_folder = StateStore._read_folder
    monkeypatch.setattr(StateStore, "_read_folder", lambda store: listings.append(store) or read_folder(store))
    for length in range(2, 8):  # the two servers in turn
        assert (first if length % 2 == 0 else second).keep(model, IDS[:length], state_after(model, IDS[:length]))
        assert on_disk_bytes(folder) <= limit, (length, on_disk_bytes(folder), limit)
    found, cache = first.lookup(model, IDS[:8])  # the second's newest state, found by the first
    assert found == 7 and same_state(cache, state_after(model, IDS[:7]))
    assert second.lookup(model, IDS[:7])[0] == 7 and second.lookup(model, IDS[:4]) is None  # trimmed, by the first
    assert first.summary()["states_in_files"] == second.summary()["states_in_files"] == 3
    assert listings == []


def test_a_shared_state_dir_changed_by_an_older_server_or_a_killed_save_is_read_again(model, tmp_path):
    """What the journal does not say is not trusted: a server of before the journal (its random mark, no line)
    changed the folder, so the store that sees its mark lists the folder, and starts a new generation of the
    journal, which sends every other store to list the folder too; a save cut off after its files (its line is
    written before them) is counted by the others; a line left half-written is not read, and the next save
    starts a new generation. The bound holds over every state there, all the way."""
    import os

    from modeling_gpn.serve.state_store import CHANGE_MARK, JOURNAL

    limit = 3 * pair_bytes(model, tmp_path / "sizing") + 100  # three states
    folder = tmp_path / "shared"
    first, second = (StateStore(0, spill_dir=folder, spill_max_bytes=limit) for _ in range(2))
    assert first.keep(model, IDS[:2], state_after(model, IDS[:2]))
    written_elsewhere(model, IDS[:3], folder)  # an older server's save: the files, then its random mark
    (folder / CHANGE_MARK).write_text("0123456789abcdef", encoding="utf-8")
    generation = (folder / JOURNAL).read_text(encoding="utf-8").split("\n")[0]
    assert first.keep(model, IDS[:4], state_after(model, IDS[:4]))  # lists the folder: three states
    assert (folder / JOURNAL).read_text(encoding="utf-8").split("\n")[0] != generation  # a new generation
    assert second.keep(model, IDS[:5], state_after(model, IDS[:5]))  # (lists it too: the oldest goes)
    assert on_disk_bytes(folder) <= limit and first.lookup(model, IDS[:2]) is None
    time.sleep(0.01)  # (modification times apart, on any file system's clock)
    read = folder / f"{written_keys(model, [IDS[:3]])[0]}{STATE_SUFFIX}"
    os.utime(read)  # the older server reads the state of 3 ids: the most recently used now, told by its mark alone
    (folder / CHANGE_MARK).write_text("fedcba9876543210", encoding="utf-8")
    assert first.keep(model, IDS[:1], state_after(model, IDS[:1]))  # (the folder listed, each file's time read)
    assert first.lookup(model, IDS[:4])[0] == 3  # the state of 4 ids went first, not the one just read
    assert second.lookup(model, IDS[:3])[0] == 3  # the older server's state, found

    with a_save_cut_off_after_its_files():  # (before its mark)
        first.keep(model, IDS[:6], state_after(model, IDS[:6]))
    assert second.keep(model, IDS[:7], state_after(model, IDS[:7]))
    assert on_disk_bytes(folder) <= limit and second.lookup(model, IDS[:6])[0] == 6  # counted, and found
    with open(folder / JOURNAL, "a", encoding="utf-8") as journal:  # (a store killed in the middle of a line)
        journal.write("0123")
    assert first.keep(model, IDS[:8], state_after(model, IDS[:8]))
    assert (folder / JOURNAL).read_text(encoding="utf-8").count("0123") == 0  # a new generation
    assert second.keep(model, IDS[:9], state_after(model, IDS[:9]))
    assert on_disk_bytes(folder) <= limit and first.lookup(model, IDS[:9])[0] == 9
    assert second.summary()["states_in_files"] == first.summary()["states_in_files"] == 3


def test_a_shared_state_dir_left_over_its_bound_by_a_killed_save_is_trimmed_at_the_next_lookup(model, tmp_path):
    """A server killed between writing a state and trimming the folder left it over --state-dir-bytes until the
    next save on it, however many lookups came between (each holds the folder). Now any store that holds the folder
    and finds it over its bound trims it: a lookup brings it back within the bound."""
    limit = 2 * pair_bytes(model, tmp_path / "sizing") + 100  # two states
    folder = tmp_path / "shared"
    first, second = (StateStore(0, spill_dir=folder, spill_max_bytes=limit) for _ in range(2))
    for length in (2, 3):
        assert first.keep(model, IDS[:length], state_after(model, IDS[:length]))
    with a_save_cut_off_after_its_files():  # (before its trim)
        first.keep(model, IDS[:4], state_after(model, IDS[:4]))
    assert on_disk_bytes(folder) > limit  # three states
    assert second.lookup(model, IDS[:3])[0] == 3
    assert on_disk_bytes(folder) <= limit and second.lookup(model, IDS[:2]) is None  # the oldest went


def test_the_journal_of_a_shared_state_dir_stays_bounded(model, tmp_path, monkeypatch):
    """The journal gains a line at every change: past its bound (lines per state held, and a least) a save starts
    a new generation, and the other stores list the folder once and follow it."""
    import modeling_gpn.serve.state_store as state_store

    monkeypatch.setattr(state_store, "JOURNAL_LEAST_LINES", 6)
    limit = 2 * pair_bytes(model, tmp_path / "sizing") + 100  # two states
    folder = tmp_path / "shared"
    first, second = (StateStore(0, spill_dir=folder, spill_max_bytes=limit) for _ in range(2))
    for length in range(1, 10):
        assert (first if length % 2 else second).keep(model, IDS[:length], state_after(model, IDS[:length]))
        assert (folder / state_store.JOURNAL).stat().st_size <= 100 + (6 + 2) * 65  # (a save's lines beyond)
        assert on_disk_bytes(folder) <= limit
    assert first.lookup(model, IDS)[0] == 9 and second.lookup(model, IDS[:8])[0] == 8


def test_the_spill_folder_is_bounded_and_a_damaged_file_is_dropped(model, tmp_path, caplog):
    state_after(model, IDS).save(tmp_path / "one-file")
    file_bytes = (tmp_path / "one-file").stat().st_size
    (tmp_path / "one-file").unlink()
    store = StateStore(0, spill_dir=tmp_path, spill_max_bytes=2 * file_bytes + file_bytes // 2)  # files only, two fit
    for length in (2, 3, 4):
        store.keep(model, IDS[:length], state_after(model, IDS[:length]))
    assert len(list(tmp_path.glob(f"*{STATE_SUFFIX}"))) == 2 and store.lookup(model, IDS[:2]) is None
    newest = max(tmp_path.glob(f"*{STATE_SUFFIX}"), key=lambda path: path.stat().st_mtime)
    data = bytearray(newest.read_bytes())
    data[-3] ^= 0xFF
    newest.write_bytes(bytes(data))
    assert store.lookup(model, IDS[:4])[0] == 3  # the damaged one is refused (checksum), the other serves
    assert not newest.exists()
    with pytest.raises(ValueError, match="spill_max_bytes must be at least 1"):  # (0 deleted every state at once)
        StateStore(0, spill_dir=tmp_path, spill_max_bytes=0)
    small = StateStore(0, spill_dir=tmp_path / "small", spill_max_bytes=file_bytes // 2)  # no state fits: said once
    with caplog.at_level(logging.WARNING, logger="modeling_gpn.serve.state_store"):
        for length in (2, 3):
            small.keep(model, IDS[:length], state_after(model, IDS[:length]))
    told = [record.getMessage() for record in caplog.records if "more than the folder's bound" in record.getMessage()]
    assert len(told) == 1 and "--state-dir-bytes" in told[0], caplog.records


def test_the_smallest_state_is_known_from_the_config(model, tmp_path):
    """`gpn serve` refuses a bound below one state before the model loads, from its config alone: the smallest
    files of a spilled state and the smallest entry in memory are those of a state of one id, to the byte, and a
    longer conversation's are larger."""
    from modeling_gpn.state_file import weights_kind

    least_files = StateStore.smallest_files_bytes(model.config, weights_kind(model))  # (float32: its name)
    for ids, exact in (([7], True), (IDS, False)):
        folder = tmp_path / str(len(ids))
        StateStore(0, spill_dir=folder).keep(model, ids, state_after(model, ids))
        files = sum(path.stat().st_size for path in folder.iterdir() if not path.name.startswith("."))
        assert files == least_files if exact else files > least_files, (ids, files, least_files)
    assert StateStore.smallest_entry_bytes(model.config) == StateStore.entry_bytes(state_after(model, [7]), 1)


def test_the_smallest_state_of_a_bf16_or_quantized_model_is_known_to_the_byte(model, tmp_path, monkeypatch):
    """The bound was exact for a float model only: a quantized model's file names its dtype longer ("bfloat16,
    quantized (Int8Tensor)", and `dtype_name` "int8"), so a --state-dir-bytes just above it was taken and every state
    then deleted once written. A bfloat16 model, and folders saved quantized to int8 and int4 (`TorchAoConfig`, what
    `gpn serve` loads quantized; `gpn generate --dtype int8 | int4` makes the same weights), spill a state of one id
    of exactly the bytes `gpn serve` refuses a bound below (`refuse_bounds_below_one_state`, from the folder's
    config.json), and a bound one byte less is refused."""
    import argparse

    torchao = pytest.importorskip("torchao.quantization", reason="torchao (the test extra) quantizes the models")
    from torchao.quantization.granularity import PerGroup
    from transformers import AutoModelForCausalLM, TorchAoConfig
    from transformers.cli.serving import model_manager

    from modeling_gpn.cli.quantization import quantized_as
    from modeling_gpn.serve.cli import refuse_bounds_below_one_state
    from modeling_gpn.serve.models import TransformersWithGPN, quantizing_model_manager

    monkeypatch.setattr(model_manager, "transformers", TransformersWithGPN())  # as gpn serve does, for this test only

    def spilled(model, folder) -> int:
        StateStore(0, spill_dir=folder).keep(model, [7], state_after(model, [7]))
        return sum(path.stat().st_size for path in folder.iterdir() if not path.name.startswith("."))

    float_folder = tmp_path / "float"
    model.save_pretrained(float_folder)
    bf16 = perturbed_model(tiny_config(eos_token_id=None), seed=21).to(torch.bfloat16)
    assert spilled(bf16, tmp_path / "bf16-states") == StateStore.smallest_files_bytes(model.config, "bfloat16")
    configs = {
        "int8": torchao.Int8WeightOnlyConfig(),
        "int4": torchao.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(16)),
    }
    for kind, quantization in configs.items():
        folder = tmp_path / kind
        AutoModelForCausalLM.from_pretrained(
            float_folder, dtype=torch.bfloat16, quantization_config=TorchAoConfig(quantization)
        ).save_pretrained(folder)
        files = spilled(AutoModelForCausalLM.from_pretrained(folder), tmp_path / f"{kind}-states")
        assert files == StateStore.smallest_files_bytes(model.config, "bfloat16", kind), kind
        args = argparse.Namespace(model=str(folder), state_dir=str(tmp_path), dtype="auto", state_dir_bytes=files)
        refuse_bounds_below_one_state(args)  # (the least that holds one state is allowed)
        args.state_dir_bytes = files - 1
        with pytest.raises(ValueError, match=f"--state-dir-bytes {files - 1} is smaller .* at least {files} bytes"):
            refuse_bounds_below_one_state(args)
        # `gpn serve FLOAT --dtype KIND` quantizes the bfloat16 model as the folder was: its states are as long, and
        # the bound is theirs (it was the float model's, the dtype named "int8" as if a float one)
        args = argparse.Namespace(model=str(float_folder), state_dir=str(tmp_path), dtype=kind, state_dir_bytes=files)
        refuse_bounds_below_one_state(args)
        args.state_dir_bytes = files - 1
        with pytest.raises(ValueError, match=f"at least {files} bytes"):
            refuse_bounds_below_one_state(args)
        # and its model manager serves the folder saved so as saved, and refuses one saved otherwise, in one line
        other = "int4" if kind == "int8" else "int8"
        served = quantizing_model_manager(kind)(device="cpu", model_timeout=-1)._load_model(str(folder))
        assert quantized_as(served) == {kind}
        refused = quantizing_model_manager(other)(device="cpu", model_timeout=-1)
        with pytest.raises(ValueError, match=rf"saved quantized already \({kind} weights\): --dtype {other} quantizes"):
            refused._load_model(str(folder))


def test_a_model_quantized_otherwise_is_refused_once_loaded_where_its_state_is_over_the_bound(
    model, tmp_path, monkeypatch
):
    """A quantization other than torchao's int8 and int4 (here int8 values through `IntxWeightOnlyConfig`, which a
    state file names by its tensors' class) left the startup check, from the config alone, a lower bound: a
    --state-dir-bytes between it and the real state was taken, and every state deleted once written. The model
    loaded is now checked exactly (its state file's fingerprint), through the server's model manager: the least
    that holds one state is allowed, one byte less refused naming the least (a float model's too)."""
    torchao = pytest.importorskip("torchao.quantization", reason="torchao (the test extra) quantizes the models")
    from torchao.quantization.granularity import PerGroup
    from transformers import AutoModelForCausalLM, TorchAoConfig
    from transformers.cli.serving import model_manager

    from modeling_gpn.serve.cli import quantized_as_saved
    from modeling_gpn.serve.models import TransformersWithGPN, quantizing_model_manager

    monkeypatch.setattr(model_manager, "transformers", TransformersWithGPN())  # as gpn serve does, for this test only
    model.save_pretrained(tmp_path / "float")
    folder = tmp_path / "intx-int8"
    quantization = torchao.IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerGroup(16))
    AutoModelForCausalLM.from_pretrained(
        tmp_path / "float", dtype=torch.bfloat16, quantization_config=TorchAoConfig(quantization)
    ).save_pretrained(folder)
    quantized = AutoModelForCausalLM.from_pretrained(folder)
    assert quantized_as_saved(quantized.config) is None  # (a quantization the config does not name)
    for name, served in (("float", model), ("intx-int8", quantized)):
        states = tmp_path / f"{name}-states"
        StateStore(0, spill_dir=states).keep(served, [7], state_after(served, [7]))
        files = on_disk_bytes(states)
        if served is quantized:  # (what the config alone tells: fewer bytes than the state)
            assert StateStore.smallest_files_bytes(quantized.config, "bfloat16") < files
        StateStore(0, spill_dir=tmp_path / "fits", spill_max_bytes=files).refuse_a_model_over_the_folder_bound(
            served, name
        )
        store = StateStore(0, spill_dir=tmp_path / "short", spill_max_bytes=files - 1)
        manager = quantizing_model_manager(None, store.refuse_a_model_over_the_folder_bound)
        with pytest.raises(ValueError, match=f"--state-dir-bytes {files - 1} is smaller .* at least {files} bytes"):
            manager(device="cpu", model_timeout=-1)._load_model(str(tmp_path / name))


def test_the_spill_folder_limit_counts_every_file_a_state_takes(model, tmp_path):
    """A spilled state is its state file and the JSON of its ids, which in a long conversation outweighs the
    state: the folder's limit counts both, when they are written and when a restarted store finds them."""

    def on_disk() -> int:  # (the state files and their ids; the stores' change mark and journal are no state's)
        return sum(path.stat().st_size for path in tmp_path.iterdir() if not path.name.startswith("."))

    long_ids = [(7 * position) % 90 + 1 for position in range(900)]
    store = StateStore(0, spill_dir=tmp_path, spill_max_bytes=12_000)  # files only
    for length in (300, 600, 900):
        store.keep(model, long_ids[:length], state_after(model, long_ids[:length]))
        assert on_disk() <= 12_000 and store.summary()["file_bytes"] == on_disk()
    assert store.lookup(model, long_ids)[0] == 900  # the newest stays
    restarted = StateStore(0, spill_dir=tmp_path, spill_max_bytes=7_000)
    assert on_disk() <= 7_000 and restarted.summary()["file_bytes"] == on_disk() > 0


def test_what_a_killed_write_left_is_deleted_when_a_store_opens_the_folder(model, tmp_path):
    """A server killed while writing a state leaves its temporary file, or the state file without the ids written
    after it (or the temporary file of the journal's new generation); one killed while trimming, the ids of a state
    file it had deleted: no store counted them against the
    folder's limit, and nothing deleted them. A store opening the folder deletes those that are old, and leaves a
    fresh one (another server's write in progress), the finished states and a user's own state file."""
    import os
    import time

    from modeling_gpn.serve.state_store import IDS_SUFFIX, JOURNAL, LEFTOVER_AGE_SECONDS

    StateStore(0, spill_dir=tmp_path).keep(model, IDS[:3], state_after(model, IDS[:3]))  # a finished state
    finished = list(tmp_path.iterdir())
    key = "ab" * 32
    left = [
        tmp_path / f".{key}{STATE_SUFFIX}.tmp-1-2-abcd",
        tmp_path / f".{key}{IDS_SUFFIX}.tmp-1-2-abcd",
        tmp_path / f"{key}{STATE_SUFFIX}",  # (its ids never written)
        tmp_path / f"{'ef' * 32}{IDS_SUFFIX}",  # (a trim killed between deleting the state file and its ids)
        tmp_path / f".{JOURNAL}.tmp-1-2-abcd",  # (a store killed while starting the journal's new generation)
    ]
    in_progress, users = tmp_path / f".{'cd' * 32}{STATE_SUFFIX}.tmp-3-4-abcd", tmp_path / f"system{STATE_SUFFIX}"
    for path in [*left, in_progress, users]:
        path.write_bytes(b"half")
    long_ago = time.time() - LEFTOVER_AGE_SECONDS - 60
    for path in [*left, *finished, users]:
        os.utime(path, (long_ago, long_ago))
    restarted = StateStore(0, spill_dir=tmp_path)
    assert [path.name for path in left if path.exists()] == []
    assert in_progress.exists() and users.exists() and all(path.exists() for path in finished)
    assert restarted.lookup(model, IDS[:4])[0] == 3


def test_a_store_opening_a_shared_folder_deletes_leftovers_only_while_it_holds_the_folder(model, tmp_path):
    """A store opening a --state-dir deleted what killed writes left (a state file without its ids, ids without
    their state) before it held the folder: the file it had looked at could be, by the time it deleted it, the ids
    or state file another server was writing under that name (a state every store counted, gone). Now it deletes
    them holding the folder: while another process holds it, the leftover is still there."""
    import os

    from modeling_gpn.serve.state_store import IDS_SUFFIX, LEFTOVER_AGE_SECONDS

    leftover = tmp_path / f"{'ef' * 32}{IDS_SUFFIX}"  # (a trim killed between deleting the state file and its ids)
    leftover.write_bytes(b"{}")
    long_ago = time.time() - LEFTOVER_AGE_SECONDS - 60
    os.utime(leftover, (long_ago, long_ago))
    with another_process_holding(tmp_path):
        opening = threading.Thread(target=StateStore, args=(0,), kwargs={"spill_dir": tmp_path, "spill_max_bytes": 1})
        opening.start()
        opening.join(0.3)
        assert opening.is_alive() and leftover.exists()  # waiting for the folder, the leftover untouched
    opening.join(60)
    assert not leftover.exists()


def test_a_spill_folder_turned_read_only_fails_no_request(model, tmp_path):
    """A spill folder whose file system turns read-only (remounted so after an error): a state read back from its
    file, which could not be deleted then, failed the request (the OSError of the delete), as did every later
    keep and the writing of the states at shutdown. Now a file that cannot be deleted is left, and logged."""
    import subprocess

    cost = state_bytes(model)
    with small_disk(tmp_path / "disk", "1m") as folder:
        store = StateStore(cost + cost // 2, spill_dir=folder)  # one state in memory
        for length in (2, 3):
            store.keep(model, IDS[:length], state_after(model, IDS[:length]))
        subprocess.run(["mount", "-o", "remount,ro", str(folder)], check=True)
        assert store.keep(model, IDS[:4], state_after(model, IDS[:4]))  # the state it evicts cannot be written
        length, cache = store.lookup(model, IDS[:3])  # 3 was dropped; 2 is read back from its file, which stays
        assert length == 2 and same_state(cache, state_after(model, IDS[:2]))
        store.spill_all()
        assert store.summary()["states_in_memory"] == 0


def generate_plain(model, ids: list[int], new: int, **kwargs):
    with torch.no_grad():
        return model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False, pad_token_id=0, **kwargs)


def test_generate_through_the_store_gives_the_tokens_of_the_whole_prompt(model):
    store = StateStore(1 << 22)
    turn, expected_cached = IDS, 0
    for _ in range(3):  # each turn: the last prompt, its answer, more text
        kept = StateKeepingModel(model, store)
        out = kept.generate(torch.tensor([turn]), generation_config=greedy(model, 6))
        assert torch.equal(out, generate_plain(model, turn, 6))
        assert kept.cached_tokens == expected_cached
        answer = out[0, len(turn) :].tolist()
        # kept: the state before the prompt's last token, and after the answer (all its tokens but the last)
        assert store.lookup(model, turn + [1], max_length=len(turn) - 1)[0] == len(turn) - 1
        assert store.lookup(model, turn + answer)[0] == len(turn) + len(answer) - 1
        turn, expected_cached = turn + answer + [7, 8, 9], len(turn) + len(answer) - 1


# A prompt that repeats itself and the model's own answer: what a processor looking back over input_ids does
# then depends on the whole prompt, not only on its last token.
LOOKING_BACK = {
    "repetition_penalty": dict(repetition_penalty=5.0),
    "no_repeat_ngram_size": dict(no_repeat_ngram_size=2),
    "multi-token sequence_bias": None,  # a ban on (the prompt's last two tokens, the plain first answer token)
}


@pytest.mark.parametrize("name", list(LOOKING_BACK))
def test_processors_that_look_back_see_the_whole_prompt_through_the_store(model, name):
    """generate() through the store is generate() on the whole prompt, also for the logits processors that read
    the prompt (repetition_penalty, no_repeat_ngram_size, a sequence_bias longer than one token): a kept state
    stands for the prompt it read, it does not hide it from them."""
    prompt = IDS + generate_plain(model, IDS, 8)[0, len(IDS) :].tolist() + IDS
    unprocessed = generate_plain(model, prompt, 8)
    processor = LOOKING_BACK[name] or dict(sequence_bias=[[[*prompt[-2:], int(unprocessed[0, len(prompt)])], -100.0]])
    expected = generate_plain(model, prompt, 8, **processor)
    assert not torch.equal(expected, unprocessed)  # the processor changes this answer: the test can fail
    store = StateStore(1 << 22)
    for cached in (0, len(prompt) - 1):  # read from scratch, then continued from the state kept by the first
        kept = StateKeepingModel(model, store)
        out = kept.generate(torch.tensor([prompt]), generation_config=greedy(model, 8, **processor))
        assert kept.cached_tokens == cached and torch.equal(out, expected)
    answers = StateKeepingModel(model, store, answers=2)  # n answers: rows forked from the kept state
    out = answers.generate(torch.tensor([prompt]), generation_config=greedy(model, 8, **processor))
    assert torch.equal(out, expected.expand(2, -1))


def greedy(model, new: int, **processors):
    from transformers import GenerationConfig

    return GenerationConfig(max_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=None, **processors)


def test_the_weights_a_request_derived_do_not_live_on_with_the_state_it_kept(model):
    """A request through the store derives the fast path's weights once (folded; for an int4 model, its matrices
    dequantized to bf16) and the store keeps the cache generate() filled. What was derived went with that cache
    (for a decode loop continuing it), so it lived as long as the kept state: an int4 model served held its
    dequantized matrices beside its int4 ones for good. The next request derives afresh: nothing is kept."""
    from modeling_gpn.derived_weights import KEPT_ATTRIBUTE

    store = StateStore(1 << 22)
    kept = StateKeepingModel(model, store)
    out = kept.generate(torch.tensor([IDS]), generation_config=greedy(model, 4))
    left = model.model.__dict__.get(KEPT_ATTRIBUTE)  # (before any other call, which would replace it)
    assert left is None or left[0]() is None
    assert store.lookup(model, out[0].tolist())[0] == len(IDS) + 3  # the answer's state is kept
    assert torch.equal(out, generate_plain(model, IDS, 4))


def test_n_answers_fork_one_state_and_read_the_prompt_once(model):
    store = StateStore(1 << 22)
    read = []
    hook = model.model.register_forward_pre_hook(
        lambda module, args, kwargs: read.append(kwargs["input_ids"].numel()), with_kwargs=True
    )
    try:
        config = greedy(model, 5)
        config.do_sample, config.top_k = True, 0
        torch.manual_seed(0)
        out = StateKeepingModel(model, store, answers=3).generate(torch.tensor([IDS]), generation_config=config)
    finally:
        hook.remove()
    assert out.shape == (3, len(IDS) + 5) and torch.equal(out[:, : len(IDS)], torch.tensor([IDS] * 3))
    # the prompt but its last token once, then 3 rows: the last prompt token and 4 answer tokens each
    assert sum(read) == (len(IDS) - 1) + 3 * 5
    for row in range(3):  # each answer's state is kept under what its row read
        assert store.lookup(model, out[row].tolist())[0] == len(IDS) + 4
    # greedy: the n answers are the one answer
    greedy_out = StateKeepingModel(model, StateStore(1 << 22), answers=2).generate(
        torch.tensor([IDS]), generation_config=greedy(model, 5)
    )
    assert torch.equal(greedy_out, generate_plain(model, IDS, 5).expand(2, -1))


def test_concurrent_saves_to_one_path_all_succeed(model, tmp_path):
    """Two threads saving to one path: every save completes and the file is whole (GPNCache.save's
    temporary file must be unique per call, not per process)."""
    cache = state_after(model, IDS)
    path = tmp_path / "shared.gpnstate.safetensors"
    errors: list[BaseException] = []
    start = threading.Barrier(3)

    def save_many():
        start.wait()
        for _ in range(20):
            try:
                cache.save(path)
            except BaseException as error:  # noqa: BLE001 - every failure is counted
                errors.append(error)

    threads = [threading.Thread(target=save_many) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads)
    assert not errors, f"{len(errors)} of 60 saves failed, e.g. {errors[0]!r}"
    assert same_state(GPNCache.load(path, model), cache)


@pytest.fixture(scope="module")
def llama_model_and_tokenizer():
    """A tiny GPN over the LLaMA-2 tokenizer, whose rare characters are byte tokens (龘 is <0xE9><0xBE><0x98>)."""
    from transformers import AutoTokenizer

    from ..environment import require_shared

    tokenizer = AutoTokenizer.from_pretrained(require_shared("data/llama2-tokenizer"))
    return perturbed_model(tiny_config(vocab_size=32000, eos_token_id=2, bos_token_id=1), seed=3), tokenizer


# 龘 as byte tokens (byte b is token 3 + b), made again and again: <0xE9> always, <0xBE> after it, <0x98> after that
DRAGON = [3 + 0xE9, 3 + 0xBE, 3 + 0x98]
MAKES_DRAGONS = [[[DRAGON[0]], 50.0], [DRAGON[:2], 100.0], [DRAGON[1:], 100.0]]


def test_a_stop_string_of_byte_tokens_ends_the_answer_and_its_kept_state_there(llama_model_and_tokenizer):
    """A request's stop string (`stop_strings`, as transformers serve hands `stop` to generate()) ends the answer
    at the token with which the answer's text first holds it, a character spelled in byte tokens too; what the
    store keeps is what was generated, up to there. A stop string the prompt begins and the answer completes
    ("lo" + 龘 after "hello") ends nothing: the answer's text does not hold it (transformers' own check, which
    reads the prompt, stopped there, "stop"). n answers end each at its own stop string (`_answer_rows`); beam
    search ends by the same rule."""
    from transformers import GenerationConfig

    from modeling_gpn.serve.handlers import _answer_rows

    model, tokenizer = llama_model_and_tokenizer
    prompt = tokenizer("hello")["input_ids"]

    def answer(stops, answers=1, store=None, num_beams=1):
        config = GenerationConfig(
            max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=2, num_beams=num_beams
        )
        config.sequence_bias, config.stop_strings = MAKES_DRAGONS, stops
        kept = StateKeepingModel(model, store or StateStore(1 << 24), answers=answers)
        out = kept.generate(torch.tensor([prompt]), generation_config=config, tokenizer=tokenizer)
        return out[:, len(prompt) :].tolist(), config

    assert answer(None)[0] == [DRAGON * 4]  # the model makes 龘 after 龘: only a stop ends it
    store = StateStore(1 << 24)
    assert answer(["龘"], store=store)[0] == [DRAGON]
    # the state after the answer: the prompt and the answer but its last token (generate() never reads it); the
    # store holds nothing of the tokens the answer would have gone on with
    assert store.lookup(model, prompt + DRAGON * 2)[0] == len(prompt) + len(DRAGON) - 1
    assert answer(["lo龘"])[0] == [DRAGON * 4]
    # beam search (not through the store) by the same rule, each candidate's answer read afresh
    assert answer(["龘龘"], num_beams=2)[0] == [DRAGON * 2] and answer(["lo龘"], num_beams=2)[0] == [DRAGON * 4]
    rows, config = answer(["龘龘", "never"], answers=2)
    assert rows == [DRAGON * 2] * 2
    ended = _answer_rows(
        torch.tensor([prompt + row for row in rows]), {"input_ids": torch.tensor([prompt])}, config, tokenizer
    )
    assert [(ids.tolist(), stopped) for _, ids, stopped in ended] == [(DRAGON * 2, True)] * 2
