"""The @triton.jit kernels behind `triton_kernels` (imported by it on first use, never at package import:
this module needs triton, and Triton reads TRITON_INTERPRET when it decorates these functions).

One program per (row, head) for the memory kernels, one per row for the row-wise ones; every kernel masks
its loads and stores, so no size has to be a multiple of a block. Contracts: see `triton_kernels`.
"""

import os

try:  # (inside try: transformers' remote-code import check must not demand triton from CPU users)
    import triton
    import triton.language as tl
except ImportError as error:
    raise ImportError(f"the GPN Triton kernels need triton ({error}): pip install triton") from error


def _mend_interpreter_index() -> None:
    """Under Triton's CPU interpreter, give its scalars an `__index__` that NumPy >= 2.4 accepts.

    Why: the interpreter holds a scalar (a kernel's int argument, say `dv`) as a one-element array and, up
    to triton 3.6 (the GPU machine's version), turns it into a Python int with `int(array)`, which NumPy 2.4
    refuses ("only 0-dimensional arrays can be converted to Python scalars"): every `range(0, dv, BLOCK_V)`
    loop of these kernels then fails on CPU. Upstream fixed it with `.squeeze()` (triton-lang/triton#9171,
    PR #9172); this applies that same fix, only when a probe shows it missing, and only to the interpreter
    (compiled kernels never take this path). A Triton whose internals differ is left as it is."""
    import operator
    import warnings

    try:
        from triton.runtime import interpreter
    except ImportError:  # (some other layout: nothing to mend)
        return
    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    if patch_tensor is None or getattr(patch_tensor, "_gpn_mended", False):
        return
    try:  # the probe: the interpreter's own patches on tl.tensor, then index a scalar it made
        scope = interpreter._LangPatchScope()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)  # (NumPy 1.25-2.3 warn, 2.4 refuses)
                patch_tensor(tl.tensor, scope)
                operator.index(interpreter._implicit_cvt(1))
            return  # it works (a Triton with the fix, or an older NumPy)
        finally:
            scope.restore()
    except TypeError as error:
        if "0-dimensional" not in str(error):  # (not NumPy's refusal: internals not as expected)
            return
    except Exception:  # noqa: BLE001 (internals not as expected: leave Triton alone)
        return

    def patch_tensor_mended(tensor, scope) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patch_tensor_mended._gpn_mended = True
    interpreter._patch_lang_tensor = patch_tensor_mended


if os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on"):  # (as Triton reads it)
    _mend_interpreter_index()


@triton.jit
def _relu_l2(x):
    """(relu(x), l2(relu(x)), 1 / its norm) of a vector held by one program: relu lets NaN through, as
    torch's does; eps 1e-12 inside the root, as the torch ops (`recurrence_step._l2_parts`)."""
    raw = tl.where(x < 0.0, 0.0, x)
    inv = 1.0 / tl.sqrt(tl.sum(raw * raw, axis=0) + 1e-12)
    return raw, raw * inv, inv


@triton.jit
def _relu_l2_backward(d_unit, unit, inv, raw):
    """The gradient into x of unit = l2(relu(x)) for d_unit (given `_relu_l2`'s results)."""
    d_raw = (d_unit - unit * tl.sum(d_unit * unit, axis=0)) * inv
    return tl.where(raw <= 0.0, 0.0, d_raw)


@triton.jit
def memory_step_kernel(
    Z,
    z_stride,
    col_value,
    col_beta,
    col_decay,
    col_query,
    KEY,
    key_stride,
    NEG_DECAY,
    M,
    M_OUT,
    KQ_RAW,
    KQ,
    KQ_INV,
    SOFTPLUS,
    GAMMA,
    DECAY,
    BETA,
    ERROR,
    UPDATE,
    READ,
    n_heads,
    dk,
    dv,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """One program per (row, head): key/query normalisation, gates, write and layer 0's read."""
    bh = tl.program_id(0).to(tl.int64)
    b, h = bh // n_heads, bh % n_heads
    zrow = Z + b * z_stride
    i = tl.arange(0, BLOCK_K)
    in_k = i < dk
    k_raw, k, k_inv = _relu_l2(tl.load(KEY + b * key_stride + h * dk + i, mask=in_k, other=0.0))
    q_raw, q, q_inv = _relu_l2(tl.load(zrow + col_query + h * dk + i, mask=in_k, other=0.0))
    pair = bh * 2 * dk
    tl.store(KQ_RAW + pair + i, k_raw, mask=in_k)
    tl.store(KQ_RAW + pair + dk + i, q_raw, mask=in_k)
    tl.store(KQ + pair + i, k, mask=in_k)
    tl.store(KQ + pair + dk + i, q, mask=in_k)
    tl.store(KQ_INV + bh * 2, k_inv)
    tl.store(KQ_INV + bh * 2 + 1, q_inv)
    # gates: gamma = -exp(A_log) softplus(decay) (torch's softplus: x above 20, else log1p(exp(x)),
    # log1p written out exactly as u = 1 + y: log(u) * y / (u - 1)); a = exp(gamma); beta = sigmoid
    x = tl.load(zrow + col_decay + h)
    y = tl.exp(x)
    u = 1.0 + y
    log1p = tl.where(u == 1.0, y, tl.log(u) * (y / tl.where(u == 1.0, 1.0, u - 1.0)))
    softplus = tl.where(x > 20.0, x, log1p)
    gamma = tl.load(NEG_DECAY + h) * softplus
    a = tl.exp(gamma)
    beta = tl.sigmoid(tl.load(zrow + col_beta + h))
    tl.store(SOFTPLUS + bh, softplus)
    tl.store(GAMMA + bh, gamma)
    tl.store(DECAY + bh, a)
    tl.store(BETA + bh, beta)
    qk = tl.sum(q * k, axis=0)
    # the write and the read, a block of M's columns at a time: M^T k and M^T q from one load of M
    base = bh * dk * dv
    for j0 in range(0, dv, BLOCK_V):
        j = j0 + tl.arange(0, BLOCK_V)
        in_v = j < dv
        tile = i[:, None] * dv + j[None, :]
        in_tile = in_k[:, None] & in_v[None, :]
        m = tl.load(M + base + tile, mask=in_tile, other=0.0)
        mtk = tl.sum(k[:, None] * m, axis=0)
        mtq = tl.sum(q[:, None] * m, axis=0)
        v = tl.load(zrow + col_value + h * dv + j, mask=in_v, other=0.0)
        error = v - mtk
        update = beta * error
        tl.store(ERROR + bh * dv + j, error, mask=in_v)
        tl.store(UPDATE + bh * dv + j, update, mask=in_v)
        tl.store(READ + bh * dv + j, a * mtq + qk * update, mask=in_v)
        tl.store(M_OUT + base + tile, a * m + k[:, None] * update[None, :], mask=in_tile)


@triton.jit
def memory_read_kernel(
    QUERY, query_stride, M, Q_RAW, Q, Q_INV, READ, n_heads, dk, dv, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr
):
    """One program per (row, head): q = l2(relu(query)), read = M^T q."""
    bh = tl.program_id(0).to(tl.int64)
    b, h = bh // n_heads, bh % n_heads
    i = tl.arange(0, BLOCK_K)
    in_k = i < dk
    q_raw, q, q_inv = _relu_l2(tl.load(QUERY + b * query_stride + h * dk + i, mask=in_k, other=0.0))
    tl.store(Q_RAW + bh * dk + i, q_raw, mask=in_k)
    tl.store(Q + bh * dk + i, q, mask=in_k)
    tl.store(Q_INV + bh, q_inv)
    base = bh * dk * dv
    for j0 in range(0, dv, BLOCK_V):
        j = j0 + tl.arange(0, BLOCK_V)
        in_v = j < dv
        m = tl.load(M + base + i[:, None] * dv + j[None, :], mask=in_k[:, None] & in_v[None, :], other=0.0)
        tl.store(READ + bh * dv + j, tl.sum(q[:, None] * m, axis=0), mask=in_v)


@triton.jit
def memory_write_backward_kernel(
    D,
    M,
    DM_OUT,
    QUERIES,
    READ_GRADS,
    K,
    k_stride,
    UPDATE,
    A,
    BETA,
    D_UPDATE,
    D_K,
    D_A,
    DQ0,
    D_ERROR,
    heads,
    dk,
    dv,
    LAYERS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """One program per (row, head): G = D + sum_l q_l r_l^T;  d_update = G^T k;  d_error = beta d_update;
    d_a = <G, M>;  d_k = G update - M d_error;  dq_0 = a M r_0 + k (update . r_0);  dL/dM = a G - k d_error^T."""
    bh = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_K)
    in_k = i < dk
    k = tl.load(K + bh * k_stride + i, mask=in_k, other=0.0)
    a = tl.load(A + bh)
    beta = tl.load(BETA + bh)
    base = bh * dk * dv
    # accumulators over the column blocks (vectors, reduced at the end)
    d_a = tl.zeros([BLOCK_K], dtype=tl.float32)
    d_k = tl.zeros([BLOCK_K], dtype=tl.float32)
    m_r0 = tl.zeros([BLOCK_K], dtype=tl.float32)
    r0_update = tl.zeros([BLOCK_V], dtype=tl.float32)
    for j0 in range(0, dv, BLOCK_V):
        j = j0 + tl.arange(0, BLOCK_V)
        in_v = j < dv
        tile = i[:, None] * dv + j[None, :]
        in_tile = in_k[:, None] & in_v[None, :]
        g = tl.load(D + base + tile, mask=in_tile, other=0.0)
        m = tl.load(M + base + tile, mask=in_tile, other=0.0)
        for layer in tl.static_range(LAYERS):
            q_l = tl.load(QUERIES + (layer * heads + bh) * dk + i, mask=in_k, other=0.0)
            r_l = tl.load(READ_GRADS + (layer * heads + bh) * dv + j, mask=in_v, other=0.0)
            g += q_l[:, None] * r_l[None, :]
        r0 = tl.load(READ_GRADS + bh * dv + j, mask=in_v, other=0.0)
        update = tl.load(UPDATE + bh * dv + j, mask=in_v, other=0.0)
        d_update = tl.sum(k[:, None] * g, axis=0)
        d_error = beta * d_update
        tl.store(D_UPDATE + bh * dv + j, d_update, mask=in_v)
        tl.store(D_ERROR + bh * dv + j, d_error, mask=in_v)
        d_a += tl.sum(g * m, axis=1)
        d_k += tl.sum(g * update[None, :] - m * d_error[None, :], axis=1)
        m_r0 += tl.sum(m * r0[None, :], axis=1)
        r0_update += r0 * update
        tl.store(DM_OUT + base + tile, a * g - k[:, None] * d_error[None, :], mask=in_tile)
    tl.store(D_K + bh * dk + i, d_k, mask=in_k)
    tl.store(DQ0 + bh * dk + i, a * m_r0 + k * tl.sum(r0_update, axis=0), mask=in_k)
    tl.store(D_A + bh, tl.sum(d_a, axis=0))


@triton.jit
def unit_rms_kernel(X, x_stride, OUT, out_stride, width, eps, BLOCK: tl.constexpr):
    """One program per row: x / sqrt(mean(x^2) + eps)."""
    row = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK)
    valid = j < width
    x = tl.load(X + row * x_stride + j, mask=valid, other=0.0)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / width + eps)
    tl.store(OUT + row * out_stride + j, x * inv, mask=valid)


@triton.jit
def ground_kernel(Z_FG, BIAS, P, U, u_stride, SIG, G, A_G, width, eps, BLOCK: tl.constexpr):
    """One program per row: sig = sigmoid(z + b);  g = sig * p + u;  a_g = rms(g)."""
    row = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK)
    valid = j < width
    at = row * width + j
    z = tl.load(Z_FG + at, mask=valid, other=0.0).to(tl.float32)  # (a matmul's output: maybe bf16)
    sig = tl.sigmoid(z + tl.load(BIAS + j, mask=valid, other=0.0))
    p = tl.load(P + at, mask=valid, other=0.0)
    g = sig * p + tl.load(U + row * u_stride + j, mask=valid, other=0.0)
    inv = 1.0 / tl.sqrt(tl.sum(g * g, axis=0) / width + eps)
    tl.store(SIG + at, sig, mask=valid)
    tl.store(G + at, g, mask=valid)
    tl.store(A_G + at, g * inv, mask=valid)


@triton.jit
def predict_input_kernel(
    PART, part_stride, col_a, col_b, col_r, NORMED, X, inter, read_width, BLOCK_F: tl.constexpr, BLOCK_R: tl.constexpr
):
    """One program per row: X = [silu(a) b | silu(r) normed_read] (the read half only when read_width > 0)."""
    row = tl.program_id(0).to(tl.int64)
    part = PART + row * part_stride
    x = X + row * (inter + read_width)
    for j0 in range(0, inter, BLOCK_F):
        j = j0 + tl.arange(0, BLOCK_F)
        valid = j < inter
        a = tl.load(part + col_a + j, mask=valid, other=0.0)
        tl.store(x + j, a * tl.sigmoid(a) * tl.load(part + col_b + j, mask=valid, other=0.0), mask=valid)
    for j0 in range(0, read_width, BLOCK_R):
        j = j0 + tl.arange(0, BLOCK_R)
        valid = j < read_width
        r = tl.load(part + col_r + j, mask=valid, other=0.0)
        normed = tl.load(NORMED + row * read_width + j, mask=valid, other=0.0)
        tl.store(x + inter + j, r * tl.sigmoid(r) * normed, mask=valid)


@triton.jit
def gated_residual_kernel(Y, PART, part_stride, col_gate, STATE, OUT, width, BLOCK: tl.constexpr):
    """One program per row: state' = Y + sigmoid(gate) * state."""
    row = tl.program_id(0).to(tl.int64)
    for j0 in range(0, width, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        valid = j < width
        at = row * width + j
        gate = tl.load(PART + row * part_stride + col_gate + j, mask=valid, other=0.0)
        y = tl.load(Y + at, mask=valid, other=0.0).to(tl.float32)  # (a matmul's output: maybe bf16)
        new = y + tl.sigmoid(gate) * tl.load(STATE + at, mask=valid, other=0.0)
        tl.store(OUT + at, new, mask=valid)


KERNELS = dict(
    memory_step=memory_step_kernel,
    memory_read=memory_read_kernel,
    memory_write_backward=memory_write_backward_kernel,
    unit_rms=unit_rms_kernel,
    ground=ground_kernel,
    predict_input=predict_input_kernel,
    gated_residual=gated_residual_kernel,
)


# --------------------------------------------------------------------------------------------------
# Backward: the elementwise stretches of `recurrence_step._step_backward` between its matmuls
# --------------------------------------------------------------------------------------------------


@triton.jit
def predict_layer_backward_kernel(
    PART,
    part_stride,
    col_gate,
    col_a,
    col_b,
    col_r,
    STATE,
    D_STATE,
    DX,
    NORMED,
    READ,
    D_PART,
    d_part_stride,
    OUT_X,
    D_STATE_OUT,
    D_READ,
    width,
    inter,
    read_width,
    eps,
    BLOCK: tl.constexpr,
    BLOCK_F: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """One program per row, through state' = sigmoid(gate) state + X W_out, X = [silu(a) b | silu(r) rms(read)]
    given dX = d state' W_out^T: the gradients of the layer's projections (into D_PART), of its input state
    (sigmoid(gate) d_state) and of its read (rms backward); X itself is rebuilt into OUT_X (the output
    matmul's weight-gradient rows)."""
    row = tl.program_id(0).to(tl.int64)
    part = PART + row * part_stride
    d_part = D_PART + row * d_part_stride
    for j0 in range(0, width, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        valid = j < width
        at = row * width + j
        sig = tl.sigmoid(tl.load(part + col_gate + j, mask=valid, other=0.0))
        d_state = tl.load(D_STATE + at, mask=valid, other=0.0)
        state = tl.load(STATE + at, mask=valid, other=0.0)
        tl.store(d_part + col_gate + j, d_state * state * (sig - sig * sig), mask=valid)
        tl.store(D_STATE_OUT + at, d_state * sig, mask=valid)
    x_row = OUT_X + row * (inter + read_width)
    dx_row = DX + row * (inter + read_width)
    for j0 in range(0, inter, BLOCK_F):
        j = j0 + tl.arange(0, BLOCK_F)
        valid = j < inter
        a = tl.load(part + col_a + j, mask=valid, other=0.0)
        b = tl.load(part + col_b + j, mask=valid, other=0.0)
        d_hidden = tl.load(dx_row + j, mask=valid, other=0.0).to(tl.float32)  # (dX: maybe bf16)
        sig = tl.sigmoid(a)
        tl.store(x_row + j, a * sig * b, mask=valid)
        tl.store(d_part + col_a + j, d_hidden * b * (sig + a * (sig - sig * sig)), mask=valid)
        tl.store(d_part + col_b + j, d_hidden * (a * sig), mask=valid)
    if read_width > 0:
        # the read's rms backward needs two row sums first: mean(read^2) and mean(d_normed * normed)
        sum_sq = tl.zeros([BLOCK_R], dtype=tl.float32)
        sum_dy_y = tl.zeros([BLOCK_R], dtype=tl.float32)
        for j0 in range(0, read_width, BLOCK_R):
            j = j0 + tl.arange(0, BLOCK_R)
            valid = j < read_width
            r = tl.load(part + col_r + j, mask=valid, other=0.0)
            normed = tl.load(NORMED + row * read_width + j, mask=valid, other=0.0)
            read = tl.load(READ + row * read_width + j, mask=valid, other=0.0)
            d_out = tl.load(dx_row + inter + j, mask=valid, other=0.0).to(tl.float32)
            sig = tl.sigmoid(r)
            tl.store(x_row + inter + j, r * sig * normed, mask=valid)
            tl.store(d_part + col_r + j, d_out * normed * (sig + r * (sig - sig * sig)), mask=valid)
            sum_sq += read * read
            sum_dy_y += d_out * (r * sig) * normed
        inv = 1.0 / tl.sqrt(tl.sum(sum_sq, axis=0) / read_width + eps)
        mean_dy_y = tl.sum(sum_dy_y, axis=0) / read_width
        for j0 in range(0, read_width, BLOCK_R):
            j = j0 + tl.arange(0, BLOCK_R)
            valid = j < read_width
            r = tl.load(part + col_r + j, mask=valid, other=0.0)
            normed = tl.load(NORMED + row * read_width + j, mask=valid, other=0.0)
            d_out = tl.load(dx_row + inter + j, mask=valid, other=0.0).to(tl.float32)
            d_normed = d_out * (r * tl.sigmoid(r))
            tl.store(D_READ + row * read_width + j, (d_normed - normed * mean_dy_y) * inv, mask=valid)


@triton.jit
def memory_read_backward_kernel(
    D_READ, M, Q, Q_INV, Q_RAW, D_QUERY, d_query_stride, n_heads, dk, dv, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr
):
    """One program per (row, head): through read = M'^T q, q = l2(relu(query)): dq = M' d_read, then the
    l2 and relu backward into the query columns (D_QUERY)."""
    bh = tl.program_id(0).to(tl.int64)
    b, h = bh // n_heads, bh % n_heads
    i = tl.arange(0, BLOCK_K)
    in_k = i < dk
    dq = tl.zeros([BLOCK_K], dtype=tl.float32)
    base = bh * dk * dv
    for j0 in range(0, dv, BLOCK_V):
        j = j0 + tl.arange(0, BLOCK_V)
        in_v = j < dv
        m = tl.load(M + base + i[:, None] * dv + j[None, :], mask=in_k[:, None] & in_v[None, :], other=0.0)
        dq += tl.sum(m * tl.load(D_READ + bh * dv + j, mask=in_v, other=0.0)[None, :], axis=1)
    q = tl.load(Q + bh * dk + i, mask=in_k, other=0.0)
    raw = tl.load(Q_RAW + bh * dk + i, mask=in_k, other=0.0)
    tl.store(D_QUERY + b * d_query_stride + h * dk + i, _relu_l2_backward(dq, q, tl.load(Q_INV + bh), raw), mask=in_k)


@triton.jit
def memory_gates_backward_kernel(
    D_UPDATE,
    ERROR,
    D_ERROR,
    D_K,
    DQ0,
    D_A,
    DECAY,
    BETA,
    SOFTPLUS,
    DECAY_PRE,
    decay_pre_stride,
    NEG_DECAY,
    KQ,
    KQ_INV,
    KQ_RAW,
    D_NEW_KEY,
    d_new_key_stride,
    DZ,
    dz_stride,
    col_value,
    col_beta,
    col_decay,
    col_query,
    D_KEY,
    NEG_TERMS,
    n_heads,
    dk,
    dv,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """One program per (row, head), after `memory_write_backward_kernel`: the gradients of the step's
    projections Z through the write gates, the value, the new key (passed through) and layer 0's query,
    the gradient of the carried key (through its l2 and relu), and d_gamma * softplus(decay) per head (the
    decay rate's gradient, summed over rows by the caller)."""
    bh = tl.program_id(0).to(tl.int64)
    b, h = bh // n_heads, bh % n_heads
    dz = DZ + b * dz_stride
    # decay: gamma = ndr softplus(x), a = exp(gamma): d_gamma = d_a a;  dx = d_gamma ndr sigmoid(x)
    d_gamma = tl.load(D_A + bh) * tl.load(DECAY + bh)
    tl.store(NEG_TERMS + bh, d_gamma * tl.load(SOFTPLUS + bh))
    x = tl.load(DECAY_PRE + b * decay_pre_stride + h)  # the decay's pre-activation (Z's decay columns)
    tl.store(dz + col_decay + h, d_gamma * tl.load(NEG_DECAY + h) * tl.sigmoid(x))
    # value (d_error) and beta (d_sigmoid = <d_update, error>)
    d_sig = tl.zeros([BLOCK_V], dtype=tl.float32)
    for j0 in range(0, dv, BLOCK_V):
        j = j0 + tl.arange(0, BLOCK_V)
        in_v = j < dv
        d_sig += tl.load(D_UPDATE + bh * dv + j, mask=in_v, other=0.0) * tl.load(
            ERROR + bh * dv + j, mask=in_v, other=0.0
        )
        tl.store(dz + col_value + h * dv + j, tl.load(D_ERROR + bh * dv + j, mask=in_v, other=0.0), mask=in_v)
    beta = tl.load(BETA + bh)
    tl.store(dz + col_beta + h, tl.sum(d_sig, axis=0) * (beta - beta * beta))
    # the new key's gradient passes to its columns; the carried key and layer 0's query through l2(relu(.))
    i = tl.arange(0, BLOCK_K)
    in_k = i < dk
    tl.store(dz + h * dk + i, tl.load(D_NEW_KEY + b * d_new_key_stride + h * dk + i, mask=in_k, other=0.0), mask=in_k)
    pair = bh * 2 * dk
    k = tl.load(KQ + pair + i, mask=in_k, other=0.0)
    d_k = tl.load(D_K + bh * dk + i, mask=in_k, other=0.0)
    k_raw = tl.load(KQ_RAW + pair + i, mask=in_k, other=0.0)
    tl.store(
        D_KEY + b * n_heads * dk + h * dk + i, _relu_l2_backward(d_k, k, tl.load(KQ_INV + bh * 2), k_raw), mask=in_k
    )
    q = tl.load(KQ + pair + dk + i, mask=in_k, other=0.0)
    dq = tl.load(DQ0 + bh * dk + i, mask=in_k, other=0.0)
    q_raw = tl.load(KQ_RAW + pair + dk + i, mask=in_k, other=0.0)
    tl.store(dz + col_query + h * dk + i, _relu_l2_backward(dq, q, tl.load(KQ_INV + bh * 2 + 1), q_raw), mask=in_k)


@triton.jit
def rms_backward_kernel(
    DY,
    X,
    ACC,
    ACC2,
    MUL,
    OUT,
    Y_OUT,
    width,
    eps,
    HAS_ACC2: tl.constexpr,
    HAS_MUL: tl.constexpr,
    WRITE_Y: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program per row: out = acc [* mul] [+ acc2] + dx, with dx the gradient through y = rms(x) =
    x inv(x) for dy: inv (dy - y mean(dy y)); y also written to Y_OUT (a matmul's weight-gradient rows)."""
    row = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK)
    valid = j < width
    at = row * width + j
    x = tl.load(X + at, mask=valid, other=0.0)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / width + eps)
    y = x * inv
    dy = tl.load(DY + at, mask=valid, other=0.0).to(tl.float32)  # (a matmul's output: maybe bf16)
    out = tl.load(ACC + at, mask=valid, other=0.0)
    if HAS_MUL:
        out = out * tl.load(MUL + at, mask=valid, other=0.0)
    if HAS_ACC2:
        out += tl.load(ACC2 + at, mask=valid, other=0.0)
    out += (dy - y * (tl.sum(dy * y, axis=0) / width)) * inv
    tl.store(OUT + at, out, mask=valid)
    if WRITE_Y:
        tl.store(Y_OUT + at, y, mask=valid)


@triton.jit
def ground_gate_backward_kernel(D_G, P, SIG, D_Z, width, BLOCK: tl.constexpr):
    """One program per row: through g = sigmoid(z) p + u: dz = dg p sigmoid'(z)."""
    row = tl.program_id(0).to(tl.int64)
    for j0 in range(0, width, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        valid = j < width
        at = row * width + j
        sig = tl.load(SIG + at, mask=valid, other=0.0)
        d_z = tl.load(D_G + at, mask=valid, other=0.0) * tl.load(P + at, mask=valid, other=0.0) * (sig - sig * sig)
        tl.store(D_Z + at, d_z, mask=valid)


KERNELS.update(
    predict_layer_backward=predict_layer_backward_kernel,
    memory_read_backward=memory_read_backward_kernel,
    memory_gates_backward=memory_gates_backward_kernel,
    rms_backward=rms_backward_kernel,
    ground_gate_backward=ground_gate_backward_kernel,
)
