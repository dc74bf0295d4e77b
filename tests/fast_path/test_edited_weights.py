"""The fast path never uses weights derived from parameters that have changed since, by any route.

Each test runs the fast path once (so it derives its folded matrices), edits the weights by one route, then
compares the fast path's logits with the plain path's (which calls the modules) on the same edited weights:
`.data` in place and `.data =`, `copy_` under no_grad, `load_state_dict`, PEFT's merge / unmerge / unload, an
optimizer step, `to(dtype)`, `parametrize` register and remove, and the same through generate() and the
decode CUDA graph (Triton's interpreter on CPU). Writes through `.data` bump no version counter, so the old
key (storage, version, dtype, device) was fooled by them; derived weights now live for one forward or one
generate() call (modeling_gpn/derived_weights.py), and decoding still folds once per generate() call.
The routes run on both CPU steps: the C step kernels' plan (which copies norms, biases and decay rates and reads
the matrices in place) and the torch ops on folded matrices (copies of them all, as the Triton path derives).
"""

from __future__ import annotations

import pytest
import torch

from ..tiny_models import perturbed_model, tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 97


def token_ids(batch: int = 2, length: int = 9, seed: int = 0) -> torch.Tensor:
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def logits_on(model, ids: torch.Tensor, fast: bool) -> torch.Tensor:
    core = model.get_base_model().model if hasattr(model, "get_base_model") else model.model
    core.use_fast_path = fast
    logits = model(ids).logits.float()
    assert core.last_recurrence_path == ("fast" if fast else "plain")
    core.use_fast_path = True
    return logits


def assert_fast_follows(model, ids, rtol=2e-4, atol=2e-5) -> None:
    """The fast path's logits equal the plain path's on the model's current weights."""
    torch.testing.assert_close(logits_on(model, ids, True), logits_on(model, ids, False), rtol=rtol, atol=atol)


def matrices(model):
    return [p for name, p in model.model.named_parameters() if p.dim() == 2 and "embed" not in name]


def edited(model):
    """Every parameter but the embedding: the matrices, which a fold copies, and the norms, biases and decay rates,
    which the C step kernels' plan copies too (it reads the matrices in place, so an edit of them alone could not
    tell a stale plan from a fresh one)."""
    return [p for name, p in model.model.named_parameters() if "embed" not in name]


@pytest.fixture(params=[True, False], ids=["c-steps", "torch-ops-steps"])
def c_kernels(request) -> bool:
    """The CPU's no-grad steps: the C step kernels' plan (the default) or the torch ops on folded matrices (what
    the Triton path on a GPU derives too: copies of every matrix, stale after any edit if kept)."""
    return request.param


def warmed_model(c_kernels: bool = True, seed: int = 0, **overrides):
    """A model whose fast path has run (and derived its weights) once, on the C step kernels or the torch ops."""
    model = perturbed_model(tiny_config(**overrides), seed=seed)
    model.model.use_c_kernels = c_kernels
    logits_on(model, token_ids(), True)
    return model


# --------------------------------------------------------------------------------------------------
# The routes
# --------------------------------------------------------------------------------------------------


def test_data_written_in_place(c_kernels):
    """The issue's case: `p.data.mul_(1.5)` on every matrix (here every parameter) after one forward (3.28 apart
    before)."""
    model = warmed_model(c_kernels)
    for p in edited(model):
        p.data.mul_(1.5)
    assert_fast_follows(model, token_ids())


def test_data_assigned_sharing_the_storage(c_kernels):
    model = warmed_model(c_kernels)
    for p in edited(model):
        p.data = p.data.mul_(1.5)  # same storage, no version bump
    assert_fast_follows(model, token_ids())


def test_data_assigned_a_new_tensor(c_kernels):
    model = warmed_model(c_kernels)
    for p in edited(model):
        p.data = p.data * 1.5
    assert_fast_follows(model, token_ids())


def test_copy_under_no_grad(c_kernels):
    model = warmed_model(c_kernels)
    with torch.no_grad():
        for p in edited(model):
            p.copy_(p * 1.5)
    assert_fast_follows(model, token_ids())


def test_load_state_dict(c_kernels):
    model = warmed_model(c_kernels)
    model.load_state_dict(perturbed_model(tiny_config(), seed=1).state_dict())
    assert_fast_follows(model, token_ids())


def test_an_optimizer_step(c_kernels):
    model = warmed_model(c_kernels).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    model(token_ids(), labels=token_ids()).loss.backward()
    optimizer.step()
    assert_fast_follows(model.eval(), token_ids())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64], ids=["bf16", "float64"])
def test_to_another_dtype_and_back(dtype, c_kernels):
    model = warmed_model(c_kernels)
    model.to(dtype)
    tolerance = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else {}
    assert_fast_follows(model, token_ids(), **tolerance)
    model.to(torch.float32)
    assert_fast_follows(model, token_ids())


def test_parametrize_register_and_remove(c_kernels):
    from torch.nn.utils import parametrize

    class Scaled(torch.nn.Module):
        def forward(self, weight):
            return 1.5 * weight

    model = warmed_model(c_kernels)
    gate = model.model.fuse_gate
    parametrize.register_parametrization(gate, "weight", Scaled())
    plain = logits_on(model, token_ids(), False)  # (a parametrized module runs the plain path)
    parametrize.remove_parametrizations(gate, "weight", leave_parametrized=True)
    torch.testing.assert_close(logits_on(model, token_ids(), True), plain, rtol=2e-4, atol=2e-5)
    assert_fast_follows(model, token_ids())


# --------------------------------------------------------------------------------------------------
# PEFT: merge, unmerge, unload
# --------------------------------------------------------------------------------------------------


def lora_model_after_one_step(model):
    """`model` wrapped in a LoRA adapter on every folded projection, after one training step (B != 0)."""
    from peft import LoraConfig, get_peft_model

    targets = ["fuse_gate", "key", "value", "gate", "ffn_in", "ffn_out", "read_query", "read_gate", "read_out"]
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0))
    peft_model.train()
    optimizer = torch.optim.SGD([p for p in peft_model.parameters() if p.requires_grad], lr=1.0)
    peft_model(token_ids(seed=3), labels=token_ids(seed=3)).loss.backward()
    optimizer.step()
    return peft_model.eval()


def test_peft_merge_and_unload(c_kernels):
    """The issue's case: merged LoRA logits 0.55 (fresh adapter) to 7.1 (after one step) apart before."""
    model = warmed_model(c_kernels)
    merged = lora_model_after_one_step(model).merge_and_unload()
    assert merged is model
    assert_fast_follows(merged, token_ids())


def test_peft_merge_adapter_then_unload(c_kernels):
    model = warmed_model(c_kernels)
    peft_model = lora_model_after_one_step(model)
    peft_model.merge_adapter()
    merged_logits = logits_on(peft_model, token_ids(), False)
    base = peft_model.unload()  # the LoRA layers gone, their update left merged in the weights
    torch.testing.assert_close(logits_on(base, token_ids(), True), merged_logits, rtol=2e-4, atol=2e-5)


def test_peft_merge_unmerge_then_unload(c_kernels):
    """merge, unmerge (both through `.data`), unload: the base weights are back (up to rounding). Merged, the
    fast path reads the LoRA layers' base layers (`merged_lora_base`) and derives from the merged weights; the
    unmerge must leave none of that behind (after it the plain path runs until the unload, then the fast path
    again, on the base weights)."""
    model = warmed_model(c_kernels)
    peft_model = lora_model_after_one_step(model)
    weight = model.model.fuse_gate.base_layer.weight
    before = weight.detach().clone()
    peft_model.merge_adapter()
    assert not torch.allclose(weight, before, rtol=1e-4, atol=1e-4)  # (the merge wrote the update in)
    assert_fast_follows(peft_model, token_ids())  # (the fast path derives from the merged weights)
    peft_model.unmerge_adapter()
    base = peft_model.unload()
    assert_fast_follows(base, token_ids())


# --------------------------------------------------------------------------------------------------
# generate(): the fold is made once per call, and a later call sees edited weights
# --------------------------------------------------------------------------------------------------


def counted_derivations(monkeypatch) -> list:
    """A list that gets an entry whenever the fast path derives its weights from the parameters: a fold
    (`recurrence_step.fold_weights`, the torch-ops steps) or a C step kernels' plan (`StepPlan`, which reads
    the weights in place but copies norms, biases and decay rates)."""
    from modeling_gpn import fast_recurrence, recurrence_step

    folds = []
    fold = recurrence_step.fold_weights
    monkeypatch.setattr(recurrence_step, "fold_weights", lambda model: folds.append(1) or fold(model))
    plan = fast_recurrence.StepPlan
    monkeypatch.setattr(fast_recurrence, "StepPlan", lambda model, rows: folds.append(1) or plan(model, rows))
    return folds


@torch.no_grad()
def test_generate_folds_once_per_call_and_sees_edits_between_calls(monkeypatch):
    folds = counted_derivations(monkeypatch)
    model = perturbed_model(tiny_config(), seed=5)
    prompt = token_ids(2, 5, seed=6)

    def greedy(fast: bool) -> torch.Tensor:
        model.model.use_fast_path = fast
        out = model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
        model.model.use_fast_path = True
        return out

    first = greedy(True)
    assert len(folds) == 1  # the prompt's forward folded; the 7 decoded tokens reused it
    assert torch.equal(first, greedy(False))
    for p in matrices(model):
        p.data.mul_(1.5)
    edited = greedy(True)
    assert len(folds) == 2
    assert torch.equal(edited, greedy(False))
    assert not torch.equal(edited, first)  # (the edit changes what is generated)


# --------------------------------------------------------------------------------------------------
# CUDA graphs (their static copies of the weights), through Triton's interpreter on CPU
# --------------------------------------------------------------------------------------------------


@torch.no_grad()
def test_the_graph_steps_see_edited_weights(triton_on, monkeypatch):
    """GPN_CUDA_GRAPHS=1: a window's graph chunks and generate()'s decode graph, made before an edit through
    `.data`, must compute with the edited weights afterwards."""
    from modeling_gpn import cuda_graphs

    monkeypatch.setattr(cuda_graphs, "WINDOW_CHUNK", 4)
    monkeypatch.setenv("GPN_CUDA_GRAPHS", "1")
    model = perturbed_model(tiny_config(), seed=7)
    prompt = token_ids(2, 5, seed=8)
    before = model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
    logits_on(model, token_ids(), True)
    assert {key[2] for key in model.model._gpn_graphs} == {1, 4}  # (the graph steps ran: decode and chunks)
    for p in matrices(model):
        p.data.mul_(1.5)
    assert_fast_follows(model, token_ids())
    fast = model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
    model.model.use_fast_path = False
    plain = model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(fast, plain) and not torch.equal(fast, before)


@torch.no_grad()
def test_a_decode_loop_folds_once_per_cache_and_a_new_cache_sees_edits(monkeypatch):
    """A loop calling the model one token at a time with its cache (what generate() does inside, and what
    benchmarks/long_decode.py does) reuses what the cache's first call derived: one fold for the loop, not one
    per token. A new cache after an edit derives afresh and sees it."""
    folds = counted_derivations(monkeypatch)
    model = perturbed_model(tiny_config(), seed=5)

    def loop() -> torch.Tensor:
        out = model(token_ids(1, 5, seed=6), use_cache=True)
        for _ in range(6):
            out = model(out.logits[:, -1:].argmax(-1), cache=out.cache, use_cache=True)
        return out.logits

    first = loop()
    assert len(folds) == 1  # the prompt's call folded; the six decoded tokens reused it
    for p in matrices(model):
        p.data.mul_(1.5)
    edited = loop()
    assert len(folds) == 2
    model.model.use_fast_path = False
    assert model.model.last_recurrence_path == "fast"
    torch.testing.assert_close(edited, loop(), rtol=2e-4, atol=2e-5)
    assert not torch.allclose(edited, first)


@torch.no_grad()
@pytest.mark.parametrize("route", ["load_state_dict", "optimizer step"])
def test_a_decode_loop_sees_weights_changed_between_two_calls_on_one_cache(route, monkeypatch):
    """What a decode loop's first call derives is kept with its cache (`derived_weights.keep_with`), and within
    that cache's life the parameters' key still guards: after `load_state_dict` or an optimizer step between two
    calls that continue the same cache, the next call derives afresh and computes with the new weights (the fast
    path's logits and state equal the plain path's from the same state). With the guard reduced to "derive only
    when nothing was derived yet" (`self.key is None`), the kept fold of the old weights would be used."""
    from ..backend_observer import FAST_PATH, ran

    folds = counted_derivations(monkeypatch)  # a fold, or the C step kernels' plan of a few-row no-grad window
    model = perturbed_model(tiny_config(), seed=5).eval()
    out = model(token_ids(1, 5, seed=6), use_cache=True)
    cache = out.cache
    for _ in range(3):  # the loop reuses the first call's fold
        out = model(out.logits[:, -1:].argmax(-1), cache=cache, use_cache=True)
    assert len(folds) == 1
    if route == "load_state_dict":
        model.load_state_dict(perturbed_model(tiny_config(), seed=1).state_dict())
    else:
        with torch.enable_grad():
            model.train()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
            model(token_ids(seed=3), labels=token_ids(seed=3)).loss.backward()
            optimizer.step()
            model.eval()
    next_token = out.logits[:, -1:].argmax(-1)
    plain_cache = cache.fork(1)  # the same state, for the plain path on the new weights
    with ran(FAST_PATH):
        fast = model(next_token, cache=cache, use_cache=True).logits
    assert len(folds) == 2  # the key changed: derived afresh, within the same cache's life
    model.model.use_fast_path = False
    plain = model(next_token, cache=plain_cache, use_cache=True).logits
    model.model.use_fast_path = True
    torch.testing.assert_close(fast, plain, rtol=2e-4, atol=2e-5)
    for kept, reference in zip(cache.get_state(), plain_cache.get_state()):
        torch.testing.assert_close(kept, reference, rtol=2e-4, atol=2e-5)


@torch.no_grad()
def test_what_a_call_derived_goes_when_the_cache_it_was_kept_for_does():
    """What the fast path derives (folded matrices; for an int4 model, its values packed for the int4 products) is kept
    with the cache a call returned, for a decode loop continuing it (`derived_weights.keep_with`), and goes when
    that cache does: the model held it for its whole life (until another call replaced it), so an int4 model
    held its bf16 matrices beside its int4 ones after its first `generate()`."""
    import gc

    from modeling_gpn.derived_weights import KEPT_ATTRIBUTE

    model = perturbed_model(tiny_config(), seed=5).eval()
    out = model.generate(token_ids(1, 5, seed=6), max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    kept = model.model.__dict__[KEPT_ATTRIBUTE]
    assert kept[0]() is out.past_key_values and kept[1].entries  # kept while the returned cache lives
    del out, kept
    gc.collect()
    assert KEPT_ATTRIBUTE not in model.model.__dict__
    model.generate(token_ids(1, 5, seed=6), max_new_tokens=3, do_sample=False)  # (its cache is not returned)
    gc.collect()
    assert KEPT_ATTRIBUTE not in model.model.__dict__
