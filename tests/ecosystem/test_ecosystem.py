"""The tools a transformers user reaches for, run for real on a tiny GPN (issue 14).

Trainer with gradient accumulation, the arguments transformers' own causal LMs take
(`num_items_in_batch`, `shift_labels`, `past_key_values`, generate()'s `tokenizer`), PEFT LoRA, forward
hooks and replaced modules (which must never be skipped by the fast path), gradient checkpointing,
torch.export and torch.compile(fullgraph=True), remote code for every auto class, and generation
continued from a returned cache.
"""

from __future__ import annotations

import copy
import json
import pickle
import subprocess
import textwrap
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ..subprocesses import BLOCK_PACKAGE, one_started_in_the_background, run_python
from ..tiny_models import perturbed_model, tiny_config, without_metadata

VOCAB = 97


def token_ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (batch, length), generator=generator)


def ragged_labels(ids: torch.Tensor) -> torch.Tensor:
    """Labels with a different number of ignored (-100) positions per row, so a mean of means is wrong."""
    labels = ids.clone()
    for row in range(labels.shape[0]):
        labels[row, : 1 + 2 * row] = -100
    return labels


def token_mean_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The causal LM loss by hand: mean over every counted target of the batch."""
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1), ignore_index=-100
    )


def logits_of(model, ids, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False, **kwargs).logits


def recurrence_path(model) -> str:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.model.last_recurrence_path


# --------------------------------------------------------------------------------------------------
# 1. What transformers passes to forward
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("return_logits", [True, False], ids=["logits", "chunked"])
def test_num_items_in_batch_makes_gradient_accumulation_exact(return_logits):
    model = perturbed_model(tiny_config()).train()
    ids = token_ids(4, 9)
    labels = ragged_labels(ids)
    count = int((labels[:, 1:] != -100).sum())

    model.zero_grad()
    full = model(ids, labels=labels, return_logits=return_logits).loss
    full.backward()
    full_grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    model.zero_grad()
    halves = []
    for rows in (slice(0, 1), slice(1, 4)):  # uneven micro-batches with uneven token counts
        loss = model(
            ids[rows], labels=labels[rows], num_items_in_batch=torch.tensor(count), return_logits=return_logits
        ).loss
        loss.backward()
        halves.append(loss.detach())
    torch.testing.assert_close(sum(halves), full.detach(), rtol=1e-5, atol=1e-6)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, full_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    # An int works too, and a micro-batch with nothing to count gives 0, not nan
    nothing = torch.full_like(labels[:1], -100)
    assert model(ids[:1], labels=nothing, num_items_in_batch=count, return_logits=return_logits).loss.item() == 0.0


@pytest.mark.parametrize("return_logits", [True, False], ids=["logits", "chunked"])
def test_shift_labels_are_the_targets_of_each_position(return_logits):
    model = perturbed_model(tiny_config())
    ids = token_ids(2, 8)
    labels = ragged_labels(ids)
    logits = logits_of(model, ids)
    shifted = F.pad(labels, (0, 1), value=-100)[:, 1:]  # what transformers' loss utils and Trainer build
    with torch.no_grad():
        from_labels = model(ids, labels=labels, return_logits=return_logits).loss
        from_shift = model(ids, shift_labels=shifted, return_logits=return_logits).loss
        both = model(ids, labels=torch.zeros_like(labels), shift_labels=shifted, return_logits=return_logits).loss
    torch.testing.assert_close(from_shift, from_labels)
    torch.testing.assert_close(both, from_labels)  # shift_labels take precedence, as in transformers
    # A context-parallel shard's last position has a real target (the next shard's first token)
    real_last = shifted.clone()
    real_last[:, -1] = 5
    expected = F.cross_entropy(logits.reshape(-1, VOCAB), real_last.reshape(-1), ignore_index=-100)
    with torch.no_grad():
        got = model(ids, shift_labels=real_last, return_logits=return_logits).loss
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="shift_labels must have shape"):
        model(ids, shift_labels=shifted[:, 1:])


def test_past_key_values_is_an_alias_of_cache():
    model = perturbed_model(tiny_config())
    ids = token_ids(2, 9)
    full = logits_of(model, ids)
    with torch.no_grad():
        cache = model(ids[:, :5], use_cache=True).cache
        with pytest.warns(FutureWarning, match="past_key_values"):
            rest = model(ids[:, 5:], past_key_values=cache, use_cache=True)
        hidden = model.model(ids[:, :5], use_cache=True).cache
        with pytest.warns(FutureWarning):
            rest_hidden = model.model(ids[:, 5:], past_key_values=hidden).last_hidden_state
    torch.testing.assert_close(rest.logits, full[:, 5:], rtol=1e-5, atol=1e-5)
    assert rest.cache is cache and cache.get_seq_length() == 9
    torch.testing.assert_close(model.lm_head(rest_hidden), full[:, 5:], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="not both"):
        model(ids, cache=cache, past_key_values=cache)


def test_wrong_arguments_are_refused_by_name():
    model = perturbed_model(tiny_config())
    ids = token_ids(2, 6)
    with pytest.raises(TypeError, match=r"unexpected arguments: \['tokenizr'\]"):
        model(ids, tokenizr=None)
    # (packed batches, `cu_seq_lens_*` / `seq_idx` / restarting `position_ids`: tests/model/test_packed.py)
    # Ordinary position ids, and left padding as generate() numbers it, are accepted and ignored
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    torch.testing.assert_close(
        logits_of(model, ids, attention_mask=mask, position_ids=positions), logits_of(model, ids, attention_mask=mask)
    )


@pytest.fixture(scope="module")
def bpe_tokenizer():
    from modeling_gpn.data import train_bpe_tokenizer

    text = ["the cat sat on the mat. the dog sat on the log.", "once upon a time there was a cat and a dog."] * 20
    return train_bpe_tokenizer(text, vocab_size=300)


def test_generate_with_stop_strings_and_tokenizer_stops(bpe_tokenizer):
    tokenizer = bpe_tokenizer
    model = perturbed_model(tiny_config(vocab_size=len(tokenizer), eos_token_id=None), seed=3)
    prompt = tokenizer("the cat", return_tensors="pt").input_ids
    free = model.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)
    new_tokens = free[0, prompt.shape[1] :]
    stop_at = 4  # stop on the text of the 4th generated token (the first time it appears)
    stop_string = tokenizer.decode(new_tokens[stop_at - 1 : stop_at])
    assert stop_string.strip(), "the chosen stop string must be visible text"
    first = next(i for i in range(len(new_tokens)) if stop_string in tokenizer.decode(new_tokens[: i + 1]))
    stopped = model.generate(
        prompt, max_new_tokens=12, do_sample=False, pad_token_id=0, stop_strings=[stop_string], tokenizer=tokenizer
    )
    assert stopped.shape[1] == prompt.shape[1] + first + 1 < free.shape[1]
    assert torch.equal(stopped[0], free[0, : stopped.shape[1]])
    assert tokenizer.decode(stopped[0, prompt.shape[1] :]).endswith(stop_string)


# --------------------------------------------------------------------------------------------------
# 6. Continuing generation from a returned cache with the full sequence
# --------------------------------------------------------------------------------------------------


def test_generation_continued_with_the_full_sequence_and_its_cache_matches_one_run():
    model = perturbed_model(tiny_config(eos_token_id=None))
    prompt = token_ids(2, 5, seed=4)
    mask = torch.ones_like(prompt)
    mask[1, :2] = 0  # a left-padded row
    settings = dict(do_sample=False, pad_token_id=0)
    whole = model.generate(prompt, attention_mask=mask, max_new_tokens=10, **settings)

    first = model.generate(prompt, attention_mask=mask, max_new_tokens=4, return_dict_in_generate=True, **settings)
    cache = first.cache
    assert cache is first.past_key_values and cache.get_seq_length() == prompt.shape[1] + 3
    full_mask = torch.cat([mask, torch.ones(2, 4, dtype=mask.dtype)], dim=1)
    continued = model.generate(first.sequences, attention_mask=full_mask, cache=cache, max_new_tokens=6, **settings)
    assert torch.equal(continued, whole)

    # The new tokens alone, with a mask over the full sequence, are fed as they are
    again = model.generate(prompt, attention_mask=mask, max_new_tokens=4, return_dict_in_generate=True, **settings)
    seen = again.cache.get_seq_length()
    tail = model.generate(
        again.sequences[:, seen:], attention_mask=full_mask, cache=again.cache, max_new_tokens=6, **settings
    )
    assert torch.equal(tail, whole[:, seen:])

    # The positions the cache has read, again and nothing new: a recurrent state cannot be rolled back
    again = model.generate(prompt, attention_mask=mask, max_new_tokens=4, return_dict_in_generate=True, **settings)
    read = again.sequences[:, : again.cache.get_seq_length()]
    with pytest.raises(ValueError, match="cannot be rolled back"):
        model.generate(
            read, attention_mask=full_mask[:, : read.shape[1]], cache=again.cache, max_new_tokens=2, **settings
        )


def test_generation_continued_with_only_the_new_positions_as_mamba_matches_one_run():
    """transformers' recurrent models (Mamba) continue from a cache given only the new positions, without a
    mask over the whole sequence, even when they outnumber the positions the cache has read: the cache's
    fingerprint of what it read tells them from the whole sequence (lengths alone cannot)."""
    model = perturbed_model(tiny_config(eos_token_id=None))
    settings = dict(do_sample=False, pad_token_id=0)
    prompt = token_ids(2, 3, seed=5)
    first = model.generate(prompt, max_new_tokens=2, return_dict_in_generate=True, **settings)
    seen = first.cache.get_seq_length()
    assert seen == 4  # the prompt and the first generated token; the last one is not read yet
    extra = token_ids(2, 5, seed=6)
    whole = model.generate(torch.cat([first.sequences, extra], dim=1), max_new_tokens=4, **settings)

    new_positions = torch.cat([first.sequences[:, seen:], extra], dim=1)  # 6 positions, more than the 4 read
    continued = model.generate(new_positions, cache=first.cache, max_new_tokens=4, **settings)
    assert torch.equal(continued, whole[:, seen:])

    # fewer new positions than read (one, as decoding feeds them) are new positions too
    fresh = model.generate(prompt, max_new_tokens=2, return_dict_in_generate=True, **settings)
    got = model.generate(fresh.sequences[:, seen:], cache=fresh.cache, max_new_tokens=3, **settings)
    expected = model.generate(prompt, max_new_tokens=5, **settings)
    assert torch.equal(got, expected[:, seen:])


def test_continuing_generation_refuses_what_it_cannot_tell_apart():
    model = perturbed_model(tiny_config(eos_token_id=None))
    settings = dict(do_sample=False, pad_token_id=0)
    prompt = token_ids(2, 3, seed=5)

    def cache_after_prompt(**inputs):
        return model.generate(**inputs, max_new_tokens=1, return_dict_in_generate=True, **settings).cache

    longer = token_ids(2, 6, seed=8)
    # inputs_embeds: nothing to fingerprint, and more positions than read
    embeds = model.get_input_embeddings()(longer).detach()
    with pytest.raises(ValueError, match="inputs_embeds"):
        model.generate(inputs_embeds=embeds, cache=cache_after_prompt(input_ids=prompt), max_new_tokens=2, **settings)
    # ...unless the mask says they are the new positions
    mask = torch.ones(2, 3 + 6, dtype=torch.long)
    model.generate(
        inputs_embeds=embeds,
        attention_mask=mask,
        cache=cache_after_prompt(input_ids=prompt),
        max_new_tokens=2,
        **settings,
    )

    # a cache that read embeddings has no record of what it read
    filled_from_embeddings = cache_after_prompt(inputs_embeds=model.get_input_embeddings()(prompt).detach())
    assert filled_from_embeddings.read_fingerprint() is None
    with pytest.raises(ValueError, match="without a record"):
        model.generate(longer, cache=filled_from_embeddings, max_new_tokens=2, **settings)

    # rows that disagree: one begins with what its row read, the other does not
    mixed = torch.cat([prompt, longer[:, :3]], dim=1)
    mixed[1, :3] = (prompt[1] + 1) % 97
    with pytest.raises(ValueError, match="begin with what the cache read"):
        model.generate(mixed, cache=cache_after_prompt(input_ids=prompt), max_new_tokens=2, **settings)

    # a mask that covers neither the given positions nor the whole sequence
    with pytest.raises(ValueError, match="must cover"):
        model.generate(
            longer,
            attention_mask=torch.ones(2, 7, dtype=torch.long),
            cache=cache_after_prompt(input_ids=prompt),
            max_new_tokens=2,
            **settings,
        )


def test_as_many_positions_as_read_without_a_record_are_refused_not_misread():
    """A cache that does not know what it read (it read embeddings), given exactly as many positions as it has
    read, cannot tell them from the whole sequence with nothing new (which must not be fed again); nor can
    embeddings of that length. Both are refused, saying what to pass (the new positions with a mask over the
    whole sequence), and that call then continues as one uninterrupted run."""
    model = perturbed_model(tiny_config(eos_token_id=None))
    settings = dict(do_sample=False, pad_token_id=0)
    prompt, new = token_ids(2, 3, seed=5), token_ids(2, 3, seed=9)
    embed = model.get_input_embeddings()

    def cache_from_embeddings():
        cache = model.generate(
            inputs_embeds=embed(prompt).detach(), max_new_tokens=1, return_dict_in_generate=True, **settings
        ).cache
        assert cache.get_seq_length() == 3 and cache.read_fingerprint() is None
        return cache

    what_to_pass = (
        r"Pass only the new positions with an attention_mask covering the whole sequence \(3 \+ 3 = 6 columns\)"
    )
    with pytest.raises(ValueError, match=what_to_pass):
        model.generate(new, cache=cache_from_embeddings(), max_new_tokens=2, **settings)
    with pytest.raises(ValueError, match="as inputs_embeds.*" + what_to_pass):
        model.generate(inputs_embeds=embed(new).detach(), cache=cache_from_embeddings(), max_new_tokens=2, **settings)
    mask = torch.ones(2, 6, dtype=torch.long)
    continued = model.generate(new, attention_mask=mask, cache=cache_from_embeddings(), max_new_tokens=2, **settings)
    uninterrupted = model.generate(torch.cat([prompt, new], dim=1), max_new_tokens=2, **settings)
    assert torch.equal(continued, uninterrupted[:, 3:])


def test_the_read_fingerprint_does_not_depend_on_how_the_positions_were_split():
    from modeling_gpn.cache import GPNCache, token_fingerprint

    model = perturbed_model(tiny_config())
    ids = token_ids(2, 150, seed=3)  # more calls than the fingerprint keeps before folding
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[0, :5] = False
    one_call = model(ids, attention_mask=mask, use_cache=True).cache
    stepped = GPNCache(model.config)
    with torch.no_grad():
        for t in range(150):
            model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], cache=stepped, use_cache=True)
    assert torch.equal(one_call.read_fingerprint(), stepped.read_fingerprint())
    # calls of several positions each continue the fingerprint of those before (one-position calls fold theirs in
    # place, another update)
    chunked = GPNCache(model.config)
    with torch.no_grad():
        for start, stop in ((0, 7), (7, 67), (67, 150)):
            model(ids[:, start:stop], attention_mask=mask[:, :stop], cache=chunked, use_cache=True)
    assert torch.equal(one_call.read_fingerprint(), chunked.read_fingerprint())
    assert torch.equal(one_call.read_fingerprint(), token_fingerprint(ids, mask))
    other_padding = ids.clone()
    other_padding[0, :5] = 0  # the ids of padded positions do not count
    assert torch.equal(token_fingerprint(other_padding, mask), token_fingerprint(ids, mask))
    assert not torch.equal(token_fingerprint(ids, None)[0], token_fingerprint(ids, mask)[0])


# --------------------------------------------------------------------------------------------------
# 2. Module wrappers: PEFT LoRA, hooks, replaced modules
# --------------------------------------------------------------------------------------------------

LORA_TARGETS = ["fuse_gate", "key", "value", "gate", "ffn_in", "ffn_out", "read_query", "read_out", "decode_proj"]


def lora_model(base, targets=LORA_TARGETS, seed: int = 1):
    import peft

    torch.manual_seed(seed)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    return peft.get_peft_model(base, config)


def test_peft_lora_gradients_through_a_carried_state_are_those_of_one_forward():
    """A LoRA model trained on a document in two chunks, the second continuing the first's cache: the adapters'
    gradients are those of one forward over the whole document (the state enters the second call with its graph)."""
    adapted = lora_model(perturbed_model(tiny_config(), seed=2).train())
    ids = torch.randint(0, 97, (2, 10), generator=torch.Generator().manual_seed(4))
    targets = torch.cat([ids[:, 1:], ids.new_full((2, 1), -100)], dim=1)

    def adapter_gradients():
        grads = {name: p.grad.clone() for name, p in adapted.named_parameters() if p.grad is not None}
        adapted.zero_grad(set_to_none=True)
        return grads

    adapted(input_ids=ids, shift_labels=targets, num_items_in_batch=1).loss.backward()
    whole = adapter_gradients()
    first = adapted(input_ids=ids[:, :4], shift_labels=targets[:, :4], num_items_in_batch=1, use_cache=True)
    second = adapted(
        input_ids=ids[:, 4:], shift_labels=targets[:, 4:], num_items_in_batch=1, cache=first.cache, use_cache=True
    )
    (first.loss + second.loss).backward()
    chunked = adapter_gradients()
    assert whole.keys() == chunked.keys() and all("lora_" in name for name in whole) and len(whole) > 10
    for name, grad in whole.items():
        torch.testing.assert_close(chunked[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_peft_lora_changes_the_logits_on_the_fast_and_plain_path():
    config = tiny_config(num_predict_layers=2)
    ids = token_ids(2, 9)
    base_logits = logits_of(perturbed_model(config), ids)
    adapted = lora_model(perturbed_model(config)).eval()
    inner = adapted.get_base_model().model
    assert inner.fast_path_blocker() is not None and "lora" in inner.fast_path_blocker().lower()

    fast_requested = logits_of(adapted, ids)
    assert recurrence_path(adapted) == "plain"  # fell back: the fast path would fold the base weights only
    inner.use_fast_path = False
    plain = logits_of(adapted, ids)
    assert (fast_requested - base_logits).abs().max() > 1e-3
    torch.testing.assert_close(fast_requested, plain)


def test_a_peft_lora_model_compiles_with_fullgraph_after_an_eager_call():
    """torch.compile(fullgraph=True) of a LoRA model that has run eagerly gives the eager logits. (The token and decoder
    projections asked, under tracing too, whether a LoRA layer was merged in place by reading its class's `__dict__`,
    which dynamo refuses once an eager call has run: a graph break, an error under fullgraph.)"""
    adapted = lora_model(perturbed_model(tiny_config(num_predict_layers=1)), targets=["fuse_proj"]).eval()
    ids = token_ids(1, 1)  # (one position, no cache: the least for dynamo to trace)
    with torch.no_grad():
        eager = adapted(ids, use_cache=False).logits
        torch._dynamo.reset()
        compiled = torch.compile(adapted, fullgraph=True, backend="eager")(ids, use_cache=False).logits
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)


def test_peft_lora_trains_saves_reloads_and_merges(tmp_path):
    import peft

    config = tiny_config()
    ids = token_ids(4, 10)
    adapted = lora_model(perturbed_model(config), targets=LORA_TARGETS + ["embed_tokens"]).train()
    optimizer = torch.optim.Adam([p for p in adapted.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(6):
        optimizer.zero_grad()
        loss = adapted(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
        optimizer.step()
    assert losses[-1] < losses[0] - 0.05, losses
    lora_grads = {n: p.grad for n, p in adapted.named_parameters() if "lora_" in n}
    assert lora_grads and all(g is not None and g.abs().max() > 0 for g in lora_grads.values())
    assert all(p.grad is None for n, p in adapted.named_parameters() if "lora_" not in n)

    adapted.eval()
    adapted_logits = logits_of(adapted, ids)
    # PEFT's mixed batch: each row's logits, and the loss, follow its own adapter on the output side (the embedding's
    # table) too (the base rows were scored against the adapted table); the one output weight a tool reads is refused
    with adapted.disable_adapter():
        base_logits = logits_of(adapted, ids)
    names = ["default", "__base__", "__base__", "default"]
    with torch.no_grad():
        mixed_logits = adapted(input_ids=ids, adapter_names=names).logits
        mixed_loss = adapted(input_ids=ids, labels=ids, adapter_names=names, return_logits=False).loss  # (chunked)
    expected = torch.where(torch.tensor([n == "default" for n in names])[:, None, None], adapted_logits, base_logits)
    close = dict(rtol=1e-4, atol=1e-4)  # (PEFT adds a sub-batch's LoRA term apart: rounding)
    torch.testing.assert_close(mixed_logits, expected, **close)
    torch.testing.assert_close(mixed_loss, token_mean_loss(expected, ids), **close)
    with adapted.base_model._enable_peft_forward_hooks(adapter_names=names):  # (what PEFT's forward runs inside)
        with pytest.raises(ValueError, match="mixed-batch inference .* there is no one output weight"):
            adapted.get_output_embeddings()(torch.zeros(4, config.embedding_size))  # (it reads the weight)
    adapted.save_pretrained(tmp_path / "adapter")
    reloaded = peft.PeftModel.from_pretrained(perturbed_model(config), tmp_path / "adapter").eval()
    torch.testing.assert_close(logits_of(reloaded, ids), adapted_logits)

    merged = adapted.merge_and_unload().eval()
    assert merged.model.fast_path_blocker() is None
    torch.testing.assert_close(
        logits_of(merged, ids), adapted_logits, rtol=1e-4, atol=1e-4
    )  # W x + BA x vs (W + BA) x: rounding
    assert merged.model.last_recurrence_path == "fast"  # plain modules again: the fast path is back


def test_a_lora_merged_in_place_runs_the_fast_path_exactly_as_merge_and_unload_and_nothing_else_does(monkeypatch):
    """`merge_adapter()` leaves PEFT's layers around the merged weights, whose forward is then the base layer's
    (`derived_weights.merged_lora_base`): the fast path (its folded steps, the decoded token in one C call) reads
    the base layers and computes `merge_and_unload()`'s model bit for bit. Unmerged, disabled, a second adapter
    active unmerged, or a hook on a layer: the plain loop again. A decode loop continuing one cache across an
    adapter switch derives from the weights as they are (what it derived is not kept with the cache)."""
    import peft

    from ..backend_observer import DECODE_CALLS, FAST_PATH, PLAIN_PATH, ran

    adapted = lora_model(perturbed_model(tiny_config(eos_token_id=None))).eval()
    inner = adapted.get_base_model().model
    ids = token_ids(2, 6)
    greedy = dict(max_new_tokens=3, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    adapted.merge_adapter()
    with torch.no_grad(), ran(FAST_PATH, DECODE_CALLS, not_ran=(PLAIN_PATH,)):
        in_place = adapted.generate(input_ids=ids, **greedy)
        in_place_logits = logits_of(adapted, ids)
    unloaded = copy.deepcopy(adapted).merge_and_unload().eval()
    with torch.no_grad(), ran(FAST_PATH, DECODE_CALLS, not_ran=(PLAIN_PATH,)):
        merged = unloaded.generate(input_ids=ids, **greedy)
    assert torch.equal(in_place.sequences, merged.sequences)
    assert all(torch.equal(a, b) for a, b in zip(in_place.logits, merged.logits, strict=True))
    assert torch.equal(in_place_logits, logits_of(unloaded, ids))
    inner.use_fast_path = False
    torch.testing.assert_close(logits_of(adapted, ids), in_place_logits)  # (the plain loop: other sums)
    inner.use_fast_path = True

    gate = inner.predict_layers[0].gate
    for module, reason in ((gate, "lora"), (gate.base_layer, "gate.base_layer has hooks")):
        hook = module.register_forward_hook(lambda *args: None)
        assert reason in inner.fast_path_blocker()
        hook.remove()
    with adapted.disable_adapter():
        assert "lora" in inner.fast_path_blocker()
    with monkeypatch.context() as patch:  # (a PEFT whose forward was not read here)
        patch.setattr(peft, "__version__", "0.22.0")
        assert "lora" in inner.fast_path_blocker()
    assert inner.fast_path_blocker() is None
    adapted.unmerge_adapter()
    assert "lora" in inner.fast_path_blocker()
    torch.manual_seed(7)
    adapted.add_adapter("other", peft.LoraConfig(r=4, target_modules=LORA_TARGETS, init_lora_weights=False))
    adapted.base_model.set_adapter(["default", "other"])  # (PEFT unmerges before it sets adapters)
    adapted.merge_adapter(["default"])  # ("other" active, not merged: PEFT 0.21 would ignore it)
    assert "lora" in inner.fast_path_blocker()

    # a loop continuing one cache across a switch of the merged adapter (same parameters: PEFT's merge writes
    # through `.data`), on the folded torch-ops steps: what the first call derived must not serve the second
    adapted.base_model.set_adapter("default")
    adapted.merge_adapter()
    inner.use_c_kernels = False
    with torch.no_grad(), ran(FAST_PATH, not_ran=(PLAIN_PATH,)):
        cache = adapted(input_ids=ids, use_cache=True).cache
    adapted.base_model.set_adapter("other")
    adapted.merge_adapter()
    plain_cache = cache.fork(1)
    with torch.no_grad(), ran(FAST_PATH, not_ran=(PLAIN_PATH,)):
        fast = adapted(input_ids=ids[:, :2], cache=cache, use_cache=True).logits
    inner.use_fast_path = False
    with torch.no_grad():
        plain = adapted(input_ids=ids[:, :2], cache=plain_cache, use_cache=True).logits
    torch.testing.assert_close(fast, plain)

    # and across decoded tokens in one C call each, two of them in one scope, as generate() holds one: the second
    # reuses the first's decode lane, and neither may leave it with the cache for a call after the switch
    from modeling_gpn.derived_weights import derived_weights_scope

    inner.use_fast_path = inner.use_c_kernels = True
    adapted.base_model.set_adapter("default")
    adapted.merge_adapter()
    with torch.no_grad():
        cache = adapted(input_ids=ids, use_cache=True).cache
        with derived_weights_scope(inner), ran(DECODE_CALLS):
            for position in range(2):
                adapted(input_ids=ids[:, position : position + 1], cache=cache, use_cache=True)
    adapted.base_model.set_adapter("other")
    adapted.merge_adapter()
    plain_cache = cache.fork(1)
    with torch.no_grad(), ran(DECODE_CALLS):
        fast = adapted(input_ids=ids[:, :1], cache=cache, use_cache=True).logits
    inner.use_fast_path = False
    with torch.no_grad():
        plain = adapted(input_ids=ids[:, :1], cache=plain_cache, use_cache=True).logits
    torch.testing.assert_close(fast, plain)


def test_a_state_of_a_lora_merged_in_place_and_of_its_merge_load_on_each_other(tmp_path, monkeypatch):
    """A PeftModel merged in place (`merge_adapter()`) whose layers are provably their base layers computes
    `merge_and_unload()`'s states bit for bit (the fast path reads those base layers), but its state was refused
    there, and the merge's on it, as "other weights ... another adapter active, or adapters disabled", words that
    did not fit: its fingerprint hashed the adapters beside the merged weights. It is now its merge's, and each
    continues the other's state as its own. A file saved by it before (its adapters hashed) still loads on it; one
    merged in place but not so read (a hook on a layer: the plain loop, PEFT's own forward) is refused on the merge,
    and the merge's state on it, saying so. Another model's state is refused on the weights hashed once (they were
    hashed a second time, in their stored form, which a file of this version cannot hold)."""
    from modeling_gpn import GPNCache, state_file
    from modeling_gpn.state_file import GPNStateFileError, state_fingerprint, weights_hash

    hash_of = weights_hash
    adapted = lora_model(perturbed_model(tiny_config(eos_token_id=None))).eval()
    adapted.merge_adapter()
    unloaded = copy.deepcopy(adapted).merge_and_unload().eval()
    prefix, new = token_ids(2, 7, seed=4), token_ids(2, 3, seed=5)
    greedy = dict(max_new_tokens=3, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    mask = torch.ones(2, 10, dtype=torch.long)
    paths = {"in place": tmp_path / "in-place.st", "unloaded": tmp_path / "unloaded.st"}
    with torch.no_grad():
        adapted(input_ids=prefix, use_cache=True).cache.save(paths["in place"])
        unloaded(input_ids=prefix, use_cache=True).cache.save(paths["unloaded"])
        runs = [
            model.generate(input_ids=new, attention_mask=mask, cache=GPNCache.load(path, model), **greedy)
            for path in paths.values()
            for model in (adapted, unloaded)
        ]
    for run in runs[1:]:
        assert torch.equal(run.sequences, runs[0].sequences)
        assert all(torch.equal(a, b) for a, b in zip(run.logits, runs[0].logits, strict=True))

    inner = adapted.get_base_model().model
    legacy = tmp_path / "legacy.st"  # (as the previous version wrote it: the adapters hashed, no new fields)
    fingerprint = state_fingerprint(inner) | {"weights_fingerprint": weights_hash(inner, as_stored=True)}
    with torch.no_grad():
        adapted(input_ids=prefix, use_cache=True).cache.save(legacy, model_fingerprint=fingerprint)
    without_metadata(legacy, "dtype_name", "merged_adapters_hashed")
    assert GPNCache.load(legacy, adapted).get_seq_length() == 7
    with pytest.raises(GPNStateFileError, match="other weights"):
        GPNCache.load(legacy, unloaded)
    # another model's state, as this version writes it ("no" adapters hashed as stored): refused on the weights
    # hashed once, its merge's form (the stored form, every byte again, cannot be the file's)
    other = tmp_path / "other.st"
    with torch.no_grad():
        unloaded(input_ids=prefix, use_cache=True).cache.save(
            other, model_fingerprint=state_fingerprint(inner) | {"weights_fingerprint": "0" * 64}
        )
    hashed = []
    monkeypatch.setattr(
        state_file,
        "weights_hash",
        lambda model, as_stored=False, **given: hashed.append(as_stored) or hash_of(model, as_stored, **given),
    )
    with pytest.raises(GPNStateFileError, match="other weights"):
        GPNCache.load(other, adapted)
    assert hashed == [False], hashed
    monkeypatch.undo()

    hook = inner.predict_layers[0].gate.register_forward_hook(lambda *args: None)
    hooked = tmp_path / "hooked.st"
    with torch.no_grad():
        adapted(input_ids=prefix, use_cache=True).cache.save(hooked)
    with pytest.raises(GPNStateFileError, match=r"This model is a PeftModel with adapters merged in place") as error:
        GPNCache.load(paths["unloaded"], adapted)
    assert "not provably their base layers" in str(error.value) and "another adapter" not in str(error.value)
    hook.remove()
    with pytest.raises(GPNStateFileError, match=r"It was computed by a PeftModel with adapters merged in place"):
        GPNCache.load(hooked, unloaded)


def test_a_peft_models_state_loads_into_it_and_not_with_other_adapter_settings(tmp_path):
    """A state is loaded for the model a user generates with, the PeftModel itself, and continues as one run;
    the same parameters with another adapter active, or adapters disabled, compute other states, so they refuse it
    (both were taken in silence: the fingerprint hashed the adapters' matrices, not which of them were on)."""
    import peft

    from modeling_gpn import GPNCache
    from modeling_gpn.state_file import GPNStateFileError

    adapted = lora_model(perturbed_model(tiny_config(eos_token_id=None))).eval()
    prefix, new = token_ids(2, 7, seed=4), token_ids(2, 3, seed=5)
    greedy = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        uninterrupted = adapted.generate(input_ids=torch.cat([prefix, new], 1), **greedy)
        adapted(input_ids=prefix, use_cache=True).cache.save(tmp_path / "state.safetensors")
    loaded = GPNCache.load(tmp_path / "state.safetensors", adapted)
    with torch.no_grad():
        continued = adapted.generate(
            input_ids=new, attention_mask=torch.ones(2, 7 + 3, dtype=torch.long), cache=loaded, **greedy
        )
    assert torch.equal(continued, uninterrupted[:, 7:])

    with adapted.disable_adapter(), pytest.raises(GPNStateFileError, match="adapters disabled"):
        GPNCache.load(tmp_path / "state.safetensors", adapted)
    torch.manual_seed(7)
    adapted.add_adapter("other", peft.LoraConfig(r=4, target_modules=LORA_TARGETS, init_lora_weights=False))
    adapted.set_adapter("other")
    with pytest.raises(GPNStateFileError, match="another adapter active"):
        GPNCache.load(tmp_path / "state.safetensors", adapted)
    adapted.set_adapter("default")
    adapted.delete_adapter("other")  # (its matrices are parameters too: while it is held, the weights differ)
    assert GPNCache.load(tmp_path / "state.safetensors", adapted).get_seq_length() == 7

    # and a state computed with the adapter on is not saved inside disable_adapter(): the file would name the
    # model without it (it did, and that model then loaded it)
    with torch.no_grad():
        cache = adapted(input_ids=prefix, use_cache=True).cache
    with adapted.disable_adapter(), pytest.raises(ValueError, match="changed after this state was computed"):
        cache.save(tmp_path / "disabled.safetensors")
    cache.save(tmp_path / "enabled.safetensors")

    # PEFT's mixed-batch inference computes each row under its own adapter (its hooks on the adapted layers, here
    # linear ones only): the file named the active adapter's model, which then continued the "__base__" row as its
    # own, in silence. Refused at save, by a fork, a deep copy, a pickled copy and a selection of rows alike
    mixed_generate = greedy | dict(max_new_tokens=2, return_dict_in_generate=True)
    with torch.no_grad():
        mixed = adapted.generate(input_ids=prefix, adapter_names=["__base__", "default"], **mixed_generate)
        after = adapted(input_ids=prefix, use_cache=True).cache  # (the hooks gone: a state of the model again)
    mixed = mixed.past_key_values
    copies = [mixed.fork(2), copy.deepcopy(mixed), pickle.loads(pickle.dumps(mixed)), mixed]
    mixed.batch_select_indices(torch.tensor([1]))
    for each in copies:
        with pytest.raises(ValueError, match=r"mixed-batch inference .*\['__base__', 'default'\].*set_adapter"):
            each.save(tmp_path / "mixed.safetensors")
    after.save(tmp_path / "after.safetensors")

    # PEFT's hotswap_adapter writes another adapter's matrices into the loaded ones through `.data` (no version bump,
    # the same settings): the state computed before was saved naming the swapped model, which then continued it
    from peft.utils.hotswap import hotswap_adapter

    lora_model(perturbed_model(tiny_config(eos_token_id=None)), seed=8).save_pretrained(tmp_path / "swapped")
    hotswap_adapter(adapted, str(tmp_path / "swapped"), adapter_name="default")
    with pytest.raises(ValueError, match="changed after this state was computed"):
        after.save(tmp_path / "swapped.safetensors")


def test_a_state_computed_before_a_lora_on_the_head_was_merged_in_place_is_not_saved(tmp_path):
    """The head is a view of the token embedding table, outside the `GPNModel`: PEFT's LoRA on `lm_head`, merged in
    place, writes the merge into that table through `.data` (no version bump), and no adapter layer below the model
    says so. A state computed before the merge was saved naming the merged model (its fingerprint is its merge's),
    and `merge_and_unload()`'s model then continued a state it did not compute, in silence; `save` now refuses it,
    and the state computed after the merge is saved."""
    adapted = lora_model(perturbed_model(tiny_config(eos_token_id=None)), targets=["lm_head"]).eval()
    prefix = token_ids(2, 5, seed=4)
    with torch.no_grad():
        before = adapted(input_ids=prefix, use_cache=True).cache
        adapted.merge_adapter()
        after = adapted(input_ids=prefix, use_cache=True).cache
    assert not all(torch.equal(a, b) for a, b in zip(before.get_state(), after.get_state(), strict=True))
    with pytest.raises(ValueError, match="changed after this state was computed"):
        before.save(tmp_path / "before.safetensors")
    after.save(tmp_path / "after.safetensors")


def prompt_tuned(config, seed: int = 3):
    """A GPN under PEFT prompt tuning with 4 virtual tokens of random values (PEFT takes their width from
    `hidden_size`, the state's, unless told the embedding's)."""
    import peft

    torch.manual_seed(seed)
    prompted = peft.get_peft_model(
        perturbed_model(config),
        peft.PromptTuningConfig(
            task_type="CAUSAL_LM", num_virtual_tokens=4, token_dim=config.embedding_size, num_attention_heads=1
        ),
    )
    with torch.no_grad():
        prompted.prompt_encoder.default.embedding.weight.normal_()
    return prompted


def test_peft_prompt_tuning_trains_the_virtual_tokens_and_generates_from_their_embeddings():
    """The virtual tokens are read (the loss is the base model's on their embeddings followed by the ids', and
    their gradient is not zero); the documented way to generate decodes that sequence as the plain forward does;
    PEFT's own generate(), which prepends them again at every token on transformers 5, is refused by name."""
    config = tiny_config(eos_token_id=None)
    ids = token_ids(2, 6)
    prompted = prompt_tuned(config)
    base = prompted.get_base_model()
    loss = prompted(input_ids=ids, labels=ids).loss
    loss.backward()
    assert prompted.prompt_encoder.default.embedding.weight.grad.abs().max() > 0
    embeds = torch.cat([prompted.get_prompt(batch_size=2), base.get_input_embeddings()(ids)], dim=1)
    labels = torch.cat([torch.full((2, 4), -100), ids], dim=1)
    torch.testing.assert_close(loss, base(inputs_embeds=embeds, labels=labels).loss)
    assert (loss - base(input_ids=ids, labels=ids).loss).abs() > 1e-3

    with torch.no_grad():
        embeds = embeds.detach()
        generated = base.generate(inputs_embeds=embeds, max_new_tokens=5, do_sample=False)
        greedy = []
        for _ in range(5):
            next_id = base(inputs_embeds=embeds, use_cache=False).logits[:, -1].argmax(-1)
            greedy.append(next_id)
            embeds = torch.cat([embeds, base.get_input_embeddings()(next_id)[:, None]], dim=1)
    assert torch.equal(generated, torch.stack(greedy, 1))

    with pytest.raises(ValueError, match="PEFT's generate\\(\\) with PROMPT_TUNING re-inserts the virtual tokens"):
        prompted.generate(input_ids=ids, max_new_tokens=3)
    assert base.generate(ids, max_new_tokens=2).shape == (2, 8)  # PEFT put its own preparation back


def test_peft_prefix_tuning_is_refused_by_name():
    """Prefix tuning hands the forward a cache of keys and values for attention layers a GPN does not have."""
    import peft

    prefixed = peft.get_peft_model(
        perturbed_model(tiny_config()),
        peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4, num_attention_heads=1),
    )
    with pytest.raises(TypeError, match="got DynamicCache: a GPN has no attention layers"):
        prefixed(input_ids=token_ids(1, 5))


def other_tuner_config(tuner: str, targets: list):
    import peft

    return {
        "ia3": lambda: peft.IA3Config(target_modules=targets, feedforward_modules=[], init_ia3_weights=False),
        "loha": lambda: peft.LoHaConfig(r=4, target_modules=targets, init_weights=False),
        "oft": lambda: peft.OFTConfig(r=0, oft_block_size=8, target_modules=targets, init_weights=False),
    }[tuner]()


@pytest.mark.parametrize("tuner", ["ia3", "loha", "oft"])
def test_peft_tuners_on_the_modules_the_fast_path_calls_are_called_in_every_call(tuner):
    """PEFT's other adapter families (IA3's scaling vector, LoHa's Hadamard product, OFT's rotation, OFT on the
    embedding too, which the output follows) on the token and decoder projections, which the fast path calls rather
    than folds: it runs, and gives the plain loop's logits (a forward, a prompt then tokens from its cache,
    generate()) and gradients, which the adapter changes. (On the step's modules any such wrapper is no plain
    module: the plain loop, as for LoRA; docs/fine-tuning.md has the table.)"""
    import peft

    from ..backend_observer import FAST_PATH, PLAIN_PATH, ran

    targets = ["fuse_proj", "decode_proj"] + (["embed_tokens"] if tuner == "oft" else [])
    base = perturbed_model(tiny_config(eos_token_id=None))
    ids = token_ids(2, 6)
    base_logits = logits_of(base, ids)
    adapted = peft.get_peft_model(base, other_tuner_config(tuner, targets)).eval()
    trained = [p for p in adapted.parameters() if p.requires_grad]
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in trained:  # (away from the identity each family starts from)
            parameter.add_(0.3 * torch.randn(parameter.shape, generator=generator))
    inner = adapted.get_base_model().model
    greedy = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)

    def run(path):
        with ran(path, not_ran=tuple({FAST_PATH, PLAIN_PATH} - {path})):
            with torch.no_grad():
                logits = adapted(input_ids=ids).logits
                cache = adapted(input_ids=ids[:, :4], use_cache=True).cache
                steps = [adapted(input_ids=ids[:, t : t + 1], cache=cache, use_cache=True).logits for t in (4, 5)]
                generated = adapted.generate(input_ids=ids, **greedy)
            adapted.zero_grad()
            adapted(input_ids=ids, labels=ids).loss.backward()
        return logits, torch.cat(steps, 1), generated, [p.grad.clone() for p in trained]

    fast = run(FAST_PATH)
    inner.use_fast_path = False
    plain = run(PLAIN_PATH)
    assert (fast[0] - base_logits).abs().max() > 1e-2
    torch.testing.assert_close(fast[0], plain[0])
    torch.testing.assert_close(fast[1], plain[0][:, 4:])
    assert torch.equal(fast[2], plain[2])
    assert all(g.abs().max() > 0 for g in fast[3])
    torch.testing.assert_close(fast[3], plain[3])


def test_peft_alora_adapts_from_its_invocation_or_is_refused():
    """aLoRA adapts the positions from its invocation tokens on, by a mask PEFT applies along each layer's input
    sequence; the step's layers see one position at a time, so the adapter ran at every position (neither aLoRA's
    output nor the base model's, in silence). A call the invocation splits is refused (forward, generate(), a
    prefill run in chunks shorter than the adapted part); the documented way (the state before the invocation without
    the adapter, continued with it) computes what aLoRA means: a plain LoRA of the same weights continuing the base
    model's state."""
    import peft

    base = perturbed_model(tiny_config(eos_token_id=None))
    targets = ["gate", "read_query", "fuse_proj", "decode_proj"]
    torch.manual_seed(1)
    alora = peft.get_peft_model(
        copy.deepcopy(base),
        peft.LoraConfig(
            r=4, target_modules=targets, alora_invocation_tokens=[1, 2], task_type="CAUSAL_LM", init_lora_weights=False
        ),
    ).eval()
    ids = token_ids(2, 8, seed=3).clamp(min=3)
    ids[:, 4:6] = torch.tensor([1, 2])  # the invocation: positions 4 to 7 are adapted
    with torch.no_grad():
        for call in (
            lambda: alora(input_ids=ids),
            lambda: alora.generate(input_ids=ids, max_new_tokens=2, do_sample=False, pad_token_id=0),
        ):
            with pytest.raises(ValueError, match=r"aLoRA .* rows \[0, 1\] .*the last \[4, 4\] of 8 positions"):
                call()
        alora.get_base_model().prefill_chunk_length = 2  # (chunks of 2, each shorter than the 4 adapted positions)
        with pytest.raises(ValueError, match="aLoRA"):
            alora(input_ids=ids, logits_to_keep=1)
        alora.get_base_model().prefill_chunk_length = 2048

    lora = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=4, target_modules=targets)).eval()
    lora.load_state_dict(alora.state_dict())
    greedy = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
    mask = torch.ones(2, 8, dtype=torch.long)
    with torch.no_grad():
        with alora.disable_adapter():
            before = alora(input_ids=ids[:, :4], use_cache=True).cache
        reference = base(input_ids=ids[:, :4], use_cache=True).cache
        states = [before.fork(1) for _ in range(2)] + [reference.fork(1) for _ in range(3)]
        adapted = alora(input_ids=ids[:, 4:], cache=states[0]).logits
        expected = lora(input_ids=ids[:, 4:], cache=states[2]).logits
        unadapted = base(input_ids=ids[:, 4:], cache=states[3]).logits
        generated = alora.generate(input_ids=ids[:, 4:], cache=states[1], attention_mask=mask, **greedy)
        expected_generated = lora.generate(input_ids=ids[:, 4:], cache=states[4], attention_mask=mask, **greedy)
    torch.testing.assert_close(adapted, expected)
    assert (adapted - unadapted).abs().max() > 1e-2
    assert torch.equal(generated, expected_generated)


def test_a_state_computed_under_lora_on_parameters_saves_loads_and_continues(tmp_path):
    """PEFT's `target_parameters` LoRA parametrizes the parameter for each call and removes it after, which moves
    its version and not its values: every state a forward left was refused at save as computed before the weights
    changed. It saves, loads into the adapted model and continues as one run; the base model refuses it."""
    import peft

    from modeling_gpn import GPNCache
    from modeling_gpn.state_file import GPNStateFileError

    torch.manual_seed(1)
    targets = ["model.decode_proj.weight", "model.predict_layers.0.gate.weight"]
    adapted = peft.get_peft_model(
        perturbed_model(tiny_config(eos_token_id=None)),
        peft.LoraConfig(r=4, target_parameters=targets, target_modules=[], init_lora_weights=False),
    ).eval()
    prefix, new = token_ids(2, 5, seed=4), token_ids(2, 2, seed=5)
    with torch.no_grad():
        whole = adapted(input_ids=torch.cat([prefix, new], 1)).logits[:, 5:]
        cache = adapted(input_ids=prefix, use_cache=True).cache
        adapted(input_ids=new[:, :1], cache=cache.fork(1), use_cache=True)  # (another forward before the save)
        cache.save(tmp_path / "state.safetensors")
        continued = adapted(input_ids=new, cache=GPNCache.load(tmp_path / "state.safetensors", adapted)).logits
    torch.testing.assert_close(continued, whole)
    assert (
        whole - logits_of(perturbed_model(tiny_config(eos_token_id=None)), torch.cat([prefix, new], 1))[:, 5:]
    ).abs().max() > 1e-3
    with pytest.raises(GPNStateFileError):
        GPNCache.load(tmp_path / "state.safetensors", perturbed_model(tiny_config(eos_token_id=None)))
    with torch.no_grad():  # (an edit of the parametrized weight itself is still seen, by its values)
        adapted.get_base_model().model.decode_proj.get_base_layer().weight.add_(1.0)
    with pytest.raises(ValueError, match="changed after this state was computed"):
        cache.save(tmp_path / "edited.safetensors")


def test_forward_hooks_run_and_count_on_every_projection_path():
    model = perturbed_model(tiny_config())
    ids = token_ids(2, 7)
    reference = logits_of(model, ids)
    assert model.model.last_recurrence_path == "fast"
    calls = []

    def scale(module, inputs, output):
        calls.append(output.shape)
        return output * 1.5

    # a projection the fast path folds makes it stand aside; the decoder is always called as a module
    for module, path in ((model.model.predict_layers[0].ffn_out, "plain"), (model.model.decode_proj, "fast")):
        handle = module.register_forward_hook(scale)
        hooked = logits_of(model, ids)
        assert calls and (hooked - reference).abs().max() > 1e-3
        assert model.model.last_recurrence_path == path
        handle.remove()
        calls.clear()
    torch.testing.assert_close(logits_of(model, ids), reference)
    assert model.model.last_recurrence_path == "fast"

    # A hook registered for every module, a pre-hook, and a replaced module also turn the fast path off
    handle = torch.nn.modules.module.register_module_forward_hook(lambda module, inputs, output: None)
    try:
        torch.testing.assert_close(logits_of(model, ids), reference)
        assert model.model.last_recurrence_path == "plain" and "global" in model.model.fast_path_blocker()
    finally:
        handle.remove()
    handle = model.model.fuse_gate.register_forward_pre_hook(lambda module, inputs: (inputs[0] * 0,))
    assert (logits_of(model, ids) - reference).abs().max() > 1e-3
    handle.remove()

    # A parametrization (the weight computed by a module) and a tensor-subclass weight are not folded either
    from torch.nn.utils import parametrize

    class Doubled(nn.Module):
        def forward(self, weight):
            return 2 * weight

    parametrize.register_parametrization(model.model.fuse_gate, "weight", Doubled())
    assert (logits_of(model, ids) - reference).abs().max() > 1e-3 and model.model.last_recurrence_path == "plain"
    parametrize.remove_parametrizations(model.model.fuse_gate, "weight", leave_parametrized=False)
    torch.testing.assert_close(logits_of(model, ids), reference)
    assert model.model.last_recurrence_path == "fast"

    class MarkedTensor(torch.Tensor):
        pass

    gate = model.model.predict_layers[0].gate
    plain_weight = gate.weight
    gate.weight = nn.Parameter(plain_weight.detach().as_subclass(MarkedTensor))
    torch.testing.assert_close(logits_of(model, ids), reference)
    assert "MarkedTensor" in model.model.fast_path_blocker() and model.model.last_recurrence_path == "plain"
    gate.weight = plain_weight

    class DoubledLinear(nn.Linear):  # a subclass (as quantization libraries swap in) is not folded
        def forward(self, x):
            return 2 * super().forward(x)

    layer = model.model.predict_layers[0].ffn_in
    doubled = DoubledLinear(layer.in_features, layer.out_features, bias=False)
    doubled.load_state_dict(layer.state_dict())
    model.model.predict_layers[0].ffn_in = doubled
    replaced = logits_of(model, ids)
    assert "DoubledLinear" in model.model.fast_path_blocker()
    assert model.model.last_recurrence_path == "plain" and (replaced - reference).abs().max() > 1e-3


def test_classic_dynamic_quantization_runs_the_plain_path_and_its_quantized_embedding_is_refused():
    """`torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)` swaps every Linear for its own
    class (packed int8 weights behind a `weight()` method): the fast path names it and the plain loop calls the modules,
    within the quantization's error of the float model (not its float weights), and generate() runs. Quantizing the
    embedding that way leaves no table for the tied output: one clear error (it failed reading `.dtype` of a method)."""
    model = perturbed_model(tiny_config(), seed=3)
    ids = torch.randint(1, 97, (2, 6), generator=torch.Generator().manual_seed(4))
    reference = logits_of(model, ids)
    quantized = torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)  # (a copy)
    assert "torch.ao.nn.quantized.dynamic" in quantized.model.fast_path_blocker()
    error = (logits_of(quantized, ids) - reference).abs().max()
    assert quantized.model.last_recurrence_path == "plain" and 1e-4 < error < 0.1, error
    assert quantized.generate(ids[:1], max_new_tokens=2, do_sample=False).shape == (1, 8)
    qconfig = {nn.Embedding: torch.ao.quantization.float_qparams_weight_only_qconfig}
    embedding_quantized = torch.ao.quantization.quantize_dynamic(model, qconfig, dtype=torch.quint8)
    with pytest.raises(TypeError, match=r"^model\.embed_tokens is a torch\.ao\.nn\.quantized\.[\w.]*Embedding without"):
        logits_of(embedding_quantized, ids)


# --------------------------------------------------------------------------------------------------
# 3. Gradient checkpointing
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["fast", "plain"])
def test_gradient_checkpointing_recomputes_segments_with_the_same_gradients(path):
    ids = token_ids(2, 11)
    model = perturbed_model(tiny_config()).train()
    model.model.use_fast_path = path == "fast"

    def gradients():
        model.zero_grad()
        model(ids, labels=ids).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    steps = []
    counter = (
        model.model.predict_layers[0].register_forward_hook(lambda *args: steps.append(1)) if path == "plain" else None
    )
    plain_grads = gradients()
    runs_without = len(steps)

    assert model.config.bptt_segment_length is None
    model.gradient_checkpointing_enable()
    assert model.is_activation_checkpointing and model.config.bptt_segment_length == 64
    model.config.bptt_segment_length = 4  # short segments, so the 11 tokens span three of them
    steps.clear()
    checkpointed_grads = gradients()
    assert recurrence_path(model) == path
    if path == "plain":  # steps ran again in the backward pass (the checkpoint stops early once it has all it needs)
        assert runs_without == 11 and 11 + 6 <= len(steps) <= 22, len(steps)
        counter.remove()
    for name, grad in plain_grads.items():
        torch.testing.assert_close(checkpointed_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)

    model.config.bptt_segment_length = None
    model.gradient_checkpointing_enable()
    model.gradient_checkpointing_disable()
    assert not model.is_activation_checkpointing and model.config.bptt_segment_length is None


def test_the_segment_length_checkpointing_sets_is_not_saved_with_the_model(tmp_path):
    """Enabling checkpointing sets `bptt_segment_length` (64) where the config had none; a model saved with it on
    (as a Trainer saves its checkpoints) wrote 64 to config.json, so every later load trained in segments and
    `gradient_checkpointing_disable()` no longer put None back."""
    model = perturbed_model(tiny_config()).train()
    model.gradient_checkpointing_enable()
    model.save_pretrained(tmp_path / "model")
    assert json.loads((tmp_path / "model" / "config.json").read_text())["bptt_segment_length"] is None
    assert model.config.bptt_segment_length == 64 and model.is_activation_checkpointing  # still on in this run
    loaded = type(model).from_pretrained(tmp_path / "model")
    assert loaded.config.bptt_segment_length is None
    # a segment length the model was given is the model's, and is saved
    given = perturbed_model(tiny_config(bptt_segment_length=5))
    given.gradient_checkpointing_enable()
    given.save_pretrained(tmp_path / "given")
    assert json.loads((tmp_path / "given" / "config.json").read_text())["bptt_segment_length"] == 5


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpointing_runs_every_bptt_segment_through_the_gradient_checkpointing_layer(use_reentrant):
    """transformers' mechanism, for real: `activation_checkpointing_enable` sets the flag and the checkpoint
    function on a `GradientCheckpointingLayer`, the plain loop calls it once per BPTT segment, and the
    function it installed runs every segment (twice: forward and the backward's recomputation), with the
    gradients of the run without checkpointing. A checkpoint function of one's own is honoured the same way
    (the plain path runs it); torch's own is replaced on the fast path by its native recomputation."""
    from torch.utils.checkpoint import checkpoint
    from transformers.modeling_layers import GradientCheckpointingLayer

    ids = token_ids(2, 11)
    model = perturbed_model(tiny_config(bptt_segment_length=4)).train()  # 11 tokens: segments of 4, 4 and 3
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    assert len(layers) == 1 and not model.is_activation_checkpointing

    def gradients():
        model.zero_grad()
        model(ids, labels=ids).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    reference = gradients()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": use_reentrant})
    layer = layers[0]
    assert model.is_activation_checkpointing and layer.gradient_checkpointing

    # torch's checkpoint: the fast path runs, recomputing the same segments natively
    natively = gradients()
    assert recurrence_path(model) == "fast"
    for name, grad in reference.items():
        torch.testing.assert_close(natively[name], grad, rtol=1e-5, atol=1e-6, msg=name)

    segment_runs = []

    def own_checkpoint(function, *args):  # a checkpoint function of one's own (as offload=True installs)
        def counted(*inner):
            segment_runs.append(inner[0].shape[1])
            return function(*inner)

        return checkpoint(counted, *args, use_reentrant=use_reentrant)

    layer._gradient_checkpointing_func = own_checkpoint
    checkpointed = gradients()
    assert recurrence_path(model) == "plain"
    assert segment_runs.count(4) == 4 and segment_runs.count(3) == 2, segment_runs  # each segment twice
    for name, grad in reference.items():
        torch.testing.assert_close(checkpointed[name], grad, rtol=1e-5, atol=1e-6, msg=name)

    model.activation_checkpointing_disable()
    assert not model.is_activation_checkpointing and not layer.gradient_checkpointing
    segment_runs.clear()
    gradients()
    assert segment_runs == [] and recurrence_path(model) == "fast"


# --------------------------------------------------------------------------------------------------
# Trainer
# --------------------------------------------------------------------------------------------------


def test_trainer_with_accumulation_and_checkpointing_trains_evaluates_with_the_token_mean_loss(tmp_path):
    from transformers import Trainer, TrainerCallback, TrainingArguments

    ids = token_ids(4, 10, seed=5)
    labels = ragged_labels(ids)
    rows = [{"input_ids": i, "attention_mask": torch.ones_like(i), "labels": target} for i, target in zip(ids, labels)]
    config = tiny_config(bptt_segment_length=3)  # checkpointing recomputes 3-token segments

    reference = perturbed_model(config).train()
    expected_loss = token_mean_loss(reference(ids).logits, labels)
    expected_loss.backward()
    expected_grads = {n: p.grad.clone() for n, p in reference.named_parameters()}

    class GradientsBeforeTheStep(TrainerCallback):
        grads = None

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            if self.grads is None:
                self.grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    recorder = GradientsBeforeTheStep()
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        per_device_eval_batch_size=4,
        max_steps=3,
        learning_rate=3e-3,
        max_grad_norm=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        gradient_checkpointing=True,
        dataloader_num_workers=0,
        seed=0,
    )
    model = perturbed_model(config).train()
    trainer = Trainer(model=model, args=args, train_dataset=rows, eval_dataset=rows, callbacks=[recorder])
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    after = trainer.evaluate()["eval_loss"]

    assert model.is_activation_checkpointing
    # the first optimizer step saw all four rows (2 x 2): its loss and gradients are the token mean's
    first_logged = next(entry["loss"] for entry in trainer.state.log_history if "loss" in entry)
    assert first_logged == pytest.approx(expected_loss.item(), abs=2e-4)
    assert before == pytest.approx(expected_loss.item(), rel=1e-5)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(recorder.grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    assert after < before - 1e-3


def trainer_arguments(output_dir, **overrides):
    from transformers import TrainingArguments

    values = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=2,
        per_device_eval_batch_size=4,
        learning_rate=3e-3,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    return TrainingArguments(**(values | overrides))


def test_trainer_label_smoothing_targets_the_next_token(tmp_path):
    """With `label_smoothing_factor`, the Trainer pops the labels and smooths the loss itself, shifting them only
    for the models transformers lists as causal LMs; unlisted, a GPN was scored (and trained) on the token it
    reads, not the next one."""
    from transformers import Trainer

    ids = token_ids(4, 10, seed=5)
    labels = ragged_labels(ids)
    rows = [{"input_ids": i, "attention_mask": torch.ones_like(i), "labels": target} for i, target in zip(ids, labels)]
    model = perturbed_model(tiny_config())
    trainer = Trainer(model=model, args=trainer_arguments(tmp_path, label_smoothing_factor=0.1), eval_dataset=rows)
    logits = logits_of(model, ids)
    next_token = F.cross_entropy(
        logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=-100, label_smoothing=0.1
    )
    assert trainer.evaluate()["eval_loss"] == pytest.approx(next_token.item(), rel=1e-5)


def test_trainer_neftune_noise_reaches_the_fast_paths_recurrence(tmp_path):
    """`neftune_noise_alpha`: the Trainer hooks the input embedding (noise in training mode). The fast path calls
    the embedding module, so the recurrence reads the noised vectors: the step's loss is the plain loop's on them,
    not the loss of the clean embeddings."""
    from transformers import Trainer, TrainerCallback

    ids = token_ids(2, 10, seed=5)
    labels = ragged_labels(ids)
    rows = [{"input_ids": i, "attention_mask": torch.ones_like(i), "labels": target} for i, target in zip(ids, labels)]
    model = perturbed_model(tiny_config()).train()
    reference = copy.deepcopy(model)
    reference.model.use_fast_path = False
    seen = {}

    def first_call(module, args, kwargs, output):
        seen.setdefault("call", (kwargs["input_ids"], kwargs["labels"], output.loss.detach()))

    class FirstStep(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):  # (after the Trainer's NEFTune hook)
            seen["hooks"] = len(model.model.embed_tokens._forward_hooks)
            model.model.embed_tokens.register_forward_hook(lambda module, i, out: seen.setdefault("embeddings", out))
            model.register_forward_hook(first_call, with_kwargs=True)

    arguments = trainer_arguments(tmp_path, neftune_noise_alpha=20.0, max_steps=1, save_strategy="no")
    Trainer(model=model, args=arguments, train_dataset=rows, callbacks=[FirstStep()]).train()

    assert seen["hooks"] == 1 and model.model.last_recurrence_path == "fast"
    batch_ids, batch_labels, loss = seen["call"]
    noised = seen["embeddings"].detach()
    magnitude = 20.0 / (10 * noised.shape[-1]) ** 0.5  # NEFTune's: alpha / sqrt(length x width)
    noise = noised - reference.model.embed_tokens(batch_ids)
    assert 0.5 * magnitude < noise.abs().max() <= magnitude + 1e-6  # (+ the rounding of the sum)
    with torch.no_grad():
        expected = reference(inputs_embeds=noised, labels=batch_labels).loss
        clean = reference(input_ids=batch_ids, labels=batch_labels).loss
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6)
    assert abs(loss.item() - clean.item()) > 1e-3


def test_a_no_grad_pass_in_training_mode_with_neftune_is_not_read_in_chunks():
    """A long no-grad forward reads its positions in chunks (prefill.py), each calling the embedding. In training
    mode (a trainer's scoring pass: TRL's old log-probabilities) NEFTune's hook would then scale its noise by the
    chunk's length, not the input's: such a pass runs in one call of the embedding."""
    from transformers.integrations.neftune import activate_neftune

    ids = token_ids(2, 12, seed=5)
    model = perturbed_model(tiny_config()).train()
    model.prefill_chunk_length = 4
    activate_neftune(model, 5.0)
    calls = []
    model.model.embed_tokens.register_forward_hook(lambda module, i, out: calls.append(out.detach()))
    with torch.no_grad():
        model(ids, logits_to_keep=1)
    noise = torch.cat(calls, dim=1) - model.model.embed_tokens.weight[ids]
    assert len(calls) == 1
    # within the bound of one call over 12 positions (+ the rounding of the sum), not of a call over 4 (1.7x it)
    assert noise.abs().max() <= 5.0 / (12 * noise.shape[-1]) ** 0.5 + 1e-6
    with torch.no_grad():  # at inference the chunks stay (the hook is no noise there)
        model.eval()(ids, logits_to_keep=1)
    assert len(calls) == 1 + 3


def test_trainer_weight_decay_reaches_a_log_unless_exempted_as_gpn_train_does(tmp_path):
    """Trainer exempts from `weight_decay` only parameters named like biases and norms: `dt_bias` is, `A_log` (the
    memory's decay rate, 1-D) is not, so it is pulled towards 0 (a retention of exp(-softplus(.)) per step) where
    `gpn train` never decays it. The override docs/transformers.md gives leaves exactly the matrices decayed."""
    from transformers import Trainer

    from modeling_gpn.train import NO_DECAY_NAMES

    class GPNTrainer(Trainer):  # the override of docs/transformers.md
        def get_decay_parameter_names(self, model):
            names = super().get_decay_parameter_names(model)
            return [name for name in names if name.split(".")[-1] not in NO_DECAY_NAMES]

    model = perturbed_model(tiny_config())
    arguments = trainer_arguments(tmp_path, weight_decay=0.1)
    assert "model.memory_write.A_log" in Trainer(model=model, args=arguments).get_decay_parameter_names(model)
    optimizer = GPNTrainer(model=model, args=arguments).create_optimizer()
    names = {id(param): name for name, param in model.named_parameters()}
    decayed = {
        names[id(param)] for group in optimizer.param_groups if group["weight_decay"] for param in group["params"]
    }
    assert decayed == {name for name, param in model.named_parameters() if param.dim() == 2}
    assert sum(len(group["params"]) for group in optimizer.param_groups) == len(names)  # the tied head once


def test_trainer_resumes_without_warning_of_the_tied_head(tmp_path):
    """A checkpoint leaves out `lm_head.weight` (it is the embedding); resuming from it re-ties the head, and the
    Trainer says nothing about "missing keys", which would read as a lost output layer."""
    import logging

    from transformers import Trainer

    ids = token_ids(4, 10, seed=5)
    rows = [{"input_ids": i, "attention_mask": torch.ones_like(i), "labels": i} for i in ids]
    arguments = dict(max_steps=2, save_strategy="steps", save_steps=1)
    Trainer(
        model=perturbed_model(tiny_config()).train(), args=trainer_arguments(tmp_path, **arguments), train_dataset=rows
    ).train()
    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logger = logging.getLogger("transformers.trainer")
    logger.addHandler(handler)
    try:
        resumed = Trainer(
            model=perturbed_model(tiny_config(), seed=1).train(),
            args=trainer_arguments(tmp_path, **arguments | {"max_steps": 3}),
            train_dataset=rows,
        )
        resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))
    finally:
        logger.removeHandler(handler)
    assert not [message for message in warnings if "missing keys" in message], warnings
    assert resumed.model.lm_head.weight is resumed.model.model.embed_tokens.weight


def test_accelerates_default_fsdp2_wrap_policy_shards_every_gpn_class_as_one_unit():
    """`accelerate config`'s FSDP2 default, `TRANSFORMER_BASED_WRAP` without class names, wraps the classes the
    prepared model's `_no_split_modules` names (transformers 5 gathers a head's from its submodels; a PEFT model
    reads its base model's): for every GPN class, PEFT-wrapped too, none below the model, which is sharded as one
    unit. It named GPNModel: Accelerate 1.16 sharded the embedding inside it again and failed in fully_shard (a
    launch: tests/tools/test_sft_fsdp.py). (device_map="auto" reads the same set: over several devices it may
    place blocks apart, docs/transformers.md.)"""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy

    from modeling_gpn import GPNForCausalLM, GPNForSequenceClassification, GPNModel

    config = tiny_config(pad_token_id=0)
    models = [GPNForCausalLM(config), GPNForSequenceClassification(config), GPNModel(config)]
    models.append(lora_model(GPNForCausalLM(config), targets=["embed_tokens", "decode_proj"]))
    for model in models:
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap")
        policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
        assert [name for name, module in model.named_modules() if name and policy(module)] == [], type(model)


def cast_inputs_as_fsdp2_mixed_precision(block: nn.Module, dtype: torch.dtype = torch.bfloat16):
    """What FSDP2's `MixedPrecisionPolicy(param_dtype=dtype)` does at each call of a unit it sharded apart while
    `cast_forward_inputs` is True (its default): every floating input cast to `dtype` before the forward runs."""

    def cast(module, args, kwargs):
        recast = [a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
        return tuple(recast), kwargs

    return block.register_forward_pre_hook(cast, with_kwargs=True)


@pytest.mark.parametrize("use_memory", [True, False])
def test_a_state_fsdp2_mixed_precision_casts_into_a_block_is_refused_naming_the_fix(use_memory):
    """A Trainer / Accelerate user who shards the blocks apart under FSDP2 in bf16 (`GPNPredictLayer,GPNMemoryWrite`
    as the classes to wrap) gets the float32 recurrent state and memory cast to bf16 at the entry of every block's
    call: with the memory the write failed deep inside ("expected scalar type Float but found BFloat16"); without
    it, the state was rounded to bf16 at every token in silence. Refused in one line naming the cast and its fix
    (`gpn train` sets it: tests/tools/test_train.py). A model whose weights are bf16 keeps its float32 state."""
    model = perturbed_model(tiny_config(use_memory=use_memory), seed=3).to(torch.bfloat16)
    model.model.use_fast_path = False  # (the path that calls the blocks, as FSDP2's hooks on them make it run)
    ids = token_ids(2, 5)
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()  # bf16 weights, the state in float32: not refused
        blocks = [model.model.memory_write] if use_memory else []
        for block in [*blocks, *model.model.predict_layers]:
            cast_inputs_as_fsdp2_mixed_precision(block)
        first = "GPNMemoryWrite got the recurrent memory" if use_memory else "GPNPredictLayer got the recurrent state"
        fix = r"MixedPrecisionPolicy\(cast_forward_inputs=False\)"
        with pytest.raises(
            TypeError, match=rf"^{first} in torch.bfloat16, not float32 .*FSDP2's mixed precision.*{fix}"
        ):
            model(ids)


# --------------------------------------------------------------------------------------------------
# 4. torch.export and torch.compile
# --------------------------------------------------------------------------------------------------


def export_inputs():
    ids = token_ids(2, 4)
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    return ids, mask


def test_torch_export_and_its_onnx_export_match_eager_and_return_the_cache():
    """The exported forward, and torch.onnx.export (dynamo) of it run by onnx's reference evaluator, give the eager
    logits and state. ONNX's graph optimizer (onnxscript 0.7) drops an Add of a scalar within 1e-8 of zero as `x + 0`,
    the L2 normalisation's 1e-12 with it: a head whose relu'd keys are all zero (head 0 here) gave NaN after it."""
    from onnx.reference import ReferenceEvaluator

    model = perturbed_model(tiny_config(num_predict_layers=1))
    with torch.no_grad():
        model.model.memory_write.key.bias[: model.config.memory_key_dim] -= 100.0
    ids, mask = export_inputs()
    with torch.no_grad():
        eager = model(ids, attention_mask=mask, use_cache=True)
    program = torch.export.export(model, (ids,), {"attention_mask": mask, "use_cache": True})
    exported = program.module()(ids, attention_mask=mask, use_cache=True)
    torch.testing.assert_close(exported.logits, eager.logits, rtol=1e-5, atol=1e-5)
    assert exported.cache.get_seq_length() == 4
    for got, want in zip(exported.cache.get_state(), eager.cache.get_state()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    other_ids = token_ids(2, 4, seed=9)  # a graph, not a recording of one input
    torch.testing.assert_close(
        program.module()(other_ids, attention_mask=mask, use_cache=True).logits,
        logits_of(model, other_ids, attention_mask=mask),
        rtol=1e-5,
        atol=1e-5,
    )
    onnx_model = torch.onnx.export(program, verbose=False).model_proto
    got = ReferenceEvaluator(onnx_model).run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})
    for got_tensor, want in zip(got[:4], [eager.logits, *eager.cache.get_state()], strict=True):
        torch.testing.assert_close(torch.from_numpy(got_tensor), want, rtol=1e-5, atol=1e-5)


class ExportedPrefill(nn.Module):
    """generate()'s prefill as a program: token ids in, logits and a new `GPNCache` out."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        out = self.model(ids, use_cache=True)
        return out.logits, out.cache


class ExportedDecode(ExportedPrefill):
    """generate()'s decode step as a program: it takes a `GPNCache` and returns the updated one."""

    def forward(self, ids, cache):
        out = self.model(ids, cache=cache, use_cache=True)
        return out.logits, out.cache


def save_and_load(program):
    import io

    # Without the example inputs: torch.load refuses the pickled GPNCache among them with weights_only=True and
    # torch logs its fallback with a broken format string (torch 2.13), an error under pytest's log capture.
    program.example_inputs = None
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    buffer.seek(0)
    return torch.export.load(buffer)


@pytest.fixture(scope="module")
def exported_programs():
    """A tiny model, and its prefill and decode programs exported with dynamic shapes (gradients enabled, as
    torch.export traces by default), saved and loaded."""
    model = perturbed_model(tiny_config(num_predict_layers=1))
    auto = torch.export.Dim.AUTO
    prompt = token_ids(2, 5)
    prefill = save_and_load(
        torch.export.export(ExportedPrefill(model), (prompt,), dynamic_shapes=({0: auto, 1: auto},))
    )
    cache = model(prompt, use_cache=True).cache
    decode_shapes = ({0: auto, 1: auto}, [{0: auto}, {0: auto}, {0: auto}, None])
    decode = save_and_load(
        torch.export.export(ExportedDecode(model), (prompt[:, :1], cache), dynamic_shapes=decode_shapes)
    )
    return model, prefill, decode


def test_torch_export_save_load_round_trips_dynamic_programs_that_take_and_return_the_cache(exported_programs):
    """The cache's pytree context is static (the positions read are a tensor child): a program exported with
    dynamic shapes saves (a count in the context was a SymInt: "Object of type SymInt is not JSON
    serializable"), and takes caches that have read any number of positions (a count in the context was a
    constant the input had to match). The decode program returns the advanced cache and leaves the one it was
    given as it was: it had written the new state into the given cache's buffers (not its count), shared with
    the returned cache, and failed on a cache of inference tensors ("Inplace update to inference tensor").
    Exported at 2 rows, both take 17: the few-row kernels' row limit (16), compared on the symbolic batch, made
    the programs guard on it ("Guard failed: ids.size()[0] <= 16")."""
    model, prefill, decode = exported_programs
    other_prompt = token_ids(17, 5, seed=2)  # another batch size, past the few-row kernels' limit
    with torch.inference_mode():  # (a cache of inference tensors, which torch lets nothing write in place outside)
        logits, exported_cache = prefill.module()(other_prompt)
    prefilled = exported_cache
    with torch.no_grad():
        eager = model(other_prompt, use_cache=True)
    torch.testing.assert_close(logits, eager.logits, rtol=1e-5, atol=1e-5)
    assert exported_cache.get_seq_length() == 5
    eager_cache = eager.cache
    for step in range(3):  # the decode program continues from caches that have read 5, 6 and 7 positions
        token = token_ids(17, 1, seed=10 + step)
        given = exported_cache.get_state()
        logits, advanced = decode.module()(token, exported_cache)
        assert exported_cache.get_seq_length() == 5 + step
        for got, want in zip(exported_cache.get_state(), given):
            assert torch.equal(got, want)
        exported_cache = advanced
        with torch.no_grad():
            eager = model(token, cache=eager_cache, use_cache=True)
        torch.testing.assert_close(logits, eager.logits, rtol=1e-5, atol=1e-5)
        assert exported_cache.get_seq_length() == eager_cache.get_seq_length() == 6 + step
        for got, want in zip(exported_cache.get_state(), eager_cache.get_state()):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the prefill's cache, still the prompt's, continues eagerly (its count is an inference tensor there)
    token = token_ids(17, 1, seed=10)
    with torch.no_grad():
        continued = model(token, cache=prefilled, use_cache=True)
        whole = model(torch.cat([other_prompt, token], 1)).logits[:, -1:]
    torch.testing.assert_close(continued.logits, whole, rtol=1e-5, atol=1e-5)
    assert continued.cache.get_seq_length() == 6
    # and a prefill of few rows through the one-call decode (up to 16 rows), which counts its positions too
    with torch.inference_mode():
        _, few_rows = prefill.module()(other_prompt[:3])
    with torch.no_grad():
        continued = model(token[:3], cache=few_rows, use_cache=True)
    torch.testing.assert_close(continued.logits, whole[:3], rtol=1e-5, atol=1e-5)
    assert continued.cache.get_seq_length() == 6


def test_exported_programs_run_with_gradients_carry_them_from_the_prefill_into_the_decode(exported_programs):
    """Run with gradients, the prefill program's cache enters the decode program with its graph (a program traced
    with gradients enabled stores the state with it, docs/cache.md): the gradients of a loss on both programs'
    logits are those of one eager forward over the prompt and the token, for every weight (each program's module
    holds its own copy of the weights: their gradients add up), the prefill's including what the decode's logits
    reach through the carried state. The cache a program returns says it carries a graph (it said not: rebuilt
    from its tensors, and `copy.deepcopy` of it failed inside torch)."""
    model, prefill, decode = exported_programs
    prompt, token = token_ids(2, 5, seed=3), token_ids(2, 1, seed=4)
    weights = torch.randn(2, 6, model.config.vocab_size, generator=torch.Generator().manual_seed(5))
    programs = prefill.module(), decode.module()
    logits, cache = programs[0](prompt)
    assert cache.carries_graph and all(state.requires_grad for state in cache.get_state())
    step_logits, advanced = programs[1](token, cache)
    assert advanced.get_seq_length() == 6
    (torch.cat([logits, step_logits], dim=1) * weights).sum().backward()
    model.zero_grad(set_to_none=True)
    (model(torch.cat([prompt, token], dim=1)).logits * weights).sum().backward()
    parts = [dict(program.named_parameters()) for program in programs]
    tied = model.lm_head.weight is model.model.embed_tokens.weight  # (a program's module reads it as the head's)
    for name, param in model.named_parameters():
        names = [f"model.{name}"] + (["model.lm_head.weight"] if tied and name == "model.embed_tokens.weight" else [])
        got = sum(part[each].grad for part in parts for each in names if part[each].grad is not None)
        torch.testing.assert_close(got, param.grad, rtol=1e-4, atol=5e-5, msg=name)  # (sums of tens of terms)


def test_transformers_executorch_exporter_and_torchscript_are_refused_by_name():
    """transformers' ExecuTorch exporter builds an attention StaticCache for the model. Given a GPN (with the static
    cache its own error asks for), it failed deep inside transformers with "'GPNConfig' object has no attribute
    'num_attention_heads'"; the config now says why. getattr with a default and hasattr answer as before.
    torch.jit.script of a GPN, or of a module holding one, failed on "Unknown type annotation: 'str | None'"."""
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    model = perturbed_model(tiny_config())
    model.generation_config.cache_implementation = "static"
    with pytest.raises(AttributeError, match="a GPN has no attention layers.*ExecuTorch exporters"):
        TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=8)
    assert getattr(model.config, "num_attention_heads", None) is None and not hasattr(model.config, "head_dim")
    with pytest.raises(AttributeError, match="'GPNConfig' object has no attribute 'no_such_field'"):
        model.config.no_such_field  # noqa: B018 (any other missing attribute: Python's own message)
    for scripted in (model, ExportedPrefill(model)):
        with pytest.raises(TypeError, match="torch.jit.script cannot compile a GPNForCausalLM: .*torch.export.export"):
            torch.jit.script(scripted)


@pytest.mark.slow
def test_torch_compile_fullgraph_matches_eager():
    """Dynamo captures the whole forward (and the backward through AOT autograd); the aot_eager backend
    runs the captured graph without generating C++, which the inductor test below adds.

    Trained over chunks that carry a cache, compiled calls keep the state with its graph, as eager ones do: a
    compiled chunk, an eager one continuing its cache, and a compiled one continuing the eager one's give the
    gradients of one eager forward over the whole sequence. (Compiled, the state was stored in place and detached:
    the gradients stopped at each compiled call, and the next call's write broke the backward.)"""
    model = perturbed_model(tiny_config(num_predict_layers=1))
    ids, mask = export_inputs()
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        got = compiled(ids, attention_mask=mask)
        want = model(ids, attention_mask=mask)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)
    for a, b in zip(got.cache.get_state(), want.cache.get_state()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # training through the compiled graph, in chunks carrying the cache (full BPTT across calls): the same loss and
    # gradients as one eager forward over the whole sequence
    model.train()
    ids = token_ids(2, 9)
    targets = torch.cat([ids[:, 1:], ids.new_full((2, 1), -100)], dim=1)  # (a chunk's last target: the next's first)
    cache, loss = None, 0
    for call, chunk in zip((compiled, model, compiled), range(0, 9, 3)):
        part = slice(chunk, chunk + 3)
        out = call(ids[:, part], shift_labels=targets[:, part], num_items_in_batch=16, cache=cache, use_cache=True)
        cache, loss = out.cache, loss + out.loss
        assert cache.carries_graph and all(state.requires_grad for state in cache.get_state())
    loss.backward()
    compiled_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    eager_loss = model(ids, labels=ids).loss
    eager_loss.backward()
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)
    for name, param in model.named_parameters():
        torch.testing.assert_close(compiled_grads[name], param.grad, rtol=1e-4, atol=1e-6, msg=name)
    # a compiled call's graph spent, freed by the backward or its weights updated in place (as an optimizer step
    # does): an eager call continuing its cache is refused by name, the compiled program's node asked
    with pytest.raises(RuntimeError, match=r"a backward\(\) has already run through that graph.*cache\.detach\(\)"):
        model(ids[:, :3], cache=cache, use_cache=True)
    out = compiled(ids[:, :3], shift_labels=targets[:, :3], num_items_in_batch=16, cache=None, use_cache=True)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0)
    with pytest.raises(RuntimeError, match=r"an optimizer step .* changed the weights.*cache\.detach\(\)"):
        model(ids[:, 3:6], cache=out.cache, use_cache=True)


@pytest.mark.slow
def test_torch_compile_fullgraph_inductor_matches_eager():
    """The default backend (generated C++): slower to compile, so a 1x3 input."""
    model = perturbed_model(tiny_config(num_predict_layers=1))
    ids = token_ids(1, 3)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids, use_cache=False).logits, logits_of(model, ids), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------------
# device_map offloading (accelerate)
# --------------------------------------------------------------------------------------------------


def test_a_model_offloaded_to_disk_by_device_map_runs_and_generates(tmp_path):
    """`from_pretrained(device_map="auto", max_memory=...)` offloads the weights (accelerate's hooks load each
    module's weights when it is called): the head's weight is meta until then, and the forward refused it as a
    head left untied ("call `model.tie_weights()`", which cannot help). Offloaded or split over several places
    (`_no_split_modules` keeps nothing whole), the model runs right and the user is told it is slow there."""
    from transformers import AutoModelForCausalLM
    from transformers.testing_utils import CaptureLogger

    from modeling_gpn.modeling_gpn import logger

    model = perturbed_model(tiny_config())
    model.save_pretrained(tmp_path / "model")
    with CaptureLogger(logger) as said:
        offloaded = AutoModelForCausalLM.from_pretrained(
            tmp_path / "model", device_map="auto", max_memory={"cpu": "20KB"}, offload_folder=str(tmp_path / "offload")
        )
    assert offloaded.hf_device_map == {"": "disk"} and offloaded.lm_head.weight.is_meta
    # a GPN runs every block at each token: offloaded or split, it is told (on one device it is not)
    assert "device_map placed this GPN on disk: its recurrence runs every block at each token" in said.out
    with CaptureLogger(logger) as said:
        split, info = AutoModelForCausalLM.from_pretrained(
            tmp_path / "model",
            device_map="auto",
            max_memory={"cpu": "80KB"},  # (a predict layer's modules land on both)
            offload_folder=str(tmp_path / "split"),
            output_loading_info=True,
        )
    assert {"cpu", "disk"} == set(split.hf_device_map.values()) and not info["missing_keys"]
    assert "device_map placed this GPN on cpu, disk:" in said.out
    with CaptureLogger(logger) as said:
        AutoModelForCausalLM.from_pretrained(tmp_path / "model", device_map="cpu")
    assert "device_map placed" not in said.out
    ids = token_ids(2, 9)
    with torch.no_grad():
        torch.testing.assert_close(offloaded(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(split(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(
        offloaded.generate(ids, max_new_tokens=5, do_sample=False),
        model.generate(ids, max_new_tokens=5, do_sample=False),
    )


# --------------------------------------------------------------------------------------------------
# 5. Remote code for every auto class
# --------------------------------------------------------------------------------------------------


REMOTE_CODE_TEST = "test_saved_folder_loads_every_auto_class_through_remote_code_without_the_package"


def _remote_code_process(tmp_path: Path) -> tuple[dict, Callable[[], subprocess.CompletedProcess]]:
    """A saved tiny GPN and its hidden states here: (what the test compares, the job that loads the folder through
    every auto class in a fresh process without the package and writes its hidden states)."""
    model = perturbed_model(tiny_config())
    folder = tmp_path / "saved"
    model.save_pretrained(folder)
    ids = token_ids(1, 6)
    with torch.no_grad():
        hidden = model.model(ids).last_hidden_state
    out = tmp_path / "hidden.pt"
    code = BLOCK_PACKAGE + textwrap.dedent(
        f"""
        import torch
        from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification

        torch.set_num_threads(1)
        folder = {str(folder)!r}
        config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
        assert type(config).__name__ == "GPNConfig", type(config)
        base = AutoModel.from_pretrained(folder, trust_remote_code=True).eval()
        assert type(base).__name__ == "GPNModel" and type(base).__module__.startswith("transformers_modules")
        lm = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
        assert type(lm).__name__ == "GPNForCausalLM"
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        assert MODEL_FOR_CAUSAL_LM_MAPPING_NAMES["gpn"] == "GPNForCausalLM"  # the Trainer's label smoothing shifts
        scorer, info = AutoModelForSequenceClassification.from_pretrained(
            folder, trust_remote_code=True, num_labels=1, output_loading_info=True
        )
        assert type(scorer).__name__ == "GPNForSequenceClassification" and scorer.score.out_features == 1
        # the causal LM's weights kept, the score head new (transformers' load report names it, and nothing else)
        assert info["missing_keys"] == {{"score.weight"}} and not info["unexpected_keys"], info
        leaked = [n for n in sys.modules if n == "modeling_gpn" or n.startswith("modeling_gpn.")]
        assert not leaked, leaked
        with torch.no_grad():
            ids = torch.tensor({ids.tolist()!r})
            torch.save((base(ids).last_hidden_state, scorer.model.eval()(ids).last_hidden_state), {str(out)!r})
        """
    )
    return dict(folder=folder, hidden=hidden, out=out), lambda: run_python(code, tmp_path)


@pytest.fixture(scope="module", autouse=True)
def remote_code_process(request, tmp_path_factory) -> Iterator[tuple[dict, Future] | None]:
    """The fresh process of `REMOTE_CODE_TEST` (the module's last test, which needs nothing of those before it),
    started in the background at the module's first test where that test is selected, beside the module's
    in-process tests (`subprocesses.one_started_in_the_background`: the suite's time on 2 cores); its folder and the hidden
    states it is compared with made here, in the test process: (those, the future of the finished process)."""
    folder = tmp_path_factory.mktemp
    with one_started_in_the_background(
        request, REMOTE_CODE_TEST, lambda: _remote_code_process(folder("remote-code"))
    ) as started:
        yield started


@pytest.mark.slow
def test_saved_folder_loads_every_auto_class_through_remote_code_without_the_package(remote_code_process):
    made, finished = remote_code_process
    auto_map = json.loads((made["folder"] / "config.json").read_text())["auto_map"]
    assert auto_map == {
        "AutoConfig": "configuration_gpn.GPNConfig",
        "AutoModel": "modeling_gpn.GPNModel",
        "AutoModelForCausalLM": "modeling_gpn.GPNForCausalLM",
        "AutoModelForSequenceClassification": "modeling_gpn.GPNForSequenceClassification",
    }
    result = finished.result()
    assert result.returncode == 0, result.stdout + result.stderr
    from_base, from_scorer = torch.load(made["out"])
    torch.testing.assert_close(from_base, made["hidden"])
    torch.testing.assert_close(from_scorer, made["hidden"])
