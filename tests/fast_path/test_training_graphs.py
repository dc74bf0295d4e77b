"""Training windows on static buffers (`cuda_graphs.TrainingSweep`): what the CUDA graphs of a training
window's forward and backward sweeps capture, run eagerly on CPU through Triton's interpreter.

The sweep must give the outputs and every gradient of the plain loop and of the fast path without graphs
(1 and 2 layers, BPTT segments with a shorter last one, chunks that do not divide the segment, awkward
sizes), fall back to the fast path for what it does not take (masks, truncation, a second call while one
holds its buffers), and, after the first call, run a chunk without any allocating op or host sync, every
buffer staying at its address (what capturing it requires).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from modeling_gpn import cuda_graphs

from ..backend_observer import FAST_PATH, PLAIN_PATH, TRAINING_SWEEP, TRITON, ran
from ..tiny_models import perturbed_model, tiny_config
from .recurrences import assert_same, random_problem, run_recurrence
from .triton_launches import VARIANTS, OpRecorder, allocating

CASES = [  # (variant, bptt segment, length): chunks of 2 steps
    ("gpn+m", None, 5),  # one segment of 5: chunks 2, 2, 1
    ("gpn+m-2l-awkward-seg2", 2, 5),  # segments 2, 2, 1 (the last one's records kept from the forward)
    ("gpn+m-awkward", 3, 4),  # segments 3 (chunks 2, 1) and 1
    ("gpn", 2, 3),
]


@pytest.fixture
def graphs_on(triton_on, monkeypatch):
    monkeypatch.setattr(cuda_graphs, "TRAINING_CHUNK", 2)
    monkeypatch.setenv("GPN_CUDA_GRAPHS", "1")
    return monkeypatch


def sweeps_of(model) -> list:
    return list(getattr(model.model, "_gpn_training_sweeps", {}).values())


@pytest.mark.parametrize("variant,segment,length", CASES)
def test_training_sweep_equals_the_fast_path_and_the_plain_loop(graphs_on, variant, segment, length):
    config = dict(VARIANTS[variant], bptt_segment_length=segment)
    model = perturbed_model(tiny_config(**config), seed=21)
    tokens, state, _, weights = random_problem(model, batch=3, length=length, mask_kind=None, seed=5)
    plain = run_recurrence(model, False, tokens, state, None, weights)
    graphs_on.setenv("GPN_CUDA_GRAPHS", "0")
    with ran(FAST_PATH, TRITON, not_ran=(TRAINING_SWEEP, PLAIN_PATH)):
        fast = run_recurrence(model, True, tokens, state, None, weights)
    assert not sweeps_of(model)
    graphs_on.setenv("GPN_CUDA_GRAPHS", "1")
    for _call in range(2):  # the second call reuses the buffers (and would replay the graphs)
        with ran(FAST_PATH, TRAINING_SWEEP, TRITON, not_ran=(PLAIN_PATH,)):
            swept = run_recurrence(model, True, tokens, state, None, weights)
        assert_same(plain, swept)
        assert_same(fast, swept)
    (sweep,) = sweeps_of(model)
    assert sweep.length == (segment or cuda_graphs.SWEEP_SEGMENT_LENGTH) and sweep.owner is None
    assert all(record is not None for record in sweep.records[:length])  # every position ran on the static buffers


def static_buffers(sweep) -> dict:
    """Address of every buffer a captured chunk reads or writes, by name."""
    named = {f"forward_ws.{j}.{name}": t for j, ws in enumerate(sweep.forward_ws) for name, t in ws.items()}
    named.update({f"backward_ws.{j}.{name}": t for j, ws in enumerate(sweep.backward_ws) for name, t in ws.items()})
    wg = sweep.weight_grads
    for kind in ("grads", "bias_grads", "products", "bias_sums", "blocks", "cast_blocks"):
        for name, value in (getattr(wg, kind) or {}).items():
            for i, t in enumerate(value if isinstance(value, tuple) else (value,)):
                named[f"{kind}.{name}.{i}"] = t
    for name in ("u", "outputs", "gammas", "d_outputs", "d_inputs", "memory", "memory_grads"):
        named[name] = getattr(sweep, name)
    for i, t in enumerate((*sweep.state_in, *sweep.grad_in)):
        named[f"state.{i}"] = t
    return {name: t.data_ptr() for name, t in named.items() if t is not None}


@pytest.mark.parametrize("variant,autocast", [("gpn+m", False), ("gpn+m-2l-awkward-seg2", False), ("gpn+m", True)])
def test_a_training_chunk_runs_without_allocation_or_host_sync(graphs_on, variant, autocast):
    """After the first call, a chunk forward and a chunk backward (what each CUDA graph captures) dispatch no
    op that makes a tensor and none that waits for the host, and every buffer keeps its address (also with
    bf16 step matrices, whose weight-gradient blocks are cast into buffers of their own)."""
    model = perturbed_model(tiny_config(**dict(VARIANTS[variant], bptt_segment_length=4)), seed=22)
    tokens, state, _, weights = random_problem(model, batch=3, length=4, mask_kind=None, seed=6)
    context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with context:
        run_recurrence(model, True, tokens, state, None, weights)
    (sweep,) = sweeps_of(model)
    assert (sweep.w.big_w.dtype == torch.bfloat16) == autocast
    buffers = static_buffers(sweep)
    with context:
        run_recurrence(model, True, tokens, state, None, weights)  # a second call: the same buffers again
    assert static_buffers(sweep) == buffers

    recorder = OpRecorder(graphs_on)
    with torch.no_grad(), recorder:
        sweep.forward_steps(2, 2)
        sweep.backward_steps(2, 2)
    assert recorder.ops, "nothing was recorded"
    assert not [f for f in recorder.ops if allocating(f)], [str(f) for f in recorder.ops if allocating(f)]
    assert not [f for f in recorder.ops if "local_scalar" in str(f) or "item" in str(f)]
    assert static_buffers(sweep) == buffers


@pytest.mark.parametrize("kind", ["mask", "truncation", "inference only"])
def test_what_the_sweep_does_not_take_runs_the_fast_path(graphs_on, kind):
    """Padding masks and truncated BPTT are not on static buffers, and GPN_CUDA_GRAPHS=inference asks for
    the no-grad graphs only: those training windows run the fast path as before."""
    if kind == "inference only":
        graphs_on.setenv("GPN_CUDA_GRAPHS", "inference")
    config = dict(bptt_truncation_length=2) if kind == "truncation" else {}
    model = perturbed_model(tiny_config(**config), seed=23)
    tokens, state, mask, weights = random_problem(
        model, batch=3, length=4, mask_kind="holes" if kind == "mask" else None, seed=7
    )
    plain = run_recurrence(model, False, tokens, state, mask, weights)
    with ran(
        FAST_PATH, TRITON, not_ran=(TRAINING_SWEEP, PLAIN_PATH)
    ):  # the fast path without a sweep, not the plain loop
        fast = run_recurrence(model, True, tokens, state, mask, weights)
    assert_same(plain, fast)
    assert not sweeps_of(model)


def test_a_second_call_before_the_first_backward_runs_the_fast_path(graphs_on):
    """The buffers hold one call's records from its forward to its backward: a second forward meanwhile runs
    the fast path, and both backward passes give the plain gradients (in either order)."""
    model = perturbed_model(tiny_config(bptt_segment_length=2), seed=24)
    core = model.model
    problems = [random_problem(model, batch=2, length=3, mask_kind=None, seed=s) for s in (8, 9)]
    expected = [run_recurrence(model, False, *p[:2], None, p[3]) for p in problems]
    core.use_fast_path = True
    objectives, inputs, graphs = [], [], []
    for tokens, state, _, weights in problems:
        tokens = tokens.clone().requires_grad_(True)
        outputs, final, _ = core.recurrence(tokens, state, None)
        objectives.append((outputs * weights[0]).sum() + sum((x * w).sum() for x, w in zip(final, weights[1:])))
        inputs.append(tokens)
        graphs.append(core.last_recurrence_backends.graphs)
    assert graphs == ["training", None]  # the second call: the fast path without the buffers the first one holds
    (sweep,) = sweeps_of(model)
    assert sweep.owner is not None and sweep.owner() is not None  # the first call holds the buffers
    for index in (1, 0):
        model.zero_grad(set_to_none=True)
        objectives[index].backward()
        torch.testing.assert_close(inputs[index].grad, expected[index][2]["token_inputs"], atol=2e-5, rtol=2e-4)
        for name, p in core.named_parameters():
            if name not in expected[index][2]:  # no gradient reaches it (the embedding: inputs are given)
                assert p.grad is None, name
                continue
            torch.testing.assert_close(p.grad, expected[index][2][name], atol=2e-5, rtol=2e-4, msg=name)
    assert sweep.owner is None


def test_bf16_autocast_sweep_tracks_the_fast_path(graphs_on):
    """Under bf16 autocast the sweep's static weights, transposes and weight-gradient casts are bf16: its
    gradients equal the fast path's up to bf16 rounding (its weight-gradient blocks are smaller)."""
    model = perturbed_model(tiny_config(num_predict_layers=2, bptt_segment_length=3), seed=25)
    tokens, state, _, weights = random_problem(model, batch=3, length=4, mask_kind=None, seed=10)
    results = {}
    for graphs in ("0", "1"):
        graphs_on.setenv("GPN_CUDA_GRAPHS", graphs)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            results[graphs] = run_recurrence(model, True, tokens, state, None, weights)
    (sweep,) = sweeps_of(model)
    assert sweep.w.big_w.dtype == torch.bfloat16 and sweep.weight_grads.cast_blocks is not None
    fast, swept = results["0"], results["1"]
    torch.testing.assert_close(swept[0], fast[0], atol=1e-5, rtol=1e-5)  # the same bf16 products
    for name, grad in fast[2].items():
        scale = grad.abs().max().clamp_min(1e-6)
        assert (swept[2][name] - grad).abs().max() / scale < 2e-2, name


@pytest.mark.parametrize("segment", [3, None])
def test_windows_of_other_lengths_reuse_one_sweep(graphs_on, segment):
    """One sweep per segment length serves windows of every length (a shorter one is one shorter segment);
    without segments the sweep's are `SWEEP_SEGMENT_LENGTH` long: always = plain."""
    model = perturbed_model(tiny_config(bptt_segment_length=segment), seed=26)
    lengths, used = [], []
    for length in (3, 5, 2):
        tokens, state, _, weights = random_problem(model, batch=2, length=length, mask_kind=None, seed=length)
        assert_same(
            run_recurrence(model, False, tokens, state, None, weights),
            run_recurrence(model, True, tokens, state, None, weights),
        )
        (sweep,) = sweeps_of(model)
        lengths.append(sweep.length)
        used.append(sweep)
    assert lengths == [segment or cuda_graphs.SWEEP_SEGMENT_LENGTH] * 3
    assert all(sweep is used[0] for sweep in used)  # (one sweep, not a new one of the same length per window)


@pytest.mark.parametrize("graphs", ["1", "0"])
def test_a_second_backward_is_refused_with_a_clear_error(graphs_on, graphs):
    """The fast path (on the sweep's buffers or not) frees its saved state during backward: a second
    backward (retain_graph=True) says so and names the plain path, instead of failing on a freed record; and, as a
    spent carried cache continued where no check sees it ends here too, `cache.detach()` for that case."""
    graphs_on.setenv("GPN_CUDA_GRAPHS", graphs)
    model = perturbed_model(tiny_config(bptt_segment_length=2), seed=25)
    core = model.model
    core.use_fast_path = True
    tokens, state, _, weights = random_problem(model, batch=2, length=5, mask_kind=None, seed=10)
    outputs, final, _ = core.recurrence(tokens.clone().requires_grad_(True), state, None)
    objective = (outputs * weights[0]).sum() + sum((x * w).sum() for x, w in zip(final, weights[1:]))
    assert bool(sweeps_of(model)) == (graphs == "1")
    objective.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match=r"one backward per forward.*use_fast_path = False.*cache\.detach\(\)"):
        objective.backward()
