"""Where the time inside one decoded token's C call goes (`gpn_decode`): each phase of the call timed on its
own, from a build of the kernels that stamps the clock where every phase starts.

    python benchmarks/profile_phases.py --preset small --dtype bfloat16 --threads 2

The phases are separated by barriers, so a phase's time runs from one barrier to the next: its work on the
slowest thread and the wait of the others. A product phase (`run_tasks`) reads its weights; the others are
the norms, gates, the memory's heads and the copies between them. Prints, per phase in the order the call
runs them, the median over `--steps` calls in microseconds and its share; then the call's own median
(`DecodePlan`'s call, its argument checks included, on the uninstrumented build, timed in turn) beside the
byte limit of the whole step (`bench.limit`: a read of its bytes), and the model's one-token step around the
call, timed on its own, step after step (the Python of the forward and the cache: `profile_step.py` says
where that goes).
Run nothing else meanwhile.
"""

from __future__ import annotations

import argparse
import ctypes
import re
import statistics
import time

import torch

from modeling_gpn import memory_kernels as mk
from modeling_gpn.bench import ReadProbe, build_gpn, one_token_step_fn, step_bytes
from modeling_gpn.recurrence_step import StepState

STAMPS = 256
_CLOCK = f"""#include <omp.h>
double gpn_stamp_time[{STAMPS}]; int gpn_stamp_line[{STAMPS}], gpn_stamps;
#define STAMP() do {{ if (omp_get_thread_num() == 0 && gpn_stamps < {STAMPS}) {{ \\
    gpn_stamp_time[gpn_stamps] = omp_get_wtime(); gpn_stamp_line[gpn_stamps++] = __LINE__; }} }} while (0)
"""


def stamped_source() -> str:
    """The kernels' source with a stamp where every phase of `step_body` and `gpn_decode` starts (before each
    work-sharing loop, and before each call of `run_tasks`) and one after the call's last barrier."""
    lines, out, inside = mk.SOURCE.split("\n"), [], False
    for line in lines:
        if line.startswith(("static void step_body(", "int gpn_decode(")):
            inside = True
        elif line.startswith("}"):
            inside = False
        if inside and (line.strip().startswith("#pragma omp for") or line.strip().startswith("run_tasks(")):
            out.append("STAMP();")
        out.append(line)
    source = "\n".join(out)
    last = "        run_tasks(D->segs, D->tasks, D->phases[4], D->phases[5], B);\n    }"
    if last not in source.replace("STAMP();\n", ""):
        raise SystemExit("the kernels' source changed: update profile_phases.py's stamps")
    source = source.replace(last, last[:-6] + "\n        #pragma omp barrier\n        STAMP();\n    }")
    return _CLOCK + source


PRODUCTS = {  # the first task range each call of run_tasks reads: what its products compute
    "D->phases[0]": "products: W_fuse (the token's input)",
    "P->phases[0]": "products: W_fg (+ W_key of the carried g)",
    "P->phases[4*l+4]": "products: the layer's projections (+ the write's)",
    "P->phases[4*l+6]": "products: W_ffn_out (+ W_read_out)",
    "D->phases[2]": "products: W_dec",
    "D->phases[4]": "products: the logits",
}


LOOPS = {  # what the other phases compute, by a piece of their first lines
    "D->fuse_norm": "the token's embedding row, normed",
    "&S[SLOT_FG]": "rms(p) (and rms(g) for the key)",
    "gr[j] = sigmoidf_": "g = sigmoid(.) p + u, and its norms",
    "&S[SLOT_GATE], b, p_out": "a layer above: the norms of its state",
    "memory_head(": "the memory: each head's write and read",
    "SLOT_HIDDEN": "the output products' inputs: silu(a) b, the gated read",
    "sigmoidf_(pr[c_gate + j])": "state' = gate * state + FFN + read",
    "key_out[b * kw + j]": "the new key (and gamma) out",
    "D->decode_norm": "rms(p') for the decoder",
    "&D->slots[2]": "the decoded row into the logits' input",
}


def phase_names(source: str, line_numbers: list[int]) -> list[str]:
    """A name for the phase starting at each stamp: what its products or its loop compute."""
    lines, names = source.split("\n"), []
    for number in line_numbers:
        code = lines[number].strip()  # (__LINE__ is 1-based: the line after the stamp)
        if code.startswith("run_tasks("):
            first = re.sub(r"\s+", "", code.split(",")[2])
            names.append(PRODUCTS.get(first, f"products from {first}"))
            continue
        text = "\n".join(lines[number : number + 12])
        names.append(next((name for piece, name in LOOPS.items() if piece in text), lines[number + 1].strip()[:70]))
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "int8"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--flags", default="", help="extra compiler flags of both builds (say -DTILED_INT8=0)")
    args = parser.parse_args()
    flags = tuple(args.flags.split())
    torch.set_num_threads(args.threads)
    model = build_gpn(args.preset, args.dtype, "cpu", 0).eval()
    step = one_token_step_fn(model, 1, model.config.vocab_size, "cpu")
    captured = {}
    decode_call = mk.DecodePlan.__call__

    def capture(plan, ids, state, ids_hash=None):
        captured["call"] = (plan, ids.clone(), state)
        return decode_call(plan, ids, state, ids_hash)

    mk.DecodePlan.__call__ = capture
    step()
    mk.DecodePlan.__call__ = decode_call
    if "call" not in captured:
        raise SystemExit("the one-token step did not run as one C call (GPN_DECODE_KERNEL, or a refused model)")
    plan, ids, (p, g, _, M) = captured["call"]
    state = StepState(p, g, plan.key if plan.step_plan.memory else None, M)  # (a decode loop's next call)
    default = mk.variant(flags) if flags else mk._library
    source = stamped_source()
    mk.SOURCE, original = source, mk.SOURCE
    try:
        stamped = mk.variant(flags)
    finally:
        mk.SOURCE = original

    def call_on(library) -> None:  # (the state advanced in place, as a decode loop's calls advance it)
        mk._library = library
        try:
            plan(ids, state)
        finally:
            mk._library = default

    count = ctypes.c_int.in_dll(stamped, "gpn_stamps")
    times = (ctypes.c_double * STAMPS).in_dll(stamped, "gpn_stamp_time")
    lines = (ctypes.c_int * STAMPS).in_dll(stamped, "gpn_stamp_line")
    probe = ReadProbe(step_bytes(model))
    phases, whole, limit, plain = {}, [], [], []
    for _ in range(args.steps):
        count.value = 0
        call_on(stamped)
        marks = [(lines[i], times[i]) for i in range(count.value)]
        for index, ((line, start), (_, end)) in enumerate(zip(marks, marks[1:])):
            phases.setdefault((index, line), []).append(end - start)
        start = time.perf_counter()
        call_on(default)
        whole.append(time.perf_counter() - start)
        probe()  # (untimed: the probe's bytes back where a decode loop's weights are between tokens)
        start = time.perf_counter()
        probe()
        limit.append(time.perf_counter() - start)
    for _ in range(args.steps):  # (consecutive, as a decode loop runs them)
        start = time.perf_counter()
        step()
        plain.append(time.perf_counter() - start)
    names = phase_names(source, [line for _, line in phases])
    medians = [1e6 * statistics.median(values) for values in phases.values()]
    total = sum(medians)
    print(
        f"{args.preset} {args.dtype}, {args.threads} thread(s), {args.flags or 'no extra flags'}, medians of {args.steps} calls\n"
    )
    print("| phase | us | share |\n|---|---|---|")
    for name, us in zip(names, medians):
        print(f"| {name} | {us:.1f} | {us / total:.0%} |")
    products = sum(us for name, us in zip(names, medians) if name.startswith("products"))
    print(f"| **all phases** | {total:.1f} | products {products / total:.0%} |\n")
    call_ms, limit_ms, step_ms = (1e3 * statistics.median(v) for v in (whole, limit, plain))
    print(
        f"the call (`DecodePlan`, uninstrumented): {call_ms:.3f} ms; the byte limit {limit_ms:.3f} ms ({probe.nbytes / 1e6:.1f} MB "
        f"at {probe.nbytes / limit_ms / 1e6:.0f} GB/s, {probe.kind}): {call_ms / limit_ms:.2f}x; the model's one-token "
        f"step around it {step_ms:.3f} ms ({step_ms - call_ms:+.3f} ms)"
    )


if __name__ == "__main__":
    main()
