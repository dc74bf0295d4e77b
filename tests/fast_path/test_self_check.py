"""The self-check a GPU runs before it uses the Triton kernels (`triton_kernels.self_check`), on CPU through
Triton's interpreter (TRITON_INTERPRET=1, set by tests/environment.py), and the code around the CUDA graph
captures (`cuda_graphs.captured`) and the training sweeps' memory bound.

The self-check must not false-alarm on correct kernels (results a few float32 ulps off the torch ops', as a
GPU's are: `gpu_noise` injects that into every kernel's output) and must catch a wrong one: an error of
1e-2 in any single output, an error in a branch a fresh model's zero weights hide, an error only in the
variant compiled for a batch divisible by 16; a failure turns the kernels off for that combination only.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from modeling_gpn import GPNForCausalLM, cuda_graphs
from modeling_gpn import fast_recurrence as fr
from modeling_gpn import triton_kernels as tk

from ..tiny_models import perturbed_model, tiny_config
from .recurrences import assert_same, random_problem, run_recurrence
from .triton_launches import VARIANTS, launches

CPU = torch.device("cpu")
EPS = 1e-6


@pytest.fixture
def fresh_self_check(triton_on, monkeypatch):
    """The self-check on (as on CUDA) with its results of this process forgotten, restored afterwards."""
    monkeypatch.setenv("GPN_TRITON_SELF_CHECK", "1")
    monkeypatch.setattr(tk, "_self_checks", {})
    return tk


def fresh_weights_and_sizes(batch: int = 3, **overrides):
    """A fresh (unperturbed) model's folded weights, whose fuse gate, gates and FFN output are zero, and
    its step sizes at `batch`."""
    torch.manual_seed(0)
    model = GPNForCausalLM(tiny_config(**overrides))
    return fr.fold_weights(model.model), fr.shapes_of(model.model, batch)


def on_every_launch(monkeypatch, change):
    """Run `change(name, written)` after every kernel launch, `written` being the float32 tensors the launch
    wrote (found by comparing them before and after): a kernel whose results are off as `change` says."""
    launch = tk._launch

    def launch_and_change(name, grid, *args, **meta):
        tensors = [a for a in args if isinstance(a, torch.Tensor) and a.dtype == torch.float32]
        before = [t.clone() for t in tensors]
        launch(name, grid, *args, **meta)
        change(name, [t for t, old in zip(tensors, before) if not torch.equal(t, old)])

    monkeypatch.setattr(tk, "_launch", launch_and_change)


def gpu_noise(monkeypatch, ulps: int = 2, seed: int = 0) -> torch.Generator:
    """Every kernel's results moved by up to `ulps` float32 ulps each (uniform integers in [-ulps, ulps] times
    the value's ulp; an exact zero stays zero), as a GPU's differ from torch's: reduction order, approximate
    division, exp2, fast sqrt. Returns the noise's generator (reseed it for another draw)."""
    generator = torch.Generator().manual_seed(seed)

    def noise(name, written):
        for t in written:
            steps = torch.randint(-ulps, ulps + 1, t.shape, generator=generator).float()
            t.add_(steps * torch.finfo(torch.float32).eps * t.abs())

    on_every_launch(monkeypatch, noise)
    return generator


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_self_check_passes_correct_kernels_whose_results_carry_gpu_noise(fresh_self_check, monkeypatch, dtype):
    """Few-ulp noise in every kernel output (what a correct kernel on a GPU gives) passes, in fp32 and bf16,
    at every batch checked, for four draws of the noise. Fails on the old check in bf16 (it multiplied in
    bf16: a few ulps flip a bf16 rounding and move a term by ~0.4%, against its 1e-3 elementwise
    tolerance: the second of these draws fails it in bf16); sizes of a few hundred so that enough values are rounded,
    batch 2 only (the other batches' variants are the other tests' concern; the interpreter is slow)."""
    monkeypatch.setattr(tk, "SELF_CHECK_BATCHES", (2,), raising=False)  # (raising: so the old code runs too)
    w, s = fresh_weights_and_sizes(
        batch=2, hidden_size=256, intermediate_size=512, num_memory_heads=2, memory_key_dim=32, memory_value_dim=64
    )
    w = fr.in_matmul_dtype(w, dtype)
    noise = gpu_noise(monkeypatch)
    for seed in range(4):
        noise.manual_seed(seed)
        tk._self_checks.clear()
        with torch.no_grad():
            assert tk.self_check(w, s, EPS, CPU, dtype), (seed, tk.self_check_failure())
    assert tk.self_check_summary() == {
        f"cpu {str(dtype)[6:]} (batch 2, hidden 256, inter 512, 1 layer(s), 2 heads of 32x64)": "passed"
    }


def test_the_self_check_runs_full_float32_matmuls_whatever_the_process_set(fresh_self_check, monkeypatch):
    """A process that set `torch.set_float32_matmul_precision("high")` (TF32 products on a GPU, bf16-based in
    oneDNN on CPU: training scripts do) gets its check's steps, both sides, in full float32 (inputs a few
    ulps apart would otherwise round apart in a 10-bit mantissa: ~5e-4, above the tolerance), and its own
    setting back afterwards. (On CPU the rounding is too fine to fail the check itself; hence the setting,
    as the check's steps see it, is what is asserted.)"""
    seen = []
    one_step = tk._one_step

    def recorded(*args):
        seen.append(torch.get_float32_matmul_precision())
        return one_step(*args)

    monkeypatch.setattr(tk, "_one_step", recorded)
    w, s = fresh_weights_and_sizes(batch=2)
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        with torch.no_grad():
            assert tk.self_check(w, s, EPS, CPU, torch.float32)
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(precision)
    assert seen == ["highest"] * 4  # (batches 2 and 16, torch ops and kernels)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_error_of_1e_2_in_any_single_output_fails(fresh_self_check, monkeypatch, dtype):
    """Every quantity the check compares (new state, gamma, state and input gradients, every weight and
    bias gradient): one element of the kernels' result off by 1e-2 of the quantity's largest fails the
    check, naming the quantity and the combination (end to end for one, through `compare_results` on the
    check's own results for all of them; at batch 2 only, the interpreter being slow)."""
    monkeypatch.setattr(tk, "SELF_CHECK_BATCHES", (2,))
    w, s = fresh_weights_and_sizes(batch=2)
    w = fr.in_matmul_dtype(w, dtype)
    results = []
    one_step = tk._one_step

    def recorded(forward, *args):
        results.append(one_step(forward, *args))
        return results[-1]

    monkeypatch.setattr(tk, "_one_step", recorded)
    with torch.no_grad():
        assert tk.self_check(w, s, EPS, CPU, dtype)
    expected, got = results  # (torch ops, then the kernels)
    assert len(expected) >= 12 and "weight gradient ('out', 0)" in expected and "gamma" in expected
    assert tk.compare_results(expected, got) is None
    for name, value in got.items():
        off = {**got, name: value.clone()}
        flat = off[name].view(-1)
        flat[flat.abs().argmax()] += 1e-2 * (flat.abs().max() if flat.abs().max() > 0 else 1)  # (d g is 0 here)
        assert (tk.compare_results(expected, off) or "").startswith(f"{name}: relative error"), name

    # end to end: the new p of the kernels off by 1e-2 in one element
    def off_new_p(forward, *args):
        named = one_step(forward, *args)
        if forward is tk.step:
            named["new p"].view(-1)[0] += 1e-2 * named["new p"].abs().max()
        return named

    monkeypatch.setattr(tk, "_one_step", off_new_p)
    monkeypatch.setattr(tk, "_self_checks", {})
    with (
        torch.no_grad(),
        pytest.warns(RuntimeWarning, match=f"disagree .* on cpu {str(dtype)[6:]} \\(batch 2, .*new p"),
    ):
        assert not tk.self_check(w, s, EPS, CPU, dtype)


def test_an_error_in_a_branch_a_fresh_model_zeroes_is_caught(fresh_self_check, monkeypatch):
    """The FFN's gradient columns off by 1% (a wrong derivative of the FFN): a fresh model's zero FFN output
    makes those gradients 0 both ways; the check's own random weights do not. Fails on the old check, which
    ran on the model's own weights."""
    original = tk.predict_layer_backward

    def wrong_ffn_gradient(part, c, *args, **kwargs):
        result = original(part, c, *args, **kwargs)
        d_part = args[5]
        d_part[:, c.ffn_a] *= 1.01
        return result

    monkeypatch.setattr(tk, "predict_layer_backward", wrong_ffn_gradient)
    monkeypatch.setattr(tk, "SELF_CHECK_BATCHES", (2,), raising=False)  # (raising: so the old code runs too)
    w, s = fresh_weights_and_sizes(batch=2)
    assert float(w.out_w[0][: s.inter].abs().max()) == 0  # (a fresh model's FFN output is zero)
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="disagree"):
        assert not tk.self_check(w, s, EPS, CPU, torch.float32)
    assert "relative error" in tk.self_check_failure()


def test_an_error_only_in_the_variant_for_batches_divisible_by_16_turns_off_that_batch_only(
    fresh_self_check, monkeypatch
):
    """`memory_write_backward` wrong only when its `heads` (B*H) is divisible by 16 (Triton compiles that
    case apart): the check of batch 16 catches it and names it; the model then runs batch 16 on the torch
    ops (= plain) and batch 3, which passed, on the kernels. Fails on the old check (batch 2 only), which
    kept the kernels on for every batch."""

    def wrong_when_divisible_by_16(name, written):
        if name == "memory_write_backward" and written and written[0].shape[0] % 16 == 0:
            for t in written:
                t.mul_(1.01)

    on_every_launch(monkeypatch, wrong_when_divisible_by_16)
    model = perturbed_model(tiny_config(num_memory_heads=2), seed=5).train()
    problems = {batch: random_problem(model, batch=batch, length=3, mask_kind=None, seed=batch) for batch in (3, 16)}
    plain = {batch: run_recurrence(model, False, *problem) for batch, problem in problems.items()}
    with pytest.warns(RuntimeWarning, match="disagree .* on cpu float32 \\(batch 16, .*"):
        fast3, _ = launches(lambda: run_recurrence(model, True, *problems[3]))
    failures = tk.self_check_failures()
    assert list(failures) == [next(k for k in failures if "(batch 16," in k)]
    assert_same(plain[3], fast3)  # (batch 3 on the kernels: unaffected by the error)
    _, n = launches(lambda: run_recurrence(model, True, *problems[3]))
    assert n["memory_step"] == 3  # batch 3 runs on the kernels
    fast16, n = launches(lambda: run_recurrence(model, True, *problems[16]))
    assert sum(n.values()) == 0  # batch 16 runs on the torch ops, forward and backward
    assert_same(plain[16], fast16)


def test_kernels_that_raise_turn_off_their_combination_and_the_torch_ops_run(fresh_self_check, monkeypatch):
    """A kernel that raises on its first launch (as a Triton release that rejects it, a GPU machine without
    a C compiler for Triton's launcher, or an asynchronous CUDA error caught by the check's synchronize,
    would) does not stop the model: the self-check warns with the error and the window runs on the torch
    ops, = plain."""
    launch = tk._launch

    def failing_launch(name, *args, **meta):
        if name == "memory_write_backward":
            raise RuntimeError("PTXAS error: Internal Triton PTX codegen error\nmore lines")
        launch(name, *args, **meta)

    monkeypatch.setattr(tk, "_launch", failing_launch)
    model = perturbed_model(tiny_config(**VARIANTS["gpn+m"]), seed=5).train()
    problem = random_problem(model, batch=3, length=4, mask_kind=None, seed=2)
    plain = run_recurrence(model, False, *problem)
    with pytest.warns(RuntimeWarning, match="disagree .*raised RuntimeError: PTXAS error"):
        fast, n = launches(lambda: run_recurrence(model, True, *problem))
    assert tk.self_check_failure().endswith("PTXAS error: Internal Triton PTX codegen error")  # its first line
    assert len(tk.self_check_failures()) == 3  # batches 2, 3 and 16: every one raised
    assert n["ground"] == 3 and n["memory_write_backward"] == 0  # only the check's own forward steps ran on them
    assert "its self-check failed" in model.model.last_recurrence_backends.triton_refused  # (the window says why)
    assert_same(plain, fast)


@torch.no_grad()
def test_a_passed_check_runs_once_per_sizes_and_the_kernels_stay_on(fresh_self_check):
    model = perturbed_model(tiny_config(**VARIANTS["gpn+m-2l"]), seed=4)
    token_inputs, state, _, _ = random_problem(model, batch=3, length=3, mask_kind=None, seed=1)
    _, n = launches(lambda: model.model.recurrence(token_inputs, state, None))
    assert tk.self_check_failure() is None and len(tk._self_checks) == 3
    assert n["ground_gate_backward"] == 3  # the check ran the kernels' backward step once per batch size
    _, n = launches(lambda: model.model.recurrence(token_inputs, state, None))
    assert n["ground_gate_backward"] == 0 and n["ground"] == 3  # checked once; the window ran on the kernels


# --------------------------------------------------------------------------------------------------
# The capture of a CUDA graph, around torch's own capture
# --------------------------------------------------------------------------------------------------


class CaptureRecorder:
    """Stand-ins for the torch.cuda calls a capture makes, recording them in order on CPU: a side stream,
    the stream context, the device guard, the graph and its capture context (which runs its body eagerly,
    as nothing here can capture). Real objects of their own, not mocks of the code under test."""

    def __init__(self):
        self.events: list = []
        self.stream = None  # the stream entered (`torch.cuda.stream`), while it is
        self.side = None  # the last stream made

    def install(self, monkeypatch) -> None:
        recorder = self

        class Stream:
            def __init__(self):
                recorder.side = self
                recorder.events.append("side stream made")

            def wait_stream(self, other):
                recorder.events.append("side waits" if self is recorder.side else "current waits")

        current = Stream.__new__(Stream)

        @contextlib.contextmanager
        def stream(s):
            recorder.stream = s
            recorder.events.append("enter side stream")
            yield
            recorder.events.append("leave side stream")
            recorder.stream = None

        @contextlib.contextmanager
        def device(d):
            recorder.events.append(("device", str(d)))
            yield

        class CUDAGraph:
            def replay(self):
                recorder.events.append("replay")

        @contextlib.contextmanager
        def graph(g, **kwargs):
            recorder.events.append(("capture", kwargs))
            yield
            recorder.events.append("captured")

        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda *args: current)
        monkeypatch.setattr(torch.cuda, "stream", stream)
        monkeypatch.setattr(torch.cuda, "device", device)
        monkeypatch.setattr(torch.cuda, "CUDAGraph", CUDAGraph)
        monkeypatch.setattr(torch.cuda, "graph", graph)

    def ran(self, what: str):
        """A function recording that it ran, and on which stream."""
        return lambda: self.events.append((what, "side stream" if self.stream is not None else "current stream"))


def test_a_capture_warms_up_on_a_side_stream_then_captures_thread_local_on_the_tensors_device(monkeypatch):
    """`cuda_graphs.captured`, which every capture goes through: under the tensors' device, a warm-up on
    a side stream that waits for the current one (and is waited for), then each capture with
    capture_error_mode="thread_local". What this cannot show without a GPU: that CUDA accepts the capture,
    that another thread's CUDA calls no longer break it, that the replay computes the warm-up's results
    (gpu_check.py checks those on a device)."""
    recorder = CaptureRecorder()
    recorder.install(monkeypatch)
    like = torch.zeros(1)
    graphs = cuda_graphs.captured(recorder.ran("warm-up"), [recorder.ran("run 0"), recorder.ran("run 1")], like)
    assert len(graphs) == 2
    assert recorder.events == [
        ("device", "cpu"),
        "side stream made",
        "side waits",
        "enter side stream",
        ("warm-up", "side stream"),
        "leave side stream",
        "current waits",
        ("capture", {"capture_error_mode": "thread_local"}),
        ("run 0", "current stream"),
        "captured",
        ("capture", {"capture_error_mode": "thread_local"}),
        ("run 1", "current stream"),
        "captured",
    ]


def test_the_training_sweep_and_the_decode_graph_capture_through_it(triton_on, monkeypatch):
    """A training sweep's first chunk and a decode graph (the real ones, on CPU with the stand-ins) are
    captured through `captured`: the warm-up runs the real steps on the side stream, the capture the same
    steps in thread_local mode; the second call of a chunk replays it."""
    recorder = CaptureRecorder()
    recorder.install(monkeypatch)
    model = perturbed_model(tiny_config(), seed=3)
    w = fr.fold_weights(model.model)
    sweep = cuda_graphs.TrainingSweep(model.model, 2, 4, w, CPU, kernels=fr.GRAPH_KERNELS)
    sweep.capture = True
    steps = []
    forward_steps = sweep.forward_steps
    on_side_stream = lambda *a: (steps.append(recorder.stream is not None), forward_steps(*a))
    monkeypatch.setattr(sweep, "forward_steps", on_side_stream)
    sweep._run("forward", 0, 2)
    sweep._run("forward", 0, 2)
    assert steps == [True, False]  # warm-up on the side stream, then the capture's run
    captures = [e for e in recorder.events if isinstance(e, tuple) and e[0] == "capture"]
    assert captures == [("capture", {"capture_error_mode": "thread_local"})] and recorder.events[-1] == "replay"
    recorder.events.clear()
    graph = cuda_graphs.StepsGraph(
        model.model, 1, CPU, kernels=fr.GRAPH_KERNELS, w=fr.cached_folded_weights(model.model, rows=1)
    )
    graph.capture()
    assert [e for e in recorder.events if isinstance(e, tuple) and e[0] == "capture"] == 2 * captures
    assert recorder.events.index("leave side stream") < recorder.events.index(captures[0])


# --------------------------------------------------------------------------------------------------
# Training sweeps are bounded
# --------------------------------------------------------------------------------------------------


def test_one_training_sweep_is_kept_and_it_always_has_a_segment(triton_on, monkeypatch):
    """Without `bptt_segment_length` a sweep still holds one segment of `SWEEP_SEGMENT_LENGTH` positions (not
    the window's), and a window of another batch size replaces the sweep instead of adding one (its buffers
    freed): = plain throughout. Fails on the old code (a sweep per batch size, as long as the window)."""
    monkeypatch.setattr(cuda_graphs, "TRAINING_CHUNK", 2)
    monkeypatch.setattr(cuda_graphs, "SWEEP_SEGMENT_LENGTH", 3)
    monkeypatch.setenv("GPN_CUDA_GRAPHS", "1")
    model = perturbed_model(tiny_config(bptt_segment_length=None), seed=26)
    kept = []
    for batch in (3, 2):
        problem = random_problem(model, batch=batch, length=5, mask_kind=None, seed=batch)
        assert_same(run_recurrence(model, False, *problem), run_recurrence(model, True, *problem))
        sweeps = list(model.model._gpn_training_sweeps.values())
        assert len(sweeps) == 1 and sweeps[0].length == 3 and sweeps[0].s.batch == batch
        kept.append(sweeps[0])
    assert kept[0] is not kept[1]
    assert kept[1].nbytes() > 3 * 2 * 3 * 8 * 16 * 4  # (at least its 3 slots of M)


# --------------------------------------------------------------------------------------------------
# What a timing ran on
# --------------------------------------------------------------------------------------------------


def test_the_backend_probe_tells_the_kernels_from_the_torch_ops(triton_on, monkeypatch):
    """`bench.BackendProbe` (what gpn bench's JSON and gpu_check.py report each timing ran on): a window on
    the Triton kernels, the same window with GPN_TRITON=0, and one whose combination failed its self-check
    (the torch ops run it: the probe must not report the kernels)."""
    from modeling_gpn.bench import BackendProbe

    model = perturbed_model(tiny_config(), seed=7)
    tokens, state, _, _ = random_problem(model, batch=2, length=2, mask_kind=None, seed=3)
    core = model.model
    core.use_fast_path = True
    with torch.no_grad(), BackendProbe() as probe:
        core.recurrence(tokens, state, None)
    assert probe.text.startswith("triton kernels, no graphs (")
    monkeypatch.setenv("GPN_TRITON", "0")
    with torch.no_grad(), BackendProbe() as probe:  # (a no-grad window of 2 rows: the C step kernels, where they build)
        core.recurrence(tokens, state, None)
    from modeling_gpn import memory_kernels

    assert probe.text == ("c step kernels (2 steps)" if memory_kernels.available() else "torch ops")
    monkeypatch.setenv("GPN_STEP_KERNELS", "0")
    with torch.no_grad(), BackendProbe() as probe:
        core.recurrence(tokens, state, None)
    assert probe.text == "torch ops"
    monkeypatch.setenv("GPN_TRITON", "1")
    s = fr.shapes_of(core, 2)
    monkeypatch.setitem(tk._self_checks, tk._self_check_key(CPU, s, torch.float32), "new p: relative error 1")
    with torch.no_grad(), BackendProbe() as probe:
        core.recurrence(tokens, state, None)
    assert probe.text == "torch ops"
