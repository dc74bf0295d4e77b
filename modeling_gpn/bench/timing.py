"""How `gpn bench` times and measures: medians of alternated repeats, peak memory, tokens through
`generate()` with a timestamping streamer, a model's one-token step with its cache, and what the fast path
ran on while a timing ran."""

from __future__ import annotations

import copy
import ctypes
import gc
import statistics
import threading
import time
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import argparse
    from collections.abc import Callable

    from transformers import GenerationConfig, PreTrainedModel
    from transformers.cache_utils import Cache
    from transformers.modeling_outputs import ModelOutput


def synchronize(device: str) -> None:
    """Wait for the device's queued work (CUDA), so that a clock read after it is exact."""
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


def train_step_fn(model: PreTrainedModel, kind: str, ids: torch.Tensor) -> Callable[[], None]:
    """A call runs one training step of `model` (forward, loss, backward, AdamW) on `ids`."""
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

    def put(self, value: torch.Tensor) -> None:
        """Stamp the time a token (or the prompt) arrived, after the device's work is done."""
        synchronize(self.device)
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        """Nothing to do at the end of generation (the streamer interface asks for it)."""
        pass


def cache_nbytes(cache: Cache | None) -> int:
    """Bytes of the tensors `cache` holds: its own `nbytes()`, else its layers' keys and values."""
    if hasattr(cache, "nbytes") and callable(cache.nbytes):
        return int(cache.nbytes())
    total = 0
    for layer in getattr(cache, "layers", []):
        for name in ("keys", "values"):
            tensor = getattr(layer, name, None)
            if isinstance(tensor, torch.Tensor):
                total += tensor.numel() * tensor.element_size()
    return total


def prompt_cache_nbytes(model: PreTrainedModel, prompt: torch.Tensor) -> int:
    """Bytes of the cache a forward of `prompt` leaves: the "cache @N" column, N positions (the cache a
    generate() call ends with holds its new tokens too, --decode-tokens - 1 more positions of a Llama's)."""
    with torch.no_grad():
        output = model(input_ids=prompt, use_cache=True, logits_to_keep=1)
    return cache_nbytes(getattr(output, "cache", None) or output.past_key_values)


class BackendProbe:
    """What the fast path ran on while the block ran, from the Triton kernel launches, CUDA graph replays and
    C step-kernel calls made meanwhile (`triton_kernels.launches`, `cuda_graphs.replays`,
    `memory_kernels.calls`): "triton kernels in CUDA graphs", "triton kernels, no graphs", "c step kernels"
    (saying how many of the steps were decoded tokens in one C call) or "torch ops" (on CPU: with the C memory kernels where they are on, as the report's "GPN memory kernels"
    says). The plain path and Llama launch none of them, so a block timing them beside the fast path still
    tells the fast path's. Why: a failed self-check or a fallback runs the torch ops in silence, and their
    figures must not pass for the kernels'."""

    def __enter__(self):
        from modeling_gpn import cuda_graphs, memory_kernels, triton_kernels

        self.launches = sum(triton_kernels.launches.values())
        self.replays = sum(cuda_graphs.replays.values())
        self.steps, self.decoded = memory_kernels.calls["step"], memory_kernels.calls["decode"]
        self.text = None
        return self

    def __exit__(self, *exc):
        from modeling_gpn import cuda_graphs, memory_kernels, triton_kernels

        launches = sum(triton_kernels.launches.values()) - self.launches
        replays = sum(cuda_graphs.replays.values()) - self.replays
        steps = memory_kernels.calls["step"] - self.steps
        decoded = memory_kernels.calls["decode"] - self.decoded
        if replays:
            self.text = f"triton kernels in CUDA graphs ({replays} replays, {launches} eager launches)"
        elif launches:
            self.text = f"triton kernels, no graphs ({launches} launches)"
        elif steps:
            one_call = f", {decoded} of them decoded tokens in one call" if decoded else ""
            self.text = f"c step kernels ({steps} steps{one_call})"
        else:
            self.text = "torch ops"
        return False


def greedy_without_end(model: PreTrainedModel, new_tokens: int, **settings) -> GenerationConfig:
    """A copy of `model.generation_config` for greedy decoding of exactly `new_tokens` tokens: an empty list of
    end-of-sequence tokens (None would mean "the model's"), so nothing stops it early. (`min_new_tokens` would
    do the same by masking the end token's logit at every step: two logits processors that cost more than a
    small GPN's whole step and that a plain `generate()` call does not run.) `settings`: other fields
    (`return_dict_in_generate`, ...)."""
    config = copy.deepcopy(model.generation_config)
    config.update(
        max_new_tokens=new_tokens, min_new_tokens=None, do_sample=False, eos_token_id=[], pad_token_id=0, **settings
    )
    return config


def generate_timings(
    model: PreTrainedModel, prompt: torch.Tensor, args: argparse.Namespace
) -> tuple[float, list[float]]:
    """One greedy generate() call of `args.decode_tokens` tokens (`greedy_without_end`): (seconds to the
    first new token, gaps between the later tokens). (The "cache @N" column is `prompt_cache_nbytes`'s.)"""
    device = args.device
    streamer = TokenTimes(device)
    synchronize(device)
    start = time.perf_counter()
    model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        generation_config=greedy_without_end(model, args.decode_tokens),
        streamer=streamer,
    )
    stamps = streamer.stamps  # [prompt, token 1, token 2, ...]
    return stamps[1] - start, [b - a for a, b in zip(stamps[1:], stamps[2:])]


def memory_kernels_state(device: str) -> str:
    """'on (their products' instructions)', or 'off (why)': whether the fast path ran the fused C memory kernels
    (CPU only), and on which vector instructions (`memory_kernels.products_isa`)."""
    from modeling_gpn import memory_kernels

    if not device.startswith("cpu"):
        return "off (CPU only)"
    if not memory_kernels.available():
        return f"off ({memory_kernels.unavailable_reason()})"
    return f"on ({memory_kernels.products_isa()})"


def self_checks_state() -> dict:
    """Every Triton self-check this process ran: {combination: "passed" or what differed} (`triton_kernels`)."""
    from modeling_gpn import triton_kernels

    return triton_kernels.self_check_summary()


def release_reused_buffers(model: PreTrainedModel) -> None:
    """Free the memory buffers a GPN's training calls keep for the next call (`BufferPool`), so that a
    peak-memory probe sees what a first call allocates."""
    if hasattr(model, "model") and hasattr(model.model, "use_fast_path"):
        from modeling_gpn.fast_recurrence import buffer_pool_of

        buffer_pool_of(model.model).release()


def one_token_step_fn(
    model: PreTrainedModel, rows: int, vocab: int, device: str, prompt_length: int = 16
) -> Callable[[], None]:
    """A call runs the model's one-token step at `rows` batch rows: a forward of one token with its cache
    (`use_cache=True`, as a decode loop calls it; the cache advances every call), after a short prompt.
    Without autograd, as decoding runs."""
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(1, vocab, (rows, prompt_length), generator=generator).to(device)
    return step_and_prefill_fns(model, prompt)[0]


def step_and_prefill_fns(model: PreTrainedModel, prompt: torch.Tensor) -> tuple[Callable[[], None], Callable[[], None]]:
    """(step, prefill) after a forward of `prompt` (rows, length) with a new cache: a call of `step` is the model's
    one-token step (`prompt`'s last token again, as `one_token_step_fn`'s), one of `prefill` a forward of the whole
    prompt (`logits_to_keep=1`, as generate() asks), both continuing that one cache, so what they derive from the
    weights (a plan, int4 values packed, int8 tiles) is derived once, as inside one generate() call: a cache-less
    prompt would derive it at every call, a second cache would hold a second copy. Without autograd."""
    token = prompt[:, -1:]

    def cache_of(output: ModelOutput):
        return getattr(output, "cache", None) or output.past_key_values

    with torch.no_grad():
        state = {"cache": cache_of(model(input_ids=prompt, use_cache=True, logits_to_keep=1))}

    def step() -> None:
        with torch.no_grad():
            state["cache"] = cache_of(model(input_ids=token, cache=state["cache"], use_cache=True))

    def prefill() -> None:
        with torch.no_grad():
            state["cache"] = cache_of(model(input_ids=prompt, cache=state["cache"], use_cache=True, logits_to_keep=1))

    return step, prefill
