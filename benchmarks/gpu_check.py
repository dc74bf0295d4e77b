"""CUDA correctness of the fast path and its Triton kernels, run by gpu_check.sh (one line per check).

    python benchmarks/gpu_check.py [--out DIR]          correctness (exit 1 if any check fails)
    python benchmarks/gpu_check.py --decode-timing      + the 130M model's one-token step, graphs on and off
    python benchmarks/gpu_check.py --training-timing    the 130M model's training step (16 x 256), graphs on
                                                        and off, and their gradients compared (no other check)
    python benchmarks/gpu_check.py --profile            where the 130M model's step time goes: GPU time per
                                                        kernel per step (torch.profiler, graphs off), the GPU's
                                                        busy fraction, the HBM bandwidth achieved (no check)
    python benchmarks/gpu_check.py --summary DIR        the JSON summary of gpu_check.sh's bench runs

Checks: fp32 fast (Triton) == fast (torch ops) == plain, losses and every gradient, for GPN+M, GPN, 2
layers with bias, segmented + truncated BPTT, with padding masks; that the Triton kernels really ran; bf16
fast (Triton and torch ops) tracking fp32 plain over 512 tokens, and bf16 training gradients of the two
backends agreeing; the decode step through a CUDA graph (GPN_CUDA_GRAPHS=1) = plain generate(); training
windows through the captured forward and backward sweeps (`cuda_graphs.TrainingSweep`) = without graphs =
plain, fp32 and bf16, the second call replaying the graphs. Without
CUDA it says so and exits 2 (gpu_check.sh then runs the CPU-interpreter tests instead).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import torch

from modeling_gpn import triton_kernels as tk
from modeling_gpn.bench import BackendProbe
from modeling_gpn.bench.models import perturbed_gpn, tiny_config

FAILURES: list[str] = []
STARTED = time.monotonic()


def stamp() -> str:
    """The wall clock and the seconds since this process started, for every line (where did the time go)."""
    return f"{time.strftime('%H:%M:%S')} +{time.monotonic() - STARTED:.1f}s"


def report(ok: bool, text: str) -> bool:
    print(f"[{'ok' if ok else 'FAIL'}] {text} ({stamp()})", flush=True)
    if not ok:
        FAILURES.append(text)
    return ok


def self_checks(device: str, preset: str = "gpn-m-1l-130m", batches=(1, 16)) -> dict:
    """The Triton kernels' self-check (`triton_kernels.self_check`) for what the timings after it run: the
    130M GPN+M in bf16 at these batch sizes (1: the decode step; 16: training, profile and the bench; the
    check adds batches 2 and 16, which select other compiled variants), before any timing, each reported.
    On a GPU this also compiles every kernel variant the timings use (Triton keeps them in its on-disk
    cache, so the later stages' processes load them instead of compiling). Returns {combination: "passed"
    or what differed} (also what every later check of the process added: `tk.self_check_summary`)."""
    from modeling_gpn.bench import build_gpn
    from modeling_gpn.fast_recurrence import cached_folded_weights, shapes_of

    if DRY_RUN:
        preset, batches = "tiny", (1,)
    backend("triton")
    model = build_gpn(preset, torch.bfloat16, device, 256)
    started = time.monotonic()
    with torch.no_grad():
        for batch in batches:
            s = shapes_of(model.model, batch)
            w = cached_folded_weights(model.model, rows=batch)
            # the model's own device (cuda:0): self-checks are kept by its name, and the later stages' forwards ask
            # for that one, so a check under "cuda" would run again there
            tk.self_check(w, s, model.config.rms_norm_eps, model.device, torch.bfloat16)
    for combination, verdict in tk.self_check_summary().items():
        report(verdict == "passed", f"self-check {combination}: {verdict}")
    print(
        f"[time] self-checks of {preset} bf16 at batches {batches} (compiling the kernels on a cold machine): "
        f"{time.monotonic() - started:.1f} s",
        flush=True,
    )
    return tk.self_check_summary()


def write_json(out: str | None, name: str, value) -> None:
    """`value` as `out`/`name` (the folder made if need be: a dry run's --out was lost at the end otherwise)."""
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, name).write_text(json.dumps(value, indent=1, default=str), encoding="utf-8")


DRY_RUN = False  # --dry-run-cpu: the same checks on CPU through Triton's interpreter, short sequences


def cuda_route_on_cpu() -> None:
    """For a dry run: switch off what runs only on CPU, so the fast path takes the route it takes on CUDA. The C
    kernels (`memory_kernels`; GPN_MEMORY_KERNELS=0 turns off the step kernels with them) would otherwise run
    every decoded token of ids on the CPU as one C call before the dispatcher is asked, and the whole no-grad
    step of a small batch: the decode timing and generate()'s decode graph would then check and time C calls,
    not the Triton steps and graphs a GPU runs (and "torch ops" would be the C memory kernels)."""
    os.environ["GPN_MEMORY_KERNELS"] = "0"


def backend(name: str) -> None:
    """Select the fast path's backend: 'triton' (the default on CUDA; forced on CPU in a dry run) or 'torch ops'."""
    os.environ["GPN_TRITON"] = "0" if name == "torch ops" else ("1" if DRY_RUN else "auto")


def grads_of(model, path, ids, mask):
    """(loss, {parameter: gradient}, Triton launches) of one training step on `path`: plain / triton / torch ops."""
    model.model.use_fast_path = path != "plain"
    backend("torch ops" if path == "plain" else path)
    model.zero_grad(set_to_none=True)
    before = sum(tk.launches.values())
    out = model(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100), return_logits=path == "plain")
    out.loss.backward()
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach().float(), grads, sum(tk.launches.values()) - before


def worst_relative(a: dict, b: dict) -> float:
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-6)).item() for k in b)


def lowest_cosine(a: dict, b: dict) -> float:
    """The lowest cosine similarity between a's and b's gradients, over those not all zero in b."""
    return min(
        torch.nn.functional.cosine_similarity(a[k].flatten(), b[k].flatten(), dim=0).item()
        for k in b
        if b[k].abs().max() > 0
    )


def correctness(device: str) -> None:
    report(tk.available(), f"triton importable and the kernels build: {tk.unavailable_reason() or 'yes'}")
    variants = {
        "gpn+m": {},
        "gpn": dict(use_memory=False),
        "2l-bias": dict(num_predict_layers=2, use_decoder_bias=True),
        "gpn+m-seg5-trunc8": dict(bptt_segment_length=5, bptt_truncation_length=8),
        "awkward-h1-dk5-dv7": dict(num_memory_heads=1, memory_key_dim=5, memory_value_dim=7),
    }
    for name, kw in variants.items():
        model = perturbed_gpn(tiny_config(**kw)).to(device).train()
        g = torch.Generator().manual_seed(1)
        length = 9 if DRY_RUN else 63
        ids = torch.randint(0, 97, (3, length), generator=g).to(device)
        mask = (torch.rand(3, length, generator=g) > 0.2).long().to(device)
        mask[:, :8] = 1  # some unmasked steps too (the Triton backward splits the gradients of masked ones only)
        plain_loss, plain, _ = grads_of(model, "plain", ids, mask)
        for path in ("torch ops", "triton"):
            loss, grads, launches = grads_of(model, path, ids, mask)
            worst = worst_relative(grads, plain)
            ok = abs(loss - plain_loss).item() < 1e-4 and worst < 1e-3 and (launches > 0) == (path == "triton")
            report(
                ok,
                f"{device} fp32 fast ({path}) == plain ({name}): loss diff {abs(loss - plain_loss).item():.2e}, "
                f"worst relative grad diff {worst:.2e}, Triton launches {launches}",
            )

    # bf16 weights (the benchmark's setting): both backends track fp32 plain, and agree with each other
    config = tiny_config()
    reference = perturbed_gpn(config, 3).to(device).eval()
    low = perturbed_gpn(config, 3).to(device).to(torch.bfloat16).eval()
    length = 24 if DRY_RUN else 512
    ids = torch.randint(0, 97, (2, length), generator=torch.Generator().manual_seed(4)).to(device)
    with torch.no_grad():
        reference.model.use_fast_path = False
        expected = reference(ids).logits.float().log_softmax(-1)
        got = {}
        for path in ("torch ops", "triton"):
            backend(path)
            got[path] = low(ids).logits.float().log_softmax(-1)
            diff = (got[path] - expected).abs()
            report(
                diff.max().item() < 0.1 and diff.mean().item() < 0.02,
                f"{device} bf16 fast ({path}) vs fp32 plain over {length} tokens: max |dlogp| {diff.max().item():.4f}, "
                f"mean {diff.mean().item():.5f}",
            )
        between = (got["triton"] - got["torch ops"]).abs()
        report(
            between.max().item() < 0.05, f"{device} bf16 Triton vs torch ops: max |dlogp| {between.max().item():.4f}"
        )
    low.train()
    ids = ids[:, :16] if DRY_RUN else ids[:, :128]
    mask = torch.ones_like(ids)
    loss_ops, grads_ops, _ = grads_of(low, "torch ops", ids, mask)
    loss_tri, grads_tri, _ = grads_of(low, "triton", ids, mask)
    cosine = lowest_cosine(grads_tri, grads_ops)
    report(
        abs(loss_tri - loss_ops).item() < 1e-2 and cosine > 0.99,
        f"{device} bf16 training, Triton vs torch ops: loss diff {abs(loss_tri - loss_ops).item():.2e}, "
        f"lowest gradient cosine {cosine:.4f}",
    )

    # the decode step through a CUDA graph = plain generate()
    model = perturbed_gpn(tiny_config(num_predict_layers=2), 12).to(device).eval()
    prompt = torch.randint(1, 97, (2, 9), generator=torch.Generator().manual_seed(5)).to(device)
    backend("triton")
    with torch.no_grad():
        model.model.use_fast_path = False
        new = 4 if DRY_RUN else 16
        plain = model.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, do_sample=False, pad_token_id=0
        )
        model.model.use_fast_path = True
        try:
            with graphs_setting("1"):
                graphed = model.generate(
                    prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, do_sample=False, pad_token_id=0
                )
                graphs = list(getattr(model.model, "_gpn_graphs", {}).values())
                ok = (
                    torch.equal(graphed, plain)
                    and bool(graphs)
                    and (DRY_RUN or all(g.graphs is not None for g in graphs))
                )
                report(
                    ok,
                    f"{device} generate() through the captured decode graph == plain: tokens equal {torch.equal(graphed, plain)}",
                )
                # a longer no-grad window: chunks of WINDOW_CHUNK steps per replay, then single steps
                ids = torch.randint(1, 97, (2, 70), generator=torch.Generator().manual_seed(6)).to(device)
                with_graphs = model(ids).logits
            with graphs_setting("0"):
                without = model(ids).logits
            diff = (with_graphs - without).abs().max().item()
            report(
                diff < 1e-4,
                f"{device} a 70-token window through graph chunks == without graphs: max |dlogit| {diff:.2e}",
            )
            # weights swapped by assigning a new Parameter: the captured graph copies the new values into its own
            # weights, never into the old Parameter (float32's folded fuse-gate bias is that Parameter itself)
            gate = model.model.fuse_gate
            old_bias, kept = gate.bias, gate.bias.detach().clone()
            gate.bias = torch.nn.Parameter(old_bias.detach() + 0.5)
            with graphs_setting("1"):
                swapped = model(ids).logits
            with graphs_setting("0"):
                swapped_without = model(ids).logits
            gate.bias = old_bias
            untouched = torch.equal(old_bias.detach(), kept)
            diff = (swapped - swapped_without).abs().max().item()
            report(
                untouched and diff < 1e-4,
                f"{device} a new fuse-gate bias Parameter through the captured graphs: the old one untouched "
                f"{untouched}, max |dlogit| against no graphs {diff:.2e}",
            )
        except Exception as error:  # noqa: BLE001 (report and go on: the bench runs without graphs then)
            report(False, f"{device} decode graph: {type(error).__name__}: {error}")
    training_graphs(device)


def training_graphs(device: str) -> None:
    """Training windows through the captured sweeps (GPN_CUDA_GRAPHS=1) == without graphs == plain: BPTT
    segments with a shorter last one, 2 layers, fp32 and bf16; the second call replays the graphs."""
    length, segment = (9, 4) if DRY_RUN else (70, 40)
    ids = torch.randint(0, 97, (3, length), generator=torch.Generator().manual_seed(7)).to(device)
    mask = torch.ones_like(ids)
    for dtype in (torch.float32, torch.bfloat16):
        model = (
            perturbed_gpn(tiny_config(num_predict_layers=2, bptt_segment_length=segment), 14)
            .to(device)
            .to(dtype)
            .train()
        )
        try:
            plain_loss, plain, _ = grads_of(model, "plain" if dtype == torch.float32 else "triton", ids, mask)
            _, eager, _ = grads_of(model, "triton", ids, mask)
            with graphs_setting("1"):
                for _call in (1, 2):
                    loss, graphed, _ = grads_of(model, "triton", ids, mask)
            sweeps = list(getattr(model.model, "_gpn_training_sweeps", {}).values())
            captured = sum(len(sweep.graphs) for sweep in sweeps)
            ran = bool(sweeps) and (DRY_RUN or captured > 0)
            if dtype == torch.float32:
                worst, worst_eager = worst_relative(graphed, plain), worst_relative(graphed, eager)
                ok = ran and abs(loss - plain_loss).item() < 1e-4 and worst < 1e-3 and worst_eager < 1e-3
                report(
                    ok,
                    f"{device} fp32 training through graphs == plain == without graphs: loss diff "
                    f"{abs(loss - plain_loss).item():.2e}, worst relative grad diff {worst:.2e} (plain), "
                    f"{worst_eager:.2e} (without graphs), graphs captured {captured}",
                )
            else:
                cosine = lowest_cosine(graphed, eager)
                ok = ran and abs(loss - plain_loss).item() < 1e-2 and cosine > 0.99
                report(
                    ok,
                    f"{device} bf16 training through graphs vs without: loss diff {abs(loss - plain_loss).item():.2e}, "
                    f"lowest gradient cosine {cosine:.4f}, graphs captured {captured}",
                )
        except Exception as error:  # noqa: BLE001 (report and go on)
            report(False, f"{device} training graphs ({dtype}): {type(error).__name__}: {error}")


def training_timing(device: str, preset: str = "gpn-m-1l-130m", batch: int = 16, length: int = 256) -> dict:
    """One training step (forward, loss, backward) of the 130M GPN+M in bf16 at batch x length (one BPTT
    segment), with the training graphs off and on: ms per step, tokens/s and the gradients' agreement."""
    from modeling_gpn.bench import build_gpn

    if DRY_RUN:
        batch, length = 2, 8
    model = build_gpn(preset, torch.bfloat16, device, length).train()
    backend("triton")
    ids = torch.randint(1, model.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(8)).to(
        device
    )
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    figures, grads, backends = {}, {}, {}
    for graphs in ("0", "1"):
        name = "on" if graphs == "1" else "off"
        times = []
        with graphs_setting(graphs):
            for _repeat in range(3):  # the first: warm-up (compiles kernels; with graphs, captures them)
                model.zero_grad(set_to_none=True)
                sync()
                start = time.perf_counter()
                with BackendProbe() as probe:
                    model(ids, labels=ids).loss.backward()
                sync()
                times.append(time.perf_counter() - start)
        backends[f"train_step_ms_graphs_{name}"] = probe.text  # (of the last, timed, step)
        grads[name] = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
        step = min(times[1:])
        figures[f"train_step_ms_graphs_{name}"] = 1e3 * step
        figures[f"train_tok_s_graphs_{name}"] = batch * length / step
        figures[f"first_step_s_graphs_{name}"] = times[0]
    figures["lowest_gradient_cosine_on_vs_off"] = cosine = lowest_cosine(grads["on"], grads["off"])
    sweeps = list(getattr(model.model, "_gpn_training_sweeps", {}).values())
    figures["graphs_captured"] = captured = sum(len(sweep.graphs) for sweep in sweeps)
    ran = bool(sweeps) and (DRY_RUN or captured > 0)
    report(
        ran and cosine > 0.99,
        f"{device} {preset} bf16 {batch}x{length} training gradients, graphs on vs off: "
        f"lowest cosine {cosine:.4f}, graphs captured {captured}",
    )
    for key, value in figures.items():
        ran_on = f" (ran on: {backends[key]})" if key in backends else ""
        print(f"[time] {preset} bf16 {batch}x{length} {key}: {value:.3f}{ran_on}", flush=True)
    figures["backends"] = backends
    return figures


def decode_timing(device: str, preset: str = "gpn-m-1l-130m") -> dict:
    """ms per one-token step of the 130M GPN+M (bf16, batch 1): the graph replay, and the fast path without
    graphs (`GPNModel.forward` of one token with a cache, what generate() calls per token)."""
    from modeling_gpn.bench import build_gpn
    from modeling_gpn.cuda_graphs import graph_of
    from modeling_gpn.fast_recurrence import GRAPH_KERNELS
    from modeling_gpn.recurrence_step import cached_folded_weights

    model = build_gpn(preset, torch.bfloat16, device, 256).eval()
    core = model.model
    backend("triton")
    figures, backends = {}, {}
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    repeats = 20 if DRY_RUN else 1
    with torch.no_grad():
        state = tuple(x.normal_() if x.numel() else x for x in core.zero_state(1, torch.device(device)))
        u = torch.randn(1, core.config.hidden_size, device=device)
        graph = graph_of(
            core, 1, torch.device(device), 1, cached_folded_weights(core, rows=1), {}, kernels=GRAPH_KERNELS
        )
        st = state
        for _ in range(5):
            _, st, _ = graph(u, st)
        sync()
        start, n = time.perf_counter(), 200 // repeats
        for _ in range(n):
            p, st, _ = graph(u, st)
        sync()
        figures["graph_step_ms"] = 1e3 * (time.perf_counter() - start) / n
        captured = graph.graphs is not None
        backends["graph_step_ms"] = (
            "triton kernels in CUDA graphs" if captured else "triton kernels, no graphs (no CUDA)"
        )
        ids = torch.randint(1, core.config.vocab_size, (1, 1), device=device)
        out = model(input_ids=ids, use_cache=True)
        for graphs in ("0", "1"):
            cache = out.cache
            name = f"model_forward_one_token_ms_graphs_{'on' if graphs == '1' else 'off'}"
            with graphs_setting(graphs):
                for _ in range(5):
                    cache = model(input_ids=ids, cache=cache, use_cache=True).cache
                sync()
                start, n = time.perf_counter(), 100 // repeats
                with BackendProbe() as probe:
                    for _ in range(n):
                        cache = model(input_ids=ids, cache=cache, use_cache=True).cache
                sync()
                figures[name] = 1e3 * (time.perf_counter() - start) / n
            backends[name] = probe.text
    for key, value in figures.items():
        print(f"[time] {preset} bf16 batch 1 {key}: {value:.3f} (ran on: {backends[key]})", flush=True)
    figures["backends"] = backends
    return figures


def step_bytes(model, batch: int) -> dict:
    """The bytes one recurrence step must move at least, from HBM, for a batch of `batch` rows: every step
    matrix once (forward: fg, big, out and the layers' matrices, in the weights' dtype; at a few rows a
    matmul streams its weight) and the memory read and written once (M and M', float32). The backward step
    reads the transposes once more and M, M' and dL/dM' again. Their ratio to the time of a step is the
    bandwidth achieved, against the GPU's nominal one (`NOMINAL_HBM_GB_S`)."""
    from modeling_gpn.fast_recurrence import fold_weights

    with torch.no_grad():
        w = fold_weights(model.model)
    matrices = [w.fg_w, w.big_w, *w.out_w, *w.layer_w]
    weight = sum(m.numel() * m.element_size() for m in matrices)
    config = model.config
    memory = 0
    if config.use_memory:
        memory = batch * config.num_memory_heads * config.memory_key_dim * config.memory_value_dim * 4
    return {
        "step_weight_bytes": weight,
        "memory_bytes": memory,
        "forward_step_bytes": weight + 2 * memory,
        "backward_step_bytes": weight + 4 * memory,
    }


def kernel_table(events, steps: int) -> list:
    """[name, launches per step, GPU us per step, share of GPU time] of the profiled device kernels, most
    time first; `steps`: the recurrence steps the profile covered."""
    from collections import defaultdict

    count, total = defaultdict(int), defaultdict(float)
    for event in events:
        if event.device_type == torch.autograd.DeviceType.CUDA:
            count[event.name] += 1
            total[event.name] += event.time_range.elapsed_us()
    busy = sum(total.values()) or 1.0
    rows = sorted(total, key=total.get, reverse=True)
    return [
        [name[:90], round(count[name] / steps, 2), round(total[name] / steps, 2), round(total[name] / busy, 3)]
        for name in rows
    ]


def profile_timing(device: str, preset: str = "gpn-m-1l-130m", batch: int = 16, length: int = 256) -> dict:
    """Where a step's time goes, for the closing note: the 130M GPN+M in bf16 at batch x length.

    1. Speed of the recurrence alone (no-grad window, graphs off and on; and a training window, graphs
       as the environment says): ms per step and the HBM bandwidth that implies (`step_bytes`).
    2. A torch.profiler trace of one no-grad window and one training step (graphs off, so each kernel is
       seen): per kernel, launches and GPU microseconds per token position (for training: its forward,
       recompute and backward steps together, and the window's other work spread over its positions), its
       share of GPU time, and the GPU's busy fraction (kernel time / wall time: how launch-bound it is)."""
    from modeling_gpn.bench import build_gpn

    if DRY_RUN:
        preset, batch, length = "tiny", 2, 8
    model = build_gpn(preset, torch.bfloat16, device, length)
    backend("triton")
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    ids = torch.randint(1, model.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(9)).to(
        device
    )
    figures: dict = dict(step_bytes(model, batch), preset=preset, batch=batch, steps=length)

    def timed(call, repeats: int = 3) -> float:
        call()  # warm-up: compiles, captures
        sync()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            call()
            sync()
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2]

    def window() -> None:
        with torch.no_grad():
            model(ids, logits_to_keep=1)

    def training() -> None:
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()

    backends = figures["backends"] = {}
    model.eval()
    for graphs in ("0", "inference"):
        with graphs_setting(graphs), BackendProbe() as probe:
            step_s = timed(window) / length
        name = "off" if graphs == "0" else "on"
        figures[f"forward_step_us_graphs_{name}"] = 1e6 * step_s
        figures[f"forward_GB_s_graphs_{name}"] = figures["forward_step_bytes"] / step_s / 1e9
        backends[f"forward_step_us_graphs_{name}"] = probe.text
    model.train()
    with BackendProbe() as probe:
        train_s = timed(training) / length
    backends["training_step_us"] = probe.text
    figures["training_step_us"] = 1e6 * train_s  # forward + backward (+ the recompute) of one position
    figures["training_graphs"] = os.environ.get("GPN_CUDA_GRAPHS", "off")
    figures["training_GB_s"] = (figures["forward_step_bytes"] + figures["backward_step_bytes"]) / train_s / 1e9

    # the profile: graphs off, so every kernel shows
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    for name, call in (("forward", window), ("training", training)):
        model.train(name == "training")
        with graphs_setting("0"):
            call()
            sync()
            with torch.profiler.profile(activities=activities) as profiler:
                start = time.perf_counter()
                call()
                sync()
                wall = time.perf_counter() - start
        table = kernel_table(profiler.events(), length)
        busy_us = sum(row[2] for row in table)
        figures[f"{name}_profile"] = {
            "kernels_per_step": round(sum(row[1] for row in table), 2),
            "gpu_busy_us_per_step": round(busy_us, 2),
            "wall_us_per_step_under_profiler": round(1e6 * wall / length, 2),
            "gpu_busy_fraction": round(busy_us / (1e6 * wall / length), 3) if wall else None,
            "top_kernels": table[:15],
        }
    for key, value in figures.items():
        if key == "backends":
            for timing, ran_on in value.items():
                print(f"[backend] {preset} bf16 {batch}x{length} {timing} ran on: {ran_on}", flush=True)
        elif isinstance(value, dict):
            print(
                f"[profile] {name_of(key)}: {value['kernels_per_step']} kernels/step, GPU busy "
                f"{value['gpu_busy_us_per_step']} us/step of {value['wall_us_per_step_under_profiler']} us wall "
                f"({value['gpu_busy_fraction']})",
                flush=True,
            )
            for row in value["top_kernels"][:8]:
                print(f"    {row[2]:9.2f} us/step  {row[1]:6.2f}/step  {100 * row[3]:5.1f}%  {row[0]}", flush=True)
        else:
            print(
                f"[time] {preset} bf16 {batch}x{length} {key}: {value if isinstance(value, str) else round(value, 3)}",
                flush=True,
            )
    return figures


def name_of(key: str) -> str:
    return key.replace("_profile", "")


@contextlib.contextmanager
def graphs_setting(value: str):
    """GPN_CUDA_GRAPHS=value inside the block, then as it was."""
    before = os.environ.get("GPN_CUDA_GRAPHS")
    os.environ["GPN_CUDA_GRAPHS"] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("GPN_CUDA_GRAPHS", None)
        else:
            os.environ["GPN_CUDA_GRAPHS"] = before


# The nominal HBM bandwidth of the GPUs the device tool lends (an un-named run may get either), by name.
NOMINAL_HBM_GB_S = {"H200": 4800, "H100": 3350}


def gpu_and_bandwidth() -> tuple[str | None, str]:
    """This machine's GPU name and how a bandwidth figure names its ceiling ("GB/s of ~4800")."""
    if not torch.cuda.is_available():
        return None, "GB/s"
    name = torch.cuda.get_device_name(0)
    nominal = next((rate for gpu, rate in NOMINAL_HBM_GB_S.items() if gpu in name), None)
    return name, f"GB/s of ~{nominal}" if nominal else "GB/s, nominal unknown"


def summary(folder: Path) -> dict:
    """One JSON object from gpu_check.sh's outputs: the figures, each target's ratio, met or not; first what
    ran how: every stage's start, duration, limit and exit code (a timeout, and what it changed for the
    stages after it, in "notes"), the graphs setting the bench ran with and why, every self-check's verdict
    (by stage), and which backend each timing actually ran on (Triton kernels or torch ops, graphs or not)."""
    result: dict = {
        "notes": [],
        "stages": [],
        "self_checks": {},
        "backends": {},
        "correctness": None,
        "runs": {},
        "targets": {},
    }
    result["gpu"], bandwidth = gpu_and_bandwidth()
    stages_file = folder / "stages.tsv"  # written by gpu_check.sh: name, start, seconds, limit, exit code
    if stages_file.is_file():
        for line in stages_file.read_text().splitlines():
            name, start, seconds, limit, code = line.split("\t")
            stage = {"stage": name, "start": start, "seconds": int(seconds), "limit_s": int(limit), "exit": int(code)}
            result["stages"].append(stage)
            if stage["exit"] in (124, 137):
                result["notes"].append(f"stage '{name}' hit its {limit} s limit: what it had not finished is missing")
            elif stage["exit"] == -1:
                result["notes"].append(f"stage '{name}' was skipped: the budget was spent")
            elif stage["exit"] != 0:  # a failed check exits 1; so does a crash (a traceback), which prints no [FAIL]
                result["notes"].append(f"stage '{name}' exited {code}: a check failed or it crashed (see its output)")
    graphs_file = folder / "graphs_in_bench.json"  # written by gpu_check.sh: the bench's GPN_CUDA_GRAPHS and why
    if graphs_file.is_file():
        graphs = result["bench_graphs"] = json.loads(graphs_file.read_text())
        if graphs.get("setting") != "1":
            result["notes"].append(f"the bench ran with GPN_CUDA_GRAPHS={graphs.get('setting')}: {graphs.get('why')}")
    for path in sorted(folder.glob("*_self_checks.json")):
        checks = result["self_checks"][path.name.replace("_self_checks.json", "")] = json.loads(path.read_text())
        failed = {where: why for where, why in checks.items() if why != "passed"}
        if failed:
            result["notes"].append(f"self-check failures in {path.name} (the kernels were off there): {failed}")
    correctness_file = folder / "correctness.txt"
    if correctness_file.is_file():
        text = correctness_file.read_text()
        # "ok" only from a run that finished (`finish`'s last line): a crash after some [ok] lines (an exception
        # outside the checks' own try, a CUDA error) or a timeout leaves checks unrun, which is not "ok"
        finished = "all checks passed" in text or "check(s) failed" in text
        result["correctness"] = (
            "FAIL"
            if "[FAIL]" in text
            else ("ok" if finished else "did not finish" if "[ok]" in text else "did not run")
        )
    for name in ("decode", "training", "profile"):
        timing = folder / f"{name}_timing.json"
        if timing.is_file():
            result["backends"][name] = json.loads(timing.read_text()).get("backends")
    for path in sorted(folder.glob("bench_*.json")):
        bench = json.loads(path.read_text())
        fast_backends = next((row.get("backend", {}) for row in bench["rows"] if row["impl"] == "fast"), {})
        result["backends"][path.stem] = {
            "graphs setting": bench.get("cuda_graphs_setting"),
            **{f"fast {timing}": ran_on for timing, ran_on in fast_backends.items()},
        }
        result["self_checks"][path.stem] = bench.get("triton_self_checks")
        for timing, ran_on in result["backends"][path.stem].items():
            if timing.startswith("fast") and not str(ran_on).startswith("triton"):
                result["notes"].append(f"{path.stem}: the fast path's {timing[5:]} ran on {ran_on}, not the kernels")
    timing_file = folder / "decode_timing.json"
    if timing_file.is_file():
        result["decode_step"] = json.loads(timing_file.read_text())
    training_file = folder / "training_timing.json"
    if training_file.is_file():
        result["training_graphs"] = json.loads(training_file.read_text())
    for path in sorted(folder.glob("bench_*.json")):
        rows = {row["impl"]: row for row in json.loads(path.read_text())["rows"]}
        fast, llama = rows.get("fast"), rows.get("llama")
        run = {"fast": fast, "llama": llama}
        if fast and llama:
            run["train_ratio"] = fast["train_tok_s"] / llama["train_tok_s"]
            run["forward_ratio"] = fast["forward_tok_s"] / llama["forward_tok_s"]
        result["runs"][path.stem] = run
    targets = result["targets"]
    base = result["runs"].get("bench_16x2048", {})
    if "train_ratio" in base:
        targets["train >= 0.25x Llama at 16x2048"] = (round(base["train_ratio"], 3), base["train_ratio"] >= 0.25)
        targets["forward >= 0.25x Llama"] = (round(base["forward_ratio"], 3), base["forward_ratio"] >= 0.25)
        prefill = base["fast"]["prefill_tok_s"].get("4096")
        if prefill:
            targets["prefill @4096 >= 5000 tok/s"] = (round(prefill), prefill >= 5000)
        decode = base["fast"]["decode_ms"].get("4096")
        if decode:
            targets["generate() ms/token @4096 (reported)"] = (round(decode, 3), None)
    for stem, run in result["runs"].items():
        if stem.startswith("bench_large") and "train_ratio" in run:
            targets[f"train >= 0.5x Llama at the larger batch ({stem})"] = (
                round(run["train_ratio"], 3),
                run["train_ratio"] >= 0.5,
            )
    training = result.get("training_graphs", {})
    if training.get("train_step_ms_graphs_on"):
        speedup = training["train_step_ms_graphs_off"] / training["train_step_ms_graphs_on"]
        targets["training step 16x256, graphs on vs off (speed-up, reported)"] = (round(speedup, 2), None)
    profile_file = folder / "profile_timing.json"
    if profile_file.is_file():
        profile = result["profile"] = json.loads(profile_file.read_text())
        for name in ("on", "off"):
            if f"forward_GB_s_graphs_{name}" in profile:
                rate = profile[f"forward_GB_s_graphs_{name}"]
                targets[f"HBM bandwidth of a forward step, graphs {name} ({bandwidth}, reported)"] = (
                    round(rate),
                    None,
                )
        if "training_GB_s" in profile:
            targets[f"HBM bandwidth of a training step ({bandwidth}, reported)"] = (
                round(profile["training_GB_s"]),
                None,
            )
    step = result.get("decode_step", {}).get("graph_step_ms")
    if step is not None:
        targets["one-token step <= 0.1 ms (graph replay)"] = (round(step, 4), step <= 0.1)
    return result


def run_timing(name: str, timing, out: str | None) -> None:
    """Run one timing on CUDA, writing its figures to OUT/NAME_timing.json; a failure is reported, not raised."""
    try:
        figures = timing("cuda")
        figures["self_checks"] = tk.self_check_summary()
        if out:
            Path(out, f"{name}_timing.json").write_text(json.dumps(figures, default=str), encoding="utf-8")
    except Exception as error:  # noqa: BLE001
        report(False, f"{name} timing: {type(error).__name__}: {error}")


def finish(out: str | None, name: str) -> int:
    """Every self-check this process ran (a `name`_self_checks.json for the summary), one line, the exit code."""
    write_json(out, f"{name}_self_checks.json", tk.self_check_summary())
    print(f"{len(FAILURES)} check(s) failed" if FAILURES else "all checks passed", f"({stamp()})", flush=True)
    return 1 if FAILURES else 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None, help="folder for the *_timing.json and *_self_checks.json files")
    parser.add_argument(
        "--self-checks",
        action="store_true",
        help="only the kernels' self-checks at the 130M sizes the timings use (compiling every kernel "
        "variant they use into Triton's on-disk cache); writes self_checks_self_checks.json",
    )
    parser.add_argument("--decode-timing", action="store_true")
    parser.add_argument(
        "--training-timing",
        action="store_true",
        help="only the 130M training step with graphs on and off (writes training_timing.json)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="only where the 130M model's step time goes: per-kernel GPU time per step (torch.profiler), "
        "the GPU's busy fraction, and the HBM bandwidth achieved (writes profile_timing.json)",
    )
    parser.add_argument("--summary", default=None, help="print the JSON summary of this gpu_check.sh output folder")
    parser.add_argument(
        "--dry-run-cpu",
        action="store_true",
        help="check this script without a GPU: the correctness checks on CPU through Triton's "
        "interpreter (TRITON_INTERPRET=1 must be set before Python starts), short sequences",
    )
    args = parser.parse_args()
    if args.dry_run_cpu:
        global DRY_RUN
        DRY_RUN = True
        if not tk.interpreter_on():
            raise SystemExit("--dry-run-cpu needs TRITON_INTERPRET=1 in the environment")
        cuda_route_on_cpu()
        self_checks("cpu")  # (every self-check before any timing, as on a GPU)
        correctness("cpu")
        decode_timing("cpu", preset="tiny")  # (the code path only: CPU-interpreter times mean nothing)
        training_timing("cpu", preset="tiny")
        profile_timing("cpu")
        return finish(args.out, "dry_run")
    if args.summary:
        print(json.dumps(summary(Path(args.summary)), indent=1, default=str))
        return 0
    if not torch.cuda.is_available():
        print(
            "no CUDA device: the GPU correctness checks did not run (see tests/fast_path/test_triton_kernels.py for the "
            "CPU-interpreter ones)",
            flush=True,
        )
        return 2
    # every mode checks the kernels at the sizes it times before it times anything (each process keeps its
    # own verdicts; the compiled kernels come from Triton's cache after the first stage)
    if args.self_checks:
        self_checks("cuda", batches=(1, 16, 32, 64))  # (the bench's batches too: 16 x 2048, then 64 or 32)
        return finish(args.out, "self_checks")
    if args.training_timing:
        self_checks("cuda", batches=(16,))
        run_timing("training", training_timing, args.out)
        return finish(args.out, "training")
    if args.profile:
        self_checks("cuda", batches=(16,))
        run_timing("profile", profile_timing, args.out)
        return finish(args.out, "profile")
    if args.decode_timing:
        self_checks("cuda", batches=(1,))
    correctness("cuda")
    # every fast-path call on CUDA first checks the kernels against the torch ops (`triton_kernels.self_check`)
    report(
        tk.self_check_failure() is None,
        f"every self-check of this process on this GPU: {tk.self_check_failure() or 'matched the torch ops'}",
    )
    if args.decode_timing:
        run_timing("decode", decode_timing, args.out)
    return finish(args.out, "correctness")


if __name__ == "__main__":
    sys.exit(main())
