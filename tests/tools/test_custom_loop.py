"""A user's own training loop of a GPN under `accelerate launch` (2 processes on CPU, DDP then FSDP2 in the same
launch: tests/tools/custom_loop_run.py), as in one process on the global batch: one step through Accelerate's
`prepare` / `backward` / `clip_grad_norm_`; 2 micro-batches under `accumulate`, and under `no_sync` of a
`DistributedDataParallel` made by hand (the one-big-batch step); docs/cache.md's truncated BPTT (a cache carried per
process, `detach()` after each step) and full BPTT (2 chunks, one backward: the chunks' summed losses, or the last
chunk's alone, which reaches the first chunk only through the cache; under DDP as it is, with
`find_unused_parameters` and with `static_graph`; under FSDP2 with the model one unit and with the blocks of the
recurrence sharded apart, whose gathered weights autograd gathers again for the first chunk's graph); gradient
checkpointing of the time segments under DDP (the fast path's own, torch's non-reentrant on the plain loop, and its
reentrant one, which DDP refuses without `static_graph`). The recurrence's
own backward (the fast path, C kernels) runs in the launch, and DDP's reducer sees every weight's gradient: the two
processes' weights are equal, to the bit. `accelerator.unwrap_model(model).save_pretrained` then `from_pretrained` gives
the trained weights back, and `gather_for_metrics` the logits of one process (an evaluation set the processes do not
divide). Under FSDP2 the plain `save_pretrained` call wrote the config and failed on the first weight ("Attempted to
access the data pointer on an invalid python storage"), a folder without weights: it is refused before anything is
written, naming `accelerator.get_state_dict(model)`, and the call Accelerate documents with it saves the full
weights."""

from __future__ import annotations

import json
import os

import pytest

from ..backend_observer import C_KERNELS_BACKWARD, FAST_PATH, PLAIN_PATH
from .custom_loop_run import CASES
from .train_runs import finish, launch_two_processes

pytestmark = pytest.mark.usefixtures("accelerate_on_cpu")
DDP = ["--multi_gpu"]
PROGRAM = ("-m", "tests.tools.custom_loop_run")
FP32 = 2e-5  # relative to the largest weight change or gradient: float32 rounding of sums taken in another order


def test_a_custom_accelerate_loop_trains_a_gpn_under_ddp_and_fsdp2_as_one_process(tmp_path):
    # One launch runs every case in turn (DDP first, then FSDP2 applied on CPU as `gpn train` does); each process
    # computes the one-process reference of each case itself. The saved models go to one folder all processes read.
    env = dict(os.environ, CUSTOM_LOOP_FOLDER=str(tmp_path))
    launched = launch_two_processes(DDP, list(CASES), tmp_path / "launch.log", program=PROGRAM, env=env)
    output = finish(launched)
    results = dict(line.split(" ", 2)[1:] for line in output.splitlines() if line.startswith("RESULT "))
    assert list(results) == list(CASES), output[-3000:]
    results = {case: json.loads(outcome) for case, outcome in results.items()}
    # Reentrant checkpointing of the plain loop's time segments: every segment's recomputation is a backward of its
    # own over the same weights, which DDP's reducer refuses unless told the graph is static (torch's own error).
    refused = results.pop("ddp-plain-checkpointing-reentrant").get("error", "")
    assert "Expected to mark a variable ready only once" in refused, refused
    for case, seen in results.items():
        assert "error" not in seen, (case, seen.get("error"))
        assert seen["processes differ by"] == 0, (case, seen)  # every gradient all-reduced, or reduce-scattered
        for figure in ("weights vs one process", "grads vs one process"):
            if figure in seen:
                assert seen[figure] < FP32, (case, figure, seen)
        if "paths" in seen:  # the recurrence's own backward ran in the launch (the blocks apart: the plain loop)
            ran = seen["paths"]
            fast = "blocks" not in case and "plain" not in case
            assert (ran[FAST_PATH] > 0, ran[PLAIN_PATH] > 0) == (fast, not fast), (case, ran)
            assert (ran[C_KERNELS_BACKWARD] > 0) == fast, (case, ran)
        if "norms" in seen:  # clip_grad_norm_'s norm is the global batch's, once per optimizer step
            assert len(seen["norms"]) == 1 and abs(seen["norms"][0] - seen["norm alone"]) < 1e-6, (case, seen)
    for case in ("ddp-step", "ddp-accumulate"):
        assert results[case]["model"] == "DistributedDataParallel", results[case]
    for case in ("fsdp2-step", "fsdp2-accumulate"):
        assert results[case]["model"] == "FSDPGPNForCausalLM", results[case]  # really sharded
    for case in ("ddp-save-gather", "fsdp2-save-gather"):
        seen = results[case]
        assert seen["reloaded vs trained"] == 0, seen
        assert seen["gathered"] == [5, 12, 97], seen  # 5 rows, not the 6 the processes ran (one repeated)
        assert seen["gathered vs one process"] < 1e-5, seen
    assert results["ddp-save-gather"]["refused"] is None
    refused = results["fsdp2-save-gather"]["refused"]
    assert refused["error"].startswith("FSDP2 shards this model's weights"), refused
    assert "state_dict = accelerator.get_state_dict(model)" in refused["error"], refused
    assert refused["state dict"].startswith("the state_dict given holds model.embed_tokens.weight as FSDP2"), refused
    assert "state_dict = accelerator.get_state_dict(model)" in refused["state dict"], refused
    assert refused["folder written"] is False, refused
