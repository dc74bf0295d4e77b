"""A decoded token in one C call (issue 28: `fast_recurrence.fast_decode_token`, `memory_kernels.DecodePlan`):
the embedding row, the token projection, the step, the decoder and the logits of a one-token forward with its
cache. It computes what the forward computes otherwise (the step kernels and the few-row products), never
runs where a module it would not call is wrapped, hooked or replaced, sees weights edited between two calls
on one cache, and refuses bad ids as the forward does. Each test shows which path ran
(`tests/backend_observer.py`)."""

from __future__ import annotations

import copy

import pytest
import torch

from ..backend_observer import C_PRODUCTS, DECODE_CALLS, FAST_PATH, PLAIN_PATH, ran
from ..environment import require_c_kernels
from ..tiny_models import perturbed_model, tiny_config


@pytest.fixture
def model():
    require_c_kernels()
    return perturbed_model(tiny_config(num_predict_layers=2), seed=21).eval()


def decode(model, steps: int = 3, rows: int = 2, **generate) -> torch.Tensor:
    """generate()'s logits of `steps` greedy tokens after a 5-token prompt, stacked (steps, rows, vocab)."""
    ids = torch.randint(1, 97, (rows, 5), generator=torch.Generator().manual_seed(22))
    generate = dict(max_new_tokens=steps, do_sample=False, output_logits=True, return_dict_in_generate=True) | generate
    return torch.stack(model.generate(ids, attention_mask=torch.ones_like(ids), **generate).logits)


def as_step_and_products(monkeypatch, function, *args):
    """`function(*args)` with the one-call decode off (GPN_DECODE_KERNEL=0): the step kernels and products."""
    with monkeypatch.context() as patch:
        patch.setenv("GPN_DECODE_KERNEL", "0")
        with ran(FAST_PATH, C_PRODUCTS, not_ran=(DECODE_CALLS,)):
            return function(*args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_generate_decodes_in_one_call_as_the_step_and_products_do(one_thread, model, monkeypatch, dtype):
    """Greedy generate() of 2 rows: its tokens in one C call each = the same tokens through the step kernels
    and the few-row products (the same products: float32's last bits, one bf16 rounding) and = the plain loop
    within the dtype's rounding."""
    model = model.to(dtype)
    with ran(FAST_PATH, DECODE_CALLS, not_ran=(PLAIN_PATH,)):
        fast = decode(model)
    # (the same products; the two norms in C sum in another order than torch's: float32's last bits)
    atol = 1e-2 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(fast, as_step_and_products(monkeypatch, decode, model), rtol=0, atol=atol)
    model.model.use_fast_path = False
    with ran(PLAIN_PATH, not_ran=(DECODE_CALLS,)):
        plain = decode(model)
    tolerance = 5e-2 if dtype == torch.bfloat16 else 1e-4
    assert (fast.float().log_softmax(-1) - plain.float().log_softmax(-1)).abs().max() < tolerance


@pytest.mark.parametrize("rows", [1, 3])
def test_the_one_call_folds_the_tokens_into_the_caches_fingerprint(one_thread, model, monkeypatch, rows):
    """A decode loop whose tokens each run in one C call (column slices of a prompt tensor too, which are not
    contiguous) leaves its cache the fingerprint of every position it read (`token_fingerprint` of the whole
    sequence, which `generate()` reads to tell a continuation from the whole sequence): the call folds each
    token in itself, and the cache's own fold (two torch ops) never runs."""
    from modeling_gpn.cache import ReadFingerprint, token_fingerprint

    ids = torch.randint(1, 97, (rows, 9), generator=torch.Generator().manual_seed(50))
    with torch.no_grad():
        cache = model(ids[:, :5], use_cache=True).cache
        folded = []
        record = ReadFingerprint.record
        monkeypatch.setattr(ReadFingerprint, "record", lambda self, *a: folded.append(a) or record(self, *a))
        with ran(FAST_PATH, DECODE_CALLS, not_ran=(PLAIN_PATH,)):
            for t in range(5, 9):
                cache = model(ids[:, t : t + 1], cache=cache, use_cache=True).cache
    assert folded == [] and cache.get_seq_length() == 9
    assert torch.equal(cache.read_fingerprint(), token_fingerprint(ids, None))


def test_an_ids_hash_that_does_not_fit_is_refused(one_thread, model):
    """The one call folds its ids only into (rows, 2) int64 residues, with bases and a modulus in (0, 2^31) (so
    that every product fits in int64): anything else is refused before anything is computed. One that fits
    becomes (h * base + id) mod modulus."""
    from modeling_gpn import memory_kernels as mk
    from modeling_gpn.recurrence_step import StepState

    m = model.model
    with torch.no_grad():
        p, g, M = model(torch.tensor([[1, 2, 3]]), use_cache=True).cache.state_buffers()
        step = mk.StepPlan(m, 1)
        plan = mk.DecodePlan(
            step, m.embed_tokens.weight, m.config.vocab_size, m.fuse_norm.weight, m.fuse_proj, m.decode_norm.weight,
            m.decode_proj, model.lm_head.weight,
        )  # fmt: skip
        before = [t.clone() for t in (p, g, M)]
        residues = torch.tensor([[4, 6]])
        for bad in (
            (torch.zeros(2, 2, dtype=torch.int64), (3, 5), 7),
            (torch.zeros(1, 2), (3, 5), 7),
            (torch.zeros(1, 4, dtype=torch.int64)[:, ::2], (3, 5), 7),
            (residues, (0, 5), 7),
            (residues, (3, 2**31), 7),
            (residues, (3, 5), 2**31),
        ):
            with pytest.raises(mk.KernelRefusal, match="ids hash"):
                plan(torch.tensor([5]), StepState(p, g, None, M), bad)
        assert all(torch.equal(a, b) for a, b in zip(before, (p, g, M))) and residues.tolist() == [[4, 6]]
        plan(torch.tensor([5]), StepState(p, g, None, M), (residues, (3, 5), 7))
    assert residues.tolist() == [[(4 * 3 + 5) % 7, (6 * 5 + 5) % 7]]


def test_beam_search_and_many_rows(one_thread, model, monkeypatch):
    """Beam search (its cache reordered between the calls) decodes in one call per token = without it; a batch
    beyond the kernels' rows (17) runs the forward as usual."""
    beams = lambda: model.generate(
        torch.tensor([[3, 5, 7, 9]]), max_new_tokens=4, num_beams=3, do_sample=False, early_stopping=False
    )
    with ran(DECODE_CALLS):
        fast = beams()
    assert torch.equal(fast, as_step_and_products(monkeypatch, beams))
    with ran(FAST_PATH, not_ran=(DECODE_CALLS,)):
        decode(model, steps=2, rows=17)


HISTORY_PROCESSORS = {
    "repetition_penalty": dict(repetition_penalty=3.0),
    "no_repeat_ngram_size": dict(no_repeat_ngram_size=1),
    "sequence_bias": dict(sequence_bias={(5,): 8.0}),
}


@pytest.mark.parametrize("processor", HISTORY_PROCESSORS)
def test_processors_that_read_the_history_see_the_one_calls_tokens(one_thread, model, processor):
    """generate()'s logits processors that read the tokens so far (penalties, banned n-grams, biases) choose
    the same tokens over the one-call decode as over the plain loop, and they change what greedy picks; the
    one-call decode computes with the tokens they chose (its logits, before the processors, are the plain loop's:
    a bias that picks its token whatever the logits would hide a state advanced with another token)."""
    ids = torch.randint(1, 97, (2, 6), generator=torch.Generator().manual_seed(3))

    def greedy(**processed):
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=10,
            output_logits=True,
            return_dict_in_generate=True,
            **processed,
        )
        return out.sequences, torch.stack(out.logits)

    with ran(DECODE_CALLS):
        fast, fast_logits = greedy(**HISTORY_PROCESSORS[processor])
    model.model.use_fast_path = False
    with ran(PLAIN_PATH, not_ran=(DECODE_CALLS,)):
        plain, plain_logits = greedy(**HISTORY_PROCESSORS[processor])
        assert torch.equal(fast, plain)
        torch.testing.assert_close(fast_logits, plain_logits, rtol=1e-4, atol=1e-4)
        assert not torch.equal(fast, greedy()[0])


def doubling(module, args, output):
    return output * 2


def doubled(method):
    return lambda *args, **kwargs: 2 * method(*args, **kwargs)


class replaced_on_class:  # noqa: N801 (a handle, named for what it does)
    """`cls.name` doubled until `remove()`, as a hook's handle removes it."""

    def __init__(self, cls: type, name: str):
        self.cls, self.name, self.written = cls, name, cls.__dict__[name]
        setattr(cls, name, doubled_method(self.written))

    def remove(self) -> None:
        setattr(self.cls, self.name, self.written)


def doubled_method(function):
    return lambda self, *args, **kwargs: 2 * function(self, *args, **kwargs)


HOOKED = {
    "lm_head forward hook": lambda m: m.lm_head.register_forward_hook(doubling),
    "decode_proj forward hook": lambda m: m.model.decode_proj.register_forward_hook(doubling),
    "fuse_norm pre-hook": lambda m: m.model.fuse_norm.register_forward_pre_hook(lambda mod, a: (a[0] + 1.0,)),
    "embedding forward hook": lambda m: m.model.embed_tokens.register_forward_hook(lambda mod, a, out: out + 1.0),
    "base model forward hook": lambda m: m.model.register_forward_hook(
        lambda mod, a, out: out.__class__(**{**out, "last_hidden_state": out.last_hidden_state * 2})
    ),
    "global forward hook": lambda m: torch.nn.modules.module.register_module_forward_hook(
        lambda mod, a, out: out * 2 if mod is m.model.decode_proj else None
    ),
    "fuse_proj forward replaced": lambda m: setattr(
        m.model.fuse_proj, "forward", lambda x: torch.full((*x.shape[:-1], m.config.hidden_size), 5.0, dtype=x.dtype)
    ),
    "fuse_gate forward hook (a step module)": lambda m: m.model.fuse_gate.register_forward_hook(doubling),
    # methods the one call computes without calling them (`modeling_gpn.DECODED_TOKEN_METHODS`), replaced
    "decoded replaced on the base model's instance": lambda m: setattr(m.model, "decoded", doubled(m.model.decoded)),
    "logits_of replaced on the causal LM's instance": lambda m: setattr(m, "logits_of", doubled(m.logits_of)),
    "token_inputs replaced on the base model's class": lambda m: replaced_on_class(type(m.model), "token_inputs"),
    "ffn replaced on a layer's instance (a step method)": lambda m: setattr(
        m.model.predict_layers[0], "ffn", doubled(m.model.predict_layers[0].ffn)
    ),
}


@pytest.mark.parametrize("change", HOOKED)
def test_a_hook_or_replaced_forward_is_never_skipped(one_thread, model, change):
    """With a hook (its own, on the base model, global) or an instance forward on a module the one call would
    not call, or a method it computes replaced (on an instance or a class), it does not run: the tokens decode as
    the forward computes them with the hook (= the plain loop's), which differ from the unhooked ones."""
    unhooked = decode(model)
    handle = HOOKED[change](model)
    try:
        with ran(not_ran=(DECODE_CALLS,)):
            hooked = decode(model)
        model.model.use_fast_path = False
        plain = decode(model)
    finally:
        if handle is not None:
            handle.remove()
    torch.testing.assert_close(hooked, plain, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(hooked, unhooked, atol=1e-3)


def test_a_lora_adapter_is_never_skipped(one_thread, model):
    """PEFT LoRA on the decoder projection (its B matrix nonzero): the adapter computes, the one call does not run."""
    peft = pytest.importorskip("peft")
    unadapted = decode(model)
    adapted = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["decode_proj"], init_lora_weights=False))
    with ran(not_ran=(DECODE_CALLS,)):
        logits = decode(adapted)
    assert not torch.allclose(logits, unadapted, atol=1e-3)


EDITS = {
    "load_state_dict": lambda m: m.load_state_dict(
        {"model.decode_proj.weight": m.model.decode_proj.weight * 1.5}, strict=False
    ),
    "in-place update": lambda m: m.model.fuse_proj.weight.add_(0.05),
    "module replaced": lambda m: setattr(
        m.model, "decode_norm", type(m.model.decode_norm)(m.config.hidden_size, m.config.rms_norm_eps)
    ),
    "parameter replaced": lambda m: setattr(
        m.model.predict_layers[0].ffn_in, "weight", torch.nn.Parameter(m.model.predict_layers[0].ffn_in.weight * -1)
    ),
}


def assert_an_edit_between_two_calls_is_seen(model, edit, ids: torch.Tensor, tolerance: float) -> None:
    """A decode loop by hand (one forward a token, continuing its cache) with `edit(model)` between two calls:
    the next token's call (in one C call) computes with the edited model, as the plain loop does in the same
    sequence of calls, and not as before the edit."""

    def continued(model, edited: bool) -> torch.Tensor:
        with torch.no_grad():
            cache = model(ids[:, :4], use_cache=True).cache
            model(ids[:, 4:5], cache=cache, use_cache=True)  # (a first one-token call: what it derives is kept)
            if edited:
                edit(model)
            return model(ids[:, 5:6], cache=cache, use_cache=True).logits[:, -1]

    plain, unedited = copy.deepcopy(model), continued(copy.deepcopy(model), edited=False)
    with ran(DECODE_CALLS):
        fast = continued(model, edited=True)
    plain.model.use_fast_path = False
    with ran(PLAIN_PATH, not_ran=(DECODE_CALLS,)):
        expected = continued(plain, edited=True)
    torch.testing.assert_close(fast, expected, rtol=tolerance, atol=tolerance)
    assert not torch.allclose(fast, unedited, atol=10 * tolerance)


@pytest.mark.parametrize("edit", EDITS)
def test_weights_edited_between_two_calls_on_one_cache_are_seen(one_thread, model, edit):
    """An edit between two one-token calls on one cache (a load, an in-place update, a module or a parameter
    replaced) is seen by the next token (`assert_an_edit_between_two_calls_is_seen`)."""
    ids = torch.randint(1, 97, (1, 6), generator=torch.Generator().manual_seed(23))
    assert_an_edit_between_two_calls_is_seen(model, EDITS[edit], ids, tolerance=1e-4)


AFTER_THE_PLAN = (
    "decode_proj forward hook",
    "global forward hook",
    "fuse_proj forward replaced",
    "fuse_gate forward hook (a step module)",
    # (a method set on an instance is watched before every token; one assigned to a class, from the next scope)
    "decoded replaced on the base model's instance",
    "logits_of replaced on the causal LM's instance",
    "ffn replaced on a layer's instance (a step method)",
)


@pytest.mark.parametrize("change", AFTER_THE_PLAN)
def test_a_hook_or_forward_added_between_two_calls_on_one_cache_is_seen(one_thread, model, change):
    """A hook registered, or a forward (or another method the one call computes) given to a module or the causal LM,
    between two one-token calls on one cache, after the first call built and checked its plan: the next token runs
    the hook (`assert_an_edit_between_two_calls_is_seen`). The plan looks at its modules' hooks again because a hook
    was registered (`WatchedModules.unhooked`), and at their forwards and methods before every token."""
    handles = []
    ids = torch.randint(1, 97, (1, 6), generator=torch.Generator().manual_seed(29))
    try:
        assert_an_edit_between_two_calls_is_seen(
            model, lambda m: handles.append(HOOKED[change](m)), ids, tolerance=1e-4
        )
    finally:
        for handle in handles:
            if handle is not None:
                handle.remove()


INT8_EDITS = {  # (torchao's int8 weight-only weight: what it holds, edited or replaced)
    "int8 data in place": lambda m: m.model.fuse_proj.weight.qdata.mul_(-1),
    # (the plans read the data where it lies: new storage under the same tensor must be seen, not the old read)
    "int8 data on new storage": lambda m: m.model.fuse_proj.weight.qdata.set_(m.model.fuse_proj.weight.qdata * -1),
    "scale in place": lambda m: m.model.decode_proj.weight.scale.mul_(1.5),
    "scale replaced": lambda m: setattr(m.model.decode_proj.weight, "scale", m.model.decode_proj.weight.scale * -1),
}


@pytest.mark.parametrize("edit", INT8_EDITS)
def test_int8_weights_edited_between_two_calls_are_seen(one_thread, edit):
    """The same for a torchao int8 weight-only model, whose weights are tensor subclasses watched through what
    they hold: its int8 data or scale edited in place, its data moved to new storage, or its scale replaced."""
    require_c_kernels()
    torchao = pytest.importorskip("torchao.quantization", reason="torchao (the test extra) quantizes the model")
    model = perturbed_model(tiny_config(), seed=26).eval()
    torchao.quantize_(model, torchao.Int8WeightOnlyConfig())
    ids = torch.randint(1, 97, (1, 6), generator=torch.Generator().manual_seed(27))
    assert_an_edit_between_two_calls_is_seen(model, INT8_EDITS[edit], ids, tolerance=1e-3)


INT4_EDITS = {  # (torchao's int4 weight-only weight: what it holds, edited or replaced; whether the values stay int4's)
    "int4 data in place": (lambda m: m.model.fuse_proj.weight.qdata.clamp_(-7, 7).neg_(), True),
    "int4 data in place, outside int4": (lambda m: m.model.fuse_proj.weight.qdata.mul_(-1), False),  # (-8 -> 8)
    "scale in place": (lambda m: m.model.decode_proj.weight.scale.mul_(1.5), True),
    "zero points replaced": (
        lambda m: setattr(m.model.fuse_proj.weight, "zero_point", m.model.fuse_proj.weight.zero_point + 1),
        True,
    ),
    "zero points in place": (lambda m: m.model.fuse_proj.weight.zero_point.add_(1), True),  # (0 -> 1: now offsets)
    "zero points replaced, outside int4": (
        lambda m: setattr(m.model.fuse_proj.weight, "zero_point", m.model.fuse_proj.weight.zero_point + 8),
        False,
    ),
}


@pytest.mark.parametrize("edit", INT4_EDITS)
def test_int4_weights_edited_between_two_calls_are_seen(one_thread, edit):
    """The same for torchao's int4 weight-only model, whose plans hold its values packed for the int4 products
    (`memory_kernels.int4_pack`): its int4 data or scale edited in place, or its zero points replaced (all 0 before:
    then read as offsets), are multiplied afresh; data or zero points edited outside int4's [-8, 7], which the packing
    cannot hold, are multiplied as the matrix dequantized from them (`int4_dequantized` says why), not packed wrong."""
    require_c_kernels()
    torchao = pytest.importorskip("torchao.quantization", reason="torchao (the test extra) quantizes the model")
    from torchao.quantization.granularity import PerGroup

    from modeling_gpn import memory_kernels

    model = perturbed_model(tiny_config(), seed=26).eval()
    torchao.quantize_(model, torchao.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(16)))
    ids = torch.randint(1, 97, (1, 6), generator=torch.Generator().manual_seed(27))
    edit, stays_int4 = INT4_EDITS[edit]
    memory_kernels.int4_dequantized.clear()
    assert_an_edit_between_two_calls_is_seen(model, edit, ids, tolerance=1e-3)
    if "+vnni" in memory_kernels.products_isa():  # (elsewhere every int4 weight keeps its dequantized matrix)
        outside = memory_kernels.int4_dequantized["a value or zero point outside int4's [-8, 7]"]
        assert (outside == 0) == stays_int4, dict(memory_kernels.int4_dequantized)


def test_bad_ids_and_padded_tokens(one_thread, model):
    """An id outside the vocabulary is refused with the forward's own message, before anything is computed (nor
    folded into the cache's fingerprint), and so is a mask holding a value other than 0 and 1;
    a token whose mask column is 0 (padding) keeps its row's state, as the forward's masked step does, and one
    whose column is all 1 (as generate() passes it, in any dtype) runs in one call."""
    with torch.no_grad():
        cache = model(torch.tensor([[1, 2, 3], [4, 5, 6]]), use_cache=True).cache
        seen = cache.get_seq_length()
        read = cache.read_fingerprint()
        for bad in (97, -1):
            with pytest.raises(ValueError, match="outside the vocabulary"):
                model(torch.tensor([[5], [bad]]), cache=cache, use_cache=True)
        for bad_mask in (torch.tensor([[1, 1, 1, 2], [1, 1, 1, 2]]), torch.tensor([[1, 1, 1, 1]])):
            with pytest.raises(ValueError, match="attention_mask"):
                model(torch.tensor([[5], [6]]), attention_mask=bad_mask, cache=cache, use_cache=True)
        assert cache.get_seq_length() == seen and torch.equal(cache.read_fingerprint(), read)
        for real in (torch.ones(2, 4, dtype=torch.long), torch.ones(2, 1, dtype=torch.bool), torch.ones(2, 5)):
            with ran(DECODE_CALLS):
                model(torch.tensor([[5], [6]]), attention_mask=real, cache=cache, use_cache=True)
        before = cache.get_state()
        mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
        with ran(FAST_PATH, not_ran=(DECODE_CALLS,)):
            model(torch.tensor([[5], [6]]), attention_mask=mask, cache=cache, use_cache=True)
        after = cache.get_state()
    assert torch.equal(after[0][1], before[0][1]) and not torch.equal(after[0][0], before[0][0])


STATE_EDITS = {
    "update_state": lambda cache: cache.update_state(*(t + 0.25 for t in cache.get_state()), num_new_tokens=0),
    "in place on the layer's tensor": lambda cache: cache.state_layer.recurrent_states[1].add_(0.25),
}


@pytest.mark.parametrize("edit", STATE_EDITS)
def test_a_state_written_between_two_calls_is_seen(one_thread, model, edit):
    """The cache's state written between two one-call tokens (through the cache, or in place on its tensor): the
    next token computes from the written state, as the plain loop does in the same sequence of calls (the key
    the last token left belongs to the old grounded state and is not reused; a shift, as a scaling would leave
    the normed key as it was)."""
    ids = torch.randint(1, 97, (1, 6), generator=torch.Generator().manual_seed(24))

    def continued(model) -> torch.Tensor:
        with torch.no_grad():
            cache = model(ids[:, :4], use_cache=True).cache
            model(ids[:, 4:5], cache=cache, use_cache=True)
            STATE_EDITS[edit](cache)
            return model(ids[:, 5:6], cache=cache, use_cache=True).logits[:, -1]

    plain = copy.deepcopy(model)
    with ran(DECODE_CALLS):
        fast = continued(model)
    plain.model.use_fast_path = False
    with ran(PLAIN_PATH, not_ran=(DECODE_CALLS,)):
        expected = continued(plain)
    torch.testing.assert_close(fast, expected, rtol=1e-4, atol=1e-4)


def test_a_graph_that_saved_the_state_refuses_its_backward(one_thread, model):
    """The one call writes the cache's state in place: a graph that saved that state tensor before refuses its
    backward (torch's in-place error), as after the state's copy by any other path, instead of a gradient
    computed from the new state."""
    with torch.no_grad():
        cache = model(torch.tensor([[1, 2, 3]]), use_cache=True).cache
    weight = torch.ones(model.config.hidden_size, requires_grad=True)
    loss = (cache.state_layer.recurrent_states[0] * weight).sum()  # (saves the predicted state for backward)
    with ran(DECODE_CALLS), torch.no_grad():
        model(torch.tensor([[4]]), cache=cache, use_cache=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_the_output_is_the_forwards_usual_output(one_thread, model):
    """The one call's output is the `GPNCausalLMOutput` the forward builds otherwise: the same attributes, items,
    tuple (`return_dict=False`) and pytree; its logits are the caller's own, which the next call leaves as they
    are."""
    from torch.utils import _pytree

    from modeling_gpn.modeling_gpn import GPNCausalLMOutput

    with torch.no_grad():
        cache = model(torch.tensor([[1, 2, 3]]), use_cache=True).cache
        with ran(DECODE_CALLS):
            output = model(torch.tensor([[4]]), cache=cache, use_cache=True)
            kept = output.logits.clone()
            as_tuple = model(torch.tensor([[5]]), cache=cache, use_cache=True, return_dict=False)
    assert torch.equal(output.logits, kept) and not torch.equal(as_tuple[0], kept)
    usual = GPNCausalLMOutput(logits=output.logits, cache=cache)
    assert type(output) is GPNCausalLMOutput and vars(output) == vars(usual)
    assert list(output.items()) == list(usual.items()) and output.to_tuple() == usual.to_tuple()
    assert output["cache"] is cache and output[0] is output.logits
    assert _pytree.tree_flatten(output)[1] == _pytree.tree_flatten(usual)[1]
    assert len(as_tuple) == 2 and as_tuple[1] is cache and as_tuple[0].shape == output.logits.shape


def huge_page_bytes(tensor: torch.Tensor) -> int:
    """Bytes on transparent huge pages in the mappings that overlap `tensor`'s bytes (/proc/self/smaps; advice
    splits a mapping where it starts and ends)."""
    first, end, inside, total = tensor.data_ptr(), tensor.data_ptr() + tensor.nbytes, False, 0
    with open("/proc/self/smaps", encoding="utf-8") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, stop = (int(part, 16) for part in head.split("-"))
                inside = start < end and first < stop
            elif inside and head == "AnonHugePages:":
                total += int(line.split()[1]) << 10
    return total


def advised_within(advice: list[tuple[int, int]], tensor: torch.Tensor) -> int:
    """Bytes of the `(start, length)` ranges in `advice` that lie inside `tensor`'s storage."""
    first, end = tensor.data_ptr(), tensor.data_ptr() + tensor.nbytes
    return sum(max(0, min(end, start + length) - max(first, start)) for start, length in advice)


@pytest.mark.parametrize("switched_off", [False, True], ids=["default", "GPN_HUGE_PAGES=0"])
def test_weights_streamed_from_dram_go_onto_huge_pages(one_thread, monkeypatch, switched_off):
    """A plan whose weights exceed the L3 (here an L3 of 1 MB, then of 1 GB) puts them onto 2 MB pages in place,
    unless switched off; the tokens decode to the same logits either way (the contents stay), and weights that
    fit stay put. The byte limit's read probe of that size sits on the same pages as the weights.

    What the GPN advises is read from its calls to libc's madvise, passed through: the pages alone cannot tell,
    since malloc may hand out memory that an earlier test advised (a free stretch of its heap, reused with its
    advice: the full suite did so), and a kernel set to give huge pages `always` gives them unadvised."""
    from modeling_gpn import memory_kernels
    from modeling_gpn.bench import ReadProbe

    require_c_kernels()
    madvise = memory_kernels._madvise()
    if madvise is None:
        pytest.skip("this machine offers no transparent huge pages")
    advice: list[tuple[int, int]] = []

    def recorded(start: int, length: int, kind: int) -> int:
        if kind == memory_kernels._MADV_HUGEPAGE:
            advice.append((start, length))
        return madvise(start, length, kind)

    monkeypatch.setattr(memory_kernels, "_madvise_function", [recorded])
    model = perturbed_model(tiny_config(vocab_size=65536, embedding_size=256), seed=25).eval()
    table = model.model.embed_tokens.weight
    if switched_off:
        monkeypatch.setenv("GPN_HUGE_PAGES", "0")
    monkeypatch.setattr(memory_kernels, "_last_level_cache_bytes", lambda: 1 << 30)
    with ran(DECODE_CALLS):
        fitting = decode(model, steps=2, rows=1)
    assert advice == []
    monkeypatch.setattr(memory_kernels, "_last_level_cache_bytes", lambda: 1 << 20)
    with ran(DECODE_CALLS):
        streamed = decode(model, steps=2, rows=1)
    assert torch.equal(streamed, fitting)
    probe = ReadProbe(64 << 20).buffer
    if switched_off:
        assert advice == []
    else:  # every whole 2 MB page of both (64 MB, so at least 31 of them), and the kernel took the advice
        assert advised_within(advice, table) >= 31 << 21 and advised_within(advice, probe) >= 31 << 21
        assert huge_page_bytes(table) > 0 and huge_page_bytes(probe) > 0


def test_attention_outputs_asked_for_a_decoded_token_are_refused(one_thread, model):
    """The one-call token refuses `output_attentions=True` as the forward does (it has none to give), and runs
    with `False`, which tools pass every model."""
    with torch.no_grad():
        cache = model(torch.tensor([[1, 2, 3], [4, 5, 6]]), use_cache=True).cache
        seen = cache.get_seq_length()
        with pytest.raises(ValueError, match="no attention layers"):
            model(torch.tensor([[5], [6]]), cache=cache, use_cache=True, output_attentions=True)
        assert cache.get_seq_length() == seen
        with ran(DECODE_CALLS):
            model(torch.tensor([[5], [6]]), cache=cache, use_cache=True, output_attentions=False)


def test_a_model_copied_or_pickled_after_decoding_derives_its_own(one_thread, model):
    """After generate() has left its one-call plans with the model (C structures holding raw pointers into the
    weights), `copy.deepcopy` and pickle (TRL's reference model, multiprocessing, `torch.save`) leave them behind:
    each copy decodes in one call from plans of its own, to the same tokens, and an edit of a copy's weights
    changes that copy's tokens and not the original's."""
    import pickle

    from modeling_gpn.fast_recurrence import DERIVED_ATTRIBUTES

    ids = torch.randint(1, 97, (2, 5), generator=torch.Generator().manual_seed(60))
    settings = dict(attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, pad_token_id=0)
    with ran(DECODE_CALLS):  # (the plans are kept while the cache it returns lives)
        generated = model.generate(ids, **settings, return_dict_in_generate=True)
    expected = generated.sequences
    assert any(DERIVED_ATTRIBUTES & module.__dict__.keys() for module in model.modules())
    for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert not any(DERIVED_ATTRIBUTES & module.__dict__.keys() for module in other.modules())
        with ran(DECODE_CALLS):
            assert torch.equal(other.generate(ids, **settings), expected)
        with torch.no_grad():
            other.model.decode_proj.weight.mul_(-1.0)
        with ran(DECODE_CALLS):
            assert not torch.equal(other.generate(ids, **settings), expected)
    with ran(DECODE_CALLS):
        assert torch.equal(model.generate(ids, **settings), expected)
