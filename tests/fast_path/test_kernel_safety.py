"""Nothing wrong in silence on the fast path: autocast and bf16 weights compute what the plain loop computes
(kernels on and off), the C kernels refuse any tensor they cannot read, and the kernel cache loads only
this user's own intact build (damaged, foreign and hostile libraries in a real cache, each probed in a
subprocess where a crash would show; a compiler that hangs is stopped)."""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from ..backend_observer import CHUNKED_LOSS, FAST_PATH, PLAIN_PATH, ran
from ..bf16_closeness import assert_bf16_close
from ..environment import REPO_ROOT, require_environment
from ..subprocesses import process_state, two_at_a_time
from ..tiny_models import perturbed_model, tiny_config, well_conditioned_model
from .recurrences import KERNEL_MODES

pytestmark = pytest.mark.usefixtures("one_thread")

PACKAGE = REPO_ROOT / "modeling_gpn"
HAS_COMPILER = bool(os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc"))
NO_COMPILER = "no C compiler (cc, gcc or $CC) here: the kernels never build"


@pytest.fixture
def c_compiler() -> None:
    """Skip for want of a C compiler (fail under GPN_REQUIRE_C_KERNELS=1, as in CI)."""
    require_environment(HAS_COMPILER, NO_COMPILER, "GPN_REQUIRE_C_KERNELS")


needs_compiler = pytest.mark.usefixtures("c_compiler")


# --------------------------------------------------------------------------------------------------
# bf16: autocast and bf16 weights, fast path = plain loop
# --------------------------------------------------------------------------------------------------


def loss_logprobs_grads(model, ids, fast: bool, autocast: bool, dtype: torch.dtype = torch.bfloat16):
    """Loss, next-token log-probs and parameter gradients of one training forward/backward (under CPU
    autocast to `dtype` if `autocast`)."""
    model.model.use_fast_path = fast
    model.zero_grad(set_to_none=True)
    region = torch.autocast("cpu", dtype=dtype) if autocast else contextlib.nullcontext()
    with region, ran(FAST_PATH if fast else PLAIN_PATH):
        out = model(ids, labels=ids)
    out.loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach().float(), out.logits.detach().float().log_softmax(-1), grads


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(  # (a GPN has no memory: the kernels have nothing to run)
    "variant,memory_kernels",
    [
        (v, k)
        for v in (dict(), dict(num_predict_layers=2), dict(use_memory=False))
        for k in KERNEL_MODES
        if not (v == dict(use_memory=False) and k == "memory-kernels")
    ],
    indirect=["memory_kernels"],
)
def test_cpu_bf16_autocast_fast_equals_plain(variant, dtype, memory_kernels):
    """Under CPU bf16 autocast (what `--mixed-precision bf16` runs; and fp16) the fast path computes what
    the plain loop computes under the same autocast: loss, log-probs and gradients, kernels on and off."""
    model = well_conditioned_model(tiny_config(**variant, bptt_segment_length=5), seed=21)
    ids = torch.randint(0, model.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(22))
    params = dict(model.named_parameters())
    exact = loss_logprobs_grads(model, ids, fast=False, autocast=False)
    plain = loss_logprobs_grads(model, ids, fast=False, autocast=True, dtype=dtype)
    fast = loss_logprobs_grads(model, ids, fast=True, autocast=True, dtype=dtype)
    assert all(p.dtype == torch.float32 for p in params.values())
    assert_bf16_close(fast, plain, exact, params)


def test_cpu_bf16_weights_fast_equals_plain(memory_kernels):
    """bf16 weights, without and with autocast: the fast path equals the plain loop, kernels on and off;
    the gradients are bf16 like the weights."""
    model = well_conditioned_model(tiny_config(num_predict_layers=2), seed=23).to(torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(24))
    params = dict(model.named_parameters())
    exact = loss_logprobs_grads(copy.deepcopy(model).float(), ids, fast=False, autocast=False)  # same weights
    for autocast in (False, True):
        plain = loss_logprobs_grads(model, ids, fast=False, autocast=autocast)
        fast = loss_logprobs_grads(model, ids, fast=True, autocast=autocast)
        assert all(g.dtype == torch.bfloat16 for g in fast[2].values())
        assert_bf16_close(fast, plain, exact, params)


@torch.no_grad()
def test_cpu_bf16_autocast_inference_and_cached_decoding(memory_kernels):
    """Inference under autocast (the no-grad fast path with its cached folded weights) and token-by-token
    decoding with a cache: the same log-probs as the plain loop under autocast, and the cached weights of
    an autocast call are not reused outside it (fp32 results stay fp32-exact)."""
    from modeling_gpn import GPNCache

    model = perturbed_model(tiny_config(), seed=25)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(26))
    results = {}
    for fast in (False, True):
        model.model.use_fast_path = fast
        with torch.autocast("cpu", dtype=torch.bfloat16), ran(FAST_PATH if fast else PLAIN_PATH):
            whole = model(ids).logits.float().log_softmax(-1)
            cache = GPNCache(model.config)
            steps = [model(ids[:, t : t + 1], cache=cache, use_cache=True).logits.float() for t in range(ids.shape[1])]
        results[fast] = (whole, torch.cat(steps, dim=1).log_softmax(-1), model(ids).logits)
        assert cache.get_state()[2].dtype == torch.float32
    for got, expected in zip(results[True][:2], results[False][:2]):
        diff = (got - expected).abs()
        assert diff.max() < 0.02 and diff.mean() < 0.003, f"max {diff.max():.4f}, mean {diff.mean():.5f}"
    torch.testing.assert_close(results[True][2], results[False][2], atol=1e-5, rtol=1e-5)  # after: fp32 again


def test_backward_called_inside_autocast(memory_kernels):
    """`loss.backward()` inside the autocast region (not the recommended place, but common): the fast
    path's hand-written backward still runs in float32 with bf16 matmuls, equal to the plain loop."""
    model = well_conditioned_model(tiny_config(), seed=27)
    ids = torch.randint(0, model.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(28))
    exact = loss_logprobs_grads(model, ids, fast=False, autocast=False)
    results = []
    for fast in (False, True):
        model.model.use_fast_path = fast
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16), ran(FAST_PATH if fast else PLAIN_PATH):
            out = model(ids, labels=ids)
            out.loss.backward()
        results.append(
            (
                out.loss.detach(),
                out.logits.float().log_softmax(-1).detach(),
                {n: p.grad for n, p in model.named_parameters()},
            )
        )
    assert_bf16_close(results[1], results[0], exact, dict(model.named_parameters()))


def test_chunked_loss_under_autocast_matches_the_plain_loss(memory_kernels):
    """Training's chunked loss (`return_logits=False`) on the fast path under bf16 autocast: the loss and
    gradients of the plain loop with full logits under the same autocast."""
    model = well_conditioned_model(tiny_config(), seed=29)
    ids = torch.randint(0, model.config.vocab_size, (2, 15), generator=torch.Generator().manual_seed(30))
    runs = []
    for fast, autocast in ((False, False), (False, True), (True, True)):
        model.model.use_fast_path = fast
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), ran(*[FAST_PATH, CHUNKED_LOSS] * fast):
            loss = model(ids, labels=ids, return_logits=not fast).loss  # fast: the chunked loss
        loss.backward()
        assert loss.dtype == torch.float32
        runs.append((loss.detach(), loss.detach().new_zeros(1), {n: p.grad for n, p in model.named_parameters()}))
    exact, plain, fast = runs
    assert_bf16_close(fast, plain, exact, dict(model.named_parameters()))


# --------------------------------------------------------------------------------------------------
# The kernels refuse what they cannot read
# --------------------------------------------------------------------------------------------------


def step_problem(seed: int = 0, rows: int = 2, H: int = 3, dk: int = 4, dv: int = 5, layers: int = 2):
    """Arguments of `memory_step` and `memory_write_backward` for a small random problem."""
    from modeling_gpn import fast_recurrence as fr

    s = fr.Shapes(batch=rows, hidden=6, inter=7, heads=H, key_dim=dk, value_dim=dv, layers=layers, memory=True)
    c = fr.columns_of(s)
    g = torch.Generator().manual_seed(seed)
    width = c.write + c.read_gate.stop
    BH = rows * H
    forward = dict(
        Z=torch.randn(rows, width, generator=g),
        columns=c,
        key=torch.randn(rows, H * dk, generator=g),
        neg_decay_rate=-torch.rand(H, generator=g),
        memory=torch.randn(BH, dk, dv, generator=g),
        memory_out=torch.empty(BH, dk, dv),
        rms_eps=1e-6,
    )
    backward = dict(
        memory_grad=torch.randn(BH, dk, dv, generator=g),
        memory=torch.randn(BH, dk, dv, generator=g),
        queries=torch.randn(layers, BH, dk, generator=g),
        read_grads=torch.randn(layers, BH, dv, generator=g),
        k=torch.randn(BH, dk, generator=g),
        update=torch.randn(BH, dv, generator=g),
        a=torch.rand(BH, 1, generator=g),
        beta=torch.rand(BH, 1, generator=g),
        memory_grad_out=torch.empty(BH, dk, dv),
    )
    return forward, backward


@needs_compiler
def test_kernels_refuse_tensors_they_cannot_read_and_the_torch_ops_take_over():
    """Each kernel entry raises KernelRefusal naming the argument for a bf16/float64, non-contiguous, wrongly
    sized or overlapping tensor, before reading anything; the fast path's wrappers then compute the same with
    the torch ops (equal to the kernel on the well-formed arguments when only the layout was off)."""
    from modeling_gpn import fast_recurrence as fr
    from modeling_gpn import memory_kernels as mk

    assert mk.available(), mk.unavailable_reason()
    forward, backward = step_problem(seed=1)
    M, Z, key, c = forward["memory"], forward["Z"], forward["key"], forward["columns"]
    query_end = c.write + c.query.stop
    # (argument, bad value, what the torch ops make of it: "same" as the good value, "other" values, or
    # None: they cannot take it either)
    bad_forward = [
        ("Z", Z.bfloat16(), "other"),
        ("Z", Z.double(), None),
        ("Z", Z.t().contiguous().t(), "same"),
        ("Z", Z[:, : query_end - 1], None),
        ("key", key.bfloat16(), "other"),
        ("key", torch.stack([key, key], dim=2)[:, :, 0], "same"),
        ("key", key[:, :-1], None),
        ("memory", M.transpose(1, 2).contiguous().transpose(1, 2), "same"),
        ("memory", M.bfloat16(), None),
        ("memory", M[:, :, :-1], None),
        ("neg_decay_rate", forward["neg_decay_rate"].bfloat16(), "other"),
        ("neg_decay_rate", forward["neg_decay_rate"][:-1], None),
        ("memory_out", torch.empty_like(M).transpose(1, 2).contiguous().transpose(1, 2), "same"),
        ("memory_out", torch.empty_like(M).bfloat16(), "other"),
        ("memory_out", torch.empty_like(M)[:, :-1], None),
        ("memory_out", M, None),  # M' written over M
    ]
    reference, expected_out = mk.memory_step(**forward), torch.empty_like(M)  # the kernel on good arguments
    expected = fr._memory_step_torch(*{**forward, "memory_out": expected_out}.values())
    for got, want in zip([*reference, forward["memory_out"]], [*expected, expected_out]):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    for name, bad, torch_ops in bad_forward:
        arguments = {**forward, name: bad}
        with pytest.raises(mk.KernelRefusal, match=name):
            mk.memory_step(**arguments)
        if torch_ops is None:
            continue
        half = fr._memory_half(*arguments.values())
        expected = fr._memory_step_torch(
            *{**arguments, "memory_out": bad.clone() if name == "memory_out" else torch.empty_like(M)}.values()
        )
        for got, want in zip(half, expected):
            torch.testing.assert_close(got, want, atol=0, rtol=0)
        if torch_ops == "same":
            for got, want in zip(half, reference):
                torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)

    out = torch.empty_like(M)
    reference = fr._memory_write_backward_torch(**{**backward, "memory_grad_out": out})
    for got, want in zip([*mk.memory_write_backward(**backward), backward["memory_grad_out"]], [*reference, out]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    bad_backward = [
        ("memory_grad", backward["memory_grad"].bfloat16()),
        ("memory_grad", backward["memory_grad"][:, :-1]),
        ("queries", backward["queries"].bfloat16()),
        ("queries", backward["queries"][:, :-1]),
        ("read_grads", backward["read_grads"].half()),
        ("read_grads", backward["read_grads"][:, :, :-1]),
        ("k", backward["k"][:, :-1]),
        ("update", backward["update"].bfloat16()),
        ("a", backward["a"][:-1]),
        ("beta", backward["beta"].bfloat16()),
        ("memory_grad_out", backward["memory_grad"]),
        ("memory_grad_out", torch.empty_like(M).transpose(1, 2).contiguous().transpose(1, 2)),
    ]
    for name, bad in bad_backward:
        with pytest.raises(mk.KernelRefusal, match=name):
            mk.memory_write_backward(**{**backward, name: bad})
    # a bf16 decay factor through the wrapper: the torch ops take it (the same as on its float32 values)
    arguments = {**backward, "a": backward["a"].bfloat16(), "memory_grad_out": torch.empty_like(M)}
    got = fr._memory_write_gradients(*arguments.values())
    rounded = {**backward, "a": backward["a"].bfloat16().float(), "memory_grad_out": torch.empty_like(M)}
    expected = fr._memory_write_backward_torch(*rounded.values())
    for a, b in zip([*got, arguments["memory_grad_out"]], [*expected, rounded["memory_grad_out"]]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # non-contiguous inputs the backward kernel copies (k is such a view on the fast path): still right
    strided = {**backward, "k": torch.stack([backward["k"], backward["k"]], dim=1)[:, 0]}
    assert not strided["k"].is_contiguous()
    for got, want in zip(mk.memory_write_backward(**strided), reference):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


REPLACED_OF_ANOTHER_SHAPE = {
    "ffn_in": lambda layer, c: setattr(
        layer.ffn_in, "weight", torch.nn.Parameter(torch.randn(2 * c.intermediate_size + 1, c.hidden_size))
    ),
    "A_log": lambda layer, c: None,  # (the memory write's, below)
    "read_out_norm": lambda layer, c: setattr(
        layer.read_out_norm, "weight", torch.nn.Parameter(torch.ones(c.hidden_size))
    ),
}


@pytest.mark.parametrize("replaced", sorted(REPLACED_OF_ANOTHER_SHAPE))
def test_a_weight_replaced_by_one_of_another_shape_is_refused_by_name(replaced):
    """`layer.ffn_in.weight = nn.Parameter(...)` of one more row (or an A_log of one more head, a read output norm as
    wide as the state where the read is narrower): the plain loop raises on the shapes; the fast path says which
    weight, never returning logits, on the C step kernels (B = 2) and the torch ops (B = 17). (Both once took some:
    the extra row ran into the next product's columns, a norm or A_log was read only as far as the config says.)
    The C step plan refuses them too, whoever builds it."""
    from modeling_gpn import memory_kernels as mk

    assert mk.available(), mk.unavailable_reason()
    config = tiny_config(num_memory_heads=2, memory_value_dim=8)  # (the read, 16 wide, narrower than d = 48)
    model = perturbed_model(config, seed=41)
    REPLACED_OF_ANOTHER_SHAPE[replaced](model.model.predict_layers[0], config)
    if replaced == "A_log":
        model.model.memory_write.A_log = torch.nn.Parameter(torch.zeros(config.num_memory_heads + 1))
    name = {"A_log": "memory_write.A_log"}.get(replaced, f"predict_layers.0.{replaced}.weight")
    for rows in (2, 17):
        ids = torch.randint(1, 97, (rows, 4), generator=torch.Generator().manual_seed(42))
        model.model.use_fast_path = False
        with torch.no_grad(), pytest.raises(RuntimeError):
            model(ids)
        model.model.use_fast_path = True
        with torch.no_grad(), pytest.raises(ValueError, match=rf"{name} has shape .* but the config makes it"):
            model(ids)
        assert model.model.last_recurrence_path == "fast"
    with pytest.raises(mk.KernelRefusal, match="config makes"):
        mk.StepPlan(model.model, 2)


# --------------------------------------------------------------------------------------------------
# The kernel cache: real damaged and foreign libraries, each probed in a subprocess
# --------------------------------------------------------------------------------------------------

# Loads memory_kernels.py and fast_recurrence.py as remote code does (a package of the shipped files,
# without the installed package), asks for the kernels, and compares one kernel step (forward and
# backward) with the torch ops. Prints one JSON line.
PROBE = textwrap.dedent(
    """
    import importlib, json, sys, types, warnings
    import torch
    package = types.ModuleType("gpn_remote")
    package.__path__ = [sys.argv[1]]
    sys.modules["gpn_remote"] = package
    sizes = json.loads(sys.argv[2])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kernels = importlib.import_module("gpn_remote.memory_kernels")
        fr = importlib.import_module("gpn_remote.fast_recurrence")
        available = kernels.available()
    result = {"available": available, "reason": kernels.unavailable_reason(),
              "warnings": [str(w.message) for w in caught if issubclass(w.category, kernels.KernelWarning)]}
    if available:
        rows, H, dk, dv, layers = sizes
        s = fr.Shapes(batch=rows, hidden=1, inter=1, heads=H, key_dim=dk, value_dim=dv, layers=layers, memory=True)
        c = fr.columns_of(s)
        g = torch.Generator().manual_seed(0)
        BH = rows * H
        Z = torch.randn(rows, c.write + c.read_gate.stop, generator=g)
        key, neg = torch.randn(rows, H * dk, generator=g), -torch.rand(H, generator=g)
        M = torch.randn(BH, dk, dv, generator=g)
        outs = torch.empty(2, BH, dk, dv)
        got = kernels.memory_step(Z, c, key, neg, M, outs[0], 1e-6)
        want = fr._memory_step_torch(Z, c, key, neg, M, outs[1], 1e-6)
        error = max((a - b).abs().max().item() for a, b in zip([*got, outs[0]], [*want, outs[1]]))
        args = [torch.randn(BH, dk, dv, generator=g), M, torch.randn(layers, BH, dk, generator=g),
                torch.randn(layers, BH, dv, generator=g), torch.randn(BH, dk, generator=g),
                torch.randn(BH, dv, generator=g), torch.rand(BH, 1, generator=g), torch.rand(BH, 1, generator=g)]
        got = kernels.memory_write_backward(*args, outs[0])
        want = fr._memory_write_backward_torch(*args, outs[1])
        scale = max(1.0, max(b.abs().max().item() for b in [*want, outs[1]]))
        error = max(error, max((a - b).abs().max().item() for a, b in zip([*got, outs[0]], [*want, outs[1]])) / scale)
        result["error"] = error
    print(json.dumps(result))
    """
)


def probe(cache: Path, *, sizes=(2, 3, 4, 5, 2), timeout: float = 300, **env_changes) -> dict:
    """Run PROBE in a fresh process with `GPN_KERNEL_CACHE=cache`; a crash (bus error, segfault) fails here."""
    env = {k: v for k, v in os.environ.items() if k not in ("GPN_MEMORY_KERNELS", "GPN_KERNEL_BUILD_TIMEOUT")}
    env.update(GPN_KERNEL_CACHE=str(cache), OMP_NUM_THREADS="1")
    for name, value in env_changes.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(PACKAGE), json.dumps(list(sizes))],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, f"the probe died with {done.returncode}: {done.stderr[-3000:]}"
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["seconds"] = time.monotonic() - started
    return result


def cached_files(cache: Path) -> tuple[Path, Path]:
    """(library, record) of the one build in `cache`."""
    (record,) = cache.glob("gpn_memory_*.sha256")
    (library,) = cache.glob("gpn_memory_*.so")
    return library, record


def plant(cache: Path, content: bytes) -> Path:
    """Replace the build in `cache` by `content` under the name and record a build of it would have."""
    library, record = cached_files(cache)
    content_hash = hashlib.sha256(content).hexdigest()
    library.unlink()
    planted = library.with_name(library.name.rsplit("-", 1)[0] + f"-{content_hash[:16]}.so")
    planted.write_bytes(content)
    record.write_text(content_hash + "\n")
    # (as a build leaves them, whatever the umask: a library writable by the group, under umask 002, is refused for
    # that before the complaint the test plants it for)
    planted.chmod(0o644)
    record.chmod(0o644)
    return planted


def assert_rebuilt_and_right(result: dict, cache: Path, complaint: str) -> None:
    """The probe warned about `complaint`, rebuilt, and its kernels computed what the torch ops compute."""
    assert result["available"], result
    assert any(complaint in w for w in result["warnings"]), result["warnings"]
    assert result["error"] < 1e-5, result
    library, record = cached_files(cache)
    assert not library.is_symlink() and library.stat().st_uid == os.getuid()
    assert not library.stat().st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    assert record.read_text().strip() == hashlib.sha256(library.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def good_build(tmp_path_factory) -> Path:
    """A cache folder holding one good build (made by a probe), copied by each scenario that needs one."""
    require_environment(HAS_COMPILER, NO_COMPILER, "GPN_REQUIRE_C_KERNELS")
    cache = tmp_path_factory.mktemp("good-kernel-cache")
    result = probe(cache)
    assert result["available"] and not result["warnings"] and result["error"] < 1e-5, result
    return cache


def copy_of(good_build: Path, target: Path) -> Path:
    target.mkdir(mode=0o700)
    for path in good_build.glob("gpn_memory_*"):
        shutil.copy2(path, target / path.name)
    return target


def compile_foreign(tmp_path: Path, source: str) -> bytes:
    """A real shared library built from other C source."""
    c_file, built = tmp_path / "foreign.c", tmp_path / "foreign.so"
    c_file.write_text(source)
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    subprocess.run([compiler, "-shared", "-fPIC", str(c_file), "-o", str(built)], check=True, capture_output=True)
    return built.read_bytes()


# Each test below names its scenario with `@kernel_cache(prepare)`: `prepare(folder, good_build)` makes the
# cache folders of the scenario (`good_build` is None for a test that does not request that fixture) and
# returns a Scenario; `cache_probes` prepares and probes every selected test's scenario ahead, two at a time,
# and the test asserts on its own (`probed`).
def kernel_cache(prepare) -> pytest.MarkDecorator:
    """The mark naming a test's scenario (`with_args`: a mark given one function alone would decorate it)."""
    return pytest.mark.kernel_cache.with_args(prepare)


@dataclass
class Scenario:
    """The caches one test probes, in order, each with `probe`'s keyword arguments, and anything noted while
    preparing them that the test checks afterwards."""

    probes: list[tuple[Path, dict]]
    noted: dict = field(default_factory=dict)


@dataclass
class Probed:
    """A scenario and its probes' results, in the order of its caches."""

    caches: list[Path]
    results: list[dict]
    noted: dict


def prepare_and_probe(prepare, folder: Path, good_build: Path | None) -> Probed:
    scenario = prepare(folder, good_build)
    results = [probe(cache, **arguments) for cache, arguments in scenario.probes]
    return Probed([cache for cache, _ in scenario.probes], results, scenario.noted)


@pytest.fixture(scope="module")
def cache_probes(request, tmp_path_factory) -> Iterator[dict]:
    """Every selected kernel-cache test's scenario, prepared and probed ahead: each probe is a fresh process
    on one thread (most rebuild the kernels with one `cc`), a minute of the suite's 15 on 2 cores one after
    another, half of it two at a time. Maps each scenario's `prepare` to a future of its Probed; a scenario that
    cannot be prepared here (not root) raises in its own test, as it would have inside it."""
    tests = [item for item in request.session.items if getattr(item, "module", None) is request.module]
    scenarios = {
        item.get_closest_marker("kernel_cache").args[0]: "good_build" in item.fixturenames
        for item in tests
        if item.get_closest_marker("kernel_cache")
    }
    with two_at_a_time() as pool:

        def start(prepare, good_build: Path | None) -> Future:
            return pool.submit(prepare_and_probe, prepare, tmp_path_factory.mktemp(prepare.__name__), good_build)

        # those that need no good build first: they run while it is made
        futures = {prepare: start(prepare, None) for prepare, needs in scenarios.items() if not needs}
        good_build = None
        if HAS_COMPILER and any(scenarios.values()):
            with contextlib.suppress(Exception):  # (its tests request it too, and fail on its error there)
                good_build = request.getfixturevalue("good_build")
        if good_build is not None:  # (else each test of the rest skips or fails on good_build)
            futures |= {prepare: start(prepare, good_build) for prepare, needs in scenarios.items() if needs}
        yield futures


@pytest.fixture
def probed(request, cache_probes) -> Probed:
    """This test's scenario, prepared and probed (ahead, by `cache_probes`)."""
    return cache_probes[request.node.get_closest_marker("kernel_cache").args[0]].result()


def reused(folder: Path, good_build: Path) -> Scenario:
    cache = copy_of(good_build, folder / "cache")
    library, _ = cached_files(cache)
    return Scenario([(cache, {})], dict(library=library, before=(library.stat().st_mtime_ns, library.stat().st_ino)))


@kernel_cache(reused)
def test_a_good_build_is_reused_without_a_rebuild(good_build, probed):
    [cache], [result], noted = probed.caches, probed.results, probed.noted
    library = noted["library"]
    assert result["available"] and not result["warnings"] and result["error"] < 1e-5, result
    assert (library.stat().st_mtime_ns, library.stat().st_ino) == noted["before"]  # loaded, not rebuilt
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700


def truncated(folder: Path, good_build: Path) -> Scenario:
    cache = copy_of(good_build, folder / "cache")
    library, _ = cached_files(cache)
    content = library.read_bytes()
    library.write_bytes(content[: len(content) // 2])
    return Scenario([(cache, {})], dict(library=library, size=len(content)))


@kernel_cache(truncated)
def test_a_truncated_build_is_rebuilt_not_loaded(good_build, probed):
    """A truncated library (a killed copy, a full disk) gave every later process a bus error."""
    [cache], [result], noted = probed.caches, probed.results, probed.noted
    assert_rebuilt_and_right(result, cache, "does not match the hash")
    assert noted["library"].stat().st_size == noted["size"]


def from_other_source(folder: Path, good_build: Path) -> Scenario:
    from modeling_gpn import memory_kernels as mk

    kernels = "".join(f"void {name}(void) {{}}\n" for name in mk._SYMBOLS if name != "gpn_kernel_source_digest")
    foreign = compile_foreign(
        folder, kernels + 'const char *gpn_kernel_source_digest(void) { return "not the GPN kernels"; }\n'
    )
    caches = []
    for with_record in (False, True):
        cache = copy_of(good_build, folder / f"cache-{with_record}")
        if with_record:
            plant(cache, foreign)
        else:
            cached_files(cache)[0].write_bytes(foreign)
        caches.append((cache, {}))
    return Scenario(caches)


@kernel_cache(from_other_source)
def test_a_library_from_other_source_under_the_right_name_is_rebuilt(good_build, probed):
    """Another library with the expected name: without a matching record (a plain swap), and with a record
    that matches it and the right symbols (built from other source: its source digest gives it away)."""
    complaints = ("does not match the hash", "built from other source")  # without, with the record
    for cache, result, complaint in zip(probed.caches, probed.results, complaints, strict=True):
        assert_rebuilt_and_right(result, cache, complaint)


def without_symbols(folder: Path, good_build: Path) -> Scenario:
    cache = copy_of(good_build, folder / "cache")
    plant(cache, compile_foreign(folder, "int gpn_something_else(void) { return 1; }\n"))
    return Scenario([(cache, {})])


@kernel_cache(without_symbols)
def test_a_library_without_the_expected_symbols_is_rebuilt_with_a_warning(good_build, probed):
    """A library whose record matches but which lacks the kernels' symbols: a warning, not a traceback."""
    [cache], [result] = probed.caches, probed.results
    assert_rebuilt_and_right(result, cache, "lacks the symbols")


def symlink(folder: Path, good_build: Path) -> Scenario:
    elsewhere = copy_of(good_build, folder / "elsewhere")
    target, _ = cached_files(elsewhere)
    cache = copy_of(good_build, folder / "cache")
    library, _ = cached_files(cache)
    library.unlink()
    library.symlink_to(target)
    return Scenario([(cache, {})], dict(target=target))


@kernel_cache(symlink)
def test_a_symlink_at_the_library_name_is_replaced_not_followed(good_build, probed):
    """A symbolic link (to a good build elsewhere, so only the link is wrong) is not loaded; it is removed
    (what it pointed to is left alone) and a build of this user's own takes its place."""
    [cache], [result], target = probed.caches, probed.results, probed.noted["target"]
    assert_rebuilt_and_right(result, cache, "symbolic link")
    assert target.is_file() and not target.is_symlink()


def group_writable_library(folder: Path, good_build: Path) -> Scenario:
    cache = copy_of(good_build, folder / "cache")
    library, _ = cached_files(cache)
    library.chmod(0o775)
    return Scenario([(cache, {})])


@kernel_cache(group_writable_library)
def test_a_group_writable_library_is_rebuilt(good_build, probed):
    [cache], [result] = probed.caches, probed.results
    assert_rebuilt_and_right(result, cache, "writable by group or others")


def group_writable_folder(folder: Path, good_build: Path) -> Scenario:
    cache = copy_of(good_build, folder / "cache")
    cache.chmod(0o777)
    return Scenario([(cache, {})])


@kernel_cache(group_writable_folder)
def test_a_group_writable_cache_folder_of_ours_is_tightened(good_build, probed):
    [cache], [result] = probed.caches, probed.results
    assert result["available"] and result["error"] < 1e-5, result
    assert any("removing the group/other write permission" in w for w in result["warnings"]), result
    assert not cache.stat().st_mode & (stat.S_IWGRP | stat.S_IWOTH)


OTHER_USER = 65534  # nobody


def of_another_user(folder: Path, good_build: Path) -> Scenario:
    is_root = hasattr(os, "getuid") and os.getuid() == 0
    require_environment(is_root, "not root: making files of another user needs root", "GPN_REQUIRE_ROOT")
    cache = copy_of(good_build, folder / "cache")
    library, _ = cached_files(cache)
    os.chown(library, OTHER_USER, OTHER_USER)
    foreign_cache = copy_of(good_build, folder / "foreign-cache")
    os.chown(foreign_cache, OTHER_USER, OTHER_USER)
    return Scenario([(cache, {}), (foreign_cache, {})])


@kernel_cache(of_another_user)
def test_files_and_folders_of_another_user_are_not_trusted(good_build, probed):
    """A library owned by another user is rebuilt; a cache folder owned by another user is not used at
    all: the kernels are off with a warning, and the torch ops serve."""
    [cache, _], [library_of_another, folder_of_another] = probed.caches, probed.results
    assert_rebuilt_and_right(library_of_another, cache, f"owned by uid {OTHER_USER}")
    result = folder_of_another
    assert not result["available"] and f"owned by uid {OTHER_USER}" in result["reason"], result
    assert any("nothing is loaded from it" in w for w in result["warnings"]), result


def fake_compiler(folder: Path, script: str) -> dict:
    """Environment changes that put an executable `cc` with this shell `script` first on PATH."""
    folder.mkdir()
    cc = folder / "cc"
    cc.write_text("#!/bin/sh\n" + script)
    cc.chmod(0o755)
    return dict(PATH=f"{folder}{os.pathsep}{os.environ.get('PATH', '')}", CC=None)


def hanging_compiler(folder: Path, good_build: None) -> Scenario:
    pid_file = folder / "sleeper.pid"
    env = fake_compiler(folder / "bin", f"sleep 1000 &\necho $! > {pid_file}\nwait\n")
    return Scenario(
        [(folder / "cache", dict(GPN_KERNEL_BUILD_TIMEOUT="3", timeout=120, **env))], dict(pid_file=pid_file)
    )


@pytest.mark.skipif(not Path("/bin/sh").exists(), reason="needs /bin/sh for the fake compiler")
@kernel_cache(hanging_compiler)
def test_a_hanging_compiler_is_stopped_and_the_torch_ops_serve(probed):
    """A `cc` that never returns (and leaves a child behind): stopped after GPN_KERNEL_BUILD_TIMEOUT with a
    warning, its whole process group killed, the kernels off; nothing half-built is left in the cache."""
    [cache], [result] = probed.caches, probed.results
    assert not result["available"] and "did not finish within 3 s" in result["reason"], result
    assert any("did not finish within 3 s" in w for w in result["warnings"]), result
    assert result["seconds"] < 60
    sleeper = int(probed.noted["pid_file"].read_text())
    deadline, seen = time.monotonic() + 60, process_state(sleeper)
    while seen not in ("X", "Z") and time.monotonic() < deadline:  # killed: a zombie, or reaped by init ("X")
        time.sleep(0.1)
        seen = process_state(sleeper)
    assert seen in ("X", "Z"), seen
    assert not list(cache.glob("gpn_memory_*.so")) and not list(cache.glob(".build-*"))


def junk_writing_compiler(folder: Path, good_build: None) -> Scenario:
    env = fake_compiler(folder / "bin", 'for last; do :; done\nhead -c 3000 /dev/urandom > "$last"\n')
    return Scenario([(folder / "cache", env)])


@pytest.mark.skipif(not Path("/bin/sh").exists(), reason="needs /bin/sh for the fake compiler")
@kernel_cache(junk_writing_compiler)
def test_a_compiler_that_writes_junk_turns_the_kernels_off_with_a_warning(probed):
    """A `cc` that exits 0 but writes junk (or a truncated file) where the library goes: never loaded as a
    library that works; a clear warning, and the torch ops serve."""
    [result] = probed.results
    assert not result["available"] and "fresh build is unusable" in result["reason"], result
    assert any("fresh build is unusable" in w for w in result["warnings"]), result


def refusing_compiler(folder: Path, *refused: str) -> dict:
    """`fake_compiler`: a `cc` that refuses the flags `refused` as a compiler without them does (one line on stderr,
    exit 1) and is the real compiler otherwise."""
    real = shutil.which(os.environ.get("CC") or "cc") or shutil.which("gcc")
    cases = "|".join(refused)
    return fake_compiler(
        folder,
        f'for flag; do case "$flag" in {cases}) echo "cc: error: unsupported option \'$flag\'" >&2; exit 1;; esac; done\n'
        f'exec "{real}" "$@"\n',
    )


def compiler_without_march_native(folder: Path, good_build: None) -> Scenario:
    return Scenario([(folder / "cache", refusing_compiler(folder / "bin", "-march=native"))])


@needs_compiler
@pytest.mark.skipif(not Path("/bin/sh").exists(), reason="needs /bin/sh for the fake compiler")
@kernel_cache(compiler_without_march_native)
def test_a_compiler_refusing_march_native_builds_with_mcpu_native_and_computes_right(probed):
    """gcc on aarch64 and older clang on Apple silicon refuse -march=native (it failed the build: the kernels off,
    with the compiler's error as a warning); such a build asks for -mcpu=native instead, without a warning, and
    its kernels compute what the torch ops compute."""
    [cache], [result] = probed.caches, probed.results
    assert result["available"] and not result["warnings"] and result["error"] < 1e-5, result
    assert len(list(cache.glob("gpn_memory_*.so"))) == 1 and not list(cache.glob(".build-*"))


@needs_compiler
@pytest.mark.skipif(not Path("/bin/sh").exists(), reason="needs /bin/sh for the fake compiler")
def test_the_cpu_flag_falls_back_in_turn_and_a_compiler_without_openmp_leaves_the_torch_ops(tmp_path, monkeypatch):
    """Where -mcpu=native is refused too, no CPU flag (a build for the target's baseline); where the compiler has
    no OpenMP (Apple's clang refuses -fopenmp), which the kernels need, the torch ops run: the reason recorded
    (`unavailable_reason`), no warning, as with no compiler at all (the usual case there)."""
    import warnings

    from modeling_gpn import fast_recurrence as fr
    from modeling_gpn import memory_kernels as mk

    neither = refusing_compiler(tmp_path / "neither", "-march=native", "-mcpu=native")["PATH"].split(os.pathsep)[0]
    flags = mk._flags_after_failure(f"{neither}/cc", list(mk._FLAGS), tmp_path, 60)
    assert flags == [flag.replace("-march=native", "-mcpu=native") for flag in mk._FLAGS]
    assert mk._flags_after_failure(f"{neither}/cc", flags, tmp_path, 60) == [
        f for f in mk._FLAGS if f != "-march=native"
    ]
    real = shutil.which(os.environ.get("CC") or "cc") or shutil.which("gcc")
    assert mk._flags_after_failure(real, list(mk._FLAGS), tmp_path, 60) is None  # (no flag to blame: the error stands)

    no_openmp = refusing_compiler(tmp_path / "no-openmp", "-fopenmp")["PATH"].split(os.pathsep)[0]
    monkeypatch.setenv("CC", f"{no_openmp}/cc")
    monkeypatch.setenv("GPN_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("GPN_MEMORY_KERNELS", raising=False)
    monkeypatch.setattr(mk, "_library", None)
    monkeypatch.setattr(mk, "_failure", None)
    with warnings.catch_warnings():
        warnings.simplefilter("error", mk.KernelWarning)
        assert not mk.available()
    assert "has no OpenMP, which the kernels need (cc: error: unsupported option '-fopenmp')" in mk.unavailable_reason()
    assert fr.memory_backend(torch.zeros(2, 3, 4), torch.zeros(2, 5)) == fr.TORCH_OPS
    assert not list((tmp_path / "cache").glob("gpn_memory_*.so"))


STACK_OVERFLOWING_SIZES = ((1, 1, 2, 1 << 20, 1), (1, 1, 1 << 20, 2, 2))


def large_memory_sizes(folder: Path, good_build: Path) -> Scenario:
    cache = copy_of(good_build, folder / "cache")
    return Scenario([(cache, dict(sizes=sizes)) for sizes in STACK_OVERFLOWING_SIZES])


@needs_compiler
@kernel_cache(large_memory_sizes)
def test_memory_sizes_that_overflowed_the_kernel_stack_compute_right(good_build, probed):
    """memory_value_dim >= 2^20 (and layers x memory_key_dim of 2^21) put 8 MB arrays on a thread's stack:
    a segfault. The kernels now keep no arrays on the stack: the same results as the torch ops."""
    for sizes, result in zip(STACK_OVERFLOWING_SIZES, probed.results, strict=True):
        assert result["available"] and result["error"] < 1e-3, (sizes, result)  # float32 sums of 2^20 terms


def test_the_model_card_says_the_remote_code_compiles_c_and_how_to_turn_it_off():
    """The card names what the C runs: since the step kernels, decoding and prefill too (it said "two small C
    kernels (the memory update of a step and its gradient)", which a user turning them off for a test read as
    training-only)."""
    from modeling_gpn.hub.model_card import build_card, validate_card

    card = build_card(tiny_config(), "someone/tiny-gpn", n_params=1234)
    validate_card(card)
    for words in (
        "compiles and loads C",
        "`cc`",
        "GPN_KERNEL_CACHE",
        "~/.cache/gpn/kernels",
        "GPN_MEMORY_KERNELS=0",
        "GPN_KERNEL_BUILD_TIMEOUT",
        "whole no-grad step of 1 to 16 rows",
        "decoded token",
    ):
        assert words in card, words
