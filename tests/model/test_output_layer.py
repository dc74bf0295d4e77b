"""The output layer where transformers' tools look for it.

`GPNModel` ends with the decoder's norm and projection (as a Llama's base model ends with its final norm):
`last_hidden_state` is W_dec rms(p) (+ b_dec), the e-wide vector the output matrix multiplies; `GPNForCausalLM.lm_head`
is a registered module tied to the embedding and returned by `get_output_embeddings()`, so
`logits == lm_head(model.model(...).last_hidden_state)` exactly. The predicted state p is one argument away
(`output_predicted_states`), `output_hidden_states` follows transformers' convention, folders of the older layout
(decoder keys at the top level) still load, with and without remote code, and a wrapped or replaced module is never
ignored in silence. (TRL's fused head and trainers: tests/ecosystem/test_trl.py.)
"""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ..bf16_closeness import relative_error
from ..subprocesses import BLOCK_PACKAGE, run_python
from ..tiny_models import perturbed_model, tiny_config

VARIANTS = {
    "gpn+m": dict(),
    "gpn": dict(use_memory=False),
    "gpn+m-2l": dict(num_predict_layers=2),
    "decoder bias": dict(use_decoder_bias=True),
}


def token_ids(batch: int = 2, length: int = 9, seed: int = 0) -> torch.Tensor:
    return torch.randint(1, 97, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_base_model_ends_with_the_decoder_and_the_logits_are_lm_head_of_it(variant):
    model = perturbed_model(tiny_config(**VARIANTS[variant]), seed=1)
    head, embedding = model.lm_head, model.model.embed_tokens
    assert dict(model.named_modules())["lm_head"] is head and type(head) is nn.Linear and head.bias is None
    assert head.weight is embedding.weight and model.get_output_embeddings() is head
    assert model._tied_weights_keys == {"lm_head.weight": "model.embed_tokens.weight"}
    assert model.config.tie_word_embeddings and "lm_head.weight" in model.all_tied_weights_keys
    ids = token_ids()
    with torch.no_grad():
        out = model(ids, output_predicted_states=True)
        hidden = model.model(ids).last_hidden_state
        assert hidden.shape == (2, 9, model.config.embedding_size)
        assert torch.equal(out.logits, model.lm_head(hidden))
        # the decoder, bias included: W_dec rms(p) (+ b_dec)
        decoder = model.model.decode_proj
        expected = F.linear(model.model.decode_norm(out.predicted_states), decoder.weight, decoder.bias)
        torch.testing.assert_close(hidden, expected, rtol=1e-6, atol=1e-6)
        if decoder.bias is not None:
            decoder.bias.add_(1.0)
            assert (model.model(ids).last_hidden_state - hidden - 1.0).abs().max() < 1e-5
    assert model.model.last_recurrence_path == "fast"  # (the decoder is called after the fast recurrence)


def test_bf16_weights_give_a_bf16_hidden_state_that_the_head_multiplies_exactly():
    model = perturbed_model(tiny_config(), seed=2).to(torch.bfloat16)
    ids = token_ids()
    with torch.no_grad():
        out = model(ids, output_predicted_states=True)
        hidden = model.model(ids).last_hidden_state
    assert hidden.dtype == out.logits.dtype == torch.bfloat16 and out.predicted_states.dtype == torch.float32
    assert torch.equal(out.logits, model.lm_head(hidden))


def test_the_predicted_state_is_one_argument_away():
    """`output_predicted_states=True` returns p (d-wide, float32) on the base model and the causal LM; it is what the
    decoder reads (`model.decode(p)` gives the logits) and what the plain step loop computes."""
    model = perturbed_model(tiny_config(), seed=3)
    ids = token_ids(2, 7)
    with torch.no_grad():
        out = model(ids, output_predicted_states=True)
        base = model.model(ids, output_predicted_states=True)
        assert model(ids).predicted_states is None
        p = out.predicted_states
        assert p.shape == (2, 7, model.config.hidden_size) and p.dtype == torch.float32
        assert torch.equal(base.predicted_states, p) and torch.equal(base.last_hidden_state, model.model.decoded(p))
        torch.testing.assert_close(model.decode(p), out.logits, rtol=0, atol=0)
        state = model.model.zero_state(2, ids.device)
        stepped = []
        inputs = model.model.token_inputs(model.model.embed_tokens(ids))
        for t in range(7):
            predicted, grounded, memory, _ = model.model.step(*state, inputs[:, t])
            state = (predicted, grounded, memory)
            stepped.append(predicted)
    torch.testing.assert_close(p, torch.stack(stepped, 1), rtol=1e-5, atol=1e-5)


def test_hidden_states_follow_transformers_convention():
    """(the embedding output, ..., last_hidden_state), the last one `last_hidden_state` itself (a GPN is one layer)."""
    model = perturbed_model(tiny_config(num_predict_layers=2), seed=4)
    ids = token_ids()
    with torch.no_grad():
        out = model.model(ids, output_hidden_states=True)
        lm = model(ids, output_hidden_states=True)
    assert len(out.hidden_states) == 2
    assert torch.equal(out.hidden_states[0], model.model.embed_tokens(ids))
    assert out.hidden_states[-1] is out.last_hidden_state
    assert all(torch.equal(a, b) for a, b in zip(lm.hidden_states, out.hidden_states))


def test_peft_all_linear_leaves_the_output_head_out():
    """PEFT's `target_modules="all-linear"` finds the output embedding by identity among the named modules and
    leaves it out: the decoder projection gets an adapter, the tied head does not, and the head stays tied."""
    import peft

    model = peft.get_peft_model(
        perturbed_model(tiny_config(), seed=5), peft.LoraConfig(r=4, target_modules="all-linear")
    )
    base = model.get_base_model()
    assert type(base.lm_head) is nn.Linear and base.lm_head.weight is base.model.embed_tokens.weight
    adapted = {name.rsplit(".", 1)[0] for name, _ in base.named_modules() if name.endswith(".lora_A")}
    assert "model.decode_proj" in adapted and "model.predict_layers.0.ffn_in" in adapted
    assert not any(name.startswith("lm_head") for name in adapted)


def test_a_wrapped_embedding_is_followed_by_the_output_and_never_ignored():
    """LoRA on `embed_tokens`: the output matrix is the adapted table (input and output sides match, before and after
    `merge_and_unload()`), and `get_output_embeddings()` is a bias-free view whose weight is that table (the base
    table while the adapter is disabled), so tools that multiply by its weight (TRL's fused head) compute the
    model's logits. With PEFT's `ensure_weight_tying=True` the head carries the tied adapter and is called: the
    same logits."""
    import peft

    ids = token_ids(2, 8)
    base_logits = perturbed_model(tiny_config(), seed=6)(ids).logits.detach()
    outputs = {}
    for tying in (False, True):
        torch.manual_seed(7)
        config = peft.LoraConfig(
            r=4,
            lora_alpha=8,
            target_modules=["embed_tokens", "decode_proj"],
            init_lora_weights=False,
            ensure_weight_tying=tying,
        )
        adapted = peft.get_peft_model(perturbed_model(tiny_config(), seed=6), config).eval()
        inner = adapted.get_base_model()
        with torch.no_grad():
            logits = adapted(input_ids=ids).logits
            hidden = inner.model(ids).last_hidden_state
            table = inner.model.embed_tokens(torch.arange(97))  # the adapted table
        torch.testing.assert_close(logits, hidden @ table.T, rtol=1e-5, atol=1e-5)
        assert (logits - base_logits).abs().max() > 1e-3
        if tying:
            assert hasattr(inner.lm_head, "lora_A") and inner.output_follows_embedding() is False
        else:
            assert inner.output_follows_embedding()
            head = inner.get_output_embeddings()
            assert head.bias is None and not list(head.parameters()) and head not in list(inner.modules())
            with torch.no_grad():
                torch.testing.assert_close(head.weight, table)
                torch.testing.assert_close(head(hidden), logits, rtol=1e-5, atol=1e-5)
                with adapted.disable_adapter():
                    assert torch.equal(head.weight, inner.lm_head.weight)
            merged = adapted.merge_and_unload().eval()
            assert merged.get_output_embeddings() is merged.lm_head
            assert merged.lm_head.weight is merged.model.embed_tokens.weight
            torch.testing.assert_close(merged(ids).logits.detach(), logits, rtol=1e-4, atol=1e-4)
        outputs[tying] = logits
    torch.testing.assert_close(outputs[True], outputs[False], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("wrapper", ["lora", "modules_to_save", "trainable_tokens"])
def test_a_second_all_linear_adapter_adapts_every_linear_layer_but_the_head(wrapper):
    """PEFT's `target_modules="all-linear"` leaves out the module `get_output_embeddings()` returns, looked up by
    identity among the named modules. While the output follows a wrapped embedding (LoRA, a `modules_to_save` copy,
    trainable tokens) that is a view of no named module, and PEFT 0.21 stopped with a bare StopIteration; it is
    answered `lm_head`, so a second `all-linear` adapter adapts every linear layer but the head, and the output stays
    the first adapter's table (the second adapter starts as the identity: the same logits)."""
    import peft

    ids = token_ids(2, 8)
    torch.manual_seed(12)
    first = {
        "lora": dict(target_modules=["embed_tokens"], init_lora_weights=False),
        "modules_to_save": dict(target_modules=["decode_proj"], modules_to_save=["embed_tokens"]),
        "trainable_tokens": dict(target_modules=["decode_proj"], trainable_token_indices={"embed_tokens": [3, 5]}),
    }[wrapper]
    adapted = peft.get_peft_model(perturbed_model(tiny_config(), seed=12), peft.LoraConfig(r=4, **first)).eval()
    inner = adapted.get_base_model()
    with torch.no_grad():
        if wrapper == "modules_to_save":
            inner.model.embed_tokens.modules_to_save["default"].weight.add_(0.3)
        if wrapper == "trainable_tokens":
            inner.model.embed_tokens.token_adapter.trainable_tokens_delta["default"].add_(0.3)
        before = adapted(input_ids=ids).logits
    head = inner.lm_head
    adapted.add_adapter("second", peft.LoraConfig(r=4, target_modules="all-linear"))
    adapted.base_model.set_adapter(["default", "second"])
    assert inner.lm_head is head and "second" not in getattr(head, "lora_A", {})
    second = {name.rsplit(".lora_A", 1)[0] for name, _ in inner.named_modules() if name.endswith("lora_A.second")}
    assert {"model.decode_proj", "model.predict_layers.0.ffn_in", "model.memory_write.key"} <= second
    assert not any(name.startswith("lm_head") for name in second)
    assert type(inner.get_output_embeddings()).__name__ == "EmbeddingTableHead"  # TRL's fused head still gets the view
    with torch.no_grad():
        torch.testing.assert_close(adapted(input_ids=ids).logits, before)


def test_the_table_view_keeps_its_table_only_while_nothing_it_depends_on_changes():
    """`get_output_embeddings()` of a wrapped embedding is a view whose table is computed once and kept for the
    reads of one call (TRL's fused head reads it three times); one held longer never hands out a stale table: an
    optimizer step, `disable_adapter()`, grad mode and a backward through it (gradient accumulation) each make it
    compute the table again."""
    import peft

    config = peft.LoraConfig(r=4, target_modules=["embed_tokens"], init_lora_weights=False)
    adapted = peft.get_peft_model(perturbed_model(tiny_config(), seed=9), config)
    inner = adapted.get_base_model()
    head = inner.get_output_embeddings()
    hidden = torch.randn(3, inner.config.embedding_size)
    first = head.weight
    assert head.weight is first and head.weight is first  # kept between reads
    with adapted.disable_adapter():
        assert torch.equal(head.weight, inner.lm_head.weight)
    for _ in range(2):  # two micro-batches, one optimizer step: the second needs a table with a live graph
        head(hidden).square().sum().backward()
    gradient = inner.model.embed_tokens.lora_embedding_A["default"].grad.clone()
    assert head.weight is not first and gradient.abs().max() > 0
    with torch.no_grad():
        inner.model.embed_tokens.lora_embedding_B["default"].add_(1.0)  # (in place, as an optimizer steps)
    torch.testing.assert_close(head.weight, inner.model.embed_tokens(torch.arange(97)))
    assert head.weight.requires_grad
    with torch.no_grad():
        assert not head.weight.requires_grad
        kept = head.weight
        lora_b = inner.model.embed_tokens.lora_embedding_B
        lora_b["default"] = nn.Parameter(
            lora_b["default"] + 1.0
        )  # (a new parameter, its version 0 as the old one's may be)
        assert head.weight is not kept
        torch.testing.assert_close(head.weight, inner.model.embed_tokens(torch.arange(97)))
    with torch.inference_mode():  # (an inference tensor tracks no version: its table is never kept)
        lora_b["default"] = nn.Parameter(lora_b["default"] + 1.0)
        assert head.weight is not head.weight
        torch.testing.assert_close(head.weight, inner.model.embed_tokens(torch.arange(97)))


def test_an_embedding_replaced_without_tying_is_refused_then_followed_once_tied():
    model = perturbed_model(tiny_config(), seed=8)
    ids = token_ids()
    model.set_input_embeddings(nn.Embedding(97, 32))
    with pytest.raises(ValueError, match="tie_weights"):
        model(ids)
    with pytest.raises(ValueError, match="tie_weights"):
        model(ids, labels=ids, return_logits=False)
    model.tie_weights()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, model.model(ids).last_hidden_state @ model.model.embed_tokens.weight.T)


@pytest.mark.parametrize("route", ["parametrization", "pruning"])
def test_an_embedding_whose_weight_is_computed_is_followed_by_the_output(route):
    """A parametrization (weight norm, a scaling) or pruning on `embed_tokens` computes its weight from others, so
    the head cannot hold it: the output follows the table the embedding computes, as for a wrapped one (logits,
    their gradients on both sides, generate() on the fast path's recurrence equal to the plain path's). Before,
    every call was refused with advice to call `tie_weights()`, which itself failed on the computed weight."""
    from torch.nn.utils import parametrize, prune

    class Scaled(nn.Module):
        def forward(self, weight):
            return 1.5 * weight

    model = perturbed_model(tiny_config(), seed=9)
    embedding, ids = model.model.embed_tokens, token_ids()
    if route == "parametrization":
        parametrize.register_parametrization(embedding, "weight", Scaled())
        raw = embedding.parametrizations.weight.original
    else:
        prune.l1_unstructured(embedding, "weight", amount=0.3)
        raw = embedding.weight_orig
    assert model.output_follows_embedding()
    model.train()
    loss = model(ids, labels=ids).loss
    loss.backward()
    table = embedding(torch.arange(97))
    with torch.no_grad():
        logits = model.eval()(ids).logits
        torch.testing.assert_close(logits, model.model(ids).last_hidden_state @ table.T, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model.get_output_embeddings().weight, table)
        fast = model.generate(ids[:, :4], max_new_tokens=5, do_sample=False)
        model.model.use_fast_path = False
        torch.testing.assert_close(model(ids).logits, logits, rtol=1e-5, atol=1e-5)
        assert torch.equal(model.generate(ids[:, :4], max_new_tokens=5, do_sample=False), fast)
    assert raw.grad is not None and raw.grad.abs().sum() > 0


def test_a_head_trained_apart_from_the_embedding_is_refused_at_saving_not_dropped(tmp_path):
    """PEFT's `modules_to_save=["embed_tokens", "lm_head"]` (a common recipe for new chat tokens) trains two copies;
    merged, the head holds a table of its own, which a GPN cannot hold (its output matrix is its embedding, the only
    one saved): saving refuses it by name instead of writing a folder that reloads as another model. With
    `modules_to_save=["embed_tokens"]` both sides follow the trained copy: merged and tied, the same logits."""
    import peft

    ids = token_ids()
    for targets in (["embed_tokens", "lm_head"], ["embed_tokens"]):
        torch.manual_seed(11)
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", modules_to_save=targets)
        adapted = peft.get_peft_model(perturbed_model(tiny_config(), seed=10), config).eval()
        with torch.no_grad():
            for name in targets:  # as training would move the copies
                copy = adapted.get_base_model().get_submodule(f"model.{name}" if "embed" in name else name)
                copy.modules_to_save["default"].weight.add_(0.3 * torch.randn_like(copy.weight))
            trained = adapted(ids).logits
        merged = adapted.merge_and_unload()
        with pytest.raises(ValueError, match="tie_weights"):
            merged.save_pretrained(tmp_path / "merged")
        assert not (tmp_path / "merged" / "model.safetensors").exists()
        if targets == ["embed_tokens"]:
            merged.tie_weights()
            merged.save_pretrained(tmp_path / "tied")
            reloaded = type(merged).from_pretrained(tmp_path / "tied").eval()
            with torch.no_grad():
                torch.testing.assert_close(reloaded(ids).logits, trained, rtol=1e-5, atol=1e-5)


def test_resize_token_embeddings_keeps_the_output_tied():
    """The head is resized with the embedding and tied again; the logits of the old tokens are unchanged."""
    model = perturbed_model(tiny_config(), seed=9)
    ids = token_ids()
    with torch.no_grad():
        before = model(ids).logits
    for size in (105, 90):
        model.resize_token_embeddings(size)
        assert model.config.vocab_size == size and model.lm_head.weight is model.model.embed_tokens.weight
        assert model.get_output_embeddings().weight.shape == (size, 32)
        with torch.no_grad():
            after = model(ids.clamp(max=size - 1)).logits
        assert after.shape[-1] == size
        if size > 97:
            assert torch.equal(after[..., :97], before)
            model(torch.tensor([[104]]))  # a new id is in the vocabulary
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model(torch.tensor([[95]]))


def test_the_chunked_loss_reads_the_head_where_it_can_and_calls_it_where_it_must(monkeypatch):
    """`return_logits=False` gives the loss and gradients of the full logits: from `lm_head.weight` for the plain tied
    head, from the adapted table for a followed embedding, and by calling the head when it is hooked."""
    import peft

    ids = token_ids(2, 10)

    def loss_and_grads(model, return_logits):
        model.zero_grad(set_to_none=True)
        loss = model(ids, labels=ids, return_logits=return_logits).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain = perturbed_model(tiny_config(), seed=10).train()
    torch.manual_seed(11)
    lora = peft.LoraConfig(r=4, target_modules=["embed_tokens"], init_lora_weights=False)
    followed = peft.get_peft_model(perturbed_model(tiny_config(), seed=10), lora).train()
    hooked = perturbed_model(tiny_config(), seed=10).train()
    hooked.lm_head.register_forward_hook(lambda module, inputs, output: 2 * output)
    with torch.no_grad():  # the followed embedding's output matrix: the adapted table
        inner = followed.get_base_model()
        adapted = inner.model(ids).last_hidden_state @ inner.model.embed_tokens(torch.arange(97)).T
        expected = {"followed": F.cross_entropy(adapted[:, :-1].reshape(-1, 97), ids[:, 1:].reshape(-1))}
    losses = {}
    for name, model in (("plain", plain), ("followed", followed), ("hooked", hooked)):
        (full, full_grads), (chunked, chunked_grads) = loss_and_grads(model, True), loss_and_grads(model, False)
        torch.testing.assert_close(chunked, full, rtol=1e-5, atol=1e-6)
        assert full_grads.keys() == chunked_grads.keys()
        for key, grad in full_grads.items():
            torch.testing.assert_close(chunked_grads[key], grad, rtol=1e-4, atol=1e-6, msg=f"{name}: {key}")
        losses[name] = float(full)
        if name in expected:
            torch.testing.assert_close(full, expected[name], rtol=1e-5, atol=1e-6)
    assert abs(losses["hooked"] - losses["plain"]) > 1e-3 and abs(losses["followed"] - losses["plain"]) > 1e-4

    # The same in bounded memory: a long no-grad call runs in prefill chunks (prefill.py), each chunk's loss read
    # the same way, and the last logits through the head.
    from modeling_gpn import modeling_gpn as module

    chunked_calls = []
    run_in_chunks = module.forward_in_chunks
    monkeypatch.setattr(module, "forward_in_chunks", lambda *a, **k: chunked_calls.append(1) or run_in_chunks(*a, **k))
    for name, model in (("plain", plain), ("followed", followed), ("hooked", hooked)):
        inner = model.get_base_model() if hasattr(model, "get_base_model") else model
        with torch.no_grad():
            inner.prefill_chunk_length = 0
            whole, last = model(ids, labels=ids).loss, model(ids).logits[:, -1:]
            inner.prefill_chunk_length = 4
            chunked, chunked_last = (
                model(ids, labels=ids, return_logits=False).loss,
                model(ids, logits_to_keep=1).logits,
            )
            del inner.prefill_chunk_length
        torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-6, msg=name)
        # (one-pass and chunked logits come from the same states through products of different row counts: the C
        # kernels' summation order at a few rows, F.linear's at many, a few float32 ulps of logits of magnitude ~50)
        torch.testing.assert_close(chunked_last, last, rtol=1e-5, atol=1e-4, msg=name)
    assert len(chunked_calls) == 6


# --------------------------------------------------------------------------------------------------
# Sequence classification
# --------------------------------------------------------------------------------------------------


def test_sequence_classification_scores_each_rows_last_real_token():
    """`GPNForSequenceClassification` (what `AutoModelForSequenceClassification` builds for a GPN config) scores the
    decoded vector at each row's last real token: padding left, right or inside a row (with the mask) gives each
    row's unpadded scores; without a mask, the last token that is not the pad token; transformers' losses."""
    from transformers import AutoModelForSequenceClassification

    from modeling_gpn import GPNForSequenceClassification

    config = tiny_config(num_labels=3, pad_token_id=0)
    model = AutoModelForSequenceClassification.from_config(config)
    assert type(model) is GPNForSequenceClassification and model.get_output_embeddings() is None
    model.load_state_dict(perturbed_model(tiny_config(), seed=13).state_dict(), strict=False)  # (perturbed gates)
    model.eval()
    generator = torch.Generator().manual_seed(14)
    alone = [torch.randint(1, 97, (1, n), generator=generator) for n in (5, 8, 3)]
    alone[1][0, -1] = 0  # a real last token that is the pad token (an EOS used as padding): the mask says it is real
    ids, mask = torch.full((4, 8), 7), torch.zeros(4, 8, dtype=torch.long)  # (padded ids are not the pad token)
    ids[0, 3:], mask[0, 3:] = alone[0][0], 1  # left padding
    ids[1], mask[1] = alone[1][0], 1
    ids[2, [0, 2, 5]], mask[2, [0, 2, 5]] = alone[2][0], 1  # padding inside and after
    with torch.no_grad():
        expected = torch.cat([model.score(model.model(row).last_hidden_state[:, -1]) for row in alone])
        batched = model(ids, attention_mask=mask).logits
        torch.testing.assert_close(batched[:3], expected, rtol=1e-5, atol=1e-6)
        empty = model.score(model.model.decoded(torch.zeros(1, 48)))  # a row with nothing real: the zero state
        torch.testing.assert_close(batched[3:], empty, rtol=1e-5, atol=1e-6)
        right = torch.zeros(1, 8, dtype=torch.long)  # right padding with the pad token, no mask
        right[0, :5] = alone[0][0]
        torch.testing.assert_close(model(right).logits, expected[:1], rtol=1e-5, atol=1e-6)
        model.config.pad_token_id = None  # no pad token: every token is real
        last = model.score(model.model(right).last_hidden_state[:, -1])
        torch.testing.assert_close(model(right).logits, last, rtol=1e-5, atol=1e-6)
        assert (last - expected[:1]).abs().max() > 1e-4
    labels = torch.tensor([2, 0, 1])
    loss = model(ids[:3], attention_mask=mask[:3], labels=labels).loss
    torch.testing.assert_close(loss, F.cross_entropy(batched[:3], labels), rtol=1e-5, atol=1e-6)


def scorer(num_labels: int = 1, seed: int = 13, **overrides):
    """A `GPNForSequenceClassification` on perturbed tiny weights (pad token 0), in eval mode: the same for a seed."""
    from modeling_gpn import GPNForSequenceClassification

    torch.manual_seed(seed)  # (the score head: the base model's weights are loaded below)
    model = GPNForSequenceClassification(tiny_config(num_labels=num_labels, pad_token_id=0, **overrides))
    model.load_state_dict(perturbed_model(tiny_config(), seed=seed).state_dict(), strict=False)
    return model.eval()


@torch.no_grad()
def test_sequence_classification_without_a_mask_finds_the_last_token_that_is_not_the_pad_token():
    """Without a mask, transformers' rule: each row's rightmost token that is not `config.pad_token_id` (a pad id
    inside the text is read as a token). Several rows whose padding nothing shows are refused by name: neither a mask
    nor a pad token (transformers refuses them too), or embeddings without a mask (scored at their last position, a
    padded row would be scored at a pad token); one row is scored at its last token."""
    model = scorer(num_labels=2)
    text = token_ids(1, 6, seed=21)
    text[0, 2] = 0  # the pad id inside the text: a token
    right = torch.cat([text, torch.zeros(1, 3, dtype=torch.long)], dim=1)  # right padding with the pad id, no mask
    left = torch.cat([torch.zeros(1, 2, dtype=torch.long), text, torch.zeros(1, 1, dtype=torch.long)], dim=1)
    alone = model.score(model.model(text).last_hidden_state[:, -1])
    at_7 = model.score(model.model(left).last_hidden_state[:, 7])  # (without a mask the left padding is read)
    torch.testing.assert_close(model(torch.cat([right, left])).logits, torch.cat([alone, at_7]), rtol=1e-5, atol=1e-6)

    embedded = model.model.embed_tokens(torch.cat([right, left]))
    with pytest.raises(ValueError, match=r"got 2 rows of inputs_embeds without an attention_mask \(no token ids"):
        model(inputs_embeds=embedded)  # (no ids: the pad token cannot be found)
    mask = torch.tensor([[1] * 6 + [0] * 3, [0, 0] + [1] * 6 + [0]])
    torch.testing.assert_close(model(inputs_embeds=embedded, attention_mask=mask).logits, alone.expand(2, -1))
    torch.testing.assert_close(model(inputs_embeds=model.model.embed_tokens(text)).logits, alone)  # one row: its last

    model.config.pad_token_id = None
    with pytest.raises(ValueError, match=r"got 2 rows without an attention_mask, and config.pad_token_id is None"):
        model(torch.cat([right, right]))
    torch.testing.assert_close(model(torch.cat([right, left]), attention_mask=mask).logits, alone.expand(2, -1))
    last = model.score(model.model(right).last_hidden_state[:, -1])
    torch.testing.assert_close(model(right).logits, last)  # one row, no pad token: every token is real


@torch.no_grad()
def test_sequence_classification_scores_a_continuation_of_a_kept_prompt_state():
    """Scoring continuations of a prompt read once: the prompt's cache (`use_cache=True`, or `past_key_values`, the
    deprecated name) continued with the new tokens alone and the mask of prompt + new columns gives each row's score
    of its real tokens read alone (a row with padding inside its prompt; a row whose new positions are all padding:
    the prompt's own score). The fast path (which ran) equals the plain loop, and bf16 weights score the whole
    sequence within bf16's rounding of float32."""
    from ..backend_observer import FAST_PATH, PLAIN_PATH, ran

    model = scorer(num_labels=2)
    prompt, new = token_ids(2, 5, seed=22), token_ids(2, 3, seed=23)
    whole = torch.cat([prompt, new], dim=1)
    mask = torch.tensor([[1, 0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0, 0, 0]])
    expected = torch.cat(
        [model.score(model.model(row[real.bool()][None]).last_hidden_state[:, -1]) for row, real in zip(whole, mask)]
    )
    scores = {}
    for path, fast in (("fast", True), ("plain", False)):
        model.model.use_fast_path = fast
        with ran(FAST_PATH if fast else PLAIN_PATH):
            kept = model(prompt, attention_mask=mask[:, :5], use_cache=True).cache
            scores[path] = model(new, cache=kept, attention_mask=mask).logits
        assert kept.get_seq_length() == 8
    torch.testing.assert_close(scores["fast"], expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(scores["plain"], expected, rtol=1e-5, atol=1e-6)
    kept = model(prompt, attention_mask=mask[:, :5], use_cache=True).cache
    with pytest.warns(FutureWarning, match="past_key_values"):
        torch.testing.assert_close(model(new, past_key_values=kept, attention_mask=mask).logits, scores["fast"])
    half = scorer(num_labels=2).to(torch.bfloat16)
    scored = half(whole, attention_mask=mask).logits
    assert scored.dtype == torch.bfloat16 and relative_error(scored, expected) < 0.02


def test_sequence_classification_losses_by_problem_type_and_labels_refused_by_name():
    """transformers' loss by problem type, against a hand computation of the scores: regression for one label (MSE,
    labels (batch,) or (batch, 1)), single-label for int64 class ids (cross-entropy, -100 ignored), multi-label for
    floats (BCE), settled by the labels' dtype or set in the config. Labels of a wrong dtype, shape or range are
    refused by name before the forward, the config's problem type left unset: they failed inside torch's losses
    (int32 class ids, an id out of range: on a GPU a device-side assert) or were broadcast against the scores with a
    warning at most (a regression label of shape (batch, 2), one label for the batch)."""
    ids, mask = token_ids(3, 5, seed=24), torch.tensor([[1] * 5, [0, 0, 1, 1, 1], [1, 1, 1, 0, 0]])

    def scores_and_loss(model, labels):
        loss = model(ids, attention_mask=mask, labels=labels).loss
        return model(ids, attention_mask=mask).logits, loss

    regressor = scorer(num_labels=1)
    target = torch.tensor([0.5, -1.0, 2.0])
    scores, loss = scores_and_loss(regressor, target)
    torch.testing.assert_close(loss, F.mse_loss(scores[:, 0], target))
    assert regressor.config.problem_type == "regression"
    torch.testing.assert_close(scores_and_loss(regressor, target[:, None])[1], loss)
    regressor.config.problem_type = None
    for bad, shape in ((torch.rand(3, 2), r"\(3, 2\)"), (torch.rand(1), r"\(1,\)"), (target > 0, r"\(3,\)")):
        with pytest.raises(ValueError, match=rf"labels of dtype .* and shape {shape} do not fit regression"):
            regressor(ids, attention_mask=mask, labels=bad)
    assert regressor.config.problem_type is None

    classifier = scorer(num_labels=3)
    classes = torch.tensor([2, -100, 0])
    scores, loss = scores_and_loss(classifier, classes)
    torch.testing.assert_close(loss, F.cross_entropy(scores[[0, 2]], classes[[0, 2]]))
    assert classifier.config.problem_type == "single_label_classification"
    classifier.config.problem_type = None
    with pytest.raises(ValueError, match=r"dtype torch.int32 .* single_label_classification.*; pass labels.long\(\)"):
        classifier(ids, attention_mask=mask, labels=classes.int())
    with pytest.raises(ValueError, match=r"labels hold 3 at row 1: a class id must be in \[0, 3\)"):
        classifier(ids, attention_mask=mask, labels=torch.tensor([0, 3, 1]))
    with pytest.raises(ValueError, match=r"shape \(3,\) do not fit multi_label_classification.*pass labels.long"):
        classifier(ids, attention_mask=mask, labels=torch.tensor([2.0, 0.0, 1.0]))  # class ids as floats
    with pytest.raises(ValueError, match=r"shape \(3, 3\) do not fit single_label.*pass labels.float"):
        classifier(ids, attention_mask=mask, labels=torch.eye(3, dtype=torch.long))  # multi-hot as integers
    assert classifier.config.problem_type is None

    multi_hot = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    scores, loss = scores_and_loss(classifier, multi_hot)
    torch.testing.assert_close(loss, F.binary_cross_entropy_with_logits(scores, multi_hot))
    assert classifier.config.problem_type == "multi_label_classification"
    with pytest.raises(ValueError, match=r"torch.bool .* multi_label_classification.*; pass labels.float"):
        classifier(ids, attention_mask=mask, labels=multi_hot.bool())
    classifier.config.problem_type = "regression"  # set in the config: several numbers a row
    scores, loss = scores_and_loss(classifier, multi_hot)
    torch.testing.assert_close(loss, F.mse_loss(scores, multi_hot))
    with pytest.raises(ValueError, match=r"shape \(3,\) do not fit regression \(config.problem_type='regression'\)"):
        classifier(ids, attention_mask=mask, labels=target)


# --------------------------------------------------------------------------------------------------
# Folders of the older layout
# --------------------------------------------------------------------------------------------------


def older_layout(folder) -> None:
    """Rewrite a saved folder as `save_pretrained` wrote it before the decoder moved into the base model (commit
    3b78628): the decoder's keys at the top level (`decode_norm.*`, `decode_proj.*`), `tie_word_embeddings: false`
    in the config, and no sequence-classification entry in the auto_map. The modeling files stay the current ones,
    as in a Hub repo whose code was updated and whose weights were not."""
    from safetensors.torch import load_file, save_file

    weights = load_file(str(folder / "model.safetensors"))
    old = {name.removeprefix("model.") if name.startswith("model.decode_") else name: t for name, t in weights.items()}
    top_level = {name for name in old if name.startswith("decode_")}
    assert top_level == {"decode_norm.weight", "decode_proj.weight", "decode_proj.bias"}
    save_file(old, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["tie_word_embeddings"] = False
    config["auto_map"].pop("AutoModelForSequenceClassification")
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.slow
def test_folders_of_the_older_layout_load_with_and_without_remote_code(tmp_path):
    from safetensors import safe_open
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification

    model = perturbed_model(tiny_config(use_decoder_bias=True), seed=12)
    folder = tmp_path / "old"
    model.save_pretrained(folder)
    older_layout(folder)
    ids = token_ids(2, 6)
    with torch.no_grad():
        expected_logits, expected_hidden = model(ids).logits, model.model(ids).last_hidden_state

    loaded, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight and loaded.config.tie_word_embeddings
    base, info = AutoModel.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    scorer = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=1)
    assert torch.equal(scorer.model.decode_proj.bias, model.model.decode_proj.bias)
    with torch.no_grad():
        assert torch.equal(loaded.eval()(ids).logits, expected_logits)
        assert torch.equal(base.eval()(ids).last_hidden_state, expected_hidden)

    from modeling_gpn.hub import check_weights  # `gpn push` checks the weights against the config: both layouts pass

    assert check_weights([folder / "model.safetensors"], model.config) == model.num_parameters()

    resaved = tmp_path / "resaved"
    loaded.save_pretrained(resaved)  # in the current layout
    with safe_open(str(resaved / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert {"model.decode_norm.weight", "model.decode_proj.weight", "model.decode_proj.bias"} <= keys
    assert not any(key.startswith("decode_") or key.startswith("lm_head") for key in keys)
    with torch.no_grad():
        assert torch.equal(AutoModelForCausalLM.from_pretrained(resaved).eval()(ids).logits, expected_logits)
    assert check_weights([resaved / "model.safetensors"], model.config) == model.num_parameters()

    out = tmp_path / "remote.pt"
    code = BLOCK_PACKAGE + textwrap.dedent(
        f"""
        import torch
        from transformers import AutoModel, AutoModelForCausalLM

        torch.set_num_threads(1)
        folder, ids = {str(folder)!r}, torch.tensor({ids.tolist()!r})
        lm, info = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, output_loading_info=True)
        assert type(lm).__module__.startswith("transformers_modules") and not info["missing_keys"], info
        base = AutoModel.from_pretrained(folder, trust_remote_code=True)
        with torch.no_grad():
            torch.save((lm.eval()(ids).logits, base.eval()(ids).last_hidden_state), {str(out)!r})
        """
    )
    result = run_python(code, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    remote_logits, remote_hidden = torch.load(out)
    assert torch.equal(remote_logits, expected_logits) and torch.equal(remote_hidden, expected_hidden)


def test_a_forward_set_on_the_heads_instance_is_called():
    """`lm_head.forward` replaced on the module's instance (a patch): the logits, the loss from full logits and the
    chunked loss are what that forward computes; none of them reads past it to the head's weight."""
    model = perturbed_model(tiny_config(), seed=12).eval()
    ids = token_ids(2, 10)
    weight = model.lm_head.weight
    model.lm_head.forward = lambda hidden: 2 * F.linear(hidden, weight)
    with torch.no_grad():
        expected = 2 * model.model(ids).last_hidden_state @ weight.T
        logits = model(ids).logits
        full, chunked = model(ids, labels=ids).loss, model(ids, labels=ids, return_logits=False).loss
    loss = F.cross_entropy(expected[:, :-1].reshape(-1, 97), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(full, loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(chunked, loss, rtol=1e-5, atol=1e-6)
