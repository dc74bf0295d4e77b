"""`gpn bench`: training, forward, prefill and decode speed and memory of GPN (plain and fast paths)
beside a parameter-matched Transformer++ (`LlamaForCausalLM`: RoPE, RMSNorm, SwiGLU, no bias), in one run,
with every batch-1 step, prefill and decode figure of a GPN stated against its byte limit (the bytes a
step must read over the read bandwidth measured in the same run).

Every figure is the median of `--repeats` timed runs after one warm-up. Training is forward + backward +
AdamW step on random tokens (the fast path uses the chunked loss, `return_logits=False`). Decode is
measured through `generate()` (greedy, batch 1, with no end-of-sequence token, so that nothing stops it early
and no logits processor runs: `greedy_without_end`) with a streamer that timestamps every new token: prefill
is the time to the first new token, decode the median gap between later tokens. The one-token step is a
forward of one token with its cache. Peak memory is `torch.cuda.max_memory_allocated` on CUDA and the peak
resident-set growth during the call on CPU (polled every 2 ms after returning freed memory to the OS).
GFLOP/s counts the matmul and memory arithmetic of the model (training = 3x forward).

Modules: `command` (arguments, run), `models` (what is measured), `measure` (one preset's figures),
`timing` (how things are timed), `limit` (the byte limit and the read probe), `report` (the table), `plot`
(`--plot`'s figure), `memory` (what a process and a cache hold: for benchmarks/ and the tests).
"""

from .command import IMPLEMENTATIONS, LIMIT_HELP, add_arguments, run
from .limit import ReadProbe, prefill_bytes, step_bytes, tensor_bytes
from .measure import Row, measure
from .memory import bytes_held, status_kib
from .models import build_gpn, count_params, forward_flops_per_token, matched_llama
from .plot import draw_bench_plot
from .report import fmt, print_limits, print_ratios, print_table
from .timing import (
    BackendProbe,
    PeakMemory,
    TokenTimes,
    cache_nbytes,
    generate_timings,
    greedy_without_end,
    memory_kernels_state,
    one_token_step_fn,
    prompt_cache_nbytes,
    release_reused_buffers,
    self_checks_state,
    step_and_prefill_fns,
    synchronize,
    timed_alternating,
    train_step_fn,
)

__all__ = [
    "BackendProbe",
    "IMPLEMENTATIONS",
    "LIMIT_HELP",
    "PeakMemory",
    "ReadProbe",
    "Row",
    "TokenTimes",
    "add_arguments",
    "build_gpn",
    "bytes_held",
    "cache_nbytes",
    "count_params",
    "draw_bench_plot",
    "fmt",
    "forward_flops_per_token",
    "generate_timings",
    "greedy_without_end",
    "matched_llama",
    "measure",
    "memory_kernels_state",
    "one_token_step_fn",
    "step_and_prefill_fns",
    "prompt_cache_nbytes",
    "print_limits",
    "print_ratios",
    "print_table",
    "release_reused_buffers",
    "run",
    "self_checks_state",
    "status_kib",
    "prefill_bytes",
    "step_bytes",
    "synchronize",
    "tensor_bytes",
    "timed_alternating",
    "train_step_fn",
]
