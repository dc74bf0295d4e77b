"""The fast recurrence (modeling_gpn/fast_recurrence.py) computes the plain loop's function and gradients."""

from __future__ import annotations

import copy

import pytest
import torch

from modeling_gpn import GPNCache

from ..backend_observer import C_KERNELS_BACKWARD, CHUNKED_LOSS, FAST_PATH, PLAIN_PATH, PREPACKED, TRITON, ran
from ..environment import require_environment
from ..tiny_models import perturbed_model, tiny_config, well_conditioned_model
from .recurrences import KERNEL_MODES, assert_same, random_problem, run_recurrence

pytestmark = pytest.mark.usefixtures("one_thread")


VARIANTS = {
    "gpn+m": dict(),
    "gpn": dict(use_memory=False),
    "gpn+m-2l": dict(num_predict_layers=2),
    "gpn+m-bias": dict(use_decoder_bias=True),
}


def kernels_backward(memory_kernels: str) -> tuple[str, ...]:
    """What a training call must also have run with these memory kernels: their backward."""
    return (C_KERNELS_BACKWARD,) if memory_kernels == "memory-kernels" else ()


def test_memory_kernels_build_where_there_is_a_compiler():
    """Where a C compiler exists the kernels must build: otherwise the suite would only test the torch ops."""
    import shutil

    from modeling_gpn import memory_kernels

    has_compiler = bool(shutil.which("cc") or shutil.which("gcc"))
    require_environment(
        has_compiler, "no C compiler (cc, gcc) here: the fast path uses its torch ops", "GPN_REQUIRE_C_KERNELS"
    )
    assert memory_kernels.available(), memory_kernels.unavailable_reason()


@pytest.mark.parametrize(  # (a GPN has no memory: the kernels have nothing to run)
    "variant,memory_kernels",
    [(v, k) for v in VARIANTS for k in KERNEL_MODES if not (v == "gpn" and k == "memory-kernels")],
    indirect=["memory_kernels"],
)
@pytest.mark.parametrize("length,mask_kind", [(1, None), (7, "holes"), (63, None), (63, "left")])
def test_fast_equals_plain_outputs_and_gradients(variant, length, mask_kind, memory_kernels):
    model = perturbed_model(tiny_config(**VARIANTS[variant]), seed=3).train()
    problem = random_problem(model, batch=3, length=length, mask_kind=mask_kind, seed=length)
    plain = run_recurrence(model, False, *problem)
    with ran(FAST_PATH, *kernels_backward(memory_kernels), not_ran=(PLAIN_PATH,)):
        fast = run_recurrence(model, True, *problem)
    assert_same(plain, fast)


@torch.no_grad()
def test_a_nan_input_poisons_its_own_row_from_there_on_like_the_plain_loop(memory_kernels):
    """A NaN in one row's input must come out as NaN from that position on in that row only, on both
    paths (the fast path must not hide it, e.g. behind a relu, nor leak it into other rows)."""
    model = perturbed_model(tiny_config(), seed=18)
    token_inputs, state, _, _ = random_problem(model, batch=2, length=9, mask_kind=None, seed=19)
    # a NaN token input at position 4; a NaN carried grounded state, which reaches only the first key
    # (through relu: NaN must survive it) and through it the memory
    nan_token = token_inputs.clone()
    nan_token[0, 4, 0] = float("nan")
    nan_state = tuple(x.clone() for x in state)
    nan_state[1][0, 0] = float("nan")
    for inputs, carried, first in ((nan_token, state, 4), (token_inputs, nan_state, 0)):
        results = []
        for fast in (False, True):
            model.model.use_fast_path = fast
            with ran(FAST_PATH if fast else PLAIN_PATH):
                outputs, final, _ = model.model.recurrence(inputs, carried, None)
            results.append((outputs.isnan().any(-1), [x.isnan().flatten(1).any(-1) for x in final]))
        (plain_out, plain_final), (fast_out, fast_final) = results
        assert torch.equal(fast_out, plain_out)
        assert fast_out[0].tolist() == [t >= first for t in range(9)] and not fast_out[1].any()
        for a, b in zip(fast_final, plain_final):
            assert torch.equal(a, b) and a.tolist() == [True, False]


@pytest.mark.parametrize("variant", ["gpn+m", "gpn+m-2l"])
def test_segmented_equals_unsegmented_gradients(variant, memory_kernels):
    problem_model = perturbed_model(tiny_config(**VARIANTS[variant]), seed=4).train()
    problem = random_problem(problem_model, batch=2, length=23, mask_kind="holes", seed=5)
    results = []
    for segment in (None, 1, 5, 23, 64):
        model = perturbed_model(tiny_config(**VARIANTS[variant], bptt_segment_length=segment), seed=4).train()
        with ran(FAST_PATH, *kernels_backward(memory_kernels), not_ran=(PLAIN_PATH,)):
            results.append(run_recurrence(model, True, *problem))
    for other in results[1:]:
        assert_same(results[0], other, atol=1e-6, rtol=1e-5)


def test_truncation_cuts_the_state_gradient_every_k_tokens():
    k = 4
    model = perturbed_model(tiny_config(bptt_truncation_length=k, bptt_segment_length=3), seed=6).train()
    problem = random_problem(model, batch=2, length=13, mask_kind="holes", seed=7)
    plain = run_recurrence(model, False, *problem)  # the plain loop detaches its state before t = 4, 8, 12
    with ran(FAST_PATH, not_ran=(PLAIN_PATH,)):
        fast = run_recurrence(model, True, *problem)
    assert_same(plain, fast)

    # the loss at position 9 reaches the token inputs of positions 8 and 9 only, never the initial state
    token_inputs, state, mask, _ = problem
    model.model.use_fast_path = True
    token_inputs = token_inputs.clone().requires_grad_(True)
    state = tuple(x.clone().requires_grad_(True) for x in state)
    outputs, _, _ = model.model.recurrence(token_inputs, state, None)
    outputs[:, 9].sum().backward()
    reached = token_inputs.grad.abs().sum(dim=(0, 2)) > 0
    assert reached.tolist() == [t in (8, 9) for t in range(13)]
    assert all(x.grad is None or x.grad.abs().sum() == 0 for x in state)

    # without truncation the same loss reaches every earlier position
    untruncated = perturbed_model(tiny_config(bptt_segment_length=3), seed=6).train()
    token_inputs.grad = None
    outputs, _, _ = untruncated.model.recurrence(token_inputs, state, None)
    outputs[:, 9].sum().backward()
    assert (token_inputs.grad.abs().sum(dim=(0, 2))[:10] > 0).all()


def test_reused_memory_buffers_keep_overlapping_calls_apart():
    """Training calls reuse the buffer that holds M' of their last segment (`BufferPool`): two forward
    passes before one backward must still each keep their own, and a later call reuses a given-back one."""
    from modeling_gpn.fast_recurrence import buffer_pool_of

    model = perturbed_model(tiny_config(bptt_segment_length=4), seed=10).train()
    generator = torch.Generator().manual_seed(11)
    first, second = (torch.randint(0, model.config.vocab_size, (2, 11), generator=generator) for _ in range(2))

    def grads_of(*batches):
        model.zero_grad(set_to_none=True)
        sum(model(ids, labels=ids).loss for ids in batches).backward()
        return {name: p.grad.clone() for name, p in model.named_parameters()}

    apart = [grads_of(first), grads_of(second)]
    together = grads_of(first, second)  # both graphs alive at once: two buffers in use
    for name, grad in together.items():
        torch.testing.assert_close(grad, apart[0][name] + apart[1][name], atol=1e-6, rtol=1e-5)

    pool = buffer_pool_of(model.model)
    held = [b.data_ptr() for buffers in pool.free.values() for b in buffers]
    assert len(held) == 3  # two last-segment buffers and one pair of alternating slots
    grads_of(first)
    assert {b.data_ptr() for buffers in pool.free.values() for b in buffers} == set(held)  # reused, none new
    pool.release()
    assert not pool.free


def tensors_in(value, seen=None) -> list:
    """The tensors `value` holds: itself, or inside its lists, tuples, dicts and objects' attributes."""
    seen = set() if seen is None else seen
    if id(value) in seen:
        return []
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    elif hasattr(value, "__dict__") and not isinstance(value, type) and not callable(value):
        value = list(vars(value).values())
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in tensors_in(item, seen)]
    return []


def recurrence_node(outputs: torch.Tensor):
    """The autograd node of the fast path's `GPNRecurrenceFunction` behind `outputs` (its ctx)."""
    pending = [outputs.grad_fn]
    while pending:
        node = pending.pop()
        if type(node).__name__ == "GPNRecurrenceFunctionBackward":
            return node
        pending.extend(next_node for next_node, _ in node.next_functions if next_node is not None)
    raise AssertionError("the fast path's autograd function is not in the graph")


HOOKED_CASES = [  # (hooks, weights and backend): float32 both ways; bf16 weights and the Triton steps under one
    ("save_on_cpu", "float32"),
    ("checkpoint(use_reentrant=False)", "float32"),
    ("save_on_cpu", "bfloat16"),
    ("save_on_cpu", "triton"),
]


@pytest.mark.parametrize("hooks,case", HOOKED_CASES)
def test_saved_tensor_hooks_see_everything_the_fast_backward_keeps(hooks, case, request):
    """Under saved-tensor hooks (`save_on_cpu`, TRL's activation offloading, a non-reentrant checkpoint around the
    model) the fast path keeps for its backward only what went through them: no tensor on its autograd node
    beside its saved tensors (it kept the boundary states, the last segment's records, its buffer and packed
    weights there, which no hook saw: memory the user offloaded stayed where it was). Segments, holes and
    packed sequences; gradients equal the plain path's under the same hooks: in float32 (on the C kernels or the
    torch ops, and on the Triton steps forward and backward through its interpreter) and with bf16 weights (as
    close to the float32 gradients as the plain loop's in bf16, and equal to the fast path's without hooks)."""
    import torch.utils.checkpoint

    from modeling_gpn import fast_recurrence as fr

    from ..bf16_closeness import assert_bf16_gradients_close

    triton = case == "triton"
    if triton:
        request.getfixturevalue("triton_on")
    make = well_conditioned_model if case == "bfloat16" else perturbed_model
    model = make(tiny_config(bptt_segment_length=3), seed=12).train()
    token_inputs, state, mask, weights = random_problem(model, batch=2, length=7, mask_kind="holes", seed=13)
    exact = None
    if case == "bfloat16":  # (the same weights in float32, on the plain loop: what both bf16 paths approximate)
        exact = copy.deepcopy(model.to(torch.bfloat16)).float()
    starts = torch.zeros(2, 7, dtype=torch.bool)
    starts[1, 4] = True  # (a packed sequence starts inside the second row)
    nodes = []

    def run(model, fast: bool, hooked: bool = True) -> dict:
        def recurrence(token_inputs, *state):
            outputs, final, _ = model.model.recurrence(token_inputs, state, mask, sequence_starts=starts)
            if fast and hooked and not nodes:  # (the forward's, not the checkpoint's recomputation)
                nodes.append(recurrence_node(outputs))
            return outputs, *final

        model.model.use_fast_path = fast
        model.zero_grad(set_to_none=True)
        leaves = [token_inputs.clone().requires_grad_(True), *(x.clone().requires_grad_(True) for x in state)]
        backends = (FAST_PATH, *[TRITON] * triton) if fast else (PLAIN_PATH,)
        with ran(*backends, not_ran=() if triton or not fast else (TRITON,)):
            if not hooked:
                outputs = recurrence(*leaves)
            elif hooks == "save_on_cpu":
                with torch.autograd.graph.save_on_cpu():
                    outputs = recurrence(*leaves)
            else:
                outputs = torch.utils.checkpoint.checkpoint(recurrence, *leaves, use_reentrant=False)
            if fast and hooked:
                # (its settings name the model's buffer pool: the model's scratch, not kept for this backward)
                kept = [t for name, value in vars(nodes[0]).items() if name != "settings" for t in tensors_in(value)]
                assert not kept, f"{len(kept)} tensors kept on the autograd node, unseen by the hooks"
            sum((x * w).sum() for x, w in zip(outputs, weights)).backward()
        if fast and triton:  # (every step of the window, both ways, on the kernels)
            assert model.model.last_recurrence_backends[:2] == (fr.TRITON, fr.TRITON)
        grads = {f"leaf {i}": x.grad for i, x in enumerate(leaves)}
        return grads | {name: p.grad for name, p in model.named_parameters() if p.grad is not None}

    plain, fast = run(model, False), run(model, True)
    if exact is None:
        assert plain.keys() == fast.keys()
        for name, plain_grad in plain.items():
            torch.testing.assert_close(fast[name], plain_grad, atol=2e-5, rtol=2e-4, msg=name)
        return
    tensors = {f"leaf {i}": x for i, x in enumerate((token_inputs, *state))} | dict(model.named_parameters())
    assert_bf16_gradients_close(fast, plain, run(exact, False), tensors)
    # the hooks change where the backward finds its tensors, not what it computes from them
    for name, grad in run(model, True, hooked=False).items():
        torch.testing.assert_close(fast[name], grad, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("variant", ["gpn+m", "gpn+m-bias"])
def test_causal_lm_loss_and_gradients_with_chunked_loss(variant):
    model = perturbed_model(tiny_config(**VARIANTS[variant]), seed=8).train()
    generator = torch.Generator().manual_seed(9)
    ids = torch.randint(0, model.config.vocab_size, (3, 17), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    labels = ids.masked_fill(mask == 0, -100)
    results = []
    for fast, return_logits in ((False, True), (True, True), (True, False)):
        model.model.use_fast_path = fast
        model.zero_grad(set_to_none=True)
        chunked = fast and not return_logits  # the loss without logits: chunked, the others from full logits
        with ran(
            FAST_PATH if fast else PLAIN_PATH, *[CHUNKED_LOSS] * chunked, not_ran=() if chunked else (CHUNKED_LOSS,)
        ):
            out = model(ids, attention_mask=mask, labels=labels, return_logits=return_logits)
        assert (out.logits is None) == (not return_logits)
        out.loss.backward()
        results.append((out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    for loss, grads in results[1:]:
        torch.testing.assert_close(loss, results[0][0], atol=1e-5, rtol=1e-5)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, results[0][1][name], atol=1e-5, rtol=1e-4, msg=name)


def test_the_chunked_loss_adds_up_every_chunk_of_rows():
    """The loss and both gradients from chunks of 7 rows (the last one short) are those of the full logits: the
    tests' models have so few rows that their loss is one chunk (`max(64, 2**20 // vocab)` rows), so a chunk
    dropped or a gradient kept from the last chunk alone would pass every other test."""
    from modeling_gpn.chunked_loss import chunked_causal_lm_loss

    generator = torch.Generator().manual_seed(3)
    decoded = torch.randn(2, 12, 8, generator=generator, requires_grad=True)
    embedding = torch.randn(50, 8, generator=generator, requires_grad=True)
    labels = torch.randint(0, 50, (2, 12), generator=generator)
    labels[0, 4] = -100
    loss = chunked_causal_lm_loss(decoded, embedding, labels, chunk_rows=7)  # 22 rows: 7, 7, 7 and 1
    expected = torch.nn.functional.cross_entropy(
        (decoded @ embedding.t())[:, :-1].flatten(0, 1), labels[:, 1:].flatten()
    )
    torch.testing.assert_close(loss, expected)
    for grad, expected_grad in zip(
        torch.autograd.grad(loss, (decoded, embedding)), torch.autograd.grad(expected, (decoded, embedding))
    ):
        torch.testing.assert_close(grad, expected_grad)


@torch.no_grad()
def test_inference_fast_path_matches_plain_and_follows_weight_changes():
    model = perturbed_model(tiny_config(num_predict_layers=2), seed=10)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(11))
    for _ in range(2):
        model.model.use_fast_path = False
        plain = model(ids).logits
        model.model.use_fast_path = True
        with ran(FAST_PATH, not_ran=(PLAIN_PATH,)):
            fast = model(ids).logits
        torch.testing.assert_close(fast, plain, atol=1e-5, rtol=1e-5)
        model.model.predict_layers[1].ffn_out.weight.mul_(1.5)  # the folded-weight cache must notice


@torch.no_grad()
def test_generate_fast_equals_plain():
    model = perturbed_model(tiny_config(), seed=12)
    prompt = torch.randint(0, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(13))
    texts = []
    for fast in (False, True):
        model.model.use_fast_path = fast
        with ran(FAST_PATH if fast else PLAIN_PATH, not_ran=(PLAIN_PATH if fast else FAST_PATH,)):
            texts.append(model.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0))
    assert torch.equal(texts[0], texts[1])


def test_bf16_tracks_fp32_over_512_tokens():
    """bf16 weights with a float32 state: next-token log-probs within 0.1 nats of fp32 over 512 tokens
    (mean abs difference under 0.02), and training gradients pointing the same way (cosine > 0.99)."""
    config = tiny_config()
    reference = perturbed_model(config, seed=14)
    low = perturbed_model(config, seed=14).to(torch.bfloat16)
    ids = torch.randint(0, config.vocab_size, (2, 512), generator=torch.Generator().manual_seed(15))
    with torch.no_grad():
        expected = reference(ids).logits.log_softmax(-1)
        cache = GPNCache(config)
        got = low(ids, cache=cache, use_cache=True).logits.float().log_softmax(-1)
    assert cache.get_state()[2].dtype == torch.float32
    diff = (got - expected).abs()
    assert diff.max() < 0.1 and diff.mean() < 0.02, f"max {diff.max():.3f}, mean {diff.mean():.4f}"

    grads = []
    for model in (reference.train(), low.train()):
        model.zero_grad(set_to_none=True)
        model(ids[:, :128], labels=ids[:, :128], return_logits=False).loss.backward()
        grads.append(torch.cat([p.grad.float().flatten() for p in model.parameters()]))
    cosine = torch.nn.functional.cosine_similarity(grads[0], grads[1], dim=0)
    assert cosine > 0.99, f"cosine {cosine:.4f}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prepacked_matrices_match_the_plain_matmul(monkeypatch, dtype):
    """Where it pays, the fast path multiplies by oneDNN-prepacked matrices (`PackedMatrix`: bf16 on CPU;
    fp32 for 8+ rows on several threads). Forced on and off here: the same loss, logits and gradients,
    up to rounding (bf16) or summation order (fp32), and the products ran on packed matrices only when on
    (a packing that failed and fell back to the plain matmul fails the test)."""
    from modeling_gpn import fast_recurrence

    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        pytest.skip("this torch build has no oneDNN linear, so nothing is prepacked")
    model = perturbed_model(tiny_config(num_predict_layers=2), seed=16).to(dtype).train()
    if dtype == torch.bfloat16 and not fast_recurrence.PackedMatrix.worthwhile(
        fast_recurrence.fold_weights(model.model)
    ):
        pytest.skip("this CPU's oneDNN has no bf16 kernels, so nothing is prepacked")
    ids = torch.randint(0, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(17))
    monkeypatch.setenv("GPN_STEP_KERNELS", "0")  # (no-grad windows of a few rows would run the C step kernels)
    results = []
    for packed in (True, False):
        monkeypatch.setattr(fast_recurrence.PackedMatrix, "worthwhile", staticmethod(lambda w, rows=None: packed))  # noqa: B023 (called in this iteration)
        model.zero_grad(set_to_none=True)
        with ran(FAST_PATH, *[PREPACKED] * packed, not_ran=() if packed else (PREPACKED,)):  # training
            loss = model(ids, labels=ids, return_logits=False).loss
            loss.backward()
        with (
            torch.no_grad(),
            ran(FAST_PATH, *[PREPACKED] * packed, not_ran=() if packed else (PREPACKED,)),
        ):  # inference
            logits = model(ids).logits.float()
        grads = torch.cat([p.grad.float().flatten() for p in model.parameters()])
        results.append((loss.detach().float(), logits, grads))
    (loss_a, logits_a, grads_a), (loss_b, logits_b, grads_b) = results
    low = dtype == torch.bfloat16
    torch.testing.assert_close(loss_a, loss_b, atol=2e-3 if low else 1e-5, rtol=1e-3 if low else 1e-5)
    assert (logits_a - logits_b).abs().max() < (0.05 if low else 1e-4)
    assert torch.nn.functional.cosine_similarity(grads_a, grads_b, dim=0) > (0.9999 if low else 1 - 1e-9)


@torch.no_grad()
def test_decode_step_compiles_as_one_graph_writing_memory_in_place():
    """The one-token step is capturable: torch.compile traces it whole (fullgraph, no data-dependent
    Python), it writes M' into the buffer it is given (a static address for CUDA graphs), and it computes
    what the eager step does. (Capture with CUDA graphs itself needs a GPU; this checks its precondition.)"""
    from modeling_gpn import fast_recurrence as fr

    model = perturbed_model(tiny_config(), seed=16)
    folded = fr.cached_folded_weights(model.model, rows=1)
    shapes = fr.shapes_of(model.model, 1)
    columns, eps = fr.columns_of(shapes), model.config.rms_norm_eps
    generator = torch.Generator().manual_seed(17)
    p, g, memory = (torch.randn(x.shape, generator=generator) for x in model.model.zero_state(1, torch.device("cpu")))
    state = fr.StepState(p, g, fr.key_from_grounded(g, folded, shapes, eps), memory)
    token_input = torch.randn(1, model.config.hidden_size, generator=generator)

    def decode_step(state, token_input, memory_out):
        new_state, _ = fr._step(state, token_input, None, folded, shapes, columns, eps, memory_out=memory_out)
        return new_state

    eager_out, compiled_out = torch.empty_like(memory), torch.empty_like(memory)
    expected = decode_step(state, token_input, eager_out)
    compiled = torch.compile(decode_step, fullgraph=True, dynamic=False)
    got = compiled(state, token_input, compiled_out)
    assert got.memory.data_ptr() == compiled_out.data_ptr()  # M' went into the given buffer
    for name, a, b in zip(fr.StepState._fields, got, expected):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)
