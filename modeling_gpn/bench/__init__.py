"""`gpn bench`: training, forward, prefill and decode speed and memory of GPN (plain and fast paths)
beside a parameter-matched Transformer++ (`LlamaForCausalLM`: RoPE, RMSNorm, SwiGLU, no bias), in one run.

Every figure is the median of `--repeats` timed runs after one warm-up. Training is forward + backward +
AdamW step on random tokens (the fast path uses the chunked loss, `return_logits=False`). Decode is
measured through `generate()` (greedy, batch 1) with a streamer that timestamps every new token: prefill
is the time to the first new token, decode the median gap between later tokens. Peak memory is
`torch.cuda.max_memory_allocated` on CUDA and the peak resident-set growth during the call on CPU
(polled every 2 ms after returning freed memory to the OS). GFLOP/s counts the matmul and memory
arithmetic of the model (training = 3x forward).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import threading
import time
from dataclasses import dataclass, field

import torch

IMPLEMENTATIONS = ("plain", "fast", "llama")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", nargs="+", default=["tiny", "small"], help="GPN presets or config JSON paths")
    parser.add_argument("--impl", nargs="+", default=list(IMPLEMENTATIONS), choices=IMPLEMENTATIONS,
                        help="implementations to measure")  # fmt: skip
    parser.add_argument("--batch", type=int, default=8, help="training / forward batch size")
    parser.add_argument("--seq-len", type=int, default=256, help="training / forward sequence length")
    parser.add_argument("--decode-prompt-lengths", type=int, nargs="*", default=[128, 1024, 4096],
                        help="prompt lengths for prefill and decode (batch 1); none to skip decoding")  # fmt: skip
    parser.add_argument("--decode-tokens", type=int, default=16, help="new tokens per generate() call")
    parser.add_argument("--memory-seq-lens", type=int, nargs="*", default=[],
                        help="also measure the training peak memory at these lengths (same batch)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats (median reported)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="weight dtype")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--segment-length", type=int, default=256,
                        help="bptt_segment_length for GPN training, as `gpn train --bptt-segment` (0: keep every "
                             "step); windows up to this long train without recomputation")  # fmt: skip
    parser.add_argument("--skip-plain-decode", action="store_true",
                        help="do not run the (slow) plain path through generate()")  # fmt: skip
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    parser.add_argument("--json", default=None, help="also write all figures to this JSON file")


# --------------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------------


def build_gpn(preset: str, dtype: torch.dtype, device: str, segment_length: int):
    from modeling_gpn import GPNForCausalLM
    from modeling_gpn.configuration import load_preset

    config = load_preset(preset)
    config.bptt_segment_length = segment_length or None
    torch.manual_seed(0)
    model = GPNForCausalLM(config).to(device=device, dtype=dtype)
    with torch.no_grad():  # the zero-initialised gates and outputs would make parts of the step trivial
        for name, param in model.named_parameters():
            if param.dim() == 2 and not param.any():
                param.normal_(0, 0.02)
    return model


def matched_llama(gpn_config, params: int, dtype: torch.dtype, device: str):
    """A LlamaForCausalLM with hidden = the GPN's embedding width, tied embeddings, and as many layers as
    bring it closest to `params` parameters."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden = gpn_config.embedding_size
    inter = max(64, int(round(8 * hidden / 3 / 64)) * 64)
    heads = max(1, hidden // 64)
    per_layer = 4 * hidden * hidden + 3 * hidden * inter + 2 * hidden
    layers = max(1, round((params - gpn_config.vocab_size * hidden - hidden) / per_layer))
    config = LlamaConfig(
        vocab_size=gpn_config.vocab_size, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=1 << 15,
        tie_word_embeddings=True, attention_bias=False, mlp_bias=False, eos_token_id=None, bos_token_id=None,
        pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device=device, dtype=dtype)
    return model


def count_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def forward_flops_per_token(model, context: int) -> float:
    """Multiply-adds x 2 of one token's forward pass (matmuls, memory, attention at a mean context)."""
    config = model.config
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    embedding = model.get_input_embeddings().weight.numel()
    if config.model_type == "gpn":
        cells = config.memory_cells
        return 2.0 * (linear + embedding) + (6 + 2 * config.num_predict_layers) * cells
    if getattr(config, "tie_word_embeddings", False):
        linear += embedding
    return 2.0 * linear + 2.0 * config.num_hidden_layers * context * config.hidden_size


# --------------------------------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------------------------------


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class PeakMemory:
    """Peak memory of a region: CUDA's allocator counter, or the peak RSS growth on CPU."""

    def __init__(self, device: str):
        self.device = device
        self.peak = None

    def __enter__(self):
        gc.collect()
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
            return self
        try:
            import psutil
        except ImportError:
            self.process = None
            return self
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except OSError:
            pass
        self.process = psutil.Process()
        self.base = self.process.memory_info().rss
        self.running, self.max_rss = True, self.base
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()
        return self

    def _poll(self) -> None:
        while self.running:
            self.max_rss = max(self.max_rss, self.process.memory_info().rss)
            time.sleep(0.002)

    def __exit__(self, *exc):
        if self.device.startswith("cuda"):
            synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated()
            return False
        if self.process is not None:
            self.running = False
            self.thread.join()
            self.max_rss = max(self.max_rss, self.process.memory_info().rss)
            self.peak = self.max_rss - self.base
        return False


def timed_alternating(fns: dict, device: str, repeats: int, warm_up: bool = True) -> dict:
    """Median seconds of each `fns[name]()` after one warm-up each (unless the caller ran it), the
    implementations timed in turn within every repeat, so that a slow spell of a noisy machine hits all
    of them alike."""
    for fn in fns.values() if warm_up else ():
        fn()
        synchronize(device)
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            synchronize(device)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def train_step_fn(model, kind: str, ids: torch.Tensor):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    model.train()

    def step():
        optimizer.zero_grad(set_to_none=True)
        if kind == "llama":
            loss = model(input_ids=ids, labels=ids).loss
        else:
            loss = model(input_ids=ids, labels=ids, return_logits=kind == "plain").loss
        loss.backward()
        optimizer.step()

    return step


class TokenTimes:
    """A generate() streamer that timestamps every put (the prompt first, then each new token)."""

    def __init__(self, device: str):
        self.device, self.stamps = device, []

    def put(self, value) -> None:
        synchronize(self.device)
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass


def cache_nbytes(cache) -> int:
    if hasattr(cache, "nbytes") and callable(cache.nbytes):
        return int(cache.nbytes())
    total = 0
    for layer in getattr(cache, "layers", []):
        for name in ("keys", "values"):
            tensor = getattr(layer, name, None)
            if isinstance(tensor, torch.Tensor):
                total += tensor.numel() * tensor.element_size()
    return total


@dataclass
class Row:
    preset: str
    impl: str
    params: int
    train_tok_s: float | None = None
    train_gflop_s: float | None = None
    forward_tok_s: float | None = None
    forward_gflop_s: float | None = None
    train_peak_bytes: dict = field(default_factory=dict)
    prefill_tok_s: dict = field(default_factory=dict)
    decode_ms: dict = field(default_factory=dict)
    cache_bytes: dict = field(default_factory=dict)
    # what each timing of the fast path actually ran on ("train", "forward", "decode": `BackendProbe`)
    backend: dict = field(default_factory=dict)


class BackendProbe:
    """What the fast path ran on while the block ran, from the Triton kernel launches and CUDA graph replays
    made meanwhile (`triton_kernels.launches`, `cuda_graphs.replays`): "triton kernels in CUDA graphs",
    "triton kernels, no graphs" or "torch ops" (on CPU: with the C memory kernels where they are on, as the
    report's "GPN memory kernels" says). The plain path and Llama launch neither, so a block timing them
    beside the fast path still tells the fast path's. Why: a failed self-check or a fallback runs the torch
    ops in silence, and their figures must not pass for the kernels'."""

    def __enter__(self):
        from modeling_gpn import cuda_graphs, triton_kernels

        self.launches = sum(triton_kernels.launches.values())
        self.replays = sum(cuda_graphs.replays.values())
        self.text = None
        return self

    def __exit__(self, *exc):
        from modeling_gpn import cuda_graphs, triton_kernels

        launches = sum(triton_kernels.launches.values()) - self.launches
        replays = sum(cuda_graphs.replays.values()) - self.replays
        if replays:
            self.text = f"triton kernels in CUDA graphs ({replays} replays, {launches} eager launches)"
        elif launches:
            self.text = f"triton kernels, no graphs ({launches} launches)"
        else:
            self.text = "torch ops"
        return False


def generate_timings(model, prompt: torch.Tensor, args) -> tuple[float, list[float], int]:
    """One greedy generate() call: (seconds to the first new token, gaps between the later tokens,
    bytes of the cache it ended with)."""
    device = args.device
    streamer = TokenTimes(device)
    synchronize(device)
    start = time.perf_counter()
    out = model.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=args.decode_tokens,
        min_new_tokens=args.decode_tokens, do_sample=False, streamer=streamer, pad_token_id=0,
        return_dict_in_generate=True,
    )  # fmt: skip
    stamps = streamer.stamps  # [prompt, token 1, token 2, ...]
    cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
    return stamps[1] - start, [b - a for a, b in zip(stamps[1:], stamps[2:])], cache_nbytes(cache)


def memory_kernels_state(device: str) -> str:
    """'on', or 'off (why)': whether the fast path ran the fused C memory kernels (CPU only)."""
    from modeling_gpn import memory_kernels

    if not device.startswith("cpu"):
        return "off (CPU only)"
    return "on" if memory_kernels.available() else f"off ({memory_kernels.unavailable_reason()})"


def self_checks_state() -> dict:
    """Every Triton self-check this process ran: {combination: "passed" or what differed} (`triton_kernels`)."""
    from modeling_gpn import triton_kernels

    return triton_kernels.self_check_summary()


def release_reused_buffers(model) -> None:
    """Free the memory buffers a GPN's training calls keep for the next call (`BufferPool`), so that a
    peak-memory probe sees what a first call allocates."""
    if hasattr(model, "model") and hasattr(model.model, "use_fast_path"):
        from modeling_gpn.fast_recurrence import buffer_pool_of

        buffer_pool_of(model.model).release()


def measure(models: dict, preset: str, args) -> list[Row]:
    """Every figure of one preset for `models` ({impl: model}); timings alternate between the models."""
    device, repeats = args.device, args.repeats
    rows = {kind: Row(preset, kind, count_params(model)) for kind, model in models.items()}
    any_model = next(iter(models.values()))
    vocab = any_model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (args.batch, args.seq_len), generator=generator).to(device)
    for kind, model in models.items():
        if kind != "llama":
            model.model.use_fast_path = kind == "fast"
    tokens = args.batch * args.seq_len
    flops = {kind: forward_flops_per_token(model, args.seq_len / 2) for kind, model in models.items()}

    # training: the warm-up step of each model runs under the peak-memory probe
    steps = {kind: train_step_fn(model, kind, ids) for kind, model in models.items()}
    for kind, step in steps.items():
        release_reused_buffers(models[kind])
        with PeakMemory(device) as memory:
            step()
        rows[kind].train_peak_bytes[args.seq_len] = memory.peak
    with BackendProbe() as probe:
        timed = timed_alternating(steps, device, repeats, warm_up=False)
    if "fast" in rows:
        rows["fast"].backend["train"] = probe.text
    for kind, seconds in timed.items():
        rows[kind].train_tok_s = tokens / seconds
        rows[kind].train_gflop_s = 3 * flops[kind] * rows[kind].train_tok_s / 1e9
    for length in args.memory_seq_lens:
        if length == args.seq_len:
            continue
        long_ids = torch.randint(1, vocab, (args.batch, length), generator=generator).to(device)
        for kind, model in models.items():
            long_step = train_step_fn(model, kind, long_ids)
            release_reused_buffers(model)  # the long step must allocate its own, as a first call would
            with PeakMemory(device) as memory:
                long_step()
            rows[kind].train_peak_bytes[length] = memory.peak
    del steps
    for model in models.values():
        model.zero_grad(set_to_none=True)
        model.eval()

    with torch.no_grad():
        forwards = {kind: (lambda m=model: m(input_ids=ids, use_cache=False)) for kind, model in models.items()}
        with BackendProbe() as probe:
            timed = timed_alternating(forwards, device, repeats)
        if "fast" in rows:
            rows["fast"].backend["forward"] = probe.text
        for kind, seconds in timed.items():
            rows[kind].forward_tok_s = tokens / seconds
            rows[kind].forward_gflop_s = flops[kind] * rows[kind].forward_tok_s / 1e9

    decoders = {kind: model for kind, model in models.items() if not (kind == "plain" and args.skip_plain_decode)}
    for length in args.decode_prompt_lengths:
        prompt = torch.randint(1, vocab, (1, length), generator=generator).to(device)
        prefill = {kind: [] for kind in decoders}
        gaps = {kind: [] for kind in decoders}
        for kind, model in decoders.items():
            rows[kind].cache_bytes[length] = generate_timings(model, prompt, args)[2]  # (and a warm-up)
        with BackendProbe() as probe:
            for _ in range(repeats):
                for kind, model in decoders.items():
                    first, later, _ = generate_timings(model, prompt, args)
                    prefill[kind].append(first)
                    gaps[kind] += later
        if "fast" in decoders:
            rows["fast"].backend[f"prefill and decode @{length}"] = probe.text
        for kind in decoders:
            rows[kind].prefill_tok_s[length] = length / statistics.median(prefill[kind])
            rows[kind].decode_ms[length] = 1e3 * statistics.median(gaps[kind])
    return list(rows.values())


# --------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------


def fmt(value, kind: str = "num") -> str:
    if value is None:
        return "-"
    if kind == "bytes":
        for unit in ("B", "KB", "MB", "GB"):
            if abs(value) < 1024 or unit == "GB":
                return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
            value /= 1024
    if value >= 100:
        return f"{value:,.0f}"
    return f"{value:.2f}"


def print_table(rows: list[Row], args) -> None:
    lengths = args.decode_prompt_lengths
    headers = ["preset", "impl", "params", "train tok/s", "train GFLOP/s", "fwd tok/s", "fwd GFLOP/s"]
    headers += [f"train peak @{n}" for n in sorted({args.seq_len, *args.memory_seq_lens})]
    headers += [f"prefill tok/s @{n}" for n in lengths] + [f"decode ms @{n}" for n in lengths]
    headers += [f"cache @{n}" for n in lengths]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for r in rows:
        cells = [r.preset, r.impl, f"{r.params / 1e6:.2f}M", fmt(r.train_tok_s), fmt(r.train_gflop_s),
                 fmt(r.forward_tok_s), fmt(r.forward_gflop_s)]  # fmt: skip
        cells += [fmt(r.train_peak_bytes.get(n), "bytes") for n in sorted({args.seq_len, *args.memory_seq_lens})]
        cells += [fmt(r.prefill_tok_s.get(n)) for n in lengths] + [fmt(r.decode_ms.get(n)) for n in lengths]
        cells += [fmt(r.cache_bytes.get(n), "bytes") for n in lengths]
        lines.append("| " + " | ".join(cells) + " |")
    print("\n".join(lines))


def print_ratios(rows: list[Row], args) -> None:
    """The issue's targets as ratios of the fast path to the others (>= 1 means met where so stated)."""
    by = {(r.preset, r.impl): r for r in rows}
    for preset in args.preset:
        fast, llama, plain = by.get((preset, "fast")), by.get((preset, "llama")), by.get((preset, "plain"))
        if fast is None:
            continue
        print(f"\n{preset}: fast path")
        if llama is not None:
            print(f"  train tok/s / Llama's: {fast.train_tok_s / llama.train_tok_s:.2f} (target >= 0.5)")
            print(f"  forward tok/s / Llama's: {fast.forward_tok_s / llama.forward_tok_s:.2f} (target >= 1.0)")
            for n in args.decode_prompt_lengths:
                if n in fast.decode_ms and n in llama.decode_ms:
                    print(f"  @{n}: Llama decode ms / ours: {llama.decode_ms[n] / fast.decode_ms[n]:.2f} (target >= 5 at 4096); "
                          f"Llama prefill tok/s / ours: {llama.prefill_tok_s[n] / fast.prefill_tok_s[n]:.2f} (target <= 3)")  # fmt: skip
        if plain is not None:
            print(f"  train speed-up over the plain path: {fast.train_tok_s / plain.train_tok_s:.2f}x; "
                  f"forward: {fast.forward_tok_s / plain.forward_tok_s:.2f}x")  # fmt: skip
        if fast.decode_ms:
            lo, hi = min(fast.decode_ms), max(fast.decode_ms)
            print(f"  decode ms @{hi} / @{lo}: {fast.decode_ms[hi] / fast.decode_ms[lo]:.2f} (target <= 1.10)")
        peaks = fast.train_peak_bytes
        if len(peaks) > 1 and peaks.get(min(peaks)):
            longest, shortest = max(peaks), min(peaks)
            print(f"  train peak memory @{longest} / @{shortest}: {peaks[longest] / peaks[shortest]:.2f} (target <= 1.5)")


def run(args) -> int:
    from tqdm import tqdm

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda asked for, but torch sees no GPU")
    rows = []
    for preset in tqdm(args.preset, desc="bench", unit="preset"):
        models = {}
        for impl in args.impl:  # one model per implementation (same seed, same weights for plain and fast)
            gpn = build_gpn(preset, dtype, args.device, args.segment_length)
            models[impl] = gpn if impl != "llama" else matched_llama(gpn.config, count_params(gpn), dtype, args.device)
        rows += measure(models, preset, args)
        del models, gpn
        gc.collect()
    print(f"\ndevice {args.device}, dtype {args.dtype}, threads {torch.get_num_threads()}, batch {args.batch} x "
          f"{args.seq_len} tokens, medians of {args.repeats} repeats, GPN training segment {args.segment_length or 'none'}, "
          f"GPN memory kernels {memory_kernels_state(args.device)}\n")  # fmt: skip
    print_table(rows, args)
    print_ratios(rows, args)
    checks = self_checks_state()
    for r in rows:
        for timing, backend in r.backend.items():
            print(f"{r.preset} {r.impl} {timing} ran on: {backend}")
    print(f"Triton self-checks: {checks or 'none ran'}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"args": {k: v for k, v in vars(args).items() if not k.startswith("_")},
                       "memory_kernels": memory_kernels_state(args.device),
                       "cuda_graphs_setting": os.environ.get("GPN_CUDA_GRAPHS", "off"),
                       "triton_self_checks": checks,
                       "rows": [r.__dict__ for r in rows]}, handle, indent=2, default=str)  # fmt: skip
    return 0
