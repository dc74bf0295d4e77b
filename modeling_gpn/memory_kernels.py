"""Fused CPU kernels for the memory half of a step and its gradient (optional: the torch ops in
`fast_recurrence` compute the same and are the reference the tests compare against).

Why: a step touches the memory M (B*H heads of dk x dv floats, 1.5 MB for the small preset at batch 8)
in many separate torch ops, each one a pass over all heads: five passes in the forward step and twelve in
its backward, and around them a dozen small ops on the key, query and gates. Per head, M and its gradient
are 32 KB each and fit in the core's L1/L2 cache, so a kernel that finishes one head before moving to the
next reads each from memory once and makes the later passes nearly free; the small ops ride along. The
kernels are plain C compiled once per machine with the system's C compiler (`cc`, or `$CC`) into
`$GPN_KERNEL_CACHE` (default `~/.cache/gpn/kernels`) and called through ctypes; without a compiler, or with
`GPN_MEMORY_KERNELS=0`, `available()` is False and the fast path uses its torch ops.

The equations are those of `fast_recurrence._step` / `_step_backward` (per head, M is dk x dv):
    forward (`memory_step`, from the step's projections Z and the carried key pre-activation):
              k = l2(relu(key)), q = l2(relu(query));  a = exp(gamma), gamma = -exp(A_log) softplus(decay);
              beta = sigmoid(.);  error = v - M^T k;  update = beta * error;
              read = a M^T q + (q . k) update  (= M'^T q);  M' = a M + k update^T;  rms(read) per row
    backward (`memory_write_backward`):
              G = D + sum_l q_l r_l^T              (D = dL/dM' from later steps, r_l = dL/d read of layer l)
              d_update = G^T k;  d_error = beta d_update;  d_a = <G, M>
              d_k = G update - M d_error;  dq_0 = M' r_0 = a M r_0 + k (update . r_0)  (layer 0's query)
              dL/dM = a G - k d_error^T
This file ships to the Hub with the model: it imports only torch and the standard library.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import NamedTuple, Optional

import torch

SOURCE = r"""
#include <stddef.h>

/* One head per iteration: every pass over M (and D) after the first hits the cache. */

#include <math.h>

static float softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); } /* torch's F.softplus (threshold 20) */

/* The memory half of a step, from the step's projections Z: the key (carried, from g_{t-1}) and layer 0's
   query through l2(relu(.)), the write gates, the write, layer 0's read and its RMS norm. Phase 1 runs one
   head at a time (every pass over M after the first hits the cache), phase 2 one row at a time. */
void gpn_memory_step(
    int rows, int H, int dk, int dv, const float *Z, long z_stride, int col_value, int col_beta, int col_decay,
    int col_query, const float *key, long key_stride, const float *neg_decay_rate, float rms_eps,
    const float *M, float *M_out, float *kq_raw, float *kq, float *kq_inv, float *softplus_decay, float *gamma,
    float *decay_factor, float *sig_beta, float *error, float *update, float *read, float *normed_read, int threads)
{
    const int heads = rows * H;
    #pragma omp parallel num_threads(threads)
    {
    #pragma omp for schedule(static)
    for (int bh = 0; bh < heads; bh++) {
        const int b = bh / H, h = bh % H;
        const float *zrow = Z + (size_t)b * z_stride;
        /* k and q: relu, then l2 normalisation (eps 1e-12 inside the root) */
        float *raw = kq_raw + (size_t)bh * 2 * dk, *unit = kq + (size_t)bh * 2 * dk;
        const float *sources[2] = {key + (size_t)b * key_stride + (size_t)h * dk, zrow + col_query + (size_t)h * dk};
        for (int s = 0; s < 2; s++) {
            float sq = 0.f;
            for (int i = 0; i < dk; i++) {
                const float v = sources[s][i], x = (v > 0.f || v != v) ? v : 0.f; /* relu; NaN stays NaN, as torch's */
                raw[s * dk + i] = x;
                sq += x * x;
            }
            const float inv = 1.f / sqrtf(sq + 1e-12f);
            kq_inv[(size_t)bh * 2 + s] = inv;
            for (int i = 0; i < dk; i++) unit[s * dk + i] = raw[s * dk + i] * inv;
        }
        const float *kh = unit, *qh = unit + dk;
        /* gates: a = exp(gamma), gamma = -exp(A_log) softplus(decay); beta = sigmoid */
        const float sp = softplus(zrow[col_decay + h]);
        const float g = neg_decay_rate[h] * sp;
        const float ah = expf(g), beta_h = 1.f / (1.f + expf(-zrow[col_beta + h]));
        softplus_decay[bh] = sp; gamma[bh] = g; decay_factor[bh] = ah; sig_beta[bh] = beta_h;
        /* write and read */
        const float *Mh = M + (size_t)bh * dk * dv;
        float *Oh = M_out + (size_t)bh * dk * dv;
        const float *vh = zrow + col_value + (size_t)h * dv;
        float *eh = error + (size_t)bh * dv, *uh = update + (size_t)bh * dv, *rh = read + (size_t)bh * dv;
        float Mtk[dv], Mtq[dv];
        for (int j = 0; j < dv; j++) { Mtk[j] = 0.f; Mtq[j] = 0.f; }
        float qk = 0.f;
        for (int i = 0; i < dk; i++) {
            const float ki = kh[i], qi = qh[i];
            const float *row = Mh + (size_t)i * dv;
            qk += qi * ki;
            #pragma omp simd
            for (int j = 0; j < dv; j++) { Mtk[j] += ki * row[j]; Mtq[j] += qi * row[j]; }
        }
        #pragma omp simd
        for (int j = 0; j < dv; j++) {
            eh[j] = vh[j] - Mtk[j];
            uh[j] = beta_h * eh[j];
            rh[j] = ah * Mtq[j] + qk * uh[j];
        }
        for (int i = 0; i < dk; i++) {
            const float ki = kh[i];
            const float *row = Mh + (size_t)i * dv;
            float *out = Oh + (size_t)i * dv;
            #pragma omp simd
            for (int j = 0; j < dv; j++) out[j] = ah * row[j] + ki * uh[j];
        }
    }
    /* the read's RMS norm runs over a whole row (all heads) */
    #pragma omp for schedule(static)
    for (int b = 0; b < rows; b++) {
        const int width = H * dv;
        const float *r = read + (size_t)b * width;
        float *n = normed_read + (size_t)b * width;
        float sq = 0.f;
        #pragma omp simd reduction(+:sq)
        for (int j = 0; j < width; j++) sq += r[j] * r[j];
        const float inv = 1.f / sqrtf(sq / width + rms_eps);
        #pragma omp simd
        for (int j = 0; j < width; j++) n[j] = r[j] * inv;
    }
    }
}

void gpn_memory_write_backward(
    int heads, int dk, int dv, int layers, const float *D, const float *M, float *dM_out,
    const float *Q, const float *R, const float *k, const float *update, const float *a, const float *beta,
    float *d_update, float *d_k, float *d_a, float *dq0, float *d_error, int threads)
{
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int h = 0; h < heads; h++) {
        const size_t mat = (size_t)h * dk * dv;
        const float *Dh = D + mat, *Mh = M + mat;
        float *Oh = dM_out + mat;
        const float *kh = k + (size_t)h * dk, *uh = update + (size_t)h * dv;
        float *dUh = d_update + (size_t)h * dv, *dkh = d_k + (size_t)h * dk, *deh = d_error + (size_t)h * dv;
        const float ah = a[h], bh = beta[h];
        float qk[layers], ru[layers], Mr[layers * dk]; /* Mr: M r_l, row by row */
        for (int l = 0; l < layers; l++) {
            const float *ql = Q + ((size_t)l * heads + h) * dk, *rl = R + ((size_t)l * heads + h) * dv;
            float s = 0.f, t = 0.f;
            for (int i = 0; i < dk; i++) s += ql[i] * kh[i];
            for (int j = 0; j < dv; j++) t += rl[j] * uh[j];
            qk[l] = s; ru[l] = t;
        }
        /* pass 1: D^T k, D update, <D, M>, M r_l */
        for (int j = 0; j < dv; j++) dUh[j] = 0.f;
        float DM = 0.f;
        for (int i = 0; i < dk; i++) {
            const float ki = kh[i];
            const float *Drow = Dh + (size_t)i * dv, *Mrow = Mh + (size_t)i * dv;
            float Du = 0.f;
            #pragma omp simd reduction(+:Du, DM)
            for (int j = 0; j < dv; j++) { dUh[j] += ki * Drow[j]; Du += Drow[j] * uh[j]; DM += Drow[j] * Mrow[j]; }
            dkh[i] = Du;
            for (int l = 0; l < layers; l++) {
                const float *rl = R + ((size_t)l * heads + h) * dv;
                float dot = 0.f;
                #pragma omp simd reduction(+:dot)
                for (int j = 0; j < dv; j++) dot += Mrow[j] * rl[j];
                Mr[l * dk + i] = dot;
            }
        }
        /* the rank-1 parts of G = D + sum_l q_l r_l^T; layer 0's dq = M' r_0 = a M r_0 + k (update . r_0) */
        float dA = DM;
        for (int l = 0; l < layers; l++) {
            const float *ql = Q + ((size_t)l * heads + h) * dk, *rl = R + ((size_t)l * heads + h) * dv;
            for (int j = 0; j < dv; j++) dUh[j] += rl[j] * qk[l];
            for (int i = 0; i < dk; i++) {
                dkh[i] += ql[i] * ru[l];
                dA += ql[i] * Mr[l * dk + i];
            }
        }
        for (int i = 0; i < dk; i++) dq0[(size_t)h * dk + i] = ah * Mr[i] + kh[i] * ru[0];
        d_a[h] = dA;
        for (int j = 0; j < dv; j++) deh[j] = bh * dUh[j];
        /* pass 2: d_k -= M d_error;  dL/dM = a G - k d_error^T */
        for (int i = 0; i < dk; i++) {
            const float ki = kh[i];
            const float *Drow = Dh + (size_t)i * dv, *Mrow = Mh + (size_t)i * dv;
            float *out = Oh + (size_t)i * dv;
            float Md = 0.f;
            #pragma omp simd reduction(+:Md)
            for (int j = 0; j < dv; j++) { Md += Mrow[j] * deh[j]; out[j] = ah * Drow[j] - ki * deh[j]; }
            dkh[i] -= Md;
            for (int l = 0; l < layers; l++) {
                const float *rl = R + ((size_t)l * heads + h) * dv;
                const float qa = ah * Q[((size_t)l * heads + h) * dk + i];
                #pragma omp simd
                for (int j = 0; j < dv; j++) out[j] += qa * rl[j];
            }
        }
    }
}
"""

_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c99"]
_lock = threading.Lock()
_library: Optional[ctypes.CDLL] = None
_failure: Optional[str] = None


def _cpu_features() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.machine() + platform.processor()


def _compile() -> ctypes.CDLL:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc, gcc or $CC) found")
    # -march=native: the build is for this CPU, so the cache key names its features (a cache folder shared
    # between machines must not hand one machine's AVX-512 build to another)
    digest = hashlib.sha256("\0".join([SOURCE, compiler, *_FLAGS, _cpu_features()]).encode()).hexdigest()[:16]
    folder = Path(os.environ.get("GPN_KERNEL_CACHE", Path.home() / ".cache" / "gpn" / "kernels"))
    library = folder / f"gpn_memory_{digest}.so"
    if library.is_file():
        try:
            return _load(library)
        except OSError:  # a damaged cached build (a killed copy, a full disk): build it again
            library.unlink(missing_ok=True)
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as scratch:
        source = Path(scratch) / "gpn_memory.c"
        source.write_text(SOURCE)
        built = Path(scratch) / library.name
        result = subprocess.run([compiler, *_FLAGS, str(source), "-o", str(built)], capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} exited with {result.returncode}: {result.stderr.strip()[-2000:]}")
        os.replace(built, library)  # atomic: concurrent processes never load a half-written file
    return _load(library)


def _load(library: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(library))
    i, p, l = ctypes.c_int, ctypes.c_void_p, ctypes.c_long
    f = ctypes.c_float
    lib.gpn_memory_step.argtypes = [i, i, i, i, p, l, i, i, i, i, p, l, p, f, p, p, *[p] * 11, i]
    lib.gpn_memory_write_backward.argtypes = [i, i, i, i, p, p, p, p, p, p, p, p, p, p, p, p, p, p, i]
    return lib


def available() -> bool:
    """Whether the kernels are built (building them on first call) and enabled (`GPN_MEMORY_KERNELS` != 0)."""
    global _library, _failure
    if os.environ.get("GPN_MEMORY_KERNELS", "1") == "0":
        return False
    with _lock:
        if _library is None and _failure is None:
            try:
                _library = _compile()
            except (OSError, RuntimeError) as error:  # no compiler, a failed build: the torch ops still work
                _failure = str(error)
        return _library is not None


def unavailable_reason() -> Optional[str]:
    """Why `available()` is False (None when it is True or was not asked yet)."""
    if os.environ.get("GPN_MEMORY_KERNELS", "1") == "0":
        return "disabled by GPN_MEMORY_KERNELS=0"
    return _failure


def usable(*tensors: torch.Tensor) -> bool:
    """Whether these tensors can go to the kernels: float32 on CPU, the kernels available, and not under
    torch.compile (which traces the torch ops instead: a ctypes call cannot be traced)."""
    if torch.compiler.is_compiling():
        return False
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors) and available()


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def _require() -> None:
    if not available():
        raise RuntimeError(f"the GPN memory kernels are unavailable: {unavailable_reason()}")


def _check_output(out: torch.Tensor, like: torch.Tensor) -> None:
    if out.shape != like.shape or out.dtype != like.dtype or not out.is_contiguous():
        raise ValueError(f"output buffer must be a contiguous {tuple(like.shape)} {like.dtype} tensor")


class MemoryStep(NamedTuple):
    """What `memory_step` computes (the names of `fast_recurrence._step`'s records)."""

    kq_raw: torch.Tensor  # (BH, 2, dk): relu of the key and of layer 0's query
    kq: torch.Tensor  # (BH, 2, dk): their l2-normalised values
    kq_inv: torch.Tensor  # (BH, 2, 1): the l2 scales
    softplus_decay: torch.Tensor  # (B, H)
    gamma: torch.Tensor  # (B, H): -exp(A_log) softplus(decay)
    decay_factor: torch.Tensor  # (BH, 1): exp(gamma)
    sig_beta: torch.Tensor  # (BH, 1)
    error: torch.Tensor  # (BH, dv)
    update: torch.Tensor  # (BH, dv)
    read: torch.Tensor  # (B, H*dv): layer 0's read M'^T q
    normed_read: torch.Tensor  # (B, H*dv): rms(read) (unit weight)


def memory_step(
    Z: torch.Tensor, columns, key: torch.Tensor, neg_decay_rate: torch.Tensor, memory: torch.Tensor,
    memory_out: torch.Tensor, rms_eps: float,
) -> MemoryStep:  # fmt: skip
    """The memory half of a step from its projections Z (B, N) (`fast_recurrence.Columns` for where the
    value, beta, decay and query columns are), the carried key pre-activation (B, H*dk) and M (BH, dk, dv):
    writes M' into `memory_out` and returns the gates, layer 0's read and what backward needs."""
    _require()
    heads, dk, dv = memory.shape
    rows = Z.shape[0]
    H = heads // rows
    if Z.stride(1) != 1 or key.stride(1) != 1 or heads != rows * H:
        raise ValueError("Z and key must have unit column stride, and M one (dk, dv) matrix per row and head")
    _check_output(memory_out, memory)
    memory, neg_decay_rate = memory.contiguous(), neg_decay_rate.float().contiguous()
    empty = lambda *shape: memory.new_empty(shape)  # noqa: E731
    out = MemoryStep(
        empty(heads, 2, dk), empty(heads, 2, dk), empty(heads, 2, 1), empty(rows, H), empty(rows, H),
        empty(heads, 1), empty(heads, 1), empty(heads, dv), empty(heads, dv), empty(rows, H * dv), empty(rows, H * dv),
    )  # fmt: skip
    _library.gpn_memory_step(
        rows, H, dk, dv, _ptr(Z), Z.stride(0), columns.value.start, columns.beta.start, columns.decay.start,
        columns.write + columns.query.start, _ptr(key), key.stride(0), _ptr(neg_decay_rate), rms_eps,
        _ptr(memory), _ptr(memory_out), *map(_ptr, out), torch.get_num_threads(),
    )  # fmt: skip
    return out


def memory_write_backward(
    memory_grad: torch.Tensor, memory: torch.Tensor, queries: torch.Tensor, read_grads: torch.Tensor,
    k: torch.Tensor, update: torch.Tensor, a: torch.Tensor, beta: torch.Tensor, memory_grad_out: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Gradients through the write and the reads of M' (see the module docstring).

    memory_grad D = dL/dM' from later steps and memory M (BH, dk, dv); queries (L, BH, dk) and read_grads
    (L, BH, dv) of the L layers reading M'; k (BH, dk), update (BH, dv), a and beta (BH,) or (BH, 1).
    Writes dL/dM into `memory_grad_out` (it may not be `memory_grad`); returns (d_update, d_k, d_a, dq of
    layer 0 (BH, dk), d_error). (The layers above need their dq before this runs, so they compute it.)"""
    _require()
    heads, dk, dv = memory.shape
    layers = queries.shape[0]
    _check_output(memory_grad_out, memory)
    if memory_grad_out.data_ptr() == memory_grad.data_ptr():
        raise ValueError("memory_grad_out must not be memory_grad")
    memory_grad, memory, queries, read_grads, k, update, a, beta = (
        t.contiguous() for t in (memory_grad, memory, queries, read_grads, k, update, a, beta)
    )
    d_update, d_error = memory.new_empty(heads, dv), memory.new_empty(heads, dv)
    d_k, d_a, dq = memory.new_empty(heads, dk), memory.new_empty(heads), memory.new_empty(heads, dk)
    _library.gpn_memory_write_backward(
        heads, dk, dv, layers, _ptr(memory_grad), _ptr(memory), _ptr(memory_grad_out), _ptr(queries),
        _ptr(read_grads), _ptr(k), _ptr(update), _ptr(a), _ptr(beta), _ptr(d_update), _ptr(d_k), _ptr(d_a),
        _ptr(dq), _ptr(d_error), torch.get_num_threads(),
    )  # fmt: skip
    return d_update, d_k, d_a, dq, d_error
