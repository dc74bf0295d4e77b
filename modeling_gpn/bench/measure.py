"""One preset's figures: training, forward, the one-token step against its byte limit, step throughput at
several batch sizes, prefill and decode through `generate()`, every timing alternated between the models
(and the limit's read probe) inside each repeat."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import argparse
    from collections.abc import Callable

    from torch import nn

from .limit import ReadProbe, prefill_bytes, step_bytes
from .models import count_params, forward_flops_per_token
from .timing import (
    BackendProbe,
    PeakMemory,
    generate_timings,
    one_token_step_fn,
    prompt_cache_nbytes,
    release_reused_buffers,
    synchronize,
    timed_alternating,
    train_step_fn,
)

STEP_REPEATS = 15  # one-token steps per repeat (a step is short; their median is the figure)


@dataclass
class Row:
    """One row of the bench table: a preset and implementation, with each measured figure (None: not measured)."""

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
    # the one-token step (a forward of one token with its cache, batch 1) and its byte limit (GPN rows)
    step_ms: float | None = None
    limit_bytes: int | None = None
    limit_ms: float | None = None  # the time of reading `limit_bytes` (`limit.ReadProbe`), same repeats
    limit_probe: str | None = None
    prefill_limit_bytes: int | None = None  # a prompt token's bytes (`limit.prefill_bytes`) and their read time
    prefill_limit_ms: float | None = None
    limit_ms_at: dict = field(default_factory=dict)  # the two limits again, read between generate()'s calls
    prefill_limit_ms_at: dict = field(default_factory=dict)  # at each prompt length (what its ratios use)
    batch_tok_s: dict = field(default_factory=dict)  # one-token steps at B rows: B / step time
    # what each timing of the fast path actually ran on ("train", "forward", "decode": `BackendProbe`)
    backend: dict = field(default_factory=dict)

    def limit_ratio(
        self, seconds_per_token: float | None, prefill: bool = False, length: int | None = None
    ) -> float | None:
        """A time per token over the byte limit's (1.0: at the limit); `prefill`: a prompt token's limit;
        `length`: the limit read beside generate() at that prompt length (else the one beside the steps)."""
        limit = self.prefill_limit_ms if prefill else self.limit_ms
        at = (self.prefill_limit_ms_at if prefill else self.limit_ms_at).get(length)
        limit = at or limit
        if seconds_per_token is None or not limit:
            return None
        return 1e3 * seconds_per_token / limit


def measure(models: dict, preset: str, args: argparse.Namespace) -> list[Row]:
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

    if not args.skip_training:
        _measure_training(models, rows, ids, flops, tokens, args)
    for model in models.values():
        model.zero_grad(set_to_none=True)
        model.eval()
    if not args.skip_training:
        with torch.no_grad():
            forwards = {kind: (lambda m=model: m(input_ids=ids, use_cache=False)) for kind, model in models.items()}
            with BackendProbe() as probe:
                timed = timed_alternating(forwards, device, repeats)
            if "fast" in rows:
                rows["fast"].backend["forward"] = probe.text
            for kind, seconds in timed.items():
                rows[kind].forward_tok_s = tokens / seconds
                rows[kind].forward_gflop_s = flops[kind] * rows[kind].forward_tok_s / 1e9
    _measure_steps(models, rows, vocab, args)
    _measure_generate(models, rows, vocab, generator, args)
    return list(rows.values())


def _measure_training(
    models: dict, rows: dict, ids: torch.Tensor, flops: dict, tokens: int, args: argparse.Namespace
) -> None:
    device, repeats, vocab = args.device, args.repeats, next(iter(models.values())).config.vocab_size
    generator = torch.Generator().manual_seed(2)
    # training: each model's second step runs under the peak-memory probe, the first having allocated what every
    # step after it keeps (the optimizer's state, the first call's one-time costs): measured on the first, these
    # made the peak at --seq-len, measured first, larger than at the other lengths (tiny: @32 / @16 read 0.53)
    steps = {kind: train_step_fn(model, kind, ids) for kind, model in models.items()}
    for kind, step in steps.items():
        rows[kind].train_peak_bytes[args.seq_len] = second_step_peak(step, models[kind], device)
    with BackendProbe() as probe:
        timed = timed_alternating(steps, device, repeats, warm_up=False)
    if "fast" in rows:
        rows["fast"].backend["train"] = probe.text
    for kind, seconds in timed.items():
        rows[kind].train_tok_s = tokens / seconds
        rows[kind].train_gflop_s = 3 * flops[kind] * rows[kind].train_tok_s / 1e9
    del steps  # (and their optimizers' state: each length's peak holds one optimizer's, its own)
    for length in args.memory_seq_lens:
        if length == args.seq_len:
            continue
        long_ids = torch.randint(1, vocab, (args.batch, length), generator=generator).to(device)
        for kind, model in models.items():
            rows[kind].train_peak_bytes[length] = second_step_peak(train_step_fn(model, kind, long_ids), model, device)


def second_step_peak(step: Callable[[], object], model: nn.Module, device: str) -> int | None:
    """The peak memory of a training step's second call: the first allocates what the later ones keep (the
    optimizer's state, one-time costs); the buffers a GPN's steps reuse are freed before the second, which must
    allocate its own, as every step of another length would."""
    step()
    release_reused_buffers(model)
    with PeakMemory(device) as memory:
        step()
    return memory.peak


def _measure_steps(models: dict, rows: dict, vocab: int, args: argparse.Namespace) -> None:
    """The one-token step of every model at each of `--decode-batches` rows, alternated with a read of the
    GPN's step bytes (its limit), `STEP_REPEATS` steps per repeat."""
    device = args.device
    gpn = next((model for kind, model in models.items() if kind != "llama"), None)
    for batch in sorted({1, *args.decode_batches}) if args.decode_batches else []:
        fns = {kind: one_token_step_fn(model, batch, vocab, device) for kind, model in models.items()}
        probes = {}
        if gpn is not None and batch == 1:
            probe, prompt_probe = (
                ReadProbe(step_bytes(gpn, batch), device),
                ReadProbe(prefill_bytes(gpn, batch), device),
            )
            probes = {"limit": probe, "prefill limit": prompt_probe}
        with BackendProbe() as backend:
            timed = _steps_and_reads(fns, probes, device, args.repeats)
        if "fast" in rows:
            rows["fast"].backend[f"step @{batch} rows"] = backend.text
        for kind in models:
            rows[kind].batch_tok_s[batch] = batch / timed[kind]
            if batch == 1:
                rows[kind].step_ms = 1e3 * timed[kind]
        if probes:
            for kind in models:
                if kind != "llama":
                    rows[kind].limit_bytes, rows[kind].limit_ms = probe.nbytes, 1e3 * timed["limit"]
                    rows[kind].prefill_limit_bytes = prompt_probe.nbytes
                    rows[kind].prefill_limit_ms = 1e3 * timed["prefill limit"]
                    rows[kind].limit_probe = probe.kind


def _steps_and_reads(fns: dict, probes: dict, device: str, repeats: int) -> dict:
    """Median seconds of each step function and of each limit's read, in turn inside every repeat: a step
    function runs once untimed (its weights back where a decode loop keeps them, after the others ran),
    then `STEP_REPEATS` timed calls in a row; a read as `ReadProbe.seconds` times it."""
    times = {name: [] for name in (*fns, *probes)}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            fn()
            for _ in range(STEP_REPEATS):
                start = time.perf_counter()
                fn()
                synchronize(device)
                times[name].append(time.perf_counter() - start)
        for name, probe in probes.items():
            times[name] += probe.seconds(STEP_REPEATS)
    return {name: statistics.median(values) for name, values in times.items()}


def _measure_generate(
    models: dict, rows: dict, vocab: int, generator: torch.Generator, args: argparse.Namespace
) -> None:
    """Prefill and decode through generate() at each prompt length; the limits' reads (a step's bytes, a
    prompt token's) are timed between the generate() calls of every repeat, so each length's ratios are
    to a bandwidth measured in the same spell of the machine (`Row.limit_ms_at`, `prefill_limit_ms_at`)."""
    device, repeats = args.device, args.repeats
    decoders = {kind: model for kind, model in models.items() if not (kind == "plain" and args.skip_plain_decode)}
    gpn = next((model for kind, model in decoders.items() if kind != "llama"), None)
    probes = (
        {"limit": ReadProbe(step_bytes(gpn), device), "prefill limit": ReadProbe(prefill_bytes(gpn), device)}
        if gpn is not None
        else {}
    )
    for length in args.decode_prompt_lengths:
        prompt = torch.randint(1, vocab, (1, length), generator=generator).to(device)
        prefill = {kind: [] for kind in decoders}
        gaps = {kind: [] for kind in decoders}
        reads = {name: [] for name in probes}
        for kind, model in decoders.items():
            generate_timings(model, prompt, args)  # (a warm-up)
            rows[kind].cache_bytes[length] = prompt_cache_nbytes(model, prompt)
        with BackendProbe() as probe:
            for _ in range(repeats):
                for kind, model in decoders.items():
                    first, later = generate_timings(model, prompt, args)
                    prefill[kind].append(first)
                    gaps[kind] += later
                for name, read in probes.items():
                    reads[name] += read.seconds(STEP_REPEATS)
        if "fast" in decoders:
            rows["fast"].backend[f"prefill and decode @{length}"] = probe.text
        for kind in decoders:
            rows[kind].prefill_tok_s[length] = length / statistics.median(prefill[kind])
            rows[kind].decode_ms[length] = 1e3 * statistics.median(gaps[kind])
            if kind != "llama" and probes:
                rows[kind].limit_ms_at[length] = 1e3 * statistics.median(reads["limit"])
                rows[kind].prefill_limit_ms_at[length] = 1e3 * statistics.median(reads["prefill limit"])
                # (the bytes these ratios are to: set here too, for a run that skips the steps, --decode-batches
                # none, where they were null and the ratios printed to a limit stated nowhere)
                rows[kind].limit_bytes, rows[kind].limit_probe = probes["limit"].nbytes, probes["limit"].kind
                rows[kind].prefill_limit_bytes = probes["prefill limit"].nbytes
