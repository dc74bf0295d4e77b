"""The C step kernels (issue 28): a no-grad step of a few rows in one C call on the modules' own weights
(float32, bfloat16, torchao int8 weight-only), the few-row products (logits, decoder and token projections),
a decoded token in one C call (embedding row to logits: `memory_kernels.DecodePlan`), and what the fast path
accepts of quantized weights. Each test compares with the plain loop (the module-calling reference) and
shows the kernels ran (`tests/backend_observer.py`). The decode loops run twice: their tokens in one C call
each, and (`GPN_DECODE_KERNEL=0`) as a step call beside the few-row products."""

from __future__ import annotations

import platform

import pytest
import torch

from ..backend_observer import (
    C_PRODUCTS,
    C_STEP_KERNELS,
    DECODE_CALLS,
    FAST_PATH,
    INT4_STEPS,
    INT8_STEPS,
    PLAIN_PATH,
    ran,
)
from ..environment import require_c_kernels, require_exact_int8, require_int4_products, require_int8_tiles
from ..tiny_models import perturbed_model, tiny_config, well_conditioned_model

torchao = pytest.importorskip("torchao.quantization", reason="torchao (the test extra) quantizes the int8 models")


def quantized(model: torch.nn.Module, config=None, head: bool = True) -> torch.nn.Module:
    """`model` in bf16 with every nn.Linear quantized by torchao (int8 weight-only unless `config`), the head too
    unless `head` is False (it then stays the tied embedding)."""
    model = model.to(torch.bfloat16)
    linears = lambda module, name: type(module) is torch.nn.Linear and (head or name != "lm_head")  # noqa: E731
    torchao.quantize_(model, config or torchao.Int8WeightOnlyConfig(), filter_fn=linears)
    return model


@pytest.fixture(params=[True, False], ids=["decode-in-one-call", "decode-as-step-and-products"])
def decoded_backends(request, monkeypatch) -> tuple[str, ...]:
    """What a decode loop's tokens run on: one C call each, or (GPN_DECODE_KERNEL=0) the step kernels and the
    few-row products; the backends a test then expects to see."""
    if request.param:
        return (DECODE_CALLS,)
    monkeypatch.setenv("GPN_DECODE_KERNEL", "0")
    return (C_PRODUCTS,)


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            return next((set(line.split(":", 1)[1].split()) for line in info if line.startswith("flags")), set())
    except OSError:
        return set()


# the kernels' builds a test runs here (by the extra compiler flags of each): this CPU's own, and on x86 the
# products of CPUs with fewer vector instructions: AVX2 and FMA (the native build again on a CPU without AVX-512),
# and plain C
BUILDS = {"native": (), "avx2": ("-mno-avx512f",), "portable": ("-mno-avx2", "-mno-fma")}
X86 = platform.machine() in ("x86_64", "AMD64")
RUNNABLE = ["native", *(["avx2"] if X86 and {"avx2", "fma"} <= cpu_flags() else []), *(["portable"] if X86 else [])]


def build_in_place(name: str, monkeypatch) -> str:
    """The kernels' build `name` put in place of the default one for the test; its `products_isa()`."""
    require_c_kernels()
    from modeling_gpn import memory_kernels as mk

    if BUILDS[name]:
        monkeypatch.setattr(mk, "_library", mk.variant(BUILDS[name]))
    return mk.products_isa()


@pytest.fixture(params=RUNNABLE)
def products_build(request, monkeypatch) -> str:
    """Each build of the kernels this machine runs, in place of the default for the test (what the products
    compute must not depend on the instructions the CPU has); its `products_isa()`."""
    return build_in_place(request.param, monkeypatch)


@pytest.fixture(params=[name for name in RUNNABLE if name != "portable"])
def exact_int8_build(request, monkeypatch) -> str:
    """Each build whose int8 products may sum exactly on the input rounded to 16 bits (`require_exact_int8` then
    skips the native one of an AVX-512 CPU without VNNI)."""
    build = build_in_place(request.param, monkeypatch)
    require_exact_int8()
    return build


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1)


def decode_loop(model, ids: torch.Tensor, mask: torch.Tensor | None, steps: int = 3) -> torch.Tensor:
    """The logits of a prompt's forward (with its cache) and of `steps` one-token forwards continuing it."""
    with torch.no_grad():
        out = model(ids, attention_mask=mask, use_cache=True)
        logits, cache = [out.logits], out.cache
        token = out.logits[:, -1:].argmax(-1)
        for _ in range(steps):
            mask = None if mask is None else torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            out = model(token, attention_mask=mask, cache=cache, use_cache=True)
            logits.append(out.logits)
            cache, token = out.cache, out.logits[:, -1:].argmax(-1)
    return torch.cat(logits, dim=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("rows, padded", [(1, False), (3, True)], ids=["one-row", "three-rows-left-padded"])
def test_the_step_kernels_compute_the_plain_loop(one_thread, decoded_backends, dtype, rows, padded):
    """Prompt and decode loop of 1 and 3 rows (left padding: the padded rows keep their state and key), 2
    predict layers (the upper layer's own read of M'), on the C step kernels = the plain loop (fp32 to
    summation order; bf16 within bf16's rounding)."""
    require_c_kernels()
    model = perturbed_model(tiny_config(num_predict_layers=2), seed=3).to(dtype)
    ids = torch.randint(1, 97, (rows, 7), generator=torch.Generator().manual_seed(4))
    mask = None
    if padded:
        mask = torch.ones(rows, 7, dtype=torch.long)
        mask[1, :3] = 0
        mask[2, :1] = 0
    decays = lambda: model.model(ids, attention_mask=mask, output_memory_decays=True).memory_decays
    with torch.no_grad(), ran(FAST_PATH, C_STEP_KERNELS, *decoded_backends, not_ran=(PLAIN_PATH,)):
        fast, fast_decays = decode_loop(model, ids, mask), decays()
    model.model.use_fast_path = False
    with torch.no_grad(), ran(PLAIN_PATH, not_ran=(FAST_PATH, C_STEP_KERNELS, C_PRODUCTS, DECODE_CALLS)):
        plain, plain_decays = decode_loop(model, ids, mask), decays()
    low = dtype == torch.bfloat16
    assert (log_probs(fast) - log_probs(plain)).abs().max() < (2e-2 if low else 1e-4)
    torch.testing.assert_close(fast_decays, plain_decays, atol=1e-3 if low else 1e-5, rtol=1e-2 if low else 1e-5)


@pytest.mark.parametrize(
    "variant",
    [dict(use_memory=False, num_predict_layers=2), dict(use_decoder_bias=True)],
    ids=["gpn-without-memory-2-layers", "decoder-bias"],
)
def test_the_step_kernels_take_every_variant(one_thread, decoded_backends, variant):
    """GPN without memory (no write, no reads: the kernels' other branch) and the decoder bias (a biased
    decoder projection on the few-row products) = the plain loop."""
    require_c_kernels()
    model = perturbed_model(tiny_config(**variant), seed=13)
    ids = torch.randint(1, 97, (2, 6), generator=torch.Generator().manual_seed(14))
    with ran(FAST_PATH, C_STEP_KERNELS, *decoded_backends, not_ran=(PLAIN_PATH,)):
        fast = decode_loop(model, ids, None)
    model.model.use_fast_path = False
    assert (log_probs(fast) - log_probs(decode_loop(model, ids, None))).abs().max() < 1e-4


def given_tokens_loop(model, ids: torch.Tensor, given: torch.Tensor) -> torch.Tensor:
    """The log-probabilities of a prompt's forward (with its cache) and of one-token forwards of `given` continuing it."""
    with torch.no_grad():
        out = model(ids, use_cache=True)
        steps = [out.logits]
        for position in range(given.shape[1]):
            out = model(given[:, position : position + 1], cache=out.cache, use_cache=True)
            steps.append(out.logits)
    return log_probs(torch.cat(steps, dim=1))


# Widths below a vector and between vector multiples (the tiny config's are all multiples of 16), one head, a
# key of one dimension and a vocabulary of two: every product, gate and memory loop of a step ends in a tail.
ODD_WIDTHS = dict(
    hidden_size=17, embedding_size=3, intermediate_size=33, num_memory_heads=1, memory_key_dim=1, memory_value_dim=5
)


@pytest.mark.parametrize("weights", ["float32", "bfloat16", "int8"])
def test_the_step_kernels_compute_the_plain_loop_at_odd_widths(one_thread, weights):
    """A prompt and three given tokens (not argmax-fed: a near tie would part the two paths) on a model of odd
    widths and a vocabulary of 2, 1 and 3 rows, on the C step kernels and decoded tokens in one C call = the plain
    loop (float32 to summation order, bf16 and int8 to their rounding)."""
    require_c_kernels()
    model = perturbed_model(tiny_config(vocab_size=2, **ODD_WIDTHS), seed=21)
    if weights == "bfloat16":
        model = model.to(torch.bfloat16)
    elif weights == "int8":
        model = quantized(model)
    generator = torch.Generator().manual_seed(22)
    for rows in (1, 3):
        ids, given = (
            torch.randint(0, 2, (rows, 6), generator=generator),
            torch.randint(0, 2, (rows, 3), generator=generator),
        )
        model.model.use_fast_path = True
        backends = (C_STEP_KERNELS, DECODE_CALLS) + ((INT8_STEPS,) if weights == "int8" else ())
        with ran(FAST_PATH, *backends, not_ran=(PLAIN_PATH,)):
            fast = given_tokens_loop(model, ids, given)
        model.model.use_fast_path = False
        plain = given_tokens_loop(model, ids, given)
        assert (fast - plain).abs().max() < (1e-5 if weights == "float32" else 2e-2), (weights, rows)


def test_int8_weights_run_the_fast_path_within_the_quantization_error(one_thread, decoded_backends):
    """A torchao int8 weight-only model runs the fast path (its step on the C kernels: nothing dequantized,
    no plain loop), = the plain loop of the same quantized model, and within the quantization's own error
    of the unquantized (bf16) fast path; a batch beyond the kernels' rows runs the torch-ops steps on the
    dequantized weights, = the plain loop too."""
    require_c_kernels()
    reference = perturbed_model(tiny_config(), seed=5).to(torch.bfloat16)
    model = quantized(perturbed_model(tiny_config(), seed=5))
    assert model.model.fast_path_blocker() is None
    ids = torch.randint(1, 97, (2, 9), generator=torch.Generator().manual_seed(6))
    with ran(FAST_PATH, C_STEP_KERNELS, INT8_STEPS, *decoded_backends, not_ran=(PLAIN_PATH,)):
        fast = decode_loop(model, ids, None)
    assert model.model.last_recurrence_backends.step == "c step kernels"
    unquantized = decode_loop(reference, ids, None)
    wide = torch.randint(1, 97, (20, 4), generator=torch.Generator().manual_seed(7))  # more rows than the kernels take
    with torch.no_grad(), ran(FAST_PATH, not_ran=(PLAIN_PATH, C_STEP_KERNELS)):
        wide_fast = model(wide).logits
    model.model.use_fast_path = False
    with ran(PLAIN_PATH, not_ran=(FAST_PATH,)):
        plain = decode_loop(model, ids, None)
        with torch.no_grad():
            wide_plain = model(wide).logits
    assert (log_probs(fast) - log_probs(plain)).abs().max() < 1e-2
    assert (log_probs(wide_fast) - log_probs(wide_plain)).abs().max() < 1e-2
    quantization_error = (log_probs(plain) - log_probs(unquantized)).abs().max()
    assert 0 < (log_probs(fast) - log_probs(unquantized)).abs().max() < 2 * quantization_error + 1e-2


def test_weights_the_fast_path_does_not_know_keep_the_plain_path(one_thread):
    """Exactly torchao's int8 weight-only weights are taken: its dynamic-activation int8 (activations
    quantized too) is another computation, so the model keeps the plain loop, which calls the modules."""
    model = quantized(perturbed_model(tiny_config(), seed=8), torchao.Int8DynamicActivationInt8WeightConfig())
    blocker = model.model.fast_path_blocker()
    assert blocker is not None and "not a plain nn.Parameter" in blocker, blocker
    with torch.no_grad(), ran(PLAIN_PATH, not_ran=(FAST_PATH, C_STEP_KERNELS)):
        model(torch.tensor([[1, 2, 3]]))


def int4(model: torch.nn.Module, head: bool = True) -> torch.nn.Module:
    """`model` in bf16 with every nn.Linear (the head too unless `head` is False) quantized by torchao's low-bit
    weight-only config: int4 values in groups of 16 weights, a scale and a zero point each
    (`IntxWeightOnlyConfig`, torchao's CPU int4)."""
    from torchao.quantization.granularity import PerGroup

    return quantized(model, torchao.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(16)), head)


def with_dequantized_weights(model: torch.nn.Module) -> torch.nn.Module:
    """The same model with each quantized weight replaced by the plain matrix its linear multiplies
    (`weight.dequantize()`, in the model's dtype); the head must be the tied embedding (a GPN's plain head is)."""
    for module in model.modules():
        if type(module) is torch.nn.Linear and type(module.weight) is not torch.nn.Parameter:
            module.weight = torch.nn.Parameter(module.weight.dequantize(), requires_grad=False)
    return model


def exactly_dequantized(model: torch.nn.Module) -> torch.nn.Module:
    """The same int4 model in float32, each quantized weight replaced by the exact matrix of its values, (q - z) s
    (exact in float32: a bf16 scale times an integer of at most 4 bits), its head the tied embedding: the int4
    values with no rounding but float32's after them."""
    for module in model.modules():
        if type(module) is torch.nn.Linear and type(module.weight) is not torch.nn.Parameter:
            held = module.weight.__dict__
            group = held["block_size"][1]
            values = held["qdata"].float() - held["zero_point"].float().repeat_interleave(group, 1)
            matrix = values * held["scale"].float().repeat_interleave(group, 1)
            module.weight = torch.nn.Parameter(matrix, requires_grad=False)
    return model.float()


def test_int4_weights_run_the_fast_path_on_their_int4_values(one_thread, decoded_backends, monkeypatch):
    """torchao's int4 weight-only model (`IntxWeightOnlyConfig`, whose linear multiplies its matrix dequantized to bf16)
    runs the fast path, its step and its decoded tokens on the C kernels' int4 products, which read the int4 values
    (not the plain loop, not a dequantized matrix). They multiply the exact weights (q - z) s in float32 where the
    plain loop multiplies them rounded to bf16 (2^-9 of each), so the two differ by that rounding: the fast path's
    log-probabilities are within twice the plain loop's own distance from exact float32 arithmetic on the same int4
    values (the two sides of that rounding, plus the int4 products' input rounded to 16 bits, some hundred times
    smaller). A batch beyond the kernels' rows runs the torch-ops steps on the dequantized matrices: to the bit what
    a bf16 model holding them computes; so does the C step on them where the int4 products are switched off
    (`GPN_INT4_KERNEL=0`). With its head quantized too (`quantize_`'s default takes every nn.Linear), the logits are
    int4 products as well, within bf16's rounding of its plain loop (a head apart from the embedding has no exact
    float32 twin: a GPN ties them). A left-padded batch keeps the same bound at its real positions."""
    require_int4_products()
    model = int4(perturbed_model(tiny_config(), seed=5), head=False)
    reference = with_dequantized_weights(int4(perturbed_model(tiny_config(), seed=5), head=False))
    exact = exactly_dequantized(int4(perturbed_model(tiny_config(), seed=5), head=False))
    assert model.model.fast_path_blocker() is None
    generator = torch.Generator().manual_seed(6)
    ids, given = torch.randint(1, 97, (2, 9), generator=generator), torch.randint(1, 97, (2, 3), generator=generator)
    with ran(FAST_PATH, C_STEP_KERNELS, INT4_STEPS, *decoded_backends, not_ran=(PLAIN_PATH,)):
        fast = given_tokens_loop(model, ids, given)
    exact.model.use_fast_path = False
    exact_log_probs = given_tokens_loop(exact, ids, given)
    model.model.use_fast_path = False
    with ran(PLAIN_PATH, not_ran=(FAST_PATH,)):
        plain = given_tokens_loop(model, ids, given)
    rounding = (plain - exact_log_probs).abs().max()
    assert 0 < (fast - plain).abs().max() <= 2 * rounding, ((fast - plain).abs().max(), rounding)

    # a left-padded batch in one forward: the padded row's real positions alike, within the same bound
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    real = mask.bool()
    with torch.no_grad():
        plain_masked = model(ids, attention_mask=mask).logits.log_softmax(-1)[real]
        exact_masked = exact(ids, attention_mask=mask).logits.log_softmax(-1)[real]
        model.model.use_fast_path = True
        with ran(FAST_PATH, INT4_STEPS, not_ran=(PLAIN_PATH,)):
            fast_masked = model(ids, attention_mask=mask).logits.log_softmax(-1)[real]
    masked_rounding = (plain_masked - exact_masked).abs().max()
    assert 0 < (fast_masked - plain_masked).abs().max() <= 2 * masked_rounding

    wide = torch.randint(1, 97, (20, 4), generator=torch.Generator().manual_seed(7))  # more rows than the kernels take
    with torch.no_grad(), ran(FAST_PATH, not_ran=(PLAIN_PATH, C_STEP_KERNELS)):
        wide_fast = model(wide).logits
    with torch.no_grad():
        assert torch.equal(wide_fast, reference(wide).logits)
    monkeypatch.setenv("GPN_INT4_KERNEL", "0")
    with ran(FAST_PATH, C_STEP_KERNELS, *decoded_backends, not_ran=(PLAIN_PATH, INT4_STEPS)):
        dequantized = given_tokens_loop(model, ids, given)
    assert torch.equal(dequantized, given_tokens_loop(reference, ids, given))
    monkeypatch.delenv("GPN_INT4_KERNEL")

    whole = int4(perturbed_model(tiny_config(), seed=5))
    with ran(FAST_PATH, C_STEP_KERNELS, INT4_STEPS, *decoded_backends, not_ran=(PLAIN_PATH,)):
        whole_fast = given_tokens_loop(whole, ids, given)
    whole.model.use_fast_path = False
    assert 0 < (whole_fast - given_tokens_loop(whole, ids, given)).abs().max() < 2e-2


def int4_cases() -> list[tuple]:
    """(dtype, rows, cols, granularity, mapping) of the int4 products' tests: rows not a multiple of 16 (a last tile
    partly past the end), one tile whole, groups of 8, 16 and 32 weights and of a whole row, zero points all 0 and
    not, float32 and bf16 modules."""
    from torchao.quantization import MappingType
    from torchao.quantization.granularity import PerAxis, PerGroup

    return [
        (torch.float32, 61, 64, PerGroup(8), MappingType.SYMMETRIC),
        (torch.float32, 61, 64, PerGroup(16), MappingType.ASYMMETRIC),
        (torch.float32, 16, 32, PerGroup(32), MappingType.ASYMMETRIC),
        (torch.float32, 200, 768, PerGroup(32), MappingType.ASYMMETRIC),
        (torch.float32, 33, 256, PerAxis(0), MappingType.SYMMETRIC),
        (torch.bfloat16, 97, 256, PerGroup(32), MappingType.SYMMETRIC),
        (torch.bfloat16, 48, 96, PerGroup(32), MappingType.ASYMMETRIC),
    ]


def int4_linear(dtype: torch.dtype, rows: int, cols: int, granularity, mapping) -> torch.nn.Linear:
    """An nn.Linear (cols -> rows, with a bias) in `dtype`, its weight quantized by torchao's int4 weight-only config."""
    linear = torch.nn.Linear(cols, rows).to(dtype)
    config = torchao.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=granularity, mapping_type=mapping)
    torchao.quantize_(linear, config)
    return linear


def test_int4_products_multiply_the_exact_int4_weights_within_the_inputs_rounding(one_thread):
    """The int4 products (`memory_kernels.int4_pack`'s layout, read by the kernel's `int4_rows`) of a torchao int4
    linear, for rows not a multiple of 16 (a last tile partly past the end), groups of 8, 16 and 32 weights and of a
    whole row, zero points all 0 and not, 1, 3 and 16 batch rows at 1 and 3 threads, a float32 and a bf16 module:
    each output is the product by the exact weights (q - z) s within the input's rounding to 16 bits (2^-15 of its
    row's largest |x| in each element, the bound of int8's products) and float32's (for bf16, of the input rounded to
    bf16, then the output's own rounding to bf16, as the module rounds). An input that is not finite is carried as
    torch's. Groups of other sizes and values of other bit widths keep the dequantized matrix, and say why."""
    import ctypes

    require_int4_products()
    from torchao.quantization.granularity import PerGroup

    from modeling_gpn import memory_kernels as mk

    generator = torch.Generator().manual_seed(71)
    for dtype, rows, cols, granularity, mapping in int4_cases():
        linear = int4_linear(dtype, rows, cols, granularity, mapping)
        held = linear.weight.__dict__
        group = held["block_size"][1]
        values = held["qdata"].double() - held["zero_point"].double().repeat_interleave(group, 1)
        exact_weight = values * held["scale"].double().repeat_interleave(group, 1)
        for threads, batch in ((1, 1), (1, 3), (3, 16), (3, 3), (1, 16)):  # (3 threads: a matrix split unevenly)
            x = torch.randn(batch, cols, generator=generator)
            mk.int4_dequantized.clear()
            torch.set_num_threads(threads)
            try:
                y = mk.module_rows(linear, x).double()
            finally:
                torch.set_num_threads(1)
            assert not mk.int4_dequantized, dict(mk.int4_dequantized)
            operand = mk.operand_of(linear)
            segment = mk._segment(operand, mk._input_slot(batch, cols), torch.zeros(batch, rows), 0)
            assert operand.kind == mk.KIND_I4 and mk._library.gpn_int4_products(ctypes.addressof(segment), batch)
            x_in = x.to(dtype).double()
            exact = x_in @ exact_weight.T + linear.bias.double()
            bound = 2**-15 * x_in.abs().amax(1, keepdim=True) * exact_weight.abs().sum(1) + 1e-5 * exact.abs() + 1e-6
            if dtype == torch.bfloat16:
                bound = bound + 2**-8 * exact.abs()
            assert ((y - exact).abs() <= bound).all(), (dtype, rows, cols, group, batch, (y - exact).abs().max())
        x[0, 5] = float("nan")  # (the batch's products then run in float32 from the exact input: its other rows too)
        carried = mk.module_rows(linear, x)
        assert carried[0].isnan().all() and ((carried[1:].double() - exact[1:]).abs() <= bound[1:]).all()
    for config, reason in (
        (torchao.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(4)), "not int4 values"),
        (torchao.IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerGroup(32)), "not int4 values"),
    ):
        linear = torch.nn.Linear(64, 40)
        torchao.quantize_(linear, config)
        mk.int4_dequantized.clear()
        x = torch.randn(1, 64, generator=generator)
        torch.testing.assert_close(mk.module_rows(linear, x), linear(x), rtol=1e-5, atol=1e-5)
        assert list(mk.int4_dequantized) and all(key.startswith(reason) for key in mk.int4_dequantized)


@pytest.fixture(params=[name for name in RUNNABLE if name != "portable"])
def int4_build(request, monkeypatch) -> str:
    """Each build of the kernels this machine runs that reads int4 weights as int4 (`memory_kernels.reads_int4`:
    VNNI's dot products, AVX2's byte multiply-adds; `require_int4_products` skips the others)."""
    build = build_in_place(request.param, monkeypatch)
    require_int4_products()
    return build


def int4_on_sixteen_bits(x: torch.Tensor, linear: torch.nn.Linear) -> torch.Tensor:
    """What the int4 products compute: each row of x (rounded to bf16 first on a bf16 module) as x_q 2^-sh
    (`on_sixteen_bits`' rounding), each group's exact integer sum of (q - z) x_q, the groups added in order as
    float32 multiply-adds of their float32 scales, times 2^-sh, plus the bias, then rounded to bf16 on a bf16 module.
    (A multiply-add here is the exact product, exact in float64, plus the sum rounded to float64 then to float32:
    twice, where the kernels' fused one rounds once; the two differ only where float64 lands on a float32 tie.)"""

    from modeling_gpn.recurrence_step import int4_weight_parts

    parts = int4_weight_parts(linear.weight)
    group, bf16 = parts.group, parts.dtype == torch.bfloat16
    q = parts.qdata.to(torch.int64)
    zero = (
        parts.zero_point.to(torch.int64)
        if parts.zero_point is not None
        else torch.zeros_like(parts.scale, dtype=torch.int64)
    )
    values = (q - zero.repeat_interleave(group, 1)).reshape(q.shape[0], -1, group)  # (rows, groups, group)
    scale = parts.scale.float().double()
    bias = linear.bias.float() if linear.bias is not None else None
    out = []
    for row in x.bfloat16().float() if bf16 else x:
        x_q, shift = on_sixteen_bits_row(row)
        x_q = x_q.reshape(-1, group)
        sums = (values * x_q).sum(-1).float().double()  # (rows, groups): exact integers, then float32 as cvtepi32_ps
        y = torch.zeros(q.shape[0], dtype=torch.float64)
        for g in range(sums.shape[1]):
            y = (scale[:, g] * sums[:, g] + y).float().double()
        y = y.float() * torch.tensor(2.0**-shift, dtype=torch.float32)
        if bias is not None:
            y = y + bias
        out.append(y.bfloat16().float() if bf16 else y)
    return torch.stack(out)


def test_int4_products_are_exact_group_sums_on_sixteen_bits_in_every_build(int4_build):
    """Every build that reads int4 weights as int4 computes the same outputs to the bit: `int4_on_sixteen_bits`, for
    rows not a multiple of 16 (a last tile partly past the end; one tile and two at a time), groups of 8, 16 and 32
    weights and of a whole row, zero points all 0 and not, float32 and bf16 modules with a bias, and 1-16 batch rows,
    and at the sums' extremes. So AVX2's byte multiply-adds sum what VNNI's dot products sum, in the same order after
    the sums."""

    from modeling_gpn import memory_kernels as mk

    generator = torch.Generator().manual_seed(72)
    for dtype, rows, cols, granularity, mapping in int4_cases():
        linear = int4_linear(dtype, rows, cols, granularity, mapping)
        for batch in (1, 3, 16):
            x = torch.randn(batch, cols, generator=generator) * 10.0 ** torch.empty(batch, cols).uniform_(
                -3, 3, generator=generator
            )
            mk.int4_dequantized.clear()
            got = mk.module_rows(linear, x)
            assert not mk.int4_dequantized, dict(mk.int4_dequantized)
            assert torch.equal(got, int4_on_sixteen_bits(x, linear)), (int4_build, dtype, rows, cols, batch)

    # the sums' extremes: every weight's value 7 (unsigned 15, the most) against an input at its largest in every
    # element, of either sign, over a whole row of 256 (AVX2 sums rounds of 8 weights in 16-bit lanes before it widens
    # them: 4 rounds reach 30,480 of int16's 32,767, a fifth would wrap)
    from torchao.quantization import MappingType
    from torchao.quantization.granularity import PerAxis

    linear = int4_linear(torch.float32, 16, 256, PerAxis(0), MappingType.SYMMETRIC)
    linear.weight.__dict__["qdata"].fill_(7)
    x = torch.tensor([[127 / 64], [-127 / 64], [3e-3]]).expand(3, 256).contiguous()  # (x_q = +-32,512: planes +-127)
    assert torch.equal(mk.module_rows(linear, x), int4_on_sixteen_bits(x, linear)), int4_build


def test_int4_weights_train_the_float_parameters_around_them_as_their_dequantized_matrices(one_thread):
    """Training the float parameters around frozen int4 weight-only weights (a bf16 model, `quantize_` freezes them)
    runs the fast path, forward and backward: its loss and every gradient are to the bit those of the bf16 model
    holding the dequantized matrices, frozen (whose own fast path is within bf16's rounding of the plain loop)."""
    model = int4(well_conditioned_model(tiny_config(), seed=9), head=False).train()
    reference = with_dequantized_weights(int4(well_conditioned_model(tiny_config(), seed=9), head=False)).train()
    ids = torch.randint(1, 97, (2, 12), generator=torch.Generator().manual_seed(10))
    with ran(FAST_PATH, not_ran=(PLAIN_PATH,)):
        loss = model(ids, labels=ids).loss
        loss.backward()
    expected = reference(ids, labels=ids).loss
    expected.backward()
    assert torch.equal(loss, expected)
    trained = [(name, p.grad, q.grad) for (name, p), q in zip(model.named_parameters(), reference.parameters())]
    assert sum(grad is not None for _, grad, _ in trained) == 15  # the vectors and the embedding
    for name, grad, expected_grad in trained:
        assert (grad is None) == (expected_grad is None), name
        assert grad is None or torch.equal(grad, expected_grad), name


def test_low_bit_weights_with_quantized_activations_keep_the_plain_path(one_thread):
    """torchao's int4 weights with int8 dynamic activations (`Int8DynamicActivationIntxWeightConfig`) quantize each
    linear's input too, which the dequantized matrix alone does not compute: the plain loop calls the modules."""
    from torchao.quantization.granularity import PerGroup

    config = torchao.Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(16))
    model = quantized(perturbed_model(tiny_config(), seed=8), config)
    blocker = model.model.fast_path_blocker()
    assert blocker is not None and "not a plain nn.Parameter" in blocker, blocker
    with torch.no_grad(), ran(PLAIN_PATH, not_ran=(FAST_PATH, C_STEP_KERNELS)):
        model(torch.tensor([[1, 2, 3]]))


@pytest.mark.parametrize("weights", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("rows", [1, 3])
def test_every_build_of_the_kernels_decodes_as_the_plain_loop(one_thread, products_build, weights, rows):
    """A prompt and its decoded tokens on each build's kernels (the one C call a token) = the plain loop of the
    same model: float32 to summation order, bf16 within its rounding, int8 within the 16-bit input's rounding."""
    model = perturbed_model(tiny_config(), seed=50)
    model = quantized(model) if weights == "int8" else model.to(getattr(torch, weights))
    ids = torch.randint(1, 97, (rows, 7), generator=torch.Generator().manual_seed(51))
    expected = (FAST_PATH, C_STEP_KERNELS, DECODE_CALLS, *((INT8_STEPS,) if weights == "int8" else ()))
    with ran(*expected, not_ran=(PLAIN_PATH,)):
        fast = decode_loop(model, ids, None)
    model.model.use_fast_path = False
    plain = decode_loop(model, ids, None)
    assert (log_probs(fast) - log_probs(plain)).abs().max() < (1e-4 if weights == "float32" else 2e-2)


def test_the_derived_weights_guard_sees_an_int8_weight_edited_in_place():
    """A torchao weight has no storage of its own (its data_ptr is 0): the guard keys it by the tensors it
    holds, so an in-place edit of its int8 data (or a requantization) starts a new derivation."""
    from modeling_gpn.derived_weights import parameters_key

    model = quantized(perturbed_model(tiny_config(), seed=9))
    before = parameters_key(model.model)
    assert parameters_key(model.model) == before
    model.model.fuse_gate.weight.qdata.add_(1)
    assert parameters_key(model.model) != before


def test_each_build_runs_the_products_it_is_built_for(products_build, request):
    """The default build takes the widest vectors this CPU has (AVX-512, else AVX2 and FMA, else plain C): an
    x86 CPU without AVX-512 must not fall back to the plain C loops; and each variant build is the one named."""
    build, flags = request.node.callspec.params["products_build"], cpu_flags()
    if build == "native":
        want = "avx512" if {"avx512f", "avx512bw"} <= flags else "avx2" if {"avx2", "fma"} <= flags else "portable"
        assert products_build.split("+")[0] == want, (products_build, sorted(flags & {"avx2", "fma", "avx512f"}))
        assert ("+vnni" in products_build) == ("avx512_vnni" in flags and want == "avx512")
    else:
        assert products_build == build


def test_the_few_row_products_equal_f_linear_and_refuse_what_they_cannot_take(products_build):
    """The logits kernel = F.linear(x.to(w.dtype), w) (odd sizes, 1-16 rows; bf16 in, bf16 out); more rows,
    a wrong shape or an int8 matrix are refused by name (the callers then run torch)."""
    require_c_kernels()
    from modeling_gpn import memory_kernels as mk

    generator = torch.Generator().manual_seed(10)
    for dtype in (torch.float32, torch.bfloat16):
        weight = torch.randn(101, 37, generator=generator).to(dtype)
        for rows in (1, 3, 16):
            x = torch.randn(rows, 37, generator=generator)
            got, want = mk.linear_rows(x, weight), torch.nn.functional.linear(x.to(dtype), weight)
            assert got.dtype == want.dtype
            torch.testing.assert_close(
                got.float(), want.float(), atol=1e-5 if dtype == torch.float32 else 1e-2, rtol=1e-5
            )
    with pytest.raises(mk.KernelRefusal, match="17 rows|rows, features"):
        mk.linear_rows(torch.randn(17, 37), weight)
    with pytest.raises(mk.KernelRefusal, match="shape"):
        mk.linear_rows(torch.randn(2, 36), weight)
    with pytest.raises(mk.KernelRefusal, match="int8"):
        mk.linear_rows(torch.randn(2, 37), torch.zeros(5, 37, dtype=torch.int8))
    model = perturbed_model(tiny_config(), seed=11)
    with pytest.raises(mk.KernelRefusal, match="17 rows"):
        mk.StepPlan(model.model, 17)
    plan = mk.StepPlan(model.model, 2)
    state = model.model.zero_state(2, torch.device("cpu"))
    from modeling_gpn.recurrence_step import StepState

    with pytest.raises(mk.KernelRefusal, match="memory has shape"):
        plan.step(StepState(state[0], state[1], None, state[2][:, :2]), torch.zeros(2, 48), None)


def test_rows_far_beyond_the_l3_are_prefetched_ahead(monkeypatch):
    """Against an L3 of 1 MB: weights that fit it get no flag (int8 four rows at a time), weights beyond it are
    read a row at a time (`STREAM_ROWS`), and weights more than `FAR_BEYOND_L3` times it also have their rows
    prefetched ahead (`FAR_ROWS`), which only pays where nearly everything comes from DRAM."""
    from types import SimpleNamespace

    from modeling_gpn import memory_kernels as mk

    monkeypatch.setattr(mk, "_last_level_cache_bytes", lambda: 1 << 20)
    monkeypatch.setenv("GPN_HUGE_PAGES", "0")  # (the pages are another test's)
    for megabytes, flags in ((0.5, 0), (1.5, mk.STREAM_ROWS), (3, mk.STREAM_ROWS | mk.FAR_ROWS)):
        segment = SimpleNamespace(flags=0)
        mk._mark_streamed([segment], [torch.zeros(int(megabytes * (1 << 18)))])
        assert segment.flags == flags, megabytes


def segment_phase(monkeypatch, op, x: torch.Tensor, streamed: bool, spare: int = 0):
    """`op` (a `memory_kernels.Operand`) times the rows of float32 `x` as one phase of a plan's products, its
    weights marked as streamed from DRAM (`STREAM_ROWS`, against an L3 of one byte) or as fitting the L3: a call
    runs the phase on two threads and returns its output; `.segment` and `.tasks` are the phase's. The output's
    buffer has `spare` columns of NaN after the product's (`.spare()`), which nothing may write."""
    import ctypes

    from modeling_gpn import memory_kernels as mk

    monkeypatch.setenv("GPN_HUGE_PAGES", "0")
    batch, cols = x.shape
    slot = mk._input_slot(batch, cols)
    slot["x"][:, :cols] = x  # (and, as the kernels' `put` writes them, its bf16 rounding and bits for bf16 products)
    slot["xr"][:, :cols] = x.bfloat16().float()
    slot["xb"][:, :cols] = x.bfloat16().view(torch.int16)
    out = torch.full((batch, op.weight.shape[0] + spare), float("nan"))
    segment = mk._segment(op, slot, out, 0)
    monkeypatch.setattr(mk, "_last_level_cache_bytes", (lambda: 1) if streamed else (lambda: 1 << 40))
    mk._mark_streamed([segment], [op.weight])
    tasks = torch.tensor(mk._tasks([segment], 0, 1), dtype=torch.int64)

    def run() -> torch.Tensor:
        mk._library.gpn_linear(ctypes.addressof(segment), tasks.data_ptr(), len(tasks), batch, 2)
        return out[:, : op.weight.shape[0]]

    run.segment, run.tasks, run.slot = segment, tasks, slot  # (the slot: what the segment's pointers read)
    run.spare = lambda: out[:, op.weight.shape[0] :]
    run.bf16_bits = lambda: out.view(torch.int16)[:, : op.weight.shape[0]]  # (`STORE_BF16`'s output)
    return run


def segment_product(monkeypatch, op, x: torch.Tensor, streamed: bool) -> tuple[torch.Tensor, int]:
    """`segment_phase`'s product, run once, and whether the rows were read two at a time."""
    import ctypes

    from modeling_gpn import memory_kernels as mk

    run = segment_phase(monkeypatch, op, x, streamed)
    return run(), mk._library.gpn_paired_rows(ctypes.addressof(run.segment), x.shape[0])


def float_operand_case(kind: int, rows: int, cols: int, batch: int, seed: int):
    """(operand, input, F.linear's product) of a random float32 or bf16 (rows, cols) weight (seeded `seed`) and a
    (batch, cols) input (seeded `seed + 1`; for bf16 weights its bf16 rounding, the output rounded as torch's bf16
    linear rounds it)."""
    from modeling_gpn import memory_kernels as mk

    weight = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    x = torch.randn(batch, cols, generator=torch.Generator().manual_seed(seed + 1))
    if kind == mk.KIND_BF16:
        weight, x = weight.bfloat16(), x.bfloat16().float()
        return mk.Operand(kind, weight, None, None, True), x, torch.nn.functional.linear(x.bfloat16(), weight).float()
    return mk.Operand(kind, weight, None, None, False), x, torch.nn.functional.linear(x, weight)


def test_long_float_rows_streamed_from_dram_are_read_in_pairs(monkeypatch, products_build):
    """Float32 rows of 4,096 weights and more, streamed from DRAM at one batch row, are read two at a time (one
    read of the input for both; in the AVX2 build, the rows its quads leave: `far_quads`): each row's sum is the one
    it has read alone, to the bit, and the product is F.linear's. Shorter rows, rows within the L3 and more batch
    rows are read as before, a row at a time or four. (The plain C build has no pairs.)"""
    from modeling_gpn import memory_kernels as mk

    def product(rows: int, cols: int, streamed: bool, batch: int = 1):
        op, x, want = float_operand_case(mk.KIND_F32, rows, cols, batch, seed=46)
        out, paired = segment_product(monkeypatch, op, x, streamed)
        return paired, out, want

    # (11 rows: a pair's tail row, and in the AVX2 build a pair after two quads; 4,100 weights: a masked tail of
    # each row)
    for rows, cols, streamed, batch, pairs in ((11, 4100, True, 1, 1), (11, 4000, True, 1, 0), (11, 4100, False, 1, 0)):
        paired, out, want = product(rows, cols, streamed, batch)
        assert paired == (pairs if products_build != "portable" else 0), (rows, cols, streamed)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-4)
    assert product(11, 4100, True, batch=2)[0] == 0
    assert torch.equal(product(11, 4100, True)[1], product(11, 4100, False)[1])


def test_rows_streamed_from_dram_are_read_four_at_a_time_in_the_avx2_build(monkeypatch, products_build):
    """In the AVX2 build, float32 and bf16 rows streamed from DRAM at one batch row are read four at a time, four
    streams in flight (`far_quads`): each row's sum is the one it has read alone (in the L3, a row at a time), to
    the bit, whatever the rows left over after the quads (a pair, one row) and the row's length (a tail of fewer
    than 32 or 8 weights), and the product is F.linear's. Rows in the L3, int8 rows, more batch rows and the
    other builds are read as before."""
    import ctypes

    from modeling_gpn import memory_kernels as mk

    def product(kind: int, rows: int, cols: int, streamed: bool, batch: int = 1):
        op, x, want = float_operand_case(kind, rows, cols, batch, seed=54)
        run = segment_phase(monkeypatch, op, x, streamed)
        return mk._library.gpn_far_quads(ctypes.addressof(run.segment), batch), run().clone(), want

    quads_here = products_build == "avx2"
    for kind in (mk.KIND_F32, mk.KIND_BF16):
        # (rows: quads alone, a pair left, one left, both; 300 rows: tasks cut inside the phase)
        for rows, cols in ((8, 768), (10, 1000), (5, 100), (7, 45), (300, 256)):
            quads, out, want = product(kind, rows, cols, streamed=True)
            assert quads == quads_here, (kind, rows, cols)
            torch.testing.assert_close(out, want, rtol=1e-2 if kind == mk.KIND_BF16 else 1e-5, atol=1e-2)
            quads_in_l3, out_in_l3, _ = product(kind, rows, cols, streamed=False)
            assert quads_in_l3 == 0
            assert torch.equal(out, out_in_l3), (kind, rows, cols)
        assert product(kind, 8, 768, streamed=True, batch=2)[0] == 0
    int8 = mk.Operand(mk.KIND_I8, torch.randint(-127, 128, (8, 768), dtype=torch.int8), torch.rand(8), None, False)
    run = segment_phase(monkeypatch, int8, torch.randn(1, 768), streamed=True)
    assert mk._library.gpn_far_quads(ctypes.addressof(run.segment), 1) == 0


def test_short_rows_in_the_l3_hold_their_input_in_registers(monkeypatch, products_build):
    """bf16 and int8 rows of 256, 512 or 768 weights at one batch row, in the L3, hold the input in registers
    (bf16 where the CPU has AVX512-BF16, int8 where it has VNNI): each row's sum is the one it has read a row at a
    time beside its input, to the bit, and the product is F.linear's. Other lengths, rows far beyond the L3 and
    more batch rows are read as before. (Read as before, int8 rows summed in float32, an AVX-512 CPU's without
    VNNI, sum in another order four rows at a time than one: there the two agree within float32's bound.)"""
    import ctypes

    from modeling_gpn import memory_kernels as mk

    def product(kind: int, rows: int, cols: int, streamed: bool, batch: int = 1):
        generator = torch.Generator().manual_seed(50)
        x = torch.randn(batch, cols, generator=torch.Generator().manual_seed(51))
        if kind == mk.KIND_BF16:
            weight, scale = torch.randn(rows, cols, generator=generator).bfloat16(), None
            x = x.bfloat16().float()
            want = torch.nn.functional.linear(x.bfloat16(), weight).float()
        else:
            weight = torch.randint(-127, 128, (rows, cols), dtype=torch.int8, generator=generator)
            scale = torch.rand(rows, generator=generator)
            want = torch.nn.functional.linear(x, weight.float() * scale[:, None])
        op = mk.Operand(kind, weight, scale, None, kind == mk.KIND_BF16)
        run = segment_phase(monkeypatch, op, x, streamed)
        held = mk._library.gpn_held_input(ctypes.addressof(run.segment), batch)
        scaled = weight.float() if scale is None else weight.float() * scale[:, None]
        return held, run().clone(), want, torch.nn.functional.linear(x.abs(), scaled.abs())  # (the terms' magnitudes)

    # int8 products summed in float32 (not exact integer sums: an AVX-512 build without VNNI, the plain C build)
    float_int8 = "+vnni" not in products_build and products_build != "avx2"
    for kind, held_here in ((mk.KIND_BF16, "+bf16" in products_build), (mk.KIND_I8, "+vnni" in products_build)):
        # (300 rows: tasks cut inside the phase; streamed: FAR_ROWS, read a row at a time)
        for cols in (256, 512, 768):
            held, out, want, magnitude = product(kind, 300, cols, streamed=False)
            assert held == held_here, (kind, cols)
            torch.testing.assert_close(out, want, rtol=1e-2, atol=1e-2)
            far, out_far, _, _ = product(kind, 300, cols, streamed=True)
            assert far == 0
            if kind == mk.KIND_I8 and float_int8:  # (two orders of a float32 sum of `cols` terms: each within
                # cols * eps of the sum of the terms' magnitudes)
                bound = 2 * cols * torch.finfo(torch.float32).eps * magnitude
                assert ((out - out_far).abs() <= bound).all(), (kind, cols, (out - out_far).abs().max())
            else:
                assert torch.equal(out, out_far), (kind, cols)
        assert product(kind, 300, 800, streamed=False)[0] == 0
        assert product(kind, 300, 768, streamed=False, batch=2)[0] == 0


def test_int8_rows_in_the_l3_read_from_tiles_of_16_rows(monkeypatch, products_build):
    """int8 products of a plan at one batch row whose weights fit the L3 read a copy of the weights in tiles of 16
    rows (`int8_tiles`, where the CPU has VNNI): every output is the one the rows read one by one give, to the bit,
    whatever the rows' length (padded to 64), the rows' count (a last tile partly past the end), the tasks' cuts
    (multiples of 16 rows), the scale, bias and rounding the segment asks for and the output's dtype; a task that
    begins inside a tile reads the rows instead, to the same bits; and a plan of int8 weights gets its tiles."""
    import ctypes

    from modeling_gpn import memory_kernels as mk

    tiled_here = "+vnni" in products_build
    generator = torch.Generator().manual_seed(52)
    for rows, cols in ((700, 768), (61, 70), (300, 256), (64, 2048)):
        weight = torch.randint(-128, 128, (rows, cols), dtype=torch.int8, generator=generator)
        width = -(-cols // 64) * 64  # (the layout, as torch writes it: padding 0, flipped)
        padded = torch.full((-(-rows // 16) * 16, width), 0x80, dtype=torch.uint8)
        padded[:rows, :cols] = weight.view(torch.uint8) ^ 0x80
        assert torch.equal(mk.int8_tiles(weight), padded.view(-1, 16, width // 4, 4).transpose(1, 2)), (rows, cols)
        scale, bias = torch.rand(rows, generator=generator), torch.randn(rows, generator=generator)
        x = torch.randn(1, cols, generator=generator)
        for bias_given, bf16, after in ((None, False, False), (bias, True, False), (bias, True, True)):
            op = mk.Operand(mk.KIND_I8, weight, scale, bias_given, bf16, bias_after_round=after)
            run = segment_phase(monkeypatch, op, x, streamed=False, spare=16)
            assert mk._library.gpn_tiled_input(ctypes.addressof(run.segment), 1) == 0
            rows_read = run().clone()
            kept = mk._tile_int8([run.segment], [weight], 1)
            assert len(kept) == tiled_here and bool(run.segment.tiles) == tiled_here
            assert mk._library.gpn_tiled_input(ctypes.addressof(run.segment), 1) == tiled_here
            assert mk._library.gpn_tiled_input(ctypes.addressof(run.segment), 2) == 0
            assert all(int(start) % 16 == 0 for start in run.tasks.reshape(-1, 3)[:, 1])
            assert torch.equal(run().clone(), rows_read), (rows, cols, bias_given is not None, bf16, after)
            assert run.spare().isnan().all(), (rows, cols)  # (a last tile's rows past the end not stored)
            run.segment.flags |= mk.STORE_BF16  # (bf16 bits into the first half of the same buffer)
            run()
            tiled_bits = run.bf16_bits().clone()
            run.segment.tiles = None
            run()
            assert torch.equal(tiled_bits, run.bf16_bits()), (rows, cols, "bf16 output")
    # a task from inside a tile: those rows are read one by one, the same outputs
    weight = torch.randint(-128, 128, (40, 256), dtype=torch.int8, generator=generator)
    x = torch.randn(1, 256, generator=generator)
    run = segment_phase(monkeypatch, mk.Operand(mk.KIND_I8, weight, torch.rand(40), None, False), x, streamed=False)
    rows_read = run().clone()
    kept = mk._tile_int8([run.segment], [weight], 1)
    out = run().fill_(float("nan"))  # (the output, to be written by these tasks alone)
    tasks = torch.tensor([[0, 0, 8], [0, 8, 40]], dtype=torch.int64)
    mk._library.gpn_linear(ctypes.addressof(run.segment), tasks.data_ptr(), 2, 1, 2)
    assert torch.equal(out, rows_read)
    # weights beyond the L3 (STREAM_ROWS), more batch rows: no tiles
    run = segment_phase(monkeypatch, mk.Operand(mk.KIND_I8, weight, torch.rand(40), None, False), x, streamed=True)
    assert mk._tile_int8([run.segment], [weight], 1) == [] and not run.segment.tiles
    run = segment_phase(monkeypatch, mk.Operand(mk.KIND_I8, weight, torch.rand(40), None, False), x, streamed=False)
    assert mk._tile_int8([run.segment], [weight], 2) == [] and not run.segment.tiles
    del kept


def test_weights_in_the_l3_are_read_by_the_same_thread_at_every_step(monkeypatch):
    """A product whose weights fit the L3 gives each of two threads its own half of the phase's tasks, at every
    call, so that what a core read stays in the caches nearest it. Weights streamed from DRAM go to whichever
    thread is free. Either way every task runs once, and the product is F.linear's."""
    require_c_kernels()
    from modeling_gpn import memory_kernels as mk

    weight = torch.randn(2048, 256, generator=torch.Generator().manual_seed(48))  # (2 MB: 8 tasks)
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(49))
    for streamed in (False, True):
        run = segment_phase(monkeypatch, mk.Operand(mk.KIND_F32, weight, None, None, False), x, streamed)
        assert len(run.tasks) == 8
        log = torch.full((len(run.tasks),), -1, dtype=torch.int32)
        mk._library.gpn_log_tasks(log.data_ptr())
        try:
            threads = []
            for _ in range(20):
                log.fill_(-1)
                torch.testing.assert_close(run(), torch.nn.functional.linear(x, weight), rtol=1e-5, atol=1e-4)
                threads.append(log.tolist())
        finally:
            mk._library.gpn_log_tasks(None)
        assert all(thread in (0, 1) for call in threads for thread in call), threads  # (each task ran)
        if not streamed:
            assert all(call == [0] * 4 + [1] * 4 for call in threads), threads


def ordered(x: torch.Tensor) -> torch.Tensor:
    """float32 bits as integers in the floats' order (-0 and 0 alike), so that a difference counts ulps."""
    bits = x.view(torch.int32).long()
    return torch.where(bits < 0, -(bits & 0x7FFFFFFF), bits)


def test_the_steps_gates_are_torchs_to_a_few_ulp_over_every_float(products_build):
    """The C step's sigmoid and silu (on its own vectorised exponential, `gate_exp`) are torch's within 4 ulp
    at every 4099th float32 of either sign (tiny, huge, subnormal and the ends of exp's range, where a gate
    rounds into the subnormals), NaN where torch's is, equal at the infinities; and the same bits on every
    build of the kernels."""
    from modeling_gpn import memory_kernels as mk

    positive = torch.arange(0, 0x7F800000, 4099, dtype=torch.int64).to(torch.int32).view(torch.float32)
    near_the_ends = torch.linspace(80.0, 110.0, 20001)
    specials = torch.tensor([float("nan"), float("inf"), 0.0, 88.72283, 88.7229, 103.97, 104.0, 104.1])
    x = torch.cat([positive, near_the_ends, specials])
    x = torch.cat([x, -x])
    sigmoid, silu = mk.gates(x)
    for ours, torchs in ((sigmoid, torch.sigmoid(x)), (silu, torch.nn.functional.silu(x))):
        assert torch.equal(ours.isnan(), torchs.isnan())
        real = ~torchs.isnan()
        ulps = (ordered(ours[real]) - ordered(torchs[real])).abs()
        assert int(ulps.max()) <= 4, float(x[real][ulps.argmax()])
    assert sigmoid[x == float("inf")].item() == 1.0 and sigmoid[x == -float("inf")].item() == 0.0
    assert silu[x == float("inf")].item() == float("inf")
    same_sigmoid, same_silu = mk.gates(x, mk.variant(()))  # (the native build's)
    torch.testing.assert_close(sigmoid, same_sigmoid, rtol=0, atol=0, equal_nan=True)  # (a NaN's sign may differ)
    torch.testing.assert_close(silu, same_silu, rtol=0, atol=0, equal_nan=True)


def test_the_read_probe_reads_every_byte(products_build):
    """The bandwidth probe behind `gpn bench`'s limit reads the whole buffer (its sum is the buffer's)."""
    from modeling_gpn import memory_kernels as mk

    for size in (1000, 1003, 64):
        buffer = torch.arange(size, dtype=torch.float32) % 7
        assert mk.read_probe(buffer) == pytest.approx(float(buffer.sum()), rel=1e-6), size


def test_gpn_generate_runs_an_int8_model_on_the_fast_path(tmp_path, capsys, one_thread):
    """`gpn generate --dtype int8` quantizes the loaded model (torchao int8 weight-only) and generates with it
    on the fast path's int8 kernels (and `--dtype float32` does not); `--dtype int4` (torchao's int4 weight-only)
    on the fast path's C kernels too, on the matrices it dequantizes to."""
    require_c_kernels()
    from gpn_cli import main
    from modeling_gpn.data import train_bpe_tokenizer

    tokenizer = train_bpe_tokenizer(["the cat sat on the mat. " * 20, "to be or not to be " * 20], 300)
    tokenizer.save_pretrained(tmp_path)
    perturbed_model(tiny_config(vocab_size=len(tokenizer)), seed=12).save_pretrained(tmp_path)
    arguments = ["generate", str(tmp_path), "the cat", "--max-new-tokens", "4", "--device", "cpu", "--dtype"]
    with ran(FAST_PATH, C_STEP_KERNELS, INT8_STEPS, not_ran=(PLAIN_PATH,)):
        assert main([*arguments, "int8"]) == 0
    with ran(FAST_PATH, C_STEP_KERNELS, not_ran=(PLAIN_PATH, INT8_STEPS)):
        assert main([*arguments, "float32"]) == 0
    with ran(FAST_PATH, C_STEP_KERNELS, DECODE_CALLS, not_ran=(PLAIN_PATH, INT8_STEPS)):
        assert main([*arguments, "int4"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("the cat") and printed[2].startswith("the cat") and printed[4].startswith("the cat")


def torchao_config(kind: str):
    """transformers' `TorchAoConfig` quantizing to `kind` ("int8": `Int8WeightOnlyConfig`; "int4":
    `IntxWeightOnlyConfig` of int4 values in groups of 16)."""
    from torchao.quantization.granularity import PerGroup
    from transformers import TorchAoConfig

    if kind == "int8":
        return TorchAoConfig(torchao.Int8WeightOnlyConfig())
    return TorchAoConfig(torchao.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(16)))


TORCHAO_CONFIGS = {  # kind -> (the weights' class, what observes their steps besides the C step kernels)
    "int8": ("Int8Tensor", (INT8_STEPS,)),
    "int4": ("IntxUnpackedToInt8Tensor", ()),
}


@pytest.mark.parametrize("kind", TORCHAO_CONFIGS)
def test_a_model_quantized_by_torchao_config_runs_the_fast_path_saves_and_reloads(tmp_path, one_thread, kind):
    """transformers' way to quantize, and the way to save a quantized model (docs/inference-speed.md):
    `from_pretrained(quantization_config=TorchAoConfig(...))` gives int8 weight-only weights that run the fast
    path's int8 kernels (= the plain loop within the 16-bit input's rounding), or int4 weight-only ones
    (`IntxWeightOnlyConfig`) that run its C kernels' int4 products where the CPU has VNNI, else the C kernels on their
    dequantized matrices (= the plain loop within bf16's rounding), the head left the bf16 embedding; `save_pretrained` + `from_pretrained` give the same quantized
    model back, to the bit."""
    require_c_kernels()
    from transformers import AutoModelForCausalLM

    weights, steps = TORCHAO_CONFIGS[kind]
    from modeling_gpn import memory_kernels as mk

    if kind == "int4" and "vnni" in mk.products_isa():  # (elsewhere the dequantized matrices: no INT4_STEPS)
        steps = (INT4_STEPS,)
    perturbed_model(tiny_config(), seed=60).save_pretrained(tmp_path / "float")
    model = AutoModelForCausalLM.from_pretrained(
        tmp_path / "float", dtype=torch.bfloat16, quantization_config=torchao_config(kind)
    )
    assert type(model.model.fuse_gate.weight).__name__ == weights
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = torch.randint(1, 97, (2, 7), generator=torch.Generator().manual_seed(61))
    with torch.no_grad(), ran(FAST_PATH, C_STEP_KERNELS, *steps, not_ran=(PLAIN_PATH,)):
        fast = model(ids).logits
    model.model.use_fast_path = False
    with torch.no_grad():
        plain = model(ids).logits
    assert (log_probs(fast) - log_probs(plain)).abs().max() < 2e-2

    model.save_pretrained(tmp_path / kind)  # (safetensors: transformers 5 writes nothing else)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / kind)
    assert type(reloaded.model.fuse_gate.weight).__name__ == weights and reloaded.dtype == torch.bfloat16
    with torch.no_grad(), ran(FAST_PATH, C_STEP_KERNELS, *steps, not_ran=(PLAIN_PATH,)):
        torch.testing.assert_close(reloaded(ids).logits, fast, rtol=0, atol=0)


def test_a_model_quantized_after_loading_is_refused_by_save_pretrained_before_anything_is_written(tmp_path):
    """transformers saves torchao's weights only through the quantizer `TorchAoConfig` attaches at loading (above). A
    model given to `quantize_` after loading failed partway through `save_pretrained` with "Attempted to access the
    data pointer on an invalid python storage", leaving a folder of config and code without weights; it is refused
    by name before anything is written."""
    model = perturbed_model(tiny_config(), seed=62)
    torchao.quantize_(model, torchao.Int8WeightOnlyConfig(), filter_fn=lambda module, name: name == "model.decode_proj")
    with pytest.raises(
        ValueError, match=r"^model\.decode_proj\.weight is a torchao Int8Tensor quantized after loading"
    ):
        model.save_pretrained(tmp_path / "int8")
    assert not (tmp_path / "int8").exists()


@pytest.mark.parametrize(("kind", "other"), [("int8", "int4"), ("int4", "int8")])
def test_gpn_generate_runs_a_folder_saved_quantized_as_saved_and_refuses_another_quantization(
    tmp_path, capsys, one_thread, kind, other
):
    """`gpn generate FOLDER --dtype KIND` of a folder saved quantized to KIND (`TorchAoConfig`) runs it as saved on
    the fast path (int8: torchao cannot quantize its weights again, it failed with its dispatch's
    NotImplementedError), and another `--dtype` quantization of it is refused in one line (int4 of an int8 folder
    ran the int8 weights in silence; int8 of an int4 folder failed in torchao's dispatch)."""
    require_c_kernels()
    from transformers import AutoModelForCausalLM

    from gpn_cli import main
    from modeling_gpn.data import train_bpe_tokenizer

    tokenizer = train_bpe_tokenizer(["the cat sat on the mat. " * 20, "to be or not to be " * 20], 300)
    perturbed_model(tiny_config(vocab_size=len(tokenizer)), seed=13).save_pretrained(tmp_path / "float")
    AutoModelForCausalLM.from_pretrained(
        tmp_path / "float", dtype=torch.bfloat16, quantization_config=torchao_config(kind)
    ).save_pretrained(tmp_path / kind)
    tokenizer.save_pretrained(tmp_path / kind)
    arguments = ["generate", str(tmp_path / kind), "the cat", "--max-new-tokens", "3", "--device", "cpu", "--dtype"]
    with ran(FAST_PATH, C_STEP_KERNELS, *TORCHAO_CONFIGS[kind][1], not_ran=(PLAIN_PATH,)):
        assert main([*arguments, kind]) == 0
    assert capsys.readouterr().out.startswith("the cat")
    assert main([*arguments, other]) == 2
    error = capsys.readouterr().err
    assert f"is saved quantized already ({kind} weights): --dtype {other} quantizes a float model" in error, error


# ---- int8 products on the integer dot products (VNNI) ----


def int8_linear(rows: int, cols: int, dtype: torch.dtype, seed: int) -> torch.nn.Linear:
    linear = torch.nn.Linear(cols, rows, bias=False).to(dtype)
    with torch.no_grad():
        linear.weight.normal_(generator=torch.Generator().manual_seed(seed))
    torchao.quantize_(linear, torchao.Int8WeightOnlyConfig())
    return linear


def on_sixteen_bits_row(row: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(x_q, sh): a float32 row as x_q 2^-sh, x_q the integers nearest row 2^sh (ties to even), sh chosen for the row's
    largest |x| times 2^sh in (16256, 32512], as the kernels' `quantize_input` rounds an input row (sh = 0 for zeros)."""
    import math

    top, shift = row.abs().max().item(), 0
    if top > 0:
        shift = 15 - math.frexp(top)[1]
        if math.ldexp(top, shift) > 32512:
            shift -= 1
    return torch.round(row.double() * 2.0**shift).to(torch.int64), shift


def on_sixteen_bits(x: torch.Tensor, linear: torch.nn.Linear) -> torch.Tensor:
    """What the kernels compute: each row of x (rounded to bf16 first on a bf16 module) written as x_q 2^-sh with
    x_q the integers nearest x 2^sh (sh: the row's largest |x| times 2^sh in (16256, 32512]), the exact integer
    sums <w, x_q> times 2^-sh, rounded once to float32, times the row's scale (then rounded to bf16 on a bf16
    module)."""

    from modeling_gpn.recurrence_step import int8_weight_parts

    parts = int8_weight_parts(linear.weight)
    weights, scale, bf16 = parts.qdata.to(torch.int64), parts.scale.float().reshape(-1), parts.dtype == torch.bfloat16
    rows = []
    for row in x.bfloat16().float() if bf16 else x:
        x_q, shift = on_sixteen_bits_row(row)
        sums = weights @ x_q
        y = (sums.double() * 2.0**-shift).float() * scale
        rows.append(y.bfloat16().float() if bf16 else y)
    return torch.stack(rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_int8_products_are_exact_sums_of_the_input_on_sixteen_bits(dtype, exact_int8_build):
    """With VNNI an int8 product rounds each input row to 16 bits and sums exactly: = `on_sixteen_bits` to the
    bit, for 1-16 rows, widths that are not multiples of the 64-byte step, inputs spanning twelve decades, and
    rows at the edges of the rounding: zero, subnormal, near the float32 maximum, and a largest |x| just below a
    power of two (where x 2^sh would pass 32,512 and a byte would overflow without the smaller shift)."""
    from modeling_gpn import memory_kernels as mk

    generator = torch.Generator().manual_seed(40)
    for rows, cols in ((7, 200), (33, 1000), (8, 3), (64, 64)):
        linear = int8_linear(rows, cols, dtype, seed=41 + cols)
        for batch in (1, 2, 3, 5, 16):
            x = torch.randn(batch, cols, generator=generator) * 10.0 ** torch.empty(batch, cols).uniform_(
                -6, 6, generator=generator
            )
            got = mk.module_rows(linear, x)
            assert torch.equal(got, on_sixteen_bits(x, linear)), (rows, cols, batch)
        edges = torch.randn(5, cols, generator=generator)
        edges[0] = 0.0
        edges[1] *= 1e-40  # subnormal
        edges[2] = edges[2].sign() * 3e38 * torch.rand(cols, generator=generator)
        edges[3] = edges[3].clamp(-0.5, 0.5)
        edges[3, 0] = 1 - 2.0**-8  # just below 2^0 (in bf16 too)
        edges[4, -1] = -(2.0**7) * (1 - 2.0**-8)
        assert torch.equal(mk.module_rows(linear, edges), on_sixteen_bits(edges, linear)), (rows, cols)


def test_an_int8_input_that_is_not_finite_takes_the_float_products(exact_int8_build):
    """An input row holding a NaN or an infinity is not rounded to 16 bits (its x 2^sh has no integer): the
    product takes the float path, whose NaNs and infinities are where torch's float product puts them."""
    from modeling_gpn import memory_kernels as mk

    linear = int8_linear(9, 200, torch.float32, seed=42)
    dequantized = linear.weight.dequantize().float()
    x = torch.randn(3, 200, generator=torch.Generator().manual_seed(43))
    x[0, 5], x[1, 7] = float("nan"), float("inf")
    got, want = mk.module_rows(linear, x), torch.nn.functional.linear(x, dequantized)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
    assert got[0].isnan().all() and got[1].isinf().any()
    torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-4)


def test_int8_sums_stay_exact_over_rows_longer_than_an_accumulator_holds(monkeypatch, exact_int8_build):
    """The integer sums of a long int8 row outgrow a 32-bit lane (AVX2 empties its accumulators into 64 bits every
    4,096 weights): rows of 9,000 weights at the largest products (weights of -128 and 127 against a constant input
    whose x_q is 32,512) and random ones are still `on_sixteen_bits` to the bit, four rows at a time against 1 to 3
    batch rows and streamed a row at a time."""
    from modeling_gpn import memory_kernels as mk
    from modeling_gpn.recurrence_step import int8_weight_parts

    linear = int8_linear(6, 9000, torch.float32, seed=48)
    qdata = int8_weight_parts(linear.weight).qdata
    qdata[0], qdata[1], qdata[2, ::2], qdata[2, 1::2] = -128, 127, -128, 127
    x = torch.full((3, 9000), 0.9921875)  # (largest |x| 2^15 = 32,512: the largest x_q)
    x[1] *= -1
    x[2].normal_(generator=torch.Generator().manual_seed(49))
    for batch in (1, 2, 3):
        assert torch.equal(mk.module_rows(linear, x[:batch]), on_sixteen_bits(x[:batch], linear)), batch
    parts = int8_weight_parts(linear.weight)
    op = mk.Operand(mk.KIND_I8, parts.qdata, parts.scale.float().reshape(-1).contiguous(), None, False)
    for row in range(3):
        streamed, _ = segment_product(monkeypatch, op, x[row : row + 1], streamed=True)
        assert torch.equal(streamed, on_sixteen_bits(x[row : row + 1], linear)), row


def test_an_int8_model_tiles_its_weights_once_its_steps_pay_for_them(monkeypatch):
    """An int8 model at one batch row reads its products' weights one row at a time for a plan's first steps, and
    from tiles of 16 rows (every int8 product: the step's and the decode call's) once the plan has run
    `TILE_AFTER_STEPS` steps or is about to, with the same logits, to the bit, as a plan that never tiles; a
    prompt shorter than that, forwarded once, builds no tiles (they would cost more than they save)."""
    import ctypes

    require_int8_tiles()
    from modeling_gpn import memory_kernels

    model = quantized(perturbed_model(tiny_config(), seed=53))
    ids = torch.randint(1, 97, (1, 6), generator=torch.Generator().manual_seed(54))
    tiled_at, tile = [], memory_kernels._tile_int8

    def seen(segments, weights, rows):
        kept = tile(segments, weights, rows)
        int8 = [s for s in segments if s.kind == memory_kernels.KIND_I8]
        assert int8 and all(memory_kernels._library.gpn_tiled_input(ctypes.addressof(s), 1) for s in int8)
        tiled_at.append(memory_kernels.calls["step"])
        return kept

    monkeypatch.setattr(memory_kernels, "_last_level_cache_bytes", lambda: 1 << 30)
    monkeypatch.setattr(memory_kernels, "_tile_int8", seen)
    monkeypatch.setattr(memory_kernels, "TILE_AFTER_STEPS", 8)
    with torch.no_grad():
        model(ids)
    assert tiled_at == []  # (6 steps)
    with ran(DECODE_CALLS, INT8_STEPS):
        first = memory_kernels.calls["step"]
        tiled = decode_loop(model, ids, None, steps=4)  # (the prompt's 6 steps, then 4 decoded tokens)
    assert tiled_at == [first + 7, first + 7]  # (before the 8th step: the step plan's products, the decode call's)
    longer = torch.randint(1, 97, (1, 9), generator=torch.Generator().manual_seed(55))
    with ran(DECODE_CALLS, INT8_STEPS):
        first = memory_kernels.calls["step"]
        tiled_longer = decode_loop(model, longer, None, steps=2)
    assert tiled_at[2:] == [first + 9, first + 9]  # (at the prompt's 9 steps; the decode call's when it is built)
    monkeypatch.setattr(memory_kernels, "TILE_AFTER_STEPS", 10**9)
    with ran(DECODE_CALLS, INT8_STEPS):
        rows_read = decode_loop(model, ids, None, steps=4)
        rows_read_longer = decode_loop(model, longer, None, steps=2)
    assert len(tiled_at) == 4 and torch.equal(tiled, rows_read) and torch.equal(tiled_longer, rows_read_longer)


def test_int8_weights_streamed_a_row_at_a_time_give_the_same_bits(one_thread, monkeypatch):
    """Weights beyond the L3 take their int8 products a row at a time (`STREAM_ROWS`), those within it four rows
    at a time: on the exact integer sums both give the same logits, to the bit (the float products sum in
    another order each way; a float32 model, whose outputs are not rounded to bf16 after the products)."""
    require_exact_int8()
    from modeling_gpn import memory_kernels

    model = perturbed_model(tiny_config(), seed=44)
    torchao.quantize_(model, torchao.Int8WeightOnlyConfig())
    ids = torch.randint(1, 97, (1, 6), generator=torch.Generator().manual_seed(45))
    monkeypatch.setattr(memory_kernels, "_last_level_cache_bytes", lambda: 1 << 30)
    with ran(DECODE_CALLS, INT8_STEPS):
        fitting = decode_loop(model, ids, None)
    monkeypatch.setattr(memory_kernels, "_last_level_cache_bytes", lambda: 1)
    with ran(DECODE_CALLS, INT8_STEPS):
        streamed = decode_loop(model, ids, None)
    assert torch.equal(streamed, fitting)
