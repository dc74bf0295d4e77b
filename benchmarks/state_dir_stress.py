"""Stress a shared `gpn serve --state-dir` with real processes and real kills: K processes, each with its own
`StateStore` on one folder, keep, look up and continue states of a shared set of prompts while the parent kills a
random one (among those past their start) with SIGKILL now and then (at a random instant: in the middle of a save
too) and starts it again.

Each child loops: a prompt (a prefix of one of a few shared token sequences, so that the stores find each other's
states), a lookup (timed), its cache checked (its length, its record of what it read against the asked prefix, and
for a sample its state against one computed from scratch), the prompt's rest read, the state kept (timed). A small
memory bound makes every store spill, a small folder bound (`--folder-states` states' worth) makes them trim.

Every `--check-every` seconds, and at the end, the parent checks the folder from outside:
  1. under its own flock on the folder: the states' bytes (state file + ids file) within the bound (over it by one
     state only where a child was killed since the last check: serving.md's slack); every state file
     whole (loads, for the model) and its ids file naming it (the key of its ids) and matching what it read;
  2. a store open all along that only looks (its view kept up to date by the journal, or a listing where the journal
     cannot tell): under its hold, its
     view of the folder (keys and bytes) and its index are those of the disk;
  3. a store opened fresh: it deletes the leftovers of killed writes older than `--leftover-age` (the store's
     LEFTOVER_AGE_SECONDS, set so in every process: 600 s in a server), none older is left; it indexes every state.
Children write what they find wrong to their log, which the parent reads at the end (with their tracebacks).

    python benchmarks/state_dir_stress.py --processes 3 --seconds 180
    python benchmarks/state_dir_stress.py --timing --seconds 30   # lookup and save medians, 1 vs 3 processes
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # (this checkout's modeling_gpn)

from modeling_gpn import GPNCache  # noqa: E402
from modeling_gpn.bench.models import perturbed_gpn, tiny_config  # noqa: E402
from modeling_gpn.serve import state_store  # noqa: E402
from modeling_gpn.serve.state_store import (  # noqa: E402
    IDS_SUFFIX,
    STATE_SUFFIX,
    StateStore,
    _entry_key,
    _ids_bytes,
    model_key,
)

BASES, BASE_LENGTH, VOCAB = 6, 24, 96


def the_model():
    torch.set_num_threads(1)
    return perturbed_gpn(tiny_config(eos_token_id=None), seed=21)


def state_after(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids]), use_cache=True, logits_to_keep=1).cache


def bounds(model, memory_states: int, folder_states: int) -> tuple[int, int]:
    """The memory bound (`memory_states` states of the longest prompt) and the folder's (`folder_states` states'
    files), measured on a store of this model."""
    ids = list(range(1, BASE_LENGTH + 1))
    cache = state_after(model, ids)
    with tempfile.TemporaryDirectory() as folder:
        store = StateStore(0, spill_dir=folder, spill_max_bytes=1 << 30)
        store.keep(model, ids, cache)
        files = store.summary()["file_bytes"]
    return memory_states * StateStore.entry_bytes(cache, len(ids)), folder_states * files


def prompts() -> list[list[int]]:
    shared = random.Random(0)
    return [[shared.randrange(1, VOCAB) for _ in range(BASE_LENGTH)] for _ in range(BASES)]


def fingerprint_of(ids: list[int]) -> torch.Tensor:
    probe = GPNCache()
    probe.record_read(torch.tensor([ids], dtype=torch.long), None)
    return probe.read_fingerprint().cpu()


# ---- a child: one store, looping -----------------------------------------------------------------------------


def child(args) -> None:
    state_store.LEFTOVER_AGE_SECONDS = args.leftover_age
    model = the_model()
    log = open(args.log, "a", encoding="utf-8")  # noqa: SIM115  (this process's, to its end)
    times: list[tuple[str, float]] = []

    def flush_times(*_):
        for op, seconds in times:
            log.write(json.dumps({"time": op, "s": seconds}) + "\n")
        times.clear()
        log.flush()

    def stop(*_):
        flush_times()
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    taking = state_store.held

    @contextlib.contextmanager
    def timed_hold(*args, **kwargs):  # (how long taking the folder's flock waits: for another process's hold)
        started = time.perf_counter()
        with taking(*args, **kwargs) as got:
            times.append(("hold", time.perf_counter() - started))
            yield got

    state_store.held = timed_hold
    store = StateStore(args.memory_bytes, spill_dir=args.folder, spill_max_bytes=args.folder_bytes)
    Path(f"{args.log}.ready").touch()  # (the parent kills only children past their start: in their loop)
    rng = random.Random(args.seed)
    bases = prompts()
    ops = 0
    while True:
        ids = rng.choice(bases)[: rng.randrange(2, BASE_LENGTH + 1)]
        started = time.perf_counter()
        found = store.lookup(model, ids)
        times.append(("lookup", time.perf_counter() - started))
        wrong = None
        if found is None:
            cache = state_after(model, ids)
        else:
            length, cache = found
            if not 0 < length <= len(ids) or cache.get_seq_length() != length:
                wrong = f"lookup of {len(ids)} ids gave length {length}, a cache of {cache.get_seq_length()}"
            elif not torch.equal(cache.read_fingerprint().cpu(), fingerprint_of(ids[:length])):
                wrong = f"lookup of {len(ids)} ids gave a cache whose read ids are not the first {length}"
            elif rng.random() < args.sample:
                expected = state_after(model, ids[:length])
                worst = max((a - b).abs().max().item() for a, b in zip(cache.get_state(), expected.get_state()))
                if worst > 1e-4:
                    wrong = f"lookup of {len(ids)} ids: the state of length {length} differs by {worst:g} from scratch"
            if wrong is None and length < len(ids):
                with torch.no_grad():
                    cache = model(
                        torch.tensor([ids[length:]]),
                        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                        cache=cache,
                        use_cache=True,
                        logits_to_keep=1,
                    ).cache
        if wrong is not None:
            log.write(json.dumps({"violation": "lookup", "detail": wrong}) + "\n")
            log.flush()
            continue
        started = time.perf_counter()
        kept = store.keep(model, ids, cache)
        times.append(("save", time.perf_counter() - started))
        if not kept:
            log.write(json.dumps({"violation": "keep refused", "detail": str(store.stats.refused)}) + "\n")
        ops += 1
        if ops % 20 == 0:
            log.write(json.dumps({"summary": store.summary()}) + "\n")
            flush_times()


# ---- the parent: children, kills, checks ---------------------------------------------------------------------


class Checker:
    def __init__(self, args, model) -> None:
        self.args, self.model = args, model
        self.key_of_model = model_key(model)
        self.watcher = StateStore(0, spill_dir=args.folder, spill_max_bytes=args.folder_bytes)  # (only looks)
        self.checks = 0
        self.violations: list[tuple[str, str]] = []
        self.most_bytes = 0
        self.leftovers_seen = 0
        self.killed_before = 0
        self.over_after_a_kill = 0  # (checks that found the folder over by one state just after a kill)

    def wrong(self, kind: str, detail: str) -> None:
        self.violations.append((kind, detail))
        print(f"  VIOLATION {kind}: {detail}", flush=True)

    def disk(self) -> tuple[dict[str, int], list[Path]]:
        """The folder's states (key -> bytes of both files) and its other files of the store's (leftovers)."""
        names = set(os.listdir(self.args.folder))
        states, others = {}, []
        for name in names:
            path = Path(self.args.folder) / name
            if name.endswith(STATE_SUFFIX) and name[:64] + IDS_SUFFIX in names:
                with_ids = path.with_name(name[:64] + IDS_SUFFIX)
                try:
                    states[name[:64]] = path.stat().st_size + with_ids.stat().st_size
                except OSError:
                    continue
            elif state_store._LEFTOVER_TEMPORARY.match(name) or (
                name.endswith(IDS_SUFFIX) and name[:64] + STATE_SUFFIX not in names
            ):
                others.append(path)
            elif name.endswith(STATE_SUFFIX):
                others.append(path)
        return states, others

    def check(self, killed: int) -> None:
        """The checks 1-3 of the module's docstring; `killed`: the children killed so far."""
        self.checks += 1
        folder = Path(self.args.folder)
        # 1. under a flock of our own: the bound, every state whole and named by its ids
        descriptor = os.open(folder, os.O_RDONLY)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX)
            states, others = self.disk()
            total = sum(states.values())
            self.most_bytes = max(self.most_bytes, total)
            if total > self.args.folder_bytes:
                # serving.md's slack: a store killed between writing a state and trimming leaves the folder over by
                # that state until the next hold of any store; only where a kill came since the last check
                if killed > self.killed_before and total - max(states.values()) <= self.args.folder_bytes:
                    self.over_after_a_kill += 1
                else:
                    self.wrong("bound", f"{len(states)} states take {total} bytes > {self.args.folder_bytes}")
            self.killed_before = killed
            for key in states:
                try:
                    record = json.loads((folder / f"{key}{IDS_SUFFIX}").read_text(encoding="utf-8"))
                    ids = [int(token) for token in record["ids"]]
                    if _entry_key(record["model"], _ids_bytes(ids)) != key or record["model"] != self.key_of_model:
                        self.wrong("ids file", f"{key[:12]}: its ids are not those its name hashes")
                        continue
                    cache = GPNCache.load(folder / f"{key}{STATE_SUFFIX}", self.model)
                    if cache.get_seq_length() != len(ids) or not torch.equal(
                        cache.read_fingerprint().cpu(), fingerprint_of(ids)
                    ):
                        self.wrong("state file", f"{key[:12]}: its state did not read its ids")
                except Exception as error:  # noqa: BLE001  (any failure to read a state is what is looked for)
                    self.wrong("state file", f"{key[:12]}: {type(error).__name__}: {error}")
        finally:
            os.close(descriptor)
        # 2. the store that only looks: its journal-kept view is the disk
        with self.watcher._lock, self.watcher._folder_held():
            states, _ = self.disk()
            view = self.watcher._folder
            if view is None:
                self.wrong("view", "the watching store could not hold the folder")
            else:
                if set(view) != set(states) or self.watcher._folder_bytes != sum(states.values()):
                    self.wrong(
                        "view",
                        f"watcher sees {len(view)} states, {self.watcher._folder_bytes} bytes; disk {len(states)}, "
                        f"{sum(states.values())}; missing {sorted(k[:8] for k in set(states) - set(view))}, extra "
                        f"{sorted(k[:8] for k in set(view) - set(states))}",
                    )
                if set(self.watcher._files) != set(states):
                    self.wrong("index", f"watcher indexes {len(self.watcher._files)} states; disk {len(states)}")
        # 3. a store opened fresh: leftovers older than the age gone, every state indexed
        reopened = time.time()
        fresh = StateStore(0, spill_dir=folder, spill_max_bytes=self.args.folder_bytes)
        with fresh._lock, fresh._folder_held():
            states, others = self.disk()
            self.leftovers_seen += len(others)
            for path in others:
                with_age = path.stat().st_mtime if path.exists() else reopened
                if with_age < reopened - self.args.leftover_age - 0.5:
                    self.wrong("leftover", f"{path.name[:40]}... {reopened - with_age:.0f} s old after a reopen")
            if set(fresh._files) != set(states):
                self.wrong("fresh index", f"a fresh store indexes {len(fresh._files)} states; disk {len(states)}")


def start(args, index: int, incarnation: int, logs: Path) -> tuple[subprocess.Popen, Path]:
    log = logs / f"child{index}-{incarnation}.jsonl"
    command = [sys.executable, __file__, "--child", "--folder", args.folder, "--log", str(log)]
    command += ["--seed", str(1000 * index + incarnation), "--memory-bytes", str(args.memory_bytes)]
    command += ["--folder-bytes", str(args.folder_bytes), "--leftover-age", str(args.leftover_age)]
    command += ["--sample", str(args.sample)]
    stderr = open(logs / f"child{index}-{incarnation}.err", "w", encoding="utf-8")  # noqa: SIM115
    return subprocess.Popen(command, stderr=stderr), log


def run(args, processes: int, seconds: float, kills: bool, checker: Checker | None, logs: Path) -> dict:
    rng = random.Random(processes)
    children = [start(args, index, 0, logs) for index in range(processes)]
    incarnations = [0] * processes
    killed = 0
    deadline = time.monotonic() + seconds
    next_check = time.monotonic() + args.check_every
    next_kill = time.monotonic() + (rng.expovariate(1 / args.kill_every) if kills else 1e18)
    while time.monotonic() < deadline:
        time.sleep(0.05)
        for index, (process, _) in enumerate(children):
            if process.poll() is not None:  # (a child that died by itself: a loud failure, restarted)
                print(f"  child {index} exited by itself: {process.returncode}", flush=True)
                incarnations[index] += 1
                children[index] = start(args, index, incarnations[index], logs)
        ready = [index for index, (_, log) in enumerate(children) if Path(f"{log}.ready").exists()]
        if time.monotonic() >= next_kill and ready:
            index = rng.choice(ready)
            children[index][0].send_signal(signal.SIGKILL)
            children[index][0].wait()
            killed += 1
            incarnations[index] += 1
            children[index] = start(args, index, incarnations[index], logs)
            next_kill = time.monotonic() + rng.expovariate(1 / args.kill_every)
        if checker is not None and time.monotonic() >= next_check:
            checker.check(killed)
            next_check = time.monotonic() + args.check_every
    for process, _ in children:
        process.send_signal(signal.SIGTERM)
    for process, _ in children:
        process.wait()
    return {"killed": killed}


def read_logs(logs: Path) -> dict:
    found = {
        "lookup": [],
        "save": [],
        "hold": [],
        "violations": [],
        "hits": 0,
        "misses": 0,
        "from_files": 0,
        "tracebacks": [],
        "dropped": 0,
    }
    for log in sorted(logs.glob("*.jsonl")):
        last = None
        for line in log.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue  # (a line cut by the kill)
            if "time" in record:
                found[record["time"]].append(record["s"])
            elif "violation" in record:
                found["violations"].append(record)
            elif "summary" in record:
                last = record["summary"]
        if last is not None:
            found["hits"] += last["hits"]
            found["misses"] += last["misses"]
            found["from_files"] += last["loaded_from_files"]
    for err in sorted(logs.glob("*.err")):
        text = err.read_text(encoding="utf-8")
        found["dropped"] += text.count("state store: dropping")  # (a file gone between the hold and the read)
        if "Traceback" in text:
            found["tracebacks"].append(f"{err.name}: {text[-600:]}")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--processes", type=int, default=3, help="stores on the folder, each a process (2-4)")
    parser.add_argument("--seconds", type=float, default=180, help="how long to run (each phase with --timing)")
    parser.add_argument(
        "--kill-every",
        type=float,
        default=3.0,
        help="mean seconds between kills (exponential), each of a child past its start",
    )
    parser.add_argument("--check-every", type=float, default=10.0, help="seconds between checks of the folder")
    parser.add_argument("--memory-states", type=int, default=2, help="each store's memory bound, in states")
    parser.add_argument("--folder-states", type=int, default=6, help="the folder's bound, in states' files")
    parser.add_argument("--leftover-age", type=float, default=5.0, help="LEFTOVER_AGE_SECONDS in every process")
    parser.add_argument("--sample", type=float, default=0.2, help="share of hits compared with a state from scratch")
    parser.add_argument("--timing", action="store_true", help="time lookups and saves, 1 then 3 processes, no kills")
    parser.add_argument("--dir", default=None, help="where to make the folder (default: the system's temporary)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--log", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--memory-bytes", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--folder-bytes", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    state_store.LEFTOVER_AGE_SECONDS = args.leftover_age
    model = the_model()
    args.memory_bytes, args.folder_bytes = bounds(model, args.memory_states, args.folder_states)
    with tempfile.TemporaryDirectory(dir=args.dir) as work:
        work = Path(work)
        if args.timing:
            print(
                "| processes | lookups | lookup (median) | saves | save (median) | taking the folder's hold (median, p90) |"
            )
            print("|---|---|---|---|---|---|")
            for processes in (1, 3):
                args.folder = str(work / f"folder{processes}")
                Path(args.folder).mkdir()
                logs = work / f"logs{processes}"
                logs.mkdir()
                run(args, processes, args.seconds, False, None, logs)
                found = read_logs(logs)
                print(
                    f"| {processes} | {len(found['lookup'])} | {statistics.median(found['lookup']) * 1e3:.2f} ms "
                    f"| {len(found['save'])} | {statistics.median(found['save']) * 1e3:.2f} ms "
                    f"| {statistics.median(found['hold']) * 1e3:.2f} ms, "
                    f"{statistics.quantiles(found['hold'], n=10)[-1] * 1e3:.2f} ms |",
                    flush=True,
                )
            return
        args.folder = str(work / "folder")
        Path(args.folder).mkdir()
        logs = work / "logs"
        logs.mkdir()
        print(
            f"{args.processes} processes, {args.seconds:.0f} s, a kill every {args.kill_every} s on average; memory "
            f"bound {args.memory_bytes} B, folder bound {args.folder_bytes} B",
            flush=True,
        )
        checker = Checker(args, model)
        ran = run(args, args.processes, args.seconds, True, checker, logs)
        checker.check(ran["killed"])  # (the end: every child stopped)
        found = read_logs(logs)
        for record in found["violations"]:
            checker.wrong(record["violation"], record["detail"])
        print(
            f"kills {ran['killed']}; checks {checker.checks}; lookups {len(found['lookup'])} (hits {found['hits']}, "
            f"misses {found['misses']}, read from files {found['from_files']}; counts of the logs' last summaries); "
            f"saves {len(found['save'])}; most bytes in the folder {checker.most_bytes} of {args.folder_bytes}; "
            f"leftovers seen (younger than the age) {checker.leftovers_seen}; over the bound by one state just after a "
            f"kill {checker.over_after_a_kill}; violations {len(checker.violations)}; "
            f"children's tracebacks {len(found['tracebacks'])}; files dropped at a lookup (logged) {found['dropped']}"
        )
        for traceback in found["tracebacks"][:5]:
            print(traceback)
        kinds: dict[str, int] = {}
        for kind, _ in checker.violations:
            kinds[kind] = kinds.get(kind, 0) + 1
        print("violations by kind:", kinds)


if __name__ == "__main__":
    main()
