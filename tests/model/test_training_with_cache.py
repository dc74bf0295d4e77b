"""Training with a carried state: gradients through a `GPNCache` from one call to the next.

A long document split into chunks, each a forward with gradients that continues the cache the one before returned:
the summed losses' gradients are those of one forward over the whole document (full backpropagation through time,
on the plain and the fast path, through p, g and M alike), and truncated BPTT detaches the cache between an optimizer
step and the next chunk (`GPNCache.detach`), a forgotten detach being refused by name (docs/cache.md, "Training with a
carried state").
"""

from __future__ import annotations

import pytest
import torch

from modeling_gpn import GPNCache

from ..backend_observer import DECODE_CALLS, FAST_PATH, PLAIN_PATH, ran
from ..environment import require_c_kernels
from ..tiny_models import tiny_config, well_conditioned_model

IDS = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(3))
CHUNKS = ((0, 4), (4, 9), (9, 12))  # three chunks of unequal lengths


def targets_of(ids: torch.Tensor) -> torch.Tensor:
    """Position t's target ids[t + 1] over the whole sequence (the last position has none): sliced per chunk as
    `shift_labels`, each chunk's last position keeps its target, the next chunk's first token."""
    return torch.cat([ids[:, 1:], ids.new_full((ids.shape[0], 1), -100)], dim=1)


def gradients(model) -> dict[str, torch.Tensor]:
    grads = {name: param.grad.clone() for name, param in model.named_parameters() if param.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def chunked_loss(model, ids: torch.Tensor, **kwargs) -> torch.Tensor:
    """The summed loss of the chunks, each continuing the cache the one before returned (with gradients)."""
    targets, cache, total = targets_of(ids), None, 0
    for start, stop in CHUNKS:
        out = model(
            ids[:, start:stop],
            shift_labels=targets[:, start:stop],
            num_items_in_batch=1,  # (the sum: the chunks' losses add up to the whole one's)
            past_key_values=cache,
            use_cache=True,
            **kwargs,
        )
        cache, total = out.past_key_values, total + out.loss
        assert cache.carries_graph
    return total


@pytest.fixture(scope="module")
def model():
    return well_conditioned_model(tiny_config(), seed=1)


@pytest.mark.parametrize("path", ["plain", "fast", "checkpointed"])
def test_gradients_through_a_carried_state_are_those_of_one_forward(model, path):
    """The summed chunk losses' gradients equal one forward's over the whole sequence, for every weight (those of the
    memory's key and value reach a later chunk only through the carried M, the grounding gate's only through p and
    g): the state enters each call with its graph, on the plain path, the fast path's autograd Function (its gradient
    into the incoming state) and gradient checkpointing's segments. The cache stored the graph, not the values alone
    (which gave each chunk's gradients as if its incoming state were a constant, in silence)."""
    if path == "checkpointed":  # (its own: transformers leaves a hook on the embedding after disabling it)
        model = well_conditioned_model(tiny_config(), seed=1)
    model.model.use_fast_path = path == "fast"
    model.prefill_chunk_length = 3  # (a long chunk with gradients is read in one pass: the prefill chunks no-grad only)
    if path == "checkpointed":
        model.gradient_checkpointing_enable()
        model.config.bptt_segment_length = 2
    try:
        assert model.training and model(IDS[:, :3]).cache is None  # (training mode keeps no cache unless asked)
        whole = model(IDS, shift_labels=targets_of(IDS), num_items_in_batch=1, return_logits=path != "fast")
        whole.loss.backward()
        expected = gradients(model)
        with ran(FAST_PATH if path == "fast" else PLAIN_PATH):
            chunked_loss(model, IDS, return_logits=path == "fast").backward()
        got = gradients(model)
    finally:
        model.model.use_fast_path, model.prefill_chunk_length = True, type(model).prefill_chunk_length
    assert expected.keys() == got.keys() and len(got) > 10
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_inputs_embeds_get_their_gradient_through_the_carried_state(model):
    """A frozen model, embeddings that require gradients (a soft prompt, an attribution): the gradient of the last
    chunk's loss reaches the first chunk's embeddings through the cache."""
    model.requires_grad_(False)
    try:
        embeds = model.get_input_embeddings()(IDS).detach().requires_grad_()
        (whole,) = torch.autograd.grad(model(inputs_embeds=embeds).logits[:, -1].square().sum(), embeds)
        first = model(inputs_embeds=embeds[:, :5], use_cache=True)
        last = model(inputs_embeds=embeds[:, 5:], cache=first.cache, use_cache=True)
        (chunked,) = torch.autograd.grad(last.logits[:, -1].square().sum(), embeds)
    finally:
        model.requires_grad_(True)
    assert chunked[:, :5].abs().sum() > 0
    torch.testing.assert_close(chunked, whole, rtol=1e-4, atol=1e-6)


def test_truncated_bptt_detaches_the_cache_and_a_forgotten_detach_is_refused(model):
    """After a backward (and an optimizer step), the cache's graph is spent: continuing it with gradients is refused
    naming `cache.detach()`, rather than failing in the next backward deep inside torch ("backward through the graph a
    second time", "modified by an inplace operation"). Detached, the next chunk starts from the same values as a
    constant; a no-grad call may continue a spent graph (it needs none)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    original = {name: param.detach().clone() for name, param in model.named_parameters()}
    try:
        first = model(IDS[:, :6], labels=IDS[:, :6], use_cache=True)
        first.loss.backward()
        with pytest.raises(RuntimeError, match=r"a backward\(\) has already run through that graph.*cache\.detach\(\)"):
            model(IDS[:, 6:], labels=IDS[:, 6:], cache=first.cache, use_cache=True)
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            constant = first.cache.fork(1)  # (the values, without gradients)
        assert first.cache.detach() is first.cache and not first.cache.carries_graph
        model(IDS[:, 6:], labels=IDS[:, 6:], cache=first.cache, use_cache=True).loss.backward()
        detached = gradients(model)
        model(IDS[:, 6:], labels=IDS[:, 6:], cache=constant, use_cache=True).loss.backward()
        for name, grad in gradients(model).items():
            torch.testing.assert_close(detached[name], grad, rtol=0, atol=0, msg=name)

        # kept with retain_graph=True, then stepped: the weights the graph holds changed
        kept = model(IDS[:, :6], labels=IDS[:, :6], use_cache=True)
        kept.loss.backward(retain_graph=True)
        optimizer.step()
        with pytest.raises(RuntimeError, match=r"an optimizer step .* changed the weights.*cache\.detach\(\)"):
            model(IDS[:, 6:], cache=kept.cache, use_cache=True)
        with torch.no_grad():
            model(IDS[:, 6:], cache=kept.cache, use_cache=True)
        assert not kept.cache.carries_graph
    finally:
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(original[name])


@pytest.mark.parametrize("path", ["plain", "fast"])
def test_a_graph_freed_before_the_last_call_is_refused_by_name(model, path):
    """Three calls, a backward of the first chunk's loss alone after the second (without retain_graph): it frees
    the first call's part of the graph, not the second's, and the third call's backward would reach it. The third
    call is refused naming `cache.detach()` and retain_graph, rather than failing in that backward inside torch
    ("backward through the graph a second time") or, on the fast path, in its recurrence's backward (which names
    the plain path, where the backward fails the same)."""
    model.model.use_fast_path = path == "fast"
    try:
        first = model(IDS[:, :4], labels=IDS[:, :4], use_cache=True)
        second = model(IDS[:, 4:8], cache=first.cache, use_cache=True)
        first.loss.backward()
        with pytest.raises(
            RuntimeError, match=r"an earlier call's part of it\) and freed it.*cache\.detach\(\).*retain_graph=True"
        ):
            model(IDS[:, 8:], labels=IDS[:, 8:], cache=second.cache, use_cache=True)
        model(IDS[:, 8:], labels=IDS[:, 8:], cache=second.cache.detach(), use_cache=True).loss.backward()
    finally:
        model.model.use_fast_path = True
        model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("call", ["decoded token", "forward"])
def test_a_no_grad_continuation_ends_the_graph(model, call):
    """A no-grad call continuing a cache that carries a graph (a decoded token in one C call, which writes the state
    in place, or a forward) leaves a constant state: a later chunk's loss does not reach the first chunk's weights
    through it. (Written into the graph's own tensors, the next call linked values the graph did not compute to the
    first chunk's weights, in silence.)"""
    first = model(IDS[:, :5], labels=IDS[:, :5], use_cache=True)
    cache = first.cache
    with torch.no_grad():
        if call == "decoded token":
            require_c_kernels()
            with ran(DECODE_CALLS):
                model(IDS[:, 5:6], cache=cache, use_cache=True)
        else:
            model(IDS[:, 5:6], labels=IDS[:, 5:6], cache=cache, use_cache=True)
        constant = cache.fork(1)
    assert not cache.carries_graph
    (first.loss + model(IDS[:, 6:], labels=IDS[:, 6:], cache=cache, use_cache=True).loss).backward()
    got = gradients(model)
    first = model(IDS[:, :5], labels=IDS[:, :5], use_cache=True)
    (first.loss + model(IDS[:, 6:], labels=IDS[:, 6:], cache=constant, use_cache=True).loss).backward()
    for name, grad in gradients(model).items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_a_cache_carrying_a_graph_copies_and_resets(model):
    """A deep copy with gradients keeps the link to the graph (as `fork` does); without, and pickled, it holds the
    values only; `reset()` drops the graph with the state; `save` writes the values."""
    import copy
    import pickle

    cache = model(IDS[:, :4], use_cache=True).cache
    assert copy.deepcopy(cache).carries_graph and cache.fork(2).carries_graph
    with torch.no_grad():
        assert not copy.deepcopy(cache).carries_graph and not cache.fork(1).carries_graph
    unpickled = pickle.loads(pickle.dumps(cache))
    assert not unpickled.carries_graph and cache.carries_graph
    torch.testing.assert_close(unpickled.get_state(), cache.get_state(), rtol=0, atol=0)
    out = model(IDS[:, :4], labels=IDS[:, :4], cache=cache, use_cache=True)
    out.loss.backward()
    cache.reset()  # (after a backward: the emptied state is no part of the spent graph)
    assert isinstance(cache, GPNCache) and not cache.carries_graph and not cache.has_state
    assert not any(state.requires_grad for state in cache.state_layer.recurrent_states.values())  # (graph released)
    model(IDS[:, 4:], labels=IDS[:, 4:], cache=cache, use_cache=True).loss.backward()
    model.zero_grad(set_to_none=True)
