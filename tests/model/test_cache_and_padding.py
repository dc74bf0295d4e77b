"""The cached, chunked, padded and batched paths equal the plain full-sequence forward."""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import LinearAttentionLayer

from modeling_gpn import GPNCache
from modeling_gpn.bench.memory import bytes_held

from ..tiny_models import perturbed_model, tiny_config

VARIANTS = {
    "gpn+m": dict(),
    "gpn": dict(use_memory=False),
    "gpn+m-2l-bias": dict(num_predict_layers=2, use_decoder_bias=True),
}


@pytest.fixture(params=list(VARIANTS), scope="module")
def model(request):
    return perturbed_model(tiny_config(**VARIANTS[request.param]), seed=1)


@torch.no_grad()
@pytest.mark.parametrize("length", [1, 63, 200])
def test_full_equals_token_by_token_equals_random_chunks(model, length):
    generator = torch.Generator().manual_seed(length)
    ids = torch.randint(0, model.config.vocab_size, (2, length), generator=generator)
    full = model(ids, use_cache=True)

    cache = GPNCache(model.config)
    stepped = torch.cat([model(ids[:, t : t + 1], cache=cache, use_cache=True).logits for t in range(length)], dim=1)
    torch.testing.assert_close(stepped, full.logits, atol=1e-5, rtol=0)

    cache, start, chunks = GPNCache(model.config), 0, []
    while start < length:
        size = int(torch.randint(1, 40, (1,), generator=generator))
        chunks.append(model(ids[:, start : start + size], cache=cache, use_cache=True).logits)
        start += size
    torch.testing.assert_close(torch.cat(chunks, dim=1), full.logits, atol=1e-5, rtol=0)
    for ours, theirs in zip(cache.get_state(), full.cache.get_state()):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    assert cache.get_seq_length() == length


def pad_rows(rows: list[torch.Tensor], layout: str, width: int, generator: torch.Generator):
    """Place each row's tokens in a (batch, width) grid: left-padded, right-padded or with holes."""
    ids = torch.full((len(rows), width), 3, dtype=torch.long)  # pad id 3 is a real, non-zero token
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        n = len(row)
        if layout == "left":
            slots = torch.arange(width - n, width)
        elif layout == "right":
            slots = torch.arange(n)
        else:  # holes anywhere, including at both ends
            slots = torch.randperm(width, generator=generator)[:n].sort().values
        ids[i, slots] = row
        mask[i, slots] = 1
    return ids, mask


@torch.no_grad()
@pytest.mark.parametrize("layout", ["left", "right", "holes"])
def test_padding_leaves_the_state_unchanged(model, layout):
    generator = torch.Generator().manual_seed(7)
    lengths, width = [5, 17, 11], 24
    rows = [torch.randint(0, model.config.vocab_size, (n,), generator=generator) for n in lengths]
    ids, mask = pad_rows(rows, layout, width, generator)
    batched = model(ids, attention_mask=mask, use_cache=True)
    batched_state = batched.cache.get_state()
    for i, row in enumerate(rows):
        alone = model(row[None], use_cache=True)
        real = mask[i].bool()
        # at every real token: the logits of the row run alone
        torch.testing.assert_close(batched.logits[i, real], alone.logits[0], atol=1e-5, rtol=0)
        # and the same final cache
        for ours, solo in zip(batched_state, alone.cache.get_state()):
            torch.testing.assert_close(ours[i], solo[0], atol=1e-5, rtol=0)


@torch.no_grad()
def test_padding_is_exactly_inert():
    """Padded positions leave (p, g, M) bit-for-bit unchanged, even with nonzero biases and gates."""
    model = perturbed_model(tiny_config(), seed=2)
    ids = torch.randint(0, 97, (1, 6))
    prefix = model(ids, use_cache=True)
    cache = prefix.cache
    before = cache.get_state()
    model(torch.randint(0, 97, (1, 5)), attention_mask=torch.zeros(1, 5, dtype=torch.long), cache=cache, use_cache=True)
    for old, new in zip(before, cache.get_state()):
        assert torch.equal(old, new)


@pytest.mark.parametrize("fast", [False, True], ids=["plain", "fast"])
@pytest.mark.parametrize("layout", ["left", "inside"])
def test_a_padded_training_batch_has_the_loss_and_gradients_of_its_rows_alone(layout, fast):
    """Training on a padded batch (labels -100 on the padding, `num_items_in_batch` as `Trainer` passes it, an
    all-padding row among them): the loss and every gradient are those of the rows run alone, on either path,
    and bit-for-bit the same whatever ids the padding holds. (Left padding labels its first real token -100 too:
    the last pad's logits, the empty state's, would target it, docs/transformers.md. Right padding alone would
    test nothing here: a causal loss never reads what comes after its targets.)"""
    from ..backend_observer import FAST_PATH, PLAIN_PATH, ran

    model = perturbed_model(tiny_config(), seed=3).train()
    generator = torch.Generator().manual_seed(4)
    rows = [torch.randint(1, 97, (n,), generator=generator) for n in (7, 1, 12)]
    num_items = sum(len(row) - 1 for row in rows)

    def gradients():
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    model.model.use_fast_path = False
    model.zero_grad(set_to_none=True)
    expected = sum(model(row[None], labels=row[None], num_items_in_batch=num_items).loss for row in rows)
    expected.backward()
    expected_grads = gradients()

    model.model.use_fast_path = fast
    ids, mask = pad_rows(rows, "left" if layout == "left" else "right", 14, generator)
    if layout == "inside":  # padding between real tokens and after them, each row's first token first
        for i, row in enumerate(rows):
            slots = torch.cat(
                [
                    torch.zeros(1, dtype=torch.long),
                    torch.randperm(13, generator=generator)[: len(row) - 1].sort().values + 1,
                ]
            )
            ids[i], mask[i] = 3, 0
            ids[i, slots], mask[i, slots] = row, 1
    ids, mask = torch.cat([ids, torch.zeros_like(ids[:1])]), torch.cat([mask, torch.zeros_like(mask[:1])])
    runs = []
    for pad_id in (0, 96):
        padded = ids.masked_fill(mask == 0, pad_id)
        model.zero_grad(set_to_none=True)
        with ran(FAST_PATH if fast else PLAIN_PATH, not_ran=(PLAIN_PATH if fast else FAST_PATH,)):
            labels = padded.masked_fill(mask == 0, -100)
            labels[torch.arange(len(mask)), mask.argmax(1)] = -100  # each row's first real token: no target
            loss = model(padded, attention_mask=mask, labels=labels, num_items_in_batch=num_items).loss
            loss.backward()
        runs.append((loss.detach(), gradients()))
    (loss, grads), (other_loss, other_grads) = runs
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
    assert grads.keys() == expected_grads.keys()
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
        assert torch.equal(other_grads[name], grads[name]), name
    assert torch.equal(other_loss, loss)


def test_cache_size_does_not_grow_with_length():
    """The state (`nbytes`) and everything the cache holds beside it (`bytes_held`: the fingerprint of what it read
    too) are the same after 16 and 4,096 positions."""
    model = perturbed_model(tiny_config(), seed=3)
    with torch.no_grad():
        short = model(torch.randint(0, 97, (1, 16)), use_cache=True).cache
        long = model(torch.randint(0, 97, (1, 4096)), use_cache=True).cache
    assert short.nbytes() == long.nbytes() == 4 * model.config.state_floats_per_row
    assert bytes_held(short) == bytes_held(long)
    assert long.get_seq_length() == 4096


def test_a_cache_says_in_one_line_what_it_holds():
    """`repr(cache)` (a notebook's display): empty, or its rows, positions read, the state's size, dtype and device,
    and a graph it carries; never the state's values."""
    from modeling_gpn import GPNCache

    model = perturbed_model(tiny_config(), seed=3)
    assert repr(GPNCache()) == "GPNCache(empty: the next forward starts from the zero state)"
    with torch.no_grad():
        cache = model(torch.randint(0, 97, (2, 5)), use_cache=True).cache
    mib = cache.nbytes() / 2**20
    assert repr(cache) == f"GPNCache(rows=2, positions read=5, state {mib:.2f} MiB float32 on cpu)"
    model(torch.randint(0, 97, (2, 3)), cache=cache, use_cache=True)  # (with gradients: the graph is kept)
    assert repr(cache).endswith(
        "positions read=8, state " + f"{mib:.2f} MiB float32 on cpu, carries an autograd graph (detach() ends it))"
    )
    assert "carries" not in repr(cache.detach())
    cache.state_layer.interrupted = True  # (as an interrupt between two writes leaves it: test_interrupted_calls.py)
    assert repr(cache).endswith("on cpu, interrupted part-way through a call: refused until reset())")


@torch.no_grad()
def test_the_cache_is_exactly_constant_in_size_from_its_first_position():
    """Every tensor a cache holds, the fingerprint of what it read included, adds up to the same bytes after 1,
    2, 100 and 3,000 positions: in generate() (measured after each of its forward calls: 100 decoded tokens,
    then a continuation of that cache given 2,900 new positions) and in a hand-written decode loop (3,000
    calls of one token). A cache that kept a record per decode call grew by one tensor a token between folds."""
    model = perturbed_model(tiny_config(eos_token_id=None), seed=3)
    checkpoints = (1, 2, 100, 3000)
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, 97, (2, 1), generator=generator)
    rows = prompt.shape[0]
    settings = dict(do_sample=False, pad_token_id=0)

    through_generate = {}

    def measure(module, args, kwargs, output) -> None:
        read = output.cache.get_seq_length()
        if read in checkpoints:
            through_generate[read] = bytes_held(output.cache)

    hook = model.model.register_forward_hook(measure, with_kwargs=True)
    try:
        first = model.generate(prompt, max_new_tokens=100, return_dict_in_generate=True, **settings)
        unread = first.sequences[:, first.cache.get_seq_length() :]
        more = torch.cat([unread, torch.randint(1, 97, (rows, 2899), generator=generator)], dim=1)
        model.generate(more, cache=first.cache, max_new_tokens=1, **settings)
    finally:
        hook.remove()

    through_loop = {}
    out = model(prompt, use_cache=True)
    cache = out.cache
    while cache.get_seq_length() <= checkpoints[-1]:
        if cache.get_seq_length() in checkpoints:
            through_loop[cache.get_seq_length()] = bytes_held(cache)
        out = model(out.logits[:, -1:].argmax(-1), cache=cache, use_cache=True)

    assert set(through_generate) == set(through_loop) == set(checkpoints)
    sizes = {
        **{f"generate@{k}": v for k, v in through_generate.items()},
        **{f"loop@{k}": v for k, v in through_loop.items()},
    }
    assert len(set(sizes.values())) == 1, sizes
    # the state (p, g, M), the fingerprint of what it read (2 int64 per row), and what transformers' own base
    # layer holds before any state, of one size at every length (5.25: a count of positions, which a GPN does not
    # use; 5.24: nothing)
    upstream = bytes_held(LinearAttentionLayer(number_of_states=3))
    assert sizes["loop@1"] == 4 * model.config.state_floats_per_row * rows + 2 * 8 * rows + upstream, sizes


def test_bytes_held_counts_every_storage_once_in_slots_too_and_status_kib_reads_the_process():
    """`bench.memory.bytes_held` (what the cache-size test above and benchmarks/decode_loop_ab.py count) reaches
    tensors kept in `__slots__`, a base class's included (a copy that read only `__dict__` counted such a cache as
    smaller than it is), counts a view's storage once, and goes through no weak reference nor `nn.Module`.
    `status_kib` reads this process's figures, and refuses a field it cannot find by name."""
    import weakref

    from modeling_gpn.bench.memory import status_kib

    class Base:
        __slots__ = ("kept",)

    class Slotted(Base):
        __slots__ = "more"  # (one name)

    held, more = torch.zeros(100), torch.zeros(30, dtype=torch.float64)
    slotted = Slotted()
    slotted.kept, slotted.more = {"state": held, "view": held[10:20]}, [more, (more.T,)]
    assert bytes_held(slotted) == 400 + 240

    class Plain:
        pass

    plain = Plain()
    elsewhere = torch.zeros(1000)  # (a model's, say: what a cache refers to without holding it)
    plain.slotted, plain.model = slotted, torch.nn.Linear(50, 50)
    plain.ref, plain.proxy = weakref.ref(elsewhere), weakref.proxy(elsewhere)
    assert bytes_held(plain) == 400 + 240

    rss = status_kib("VmRSS")
    assert 10_000 < rss <= status_kib("VmHWM")  # (a Python with torch holds tens of MiB at least)
    with pytest.raises(ValueError, match="has no 'VmNothing' line"):
        status_kib("VmNothing")


def test_bf16_weights_keep_a_float32_state():
    model = perturbed_model(tiny_config(), seed=4).to(torch.bfloat16)
    ids = torch.randint(0, 97, (2, 32))
    with torch.no_grad():
        out = model(ids, use_cache=True, output_predicted_states=True)
    assert out.predicted_states.dtype == torch.float32
    assert all(state.dtype == torch.float32 for state in out.cache.get_state())
    reference = perturbed_model(tiny_config(), seed=4)
    with torch.no_grad():
        fp32 = reference(ids).logits
    assert (out.logits.float() - fp32).abs().max() < 0.25 * fp32.abs().max()
