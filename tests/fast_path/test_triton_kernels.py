"""The Triton kernels (modeling_gpn/triton_kernels.py) compute what the torch ops of the fast path compute.

No GPU is needed: every test runs the kernels on CPU tensors through Triton's interpreter
(TRITON_INTERPRET=1, set by tests/environment.py before torch is imported, since importing torch imports
triton.language) with the Triton backend forced by the `triton_on` fixture (GPN_TRITON=1). Sizes are
awkward on purpose: odd batches, key and value dimensions that are not multiples of the block sizes (5, 7,
12, and 70 = two 32-column blocks of M and a ragged third), one, two and three heads, masks. Without triton the tests skip; `.ci/run` sets GPN_REQUIRE_TRITON=1, which turns the
skip into a failure so CI cannot pass by skipping.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from modeling_gpn import fast_recurrence as fr
from modeling_gpn import recurrence_step
from modeling_gpn import triton_kernels as tk

from ..backend_observer import FAST_PATH, PLAIN_PATH, TRITON, ran
from ..environment import require_environment
from ..tiny_models import perturbed_model, tiny_config
from .recurrences import assert_same, random_problem, run_recurrence
from .triton_launches import VARIANTS, OpRecorder, allocating, launches


def shapes(B, H, dk, dv, d=10, f=6, layers=1):
    return fr.Shapes(batch=B, hidden=d, inter=f, heads=H, key_dim=dk, value_dim=dv, layers=layers, memory=True)


def memory_problem(B, H, dk, dv, seed):
    """Z (B, N) with every column a step reads, a carried key as a strided view, M and the decay rates.
    Values are spread so that relu cuts, softplus takes its >20 branch and its tiny-value branch."""
    g = torch.Generator().manual_seed(seed)
    s = shapes(B, H, dk, dv)
    c = fr.columns_of(s)
    width = c.write + c.read_gate.stop
    Z = 2 * torch.randn(B, width, generator=g)
    Z[0, c.decay.start] = 25.0  # softplus(x) = x above 20
    Z[-1, c.decay.stop - 1] = -30.0  # softplus(x) ~ 1e-13: log1p must not round it to 0
    key_source = torch.randn(B, width + 3, generator=g)
    key = key_source[:, 3 : 3 + H * dk]  # a strided view, like Z[:, c.key] of the previous step
    M = torch.randn(B * H, dk, dv, generator=g)
    neg_decay_rate = -torch.rand(H, generator=g) - 0.1
    return s, c, Z, key, M, neg_decay_rate


SIZES = [(3, 1, 5, 7), (3, 3, 12, 70), (1, 2, 8, 16)]


@pytest.mark.parametrize("B,H,dk,dv", SIZES)
def test_memory_step_matches_the_torch_ops(triton_on, B, H, dk, dv):
    s, c, Z, key, M, ndr = memory_problem(B, H, dk, dv, seed=B * 100 + dk)
    out_ref, out_tri = torch.empty_like(M), torch.full_like(M, float("nan"))
    expected = fr._memory_step_torch(Z, c, key, ndr, M, out_ref, 1e-6)
    got, n = launches(lambda: tk.memory_step(Z, c, key, ndr, M, out_tri, 1e-6))
    assert n == {"memory_step": 1, "unit_rms": 1}  # the per-(row, head) kernel and the read's RMS norm
    torch.testing.assert_close(out_tri, out_ref, atol=1e-5, rtol=1e-5)
    for name in expected._fields:
        torch.testing.assert_close(getattr(got, name), getattr(expected, name), atol=1e-5, rtol=1e-5, msg=name)
    assert got.softplus_decay[-1, -1] > 0  # the tiny-value branch kept its value


def test_memory_step_keeps_a_nan_key_as_nan(triton_on):
    """relu must not turn a NaN carried key into 0 (as torch's relu keeps it), so a poisoned row stays visible."""
    s, c, Z, key, M, ndr = memory_problem(3, 3, 5, 7, seed=5)
    key = key.clone()
    key[1, 0] = float("nan")
    got = tk.memory_step(Z, c, key, ndr, M, torch.empty_like(M), 1e-6)
    poisoned = torch.zeros_like(got.kq, dtype=torch.bool)
    poisoned[3, 0] = True  # row 1, head 0: its key
    assert got.kq[poisoned].isnan().all() and not got.kq[~poisoned].isnan().any()


def write_backward_problem(B, H, dk, dv, layers, seed):
    g = torch.Generator().manual_seed(seed)
    heads = B * H
    D, M = torch.randn(heads, dk, dv, generator=g), torch.randn(heads, dk, dv, generator=g)
    queries = F.normalize(torch.randn(layers, heads, dk, generator=g), dim=-1)
    read_grads = torch.randn(layers, heads, dv, generator=g)
    k = F.normalize(torch.randn(heads, dk, generator=g), dim=-1)
    v = torch.randn(heads, dv, generator=g)
    a = torch.rand(heads, 1, generator=g) * 0.5 + 0.5
    beta = torch.rand(heads, 1, generator=g)
    return D, M, queries, read_grads, k, v, a, beta


@pytest.mark.parametrize("B,H,dk,dv", SIZES)
@pytest.mark.parametrize("layers", [1, 2])
def test_memory_write_backward_matches_the_torch_ops_and_autograd(triton_on, B, H, dk, dv, layers):
    D, M, queries, read_grads, k, v, a, beta = write_backward_problem(B, H, dk, dv, layers, seed=dv + layers)
    update = beta * (v - torch.bmm(k[:, None], M)[:, 0])
    ref_out, tri_out = torch.empty_like(M), torch.full_like(M, float("nan"))
    expected = fr._memory_write_backward_torch(D, M, queries, read_grads, k, update, a, beta, ref_out)
    got, n = launches(lambda: tk.memory_write_backward(D, M, queries, read_grads, k, update, a, beta, tri_out))
    assert n == {"memory_write_backward": 1}
    names = ("d_update", "d_k", "d_a", "dq0", "d_error")
    for name, x, y in zip(names, got, expected):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5, msg=name)
    torch.testing.assert_close(tri_out, ref_out, atol=1e-5, rtol=1e-5)

    # and against autograd through M' = a M + k (beta (v - M^T k))^T with the reads M'^T q_l
    leaves = [x.clone().requires_grad_(True) for x in (M, k, a, queries)]
    M_, k_, a_, q_ = leaves
    error = v - torch.bmm(k_[:, None], M_)[:, 0]
    update_ = beta * error
    error.retain_grad()
    update_.retain_grad()
    new_M = a_[:, :, None] * M_ + k_[:, :, None] * update_[:, None, :]
    reads = torch.einsum("hk,hkv->hv", q_.reshape(-1, q_.shape[-1]), new_M.repeat(layers, 1, 1))
    ((new_M * D).sum() + (reads * read_grads.reshape(reads.shape)).sum()).backward()
    d_update, d_k, d_a, dq0, d_error = got
    torch.testing.assert_close(d_update, update_.grad, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(d_error, error.grad, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(d_a, a_.grad[:, 0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(dq0, q_.grad[0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(tri_out, M_.grad, atol=1e-5, rtol=1e-4)
    # d_k is the gradient through the key's use in M^T k and in the outer product, i.e. k's full gradient
    torch.testing.assert_close(d_k, k_.grad, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("B,H,dk,dv", SIZES)
def test_memory_read_matches_the_torch_ops(triton_on, B, H, dk, dv):
    g = torch.Generator().manual_seed(dk)
    query = torch.randn(B, H * dk + 4, generator=g)[:, 2 : 2 + H * dk]  # strided, like a column slice
    M = torch.randn(B * H, dk, dv, generator=g)
    q_raw, q, q_inv, read = tk.memory_read(query, M)
    ref_raw = F.relu(query).reshape(B * H, dk)
    ref_q, ref_inv = recurrence_step._l2_parts(ref_raw)
    torch.testing.assert_close(q_raw, ref_raw)
    torch.testing.assert_close(q, ref_q, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(q_inv, ref_inv, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(read, torch.bmm(ref_q[:, None], M).view(B, H * dv), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows,width", [(3, 5), (1, 48), (5, 1100)])
def test_row_kernels_match_the_torch_ops(triton_on, rows, width):
    g = torch.Generator().manual_seed(width)
    eps = 1e-6
    x = torch.randn(rows, width, generator=g)
    torch.testing.assert_close(tk.unit_rms(x, eps), fr._unit_rms(x, eps), atol=1e-6, rtol=1e-5)
    # ground: sigmoid(z + b) * p + u and its rms; u a column of a (B, T, d) window
    z, b, p = (
        torch.randn(rows, width, generator=g),
        torch.randn(width, generator=g),
        torch.randn(rows, width, generator=g),
    )
    window = torch.randn(rows, 3, width, generator=g)
    sig, grounded, a_g = tk.ground(z, b, p, window[:, 1], eps)
    ref_sig = torch.sigmoid(z + b)
    ref_g = torch.addcmul(window[:, 1], ref_sig, p)
    torch.testing.assert_close(sig, ref_sig, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grounded, ref_g, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(a_g, fr._unit_rms(ref_g, eps), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("memory", [True, False])
def test_predict_input_and_gated_residual_match_the_torch_ops(triton_on, memory):
    B, d, f, H, dk, dv = 3, 1030, 1027, 3, 5, 7  # widths past the 1024-wide blocks: the loops run twice
    s = fr.Shapes(B, d, f, H if memory else 0, dk if memory else 0, dv if memory else 0, 1, memory)
    c = fr.columns_of(s)
    g = torch.Generator().manual_seed(7)
    Z = torch.randn(B, c.write + (c.read_gate.stop if memory else c.ffn_b.stop), generator=g)
    part = Z[:, c.write :]
    normed = torch.randn(B, H * dv, generator=g) if memory else None
    X = tk.predict_input(part, c, normed, f)
    expected = F.silu(part[:, c.ffn_a]) * part[:, c.ffn_b]
    if memory:
        expected = torch.cat([expected, F.silu(part[:, c.read_gate]) * normed], dim=1)
    torch.testing.assert_close(X, expected, atol=1e-6, rtol=1e-5)
    Y, state = torch.randn(B, d, generator=g), torch.randn(B, d, generator=g)
    torch.testing.assert_close(
        tk.gated_residual(Y, part, c, state),
        torch.addcmul(Y, torch.sigmoid(part[:, c.gate]), state),
        atol=1e-6,
        rtol=1e-5,
    )


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "gpn+m-2l"])  # (2 layers: the awkward one)
@pytest.mark.parametrize("length,mask_kind", [(4, "holes"), (4, "left"), (4, "right"), (4, "hole"), (3, None)])
def test_fast_equals_plain_on_the_triton_path(triton_on, variant, length, mask_kind):
    """Outputs, final state and every gradient of the fast path with the Triton kernels = the plain loop,
    with padding (random holes, left, right, a hole inside a row) and without."""
    model = perturbed_model(tiny_config(**VARIANTS[variant]), seed=3).train()
    problem = random_problem(model, batch=3, length=length, mask_kind=mask_kind, seed=length)
    plain = run_recurrence(model, False, *problem)
    fast, n = launches(lambda: run_recurrence(model, True, *problem))
    # every step ran on the kernels, forward and (for the memory's gradient) backward
    assert n["ground"] >= length and n["gated_residual"] >= length * model.config.num_predict_layers
    if model.config.use_memory:
        assert n["memory_step"] >= length and n["memory_write_backward"] == length
    # every backward step on the kernels, the masked ones too (which once ran `_step_backward`)
    if mask_kind is not None:
        assert not problem[2].all(), "the mask pads nothing: no masked step is tested"
    assert n["ground_gate_backward"] == length
    assert n["predict_layer_backward"] == length * model.config.num_predict_layers
    assert_same(plain, fast)


@pytest.mark.parametrize("variant", ["gpn+m", "gpn+m-2l"])
def test_padded_training_batch_on_the_triton_path_equals_plain(triton_on, variant):
    """A causal-LM training batch with left padding, right padding and a hole inside a row: the loss and
    every parameter gradient on the Triton path = the plain loop's, and every backward step (each of them
    masked here) ran on the kernels, none on `_step_backward`."""
    model = perturbed_model(tiny_config(**VARIANTS[variant]), seed=12).train()
    length = 6
    ids = torch.randint(0, model.config.vocab_size, (3, length), generator=torch.Generator().manual_seed(13))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding
    mask[1, 4:] = 0  # right padding
    mask[2, 2:4] = 0  # a hole inside the row
    labels = ids.masked_fill(mask == 0, -100)
    results = {}
    for fast in (False, True):
        model.model.use_fast_path = fast
        model.zero_grad(set_to_none=True)

        def loss_and_backward():
            loss = model(ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            return loss.detach()

        loss, n = launches(loss_and_backward)
        results[fast] = (loss, {name: p.grad.clone() for name, p in model.named_parameters()}, n)
    (plain_loss, plain_grads, _), (fast_loss, fast_grads, n) = results[False], results[True]
    assert n["ground_gate_backward"] == length  # every step's backward on the kernels
    assert n["predict_layer_backward"] == length * model.config.num_predict_layers
    torch.testing.assert_close(fast_loss, plain_loss, atol=1e-5, rtol=1e-5)
    assert plain_grads.keys() == fast_grads.keys()
    for name, grad in plain_grads.items():
        torch.testing.assert_close(fast_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_gradients_through_a_carried_state_on_the_triton_path_are_one_plain_forwards(triton_on):
    """Two calls with gradients, the second continuing the cache the first returned (full backpropagation through
    time across calls, docs/cache.md): on the Triton path the summed losses' gradients are those of one plain
    forward over the whole sequence, for every weight. The first call's backward starts from the gradient the
    second call's carried state hands it (its final p, g and M), through the kernels' backward steps."""
    model = perturbed_model(tiny_config(**VARIANTS["gpn+m"]), seed=5).train()
    ids = torch.randint(0, model.config.vocab_size, (2, 4), generator=torch.Generator().manual_seed(6))
    targets = torch.cat([ids[:, 1:], ids.new_full((2, 1), -100)], dim=1)  # (a chunk's last target: the next's first)
    model.model.use_fast_path = False
    model(ids, shift_labels=targets, num_items_in_batch=1).loss.backward()
    expected = {name: param.grad for name, param in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    model.model.use_fast_path = True

    def two_calls():
        first = model(ids[:, :2], shift_labels=targets[:, :2], num_items_in_batch=1, use_cache=True)
        second = model(ids[:, 2:], shift_labels=targets[:, 2:], num_items_in_batch=1, cache=first.cache, use_cache=True)
        assert second.cache.carries_graph
        (first.loss + second.loss).backward()

    with ran(FAST_PATH, TRITON, not_ran=(PLAIN_PATH,)):
        _, n = launches(two_calls)
    assert n["ground_gate_backward"] == 4 and n["memory_write_backward"] == 4  # (both calls' backward on the kernels)
    assert expected.keys() == {name for name, param in model.named_parameters() if param.grad is not None}
    for name, grad in expected.items():
        torch.testing.assert_close(dict(model.named_parameters())[name].grad, grad, atol=1e-5, rtol=1e-4, msg=name)


@torch.no_grad()
@pytest.mark.parametrize("variant", ["gpn+m", "gpn+m-2l"])
def test_inference_on_the_triton_path_equals_plain(triton_on, variant):
    """The no-grad path (scoring a window, then one-token decode steps that write a fresh M) on the kernels."""
    model = perturbed_model(tiny_config(**VARIANTS[variant]), seed=8)
    token_inputs, state, mask, _ = random_problem(model, batch=3, length=4, mask_kind="holes", seed=2)
    core = model.model
    results = {}
    for fast in (False, True):
        core.use_fast_path = fast
        with ran(FAST_PATH, TRITON, not_ran=(PLAIN_PATH,)) if fast else ran(PLAIN_PATH, not_ran=(FAST_PATH, TRITON)):
            outputs, final, gammas = core.recurrence(token_inputs, state, mask, output_memory_decays=True)
            one, final_one, _ = core.recurrence(token_inputs[:, :1], final, None)
        results[fast] = (outputs, *final, gammas, one, *final_one)
    for got, expected in zip(results[True], results[False]):
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-4)


def test_a_window_the_triton_step_does_not_take_runs_its_backward_on_the_torch_ops(triton_on):
    """Token inputs with the batch innermost (a permuted tensor: a step's rows are not unit-stride) run the
    torch-ops steps, whose records follow that layout (column-major); the backward must then run on the torch
    ops too, not on Triton's kernels, which read row-major records (the gradients were silently wrong)."""
    model = perturbed_model(tiny_config(**VARIANTS["gpn+m-awkward"]), seed=3).train()
    token_inputs, state, mask, weights = random_problem(model, batch=3, length=2, mask_kind=None, seed=1)
    token_inputs = token_inputs.permute(2, 1, 0).contiguous().permute(2, 1, 0)  # (B, T, d), batch innermost
    plain = run_recurrence(model, False, token_inputs, state, mask, weights)
    with ran(FAST_PATH, TRITON):  # (the memory half still runs on Triton's kernels)
        fast = run_recurrence(model, True, token_inputs, state, mask, weights)
    assert model.model.last_recurrence_backends[:2] == (fr.TORCH_OPS, fr.TORCH_OPS)
    assert "elements not adjacent" in model.model.last_recurrence_backends.triton_refused  # (said, not silent)
    assert_same(plain, fast)


@torch.no_grad()
def test_a_strided_fuse_gate_bias_on_the_triton_path_equals_plain(triton_on):
    """`ground` reads the fuse gate's bias at unit stride: a strided one (a plain nn.Parameter can be a
    strided view) is made contiguous first, not read as garbage."""
    model = perturbed_model(tiny_config(**VARIANTS["gpn+m-awkward"]), seed=4)
    bias = model.model.fuse_gate.bias.detach()
    model.model.fuse_gate.bias = torch.nn.Parameter(torch.stack([bias, torch.zeros_like(bias)], dim=1)[:, 0])
    ids = torch.randint(0, model.config.vocab_size, (2, 3), generator=torch.Generator().manual_seed(5))
    model.model.use_fast_path = False
    expected = model(ids).logits
    model.model.use_fast_path = True
    with ran(FAST_PATH, TRITON):
        got = model(ids).logits
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-4)


def test_backend_choice(monkeypatch):
    """Which implementation runs the memory half: Triton only where selected and usable, never silently on
    inputs it cannot take (a key dimension past the block limit falls back to the C kernels or torch ops)."""
    M = torch.zeros(6, 8, 16)
    monkeypatch.setenv("GPN_TRITON", "0")
    assert fr.memory_backend(M) != fr.TRITON
    monkeypatch.delenv("GPN_TRITON")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert fr.memory_backend(M) != fr.TRITON  # CPU tensors without the interpreter forced: never Triton
    require_environment(tk.available(), f"triton unavailable: {tk.unavailable_reason()}", "GPN_REQUIRE_TRITON")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("GPN_TRITON", "1")
    assert fr.memory_backend(M) == fr.TRITON
    assert fr.memory_backend(torch.zeros(2, tk.MAX_KEY_BLOCK + 1, 4)) != fr.TRITON
    assert fr.memory_backend(M.double()) != fr.TRITON
    assert fr.memory_backend(M.transpose(1, 2)) != fr.TRITON


def one_step_problem(variant: str, B: int, seed: int, dtype=torch.float32):
    model = perturbed_model(tiny_config(**VARIANTS[variant]), seed=seed).to(dtype)
    core = model.model
    s, eps = fr.shapes_of(core, B), core.config.rms_norm_eps
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        w = fr.fold_weights(core)
        p, grounded, M = (torch.randn(x.shape, generator=g) for x in core.zero_state(B, torch.device("cpu")))
        state = fr.StepState(p, grounded, fr.key_from_grounded(grounded, w, s, eps), M)
    u = torch.randn(B, 3, s.hidden, generator=g)[:, 1]
    return w, s, fr.columns_of(s), eps, state, u, g


@torch.no_grad()
@pytest.mark.parametrize(
    "variant,dtype,masked",
    [
        ("gpn+m", torch.float32, False),
        ("gpn+m-awkward", torch.float32, False),
        ("gpn+m-2l-awkward-seg2", torch.float32, False),
        ("gpn", torch.float32, False),
        ("gpn+m-2l-awkward-seg2", torch.bfloat16, False),
        ("gpn+m", torch.float32, True),
        ("gpn+m-2l-awkward-seg2", torch.float32, True),
        ("gpn", torch.float32, True),
    ],
)
def test_one_step_forward_and_backward_match_the_torch_ops(triton_on, variant, dtype, masked):
    """`triton_kernels.step` = `_step` (new state, gamma, every record) and `triton_kernels.step_backward` =
    `_step_backward` (state gradients, dL/du, every weight-gradient row and the decay-rate gradient); with
    bf16 weights the kernels read the bf16 matmul outputs themselves (the same numbers, upcast exactly).
    A `masked` step (row 1 padding) runs on the kernels both ways; its padded row's gradients pass by."""
    w, s, c, eps, state, u, g = one_step_problem(variant, B=3, seed=11, dtype=dtype)
    real = torch.tensor([True, False, True]) if masked else None
    results = {}
    for name, step in (("torch", fr._step), ("triton", tk.step)):
        saved = {}
        new_state, gamma = step(
            state, u, real, w, s, c, eps, saved, torch.empty_like(state.memory) if s.memory else None
        )
        results[name] = (new_state, gamma, saved)
    (ref_state, ref_gamma, ref_saved), (tri_state, tri_gamma, tri_saved) = results["torch"], results["triton"]
    for a, b in zip(tri_state, ref_state):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    if s.memory:
        torch.testing.assert_close(tri_gamma, ref_gamma)
    assert tri_saved.keys() == ref_saved.keys()
    for key in ref_saved:
        if key != "layers":
            torch.testing.assert_close(tri_saved[key], ref_saved[key], atol=1e-5, rtol=1e-5, msg=key)
    for tri_layer, ref_layer in zip(tri_saved["layers"], ref_saved["layers"]):
        assert tri_layer.keys() == ref_layer.keys()
        for key in ref_layer:
            torch.testing.assert_close(tri_layer[key], ref_layer[key], atol=1e-5, rtol=1e-5, msg=key)

    grads = fr.StepState(*(torch.randn(x.shape, generator=g) for x in ref_state))
    wt = fr.transpose_weights(w)
    backward = {}
    for name, step_backward in (("torch", fr._step_backward), ("triton", tk.step_backward)):
        weight_grads = fr._WeightGrads(w, s.batch)
        out = torch.empty_like(state.memory) if s.memory else None
        (d_state, d_u), n = launches(lambda: step_backward(ref_saved, grads, wt, s, c, eps, weight_grads, out))  # noqa: B023 (called in this iteration)
        weight_grads.flush()  # the rows become weight gradients
        backward[name] = (d_state, d_u, weight_grads, n)
    (ref_d, ref_du, ref_wg, _), (tri_d, tri_du, tri_wg, n) = backward["torch"], backward["triton"]
    assert n["ground_gate_backward"] == 1  # it ran on the kernels
    for a, b in zip((*tri_d, tri_du), (*ref_d, ref_du)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    for key in ref_wg.grads:
        torch.testing.assert_close(tri_wg.grads[key], ref_wg.grads[key], atol=1e-5, rtol=1e-4, msg=str(key))
    for key in ref_wg.bias_grads:
        torch.testing.assert_close(tri_wg.bias_grads[key], ref_wg.bias_grads[key], atol=1e-5, rtol=1e-4, msg=str(key))
    if s.memory:
        torch.testing.assert_close(tri_wg.neg_decay, ref_wg.neg_decay, atol=1e-5, rtol=1e-4)
    if masked:  # the padded row: its gradients pass straight to the input state, nothing reaches its u
        assert not tri_du[1].any()
        assert torch.equal(tri_d.p[1], grads.p[1]) and torch.equal(tri_d.g[1], grads.g[1])
        assert torch.equal(tri_d.key[1], grads.key[1]) and torch.equal(tri_d.memory[1], grads.memory[1])
        with pytest.raises(ValueError, match="unmasked"):  # static buffers (a training graph) never take one
            tk.step_backward(ref_saved, grads, wt, s, c, eps, fr._WeightGrads(w, s.batch), ws={})


# --------------------------------------------------------------------------------------------------
# The decode step on static buffers (what a CUDA graph captures; the capture itself needs a GPU)
# --------------------------------------------------------------------------------------------------


@torch.no_grad()
@pytest.mark.parametrize("variant,steps", [("gpn+m", 1), ("gpn+m-2l-awkward-seg2", 1), ("gpn+m-2l-awkward-seg2", 2)])
def test_graph_steps_run_on_static_buffers_without_allocation_or_host_sync(triton_on, monkeypatch, variant, steps):
    """What a CUDA graph captures (`cuda_graphs.StepsGraph.run`: `steps` steps on static buffers) equals the
    plain loop, hands the state back in two alternating slots, and after its first call dispatches no op
    that allocates and none that waits for the host, every intermediate staying in the same buffer."""
    from modeling_gpn import cuda_graphs

    model = perturbed_model(tiny_config(**VARIANTS[variant]), seed=9)
    core = model.model
    B, calls = 3, 3
    tokens, state, _, _ = random_problem(model, batch=B, length=steps * calls, mask_kind=None, seed=4)
    graph = cuda_graphs.StepsGraph(
        core, B, torch.device("cpu"), steps=steps, kernels=fr.GRAPH_KERNELS, w=fr.cached_folded_weights(core, rows=B)
    )
    core.use_fast_path = False
    memory_addresses, graph_state, reference_state = [], state, state
    for call in range(calls):
        window = tokens[:, call * steps : (call + 1) * steps]
        expected, reference_state, expected_gammas = core.recurrence(
            window, reference_state, None, output_memory_decays=True
        )
        outputs, graph_state, gammas = graph(window, graph_state)
        for got, want in zip((outputs, *graph_state, gammas), (expected, *reference_state, expected_gammas)):
            torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-4)
        memory_addresses.append(graph_state[2].data_ptr())
    # two slots: the state handed back was not copied, the next call started from that slot
    if steps % 2:
        assert memory_addresses[0] == memory_addresses[2] != memory_addresses[1]
    else:
        assert memory_addresses[0] == memory_addresses[1] == memory_addresses[2]

    recorder = OpRecorder(monkeypatch)
    buffers = {name: t.data_ptr() for ws in graph.workspaces for name, t in ws.items()}
    with recorder:
        graph.run(graph.current)
    assert recorder.ops, "nothing was recorded"
    assert not [f for f in recorder.ops if allocating(f)], [str(f) for f in recorder.ops if allocating(f)]
    assert not [f for f in recorder.ops if "local_scalar" in str(f) or "item" in str(f)]
    assert buffers == {name: t.data_ptr() for ws in graph.workspaces for name, t in ws.items()}


def plain_then_graphs_on(core, tokens, state, monkeypatch, **kwargs):
    """The plain loop's result for a window from `state`, then the fast path switched on with CUDA graphs
    (`GPN_CUDA_GRAPHS=1`) for the call the test compares with it."""
    core.use_fast_path = False
    expected = core.recurrence(tokens, state, None, **kwargs)
    core.use_fast_path = True
    monkeypatch.setenv("GPN_CUDA_GRAPHS", "1")
    return expected


@torch.no_grad()
def test_a_window_through_graph_chunks_equals_plain(triton_on, monkeypatch):
    """A no-grad window with GPN_CUDA_GRAPHS=1: chunks of WINDOW_CHUNK steps, then single steps."""
    from modeling_gpn import cuda_graphs

    monkeypatch.setattr(cuda_graphs, "WINDOW_CHUNK", 2)
    model = perturbed_model(tiny_config(num_predict_layers=2), seed=13)
    core = model.model
    tokens, state, _, _ = random_problem(model, batch=3, length=5, mask_kind=None, seed=6)
    expected = plain_then_graphs_on(core, tokens, state, monkeypatch, output_memory_decays=True)
    got = core.recurrence(tokens, state, None, output_memory_decays=True)
    for a, b in zip((got[0], *got[1], got[2]), (expected[0], *expected[1], expected[2])):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-4)
    assert {key[2] for key in core._gpn_graphs} == {1, 2}  # two chunks of 2 steps, then one single step


@torch.no_grad()
def test_the_decode_graph_takes_prepacked_weights(triton_on, monkeypatch):
    """On a CPU whose oneDNN has bf16 kernels, `cached_folded_weights` prepacks bf16 step matrices for it
    (`PackedMatrix`); the graph's key step must take them as `key_from_grounded` does (`gpu_check.py
    --dry-run-cpu` failed on such a CPU). Packing forced for fp32 weights: the same path on any CPU."""
    monkeypatch.setattr(fr.PackedMatrix, "worthwhile", staticmethod(lambda w, rows=None: True))
    model = perturbed_model(tiny_config(), seed=14)
    core = model.model
    tokens, state, _, _ = random_problem(model, batch=2, length=1, mask_kind=None, seed=7)
    expected = plain_then_graphs_on(core, tokens, state, monkeypatch)
    got = core.recurrence(tokens, state, None)
    assert [type(graph.w.big_w) for graph in core._gpn_graphs.values()] == [fr.PackedMatrix]  # (the case)
    for a, b in zip((got[0], *got[1]), (expected[0], *expected[1])):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-4)


@torch.no_grad()
def test_a_graph_is_kept_per_dtype_of_every_step_matrix():
    """A captured graph multiplies in its static weights' dtypes and copies (casts) each later call's weights
    into them: a model whose fuse gate alone was cast since (kept in float32 beside bf16 matrices, or the
    reverse) needs a graph of its own, not the old one replaying that product in the old dtype. (Pure
    bookkeeping: on CPU nothing is captured, so no triton is needed.)"""
    from modeling_gpn import cuda_graphs

    core = perturbed_model(tiny_config(), seed=15).model
    cpu, w = torch.device("cpu"), fr.cached_folded_weights(core, rows=2)
    first = cuda_graphs.graph_of(core, 2, cpu, 1, w, {}, kernels=fr.GRAPH_KERNELS)
    recast = cuda_graphs.graph_of(core, 2, cpu, 1, w._replace(fg_w=w.fg_w.bfloat16()), {}, kernels=fr.GRAPH_KERNELS)
    assert recast is not first and recast.w.fg_w.dtype == torch.bfloat16 and first.w.fg_w.dtype == torch.float32
    assert cuda_graphs.graph_of(core, 2, cpu, 1, w, {}, kernels=fr.GRAPH_KERNELS) is first  # (same dtypes: kept)


@torch.no_grad()
def test_the_no_grad_graphs_kept_are_bounded(triton_on, monkeypatch):
    """Each batch size gets graphs of its own (two state slots and workspaces a row): a server meeting many batch
    sizes kept them all. The least recently used go first, and a state a dropped graph returned continues
    exactly (copied into the slots of the graph made again)."""
    from modeling_gpn import cuda_graphs

    monkeypatch.setattr(cuda_graphs, "MAX_INFERENCE_GRAPHS", 3)
    model = perturbed_model(tiny_config(), seed=17)
    core, cpu = model.model, torch.device("cpu")
    graph = lambda batch: cuda_graphs.graph_of(
        core, batch, cpu, 1, fr.cached_folded_weights(core, rows=batch), {}, kernels=fr.GRAPH_KERNELS
    )
    kept = lambda: [key[0] for key in core._gpn_graphs]  # batch sizes, least recently used first
    tokens, state, _, _ = random_problem(model, batch=1, length=2, mask_kind=None, seed=9)
    core.use_fast_path = False
    expected = core.recurrence(tokens, state, None)
    first, carried, _ = graph(1)(tokens[:, :1], state)
    first = first.clone()
    for batch in (2, 3, 4):
        graph(batch)
    assert kept() == [2, 3, 4]
    second, final, _ = graph(1)(tokens[:, 1:], carried)  # a new graph, reading the dropped one's state
    for a, b in zip((torch.cat([first, second], dim=1), *final), (expected[0], *expected[1])):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-4)
    graph(3)  # used again: kept before 4
    graph(5)
    assert kept() == [1, 3, 5]


@torch.no_grad()
def test_graphs_made_under_inference_mode_run_outside_it(triton_on, monkeypatch):
    """Graphs made under torch.inference_mode() (an evaluation harness) and replayed under no_grad (generate())
    write their static buffers in place, which torch forbids on inference tensors outside inference mode (it
    raised): the buffers are made outside it. On CUDA a capture keeps its own copies of weights folded under it
    (`own_weights`: a later call copies its weights into them)."""
    from modeling_gpn import cuda_graphs

    model = perturbed_model(tiny_config(), seed=16)
    core = model.model
    tokens, state, _, _ = random_problem(model, batch=2, length=2, mask_kind=None, seed=8)
    expected = plain_then_graphs_on(core, tokens, state, monkeypatch)
    with torch.inference_mode():
        first = core.recurrence(tokens, state, None)
    second = core.recurrence(tokens, state, None)
    assert core.last_recurrence_backends.graphs == fr.INFERENCE_GRAPHS
    for got in (first, second):
        for a, b in zip((got[0], *got[1]), (expected[0], *expected[1])):
            torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-4)
    with torch.inference_mode():
        w = fr.cached_folded_weights(core, rows=2)
    graph = cuda_graphs.StepsGraph(core, 2, torch.device("cpu"), kernels=fr.GRAPH_KERNELS, w=w)
    assert not [t for t in recurrence_step._flatten(graph.own_weights()) if t.is_inference()]


@torch.no_grad()
def test_generate_through_the_decode_graph_equals_plain(triton_on, monkeypatch):
    """generate() with GPN_CUDA_GRAPHS=1: every decoded token goes through the static-buffer step, as on a GPU.
    On CPU a decoded token of ids on the CPU runs as one C call before the dispatcher is asked (which never
    happens on CUDA), so that is switched off here: else only the prompt (5 tokens, one single-step graph call
    each) would reach the graph, and a broken decode graph would pass."""
    monkeypatch.setenv("GPN_DECODE_KERNEL", "0")
    model = perturbed_model(tiny_config(), seed=12)
    prompt = torch.randint(1, 97, (2, 5), generator=torch.Generator().manual_seed(1))
    model.model.use_fast_path = False
    plain = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    model.model.use_fast_path = True
    monkeypatch.setenv("GPN_CUDA_GRAPHS", "1")
    fast = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(fast, plain)
    assert getattr(model.model, "_gpn_graphs", None)  # the graph steps ran
    # ... for the decoded tokens too: the last forward (the last decoded token) went through the decode graph
    assert model.model.last_recurrence_backends.graphs == fr.INFERENCE_GRAPHS


def test_without_triton_the_model_runs_on_the_other_backends():
    """triton is optional: where it does not import, the backend is the C kernels or torch ops, with the reason
    on record, and the model runs (in a fresh process where `import triton` fails, even with GPN_TRITON=1)."""
    import subprocess
    import sys

    from ..environment import REPO_ROOT

    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from modeling_gpn import fast_recurrence as fr, triton_kernels as tk\n"
        "from tests.tiny_models import perturbed_model, tiny_config\n"
        "assert not tk.available() and 'triton' in tk.unavailable_reason(), tk.unavailable_reason()\n"
        "assert fr.memory_backend(torch.zeros(6, 8, 16)) != fr.TRITON\n"
        "model = perturbed_model(tiny_config())\n"
        "ids = torch.randint(1, 97, (2, 5))\n"
        "model(ids, labels=ids).loss.backward()\n"
        "print('ok')\n"
    )
    env = dict(os.environ, GPN_TRITON="1", TRITON_INTERPRET="1")
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=300
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), (
        result.stdout[-2000:] + result.stderr[-2000:]
    )


# (the self-check a GPU runs before it uses the kernels: tests/fast_path/test_self_check.py)
