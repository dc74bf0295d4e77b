"""Long-running memory: repeat what a process kept alive for hours repeats, and print how its memory moves.

Each scenario runs one operation `--iterations` times and prints, every `--every` iterations (after
`gc.collect()`), the process's resident memory (`/proc/self/statm`), the bytes glibc's malloc holds (C code's
heap: torch's, the kernels'), the count of objects the collector tracks and tracemalloc's Python-allocated bytes
(`--tracemalloc`; it slows the run). A bounded operation levels off after
its first iterations; one that leaks grows by the same amount every report. Scenarios:

- generate:   one model, `generate()` again and again (the fast path's one-call decode: plans built per call).
- decode:     one model, a decode loop of forward calls continuing one cache (what is kept with the cache), a new
              cache every iteration.
- models:     create a model, generate, drop it (a sweep, a test session): each dropped model must be collected
              (checked through a weak reference). Each new model has the same config and new weights, which
              reuse the freed memory: its fast generate() must equal its plain one (a plan keyed by an address
              would give the dropped model's tokens).
- threads:    a new thread per call (a server making one per request), each generating with one kept model.
              `--int8` quantizes the model's linears (torchao int8 weight-only), whose products keep a per-thread
              buffer in the C kernels.
- states:     fork, save and load a kept state over and over (`GPNCache.fork`, `save`, `load`).
- store:      `gpn serve`'s state store (`serve.StateStore`) kept filling with new conversations: bounded by its
              `max_bytes`.

Run it alone (nothing heavy beside it: RSS figures move with other processes' page cache pressure too):

    python benchmarks/long_running_memory.py --scenario threads --int8 --iterations 2000 --every 500
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import sys
import tempfile
import threading
import tracemalloc
import weakref
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # (this checkout's modeling_gpn)

import modeling_gpn  # noqa: E402,F401  (registers GPN)
from modeling_gpn import GPNCache, GPNForCausalLM  # noqa: E402
from modeling_gpn.bench.models import perturbed_gpn, tiny_config  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_mb() -> float:
    with open("/proc/self/statm", encoding="utf-8") as statm:
        return int(statm.read().split()[1]) * PAGE / 2**20


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost").split()
    ]


_libc = ctypes.CDLL(None)
_libc.mallinfo2.restype = _MallInfo2


def malloc_mb() -> float:
    """Bytes glibc's malloc has handed out and not had back (every arena): what C code (torch's, the kernels')
    holds on the heap, whatever of it RSS shows."""
    info = _libc.mallinfo2()
    return (info.uordblks + info.hblkhd) / 2**20


def report(label: str, iteration: int, start: tuple) -> None:
    gc.collect()
    traced = tracemalloc.get_traced_memory()[0] / 2**20 if tracemalloc.is_tracing() else float("nan")
    objects = len(gc.get_objects())
    print(
        f"{label:>9} {iteration:>6}: RSS {rss_mb():8.1f} MB ({rss_mb() - start[0]:+7.1f}), "
        f"malloc {malloc_mb():8.2f} MB ({malloc_mb() - start[2]:+7.2f}), "
        f"gc objects {objects:>8} ({objects - start[1]:+7}), tracemalloc {traced:7.2f} MB",
        flush=True,
    )


def tiny_model(seed: int, **overrides) -> GPNForCausalLM:
    """The model every scenario runs: the tests' tiny GPN+M of 2 predict layers (`perturbed_gpn`), seeded."""
    return perturbed_gpn(tiny_config(**{"num_predict_layers": 2, **overrides}), seed)


def make_model(seed: int, int8: bool = False, **overrides) -> torch.nn.Module:
    model = tiny_model(seed, **overrides)
    if int8:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        quantize_(model.to(torch.bfloat16), Int8WeightOnlyConfig())
    return model


def greedy(model: torch.nn.Module, ids: torch.Tensor, tokens: int = 8) -> torch.Tensor:
    return model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False
    )


PROMPT = torch.randint(1, 97, (1, 6), generator=torch.Generator().manual_seed(0))


def scenario_generate(args: argparse.Namespace, step: int) -> None:
    model = scenario_generate.model = getattr(scenario_generate, "model", None) or make_model(1, args.int8)
    greedy(model, PROMPT)


def scenario_decode(args: argparse.Namespace, step: int) -> None:
    model = scenario_decode.model = getattr(scenario_decode, "model", None) or make_model(1, args.int8)
    with torch.no_grad():
        out = model(PROMPT, use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        for _ in range(8):
            out = model(token, cache=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)


_addresses: dict = {"last": set(), "reused": 0}


def scenario_models(args: argparse.Namespace, step: int) -> None:
    from modeling_gpn.memory_kernels import calls

    model = make_model(1000 + step, args.int8)
    addresses = {p.data_ptr() for p in model.parameters()}
    _addresses["reused"] += bool(addresses & _addresses["last"])  # (a weight where the dropped model's was)
    _addresses["last"] = addresses
    decoded = calls["decode"]
    fast = greedy(model, PROMPT)
    if calls["decode"] == decoded:
        raise SystemExit("the fast generate() ran no decoded token as one C call")
    model.model.use_fast_path = False
    plain = greedy(model, PROMPT)
    if not args.int8 and not torch.equal(fast, plain):  # (int8 products round the input: close, not equal)
        raise SystemExit(f"model {step}: fast generate() {fast.tolist()} differs from the plain {plain.tolist()}")
    dropped = weakref.ref(model)
    del model
    gc.collect()
    if dropped() is not None:
        raise SystemExit(f"model {step} is still alive after it was dropped")
    if (step + 1) % args.every == 0:
        print(f"   models: {_addresses['reused']} of {step + 1} had a weight at an address of the model before")


def scenario_threads(args: argparse.Namespace, step: int) -> None:
    model = scenario_threads.model = getattr(scenario_threads, "model", None) or make_model(1, args.int8)
    thread = threading.Thread(target=greedy, args=(model, PROMPT))
    thread.start()
    thread.join()


def scenario_states(args: argparse.Namespace, step: int) -> None:
    if not hasattr(scenario_states, "model"):
        scenario_states.model = make_model(1, args.int8)
        scenario_states.folder = tempfile.mkdtemp()
        with torch.no_grad():
            scenario_states.cache = scenario_states.model(PROMPT, use_cache=True).past_key_values
    model, cache = scenario_states.model, scenario_states.cache
    path = Path(scenario_states.folder) / "state.safetensors"
    forked = cache.fork(1)
    forked.save(path)
    loaded = GPNCache.load(path, model.model)
    with torch.no_grad():
        model(torch.tensor([[3]]), cache=loaded, use_cache=True)


def scenario_store(args: argparse.Namespace, step: int) -> None:
    from modeling_gpn.serve.state_store import StateStore

    if not hasattr(scenario_store, "store"):
        scenario_store.model = make_model(1, args.int8)
        scenario_store.store = StateStore(max_bytes=2**20)
    model, store = scenario_store.model, scenario_store.store
    ids = [1 + (step * 7 + i) % 96 for i in range(6)]
    with torch.no_grad():
        cache = model(torch.tensor([ids]), use_cache=True).past_key_values
    store.keep(model, ids, cache)
    found = store.lookup(model, ids + [5])
    assert found is not None and found[0] == len(ids)


SCENARIOS = {name.removeprefix("scenario_"): value for name, value in globals().items() if name.startswith("scenario_")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), action="append", help="(repeatable; default: all)")
    parser.add_argument("--iterations", type=int, default=1000)
    parser.add_argument("--every", type=int, default=100, help="report every this many iterations")
    parser.add_argument("--int8", action="store_true", help="torchao int8 weight-only linears (the int8 C products)")
    parser.add_argument("--tracemalloc", action="store_true", help="count Python allocations too (slower)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.tracemalloc:
        tracemalloc.start()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, int8: {args.int8}", flush=True)
    for name in args.scenario or sorted(SCENARIOS):
        run = SCENARIOS[name]
        run(args, 0)  # (warm-up: the kernels built, first plans and caches made)
        gc.collect()
        start = (rss_mb(), len(gc.get_objects()), malloc_mb())
        report(name, 1, start)
        for step in range(1, args.iterations):
            run(args, step)
            if (step + 1) % args.every == 0:
                report(name, step + 1, start)


if __name__ == "__main__":
    main()
