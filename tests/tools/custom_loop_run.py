"""A user's own training loop under `accelerate launch` (tests/tools/test_custom_loop.py): Accelerate's documented
pattern (`accelerator.prepare`, `accumulate`, `backward`, `clip_grad_norm_`, `gather_for_metrics`, `unwrap_model(...)
.save_pretrained`) and `torch.nn.parallel.DistributedDataParallel` by hand, on a tiny GPN, 2 processes on CPU.

Every case compares the launch with one process computing the same thing on the global batch (each process computes
that reference itself, on a copy of the model outside any wrapper, so nothing but this launch runs), and with the
other process (the weights after the step, gathered). Launched, it runs each case named on its command line in turn
in the same 2 processes (one launch, not one per case: each start of 2 processes imports torch and transformers,
seconds of the suite's time on 2 cores), and prints one `RESULT` line per case: its figures, or the traceback of its
refusal (the models it saves go to the folder `CUSTOM_LOOP_FOLDER` names, one for every process). Each case also
reports which paths of the recurrence ran (`tests/backend_observer.py`), in the launch and in the reference.
`CUSTOM_LOOP_TIMES=1` prints what each case took, on stderr (by hand; never asserted)."""

from __future__ import annotations

import copy
import json
import os
import sys
import time
import traceback

import torch

ROWS, LENGTH, LR = 2, 12, 0.5  # rows per process and micro-batch, tokens per row, SGD's step
BLOCKS = ["GPNPredictLayer", "GPNMemoryWrite"]


def tiny_model() -> torch.nn.Module:
    from tests.tiny_models import perturbed_model, tiny_config

    return perturbed_model(tiny_config(), seed=3).train()


def rows(count: int, length: int = LENGTH, seed: int = 0) -> torch.Tensor:
    """`count` rows of token ids, the same on every process."""
    return torch.randint(1, 97, (count, length), generator=torch.Generator().manual_seed(seed))


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).float() for t in tensors])


def full_weights(model: torch.nn.Module) -> torch.Tensor:
    """Every weight of `model` (an FSDP2 model's gathered whole), flattened in the order of `named_parameters`."""
    from torch.distributed.tensor import DTensor

    return flat(p.full_tensor() if isinstance(p, DTensor) else p for _, p in model.named_parameters())


def relative(seen: torch.Tensor, want: torch.Tensor) -> float:
    return float((seen - want).abs().max() / want.abs().max())


def across_processes(accelerator, vector: torch.Tensor) -> float:
    """The largest difference between the processes' copies of `vector`."""
    gathered = accelerator.gather(vector[None])
    return float((gathered - gathered[0]).abs().max())


def compared_gradients(grads: torch.Tensor, reference: torch.nn.Module, accelerator, seen) -> dict:
    """A case's result: this process's gradients (`grads`, flattened) against the one-process `reference`'s, the
    processes' copies against each other, and the paths that ran (`seen`)."""
    return {
        "grads vs one process": relative(grads, flat(p.grad for p in reference.parameters())),
        "processes differ by": across_processes(accelerator, grads),
        "paths": paths(seen),
    }


def observed():
    """`tests.backend_observer.observe()`: which paths and backends ran in the block."""
    from tests.backend_observer import observe

    return observe()


def paths(seen) -> dict:
    from tests.backend_observer import C_KERNELS_BACKWARD, FAST_PATH, PLAIN_PATH

    return {name: seen[name] for name in (FAST_PATH, PLAIN_PATH, C_KERNELS_BACKWARD)}


def accelerator_for(fsdp: bool | str = False, **kwargs):
    """An Accelerator as a user's script makes it; with `fsdp`, FSDP2 applied on CPU as `gpn train` does (Accelerate
    1.16 would make the launch DDP there without a word), the model one unit (`fsdp="blocks"`: the blocks of the
    recurrence sharded apart, as `--fsdp_transformer_layer_cls_to_wrap GPNPredictLayer,GPNMemoryWrite` does)."""
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    accelerator = Accelerator(cpu=True, **kwargs)
    if fsdp:
        PartialState().distributed_type = DistributedType.FSDP
        accelerator.state.distributed_type = DistributedType.FSDP
        blocks = dict(auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=BLOCKS)
        accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2, **(blocks if fsdp == "blocks" else {})
        )
        assert accelerator.is_fsdp2
    else:
        PartialState().distributed_type = DistributedType.MULTI_CPU
        accelerator.state.distributed_type = DistributedType.MULTI_CPU
    return accelerator


def one_step(fsdp: bool, accumulation: int = 1) -> dict:
    """Accelerate's loop: a prepared model, optimizer and dataloader, `accumulation` micro-batches of `ROWS` rows per
    process under `accumulate`, `backward`, `clip_grad_norm_` (a clip that bites), one optimizer step; against one
    process stepping on the whole global batch."""
    from torch.utils.data import DataLoader

    accelerator = accelerator_for(fsdp, gradient_accumulation_steps=accumulation)
    model = tiny_model()
    reference = copy.deepcopy(model)
    data = rows(ROWS * accelerator.num_processes * accumulation)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    loader = DataLoader(data, batch_size=ROWS)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    norms = []
    with observed() as seen:
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(input_ids=batch, labels=batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 0.05)))
                optimizer.step()
                optimizer.zero_grad()
    weights, start = full_weights(model), flat(tiny_model().parameters())
    with observed() as seen_alone:
        reference(input_ids=data, labels=data).loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05))
    torch.optim.SGD(reference.parameters(), lr=LR).step()
    want = flat(reference.parameters())
    return {
        "weights vs one process": relative(weights - start, want - start),  # (the steps taken)
        "processes differ by": across_processes(accelerator, weights),
        "norms": norms,
        "norm alone": norm,
        "paths": paths(seen),
        "paths alone": paths(seen_alone),
        "model": type(model).__name__,
    }


def by_hand_no_sync() -> dict:
    """`torch.nn.parallel.DistributedDataParallel` by hand, 2 micro-batches, the first under `no_sync`."""
    accelerator = accelerator_for()  # (the process group)
    rank, world = accelerator.process_index, accelerator.num_processes
    model = tiny_model()
    reference = copy.deepcopy(model)
    data = rows(ROWS * world * 2)
    mine = data.view(2, world, ROWS, LENGTH)[:, rank]  # micro-batch i: this process's rows of it
    wrapped = torch.nn.parallel.DistributedDataParallel(model)
    with observed() as seen:
        with wrapped.no_sync():
            (wrapped(input_ids=mine[0], labels=mine[0]).loss / 2).backward()
        (wrapped(input_ids=mine[1], labels=mine[1]).loss / 2).backward()
    grads = flat(p.grad for p in model.parameters())
    reference(input_ids=data, labels=data).loss.backward()
    return compared_gradients(grads, reference, accelerator, seen)


def chunked(document: torch.Tensor, size: int) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """docs/cache.md's chunks of a long document and their shifted targets."""
    targets = torch.cat([document[:, 1:], torch.full_like(document[:, :1], -100)], dim=1)
    return document.split(size, dim=1), targets.split(size, dim=1)


def truncated_bptt(fsdp: bool) -> dict:
    """docs/cache.md's truncated BPTT loop through a prepared model: a cache carried per process, an optimizer step
    per chunk, `detach()` after each backward."""
    accelerator = accelerator_for(fsdp)
    rank, world = accelerator.process_index, accelerator.num_processes
    model = tiny_model()
    reference = copy.deepcopy(model)
    document = rows(ROWS * world, length=3 * LENGTH, seed=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model, optimizer = accelerator.prepare(model, optimizer)

    def run(model, optimizer, document):
        cache = None
        for chunk, target in zip(*chunked(document, LENGTH)):
            out = model(input_ids=chunk, shift_labels=target, cache=cache, use_cache=True)
            accelerator.backward(out.loss)
            optimizer.step()
            optimizer.zero_grad()
            cache = out.cache.detach()

    with observed() as seen:
        run(model, optimizer, document[rank * ROWS : (rank + 1) * ROWS])
    weights = full_weights(model)
    start = flat(tiny_model().parameters())
    run(reference, torch.optim.SGD(reference.parameters(), lr=LR), document)
    return {
        "weights vs one process": relative(weights - start, flat(reference.parameters()) - start),
        "processes differ by": across_processes(accelerator, weights),
        "paths": paths(seen),
    }


def full_bptt(fsdp: bool, ddp_kwargs: dict | None = None, last_only: bool = False) -> dict:
    """docs/cache.md's full BPTT loop through a prepared model: 2 chunks, the cache carried, one backward (of the
    chunks' summed losses, or with `last_only` of the last chunk's alone, which reaches the first chunk's weights only
    through the cache)."""
    from accelerate.utils import DistributedDataParallelKwargs

    handlers = [DistributedDataParallelKwargs(**ddp_kwargs)] if ddp_kwargs else None
    accelerator = accelerator_for(fsdp, kwargs_handlers=handlers)
    rank, world = accelerator.process_index, accelerator.num_processes
    model = tiny_model()
    reference = copy.deepcopy(model)
    document = rows(ROWS * world, length=2 * LENGTH, seed=2)
    model = accelerator.prepare(model)

    def run(model, document, backward):
        chunks, targets = chunked(document, LENGTH)
        counted = sum(int((t != -100).sum()) for t in (targets[-1:] if last_only else targets))
        cache, loss = None, 0
        for index, (chunk, target) in enumerate(zip(chunks, targets)):
            if last_only and index < len(chunks) - 1:
                target = torch.full_like(target, -100)
            out = model(input_ids=chunk, shift_labels=target, num_items_in_batch=counted, cache=cache, use_cache=True)
            cache, loss = out.cache, loss + out.loss
        backward(loss)

    with observed() as seen:
        for _ in range(2):  # (twice: DDP's static graph records the first iteration)
            model.zero_grad() if not fsdp else [setattr(p, "grad", None) for p in model.parameters()]
            run(model, document[rank * ROWS : (rank + 1) * ROWS], accelerator.backward)
    from torch.distributed.tensor import DTensor

    grads = flat(p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in model.parameters())
    run(reference, document, lambda loss: loss.backward())
    return compared_gradients(grads, reference, accelerator, seen)


def checkpointed(fast: bool, reentrant: bool | None = None, static: bool = False) -> dict:
    """A step of a prepared model with gradient checkpointing on (segments of 4 positions), on the fast path (its own
    recomputation) or the plain one (torch's checkpoint of every segment: `use_reentrant` as given, transformers'
    default False where None), under DDP with or without `static_graph`: twice, the gradients of the second."""
    from accelerate.utils import DistributedDataParallelKwargs

    accelerator = accelerator_for(kwargs_handlers=[DistributedDataParallelKwargs(static_graph=static)])
    rank, world = accelerator.process_index, accelerator.num_processes
    model = tiny_model()
    model.model.use_fast_path = fast
    model.gradient_checkpointing_enable(None if reentrant is None else {"use_reentrant": reentrant})
    model.config.bptt_segment_length = 4
    reference = copy.deepcopy(model)
    data = rows(ROWS * world)
    mine = data[rank * ROWS : (rank + 1) * ROWS]
    wrapped = accelerator.prepare(model)
    with observed() as seen:
        for _ in range(2):  # (twice: DDP's static graph records the first iteration)
            wrapped.zero_grad()
            accelerator.backward(wrapped(input_ids=mine, labels=mine).loss)
    grads = flat(p.grad for p in model.parameters())
    reference(input_ids=data, labels=data).loss.backward()
    return compared_gradients(grads, reference, accelerator, seen)


def saved_and_gathered(fsdp: bool) -> dict:
    """A step, then `accelerator.unwrap_model(model).save_pretrained` on the main process (the folder shared) and
    `from_pretrained` on every process; and `gather_for_metrics` of the logits of an evaluation loop over a dataset
    whose length the processes do not divide."""
    from torch.utils.data import DataLoader
    from transformers import AutoModelForCausalLM

    accelerator = accelerator_for(fsdp)
    model = tiny_model()
    reference = copy.deepcopy(model).eval()
    data = rows(ROWS * accelerator.num_processes)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    evaluation = rows(5, seed=4)
    loader = DataLoader(data, batch_size=ROWS)
    model, optimizer, loader, evaluated = accelerator.prepare(model, optimizer, loader, DataLoader(evaluation, 2))
    for batch in loader:
        accelerator.backward(model(input_ids=batch, labels=batch).loss)
        optimizer.step()
        optimizer.zero_grad()
    weights = full_weights(model)
    model.eval()
    logits = []
    with torch.no_grad():
        for batch in evaluated:
            logits.append(accelerator.gather_for_metrics(model(input_ids=batch).logits))
    logits = torch.cat(logits)
    torch.nn.utils.vector_to_parameters(weights, reference.parameters())  # (the trained weights, in a plain model)
    with torch.no_grad():
        reference_logits = reference(input_ids=evaluation).logits
    folder = os.path.join(os.environ["CUSTOM_LOOP_FOLDER"], "fsdp2" if fsdp else "ddp")
    unwrapped, refused = accelerator.unwrap_model(model), None
    if accelerator.is_main_process:  # the plain call (under FSDP2: refused before anything is written)
        try:
            unwrapped.save_pretrained(folder)
        except ValueError as error:
            refused = {"error": str(error), "folder written": os.path.exists(folder)}
        if fsdp:  # the model's own state dict, its shards (DTensors), given
            try:
                unwrapped.save_pretrained(folder, state_dict=unwrapped.state_dict())
            except ValueError as error:
                refused["state dict"] = str(error)
            refused["folder written"] = refused["folder written"] or os.path.exists(folder)
    if fsdp:  # what Accelerate documents for a sharded model: the full weights gathered on every process
        state_dict = accelerator.get_state_dict(model)
        save = accelerator.save
        unwrapped.save_pretrained(
            folder, is_main_process=accelerator.is_main_process, save_function=save, state_dict=state_dict
        )
    accelerator.wait_for_everyone()
    reloaded = AutoModelForCausalLM.from_pretrained(folder)
    return {
        "reloaded vs trained": float((flat(reloaded.parameters()) - weights).abs().max()),
        "processes differ by": across_processes(accelerator, weights),
        "gathered": list(logits.shape),
        "gathered vs one process": float((logits - reference_logits).abs().max()),
        "refused": refused,
    }


CASES = {
    "ddp-step": lambda: one_step(fsdp=False),
    "ddp-accumulate": lambda: one_step(fsdp=False, accumulation=2),
    "ddp-by-hand-no-sync": by_hand_no_sync,
    "ddp-truncated-bptt": lambda: truncated_bptt(fsdp=False),
    "ddp-full-bptt": lambda: full_bptt(fsdp=False),
    "ddp-full-bptt-last-only": lambda: full_bptt(fsdp=False, last_only=True),
    "ddp-full-bptt-unused": lambda: full_bptt(fsdp=False, ddp_kwargs={"find_unused_parameters": True}),
    "ddp-full-bptt-static": lambda: full_bptt(fsdp=False, ddp_kwargs={"static_graph": True}),
    "ddp-checkpointing": lambda: checkpointed(fast=True),
    "ddp-plain-checkpointing": lambda: checkpointed(fast=False),
    "ddp-plain-checkpointing-reentrant": lambda: checkpointed(fast=False, reentrant=True),
    "ddp-plain-checkpointing-reentrant-static": lambda: checkpointed(fast=False, reentrant=True, static=True),
    "ddp-save-gather": lambda: saved_and_gathered(fsdp=False),
    "fsdp2-step": lambda: one_step(fsdp=True),
    "fsdp2-accumulate": lambda: one_step(fsdp=True, accumulation=2),
    "fsdp2-truncated-bptt": lambda: truncated_bptt(fsdp=True),
    "fsdp2-full-bptt": lambda: full_bptt(fsdp=True),
    "fsdp2-full-bptt-last-only": lambda: full_bptt(fsdp=True, last_only=True),
    "fsdp2-blocks-full-bptt-last-only": lambda: full_bptt(fsdp="blocks", last_only=True),
    "fsdp2-save-gather": lambda: saved_and_gathered(fsdp=True),
}


def result(case: str) -> dict:
    try:
        return CASES[case]()
    except Exception:  # noqa: BLE001 (reported, then the next case)
        return {"error": traceback.format_exc()}


if __name__ == "__main__":
    assert "CUSTOM_LOOP_FOLDER" in os.environ, "CUSTOM_LOOP_FOLDER: a folder every process reads, for the saved models"
    for case in sys.argv[1:] or list(CASES):
        began = time.perf_counter()
        outcome = result(case)
        if os.environ.get("CUSTOM_LOOP_TIMES"):  # (by hand: what each case costs)
            print(f"TIME {case} {time.perf_counter() - began:.2f} s", file=sys.stderr, flush=True)
        if os.environ.get("RANK", "0") == "0":  # (one line: the processes' prints would interleave)
            print(f"RESULT {case} " + json.dumps(outcome), flush=True)
