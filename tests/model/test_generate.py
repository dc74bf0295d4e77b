"""Real transformers `generate()` on a GPN: every decoding mode, with and without the cache."""

from __future__ import annotations

import copy

import pytest
import torch

from modeling_gpn import GPNCache

from ..backend_observer import FAST_PATH, PLAIN_PATH, ran
from ..tiny_models import perturbed_model, tiny_config

PAD = 0


@pytest.fixture(scope="module")
def model():
    model = perturbed_model(tiny_config(eos_token_id=None), seed=11)
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = None
    return model


def argmax_continuation(model, ids: torch.Tensor, steps: int) -> torch.Tensor:
    """`ids` and `steps` greedy tokens, each recomputed from scratch by the plain forward: no cache anywhere."""
    for _ in range(steps):
        ids = torch.cat([ids, model(ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


@torch.no_grad()
def test_greedy_equals_argmax_path_without_cache(model):
    prompt = torch.randint(1, 97, (1, 9), generator=torch.Generator().manual_seed(0))
    generated = model.generate(prompt, max_new_tokens=12, do_sample=False)
    assert torch.equal(generated, argmax_continuation(model, prompt, 12))


@torch.no_grad()
def test_beam_search_with_and_without_cache(model):
    prompt = torch.randint(1, 97, (2, 6), generator=torch.Generator().manual_seed(1))
    kwargs = dict(
        max_new_tokens=8,
        num_beams=3,
        num_return_sequences=2,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
    )
    cached = model.generate(prompt, use_cache=True, **kwargs)
    uncached = model.generate(prompt, use_cache=False, **kwargs)
    assert cached.sequences.shape == (4, 14)
    assert torch.equal(cached.sequences, uncached.sequences)
    torch.testing.assert_close(cached.sequences_scores, uncached.sequences_scores, atol=1e-5, rtol=0)


@torch.no_grad()
def test_beam_search_reorders_what_each_cache_row_has_read(model):
    """Beam search reorders the cache's rows at every step (`reorder_cache`): the fingerprint of what each
    row has read must move with its state. Checked at every step of a real beam search: when the logits
    processors run, the cache has read each running beam's sequence so far (the `input_ids` they get), row
    for row, and its fingerprint says so. (Had it stayed in place, a row would claim another beam's history,
    and a continuation given the whole sequence could be misread.)"""
    from transformers import LogitsProcessor, LogitsProcessorList

    from modeling_gpn.cache import token_fingerprint

    caches, checked = [], []

    class CheckWhatEachRowRead(LogitsProcessor):
        def __call__(self, input_ids, scores):
            cache = caches[-1]
            assert cache.get_seq_length() == input_ids.shape[1]
            checked.append(torch.equal(cache.read_fingerprint(), token_fingerprint(input_ids, None)))
            return scores

    hook = model.model.register_forward_hook(lambda module, args, output: caches.append(output.cache))
    try:
        prompt = torch.randint(1, 97, (2, 4), generator=torch.Generator().manual_seed(0))
        model.generate(
            prompt,
            max_new_tokens=8,
            num_beams=3,
            num_return_sequences=2,
            do_sample=False,
            logits_processor=LogitsProcessorList([CheckWhatEachRowRead()]),
        )
    finally:
        hook.remove()
    assert len(checked) == 8 and all(checked), checked


@torch.no_grad()
def test_output_logits_and_transition_scores_are_the_forwards(model):
    """transformers' recipe `return_dict_in_generate=True, output_logits=True, output_scores=True` then
    `compute_transition_scores` (greedy; beams with `beam_indices`): each step's logits, and each chosen token's
    log-probability, are the plain forward's over the returned sequence."""
    prompt = torch.randint(1, 97, (1, 5), generator=torch.Generator().manual_seed(91))
    out = model.generate(
        prompt, max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_scores=True, output_logits=True
    )
    forward = model(out.sequences, use_cache=False).logits[:, 4:-1]
    torch.testing.assert_close(torch.stack(out.logits, 1), forward, atol=1e-5, rtol=0)
    chosen = forward.log_softmax(-1).gather(-1, out.sequences[:, 5:, None])[..., 0]
    scores = model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
    torch.testing.assert_close(scores, chosen, atol=1e-5, rtol=0)
    beams = model.generate(
        prompt,
        max_new_tokens=4,
        num_beams=3,
        num_return_sequences=2,
        length_penalty=0.0,
        return_dict_in_generate=True,
        output_scores=True,
    )
    forward = model(beams.sequences, use_cache=False).logits[:, 4:-1].log_softmax(-1)
    chosen = forward.gather(-1, beams.sequences[:, 5:, None])[..., 0]
    scores = model.compute_transition_scores(beams.sequences, beams.scores, beams.beam_indices)
    torch.testing.assert_close(scores, chosen, atol=1e-5, rtol=0)


@torch.no_grad()
def test_seeded_sampling_with_and_without_cache(model):
    """The same seed, the same samples: with the cache or without, through `transformers.set_seed` as through
    `torch.manual_seed`, and on the plain path (a forward draws nothing from torch's generator on either path, so
    they leave it at the same state, as the later samples show)."""
    from transformers import set_seed

    prompt = torch.randint(1, 97, (2, 5), generator=torch.Generator().manual_seed(2))
    kwargs = dict(max_new_tokens=10, do_sample=True, top_k=20, top_p=0.9, temperature=0.9, num_return_sequences=3)
    torch.manual_seed(123)
    with ran(FAST_PATH, not_ran=(PLAIN_PATH,)):
        cached = model.generate(prompt, use_cache=True, **kwargs)
    set_seed(123)
    uncached = model.generate(prompt, use_cache=False, **kwargs)
    model.model.use_fast_path = False
    try:
        torch.manual_seed(123)
        with ran(PLAIN_PATH, not_ran=(FAST_PATH,)):
            plain = model.generate(prompt, **kwargs)
    finally:
        model.model.use_fast_path = True
    assert cached.shape == (6, 15)
    assert torch.equal(cached, uncached) and torch.equal(cached, plain)


@torch.no_grad()
@pytest.mark.parametrize("mode", ["greedy", "beam"])
def test_left_padded_batch_gives_each_rows_solo_output(model, mode):
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 97, (n,), generator=generator) for n in (3, 10, 6)]
    width = max(len(p) for p in prompts)
    ids = torch.full((3, width), PAD, dtype=torch.long)
    mask = torch.zeros(3, width, dtype=torch.long)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt) :] = prompt
        mask[i, width - len(prompt) :] = 1
    kwargs = dict(max_new_tokens=7, do_sample=False)
    if mode == "beam":
        kwargs.update(num_beams=3)
    batched = model.generate(ids, attention_mask=mask, **kwargs)
    for i, prompt in enumerate(prompts):
        solo = model.generate(prompt[None], **kwargs)
        assert torch.equal(batched[i, width:], solo[0, len(prompt) :]), f"row {i}"


@torch.no_grad()
def test_assisted_decoding_is_refused_clearly(model):
    """Assisted and prompt-lookup decoding with a GPN as the main model are refused by name before any forward:
    transformers 5.25 refuses them only after its first forward, which had advanced the cache the caller gave."""
    prompt = torch.randint(1, 97, (1, 4))
    cache = model(prompt, use_cache=True).cache
    state = [buffer.clone() for buffer in cache.state_buffers()]
    new = torch.randint(1, 97, (1, 3))
    for decoding in (dict(assistant_model=model), dict(prompt_lookup_num_tokens=2)):
        with pytest.raises(ValueError, match=r"Assisted decoding .* GPN as the main model.* cannot be rolled back"):
            model.generate(new, cache=cache, max_new_tokens=3, do_sample=False, **decoding)
    assert cache.get_seq_length() == 4
    assert all(torch.equal(kept, now) for kept, now in zip(state, cache.state_buffers()))
    # an assistant beside beam search, which transformers says it ignores and hands to the forward (which failed
    # naming an unexpected argument 'assistant_model'), is named for what it is
    with pytest.raises(ValueError, match=r"assistant_model with beam_search: transformers assists only greedy"):
        model.generate(new, max_new_tokens=3, num_beams=2, assistant_model=model)


def test_a_gpn_as_the_draft_model_of_assisted_decoding_is_refused_clearly(model):
    """transformers refuses a stateful main model, not a stateful draft: with a GPN assisting a Llama it crops the
    GPN's cache after the first round, which failed with a RuntimeError from deep in transformers' cache code."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    sizes = dict(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2
    )
    main = LlamaForCausalLM(LlamaConfig(vocab_size=97, pad_token_id=PAD, **sizes)).eval()
    prompt = torch.randint(1, 97, (1, 4))
    with pytest.raises(ValueError, match=r"cannot be the assistant \(draft\) model .* cannot be rolled back"):
        main.generate(prompt, assistant_model=model, max_new_tokens=3, do_sample=False)


@torch.no_grad()
def test_generate_does_not_inspect_the_forward_at_every_token(model, monkeypatch):
    """generate() asks for the forward's signature at every token of a model defined outside transformers: a
    GPN's is computed once (`GPNForCausalLM.forward.__signature__`, the signature inspect itself gives), so 8
    tokens build it from the function's code no more than once (transformers' own processors aside)."""
    import inspect

    from modeling_gpn.modeling_gpn import GPNForCausalLM

    built, from_function = [], inspect._signature_from_function
    monkeypatch.setattr(
        inspect,
        "_signature_from_function",
        lambda cls, func, *a, **k: built.append(func) or from_function(cls, func, *a, **k),
    )
    model.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=8, do_sample=False)
    assert model.is_remote_code() and sum(func is GPNForCausalLM.forward for func in built) <= 1
    assert str(GPNForCausalLM.forward.__signature__) == str(from_function(inspect.Signature, GPNForCausalLM.forward))


@pytest.mark.parametrize("mode", ["greedy", "sample", "beams", "padded"])
def test_a_decoded_tokens_inputs_are_transformers_own(model, monkeypatch, mode):
    """A GPN builds a decoded token's inputs itself (`prepare_inputs_for_generation`; transformers' generic
    version asks the config and the model's device at every token): at every token of generate() they are the
    inputs transformers' own version gives (the same keys, equal contiguous tensors, the same cache), and
    transformers' version is called for the prompt's only."""
    import functools

    from transformers import GenerationMixin

    from modeling_gpn import GPNForCausalLM

    generic, own = GenerationMixin.prepare_inputs_for_generation, GPNForCausalLM.prepare_inputs_for_generation
    delegated, compared = [], []
    monkeypatch.setattr(
        GenerationMixin, "prepare_inputs_for_generation", lambda *a, **k: delegated.append(1) or generic(*a, **k)
    )

    @functools.wraps(own)
    def both(self, *args, **kwargs):
        mine, theirs = own(self, *args, **kwargs), generic(self, *args, **kwargs)
        assert mine.keys() == theirs.keys()
        for key, value in mine.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, theirs[key]) and value.is_contiguous(), key
            else:
                assert value is theirs[key] or value == theirs[key], key
        compared.append(mine["input_ids"].shape)
        return mine

    monkeypatch.setattr(GPNForCausalLM, "prepare_inputs_for_generation", both)
    prompt = torch.randint(1, 97, (2, 6), generator=torch.Generator().manual_seed(52))
    mask = torch.ones_like(prompt)
    settings = {"greedy": {}, "sample": {"do_sample": True}, "beams": {"num_beams": 2}, "padded": {}}[mode]
    if mode == "padded":
        mask[1, :2] = 0
        prompt[1, :2] = PAD
    torch.manual_seed(53)
    model.generate(prompt, attention_mask=mask, max_new_tokens=5, **({"do_sample": False} | settings))
    rows = 4 if mode == "beams" else 2
    assert compared == [torch.Size([rows, 6])] + [torch.Size([rows, 1])] * 4 and delegated == [1]  # (the prompt's)


@torch.no_grad()
def test_generate_goes_past_the_training_window_at_its_default_length():
    """`max_length_hint` (the training window) is no limit for generate(): a prompt longer than it decodes
    transformers' default 20 new tokens, as the plain forward continues it (not "max_length is set to 8" raised,
    which generate() did while the hint was also the config's `max_position_embeddings`)."""
    model = perturbed_model(tiny_config(eos_token_id=None, max_length_hint=8), seed=12)
    model.generation_config.pad_token_id = PAD
    assert getattr(model.config, "max_position_embeddings", None) is None  # (what generate() caps a length by)
    prompt = torch.randint(1, 97, (1, 12), generator=torch.Generator().manual_seed(5))
    generated = model.generate(prompt, do_sample=False)
    assert torch.equal(generated, argmax_continuation(model, prompt, 20))


@torch.no_grad()
@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_the_cache_kinds_a_gpn_cache_is_give_the_default_output(model, kind):
    """A GPNCache is one state a row, updated in place, of one size at every length: what `cache_implementation`
    "dynamic" and "static" ask for. Either gives the default call's tokens, on a GPNCache."""
    prompt = torch.randint(1, 97, (2, 5), generator=torch.Generator().manual_seed(6))
    kwargs = dict(max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
    default = model.generate(prompt, **kwargs)
    chosen = model.generate(prompt, cache_implementation=kind, **kwargs)
    assert torch.equal(chosen.sequences, default.sequences)
    assert isinstance(chosen.cache, GPNCache)


@pytest.mark.parametrize("kind", ["offloaded", "offloaded_static", "quantized", "sliding_window"])
def test_other_cache_kinds_are_refused_not_ignored(model, kind):
    prompt = torch.randint(1, 97, (1, 4))
    with pytest.raises(ValueError, match=rf"cache_implementation='{kind}' does not apply to a GPN"):
        model.generate(prompt, max_new_tokens=3, cache_implementation=kind)


def test_a_cache_kind_beside_a_cache_is_refused(model):
    prompt = torch.randint(1, 97, (1, 4))
    with pytest.raises(ValueError, match="both `cache_implementation` and `cache`"):
        model.generate(prompt, max_new_tokens=3, cache=GPNCache(model.config), cache_implementation="static")


def test_continuous_batching_is_refused_clearly(model):
    """transformers' continuous batching needs a paged attention cache: `generate_batch` and
    `generate(cache_implementation="paged")` say so, not a config dump from deep inside its scheduler."""
    with pytest.raises(ValueError, match="continuous batching .* a paged attention cache"):
        model.generate_batch([[5, 6, 7]])
    with pytest.raises(ValueError, match="continuous batching .* a paged attention cache"):
        model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, cache_implementation="paged")


@torch.no_grad()
def test_hub_decoding_methods_a_gpn_cannot_run_are_refused_by_name(model):
    """DoLa and contrastive search, which transformers 5 fetches from Hub repos, are refused saying why before
    anything is fetched (not transformers' call for trust_remote_code, then code written for layers and rollbacks);
    under HF_HUB_OFFLINE (the suite's) a Hub `custom_generate` not in the cache is said to be that, not a repo
    without the method."""
    prompt = torch.tensor([[5, 6, 7]])
    with pytest.raises(ValueError, match="DoLa .* a GPN has no earlier layers"):
        model.generate(prompt, max_new_tokens=3, dola_layers="low")
    with pytest.raises(ValueError, match="contrastive search .* cannot be rolled back"):
        model.generate(prompt, max_new_tokens=3, penalty_alpha=0.6, top_k=4, trust_remote_code=True)
    with pytest.raises(OSError, match="HF_HUB_OFFLINE is set .* not in the local Hub cache"):
        model.generate(prompt, max_new_tokens=3, custom_generate="me/no-such-method", trust_remote_code=True)


def test_the_text_generation_pipeline_gives_generates_tokens(tmp_path):
    """transformers' `pipeline("text-generation")` on a saved GPN folder with its tokenizer (what a Hub card's
    `pipeline_tag` promises): one prompt, and two prompts in one padded batch, give the text of greedy
    generate() on each prompt alone."""
    from transformers import pipeline

    from modeling_gpn.data import train_bpe_tokenizer

    tokenizer = train_bpe_tokenizer(["the cat sat on the mat. " * 20, "to be or not to be " * 20], 300)
    tokenizer.save_pretrained(tmp_path)
    model = perturbed_model(tiny_config(vocab_size=len(tokenizer), eos_token_id=None), seed=13)
    model.save_pretrained(tmp_path)
    prompts = ["the cat", "to be or not to be, that"]
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            whole = model.generate(ids, max_new_tokens=7, do_sample=False, pad_token_id=tokenizer.pad_token_id)
            expected.append(tokenizer.decode(whole[0], skip_special_tokens=True)[len(tokenizer.decode(ids[0])) :])
    generator = pipeline("text-generation", model=str(tmp_path), device="cpu")
    settings = dict(max_new_tokens=7, do_sample=False, return_full_text=False)
    assert generator(prompts[1], **settings)[0]["generated_text"] == expected[1]
    batched = generator(prompts, batch_size=2, **settings)
    assert [answer[0]["generated_text"] for answer in batched] == expected


@torch.no_grad()
def test_a_compiled_decode_step_counts_the_positions_an_eager_prefill_read(model):
    """A generate() given a `compile_config` compiles the decoding forward and runs the prompt's forward eagerly:
    the compiled steps continue a cache whose count of positions read is a Python int. They must add to it, not start it again from 0 (the count then said 4 after a 7-token prompt
    and 5 generated tokens, and a saved state or a continuation's mask was judged against it). Here the same
    compiled call is forced on CPU (`compile_config`, the eager backend), and a hand-written loop does the same."""
    from transformers import CompileConfig

    torch._dynamo.reset()
    prompt = torch.randint(1, 97, (2, 7), generator=torch.Generator().manual_seed(60))
    compile_config = CompileConfig(backend="eager")
    compile_config._compile_all_devices = True  # (on CPU too)
    out = model.generate(
        prompt, max_new_tokens=5, do_sample=False, compile_config=compile_config, return_dict_in_generate=True
    )
    assert torch.equal(out.sequences, argmax_continuation(model, prompt, 5))
    assert out.cache.get_seq_length() == 7 + 4  # the prompt and every generated token but the last
    # continued as docs/cache.md says a compiled generate()'s cache is: the new positions, a mask of read + new columns
    more = torch.cat([out.sequences[:, 11:], torch.tensor([[5, 6], [7, 8]])], dim=1)
    mask = torch.ones(2, 11 + 3, dtype=torch.long)
    continued = model.generate(more, attention_mask=mask, cache=out.cache, max_new_tokens=2, do_sample=False)
    whole = torch.cat([out.sequences, more[:, 1:]], dim=1)
    assert torch.equal(continued[:, 3:], argmax_continuation(model, whole, 2)[:, 14:])

    compiled = torch.compile(model, backend="eager", fullgraph=True)
    cache = model(prompt, use_cache=True).cache
    for step in range(3):
        compiled(prompt[:, step : step + 1], cache=cache, use_cache=True)
        assert cache.get_seq_length() == 7 + step + 1


def test_generate_compiles_the_decoding_forward_only_when_asked(model, monkeypatch):
    """transformers' generate() compiles the decoding forward by itself on CUDA for a compileable cache (a GPNCache
    is one): for a GPN that traced the plain recurrence in place of the fast path's kernels and graphs. It does so
    only given a `compile_config`. Asked of the criterion generate() consults, on a model that says it is on CUDA (no
    tensor moves: only the answer is read)."""
    from transformers import CompileConfig, GenerationConfig

    monkeypatch.setattr(type(model), "device", property(lambda self: torch.device("cuda")))
    kwargs = {"cache": GPNCache()}
    assert not model._valid_auto_compile_criteria(kwargs, GenerationConfig())
    assert model._valid_auto_compile_criteria(kwargs, GenerationConfig(compile_config=CompileConfig()))
    assert not model._valid_auto_compile_criteria(
        kwargs, GenerationConfig(compile_config=CompileConfig(), disable_compile=True)
    )


@torch.no_grad()
@pytest.mark.parametrize("mode", ["greedy", "beam", "sample"])
def test_non_finite_logits_are_refused_by_name_not_decoded(mode):
    """A NaN weight, or inf in a prompt's embeddings, makes the logits non-finite; generate() picked tokens from
    them in silence (greedy's argmax takes a NaN for the largest: a NaN in the embedding row of token 50, which the
    prompt never reads, made the first generated token 50 and, its row read, every later one 0). Refused by name,
    in every decoding mode."""
    model = perturbed_model(tiny_config(eos_token_id=None), seed=11)
    model.generation_config.pad_token_id = PAD
    settings = {"greedy": {}, "beam": {"num_beams": 2}, "sample": {"do_sample": True}}[mode]
    prompt = torch.randint(1, 50, (2, 5), generator=torch.Generator().manual_seed(61))
    model.generate(prompt, max_new_tokens=3, **settings)  # (finite: decodes)
    embeds = model.get_input_embeddings()(prompt)
    embeds[1, 2, 0] = float("inf")
    with pytest.raises(ValueError, match=r"not finite \(NaN or inf\) in rows \[1\].*the prompt's inputs_embeds"):
        model.generate(inputs_embeds=embeds, max_new_tokens=3, **settings)
    model.model.embed_tokens.weight[50, 0] = float("nan")
    with pytest.raises(ValueError, match=r"not finite .* parameter model\.embed_tokens\.weight"):
        model.generate(prompt, max_new_tokens=3, **settings)


@torch.no_grad()
def test_a_float16_overflow_is_refused_naming_float16_not_decoded():
    """float16 weights whose FFN products pass 65504 turn the (float32) state NaN: at a decoded token, generate()
    returned token 0 for every later token in silence (greedy's argmax takes a NaN for the largest), the prompt's
    check having seen finite logits; in the prompt, its error said "no parameter". Both are refused naming float16
    and what to load instead; the same weights in float32 decode (the overflow is float16's range, not the model's)."""
    prompt = torch.randint(1, 97, (1, 6), generator=torch.Generator().manual_seed(1))
    for scale, when in ((255, "at a decoded token after a finite prompt"), (300, "after the prompt")):
        model = perturbed_model(tiny_config(eos_token_id=None), seed=0)
        model.model.predict_layers[0].ffn_in.weight.mul_(scale)  # (its products pass 65504 at some token)
        assert model.generate(prompt, max_new_tokens=20, do_sample=False).shape == (1, 26)
        with pytest.raises(ValueError, match=rf"{when}.*the weights are float16, whose largest value is 65504"):
            model.half().generate(prompt, max_new_tokens=20, do_sample=False)


def test_prompts_and_masks_of_the_wrong_shape_are_refused_by_name(model):
    """generate() reads the batch and length off the prompt and the mask before the model sees them, and drops an
    all-ones mask unread: a prompt of shape (seq,) failed with a bare IndexError from inside transformers, and an
    all-ones mask of another batch or length was ignored in silence. Each is named; a mask over the whole sequence
    of a continued cache (longer than the prompt) is still taken."""
    prompt = torch.randint(1, 97, (2, 7), generator=torch.Generator().manual_seed(62))
    with pytest.raises(ValueError, match=r"input_ids of shape \(batch, seq\), got \(7,\).*ids\[None\]"):
        model.generate(prompt[0], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"attention_mask of shape \(batch, seq\), got \(7,\)"):
        model.generate(prompt[:1], attention_mask=torch.ones(7, dtype=torch.long), max_new_tokens=2)
    for shape in ((1, 7), (2, 5), (2, 9)):
        with pytest.raises(ValueError, match=rf"attention_mask has shape \({shape[0]}, {shape[1]}\) but the prompt"):
            model.generate(prompt, attention_mask=torch.ones(shape, dtype=torch.long), max_new_tokens=2)
    embeds = model.get_input_embeddings()(prompt).detach()
    with pytest.raises(ValueError, match=r"attention_mask has shape \(2, 5\) but the prompt has 2 rows of 7"):
        model.generate(inputs_embeds=embeds, attention_mask=torch.ones(2, 5, dtype=torch.long), max_new_tokens=2)
    with torch.no_grad():
        cache = model(prompt, use_cache=True).cache
    new = torch.randint(1, 97, (2, 3), generator=torch.Generator().manual_seed(63))
    whole = torch.ones(2, 7 + 3, dtype=torch.long)
    continued = model.generate(new, attention_mask=whole, cache=cache, max_new_tokens=2, do_sample=False)
    assert torch.equal(continued[:, 3:], argmax_continuation(model, torch.cat([prompt, new], 1), 2)[:, 10:])


def test_generation_values_that_would_be_wrong_in_silence_are_refused_by_name(model):
    """num_return_sequences=0 gave one sequence a row; an eos_token_id outside the vocabulary was never generated
    (generation ran to its length); a pad_token_id outside it was fed back after a row's end and blamed on the
    prompt's tokenizer; beam search with a huge max_new_tokens tried to preallocate terabytes. Each is named before
    anything runs."""
    prompt = torch.randint(1, 97, (2, 3), generator=torch.Generator().manual_seed(64))
    with pytest.raises(ValueError, match="num_return_sequences must be at least 1, got 0"):
        model.generate(prompt, max_new_tokens=2, do_sample=True, num_return_sequences=0)
    for name, value in (("eos_token_id", 97), ("eos_token_id", [5, -1]), ("pad_token_id", 500)):
        bad = value if isinstance(value, int) else value[1]
        with pytest.raises(
            ValueError, match=rf"{name}={bad} \(generation config\) is outside the vocabulary \[0, 97\)"
        ):
            model.generate(prompt, max_new_tokens=2, **{name: value})
    with pytest.raises(ValueError, match=r"Beam search preallocates its sequences for max_length=10000000000003 "):
        model.generate(prompt, max_new_tokens=10**13, num_beams=2)


@pytest.mark.parametrize("size", [0, -1, 1.5, True])
def test_a_prefill_chunk_size_that_is_not_a_positive_integer_is_refused_by_name(model, size):
    """transformers' chunked prefill split the prompt by it: 0, -1 and 1.5 failed inside torch's `split` (a
    RuntimeError or TypeError naming split sizes), True read one position a chunk."""
    prompt = torch.randint(1, 97, (2, 5), generator=torch.Generator().manual_seed(65))
    with pytest.raises(ValueError, match=rf"prefill_chunk_size must be a positive integer .* got {size!r}"):
        model.generate(prompt, max_new_tokens=2, prefill_chunk_size=size)


@torch.no_grad()
@pytest.mark.parametrize("given", ["new positions", "whole sequence"])
def test_sampling_several_sequences_from_a_given_state(model, given):
    """`num_return_sequences=3` continuing a cache of one row a prompt: transformers repeats the prompts' rows but
    not a cache's, and generate() failed on "The cache holds 2 rows but the input has 6". The state's rows are
    repeated with them, and the samples, tokens and logits, are those of the uninterrupted run with the same seed;
    a refused call leaves them as they were."""
    prompt = torch.randint(1, 97, (2, 7), generator=torch.Generator().manual_seed(64))
    more = torch.randint(1, 97, (2, 3), generator=torch.Generator().manual_seed(65))
    settings = dict(do_sample=True, num_return_sequences=3, max_new_tokens=4, return_dict_in_generate=True)
    torch.manual_seed(66)
    whole = model.generate(torch.cat([prompt, more], dim=1), output_logits=True, **settings)
    cache = model(prompt, use_cache=True).cache
    torch.manual_seed(66)
    if given == "new positions":
        mask = torch.ones(2, 7 + 3, dtype=torch.long)
        continued = model.generate(more, attention_mask=mask, cache=cache, output_logits=True, **settings)
        new_tokens = continued.sequences[:, 3:]
    else:
        continued = model.generate(torch.cat([prompt, more], dim=1), cache=cache, output_logits=True, **settings)
        new_tokens = continued.sequences[:, 10:]
    assert torch.equal(new_tokens, whole.sequences[:, 10:])
    torch.testing.assert_close(torch.stack(continued.logits), torch.stack(whole.logits), atol=1e-5, rtol=0)
    assert continued.cache is cache and cache.get_seq_length() == 10 + 3
    # a refused continuation (the whole sequence with nothing new) leaves the given cache as it was: two rows
    cache = model(prompt, use_cache=True).cache
    with pytest.raises(ValueError, match="nothing new"):
        model.generate(prompt, cache=cache, **settings)
    assert cache.state_layer.batch_size == 2


@torch.no_grad()
def test_a_whole_sequence_departing_from_what_the_cache_read_is_refused_not_read_twice(model, tmp_path):
    """transformers' recipe that reuses a prompt's cache (docs "Caching": a cache of PROMPT, then
    `generate(**tokenizer(PROMPT + question), cache=copy.deepcopy(prompt_cache))`): PROMPT's last token tokenized
    alone (" ") is another in the whole text (" to"), so the whole sequence does not begin with the positions the
    cache read, and it was read as new positions after them: the whole prompt read twice, in silence. It begins with
    the first half of what the cache's first call read, so it is refused, saying what to pass; so are as many
    positions beginning so. Fewer are new positions (a loop feeding each question alone, repeating a short first
    prompt's opening), new positions that begin otherwise are read as before, and the same positions with a mask
    over the whole sequence are new positions as always."""
    prompt = torch.randint(1, 97, (1, 8), generator=torch.Generator().manual_seed(81))
    question = torch.randint(1, 97, (1, 3), generator=torch.Generator().manual_seed(82))
    prompt_cache = model(prompt, use_cache=True).cache
    retokenized = torch.cat([prompt[:, :7], (prompt[:, 7:] % 96) + 1, question], dim=1)  # last prompt token differs
    settings = dict(max_new_tokens=4, do_sample=False)
    for given in (retokenized, retokenized[:, :8]):  # more, as many as were read
        cache = copy.deepcopy(prompt_cache) if given is retokenized else prompt_cache.fork(1)  # (both recipes' copies)
        with pytest.raises(ValueError, match=r"rows \[0\] begin with the first 4 positions the cache read but do"):
            model.generate(given, attention_mask=torch.ones_like(given), cache=cache, **settings)
        assert cache.get_seq_length() == 8  # nothing read
    mask = torch.ones(1, 8 + retokenized.shape[1], dtype=torch.long)  # meant as new positions: said so
    continued = model.generate(retokenized, attention_mask=mask, cache=copy.deepcopy(prompt_cache), **settings)
    assert torch.equal(continued[:, -4:], argmax_continuation(model, torch.cat([prompt, retokenized], 1), 4)[:, -4:])
    for new in (torch.cat([question, prompt], dim=1), retokenized[:, :7]):  # not beginning as the history; fewer
        continued = model.generate(new, cache=copy.deepcopy(prompt_cache), **settings)
        assert torch.equal(continued[:, -4:], argmax_continuation(model, torch.cat([prompt, new], 1), 4)[:, -4:])
    prompt_cache.save(tmp_path / "prompt.safetensors")  # a saved prompt state refuses it as its cache did
    loaded = GPNCache.load(tmp_path / "prompt.safetensors", model)
    with pytest.raises(ValueError, match=r"rows \[0\] begin with the first 4 positions the cache read but do"):
        model.generate(retokenized, attention_mask=torch.ones_like(retokenized), cache=loaded, **settings)


@torch.no_grad()
def test_continuing_with_a_mask_over_the_new_positions_in_prefill_chunks(model):
    """A cache continued with the new positions and a mask over them only (accepted, docs/cache.md), padded in one
    row, read in transformers' prefill chunks (`prefill_chunk_size`): its chunked prefill slices the mask as one over
    the whole sequence, so each chunk got another chunk's columns and a padded position was read as real, in
    silence. Tokens and logits are the uninterrupted run's."""
    prompt = torch.randint(1, 97, (2, 7), generator=torch.Generator().manual_seed(67))
    new = torch.randint(1, 97, (2, 5), generator=torch.Generator().manual_seed(68))
    new_mask = torch.ones(2, 5, dtype=torch.long)
    new_mask[0, :2] = 0
    settings = dict(max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_logits=True)
    whole_mask = torch.cat([torch.ones(2, 7, dtype=torch.long), new_mask], dim=1)
    whole = model.generate(torch.cat([prompt, new], dim=1), attention_mask=whole_mask, **settings)
    cache = model(prompt, use_cache=True).cache
    continued = model.generate(new, attention_mask=new_mask, cache=cache, prefill_chunk_size=2, **settings)
    assert torch.equal(continued.sequences[:, 5:], whole.sequences[:, 12:])
    torch.testing.assert_close(torch.stack(continued.logits), torch.stack(whole.logits), atol=1e-5, rtol=0)


@torch.no_grad()
def test_continuing_with_new_embeddings_or_in_prefill_chunks_reads_every_new_position(model):
    """A cache continued with the new positions as inputs_embeds (a mask over the whole sequence), or as ids
    without a mask in prefill chunks: transformers 5.25 slices what a cache is continued with by the positions it
    read, as if it were the whole sequence, which dropped new positions in silence. Tokens are the uninterrupted
    run's, and the cache read every position."""
    prompt = torch.randint(1, 97, (2, 3), generator=torch.Generator().manual_seed(71))
    new = torch.randint(1, 97, (2, 6), generator=torch.Generator().manual_seed(72))
    settings = dict(max_new_tokens=3, do_sample=False)
    whole = model.generate(torch.cat([prompt, new], dim=1), **settings)[:, 9:]
    cache = model(prompt, use_cache=True).cache
    embeds = model.get_input_embeddings()(new)
    mask = torch.ones(2, 9, dtype=torch.long)
    assert torch.equal(model.generate(inputs_embeds=embeds, attention_mask=mask, cache=cache, **settings), whole)
    assert cache.get_seq_length() == 9 + 2
    cache = model(prompt, use_cache=True).cache
    assert torch.equal(model.generate(new, cache=cache, prefill_chunk_size=2, **settings)[:, 6:], whole)
    assert cache.get_seq_length() == 9 + 2

    # The same on any transformers 5: what the prefill is handed from a kept state follows transformers' own
    # convention for new positions (a mask, or the length of the all-ones one generate() dropped, over the whole
    # sequence: 5.25's prefill slices ids only when that length is theirs), and is fed whole whatever slice
    # transformers asks for (`next_sequence_length`: 5.25 always slices inputs_embeds by the positions read)
    from transformers import GenerationConfig

    from modeling_gpn.generation import continue_from_cache

    cache = model(prompt, use_cache=True).cache
    config = GenerationConfig()
    config._mask_length = 6  # generate() dropped an all-ones mask over the 6 new positions
    ids, kwargs, seen = continue_from_cache(new, config, {"cache": cache})
    assert torch.equal(ids, new) and seen == 3 and config._mask_length == 3 + 6
    for given in (dict(input_ids=new), dict(input_ids=new[:, :0], inputs_embeds=embeds)):
        inputs = model.prepare_inputs_for_generation(
            **given, next_sequence_length=3, cache=cache, is_first_iteration=True
        )
        assert inputs["inputs_embeds" if "inputs_embeds" in given else "input_ids"].shape[1] == 6


@torch.no_grad()
def test_a_continued_whole_sequence_whose_mask_pads_what_the_cache_read_is_refused_by_name(model):
    """A row that ends (EOS) while others go on is fed pad tokens, unmasked, and its cache reads them as tokens; given
    the whole sequence back, transformers infers a mask from pad_token_id that marks them as padding. After two rounds
    in which each row ended first once, no row matched its fingerprint and the whole sequence was read again as new
    positions, in silence (45 positions read, not 25); after one round the rows disagreed, refused for the wrong
    reason. Named instead; the whole sequence with 1 at those positions continues as one run."""
    prompt = torch.randint(1, 97, (2, 7), generator=torch.Generator().manual_seed(0))
    first = model.generate(prompt, max_new_tokens=6, eos_token_id=[43], do_sample=False, return_dict_in_generate=True)
    read = first.cache.get_seq_length()
    sequence = torch.cat([first.sequences, torch.tensor([[5, 6], [7, 8]])], dim=1)
    second = model.generate(
        sequence[:, read:],
        attention_mask=torch.ones(2, sequence.shape[1], dtype=torch.long),
        cache=first.cache,
        max_new_tokens=6,
        eos_token_id=[54],
        do_sample=False,
        return_dict_in_generate=True,
    )
    sequence = torch.cat([sequence[:, :read], second.sequences, torch.tensor([[9, 10], [11, 12]])], dim=1)
    ended = sequence[:, 7:-2] == PAD
    assert ended[0].any() and ended[1].any()  # (each row ended with EOS while the other went on, once)
    cache = second.cache
    with pytest.raises(ValueError, match=r"rows \[0, 1\] begin with what the cache read, but the attention_mask marks"):
        model.generate(sequence, cache=cache, max_new_tokens=3, do_sample=False)
    assert cache.get_seq_length() == 20
    continued = model.generate(
        sequence, attention_mask=torch.ones_like(sequence), cache=cache, max_new_tokens=3, do_sample=False
    )
    assert sequence.shape[1] == 23 and cache.get_seq_length() == 23 + 2  # (the last token generated is not read)
    assert torch.equal(continued, argmax_continuation(model, sequence, 3))


@torch.no_grad()
@pytest.mark.parametrize("mode", ["greedy", "sample", "beams"])
def test_a_process_that_finished_first_under_synced_gpus_keeps_its_sequences_state(model, monkeypatch, mode):
    """Under `synced_gpus` (on by itself for generate() under DeepSpeed ZeRO-3 or FSDP with more than one
    process), a process whose rows have all finished goes on running the forward on its last tokens until every
    process has finished (transformers' loops: forward, then `continue`), to keep the collectives matched. A
    GPN's state read them: the cache returned, and the caller's, held a state past the sequences, and continuing
    it with the whole sequence gave logits off by 0.01 in silence. They run on a copy: the cache is the one the
    same generate() without `synced_gpus` returns, and continues as a fresh read. The other process is the
    all-reduce of transformers' `_has_unfinished_sequences` (the only collective the loop runs itself): still
    decoding 3 steps after this one finished."""
    calls = []

    def another_process_still_decoding(flag, *args, **kwargs):  # its flag (1: unfinished) added to this one's
        calls.append(float(flag))
        flag += 1.0 if len(calls) <= 3 + 3 else 0.0

    prompt = torch.randint(1, 97, (2, 5), generator=torch.Generator().manual_seed(70))
    settings = {"greedy": {}, "sample": {"do_sample": True}, "beams": {"num_beams": 2}}[mode]
    settings = {"do_sample": False, "max_new_tokens": 3, "return_dict_in_generate": True} | settings
    torch.manual_seed(71)
    alone = model.generate(prompt, **settings)
    monkeypatch.setattr(torch.distributed, "all_reduce", another_process_still_decoding)
    given = GPNCache()
    torch.manual_seed(71)
    synced = model.generate(prompt, cache=given, synced_gpus=True, **settings)
    assert calls == [1.0, 1.0, 1.0] + [0.0] * 4  # 3 tokens picked, then 3 idle forwards (and the last check)
    assert torch.equal(synced.sequences, alone.sequences) and synced.cache is given
    assert given.get_seq_length() == alone.cache.get_seq_length() == 5 + 2
    for kept, reference in zip(given.get_state(), alone.cache.get_state()):
        assert torch.equal(kept, reference)
    assert torch.equal(given.read_fingerprint(), alone.cache.read_fingerprint())
    if mode != "beams":  # (a beam search's cache rows are its last running beams: docs/cache.md)
        whole = torch.cat([synced.sequences, torch.full((2, 1), 9)], dim=1)
        continued = model.generate(whole, cache=given, **(settings | {"max_new_tokens": 1}), output_logits=True)
        fresh = model(whole).logits[:, -1]
        torch.testing.assert_close(continued.logits[0], fresh, atol=1e-5, rtol=0)
