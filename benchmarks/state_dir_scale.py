"""What one save into a shared `gpn serve --state-dir` costs as the folder grows: one store alone, and two stores
(two servers on the folder, as two processes would be: they share nothing but the folder) writing in turn.

The folder is filled with N states of the tiny test GPN (`tests/tiny_models.py`' shapes, about 3 KB a state) whose
ids files are written directly (the same state file bytes copied under each key: the folder's bookkeeping reads
the names, the ids and the sizes, never a state file's contents), then a store is opened on it. Timed: one
`StateStore.keep` of a new state going straight to the folder (`StateStore(0, ...)`: files only, a bound far above
the folder, so no trim), its forward pass done before the clock starts; medians of `--saves` saves each.

    python benchmarks/state_dir_scale.py --states 1000 10000 30000 --saves 40
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # (this checkout's modeling_gpn)

from modeling_gpn.bench.models import perturbed_gpn, tiny_config  # noqa: E402
from modeling_gpn.serve.state_store import (  # noqa: E402
    IDS_SUFFIX,
    STATE_SUFFIX,
    StateStore,
    _entry_key,
    _ids_bytes,
    _ids_file,
    model_key,
)


def state_after(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids]), use_cache=True, logits_to_keep=1).cache


def fill(folder: Path, model, count: int) -> None:
    """`count` states in `folder` as a store leaves them (a state file and its ids), written directly."""
    sample = folder / "sample"
    StateStore(0, spill_dir=sample).keep(model, [1, 2], state_after(model, [1, 2]))
    state_bytes = next(sample.glob(f"*{STATE_SUFFIX}")).read_bytes()
    shutil.rmtree(sample)
    key_of_model = model_key(model)
    for index in range(count):
        ids = [index // 96**2 % 96 + 1, index // 96 % 96 + 1, index % 96 + 1]  # (distinct, in the vocabulary)
        key = _entry_key(key_of_model, _ids_bytes(ids))
        (folder / f"{key}{STATE_SUFFIX}").write_bytes(state_bytes)
        (folder / f"{key}{IDS_SUFFIX}").write_bytes(_ids_file(key_of_model, ids))


def timed_keeps(stores: list[StateStore], model, saves: int, first: int) -> list[float]:
    """Seconds of each of `saves` keeps, the stores taking turns; new ids each (states of 4 ids)."""
    ids = [[(first + index) // 96 % 96 + 1, (first + index) % 96 + 1, 3, 5] for index in range(saves)]
    states = [state_after(model, each) for each in ids]
    times = []
    for index, cache in enumerate(states):
        store = stores[index % len(stores)]
        started = time.perf_counter()
        assert store.keep(model, ids[index], cache)
        times.append(time.perf_counter() - started)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--states", type=int, nargs="+", default=[1000, 10000, 30000])
    parser.add_argument("--saves", type=int, default=40)
    parser.add_argument("--dir", default=None, help="where to make the folders (default: the system's temporary)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = perturbed_gpn(tiny_config(eos_token_id=None), seed=21)
    print(
        "| states in the folder | open (s) | one store alone: a save (median) | two stores in turn: a save (median) |"
    )
    print("|---|---|---|---|")
    for count in args.states:
        with tempfile.TemporaryDirectory(dir=args.dir) as temporary:
            folder = Path(temporary)
            fill(folder, model, count)
            started = time.perf_counter()
            first = StateStore(0, spill_dir=folder, spill_max_bytes=10**12)
            opened = time.perf_counter() - started
            alone = timed_keeps([first], model, args.saves, 1000)
            second = StateStore(0, spill_dir=folder, spill_max_bytes=10**12)
            both = timed_keeps([first, second], model, 2 * args.saves, 2000)
            print(
                f"| {count:,} | {opened:.2f} | {statistics.median(alone) * 1e3:.2f} ms "
                f"| {statistics.median(both) * 1e3:.2f} ms |",
                flush=True,
            )


if __name__ == "__main__":
    main()
