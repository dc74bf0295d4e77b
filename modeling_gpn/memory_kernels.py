"""Fused CPU kernels: the memory half of a step and its gradient, and the whole no-grad step of 1-16 rows
with the few-row products around it (`StepPlan`, `linear_rows`, `module_rows`; see the section "the step at
a small batch" below). Optional: the torch ops in `recurrence_step` compute the same and are the reference
the tests compare against.

Why: a step touches the memory M (B*H heads of dk x dv floats, 1.5 MB for the small preset at batch 8)
in many separate torch ops, each one a pass over all heads: five passes in the forward step and twelve in
its backward, and around them a dozen small ops on the key, query and gates. Per head, M and its gradient
are 32 KB each and fit in the core's L1/L2 cache, so a kernel that finishes one head before moving to the
next reads each from memory once and makes the later passes nearly free; the small ops ride along. The
kernels are plain C compiled once per machine with the system's C compiler (`cc`, or `$CC`) into
`$GPN_KERNEL_CACHE` (default `~/.cache/gpn/kernels`) and called through ctypes; without a compiler, or with
`GPN_MEMORY_KERNELS=0`, `available()` is False and the fast path uses its torch ops.

Safety (a shared library runs with the full rights of the process that loads it):
- The cache loads only what this user built: the folder must be owned by the user and writable by no one
  else (a folder of the user's that others may write to is tightened first; anyone else's is refused);
  the record `gpn_memory_<key>.sha256` (written after a successful build) and the library it names,
  `gpn_memory_<key>-<hash>.so`, must be regular files (no symbolic links) owned by the user and writable
  by no one else, and the library's content hash must equal the record. Builds go to a temporary name,
  are fsynced and renamed, under a lock (concurrent processes build once). A damaged or foreign library
  (truncated, replaced, re-permissioned, without the expected symbols or built from other source) is
  removed and rebuilt, with a `KernelWarning`; whatever cannot be made right turns the kernels off with a
  warning, and the torch ops compute the same.
- The compiler runs at most `GPN_KERNEL_BUILD_TIMEOUT` seconds (default 60; then it is killed, with a
  warning, and the torch ops are used), so a hanging `cc` cannot hang the first forward pass.
- Every kernel entry checks every tensor it reads or writes (float32, on the CPU, strided, the sizes and
  strides the C code assumes, outputs that overlap no input) and raises `KernelRefusal` naming the problem
  when one does not fit; the fast path (`fast_recurrence`) then uses the torch ops. Nothing is read as the wrong type.

The equations are those of `recurrence_step._step` / `_step_backward` (per head, M is dk x dv):
    forward (`memory_step`, from the step's projections Z and the carried key pre-activation):
              k = l2(relu(key)), q = l2(relu(query));  a = exp(gamma), gamma = -exp(A_log) softplus(decay);
              beta = sigmoid(.);  error = v - M^T k;  update = beta * error;
              read = a M^T q + (q . k) update  (= M'^T q);  M' = a M + k update^T;  rms(read) per row
    backward (`memory_write_backward`):
              G = D + sum_l q_l r_l^T              (D = dL/dM' from later steps, r_l = dL/d read of layer l)
              d_update = G^T k;  d_error = beta d_update;  d_a = <G, M>
              d_k = G update - M d_error;  dq_0 = M' r_0 = a M r_0 + k (update . r_0)  (layer 0's query)
              dL/dM = a G - k d_error^T
This file ships to the Hub with the model: it imports only torch, the standard library and `recurrence_step`
(the contract it implements part of).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import torch
from torch.autograd.graph import increment_version

from .recurrence_step import (
    INT4_GROUPS,
    Columns,
    FoldedWeights,
    Int4Weight,
    MemoryStep,
    Shapes,
    StepState,
    dequantized_by_linear,
    int4_weight_parts,
    int8_weight_parts,
    keep_padded_rows,
)

SOURCE = r"""
#include <stddef.h>
#include <math.h>
#include <string.h>

/* One head per iteration: every pass over M (and D) after the first hits the cache. Sizes are 64-bit and
   there are no arrays on the stack (a thread's stack is small: a head's dv floats there overflowed it), so
   any size the Python side accepts is safe; the Python side checks every tensor before a call. */

typedef long long i64;

static float softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); } /* torch's F.softplus (threshold 20) */

/* The memory half of a step, from the step's projections Z: the key (carried, from g_{t-1}) and layer 0's
   query through l2(relu(.)), the write gates, the write, layer 0's read and its RMS norm. Phase 1 runs one
   head at a time (every pass over M after the first hits the cache), phase 2 one row at a time. */
/* One head of the memory half: k and q through relu and l2 normalisation (eps 1e-12 inside the root), the
   write gates, the write M' = a M + k update^T and the read M'^T q through a M^T q + (q . k) update, from one
   pass over M (the later passes hit the cache). The records go to index bh of each record array. */
static void memory_head(
    i64 bh, i64 dk, i64 dv, const float *key_h, const float *query_h, const float *value_h, float beta_pre,
    float decay_pre, float neg_decay_rate_h, const float *Mh, float *Oh, float *kq_raw, float *kq, float *kq_inv,
    float *softplus_decay, float *gamma, float *decay_factor, float *sig_beta, float *error, float *update, float *read)
{
    float *raw = kq_raw + bh * 2 * dk, *unit = kq + bh * 2 * dk;
    const float *sources[2] = {key_h, query_h};
    for (i64 s = 0; s < 2; s++) {
        float sq = 0.f;
        for (i64 i = 0; i < dk; i++) {
            const float v = sources[s][i], x = (v > 0.f || v != v) ? v : 0.f; /* relu; NaN stays NaN, as torch's */
            raw[s * dk + i] = x;
            sq += x * x;
        }
        const float inv = 1.f / sqrtf(sq + 1e-12f);
        kq_inv[bh * 2 + s] = inv;
        for (i64 i = 0; i < dk; i++) unit[s * dk + i] = raw[s * dk + i] * inv;
    }
    const float *kh = unit, *qh = unit + dk;
    /* gates: a = exp(gamma), gamma = -exp(A_log) softplus(decay); beta = sigmoid */
    const float sp = softplus(decay_pre);
    const float g = neg_decay_rate_h * sp;
    const float ah = expf(g), beta_h = 1.f / (1.f + expf(-beta_pre));
    softplus_decay[bh] = sp; gamma[bh] = g; decay_factor[bh] = ah; sig_beta[bh] = beta_h;
    /* M^T k and M^T q accumulate straight in the error and read rows (no stack arrays) */
    float *restrict eh = error + bh * dv, *restrict uh = update + bh * dv;
    float *restrict rh = read + bh * dv;
    for (i64 j = 0; j < dv; j++) { eh[j] = 0.f; rh[j] = 0.f; }
    float qk = 0.f;
    for (i64 i = 0; i < dk; i++) {
        const float ki = kh[i], qi = qh[i];
        const float *row = Mh + i * dv;
        qk += qi * ki;
        #pragma omp simd
        for (i64 j = 0; j < dv; j++) { eh[j] += ki * row[j]; rh[j] += qi * row[j]; }
    }
    #pragma omp simd
    for (i64 j = 0; j < dv; j++) {
        const float e = value_h[j] - eh[j];
        eh[j] = e;
        uh[j] = beta_h * e;
        rh[j] = ah * rh[j] + qk * uh[j];
    }
    for (i64 i = 0; i < dk; i++) {
        const float ki = kh[i];
        const float *row = Mh + i * dv;
        float *out = Oh + i * dv;
        #pragma omp simd
        for (i64 j = 0; j < dv; j++) out[j] = ah * row[j] + ki * uh[j];
    }
}

/* The memory half of a step, from the step's projections Z: the key (carried, from g_{t-1}) and layer 0's
   query through l2(relu(.)), the write gates, the write, layer 0's read and its RMS norm. Phase 1 runs one
   head at a time (every pass over M after the first hits the cache), phase 2 one row at a time. */
void gpn_memory_step(
    i64 rows, i64 H, i64 dk, i64 dv, const float *Z, i64 z_stride, i64 col_value, i64 col_beta, i64 col_decay,
    i64 col_query, const float *key, i64 key_stride, const float *neg_decay_rate, float rms_eps,
    const float *M, float *M_out, float *kq_raw, float *kq, float *kq_inv, float *softplus_decay, float *gamma,
    float *decay_factor, float *sig_beta, float *error, float *update, float *read, float *normed_read, int threads)
{
    const i64 heads = rows * H;
    #pragma omp parallel num_threads(threads)
    {
    #pragma omp for schedule(static)
    for (i64 bh = 0; bh < heads; bh++) {
        const i64 b = bh / H, h = bh % H;
        const float *zrow = Z + b * z_stride;
        memory_head(bh, dk, dv, key + b * key_stride + h * dk, zrow + col_query + h * dk, zrow + col_value + h * dv,
                    zrow[col_beta + h], zrow[col_decay + h], neg_decay_rate[h], M + bh * dk * dv, M_out + bh * dk * dv,
                    kq_raw, kq, kq_inv, softplus_decay, gamma, decay_factor, sig_beta, error, update, read);
    }
    /* the read's RMS norm runs over a whole row (all heads) */
    #pragma omp for schedule(static)
    for (i64 b = 0; b < rows; b++) {
        const i64 width = H * dv;
        const float *r = read + b * width;
        float *n = normed_read + b * width;
        float sq = 0.f;
        #pragma omp simd reduction(+:sq)
        for (i64 j = 0; j < width; j++) sq += r[j] * r[j];
        const float inv = 1.f / sqrtf(sq / (float)width + rms_eps);
        #pragma omp simd
        for (i64 j = 0; j < width; j++) n[j] = r[j] * inv;
    }
    }
}

/* scratch: heads * layers * (dk + 2) floats (per head: q_l . k, r_l . update and M r_l for every layer) */
void gpn_memory_write_backward(
    i64 heads, i64 dk, i64 dv, i64 layers, const float *D, const float *M, float *dM_out,
    const float *Q, const float *R, const float *k, const float *update, const float *a, const float *beta,
    float *d_update, float *d_k, float *d_a, float *dq0, float *d_error, float *scratch, int threads)
{
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (i64 h = 0; h < heads; h++) {
        const i64 mat = h * dk * dv;
        const float *Dh = D + mat, *Mh = M + mat;
        float *Oh = dM_out + mat;
        const float *kh = k + h * dk, *uh = update + h * dv;
        float *dUh = d_update + h * dv, *dkh = d_k + h * dk, *deh = d_error + h * dv;
        const float ah = a[h], bh = beta[h];
        float *qk = scratch + h * layers * (dk + 2), *ru = qk + layers, *Mr = ru + layers; /* Mr: M r_l */
        for (i64 l = 0; l < layers; l++) {
            const float *ql = Q + (l * heads + h) * dk, *rl = R + (l * heads + h) * dv;
            float s = 0.f, t = 0.f;
            for (i64 i = 0; i < dk; i++) s += ql[i] * kh[i];
            for (i64 j = 0; j < dv; j++) t += rl[j] * uh[j];
            qk[l] = s; ru[l] = t;
        }
        /* pass 1: D^T k, D update, <D, M>, M r_l */
        for (i64 j = 0; j < dv; j++) dUh[j] = 0.f;
        float DM = 0.f;
        for (i64 i = 0; i < dk; i++) {
            const float ki = kh[i];
            const float *Drow = Dh + i * dv, *Mrow = Mh + i * dv;
            float Du = 0.f;
            #pragma omp simd reduction(+:Du, DM)
            for (i64 j = 0; j < dv; j++) { dUh[j] += ki * Drow[j]; Du += Drow[j] * uh[j]; DM += Drow[j] * Mrow[j]; }
            dkh[i] = Du;
            for (i64 l = 0; l < layers; l++) {
                const float *rl = R + (l * heads + h) * dv;
                float dot = 0.f;
                #pragma omp simd reduction(+:dot)
                for (i64 j = 0; j < dv; j++) dot += Mrow[j] * rl[j];
                Mr[l * dk + i] = dot;
            }
        }
        /* the rank-1 parts of G = D + sum_l q_l r_l^T; layer 0's dq = M' r_0 = a M r_0 + k (update . r_0) */
        float dA = DM;
        for (i64 l = 0; l < layers; l++) {
            const float *ql = Q + (l * heads + h) * dk, *rl = R + (l * heads + h) * dv;
            for (i64 j = 0; j < dv; j++) dUh[j] += rl[j] * qk[l];
            for (i64 i = 0; i < dk; i++) {
                dkh[i] += ql[i] * ru[l];
                dA += ql[i] * Mr[l * dk + i];
            }
        }
        for (i64 i = 0; i < dk; i++) dq0[h * dk + i] = ah * Mr[i] + kh[i] * ru[0];
        d_a[h] = dA;
        for (i64 j = 0; j < dv; j++) deh[j] = bh * dUh[j];
        /* pass 2: d_k -= M d_error;  dL/dM = a G - k d_error^T */
        for (i64 i = 0; i < dk; i++) {
            const float ki = kh[i];
            const float *Drow = Dh + i * dv, *Mrow = Mh + i * dv;
            float *out = Oh + i * dv;
            float Md = 0.f;
            #pragma omp simd reduction(+:Md)
            for (i64 j = 0; j < dv; j++) { Md += Mrow[j] * deh[j]; out[j] = ah * Drow[j] - ki * deh[j]; }
            dkh[i] -= Md;
            for (i64 l = 0; l < layers; l++) {
                const float *rl = R + (l * heads + h) * dv;
                const float qa = ah * Q[(l * heads + h) * dk + i];
                #pragma omp simd
                for (i64 j = 0; j < dv; j++) out[j] += qa * rl[j];
            }
        }
    }
}
/* ---- the step at batch 1..16: matrix-vector products at the bandwidth limit, and the whole step fused ----

A step at a small batch reads every weight once and does little arithmetic per weight, so its speed is the
rate at which the weights stream in. The products read the weights in nn.Linear's own layout (out, in):
each output is a dot product of one weight row with the input, four rows at a time against up to four
batch rows, so every weight is loaded once and used for every batch row, and the input rows stay in L1.
Weights are float32, bfloat16 (multiplied with the input rounded to bfloat16, as torch's bf16 matmul does,
accumulated in float32) or int8 with one float32 scale per output row (torchao's int8 weight-only; with
AVX512-VNNI on the integer dot products, the input rounded to 16 bits: see quantize_input). */

#include <stdint.h>
#include <stdlib.h>
#include <pthread.h>
#include <omp.h>

/* A buffer of the calling thread's own (the int8 products' quantized inputs, `quantize_input`), freed when the
   thread ends: a `static __thread` pointer alone is not, so a server that starts a thread per request (each with
   its OpenMP team) would leave one buffer behind per thread, for good. `old`: the thread's buffer, freed here
   (NULL: none yet). Returns one of `bytes`, or NULL where malloc fails. */
static pthread_key_t thread_buffer_key;
static pthread_once_t thread_buffer_once = PTHREAD_ONCE_INIT;
static i64 live_thread_buffers;  /* allocated and not yet freed, in every thread (`gpn_thread_buffers`) */
static void free_thread_buffer(void *buffer)
{
    free(buffer);
    __atomic_sub_fetch(&live_thread_buffers, 1, __ATOMIC_RELAXED);
}
static void make_thread_buffer_key(void) { pthread_key_create(&thread_buffer_key, free_thread_buffer); }
static void *thread_buffer(void *old, size_t bytes)
{
    pthread_once(&thread_buffer_once, make_thread_buffer_key);
    if (old) free_thread_buffer(old);
    void *buffer = malloc(bytes);
    if (buffer) __atomic_add_fetch(&live_thread_buffers, 1, __ATOMIC_RELAXED);
    pthread_setspecific(thread_buffer_key, buffer);  /* (its destructor frees it when the thread ends) */
    return buffer;
}
/* How many such buffers are alive now (`thread_buffers`: asked by the tests) */
i64 gpn_thread_buffers(void) { return __atomic_load_n(&live_thread_buffers, __ATOMIC_RELAXED); }

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define GPN_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define GPN_AVX2 1
#endif

enum { KIND_F32 = 0, KIND_BF16 = 1, KIND_I8 = 2, KIND_I4 = 3 };
#ifndef PREFETCH
#define PREFETCH 1
#endif
enum { ROUND_OUTPUT = 1, STORE_BF16 = 2, BIAS_AFTER_ROUND = 4, STREAM_ROWS = 8, FAR_ROWS = 16 };
/* FAR_ROWS: weights far beyond the L3, read a row at a time from DRAM: the row is prefetched this far ahead into
   the L2 (with the hardware's prefetcher alone one core keeps too few reads in flight; where much of the
   weights stays in the L3 the extra instructions cost more than they bring: benchmarks/RESULTS.md) */
enum { FAR_AHEAD = 4096 };
/* ... every cache line of a float32 or bf16 row: with every other line (the hardware fetching its neighbour) the
   130M model's step and prefill took 2-18% longer, at 1 and 2 threads (benchmarks/RESULTS.md; -DFAR_EVERY_LINE=0
   builds that, for an A/B). int8 rows keep every other line: the same change there was as often slower as faster. */
#ifndef FAR_EVERY_LINE
#define FAR_EVERY_LINE 1
#endif
/* NEAR_AHEAD: rows read a row at a time without FAR_ROWS (weights in the L3, or a little beyond it: bf16 rows, and
   the int8 rows that hold their input, `held_input`) are prefetched this much nearer, into the L2. Between two
   decoded tokens the L3's other tenants evict part of them, and the hardware's prefetcher alone then keeps too few
   reads in flight: small's bf16 step was faster with it in 10 of 12 A/Bs, its prefill no faster; 4 KB ahead, or
   into the L1, was slower. The AVX2 build's bf16 rows too (its step and prefill 10-20% faster); not its float32
   rows, whose step was slower with it (benchmarks/RESULTS.md; -DNEAR_PREFETCH=0 builds without it and
   -DNEAR_AHEAD=... with another distance, for an A/B) */
#ifndef NEAR_PREFETCH
#define NEAR_PREFETCH 1
#endif
#ifndef NEAR_AHEAD
#define NEAR_AHEAD 2048
#endif

typedef struct { /* one linear map of a phase: out[b, j] = (round?)(scale_j * <W_j, x_b>) + bias_j */
    const void *w;        /* (rows, cols) row-major: float, uint16 (bf16 bits) or int8 */
    const float *scale;   /* (rows,) or NULL */
    const float *bias;    /* (rows,) or NULL */
    const float *x;       /* float32 input rows (the exact input, or for bf16 and int8-on-bf16 its bf16 rounding) */
    const uint16_t *xb;   /* the input rounded to bf16 (bf16 weights with AVX512-BF16), else unused */
    void *out;            /* float (or bf16 bits with STORE_BF16) */
    i64 rows, cols, x_stride, out_stride, kind, flags;
    const uint8_t *tiles; /* int8 only, or NULL: the weights again in tiles of 16 rows (`tiled_int8_rows`) */
    const int8_t *offsets; /* int4 only: 8 + each group's zero point, (tiles, groups, 16), or NULL: all 8 (`int4_pack`) */
    i64 group;            /* int4 only: the weights of a group (a multiple of 8 dividing cols) */
} gpn_segment;

static inline float bf16_bits_to_float(uint16_t h) { union { uint32_t u; float f; } v; v.u = (uint32_t)h << 16; return v.f; }
static inline uint16_t float_to_bf16_bits(float f)  /* round to nearest even, as torch's .to(torch.bfloat16) */
{
    union { uint32_t u; float f; } v; v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  /* NaN */
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}
static inline float round_bf16(float f) { return bf16_bits_to_float(float_to_bf16_bits(f)); }
/* The shift of an input row of int8 products on integer sums (VNNI's, AVX2's), from its largest |x|: x_q, the
   integers nearest x 2^sh, then have 16,256 <= max |x_q| <= 32,512 */
static inline int input_shift(float largest)
{
    int e = 0, sh = 0;
    if (largest > 0.f) {
        (void)frexpf(largest, &e);  /* largest = f 2^e, f in [0.5, 1) */
        sh = 15 - e;
        if (ldexp((double)largest, sh) > 32512.0) sh--;
    }
    return sh;
}
static inline float weight_at(const void *w, const int kind, i64 k)
{
    if (kind == KIND_F32) return ((const float *)w)[k];
    if (kind == KIND_I8) return (float)((const int8_t *)w)[k];
    return bf16_bits_to_float(((const uint16_t *)w)[k]);
}

#ifdef GPN_AVX512
static inline __attribute__((always_inline)) __m512 load_weights(const void *w, const int kind, i64 k, __mmask16 m)
{
    if (kind == KIND_F32) return _mm512_maskz_loadu_ps(m, (const float *)w + k);
    if (kind == KIND_I8)
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, (const int8_t *)w + k)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, (const uint16_t *)w + k)), 16));
}

/* the four sums of four accumulators, in one pass of shuffles */
static inline __m128 reduce4(__m512 a0, __m512 a1, __m512 a2, __m512 a3)
{
#ifdef __AVX512DQ__
    const __m256 b0 = _mm256_add_ps(_mm512_castps512_ps256(a0), _mm512_extractf32x8_ps(a0, 1));
    const __m256 b1 = _mm256_add_ps(_mm512_castps512_ps256(a1), _mm512_extractf32x8_ps(a1, 1));
    const __m256 b2 = _mm256_add_ps(_mm512_castps512_ps256(a2), _mm512_extractf32x8_ps(a2, 1));
    const __m256 b3 = _mm256_add_ps(_mm512_castps512_ps256(a3), _mm512_extractf32x8_ps(a3, 1));
    const __m256 d = _mm256_hadd_ps(_mm256_hadd_ps(b0, b1), _mm256_hadd_ps(b2, b3));
    return _mm_add_ps(_mm256_castps256_ps128(d), _mm256_extractf128_ps(d, 1));
#else
    return _mm_setr_ps(_mm512_reduce_add_ps(a0), _mm512_reduce_add_ps(a1), _mm512_reduce_add_ps(a2), _mm512_reduce_add_ps(a3));
#endif
}

/* sums[i][b] = <row i, x_b> for 4 weight rows and NB batch rows; KIND and NB are constants where it is
   inlined. With one or two batch rows every row gets two accumulators (the multiply-add latency needs
   eight chains in flight); with more, one (the registers hold 4 x NB accumulators). */
static inline __attribute__((always_inline)) void dot_block(
    const void *const rows[4], const int KIND, const float *const xs[4], const uint16_t *const xbs[4], i64 K,
    const int NB, float sums[4][4])
{
    const int PAR = NB <= 2 ? 2 : 1;
    const i64 ES = KIND == KIND_F32 ? 4 : KIND == KIND_BF16 ? 2 : 1;
    __m512 acc[2][4][4];
    for (int s = 0; s < PAR; s++)
        for (int i = 0; i < 4; i++)
            for (int b = 0; b < NB; b++) acc[s][i][b] = _mm512_setzero_ps();
    i64 k = 0;
#if defined(__AVX512BF16__)
    if (KIND == KIND_BF16) {  /* bf16 pairs: one instruction multiplies 32 weights by the bf16 input */
        for (; k + 32 * PAR <= K; k += 32 * PAR)
            for (int s = 0; s < PAR; s++) {
                if (PREFETCH) for (int i = 0; i < 4; i++) _mm_prefetch((const char *)rows[i] + (4 * K + k + 32 * s) * 2, _MM_HINT_T0);
                __m512bh xv[4];
                for (int b = 0; b < NB; b++) xv[b] = (__m512bh)_mm512_loadu_si512((const void *)(xbs[b] + k + 32 * s));
                for (int i = 0; i < 4; i++) {
                    const __m512bh wv = (__m512bh)_mm512_loadu_si512((const void *)((const uint16_t *)rows[i] + k + 32 * s));
                    for (int b = 0; b < NB; b++) acc[s][i][b] = _mm512_dpbf16_ps(acc[s][i][b], wv, xv[b]);
                }
            }
    }
#endif
    for (; k + 16 * PAR <= K; k += 16 * PAR)
        for (int s = 0; s < PAR; s++) {
            if (PREFETCH) for (int i = 0; i < 4; i++) _mm_prefetch((const char *)rows[i] + (4 * K + k + 16 * s) * ES, _MM_HINT_T0);
            __m512 xv[4];
            for (int b = 0; b < NB; b++) xv[b] = _mm512_loadu_ps(xs[b] + k + 16 * s);
            for (int i = 0; i < 4; i++) {
                const __m512 wv = load_weights(rows[i], KIND, k + 16 * s, (__mmask16)0xffff);
                for (int b = 0; b < NB; b++) acc[s][i][b] = _mm512_fmadd_ps(wv, xv[b], acc[s][i][b]);
            }
        }
    for (; k < K; k += 16) {
        const __mmask16 m = K - k >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (K - k)) - 1u);
        __m512 xv[4];
        for (int b = 0; b < NB; b++) xv[b] = _mm512_maskz_loadu_ps(m, xs[b] + k);
        for (int i = 0; i < 4; i++) {
            const __m512 wv = load_weights(rows[i], KIND, k, m);
            for (int b = 0; b < NB; b++) acc[0][i][b] = _mm512_fmadd_ps(wv, xv[b], acc[0][i][b]);
        }
    }
    for (int b = 0; b < NB; b++) {
        if (PAR == 2)
            for (int i = 0; i < 4; i++) acc[0][i][b] = _mm512_add_ps(acc[0][i][b], acc[1][i][b]);
        float four[4];
        _mm_storeu_ps(four, reduce4(acc[0][0][b], acc[0][1][b], acc[0][2][b], acc[0][3][b]));
        for (int i = 0; i < 4; i++) sums[i][b] = four[i];
    }
}

/* <rows[i], x> for NR = 1 or 2 rows and one batch row, each row read as one sequential stream (eight accumulators
   a row, 128 weights a round; one row is as fast as a plain read of the same bytes, where four interleaved rows
   are 10-20% slower). Two rows share each load of the input (`paired_rows`); each row's sum is the one it has
   alone, to the bit. */
static inline __attribute__((always_inline)) void dot_rows(const void *const rows[2], const int NR, const int KIND,
                                                           const float *x, const uint16_t *xb, i64 K, const int FAR,
                                                           float sums[2])
{
    __m512 acc[2][8];
    for (int i = 0; i < NR; i++)
        for (int a = 0; a < 8; a++) acc[i][a] = _mm512_setzero_ps();
    i64 k = 0;
#if defined(__AVX512BF16__)
    if (KIND == KIND_BF16) {
        for (; k + 256 <= K; k += 256)
            for (int a = 0; a < 8; a++) {
                const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(xb + k + 32 * a));
                for (int i = 0; i < NR; i++) {
                    const uint16_t *row = (const uint16_t *)rows[i];
                    if (FAR && (FAR_EVERY_LINE || a % 2 == 0)) _mm_prefetch((const char *)row + 2 * (k + 32 * a) + FAR_AHEAD, _MM_HINT_T2);
                    else if (NEAR_PREFETCH && a % 2 == 0)
                        _mm_prefetch((const char *)row + 2 * (k + 32 * a) + NEAR_AHEAD, _MM_HINT_T1);
                    acc[i][a] = _mm512_dpbf16_ps(acc[i][a], (__m512bh)_mm512_loadu_si512((const void *)(row + k + 32 * a)), xv);
                }
            }
    }
#else
    (void)xb;
#endif
    for (; k + 128 <= K; k += 128)
        for (int a = 0; a < 8; a++) {
            const __m512 xv = _mm512_loadu_ps(x + k + 16 * a);
            for (int i = 0; i < NR; i++) {
                if (FAR && KIND == KIND_F32 && (FAR_EVERY_LINE || a % 2 == 0))
                    _mm_prefetch((const char *)rows[i] + 4 * (k + 16 * a) + FAR_AHEAD, _MM_HINT_T2);
                acc[i][a] = _mm512_fmadd_ps(load_weights(rows[i], KIND, k + 16 * a, (__mmask16)0xffff), xv, acc[i][a]);
            }
        }
    for (int a = 0; k < K; k += 16, a = (a + 1) & 7) {
        const __mmask16 m = K - k >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (K - k)) - 1u);
        const __m512 xv = _mm512_maskz_loadu_ps(m, x + k);
        for (int i = 0; i < NR; i++) acc[i][a] = _mm512_fmadd_ps(load_weights(rows[i], KIND, k, m), xv, acc[i][a]);
    }
    for (int i = 0; i < NR; i++) {
        __m512 *c = acc[i];
        const __m512 s = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(c[0], c[1]), _mm512_add_ps(c[2], c[3])),
                                       _mm512_add_ps(_mm512_add_ps(c[4], c[5]), _mm512_add_ps(c[6], c[7])));
        sums[i] = _mm512_reduce_add_ps(s);
    }
}

#define GPN_HAVE_DOT_ROW 1

#if defined(__AVX512VNNI__)
/* int8 products on the integer dot products (VNNI: two instructions per 64 weights, where converting each to
   float takes three per 16):
   an input row x is written as x_q 2^-sh, with x_q the 16-bit integer nearest x 2^sh (sh chosen for the row's
   largest |x|: 16,256 <= max |x_q| <= 32,512), and x_q = 256 hi + lo with hi and lo signed bytes. vpdpbusd
   multiplies unsigned by signed bytes, so the weights go in as w + 128 (their top bit flipped) and 128 times
   the sum of hi (or lo) comes off afterwards. The sums are exact (in int32 for K <= 32768); the one error is
   x's rounding, at most 2^-15 of the row's largest |x| in each element, some hundred times below the error
   of the weights' own int8 rounding. A row holding a NaN or an infinity takes the float products, which
   carry it as torch does. */
#define GPN_VNNI 1
enum { VNNI_MAX_COLS = 32768, VNNI_MAX_ROWS = 16 };

typedef struct {
    const float *x;          /* the input quantized (NULL: none yet in this phase) */
    i64 stride, K, B, width; /* width: K rounded up to 64, the planes' row length */
    int finite;              /* 0: some input is not finite (the float products run) */
    int8_t *hi, *lo;         /* (B, width) each, zero past K */
    int32_t *sums8;          /* (B, width / 8): the sums of x_q over each 8 elements (int4 products, `int4_sums8`) */
    int sums8_ready;         /* 0: not yet computed for this input */
    i64 sum_hi[VNNI_MAX_ROWS], sum_lo[VNNI_MAX_ROWS];
    double unit[VNNI_MAX_ROWS]; /* 2^-sh */
    i64 capacity;            /* bytes held at hi (both planes) */
} gpn_quantized;
/* each thread's own: a phase's threads quantize the inputs of the products they take (a few thousand floats,
   redone by each thread instead of a barrier), and every phase starts afresh (`run_tasks`), since the slots
   are rewritten between phases; its buffer is freed when the thread ends (`thread_buffer`) */
static __thread gpn_quantized quantized_input;

static const gpn_quantized *quantize_input(const gpn_segment *sg, i64 B)
{
    gpn_quantized *q = &quantized_input;
    const i64 K = sg->cols, width = (K + 63) / 64 * 64;
    if (q->x == sg->x && q->stride == sg->x_stride && q->K == K && q->B == B) return q->finite ? q : 0;
    q->x = 0;
    q->sums8_ready = 0;
    if (2 * B * width + 4 * B * (width / 8) > q->capacity) {  /* (the two planes, then the int4 products' sums) */
        q->capacity = 0;
        q->hi = (int8_t *)thread_buffer(q->hi, (size_t)(2 * B * width + 4 * B * (width / 8)));
        if (!q->hi) return 0;  /* (the float products run) */
        q->capacity = 2 * B * width + 4 * B * (width / 8);
    }
    q->lo = q->hi + B * width;
    q->sums8 = (int32_t *)(q->hi + 2 * B * width);  /* (2 B width is a multiple of 128: aligned as int32) */
    q->finite = 1;
    for (i64 b = 0; b < B && q->finite; b++) {
        const float *x = sg->x + b * sg->x_stride;
        __m512 top = _mm512_setzero_ps();
        __mmask16 bad = 0;
        for (i64 k = 0; k < K; k += 16) {
            const __mmask16 m = K - k >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (K - k)) - 1u);
            const __m512 a = _mm512_abs_ps(_mm512_maskz_loadu_ps(m, x + k));
            bad |= _mm512_cmp_ps_mask(a, _mm512_set1_ps(INFINITY), _CMP_NLT_UQ);  /* inf or NaN */
            top = _mm512_max_ps(top, a);
        }
        if (bad) { q->finite = 0; break; }
        const float largest = _mm512_reduce_max_ps(top);
        const int sh = input_shift(largest);
        const __m512 shift = _mm512_set1_ps((float)sh);
        __m512i hs = _mm512_setzero_si512(), ls = hs;
        for (i64 k = 0; k < width; k += 16) {
            const __mmask16 m = K - k >= 16 ? (__mmask16)0xffff : K > k ? (__mmask16)((1u << (K - k)) - 1u) : 0;
            const __m512i xq = _mm512_cvtps_epi32(_mm512_scalef_ps(_mm512_maskz_loadu_ps(m, x + k), shift));
            const __m512i hi = _mm512_srai_epi32(_mm512_add_epi32(xq, _mm512_set1_epi32(128)), 8);
            const __m512i lo = _mm512_sub_epi32(xq, _mm512_slli_epi32(hi, 8));
            _mm_storeu_si128((__m128i *)(q->hi + b * width + k), _mm512_cvtepi32_epi8(hi));
            _mm_storeu_si128((__m128i *)(q->lo + b * width + k), _mm512_cvtepi32_epi8(lo));
            hs = _mm512_add_epi32(hs, hi);
            ls = _mm512_add_epi32(ls, lo);
        }
        q->sum_hi[b] = _mm512_reduce_add_epi32(hs);
        q->sum_lo[b] = _mm512_reduce_add_epi32(ls);
        q->unit[b] = ldexp(1.0, -sh);
    }
    q->x = sg->x; q->stride = sg->x_stride; q->K = K; q->B = B; q->width = width;
    return q->finite ? q : 0;
}

/* acc += <4 unsigned bytes of w, 4 signed bytes of x> in each int32 lane (as inline assembly: GCC 12 compiles
   _mm512_dpbusd_epi32 with a register copy around every use, half the loop's instructions) */
#define DPBUSD(acc, w, x) __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w), "vm"(x))
/* the same with x in a register: where one input is multiplied by several rows, a memory operand would reload it for
   every row (three loads per 64 weights, where one and a half do). (With two to four batch rows GCC 12 still reloads
   the planes for each row, for want of registers: only one batch row's are held.) */
#define DPBUSD_HELD(acc, w, x) __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x))

/* the four sums of four accumulators, in one pass of shuffles (as reduce4) */
static inline __m128i reduce4_epi32(__m512i a0, __m512i a1, __m512i a2, __m512i a3)
{
    const __m256i b0 = _mm256_add_epi32(_mm512_castsi512_si256(a0), _mm512_extracti64x4_epi64(a0, 1));
    const __m256i b1 = _mm256_add_epi32(_mm512_castsi512_si256(a1), _mm512_extracti64x4_epi64(a1, 1));
    const __m256i b2 = _mm256_add_epi32(_mm512_castsi512_si256(a2), _mm512_extracti64x4_epi64(a2, 1));
    const __m256i b3 = _mm256_add_epi32(_mm512_castsi512_si256(a3), _mm512_extracti64x4_epi64(a3, 1));
    const __m256i d = _mm256_hadd_epi32(_mm256_hadd_epi32(b0, b1), _mm256_hadd_epi32(b2, b3));
    return _mm_add_epi32(_mm256_castsi256_si128(d), _mm256_extracti128_si256(d, 1));
}

/* <w, x_q> 2^-sh of batch row b from the two byte planes' sums */
static inline float vnni_dot(const gpn_quantized *q, i64 b, int32_t sum_hi, int32_t sum_lo)
{
    const i64 v = 256 * ((i64)sum_hi - 128 * q->sum_hi[b]) + ((i64)sum_lo - 128 * q->sum_lo[b]);
    return (float)((double)v * q->unit[b]);
}

/* sums[i][b] = <row i, x_(b0 + b)> for NR weight rows and NB batch rows (2 NR NB accumulators: NR NB <= 8) */
static inline __attribute__((always_inline)) void vnni_block(const int8_t *const rows[], const int NR, const gpn_quantized *q,
                                                             i64 b0, const int NB, i64 K, float sums[4][4])
{
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const int8_t *xh[4], *xl[4];
    for (int b = 0; b < NB; b++) { xh[b] = q->hi + (b0 + b) * q->width; xl[b] = q->lo + (b0 + b) * q->width; }
    __m512i h[4][4], l[4][4];
    for (int i = 0; i < NR; i++)
        for (int b = 0; b < NB; b++) h[i][b] = l[i][b] = _mm512_setzero_si512();
    for (i64 k = 0; k < K; k += 64) {
        const __mmask64 m = K - k >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << (K - k)) - 1);
        if (PREFETCH) for (int i = 0; i < NR; i++) _mm_prefetch((const char *)rows[i] + 4 * K + k, _MM_HINT_T0);
        __m512i vh[4], vl[4];
        for (int b = 0; b < NB; b++) {
            vh[b] = _mm512_loadu_si512((const void *)(xh[b] + k));
            vl[b] = _mm512_loadu_si512((const void *)(xl[b] + k));
        }
        for (int i = 0; i < NR; i++) {
            const __m512i w = _mm512_xor_si512(_mm512_maskz_loadu_epi8(m, rows[i] + k), flip);  /* (past K: 128 x 0) */
            for (int b = 0; b < NB; b++) {
                DPBUSD_HELD(h[i][b], w, vh[b]);
                DPBUSD_HELD(l[i][b], w, vl[b]);
            }
        }
    }
    for (int b = 0; b < NB; b++) {
        int32_t four[4], more[4];
        if (NR == 4) {
            _mm_storeu_si128((__m128i *)four, reduce4_epi32(h[0][b], h[1][b], h[2][b], h[3][b]));
            _mm_storeu_si128((__m128i *)more, reduce4_epi32(l[0][b], l[1][b], l[2][b], l[3][b]));
            for (int i = 0; i < 4; i++) sums[i][b] = vnni_dot(q, b0 + b, four[i], more[i]);
        } else {
            _mm_storeu_si128((__m128i *)four, reduce4_epi32(h[0][b], h[1][b], l[0][b], l[1][b]));
            for (int i = 0; i < 2; i++) sums[i][b] = vnni_dot(q, b0 + b, four[i], four[2 + i]);
        }
    }
}

/* <row, x_0> for one batch row, the row read as one sequential stream (weights streamed from DRAM) */
static inline float vnni_row(const int8_t *row, const gpn_quantized *q, i64 K, int far)
{
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const int8_t *xh = q->hi, *xl = q->lo;
    __m512i h0 = _mm512_setzero_si512(), h1 = h0, h2 = h0, h3 = h0, l0 = h0, l1 = h0, l2 = h0, l3 = h0;
    i64 k = 0;
#define GPN_VNNI_AT(H, L, at) do { \
        const __m512i w = _mm512_xor_si512(_mm512_loadu_si512((const void *)(row + (at))), flip); \
        DPBUSD(H, w, _mm512_loadu_si512((const void *)(xh + (at)))); \
        DPBUSD(L, w, _mm512_loadu_si512((const void *)(xl + (at)))); } while (0)
    for (; k + 256 <= K; k += 256) {
        if (far) {
            _mm_prefetch((const char *)row + k + FAR_AHEAD, _MM_HINT_T2);
            _mm_prefetch((const char *)row + k + 128 + FAR_AHEAD, _MM_HINT_T2);
        }
        GPN_VNNI_AT(h0, l0, k); GPN_VNNI_AT(h1, l1, k + 64); GPN_VNNI_AT(h2, l2, k + 128); GPN_VNNI_AT(h3, l3, k + 192);
    }
#undef GPN_VNNI_AT
    for (; k < K; k += 64) {
        const __mmask64 m = K - k >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << (K - k)) - 1);
        const __m512i w = _mm512_xor_si512(_mm512_maskz_loadu_epi8(m, row + k), flip);
        DPBUSD(h0, w, _mm512_loadu_si512((const void *)(xh + k)));
        DPBUSD(l0, w, _mm512_loadu_si512((const void *)(xl + k)));
    }
    int32_t four[4];
    _mm_storeu_si128((__m128i *)four, reduce4_epi32(_mm512_add_epi32(h0, h1), _mm512_add_epi32(h2, h3),
                                                    _mm512_add_epi32(l0, l1), _mm512_add_epi32(l2, l3)));
    return vnni_dot(q, 0, four[0] + four[1], four[2] + four[3]);
}

#define GPN_QUANTIZED 1
#define quantized_block vnni_block
#define quantized_row vnni_row
enum { QUANTIZED_MAX_ROWS = VNNI_MAX_ROWS, QUANTIZED_MAX_COLS = VNNI_MAX_COLS };
#endif

#elif defined(GPN_AVX2)
/* AVX2 with FMA (x86 CPUs without AVX-512: AMD's before Zen 4, Intel's client cores): the same products on
   vectors of 8 floats, with the same layout of the work. There are no masked loads of bytes, so the elements
   past a row's last whole vector are summed in scalar code and added after the vector sums. */
static inline __attribute__((always_inline)) __m256 load_weights(const void *w, const int kind, i64 k)
{
    if (kind == KIND_F32) return _mm256_loadu_ps((const float *)w + k);
    if (kind == KIND_I8)
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)w + k))));
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + k))), 16));
}

static inline float sum8(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* sums[i][b] = <row i, x_b> for NR weight rows and NB batch rows (constants where it is inlined); NR NB <= 8
   accumulators, doubled where there are four or fewer (the multiply-add latency needs eight chains in flight),
   of the 16 registers */
static inline __attribute__((always_inline)) void dot_grid(const void *const rows[], const int NR, const int KIND,
                                                           const float *const xs[], i64 K, const int NB,
                                                           float sums[4][4])
{
    const int PAR = NR * NB <= 4 ? 2 : 1;
    const i64 ES = KIND == KIND_F32 ? 4 : KIND == KIND_BF16 ? 2 : 1;
    __m256 acc[2][4][4];
    for (int s = 0; s < PAR; s++)
        for (int i = 0; i < NR; i++)
            for (int b = 0; b < NB; b++) acc[s][i][b] = _mm256_setzero_ps();
    i64 k = 0;
    for (; k + 8 * PAR <= K; k += 8 * PAR) {
        if (PREFETCH && ((k * ES) & 63) < 8 * PAR * ES)  /* once a line: the same columns of the next block */
            for (int i = 0; i < NR; i++) _mm_prefetch((const char *)rows[i] + (4 * K + k) * ES, _MM_HINT_T0);
        for (int s = 0; s < PAR; s++) {
            __m256 xv[4];
            for (int b = 0; b < NB; b++) xv[b] = _mm256_loadu_ps(xs[b] + k + 8 * s);
            for (int i = 0; i < NR; i++) {
                const __m256 wv = load_weights(rows[i], KIND, k + 8 * s);
                for (int b = 0; b < NB; b++) acc[s][i][b] = _mm256_fmadd_ps(wv, xv[b], acc[s][i][b]);
            }
        }
    }
    for (; k + 8 <= K; k += 8)
        for (int i = 0; i < NR; i++) {
            const __m256 wv = load_weights(rows[i], KIND, k);
            for (int b = 0; b < NB; b++) acc[0][i][b] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xs[b] + k), acc[0][i][b]);
        }
    for (int i = 0; i < NR; i++)
        for (int b = 0; b < NB; b++) {
            float s = sum8(PAR == 2 ? _mm256_add_ps(acc[0][i][b], acc[1][i][b]) : acc[0][i][b]);
            for (i64 t = k; t < K; t++) s += weight_at(rows[i], KIND, t) * xs[b][t];
            sums[i][b] = s;
        }
}

/* sums[i][b] = <row i, x_b> for 4 weight rows and NB batch rows: all four rows at once against one or two batch
   rows, two at a time against three or four (the accumulators must fit the registers) */
static inline __attribute__((always_inline)) void dot_block(
    const void *const rows[4], const int KIND, const float *const xs[4], const uint16_t *const xbs[4], i64 K,
    const int NB, float sums[4][4])
{
    (void)xbs;
    if (NB <= 2) {
        dot_grid(rows, 4, KIND, xs, K, NB, sums);
        return;
    }
    float upper[4][4];
    dot_grid(rows, 2, KIND, xs, K, NB, sums);
    dot_grid(rows + 2, 2, KIND, xs, K, NB, upper);
    for (int b = 0; b < NB; b++) { sums[2][b] = upper[0][b]; sums[3][b] = upper[1][b]; }
}

/* Rows streamed from DRAM (FAR_ROWS) at one batch row are read four at a time (`far_quads`), four streams in
   flight: one row at a time (prefetched FAR_AHEAD on), which reads as fast as a plain read on the AVX-512 build's
   hosts, kept too few reads in flight on AMD's Zen 3, where the 130M model's float32 and bf16 steps and prefill
   were faster with quads at 1 and 2 threads (benchmarks/RESULTS.md). Float32 quads stream fastest on the
   hardware's prefetcher alone; bf16 ones, half the bytes a multiply-add, still need the next quad's lines
   prefetched. -DFAR_QUADS=0 builds the rows one at a time, -DQUAD_PREFETCH=... names the kinds prefetched
   (1 << KIND), for an A/B. */
#ifndef FAR_QUADS
#define FAR_QUADS 1
#endif
#if FAR_QUADS
#define GPN_FAR_QUADS 1
#endif
#ifndef QUAD_PREFETCH
#define QUAD_PREFETCH (1 << KIND_BF16)
#endif

/* <rows[i], x> for NR = 1, 2 or 4 rows and one batch row, each row read as one sequential stream (four
   accumulators a row, 32 weights a round). The rows share each load of the input (`paired_rows`, `far_quads`);
   each row's sum is the one it has alone, to the bit. */
static inline __attribute__((always_inline)) void dot_rows(const void *const rows[], const int NR, const int KIND,
                                                           const float *x, const uint16_t *xb, i64 K, const int FAR,
                                                           float sums[])
{
    (void)xb;
    const i64 ES = KIND == KIND_F32 ? 4 : KIND == KIND_BF16 ? 2 : 1;
    __m256 acc[4][4];
    for (int i = 0; i < NR; i++)
        for (int a = 0; a < 4; a++) acc[i][a] = _mm256_setzero_ps();
    i64 k = 0;
    for (; k + 32 <= K; k += 32) {
        for (int i = 0; i < NR; i++)
            if (FAR && NR == 4) {
                if ((QUAD_PREFETCH >> KIND) & 1)  /* (the same columns of the next quad, once a line) */
                    for (i64 line = 0; line < 32 * ES; line += 64)
                        _mm_prefetch((const char *)rows[i] + ES * (4 * K + k) + line, _MM_HINT_T0);
            } else if (FAR && KIND != KIND_I8)
                for (i64 line = 0; line < 32 * ES; line += 64)
                    _mm_prefetch((const char *)rows[i] + ES * k + line + FAR_AHEAD, _MM_HINT_T2);
            else if (!FAR && NEAR_PREFETCH && KIND == KIND_BF16)
                _mm_prefetch((const char *)rows[i] + ES * k + NEAR_AHEAD, _MM_HINT_T1);
        for (int a = 0; a < 4; a++) {
            const __m256 xv = _mm256_loadu_ps(x + k + 8 * a);
            for (int i = 0; i < NR; i++) acc[i][a] = _mm256_fmadd_ps(load_weights(rows[i], KIND, k + 8 * a), xv, acc[i][a]);
        }
    }
    const i64 whole = k;
    for (int i = 0; i < NR; i++) {
        k = whole;
        for (int a = 0; k + 8 <= K; k += 8, a++)
            acc[i][a] = _mm256_fmadd_ps(load_weights(rows[i], KIND, k), _mm256_loadu_ps(x + k), acc[i][a]);
        float s = sum8(_mm256_add_ps(_mm256_add_ps(acc[i][0], acc[i][1]), _mm256_add_ps(acc[i][2], acc[i][3])));
        for (i64 t = k; t < K; t++) s += weight_at(rows[i], KIND, t) * x[t];
        sums[i] = s;
    }
}

#define GPN_HAVE_DOT_ROW 1

/* int8 products on 16-bit integer multiply-adds (vpmaddwd: 16 weights widened to 16 bits and multiplied in
   three instructions, where converting them to float takes six). The input row is rounded to 16 bits exactly as
   for VNNI above: x = x_q 2^-sh, x_q the 16-bit integer nearest x 2^sh, 16,256 <= max |x_q| <= 32,512. The sums
   are exact (each int32 lane takes at most 256 multiply-adds of two products of at most 128 x 32,512 before it
   is added into 64 bits), so these products are VNNI's to the bit; the one error is x's rounding, some hundred
   times below that of the weights' own int8 rounding. A row holding a NaN or an infinity takes the float
   products, which carry it as torch does. */
#define GPN_MADD 1
enum { MADD_MAX_ROWS = 16, MADD_CHUNK = 256 * 16 };  /* weights one accumulator takes before it is emptied */

typedef struct {
    const float *x;          /* the input quantized (NULL: none yet in this phase) */
    i64 stride, K, B, width; /* width: K rounded up to 8, the planes' row length */
    int finite;              /* 0: some input is not finite (the float products run) */
    int16_t *xq;             /* (B, K) */
    int8_t *hi, *lo;         /* (B, width) each, x_q = 256 hi + lo, zero past K: the int4 products' (`int4_sums8`) */
    int32_t *sums8;          /* (B, width / 8): the sums of x_q over each 8 elements (the same) */
    int sums8_ready;         /* 0: the planes and sums not yet made for this input */
    double unit[MADD_MAX_ROWS]; /* 2^-sh */
    i64 capacity;            /* bytes held at sums8 (the sums, xq, then the planes) */
} gpn_quantized;
/* each thread's own, as for VNNI */
static __thread gpn_quantized quantized_input;

static const gpn_quantized *quantize_input(const gpn_segment *sg, i64 B)
{
    gpn_quantized *q = &quantized_input;
    const i64 K = sg->cols;
    if (q->x == sg->x && q->stride == sg->x_stride && q->K == K && q->B == B) return q->finite ? q : 0;
    q->x = 0;
    q->sums8_ready = 0;
    const i64 width = (K + 7) / 8 * 8, bytes = 4 * B * (width / 8) + 2 * B * K + 2 * B * width;
    if (bytes > q->capacity) {
        q->capacity = 0;
        q->sums8 = (int32_t *)thread_buffer(q->sums8, (size_t)bytes);
        if (!q->sums8) return 0;  /* (the float products run) */
        q->capacity = bytes;
    }
    q->xq = (int16_t *)(q->sums8 + B * (width / 8));  /* (B width / 2 bytes on: a multiple of 4) */
    q->hi = (int8_t *)(q->xq + B * K);
    q->lo = q->hi + B * width;
    q->finite = 1;
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (i64 b = 0; b < B && q->finite; b++) {
        const float *x = sg->x + b * sg->x_stride;
        __m256 top = _mm256_setzero_ps();
        int bad = 0;
        i64 k = 0;
        for (; k + 8 <= K; k += 8) {
            const __m256 a = _mm256_and_ps(_mm256_loadu_ps(x + k), magnitude);
            bad |= _mm256_movemask_ps(_mm256_cmp_ps(a, _mm256_set1_ps(INFINITY), _CMP_NLT_UQ));  /* inf or NaN */
            top = _mm256_max_ps(top, a);
        }
        float largest = 0.f;
        float tops[8];
        _mm256_storeu_ps(tops, top);
        for (int j = 0; j < 8; j++) largest = tops[j] > largest ? tops[j] : largest;
        for (; k < K; k++) {
            const float a = fabsf(x[k]);
            bad |= !(a < INFINITY);
            largest = a > largest ? a : largest;
        }
        if (bad) { q->finite = 0; break; }
        const int sh = input_shift(largest);
        /* x 2^sh in double is exact (2^sh itself may lie beyond float's range); rounded to the nearest integer, ties
           to even, as VNNI's float conversion */
        const double scale = ldexp(1.0, sh);
        const __m256d scale4 = _mm256_set1_pd(scale);
        int16_t *xq = q->xq + b * K;
        for (k = 0; k + 8 <= K; k += 8) {
            const __m128i lower = _mm256_cvtpd_epi32(_mm256_mul_pd(_mm256_cvtps_pd(_mm_loadu_ps(x + k)), scale4));
            const __m128i upper = _mm256_cvtpd_epi32(_mm256_mul_pd(_mm256_cvtps_pd(_mm_loadu_ps(x + k + 4)), scale4));
            _mm_storeu_si128((__m128i *)(xq + k), _mm_packs_epi32(lower, upper));
        }
        for (; k < K; k++) xq[k] = (int16_t)lrint((double)x[k] * scale);
        q->unit[b] = ldexp(1.0, -sh);
    }
    q->x = sg->x; q->stride = sg->x_stride; q->K = K; q->B = B; q->width = width;
    return q->finite ? q : 0;
}

static inline i64 sum8_epi32(__m256i v)
{
    int32_t lanes[8];
    _mm256_storeu_si256((__m256i *)lanes, v);
    i64 s = 0;
    for (int j = 0; j < 8; j++) s += lanes[j];
    return s;
}

/* sums[i][b] = <row i, x_(b0 + b)> for NR weight rows and NB batch rows (NR NB <= 8 accumulators) */
static inline __attribute__((always_inline)) void madd_grid(const int8_t *const rows[], const int NR, const gpn_quantized *q,
                                                            i64 b0, const int NB, i64 K, float sums[4][4])
{
    const int16_t *xs[4];
    for (int b = 0; b < NB; b++) xs[b] = q->xq + (b0 + b) * K;
    i64 total[4][4] = {{0}};
    i64 k = 0;
    while (k + 16 <= K) {
        __m256i acc[4][4];
        for (int i = 0; i < NR; i++)
            for (int b = 0; b < NB; b++) acc[i][b] = _mm256_setzero_si256();
        const i64 end = K - k > MADD_CHUNK ? k + MADD_CHUNK : K;
        /* 64 weights a round, a line of each row: one prefetch a row, and the input held in registers for all the
           rows (as a memory operand GCC reloads it for each) */
        for (; k + 64 <= end; k += 64) {
            if (PREFETCH)
                for (int i = 0; i < NR; i++) _mm_prefetch((const char *)rows[i] + 4 * K + k, _MM_HINT_T0);
            for (int u = 0; u < 64; u += 16) {
                __m256i xv[4];
                for (int b = 0; b < NB; b++) {
                    xv[b] = _mm256_loadu_si256((const __m256i *)(xs[b] + k + u));
                    __asm__("" : "+x"(xv[b]));
                }
                for (int i = 0; i < NR; i++) {
                    const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(rows[i] + k + u)));
                    for (int b = 0; b < NB; b++) acc[i][b] = _mm256_add_epi32(acc[i][b], _mm256_madd_epi16(w, xv[b]));
                }
            }
        }
        for (; k + 16 <= end; k += 16) {
            __m256i xv[4];
            for (int b = 0; b < NB; b++) xv[b] = _mm256_loadu_si256((const __m256i *)(xs[b] + k));
            for (int i = 0; i < NR; i++) {
                const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(rows[i] + k)));
                for (int b = 0; b < NB; b++) acc[i][b] = _mm256_add_epi32(acc[i][b], _mm256_madd_epi16(w, xv[b]));
            }
        }
        for (int i = 0; i < NR; i++)
            for (int b = 0; b < NB; b++) total[i][b] += sum8_epi32(acc[i][b]);
    }
    for (int i = 0; i < NR; i++)
        for (int b = 0; b < NB; b++) {
            for (i64 t = k; t < K; t++) total[i][b] += (i64)rows[i][t] * xs[b][t];
            sums[i][b] = (float)((double)total[i][b] * q->unit[b0 + b]);
        }
}

/* <row, x_0> for one batch row, the row read as one sequential stream (weights streamed from DRAM; two
   accumulators) */
static inline float madd_row(const int8_t *row, const gpn_quantized *q, i64 K, int far)
{
    const int16_t *x = q->xq;
    i64 total = 0, k = 0;
    while (k + 32 <= K) {
        __m256i a0 = _mm256_setzero_si256(), a1 = a0;
        const i64 end = K - k > 2 * MADD_CHUNK ? k + 2 * MADD_CHUNK : K;
        for (; k + 32 <= end; k += 32) {
            if (far && (k & 63) == 0) _mm_prefetch((const char *)row + k + FAR_AHEAD, _MM_HINT_T2);
            a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(row + k))),
                                                        _mm256_loadu_si256((const __m256i *)(x + k))));
            a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(row + k + 16))),
                                                        _mm256_loadu_si256((const __m256i *)(x + k + 16))));
        }
        total += sum8_epi32(a0) + sum8_epi32(a1);
    }
    for (; k < K; k++) total += (i64)row[k] * x[k];
    return (float)((double)total * q->unit[0]);
}
#define GPN_QUANTIZED 1
#define quantized_block madd_grid
#define quantized_row madd_row
enum { QUANTIZED_MAX_ROWS = MADD_MAX_ROWS, QUANTIZED_MAX_COLS = 1 << 30 };

#else
/* plain C for any other CPU: each sum vectorised by the compiler (`omp simd`, in lanes it may reorder) */
static inline void dot_block(const void *const rows[4], const int kind, const float *const xs[4], const uint16_t *const xbs[4],
                             i64 K, const int NB, float sums[4][4])
{
    (void)xbs;
    for (int i = 0; i < 4; i++)
        for (int b = 0; b < NB; b++) {
            float s = 0.f;
            const float *x = xs[b];
            #pragma omp simd reduction(+:s)
            for (i64 k = 0; k < K; k++) s += weight_at(rows[i], kind, k) * x[k];
            sums[i][b] = s;
        }
}
#endif

#ifdef GPN_HAVE_DOT_ROW
/* <row, x> for one row (`dot_rows` of one row) */
static inline __attribute__((always_inline)) float dot_row(const void *row, const int KIND, const float *x, const uint16_t *xb, i64 K,
                                                            const int FAR)
{
    const void *rows[2] = {row, row};
    float sums[2];
    dot_rows(rows, 1, KIND, x, xb, K, FAR, sums);
    return sums[0];
}
#endif

static inline i64 weight_size(i64 kind) { return kind == KIND_F32 ? 4 : kind == KIND_BF16 ? 2 : 1; }

/* rows [r0, r1) of segment `sg` for all B batch rows */
/* y = scale * dot + bias, rounded to bf16 where the module rounds (as torch's bf16 linear: the bias inside
   the rounding; a bias the module adds afterwards in float32, the decay's dt_bias, after it) */
static inline void store_output(const gpn_segment *sg, i64 b, i64 r, float y)
{
    if (sg->scale && sg->kind != KIND_I4) y *= sg->scale[r];  /* (int4's scales are its groups', applied already) */
    if (sg->bias && !(sg->flags & BIAS_AFTER_ROUND)) y += sg->bias[r];
    if (sg->flags & ROUND_OUTPUT) y = round_bf16(y);
    if (sg->bias && (sg->flags & BIAS_AFTER_ROUND)) y += sg->bias[r];
    const i64 at = b * sg->out_stride + r;
    if (sg->flags & STORE_BF16) ((uint16_t *)sg->out)[at] = float_to_bf16_bits(y);
    else ((float *)sg->out)[at] = y;
}

/* int4 weights in `int4_pack`'s layout: tiles of 16 rows, in which each 8 weights of a row are a 4-byte group, the
   first four in its low nibbles and the next four in its high ones, each as u = q + 8 in [0, 15]; per group and row a
   float32 scale and an offset 8 + z (z the group's zero point; NULL: every z is 0), at ((tile, group), row in tile).
   The weight is (u - offset) scale, what torchao dequantizes. */
static inline int int4_at(const gpn_segment *sg, i64 r, i64 k)
{
    const uint8_t at = ((const uint8_t *)sg->w)[(r / 16) * 8 * sg->cols + (k / 8) * 64 + 4 * (r % 16) + k % 4];
    return k % 8 < 4 ? at & 15 : at >> 4;
}
/* rows [r0, r1) of an int4 segment in float32 from the exact input (an input that is not finite, or a build without
   VNNI, which the Python side does not give int4 segments: its products carry NaN and infinities as torch's) */
static void int4_rows_float(const gpn_segment *sg, i64 B, i64 r0, i64 r1)
{
    const i64 K = sg->cols, G = sg->group, ng = K / G;
    for (i64 b = 0; b < B; b++) {
        const float *x = sg->x + b * sg->x_stride;
        for (i64 r = r0; r < r1; r++) {
            float y = 0.f;
            for (i64 g = 0; g < ng; g++) {
                const i64 at = ((r / 16) * ng + g) * 16 + r % 16;
                const int o = sg->offsets ? sg->offsets[at] : 8;
                float sum = 0.f;
                for (i64 k = g * G; k < g * G + G; k++) sum += (float)(int4_at(sg, r, k) - o) * x[k];
                y += sg->scale[at] * sum;
            }
            store_output(sg, b, r, y);
        }
    }
}

/* Rows of 256, 512 or 768 weights at one batch row, outside FAR_ROWS (in the L3, or a little beyond it), hold the
   input in registers (`held_input`): bf16 rows where the CPU has AVX512-BF16, int8 rows (their input's two byte
   planes) where it has VNNI. Read a row at a time beside its input (`dot_rows`, `vnni_row`), a row takes a load of
   the input beside each load of weights, and a core loads one 64-byte vector a cycle, so the loads, not the L3,
   bound those rows; four rows at a time (`vnni_block`) share the input's loads but read four streams, which the L3
   serves worse. Held, the input is loaded once per task (8-24 vectors, a constant where these are inlined so that
   they stay in registers) and each row is one stream of loads. Each row's sum is the one it has read beside its
   input, to the bit: bf16 with `dot_rows`' eight accumulators in the same order, int8 in exact integers. Longer
   rows do not fit the registers; -DHELD_INPUT=0 builds without it, for an A/B (benchmarks/RESULTS.md). */
#ifndef HELD_INPUT
#define HELD_INPUT 1
#endif
#if defined(__AVX512BF16__)
#define GPN_HELD_BF16 1
static inline __attribute__((always_inline)) void held_bf16_rows(const gpn_segment *sg, i64 r0, i64 r1, const int N)
{
    __m512bh xv[24];
    for (int a = 0; a < N; a++) xv[a] = (__m512bh)_mm512_loadu_si512((const void *)(sg->xb + 32 * a));
    for (i64 r = r0; r < r1; r++) {
        const uint16_t *row = (const uint16_t *)sg->w + r * 32 * N;
        __m512 c0 = _mm512_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0;
        for (int a = 0; a < N; a += 8) {
            if (NEAR_PREFETCH)
                for (int j = 0; j < 8; j += 2) _mm_prefetch((const char *)(row + 32 * (a + j)) + NEAR_AHEAD, _MM_HINT_T1);
#define GPN_HELD(c, j) c = _mm512_dpbf16_ps(c, (__m512bh)_mm512_loadu_si512((const void *)(row + 32 * (a + j))), xv[a + j])
            GPN_HELD(c0, 0); GPN_HELD(c1, 1); GPN_HELD(c2, 2); GPN_HELD(c3, 3);
            GPN_HELD(c4, 4); GPN_HELD(c5, 5); GPN_HELD(c6, 6); GPN_HELD(c7, 7);
#undef GPN_HELD
        }
        const __m512 s = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(c0, c1), _mm512_add_ps(c2, c3)),
                                       _mm512_add_ps(_mm512_add_ps(c4, c5), _mm512_add_ps(c6, c7)));
        store_output(sg, 0, r, _mm512_reduce_add_ps(s));
    }
}
#endif
#if defined(GPN_VNNI)
#define GPN_HELD_INT8 1
static inline __attribute__((always_inline)) void held_int8_rows(const gpn_segment *sg, const gpn_quantized *q, i64 r0,
                                                                 i64 r1, const int N)
{
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512i vh[12], vl[12];
    for (int a = 0; a < N; a++) {
        vh[a] = _mm512_loadu_si512((const void *)(q->hi + 64 * a));
        vl[a] = _mm512_loadu_si512((const void *)(q->lo + 64 * a));
    }
    for (i64 r = r0; r < r1; r++) {
        const int8_t *row = (const int8_t *)sg->w + r * 64 * N;
        __m512i h0 = _mm512_setzero_si512(), h1 = h0, l0 = h0, l1 = h0;
        for (int a = 0; a < N; a += 2) {
            if (NEAR_PREFETCH) _mm_prefetch((const char *)row + 64 * a + NEAR_AHEAD, _MM_HINT_T1);
            const __m512i w0 = _mm512_xor_si512(_mm512_loadu_si512((const void *)(row + 64 * a)), flip);
            const __m512i w1 = _mm512_xor_si512(_mm512_loadu_si512((const void *)(row + 64 * a + 64)), flip);
            DPBUSD_HELD(h0, w0, vh[a]); DPBUSD_HELD(l0, w0, vl[a]);
            DPBUSD_HELD(h1, w1, vh[a + 1]); DPBUSD_HELD(l1, w1, vl[a + 1]);
        }
        int32_t four[4];
        _mm_storeu_si128((__m128i *)four, reduce4_epi32(h0, h1, l0, l1));
        store_output(sg, 0, r, vnni_dot(q, 0, four[0] + four[1], four[2] + four[3]));
    }
}
#endif

/* int8 rows in tiles of 16 (`tiles`, the plan's copy of the weights, `int8_tiles`): each 64-byte vector holds
   four consecutive weights of 16 rows, their top bits flipped, so one vpdpbusd against four of the input's bytes
   broadcast adds them into 16 rows' sums at once, each lane a row's. A row read on its own (`held_int8_rows`)
   ends in a reduction of its accumulators and a scalar store, as many instructions as its products where rows
   are 256 weights long; here no reduction is left, and 16 outputs are finished and stored as one vector. Four
   tiles (64 rows) share each broadcast. The sums are the held rows', exact integers, so the outputs are the same
   to the bit. -DTILED_INT8=0 builds without it, for an A/B (benchmarks/RESULTS.md). */
#ifndef TILED_INT8
#define TILED_INT8 1
#endif
#if defined(GPN_VNNI)
/* float_to_bf16_bits in 16 lanes (in the low half of each) */
static inline __m512i bf16_bits16(__m512 y)
{
    const __m512i u = _mm512_castps_si512(y);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i bits = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), 16);
    return _mm512_mask_mov_epi32(bits, _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
}

/* four bytes of an input plane in every lane (memcpy: the planes are bytes) */
static inline __m512i broadcast4(const int8_t *at)
{
    int32_t four;
    memcpy(&four, at, 4);
    return _mm512_set1_epi32(four);
}
#endif
#if defined(GPN_VNNI) && TILED_INT8
#define GPN_TILED_INT8 1

/* store_output for rows [r, r + n) (n <= 16) from their two planes' sums: `vnni_dot` and `store_output` in
   16 lanes, the same operations in the same order (the sum in int64, scaled in double, rounded to float) */
static inline void store_tile(const gpn_segment *sg, const gpn_quantized *q, i64 r, i64 n, __m512i h, __m512i l)
{
    const __mmask16 m = n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u);
    const __m512i flipped = _mm512_set1_epi64(256 * 128 * q->sum_hi[0] + 128 * q->sum_lo[0]);
    const __m512d unit = _mm512_set1_pd(q->unit[0]);
    __m256 half[2];
    for (int i = 0; i < 2; i++) {
        const __m512i hi = _mm512_cvtepi32_epi64(i ? _mm512_extracti64x4_epi64(h, 1) : _mm512_castsi512_si256(h));
        const __m512i lo = _mm512_cvtepi32_epi64(i ? _mm512_extracti64x4_epi64(l, 1) : _mm512_castsi512_si256(l));
        const __m512i v = _mm512_sub_epi64(_mm512_add_epi64(_mm512_slli_epi64(hi, 8), lo), flipped);
        half[i] = _mm512_cvtpd_ps(_mm512_mul_pd(_mm512_cvtepi64_pd(v), unit));
    }
    __m512 y = _mm512_insertf32x8(_mm512_castps256_ps512(half[0]), half[1], 1);
    if (sg->scale) y = _mm512_mul_ps(y, _mm512_maskz_loadu_ps(m, sg->scale + r));
    if (sg->bias && !(sg->flags & BIAS_AFTER_ROUND)) y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(m, sg->bias + r));
    if (sg->flags & ROUND_OUTPUT) y = _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits16(y), 16));
    if (sg->bias && (sg->flags & BIAS_AFTER_ROUND)) y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(m, sg->bias + r));
    if (sg->flags & STORE_BF16) _mm256_mask_storeu_epi16((uint16_t *)sg->out + r, m, _mm512_cvtepi32_epi16(bf16_bits16(y)));
    else _mm512_mask_storeu_ps((float *)sg->out + r, m, y);
}

/* rows [r0, r1) of an int8 segment with tiles at one batch row (r0 a multiple of 16). The accumulators are named
   variables, not arrays: GCC 12 keeps an array the inline assembly writes on the stack, a load and a store around
   every product. */
static void tiled_int8_rows(const gpn_segment *sg, const gpn_quantized *q, i64 r0, i64 r1)
{
    const i64 width = q->width, tile_bytes = 16 * width;
    const int8_t *xh = q->hi, *xl = q->lo;
    i64 r = r0;
    for (; r + 48 < r1; r += 64) {  /* four tiles, the last maybe partly past r1 */
        const uint8_t *t = sg->tiles + r / 16 * tile_bytes;
        __m512i h0 = _mm512_setzero_si512(), h1 = h0, h2 = h0, h3 = h0, l0 = h0, l1 = h0, l2 = h0, l3 = h0;
        for (i64 k = 0; k < width; k += 4) {
            const __m512i bh = broadcast4(xh + k), bl = broadcast4(xl + k);
            const uint8_t *at = t + 16 * k;
            const __m512i w0 = _mm512_loadu_si512((const void *)at);
            const __m512i w1 = _mm512_loadu_si512((const void *)(at + tile_bytes));
            const __m512i w2 = _mm512_loadu_si512((const void *)(at + 2 * tile_bytes));
            const __m512i w3 = _mm512_loadu_si512((const void *)(at + 3 * tile_bytes));
            DPBUSD_HELD(h0, w0, bh); DPBUSD_HELD(l0, w0, bl);
            DPBUSD_HELD(h1, w1, bh); DPBUSD_HELD(l1, w1, bl);
            DPBUSD_HELD(h2, w2, bh); DPBUSD_HELD(l2, w2, bl);
            DPBUSD_HELD(h3, w3, bh); DPBUSD_HELD(l3, w3, bl);
        }
        store_tile(sg, q, r, 16, h0, l0);
        store_tile(sg, q, r + 16, 16, h1, l1);
        store_tile(sg, q, r + 32, 16, h2, l2);
        store_tile(sg, q, r + 48, r1 - r - 48 < 16 ? r1 - r - 48 : 16, h3, l3);
    }
    for (; r < r1; r += 16) {
        const uint8_t *t = sg->tiles + r / 16 * tile_bytes;
        __m512i h0 = _mm512_setzero_si512(), l0 = h0;
        for (i64 k = 0; k < width; k += 4) {
            const __m512i w = _mm512_loadu_si512((const void *)(t + 16 * k));
            DPBUSD_HELD(h0, w, broadcast4(xh + k));
            DPBUSD_HELD(l0, w, broadcast4(xl + k));
        }
        store_tile(sg, q, r, r1 - r < 16 ? r1 - r : 16, h0, l0);
    }
}
#endif

/* int4 weights on the integer dot products (`int4_pack`'s tiles, above `int4_rows_float`): a 64-byte load holds 8
   weights of 16 rows, which an and and a shift split into two vectors of four weights of the 16 rows, each as
   int8's tiles hold them (`tiled_int8_rows`), so that the input, x = x_q 2^-sh in two signed byte planes
   (`quantize_input`), goes in as four bytes broadcast, four tiles sharing each broadcast. Each group's sum is an
   exact integer: sum u x_q - (8 + z) sum x_q = sum (q - z) x_q (|q - z| <= 15, groups of at most INT4_MAX_GROUP
   weights: within int32), then multiplied by the group's float32 scale into a float32 sum, y = 2^-sh sum_g s_g (...):
   the error against the products of the exact weights is the input's 16-bit rounding (as int8's) and float32's
   rounding of the groups' sum. The weights are read at 0.5 bytes each (with 4 bytes of scale per group, and 1 of
   offset where some zero point is not 0), against 2 for the bf16 matrix torchao's linear dequantizes. */
#if defined(GPN_VNNI)
#define GPN_INT4 1
/* 15 * 4096 * 32768 (|q - z|, the group, |x_q|) = 2.01e9 < 2^31: a longer group could wrap the int32 sums in silence */
enum { INT4_MAX_GROUP = 4096 };

/* the sums of x_q over each 8 elements of every batch row (`sums8`), once per input */
static void int4_sums8(gpn_quantized *q)
{
    if (q->sums8_ready) return;
    const i64 n = q->width / 8;
    for (i64 b = 0; b < q->B; b++)
        for (i64 j = 0; j < n; j++) {
            int32_t sum = 0;
            for (i64 k = 8 * j; k < 8 * j + 8; k++) sum += 256 * q->hi[b * q->width + k] + q->lo[b * q->width + k];
            q->sums8[b * n + j] = sum;
        }
    q->sums8_ready = 1;
}

/* store_output for rows [r, r + n) (n <= 16) of batch row b from their float sums */
static inline void int4_store(const gpn_segment *sg, i64 b, i64 r, i64 n, __m512 y)
{
    const __mmask16 m = n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u);
    if (sg->bias && !(sg->flags & BIAS_AFTER_ROUND)) y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(m, sg->bias + r));
    if (sg->flags & ROUND_OUTPUT) y = _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits16(y), 16));
    if (sg->bias && (sg->flags & BIAS_AFTER_ROUND)) y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(m, sg->bias + r));
    const i64 at = b * sg->out_stride + r;
    if (sg->flags & STORE_BF16) _mm256_mask_storeu_epi16((uint16_t *)sg->out + at, m, _mm512_cvtepi32_epi16(bf16_bits16(y)));
    else _mm512_mask_storeu_ps((float *)sg->out + at, m, y);
}

/* NT (1 or 4) tiles from row r (a multiple of 16) for batch row b; the offsets are read where the segment has them
   (else all 8: a branch per group, not a variant of the loop: each variant adds to every build's compile time). The
   accumulators are named variables (as `tiled_int8_rows`'). */
#define GPN_I4_ZERO(j) __m512i h##j = _mm512_setzero_si512(), l##j = h##j
#define GPN_I4_TILE(j) do { \
        const __m512i v = _mm512_loadu_si512((const void *)(at + (j) * tile_bytes)); \
        const __m512i w0 = _mm512_and_si512(v, nibble), w1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble); \
        DPBUSD_HELD(h##j, w0, bh0); DPBUSD_HELD(l##j, w0, bl0); \
        DPBUSD_HELD(h##j, w1, bh1); DPBUSD_HELD(l##j, w1, bl1); } while (0)
#define GPN_I4_GROUP(j) do { \
        const i64 gi = ((t0 + (j)) * ng + g) * 16; \
        const __m512i u = _mm512_add_epi32(_mm512_slli_epi32(h##j, 8), l##j); \
        const __m512i o = sg->offsets ? _mm512_mullo_epi32(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(sg->offsets + gi))), xg) : xg8; \
        y##j = _mm512_fmadd_ps(_mm512_loadu_ps(sg->scale + gi), _mm512_cvtepi32_ps(_mm512_sub_epi32(u, o)), y##j); } while (0)
static inline __attribute__((always_inline)) void int4_tiles(const gpn_segment *sg, const gpn_quantized *q, i64 b, i64 r,
                                                             i64 r1, const int NT)
{
    const i64 K = sg->cols, G = sg->group, ng = K / G, tile_bytes = 8 * K, t0 = r / 16;
    const int8_t *xh = q->hi + b * q->width, *xl = q->lo + b * q->width;
    const int32_t *s8 = q->sums8 + b * (q->width / 8);
    const uint8_t *base = (const uint8_t *)sg->w + t0 * tile_bytes;
    const __m512i nibble = _mm512_set1_epi8(0x0f);
    __m512 y0 = _mm512_setzero_ps(), y1 = y0, y2 = y0, y3 = y0;
    for (i64 g = 0; g < ng; g++) {
        GPN_I4_ZERO(0); GPN_I4_ZERO(1); GPN_I4_ZERO(2); GPN_I4_ZERO(3);
        int32_t xsum = 0;
        for (i64 k = g * G; k < g * G + G; k += 8) {
            xsum += s8[k / 8];
            const __m512i bh0 = broadcast4(xh + k), bl0 = broadcast4(xl + k);
            const __m512i bh1 = broadcast4(xh + k + 4), bl1 = broadcast4(xl + k + 4);
            const uint8_t *at = base + 8 * k;
            if (NEAR_PREFETCH) _mm_prefetch((const char *)at + NEAR_AHEAD, _MM_HINT_T1);
            GPN_I4_TILE(0);
            if (NT > 1) {
                if (NEAR_PREFETCH) {
                    _mm_prefetch((const char *)at + tile_bytes + NEAR_AHEAD, _MM_HINT_T1);
                    _mm_prefetch((const char *)at + 2 * tile_bytes + NEAR_AHEAD, _MM_HINT_T1);
                    _mm_prefetch((const char *)at + 3 * tile_bytes + NEAR_AHEAD, _MM_HINT_T1);
                }
                GPN_I4_TILE(1); GPN_I4_TILE(2); GPN_I4_TILE(3);
            }
        }
        const __m512i xg = _mm512_set1_epi32(xsum), xg8 = _mm512_set1_epi32(8 * xsum);
        GPN_I4_GROUP(0);
        if (NT > 1) { GPN_I4_GROUP(1); GPN_I4_GROUP(2); GPN_I4_GROUP(3); }
    }
    const __m512 unit = _mm512_set1_ps((float)q->unit[b]);
    int4_store(sg, b, r, r1 - r < 16 ? r1 - r : 16, _mm512_mul_ps(y0, unit));
    if (NT > 1) {
        int4_store(sg, b, r + 16, 16, _mm512_mul_ps(y1, unit));
        int4_store(sg, b, r + 32, 16, _mm512_mul_ps(y2, unit));
        int4_store(sg, b, r + 48, r1 - r - 48 < 16 ? r1 - r - 48 : 16, _mm512_mul_ps(y3, unit));
    }
}
#undef GPN_I4_ZERO
#undef GPN_I4_TILE
#undef GPN_I4_GROUP

enum { INT4_TILES = 4 };  /* tiles a pass: four share each broadcast */

#elif defined(GPN_MADD)
/* int4 weights on AVX2's byte multiply-adds: the same tiles, a 32-byte load holding 8 weights of 8 rows (half a
   tile's 16), split by an and and a shift as above, against the same two signed byte planes of the input (made from
   its 16 bits once per input, `int4_sums8`, as VNNI's `quantize_input` makes them). vpmaddubsw multiplies the
   unsigned weights by four bytes of a plane broadcast, into pairs of products (at most 2 x 15 x 128 in magnitude:
   never saturated), and vpmaddwd against ones adds each two pairs into the row's int32 lane: VNNI's vpdpbusd in two
   instructions, the same exact integers, then the same float32 epilogue a group at a time, so the outputs are
   VNNI's to the bit. Two tiles at a time (four halves of 8 rows) share each round's 4 broadcasts; more would spill
   their accumulators (16-bit and 32-bit, `INT4_STEPS16`) from AVX2's 16 registers. */
#define GPN_INT4 1
enum { INT4_MAX_GROUP = 4096 };  /* (as VNNI's: the same int32 sums) */
/* rounds of 8 weights a 16-bit lane sums before it is widened: each round adds two pairs of products, at most
   2 x 2 x 15 x 128 = 7,680 in magnitude, so four stay within int16 (30,720) and the sums stay exact.
   -DINT4_STEPS16=1 widens every round, for an A/B. */
#ifndef INT4_STEPS16
#define INT4_STEPS16 4
#endif

/* the planes of the 16-bit input and the sums of x_q over each 8 elements of every batch row, once per input */
static void int4_sums8(gpn_quantized *q)
{
    if (q->sums8_ready) return;
    const i64 K = q->K, width = q->width, n = width / 8;
    for (i64 b = 0; b < q->B; b++) {
        for (i64 k = 0; k < width; k++) {
            const int32_t x = k < K ? q->xq[b * K + k] : 0;
            const int32_t hi = (x + 128) >> 8;  /* (arithmetic: |x_q| <= 32,512, so hi and lo are signed bytes) */
            q->hi[b * width + k] = (int8_t)hi;
            q->lo[b * width + k] = (int8_t)(x - 256 * hi);
        }
        for (i64 j = 0; j < n; j++) {
            int32_t sum = 0;
            for (i64 k = 8 * j; k < 8 * j + 8 && k < K; k++) sum += q->xq[b * K + k];
            q->sums8[b * n + j] = sum;
        }
    }
    q->sums8_ready = 1;
}

static inline __m256i broadcast4(const int8_t *at)
{
    int32_t four;
    memcpy(&four, at, 4);
    return _mm256_set1_epi32(four);
}

/* NT (1 or 2) tiles from row r (a multiple of 16) for batch row b: the 8 rows of half h of tile t in lane order */
static inline __attribute__((always_inline)) void int4_tiles(const gpn_segment *sg, const gpn_quantized *q, i64 b, i64 r,
                                                             i64 r1, const int NT)
{
    const i64 K = sg->cols, G = sg->group, ng = K / G, tile_bytes = 8 * K, t0 = r / 16;
    const int8_t *xh = q->hi + b * q->width, *xl = q->lo + b * q->width;
    const int32_t *s8 = q->sums8 + b * (q->width / 8);
    const uint8_t *base = (const uint8_t *)sg->w + t0 * tile_bytes;
    const __m256i nibble = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    __m256 y[2][2];
    for (int t = 0; t < NT; t++) y[t][0] = y[t][1] = _mm256_setzero_ps();
    for (i64 g = 0; g < ng; g++) {
        __m256i h[2][2], l[2][2];
        for (int t = 0; t < NT; t++) h[t][0] = h[t][1] = l[t][0] = l[t][1] = _mm256_setzero_si256();
        int32_t xsum = 0;
        for (i64 chunk = g * G; chunk < g * G + G; chunk += 8 * INT4_STEPS16) {
            /* up to INT4_STEPS16 rounds of 8 weights summed in 16 bits, then widened once */
            __m256i h16[2][2], l16[2][2];
            for (int t = 0; t < NT; t++) h16[t][0] = h16[t][1] = l16[t][0] = l16[t][1] = _mm256_setzero_si256();
            const i64 end = chunk + 8 * INT4_STEPS16 < g * G + G ? chunk + 8 * INT4_STEPS16 : g * G + G;
            for (i64 k = chunk; k < end; k += 8) {
                xsum += s8[k / 8];
                const __m256i bh0 = broadcast4(xh + k), bl0 = broadcast4(xl + k);
                const __m256i bh1 = broadcast4(xh + k + 4), bl1 = broadcast4(xl + k + 4);
                const uint8_t *at = base + 8 * k;
                for (int t = 0; t < NT; t++) {
                    if (NEAR_PREFETCH) _mm_prefetch((const char *)at + t * tile_bytes + NEAR_AHEAD, _MM_HINT_T1);
                    for (int half = 0; half < 2; half++) {
                        const __m256i v = _mm256_loadu_si256((const __m256i *)(at + t * tile_bytes + 32 * half));
                        const __m256i w0 = _mm256_and_si256(v, nibble);
                        const __m256i w1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
                        h16[t][half] = _mm256_add_epi16(h16[t][half], _mm256_add_epi16(_mm256_maddubs_epi16(w0, bh0),
                                                                                        _mm256_maddubs_epi16(w1, bh1)));
                        l16[t][half] = _mm256_add_epi16(l16[t][half], _mm256_add_epi16(_mm256_maddubs_epi16(w0, bl0),
                                                                                        _mm256_maddubs_epi16(w1, bl1)));
                    }
                }
            }
            for (int t = 0; t < NT; t++)
                for (int half = 0; half < 2; half++) {
                    h[t][half] = _mm256_add_epi32(h[t][half], _mm256_madd_epi16(h16[t][half], ones));
                    l[t][half] = _mm256_add_epi32(l[t][half], _mm256_madd_epi16(l16[t][half], ones));
                }
        }
        const __m256i xg = _mm256_set1_epi32(xsum), xg8 = _mm256_set1_epi32(8 * xsum);
        for (int t = 0; t < NT; t++)
            for (int half = 0; half < 2; half++) {
                const i64 gi = ((t0 + t) * ng + g) * 16 + 8 * half;
                const __m256i u = _mm256_add_epi32(_mm256_slli_epi32(h[t][half], 8), l[t][half]);
                const __m256i o = sg->offsets
                    ? _mm256_mullo_epi32(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(sg->offsets + gi))), xg)
                    : xg8;
                y[t][half] = _mm256_fmadd_ps(_mm256_loadu_ps(sg->scale + gi), _mm256_cvtepi32_ps(_mm256_sub_epi32(u, o)),
                                             y[t][half]);
            }
    }
    const __m256 unit = _mm256_set1_ps((float)q->unit[b]);
    for (int t = 0; t < NT; t++)
        for (int half = 0; half < 2; half++) {
            const i64 first = r + 16 * t + 8 * half;
            float out[8];
            _mm256_storeu_ps(out, _mm256_mul_ps(y[t][half], unit));
            for (i64 i = 0; i < 8 && first + i < r1; i++) store_output(sg, b, first + i, out[i]);
        }
}

enum { INT4_TILES = 2 };
#endif

#ifdef GPN_INT4
/* rows [r0, r1) of an int4 segment (r0 a multiple of 16) for all B batch rows, on the quantized input: INT4_TILES
   tiles at a time, then one at a time */
static void int4_rows(const gpn_segment *sg, const gpn_quantized *q, i64 B, i64 r0, i64 r1)
{
    int4_sums8((gpn_quantized *)q);  /* (the calling thread's own) */
    for (i64 b = 0; b < B; b++) {
        i64 r = r0;
        for (; r + 16 * (INT4_TILES - 1) < r1; r += 16 * INT4_TILES) int4_tiles(sg, q, b, r, r1, INT4_TILES);
        for (; r < r1; r += 16) int4_tiles(sg, q, b, r, r1, 1);
    }
}
#endif

/* whether rows from r0 on of an int4 segment run the int4 products (else `int4_rows_float`; a finite input too) */
static int int4_products(const gpn_segment *sg, i64 B, i64 r0)
{
#ifdef GPN_INT4
    return sg->kind == KIND_I4 && B <= QUANTIZED_MAX_ROWS && sg->cols <= QUANTIZED_MAX_COLS && sg->group <= INT4_MAX_GROUP
           && r0 % 16 == 0;
#else
    (void)sg; (void)B; (void)r0;
    return 0;
#endif
}

/* whether rows from r0 on are read from their tiles (a task that begins inside a tile reads the rows) */
static int tiled_input(const gpn_segment *sg, i64 B, i64 r0)
{
#ifdef GPN_TILED_INT8
    return B == 1 && sg->kind == KIND_I8 && sg->tiles && r0 % 16 == 0;
#else
    (void)sg; (void)B; (void)r0;
    return 0;
#endif
}

static int held_input(const gpn_segment *sg, i64 B)
{
    if (!HELD_INPUT || B != 1 || (sg->flags & FAR_ROWS) || (sg->cols != 256 && sg->cols != 512 && sg->cols != 768))
        return 0;
#ifdef GPN_HELD_BF16
    if (sg->kind == KIND_BF16) return 1;
#endif
#ifdef GPN_HELD_INT8
    if (sg->kind == KIND_I8) return 1;
#endif
    return 0;
}

#ifdef GPN_QUANTIZED
/* rows [r0, r1) of an int8 segment for all B batch rows, on the quantized input (VNNI's or AVX2's products) */
static void quantized_rows(const gpn_segment *sg, const gpn_quantized *q, i64 B, i64 r0, i64 r1)
{
    const i64 K = sg->cols;
    const int8_t *w = (const int8_t *)sg->w;
#ifdef GPN_TILED_INT8
    if (tiled_input(sg, B, r0)) {
        tiled_int8_rows(sg, q, r0, r1);
        return;
    }
#endif
#ifdef GPN_HELD_INT8
    if (held_input(sg, B)) {
        if (K == 256) held_int8_rows(sg, q, r0, r1, 4);
        else if (K == 512) held_int8_rows(sg, q, r0, r1, 8);
        else held_int8_rows(sg, q, r0, r1, 12);
        return;
    }
#endif
    if (B == 1 && (sg->flags & STREAM_ROWS)) {
        const int far = (sg->flags & FAR_ROWS) != 0;
        for (i64 r = r0; r < r1; r++) store_output(sg, 0, r, quantized_row(w + r * K, q, K, far));
        return;
    }
    for (i64 b0 = 0; b0 < B; b0 += 4) {
        const int nb = (int)(B - b0 < 4 ? B - b0 : 4);
        for (i64 r = r0; r < r1; r += 4) {
            const i64 nr = r1 - r < 4 ? r1 - r : 4;
            const int8_t *rows[4];
            for (int i = 0; i < 4; i++) rows[i] = w + (r + (i < nr ? i : nr - 1)) * K;
            float sums[4][4];
            switch (nb) {  /* four weight rows against one or two batch rows, two against three or four */
                case 1: quantized_block(rows, 4, q, b0, 1, K, sums); break;
                case 2: quantized_block(rows, 4, q, b0, 2, K, sums); break;
                case 3: quantized_block(rows, 2, q, b0, 3, K, sums); quantized_block(rows + 2, 2, q, b0, 3, K, sums + 2); break;
                default: quantized_block(rows, 2, q, b0, 4, K, sums); quantized_block(rows + 2, 2, q, b0, 4, K, sums + 2); break;
            }
            for (i64 i = 0; i < nr; i++)
                for (int b = 0; b < nb; b++) store_output(sg, b0 + b, r + i, sums[i][b]);
        }
    }
}
#endif

/* Float rows this long and longer, streamed from DRAM at one batch row, are read two at a time (`dot_rows`; in the
   AVX2 build, the rows its quads leave over, `far_quads`): a row's weights and the input then overflow the L1
   together (16 KB each at 4,096 floats), so that a row at a time reads the input again from the L2 for every row,
   where a pair of rows reads it once. Shorter rows stream faster one at a time (benchmarks/RESULTS.md;
   -DPAIR_MIN_COLS=... for an A/B of builds). */
#ifndef PAIR_MIN_COLS
#define PAIR_MIN_COLS 4096
#endif
static int paired_rows(const gpn_segment *sg, i64 B)
{
#ifdef GPN_HAVE_DOT_ROW
    return B == 1 && sg->kind == KIND_F32 && (sg->flags & STREAM_ROWS) && sg->cols >= PAIR_MIN_COLS;
#else
    (void)sg; (void)B;
    return 0;
#endif
}

/* Whether segment_rows reads the rows of `sg` four at a time at B batch rows (the AVX2 build's `far_quads`) */
static int far_quads(const gpn_segment *sg, i64 B)
{
#ifdef GPN_FAR_QUADS
    return B == 1 && (sg->kind == KIND_F32 || sg->kind == KIND_BF16) && (sg->flags & FAR_ROWS);
#else
    (void)sg; (void)B;
    return 0;
#endif
}

static void segment_rows(const gpn_segment *sg, i64 B, i64 r0, i64 r1)
{
    const i64 K = sg->cols, es = weight_size(sg->kind);
    const char *w = (const char *)sg->w;
    if (sg->kind == KIND_I4) {
#ifdef GPN_INT4
        if (int4_products(sg, B, r0)) {
            const gpn_quantized *q = quantize_input(sg, B);
            if (q) { int4_rows(sg, q, B, r0, r1); return; }
        }
#endif
        int4_rows_float(sg, B, r0, r1);
        return;
    }
#ifdef GPN_QUANTIZED
    if (sg->kind == KIND_I8 && B <= QUANTIZED_MAX_ROWS && K <= QUANTIZED_MAX_COLS) {
        const gpn_quantized *q = quantize_input(sg, B);
        if (q) { quantized_rows(sg, q, B, r0, r1); return; }
    }
#endif
#ifdef GPN_HELD_BF16
    if (sg->kind == KIND_BF16 && held_input(sg, B)) {
        if (K == 256) held_bf16_rows(sg, r0, r1, 8);
        else if (K == 512) held_bf16_rows(sg, r0, r1, 16);
        else held_bf16_rows(sg, r0, r1, 24);
        return;
    }
#endif
#ifdef GPN_HAVE_DOT_ROW
    /* (int8 rows without VNNI convert as they go: four rows at a time hide that better while the weights sit in
       the L3; a row at a time streams better from DRAM, STREAM_ROWS) */
    if (B == 1 && (sg->kind != KIND_I8 || (sg->flags & STREAM_ROWS))) {
        const int far = (sg->flags & FAR_ROWS) != 0;
        i64 r = r0;
#ifdef GPN_FAR_QUADS
        if (far_quads(sg, B))  /* (the rows left over then go as below: each row's sum is the same either way) */
            for (; r + 4 <= r1; r += 4) {
                const void *rows[4] = {w + r * K * es, w + (r + 1) * K * es, w + (r + 2) * K * es, w + (r + 3) * K * es};
                float y[4];
                if (sg->kind == KIND_F32) dot_rows(rows, 4, KIND_F32, sg->x, sg->xb, K, 1, y);
                else dot_rows(rows, 4, KIND_BF16, sg->x, sg->xb, K, 1, y);
                for (int i = 0; i < 4; i++) store_output(sg, 0, r + i, y[i]);
            }
#endif
        if (paired_rows(sg, B))
            for (; r + 2 <= r1; r += 2) {
                const void *rows[2] = {w + r * K * es, w + (r + 1) * K * es};
                float y[2];
                if (far) dot_rows(rows, 2, KIND_F32, sg->x, sg->xb, K, 1, y);
                else dot_rows(rows, 2, KIND_F32, sg->x, sg->xb, K, 0, y);
                store_output(sg, 0, r, y[0]);
                store_output(sg, 0, r + 1, y[1]);
            }
        for (; r < r1; r++) {
            const void *row = w + r * K * es;
            float y;
            if (sg->kind == KIND_F32) y = far ? dot_row(row, KIND_F32, sg->x, sg->xb, K, 1) : dot_row(row, KIND_F32, sg->x, sg->xb, K, 0);
            else if (sg->kind == KIND_BF16) y = far ? dot_row(row, KIND_BF16, sg->x, sg->xb, K, 1) : dot_row(row, KIND_BF16, sg->x, sg->xb, K, 0);
            else y = dot_row(row, KIND_I8, sg->x, sg->xb, K, 0);
            store_output(sg, 0, r, y);
        }
        return;
    }
#endif
    for (i64 b0 = 0; b0 < B; b0 += 4) {
        const int nb = (int)(B - b0 < 4 ? B - b0 : 4);
        const float *xs[4];
        const uint16_t *xbs[4];
        for (int b = 0; b < 4; b++) {
            const i64 row = b0 + (b < nb ? b : nb - 1);
            xs[b] = sg->x + row * sg->x_stride;
            xbs[b] = sg->xb ? sg->xb + row * sg->x_stride : 0;
        }
        for (i64 r = r0; r < r1; r += 4) {
            const i64 nr = r1 - r < 4 ? r1 - r : 4;
            const void *rows[4];
            for (int i = 0; i < 4; i++) rows[i] = w + (r + (i < nr ? i : nr - 1)) * K * es;
            float sums[4][4];
#define GPN_DOT(KIND) switch (nb) { \
                case 1: dot_block(rows, KIND, xs, xbs, K, 1, sums); break; \
                case 2: dot_block(rows, KIND, xs, xbs, K, 2, sums); break; \
                case 3: dot_block(rows, KIND, xs, xbs, K, 3, sums); break; \
                default: dot_block(rows, KIND, xs, xbs, K, 4, sums); break; }
            if (sg->kind == KIND_F32) GPN_DOT(KIND_F32)
            else if (sg->kind == KIND_BF16) GPN_DOT(KIND_BF16)
            else GPN_DOT(KIND_I8)
#undef GPN_DOT
            for (i64 i = 0; i < nr; i++)
                for (int b = 0; b < nb; b++) store_output(sg, b0 + b, r + i, sums[i][b]);
        }
    }
}

/* Which thread ran each task of the last phases (`gpn_log_tasks`: NULL, or a log the tests read) */
static int *task_log;
void gpn_log_tasks(int *log) { task_log = log; }

static inline void run_task(const gpn_segment *segs, const i64 *tasks, i64 t, i64 B)
{
    segment_rows(&segs[tasks[3 * t]], B, tasks[3 * t + 1], tasks[3 * t + 2]);
    if (task_log) task_log[t] = omp_get_thread_num();
}

/* tasks: (segment, first row, end row) triples, run inside a parallel region. Weights that fit the L3 are read
   by the same thread at every step, each thread one contiguous run of a phase's tasks (static): two threads
   each reading their own half of a buffer near the L3's size read it up to 2-3x faster than with the halves
   swapped at every pass (benchmarks/l3_sharing.sh; at times no faster), so tasks that move between cores, as
   dynamic ones do from token to token, may read L3-sized weights at nearly DRAM's rate. A run rather than
   every other task: one stream of rows per thread, with which small's bf16 step and prefill were faster in 8
   of 9 A/Bs (int8 level: RESULTS.md). Weights streamed from DRAM have no such home: threads take their tasks
   in turn (dynamic), so a thread slowed by the machine's other tenants does fewer of them. (A plan marks all
   its segments alike, `_mark_streamed`; -DKEEP_L3_TASKS=0 gives every phase out in turn, for an A/B.) */
#ifndef KEEP_L3_TASKS
#define KEEP_L3_TASKS 1
#endif
static void run_tasks(const gpn_segment *segs, const i64 *tasks, i64 first, i64 end, i64 B)
{
#ifdef GPN_QUANTIZED
    quantized_input.x = 0;  /* (the inputs were written since the last phase) */
#endif
    if (KEEP_L3_TASKS && first < end && !(segs[tasks[3 * first]].flags & STREAM_ROWS)) {
        #pragma omp for schedule(static)
        for (i64 t = first; t < end; t++) run_task(segs, tasks, t, B);
    } else {
        #pragma omp for schedule(dynamic, 1)
        for (i64 t = first; t < end; t++) run_task(segs, tasks, t, B);
    }
}

/* `int8_tiles`: the int8 weight w (rows, cols) in tiles of 16 rows into `tiles` (ceil(rows / 16), width / 4, 16, 4),
   width = cols rounded up to 64; zero bytes, flipped, where rows or cols are padded. With AVX-512 a tile's 16 rows
   are read 64 bytes at a time and their 4-byte groups transposed in registers (16 x 16), as fast as the copy's
   bytes stream: a plan builds its tiles once per scope, before a prompt's first token. One thread: on a machine
   with other tenants a parallel region waits for its slowest thread, and this is a short copy. */
#ifdef GPN_AVX512
static inline void transpose16_epi32(__m512i r[16])
{
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {  /* [a0 b0 a1 b1 | ...], [a2 b2 a3 b3 | ...] in each 128-bit lane */
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {  /* u[i + j]: rows i..i+3 of columns j, 4 + j, 8 + j, 12 + j */
        u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int j = 0; j < 4; j++) {
        const __m512i a = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x88), b = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xdd);
        const __m512i c = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x88), d = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xdd);
        r[j] = _mm512_shuffle_i32x4(a, c, 0x88);
        r[8 + j] = _mm512_shuffle_i32x4(a, c, 0xdd);
        r[4 + j] = _mm512_shuffle_i32x4(b, d, 0x88);
        r[12 + j] = _mm512_shuffle_i32x4(b, d, 0xdd);
    }
}
#endif
void gpn_int8_tiles(const int8_t *w, i64 rows, i64 cols, uint8_t *tiles)
{
    const i64 width = (cols + 63) / 64 * 64, n_tiles = (rows + 15) / 16;
    for (i64 t = 0; t < n_tiles; t++) {
#ifdef GPN_AVX512
        const __m512i flip = _mm512_set1_epi8((char)0x80);
        for (i64 k = 0; k < width; k += 64) {
            const __mmask64 m = cols - k >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << (cols - k)) - 1);
            __m512i r[16];
            for (i64 i = 0; i < 16; i++)
                r[i] = 16 * t + i < rows ? _mm512_maskz_loadu_epi8(m, w + (16 * t + i) * cols + k) : _mm512_setzero_si512();
            transpose16_epi32(r);
            for (i64 j = 0; j < 16; j++)  /* four columns k + 4j .. of the 16 rows */
                _mm512_storeu_si512((void *)(tiles + 16 * (t * width + k) + 64 * j), _mm512_xor_si512(r[j], flip));
        }
#else
        for (i64 k = 0; k < width; k += 4)
            for (i64 i = 0; i < 16; i++) {
                const i64 r = 16 * t + i;
                uint8_t *to = tiles + (16 * (t * width + k) + 4 * i);
                for (i64 j = 0; j < 4; j++)
                    to[j] = (uint8_t)((r < rows && k + j < cols ? (uint8_t)w[r * cols + k + j] : 0) ^ 0x80u);
            }
#endif
    }
}

/* `int4_pack`: torchao's int4 values q (rows, cols) int8 in [-8, 7], one a byte, with a scale (float32) and a zero
   point z (int8; NULL: all 0) per group of `group` weights of a row (rows, cols / group), into the layout the int4
   products read (`int4_rows_float`): `tiles` (ceil(rows / 16), cols / 8, 64) bytes, `scales` (ceil(rows / 16),
   groups, 16) float32 and, with zero points, `offsets` (the same) int8 8 + z; padded rows hold 0 everywhere. cols a
   multiple of 8 and of `group`. Returns 0, or 1 where some q or z lies outside [-8, 7] (a value edited out of int4's
   range: nothing this layout holds; the caller keeps the dequantized matrix). With AVX-512 a tile's 16 rows are read
   64 values at a time and their 4-byte groups transposed in registers, as `int8_tiles`; one thread, as it. */
int gpn_int4_pack(const int8_t *q, const float *scale, const int8_t *zero, i64 rows, i64 cols, i64 group,
                  uint8_t *tiles, float *scales, int8_t *offsets)
{
    const i64 n_tiles = (rows + 15) / 16, ng = cols / group;
    int bad = 0;
    for (i64 t = 0; t < n_tiles; t++) {
        uint8_t *tile = tiles + t * 8 * cols;
#ifdef GPN_AVX512
        const __m512i eight = _mm512_set1_epi8(8), fifteen = _mm512_set1_epi8(15);
        for (i64 k = 0; k < cols; k += 64) {
            const __mmask64 m = cols - k >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << (cols - k)) - 1);
            __m512i r[16];
            for (i64 i = 0; i < 16; i++) {
                if (16 * t + i < rows) {
                    r[i] = _mm512_add_epi8(_mm512_maskz_loadu_epi8(m, q + (16 * t + i) * cols + k), eight);
                    bad |= _mm512_mask_cmpgt_epu8_mask(m, r[i], fifteen) != 0;
                    r[i] = _mm512_and_si512(r[i], _mm512_movm_epi8(m));
                } else {
                    r[i] = _mm512_setzero_si512();
                }
            }
            transpose16_epi32(r);  /* r[j]: columns k + 4j .. k + 4j + 3 of the 16 rows */
            for (i64 j = 0; j < 8 && k + 8 * j < cols; j++)
                _mm512_storeu_si512((void *)(tile + (k / 8 + j) * 64),
                                    _mm512_or_si512(r[2 * j], _mm512_slli_epi16(r[2 * j + 1], 4)));
        }
#else
        for (i64 k8 = 0; k8 < cols / 8; k8++)
            for (i64 i = 0; i < 16; i++)
                for (i64 j = 0; j < 4; j++) {
                    const i64 r = 16 * t + i;
                    int lo = 0, hi = 0;
                    if (r < rows) {
                        lo = q[r * cols + 8 * k8 + j] + 8;
                        hi = q[r * cols + 8 * k8 + 4 + j] + 8;
                        bad |= lo < 0 || lo > 15 || hi < 0 || hi > 15;
                    }
                    tile[k8 * 64 + 4 * i + j] = (uint8_t)((lo & 15) | (hi & 15) << 4);
                }
#endif
        for (i64 g = 0; g < ng; g++)
            for (i64 i = 0; i < 16; i++) {
                const i64 r = 16 * t + i, at = (t * ng + g) * 16 + i;
                scales[at] = r < rows ? scale[r * ng + g] : 0.f;
                if (offsets) {
                    const int z = r < rows ? zero[r * ng + g] : 0;
                    bad |= z < -8 || z > 7;
                    offsets[at] = (int8_t)(r < rows ? 8 + z : 0);
                }
            }
    }
    return bad;
}

/* One phase of products on its own (the logits of a few rows, and any product the fused step does not cover) */
void gpn_linear(const gpn_segment *segs, const i64 *tasks, i64 n_tasks, i64 B, int threads)
{
    #pragma omp parallel num_threads(threads)
    run_tasks(segs, tasks, 0, n_tasks, B);
}

/* Whether segment_rows reads the rows of `sg` two at a time at B batch rows (`paired_rows`; asked by the tests) */
int gpn_paired_rows(const gpn_segment *sg, i64 B) { return paired_rows(sg, B); }
/* Whether segment_rows reads the rows of `sg` four at a time at B batch rows (`far_quads`; asked by the tests) */
int gpn_far_quads(const gpn_segment *sg, i64 B) { return far_quads(sg, B); }
/* Whether segment_rows holds the input of `sg` in registers at B batch rows (`held_input`; asked by the tests) */
int gpn_held_input(const gpn_segment *sg, i64 B) { return held_input(sg, B); }
int gpn_tiled_input(const gpn_segment *sg, i64 B) { return tiled_input(sg, B, 0); }
/* Whether segment_rows runs the int4 products of `sg` at B batch rows (`int4_products`; asked by the tests) */
int gpn_int4_products(const gpn_segment *sg, i64 B) { return int4_products(sg, B, 0); }

/* The vector instructions the products were built for (`products_isa`: the bench says it, the tests ask it) */
const char *gpn_products_isa(void)
{
    return
#if defined(GPN_AVX512)
        "avx512"
#if defined(__AVX512BF16__)
        "+bf16"
#endif
#ifdef GPN_VNNI
        "+vnni"
#endif
#elif defined(GPN_AVX2)
        "avx2"
#else
        "portable"
#endif
        ;
}

/* A read of n floats at the rate the machine streams them (the byte limit's bandwidth); returns their sum */
float gpn_read_probe(const float *x, i64 n, int threads)
{
    float total = 0.f;
    #pragma omp parallel num_threads(threads) reduction(+:total)
    {
#ifdef GPN_AVX512
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        #pragma omp for schedule(static)
        for (i64 i = 0; i < n / 64; i++) {
            const float *p = x + i * 64;
            a0 = _mm512_add_ps(a0, _mm512_loadu_ps(p)); a1 = _mm512_add_ps(a1, _mm512_loadu_ps(p + 16));
            a2 = _mm512_add_ps(a2, _mm512_loadu_ps(p + 32)); a3 = _mm512_add_ps(a3, _mm512_loadu_ps(p + 48));
        }
        total += _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
#elif defined(GPN_AVX2)
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        #pragma omp for schedule(static)
        for (i64 i = 0; i < n / 64; i++) {
            const float *p = x + i * 64;
            a0 = _mm256_add_ps(a0, _mm256_add_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 32)));
            a1 = _mm256_add_ps(a1, _mm256_add_ps(_mm256_loadu_ps(p + 8), _mm256_loadu_ps(p + 40)));
            a2 = _mm256_add_ps(a2, _mm256_add_ps(_mm256_loadu_ps(p + 16), _mm256_loadu_ps(p + 48)));
            a3 = _mm256_add_ps(a3, _mm256_add_ps(_mm256_loadu_ps(p + 24), _mm256_loadu_ps(p + 56)));
        }
        total += sum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
#else
        float mine = 0.f;
        #pragma omp for schedule(static)
        for (i64 i = 0; i < n / 64; i++) {
            const float *p = x + i * 64;
            #pragma omp simd reduction(+:mine)
            for (int j = 0; j < 64; j++) mine += p[j];
        }
        total += mine;
#endif
    }
    for (i64 i = n / 64 * 64; i < n; i++) total += x[i];
    return total;
}

/* ---- the whole step at a small batch, in one call: one parallel region, its phases separated by the
   barriers of the work-sharing loops ---- */

typedef struct { float *x; float *xr; uint16_t *xb; i64 stride; } gpn_slot; /* an input of products, per batch row:
    exact, rounded to bf16 (as float) and its bf16 bits */
enum { SLOT_FG, SLOT_KEY, SLOT_WRITE, SLOT_GATE, SLOT_FFN, SLOT_READ, SLOT_HIDDEN, SLOT_GATED, SLOTS };

typedef struct {
    i64 B, d, f, H, dk, dv, L, memory, width_z, width_part;
    double eps;
    const gpn_segment *segs;
    const i64 *tasks;
    const i64 *phases;  /* task ranges [phases[2i], phases[2i+1]): fuse gate, carried key, layer 0 (with the
                           write), layer 0's output, then for each layer above: its projections, its output */
    const float *const *norms;  /* fuse gate, write, then per layer: gate, FFN, read, read output */
    const float *neg_decay;     /* -exp(A_log) */
    gpn_slot slots[SLOTS];
    float *zfg, *key0, *Z, *part, *y_ffn, *y_read;
    float *kq_raw, *kq, *kq_inv, *softplus, *decay_factor, *sig_beta, *error, *update, *read, *gamma;
} gpn_step_plan;

enum { CHUNK = 256 };  /* elements of a row an elementwise phase hands a thread at a time */
#ifndef GATE_EXP
#define GATE_EXP 1
#endif
/* e^x for the gates of the elementwise phases (about 4,300 a small token): Cephes' expf without calls or
   branches, so that a loop of them vectorises. x = n ln2 + r (|r| <= ln2/2, ln2 in two parts), e^r by its
   polynomial, then two exact scalings by powers of two (2^n alone leaves the exponent's range near both ends), the
   second rounding once into the subnormals or to infinity as expf does; within an ulp or two of expf, as torch's own
   vectorised exp is. The same fmaf's in every build and lane (C99 contracts nothing), so the scalar tail and the
   vector body agree to the bit. -DGATE_EXP=0 builds the gates on expf, for an A/B. */
static inline float gate_exp(float x)
{
#if GATE_EXP
    const float xc = x < -104.f ? -104.f : x > 89.f ? 89.f : x;  /* (beyond: 0 and infinity all the same; NaN stays) */
    union { float f; uint32_t u; } m, lo, hi;
    m.f = xc * 1.44269504088896341f + 12582912.f;               /* n = x / ln2 rounded, in the low bits */
    const float n = m.f - 12582912.f;
    const int32_t ni = (int32_t)(m.u - 0x4b400000u), n1 = ni / 2;
    float r = fmaf(n, -0.693359375f, xc);
    r = fmaf(n, 2.12194440e-4f, r);
    float q = 1.9875691500e-4f;
    q = fmaf(q, r, 1.3981999507e-3f);
    q = fmaf(q, r, 8.3334519073e-3f);
    q = fmaf(q, r, 4.1665795894e-2f);
    q = fmaf(q, r, 1.6666665459e-1f);
    q = fmaf(q, r, 5.0000001201e-1f);
    lo.u = (uint32_t)(n1 + 127) << 23;
    hi.u = (uint32_t)(ni - n1 + 127) << 23;
    return ((fmaf(q, r * r, r) + 1.f) * lo.f) * hi.f;
#else
    return expf(x);
#endif
}
static inline float sigmoidf_(float x) { return 1.f / (1.f + gate_exp(-x)); }
static inline float siluf_(float x) { return x / (1.f + gate_exp(-x)); }

/* The gates on their own (asked by the tests): sigmoid and silu of n floats, vectorised as the step's loops are */
void gpn_gates(const float *x, float *sigmoid, float *silu, i64 n)
{
    #pragma omp simd
    for (i64 j = 0; j < n; j++) { sigmoid[j] = sigmoidf_(x[j]); silu[j] = siluf_(x[j]); }
}

static float inv_rms(const float *x, i64 n, float eps)
{
    float sq = 0.f;
    #pragma omp simd reduction(+:sq)
    for (i64 j = 0; j < n; j++) sq += x[j] * x[j];
    return 1.f / sqrtf(sq / (float)n + eps);
}

/* one batch row of a slot, its three pointers taken out of the struct so that a loop writing them vectorises */
typedef struct { float *x, *xr; uint16_t *xb; } slot_row;
static inline slot_row row_of(const gpn_slot *s, i64 b)
{
    const i64 at = b * s->stride;
    return (slot_row){s->x + at, s->xr + at, s->xb + at};
}
static inline void put(slot_row s, i64 j, float v)
{
    const uint16_t h = float_to_bf16_bits(v);
    s.x[j] = v; s.xb[j] = h; s.xr[j] = bf16_bits_to_float(h);
}

/* slot = rms(x; n) for one batch row (x may be the slot's own exact row: each element is read before it is written) */
static void put_normed(const gpn_slot *s, i64 b, const float *x, i64 n, float inv, const float *w)
{
    const slot_row out = row_of(s, b);
    #pragma omp simd
    for (i64 j = 0; j < n; j++) put(out, j, x[j] * inv * w[j]);
}

/* One step, run by every thread of the enclosing parallel region (its phases end at the work-sharing
   loops' barriers). u's rows are u_stride floats apart; gamma's rows gamma_stride. */
static void step_body(const gpn_step_plan *P, const float *p, const float *g, const float *key_in, const float *M,
                      const float *u, i64 u_stride, float *p_out, float *g_out, float *key_out, float *M_out,
                      float *gamma, i64 gamma_stride)
{
    const i64 B = P->B, d = P->d, f = P->f, H = P->H, dk = P->dk, dv = P->dv, wz = P->width_z, wp = P->width_part;
    const float eps = (float)P->eps;
    const gpn_slot *S = P->slots;
    const i64 kw = H * dk, vw = H * dv, write = P->memory ? kw + vw + 2 * H : 0;
    (void)f;
    const i64 c_value = kw, c_beta = kw + vw, c_decay = kw + vw + H;       /* columns of Z */
    const i64 c_gate = 0, c_a = d, c_b = d + f, c_query = d + 2 * f, c_rg = d + 2 * f + kw; /* of a layer's part */
    const float *key = key_in ? key_in : P->key0;
    {
    /* ground: g = sigmoid(W_fg rms(p) + b_fg) p + u (and the key of the carried g, when not given) */
    #pragma omp for schedule(static)
    for (i64 b = 0; b < B; b++) {
        put_normed(&S[SLOT_FG], b, p + b * d, d, inv_rms(p + b * d, d, eps), P->norms[0]);
        if (!key_in) put_normed(&S[SLOT_KEY], b, g + b * d, d, inv_rms(g + b * d, d, eps), P->norms[1]);
    }
    run_tasks(P->segs, P->tasks, P->phases[0], key_in ? P->phases[1] : P->phases[3], B);
    #pragma omp for schedule(static)
    for (i64 b = 0; b < B; b++) {
        float *gr = g_out + b * d;
        #pragma omp simd
        for (i64 j = 0; j < d; j++) gr[j] = sigmoidf_(P->zfg[b * d + j]) * p[b * d + j] + u[b * u_stride + j];
        const float inv = inv_rms(gr, d, eps);
        if (P->memory) put_normed(&S[SLOT_WRITE], b, gr, d, inv, P->norms[1]);
        put_normed(&S[SLOT_GATE], b, gr, d, inv, P->norms[2]);
        put_normed(&S[SLOT_FFN], b, gr, d, inv, P->norms[3]);
        if (P->memory) put_normed(&S[SLOT_READ], b, gr, d, inv, P->norms[4]);
    }
    for (i64 l = 0; l < P->L; l++) {
        /* layer l's projections: layer 0's come with the write's, from g; the others' from the state */
        const float *part = l == 0 ? P->Z + write : P->part;
        const i64 ws = l == 0 ? wz : wp;
        const float *state = l == 0 ? g_out : p_out;
        if (l > 0) {
            #pragma omp for schedule(static)
            for (i64 b = 0; b < B; b++) {
                const float inv = inv_rms(p_out + b * d, d, eps);
                put_normed(&S[SLOT_GATE], b, p_out + b * d, d, inv, P->norms[2 + 4 * l]);
                put_normed(&S[SLOT_FFN], b, p_out + b * d, d, inv, P->norms[3 + 4 * l]);
                if (P->memory) put_normed(&S[SLOT_READ], b, p_out + b * d, d, inv, P->norms[4 + 4 * l]);
            }
        }
        run_tasks(P->segs, P->tasks, P->phases[4 * l + 4], P->phases[4 * l + 5], B);
        if (P->memory) {
            #pragma omp for schedule(static)
            for (i64 bh = 0; bh < B * H; bh++) {
                const i64 b = bh / H, h = bh % H;
                if (l == 0) {
                    const float *zrow = P->Z + b * wz;
                    memory_head(bh, dk, dv, key + b * kw + h * dk, part + b * ws + c_query + h * dk,
                                zrow + c_value + h * dv, zrow[c_beta + h], zrow[c_decay + h], P->neg_decay[h],
                                M + bh * dk * dv, M_out + bh * dk * dv, P->kq_raw, P->kq, P->kq_inv, P->softplus,
                                P->gamma, P->decay_factor, P->sig_beta, P->error, P->update, P->read);
                } else {  /* a layer above reads M' with its own query */
                    const float *qs = part + b * ws + c_query + h * dk;
                    float *q = P->kq + bh * 2 * dk + dk, sq = 0.f;  /* (the key-query scratch is free by now) */
                    for (i64 i = 0; i < dk; i++) { const float v = qs[i], x = (v > 0.f || v != v) ? v : 0.f; q[i] = x; sq += x * x; }
                    const float inv = 1.f / sqrtf(sq + 1e-12f);
                    float *restrict r = P->read + bh * dv;
                    const float *Mh = M_out + bh * dk * dv;
                    for (i64 j = 0; j < dv; j++) r[j] = 0.f;
                    for (i64 i = 0; i < dk; i++) {
                        const float qi = q[i] * inv, *row = Mh + i * dv;
                        #pragma omp simd
                        for (i64 j = 0; j < dv; j++) r[j] += qi * row[j];
                    }
                }
            }
        }
        /* the output products' inputs: [silu(a) b | silu(read gate) rms(read; n_ro)], in chunks of a row (at one
           or two rows a thread per row would leave the others waiting through thousands of exponentials) */
        const i64 cf = (f + CHUNK - 1) / CHUNK, cv = P->memory ? (vw + CHUNK - 1) / CHUNK : 0;
        #pragma omp for schedule(static)
        for (i64 t = 0; t < B * (cf + cv); t++) {
            const i64 b = t / (cf + cv), c = t % (cf + cv);
            const float *pr = part + b * ws;
            if (c < cf) {
                const slot_row h = row_of(&S[SLOT_HIDDEN], b);
                const i64 end = f < (c + 1) * CHUNK ? f : (c + 1) * CHUNK;
                #pragma omp simd
                for (i64 j = c * CHUNK; j < end; j++) put(h, j, siluf_(pr[c_a + j]) * pr[c_b + j]);
            } else {
                const float *r = P->read + b * vw, *n_ro = P->norms[5 + 4 * l];
                const float inv = inv_rms(r, vw, eps);  /* (the whole row's, in every chunk of it) */
                const slot_row gated = row_of(&S[SLOT_GATED], b);
                const i64 end = vw < (c - cf + 1) * CHUNK ? vw : (c - cf + 1) * CHUNK;
                #pragma omp simd
                for (i64 j = (c - cf) * CHUNK; j < end; j++) put(gated, j, siluf_(pr[c_rg + j]) * (r[j] * inv * n_ro[j]));
            }
        }
        run_tasks(P->segs, P->tasks, P->phases[4 * l + 6], P->phases[4 * l + 7], B);
        /* state' = sigmoid(W_pg rms(state) + b_pg) state + FFN (+ read), in chunks of a row */
        const i64 cd = (d + CHUNK - 1) / CHUNK;
        #pragma omp for schedule(static)
        for (i64 t = 0; t < B * cd; t++) {
            const i64 b = t / cd, c = t % cd;
            const float *pr = part + b * ws, *y_ffn = P->y_ffn + b * d, *y_read = P->y_read + b * d;
            const i64 end = d < (c + 1) * CHUNK ? d : (c + 1) * CHUNK;
            if (P->memory) {
                #pragma omp simd
                for (i64 j = c * CHUNK; j < end; j++)
                    p_out[b * d + j] = sigmoidf_(pr[c_gate + j]) * state[b * d + j] + y_ffn[j] + y_read[j];
            } else {
                #pragma omp simd
                for (i64 j = c * CHUNK; j < end; j++) p_out[b * d + j] = sigmoidf_(pr[c_gate + j]) * state[b * d + j] + y_ffn[j];
            }
        }
    }
    if (P->memory) {
        #pragma omp for schedule(static)
        for (i64 b = 0; b < B; b++) {
            for (i64 j = 0; j < kw; j++) key_out[b * kw + j] = P->Z[b * wz + j];
            if (gamma) for (i64 h = 0; h < H; h++) gamma[b * gamma_stride + h] = P->gamma[b * H + h];
        }
    }
    }
}

void gpn_step(const gpn_step_plan *P, const float *p, const float *g, const float *key_in, const float *M,
              const float *u, float *p_out, float *g_out, float *key_out, float *M_out, float *gamma, int threads)
{
    #pragma omp parallel num_threads(threads)
    step_body(P, p, g, key_in, M, u, P->d, p_out, g_out, key_out, M_out, gamma, P->H);
}

/* T steps of an unmasked window in one parallel region: the token inputs U (B, T, d), the predicted states
   into P_out (B, T, d) and gamma into gammas (B, T, H) (or NULL); the state alternates between two sets of
   buffers (p, g, key: (2, B, width); M: (2, B, H, dk, dv)), the last step's set holding the final state. */
void gpn_steps(const gpn_step_plan *P, i64 T, const float *p0, const float *g0, const float *key0, const float *M0,
               const float *U, float *P_out, float *gammas, float *p_buf, float *g_buf, float *key_buf, float *M_buf,
               int threads)
{
    const i64 B = P->B, d = P->d, kw = P->H * P->dk, cells = P->H * P->dk * P->dv;
    #pragma omp parallel num_threads(threads)
    for (i64 t = 0; t < T; t++) {
        const i64 now = t % 2, before = 1 - now;
        step_body(P, t ? p_buf + before * B * d : p0, t ? g_buf + before * B * d : g0,
                  t ? key_buf + before * B * kw : key0, t ? M_buf + before * B * cells : M0, U + t * d, T * d,
                  p_buf + now * B * d, g_buf + now * B * d, key_buf + now * B * kw, M_buf + now * B * cells,
                  gammas ? gammas + t * P->H : 0, T * P->H);
        #pragma omp for schedule(static)
        for (i64 b = 0; b < B; b++)
            for (i64 j = 0; j < d; j++) P_out[(b * T + t) * d + j] = p_buf[(now * B + b) * d + j];
    }
}

/* ---- a decoded token in one call: the token's embedding row and its input to the step, the step, then the
   decoder and the logits (what a decode step computes outside the step is a few small products and norms,
   which as separate calls cost more than their bytes). The outputs may be the inputs (the state advanced in
   place): the step reads p and g only while it grounds, before it writes either; the key only in layer 0's
   memory half, before the last phase writes the new one; and each head's M only in its own memory half, which
   writes M' element by element after reading M ---- */

typedef struct {
    i64 B, e, vocab, table_kind;  /* table: the embedding (vocab, e), float or bf16 bits (KIND_F32 / KIND_BF16) */
    const void *table;
    const float *fuse_norm, *decode_norm;  /* float32 copies of the two norms' weights (e and d wide) */
    const gpn_segment *segs;               /* the token projection, the decoder projection, the logits */
    const i64 *tasks;
    i64 phases[6];                         /* their task ranges */
    gpn_slot slots[3];                     /* their inputs: rms(E[x]) (e wide), rms(p') (d), the decoded (e) */
    float *u, *decoded;                    /* (B, d) token inputs, (B, e) decoder outputs */
} gpn_decode_plan;

/* hash: NULL, or (B, 2) residues that the ids are folded into, h = (h * base + id) mod modulus per column (the
   cache's fingerprint of what it read: two ops on a few numbers, which as torch calls cost more than a small
   step's norms); base, modulus < 2^31, so every product fits */
int gpn_decode(const gpn_step_plan *P, const gpn_decode_plan *D, const i64 *ids, const float *p, const float *g,
               const float *key_in, const float *M, float *p_out, float *g_out, float *key_out, float *M_out,
               i64 *hash, i64 base0, i64 base1, i64 modulus, int threads)
{
    const i64 B = D->B, e = D->e, d = P->d;
    const float eps = (float)P->eps;
    for (i64 b = 0; b < B; b++)
        if (ids[b] < 0 || ids[b] >= D->vocab) return 1;  /* (the caller checks them; never read outside the table) */
    if (hash)
        for (i64 b = 0; b < B; b++) {
            hash[2 * b] = (hash[2 * b] * base0 + ids[b]) % modulus;
            hash[2 * b + 1] = (hash[2 * b + 1] * base1 + ids[b]) % modulus;
        }
    #pragma omp parallel num_threads(threads)
    {
        /* u = W_fuse rms(E[x]) */
        #pragma omp for schedule(static)
        for (i64 b = 0; b < B; b++) {
            const gpn_slot *s = &D->slots[0];
            float *x = s->x + b * s->stride;  /* (the exact row, in place of the normed one until it is normed) */
            for (i64 j = 0; j < e; j++)
                x[j] = D->table_kind == KIND_BF16 ? bf16_bits_to_float(((const uint16_t *)D->table)[ids[b] * e + j])
                                                  : ((const float *)D->table)[ids[b] * e + j];
            const float inv = inv_rms(x, e, eps);
            put_normed(s, b, x, e, inv, D->fuse_norm);
        }
        run_tasks(D->segs, D->tasks, D->phases[0], D->phases[1], B);
        step_body(P, p, g, key_in, M, D->u, d, p_out, g_out, key_out, M_out, 0, P->H);
        /* decoded = W_dec rms(p') (+ b_dec), then its logits */
        #pragma omp for schedule(static)
        for (i64 b = 0; b < B; b++)
            put_normed(&D->slots[1], b, p_out + b * d, d, inv_rms(p_out + b * d, d, eps), D->decode_norm);
        run_tasks(D->segs, D->tasks, D->phases[2], D->phases[3], B);
        #pragma omp for schedule(static)
        for (i64 b = 0; b < B; b++) {
            const slot_row decoded = row_of(&D->slots[2], b);
            #pragma omp simd
            for (i64 j = 0; j < e; j++) put(decoded, j, D->decoded[b * e + j]);
        }
        run_tasks(D->segs, D->tasks, D->phases[4], D->phases[5], B);
    }
    return 0;
}

"""

_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c99"]
# What a compiler that refuses "-march=native" is asked instead, in turn: "-mcpu=native" (what gcc on aarch64 and
# older clang on arm64 take), then no CPU flag (a build for the target's baseline). "-fopenmp" has no stand-in:
# the kernels need OpenMP (Apple's clang has none: the torch ops run instead).
_NATIVE_FLAGS = ("-march=native", "-mcpu=native")
_OPENMP_PROBE = "#include <omp.h>\nint gpn_probe(void) { return omp_get_max_threads(); }\n"
_PLAIN_PROBE = "int gpn_probe(void) { return 0; }\n"
_SYMBOLS = (
    "gpn_memory_step",
    "gpn_memory_write_backward",
    "gpn_linear",
    "gpn_int8_tiles",
    "gpn_int4_pack",
    "gpn_paired_rows",
    "gpn_far_quads",
    "gpn_held_input",
    "gpn_tiled_input",
    "gpn_int4_products",
    "gpn_gates",
    "gpn_log_tasks",
    "gpn_step",
    "gpn_steps",
    "gpn_decode",
    "gpn_read_probe",
    "gpn_products_isa",
    "gpn_thread_buffers",
    "gpn_kernel_source_digest",
)
BUILD_TIMEOUT_S = 60.0  # default bound on one compiler run (`GPN_KERNEL_BUILD_TIMEOUT` overrides it)
_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_failure: str | None = None
calls: Counter = (
    Counter()
)  # kernel calls so far, by kernel (tests/backend_observer.py: a test of the kernels asserts they ran)


class KernelWarning(UserWarning):
    """The kernel cache held something damaged or foreign (rebuilt), or the kernels were turned off."""


class KernelRefusal(RuntimeError):
    """A kernel cannot take these arguments (or the kernels are unavailable); the torch ops can."""


class _CompilerFailed(RuntimeError):
    """The compiler exited with an error (the message holds the end of what it printed)."""


class _NoOpenMP(RuntimeError):
    """The compiler has no OpenMP (refuses -fopenmp or lacks omp.h), which the kernels need: like a missing
    compiler, the usual case on some platforms (macOS with Apple's clang), so the torch ops run without a warning."""


class _Untrusted(Exception):
    """A cached library (or its record) that must not be loaded; the message says why."""


def _source_digest() -> str:
    return hashlib.sha256(SOURCE.encode()).hexdigest()


def _kernel_text() -> str:
    """What is compiled: the kernels plus a function naming the digest of their source, checked after
    loading (a library with the right name and hash but built from other source is not used)."""
    return SOURCE + f'\nconst char *gpn_kernel_source_digest(void) {{ return "{_source_digest()}"; }}\n'


def _cpu_features() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.machine() + platform.processor()


def _warn(message: str) -> None:
    warnings.warn(f"GPN memory kernels: {message}", KernelWarning, stacklevel=3)


def _build_timeout() -> float:
    value = os.environ.get("GPN_KERNEL_BUILD_TIMEOUT")
    if value is None:
        return BUILD_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        _warn(f"GPN_KERNEL_BUILD_TIMEOUT={value!r} is not a positive number of seconds; using {BUILD_TIMEOUT_S:g}")
        return BUILD_TIMEOUT_S
    return seconds


# ---- the cache: only what this user built, checked before loading ----------------------------------------


def _problem_with_owner_and_mode(info: os.stat_result) -> str | None:
    """Why a file or folder with this status is not this user's alone (None: it is)."""
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        return f"is owned by uid {info.st_uid}, not by this user (uid {os.getuid()})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by group or others (mode {stat.filemode(info.st_mode)})"
    return None


def _private_folder() -> Path:
    """The cache folder, created private (0700) if missing; raises RuntimeError if it is someone else's."""
    folder = Path(os.environ.get("GPN_KERNEL_CACHE") or Path.home() / ".cache" / "gpn" / "kernels")
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = folder.stat()
    if not stat.S_ISDIR(info.st_mode):
        raise RuntimeError(f"the kernel cache {folder} is not a folder")
    problem = _problem_with_owner_and_mode(info)
    if problem is not None and hasattr(os, "getuid") and info.st_uid == os.getuid():
        # ours, but others may write to it (an old umask): tighten it; whatever they may have put there
        # is caught below (owner, mode and content hash of each file)
        _warn(f"the kernel cache {folder} {problem}; removing the group/other write permission")
        os.chmod(folder, stat.S_IMODE(info.st_mode) & ~(stat.S_IWGRP | stat.S_IWOTH))
        problem = _problem_with_owner_and_mode(folder.stat())
    if problem is not None:
        raise RuntimeError(
            f"the kernel cache {folder} {problem}: nothing is loaded from it (set GPN_KERNEL_CACHE to a "
            "folder of your own, or GPN_MEMORY_KERNELS=0)"
        )
    return folder


def _read_own_file(path: Path) -> bytes:
    """The content of `path`, which must be a regular file (not a symbolic link) of this user's that no one
    else may write to; checked on the opened file, so what is read is what was checked."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        if path.is_symlink():
            raise _Untrusted(f"{path.name} is a symbolic link")
        descriptor = os.open(path, flags)
    except FileNotFoundError:
        raise _Untrusted(f"{path.name} is missing") from None
    except OSError as error:  # ELOOP: a link slipped in after the check
        raise _Untrusted(f"{path.name} cannot be opened safely ({error})") from None
    with os.fdopen(descriptor, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise _Untrusted(f"{path.name} is not a regular file")
        problem = _problem_with_owner_and_mode(info)
        if problem is not None:
            raise _Untrusted(f"{path.name} {problem}")
        return handle.read()


def _library_name(key: str, content_hash: str) -> str:
    """A library's file name: the build key and its content hash. A build is never rewritten in place, and
    a rebuild gets a new name: the dynamic loader hands back whatever it once loaded under a name, so a
    rejected library must not share its name with the one replacing it."""
    return f"gpn_memory_{key}-{content_hash[:16]}.so"


def _load_verified(folder: Path, key: str) -> ctypes.CDLL:
    """Load the library the record `gpn_memory_{key}.sha256` names if it is this user's own build: its
    content hash equal to the record, the expected symbols and source digest present. Raises `_Untrusted`
    naming what is wrong."""
    expected = _read_own_file(folder / f"gpn_memory_{key}.sha256").decode("ascii", "replace").strip()
    if len(expected) != 64 or any(c not in "0123456789abcdef" for c in expected):
        raise _Untrusted(f"the record gpn_memory_{key}.sha256 is malformed")
    library = folder / _library_name(key, expected)
    if hashlib.sha256(_read_own_file(library)).hexdigest() != expected:
        raise _Untrusted(f"{library.name} does not match the hash recorded when it was built (damaged or replaced)")
    try:
        lib = ctypes.CDLL(str(library))
    except OSError as error:
        raise _Untrusted(f"{library.name} cannot be loaded ({error})") from None
    missing = [name for name in _SYMBOLS if not hasattr(lib, name)]
    if missing:
        raise _Untrusted(f"{library.name} lacks the symbols {', '.join(missing)}")
    lib.gpn_kernel_source_digest.restype = ctypes.c_char_p
    if lib.gpn_kernel_source_digest() != _source_digest().encode():
        raise _Untrusted(f"{library.name} was built from other source")
    i64, p, f = ctypes.c_longlong, ctypes.c_void_p, ctypes.c_float
    lib.gpn_memory_step.argtypes = [*[i64] * 4, p, *[i64] * 5, p, i64, p, f, p, p, *[p] * 11, ctypes.c_int]
    lib.gpn_memory_step.restype = None
    lib.gpn_memory_write_backward.argtypes = [*[i64] * 4, *[p] * 15, ctypes.c_int]
    lib.gpn_memory_write_backward.restype = None
    lib.gpn_linear.argtypes = [p, p, i64, i64, ctypes.c_int]
    lib.gpn_linear.restype = None
    lib.gpn_int8_tiles.argtypes = [p, i64, i64, p]
    lib.gpn_int8_tiles.restype = None
    lib.gpn_int4_pack.argtypes, lib.gpn_int4_pack.restype = [p, p, p, i64, i64, i64, p, p, p], ctypes.c_int
    lib.gpn_paired_rows.argtypes = [p, i64]
    lib.gpn_paired_rows.restype = ctypes.c_int
    lib.gpn_far_quads.argtypes = [p, i64]
    lib.gpn_far_quads.restype = ctypes.c_int
    lib.gpn_held_input.argtypes = [p, i64]
    lib.gpn_held_input.restype = ctypes.c_int
    lib.gpn_tiled_input.argtypes, lib.gpn_tiled_input.restype = [p, i64], ctypes.c_int
    lib.gpn_int4_products.argtypes, lib.gpn_int4_products.restype = [p, i64], ctypes.c_int
    lib.gpn_gates.argtypes, lib.gpn_gates.restype = [p, p, p, i64], None
    lib.gpn_thread_buffers.argtypes, lib.gpn_thread_buffers.restype = [], i64
    lib.gpn_log_tasks.argtypes, lib.gpn_log_tasks.restype = [p], None
    lib.gpn_step.argtypes = [*[p] * 11, ctypes.c_int]
    lib.gpn_step.restype = None
    lib.gpn_steps.argtypes = [p, i64, *[p] * 11, ctypes.c_int]
    lib.gpn_steps.restype = None
    lib.gpn_decode.argtypes = [*[p] * 12, i64, i64, i64, ctypes.c_int]
    lib.gpn_decode.restype = ctypes.c_int
    lib.gpn_read_probe.argtypes = [p, i64, ctypes.c_int]
    lib.gpn_read_probe.restype = f
    lib.gpn_products_isa.argtypes = []
    lib.gpn_products_isa.restype = ctypes.c_char_p
    return lib


def _remove_builds(folder: Path, key: str, keep: str | None = None) -> None:
    """Remove the libraries of this build key (links themselves, never what they point to) but `keep`."""
    for path in folder.glob(f"gpn_memory_{key}-*.so"):
        if path.name != keep:
            path.unlink(missing_ok=True)


@contextmanager
def _build_lock(folder: Path, name: str, timeout: float) -> Iterator[None]:
    """An exclusive lock on `folder/name` (POSIX; elsewhere no lock: the hash check still holds), waited for
    at most `timeout` seconds (a build holding it is itself bounded by the build timeout)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    descriptor = os.open(folder / name, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"another process held {folder / name} for over {timeout:g} s") from None
                time.sleep(0.05)
        yield
    finally:
        os.close(descriptor)  # releases the lock


def _run_compiler(command: list[str], timeout: float) -> None:
    """Run the compiler in its own process group; kill the whole group if it takes over `timeout` seconds."""
    process = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, errors = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (AttributeError, OSError):
            process.kill()
        process.wait()
        raise RuntimeError(
            f"{command[0]} did not finish within {timeout:g} s (GPN_KERNEL_BUILD_TIMEOUT); it was stopped"
        ) from None
    if process.returncode != 0:
        raise _CompilerFailed(f"{command[0]} exited with {process.returncode}: {errors.strip()[-2000:]}")


def _refuses(compiler: str, flag: str, source: str, folder: Path, timeout: float) -> str | None:
    """The first line of `compiler`'s error when it cannot build the tiny `source` into a shared library with
    `flag`, None when it can (asked only after a build failed: which flag, if any, is to blame)."""
    with tempfile.TemporaryDirectory(dir=folder, prefix=".probe-") as scratch:
        path = Path(scratch) / "probe.c"
        path.write_text(source, encoding="ascii")
        try:
            _run_compiler([compiler, flag, "-shared", "-fPIC", str(path), "-o", str(path.with_suffix(".so"))], timeout)
        except _CompilerFailed as failure:
            lines = str(failure).split(": ", 1)[-1].strip().splitlines()
            return lines[0] if lines else "no message"
    return None


def _flags_after_failure(compiler: str, flags: list[str], folder: Path, timeout: float) -> list[str] | None:
    """The flags to build with next after a build with `flags` failed: its CPU flag replaced by the next of
    `_NATIVE_FLAGS` (or dropped) where the compiler refuses it; None where no flag is to blame (the failure
    stands). Raises `_NoOpenMP` where the compiler refuses -fopenmp."""
    if "-fopenmp" in flags and (refusal := _refuses(compiler, "-fopenmp", _OPENMP_PROBE, folder, timeout)):
        raise _NoOpenMP(
            f"{compiler} has no OpenMP, which the kernels need ({refusal}); set CC to a compiler with OpenMP "
            "(gcc; on macOS Homebrew's gcc) to build them"
        )
    native = next((flag for flag in flags if flag in _NATIVE_FLAGS), None)
    if native is None or not _refuses(compiler, native, _PLAIN_PROBE, folder, timeout):
        return None
    following = _NATIVE_FLAGS[_NATIVE_FLAGS.index(native) + 1 :]
    return [following[0] if flag == native else flag for flag in flags if following or flag != native]


def _build(compiler: str, folder: Path, key: str, timeout: float, flags: list[str]) -> None:
    """Compile in a private temporary folder, then publish the library under its content-hash name and the
    record naming it (each fsynced, then renamed into place: no process ever sees a half-written file under
    a final name) and remove older builds of the same key."""
    record = folder / f"gpn_memory_{key}.sha256"
    with tempfile.TemporaryDirectory(dir=folder, prefix=".build-") as scratch:
        source = Path(scratch) / "gpn_memory.c"
        source.write_text(_kernel_text(), encoding="utf-8")
        built = Path(scratch) / "gpn_memory.so"
        _run_compiler([compiler, *flags, str(source), "-o", str(built)], timeout)
        os.chmod(built, stat.S_IMODE(built.stat().st_mode) & ~(stat.S_IWGRP | stat.S_IWOTH))
        content_hash = hashlib.sha256(built.read_bytes()).hexdigest()
        written = Path(scratch) / record.name
        written.write_text(content_hash + "\n", encoding="utf-8")
        os.chmod(written, 0o644)
        for path in (built, written):
            with open(path, "rb+") as handle:
                os.fsync(handle.fileno())
        library = _library_name(key, content_hash)
        os.replace(built, folder / library)
        os.replace(written, record)
    try:  # make the renames durable too (best effort: not every platform can fsync a folder)
        descriptor = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
    except OSError:
        pass
    _remove_builds(folder, key, keep=library)


def _compile(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The kernels: this user's verified cached build, or a fresh one (replacing anything damaged or foreign),
    compiled with `extra_flags` after the usual ones; where the compiler refuses -march=native, with
    -mcpu=native or no CPU flag instead (`_flags_after_failure`)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise FileNotFoundError("no C compiler (cc, gcc or $CC) found")
    timeout = _build_timeout()
    folder = _private_folder()
    flags = [*_FLAGS, *extra_flags]
    while True:
        try:
            return _compile_with(compiler, flags, folder, timeout)
        except _CompilerFailed:
            following = _flags_after_failure(compiler, flags, folder, timeout)
            if following is None:
                raise
            flags = following


def _compile_with(compiler: str, flags: list[str], folder: Path, timeout: float) -> ctypes.CDLL:
    """`_compile` with these flags: the cached build of their key, else a fresh one."""
    # -march=native (or -mcpu=native): the build is for this CPU, so the key names its features (a cache folder
    # shared between machines must not hand one machine's AVX-512 build to another)
    key = hashlib.sha256("\0".join([_kernel_text(), compiler, *flags, _cpu_features()]).encode()).hexdigest()[:16]
    with _build_lock(folder, f"gpn_memory_{key}.lock", timeout + 30):
        record = folder / f"gpn_memory_{key}.sha256"
        if os.path.lexists(record):
            try:
                return _load_verified(folder, key)
            except _Untrusted as problem:
                _warn(f"not loading the cached build in {folder}: {problem}; building it again")
                record.unlink(missing_ok=True)  # a link is removed, not what it points to
                _remove_builds(folder, key)
        _build(compiler, folder, key, timeout, flags)
        try:
            return _load_verified(folder, key)
        except _Untrusted as problem:  # e.g. a compiler that is not what it claims
            raise RuntimeError(f"the fresh build is unusable: {problem}") from None


def switched_off(name: str) -> bool:
    """Whether the environment sets the switch `name` to "0" (the kernels' switches are read at every call, so
    a test or an A/B run may flip one at any time).

    Several are read before every decoded token, just after the kernels streamed the weights through the
    caches: an unset name, the usual case, is answered by one lookup in the environment's own dict, without
    the KeyError that `os.environ.get` raises and catches inside, whose code and objects come from memory."""
    data = getattr(os.environ, "_data", None)  # (None: os.environ is not CPython's own mapping)
    if data is not None:
        key = _switch_keys.get(name)
        if key is None:
            key = _switch_keys[name] = os.environ.encodekey(name)
        if key not in data:
            return False
    return os.environ.get(name) == "0"


_switch_keys: dict = {}  # switch name -> its key in os.environ._data


def available() -> bool:
    """Whether the kernels are built (building them on first call) and enabled (`GPN_MEMORY_KERNELS` != 0).

    A failure (no compiler, a failed or timed-out build, an untrusted cache folder) is remembered for the
    process; all but a missing compiler are reported once with a `KernelWarning`."""
    global _library, _failure
    if switched_off("GPN_MEMORY_KERNELS"):
        return False
    if _library is not None:  # (built: no lock to take before every decoded token)
        return True
    with _lock:
        if _library is None and _failure is None:
            try:
                _library = _compile()
            except (FileNotFoundError, _NoOpenMP) as error:  # the usual case on many machines: no warning
                _failure = str(error)
            except (OSError, RuntimeError) as error:  # a failed build, an untrusted folder: say so once
                _failure = str(error)
                _warn(f"{error}; using the torch ops instead (GPN_MEMORY_KERNELS=0 turns the kernels off)")
        return _library is not None


def unavailable_reason() -> str | None:
    """Why `available()` is False (None when it is True or was not asked yet)."""
    if switched_off("GPN_MEMORY_KERNELS"):
        return "disabled by GPN_MEMORY_KERNELS=0"
    return _failure


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the kernels may be called at all: not under torch.compile (which traces the torch ops
    instead: a ctypes call cannot be traced), any `tensors` given float32 on the CPU (asked before the
    kernels are built: for GPU tensors nothing is ever compiled), and the kernels available. (Each kernel
    entry still checks all of its arguments and raises `KernelRefusal` where one does not fit.)"""
    if torch.compiler.is_compiling():
        return False
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors) and available()


# ---- argument checks: every tensor a kernel reads or writes ---------------------------------------------


def _refuse(problem: str) -> None:
    raise KernelRefusal(f"GPN memory kernel refused its arguments: {problem}")


def _check(t: torch.Tensor, name: str, shape: tuple | None = None, contiguous: bool = False) -> None:
    """`t` must be a float32 strided CPU tensor (of `shape`, contiguous if asked)."""
    if not isinstance(t, torch.Tensor):
        _refuse(f"{name} is a {type(t).__name__}, not a tensor")
    if not t.is_cpu or t.layout is not torch.strided:  # (attributes, not `t.device`: this runs every step)
        _refuse(f"{name} is a {t.layout} tensor on {t.device}; the kernels read strided CPU memory")
    if t.dtype is not torch.float32:
        _refuse(f"{name} is {t.dtype}; the kernels read float32")
    if shape is not None and t.shape != shape:
        _refuse(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    if contiguous and not t.is_contiguous():
        _refuse(f"{name} is not contiguous")


def _span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last) byte addresses `t` covers."""
    first = t.data_ptr()
    if t.is_contiguous():  # the common case, without the Python loop
        return first, first + t.numel() * t.element_size()
    if t.numel() == 0:
        return first, first
    extent = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) + 1
    return first, first + extent * t.element_size()


def _check_apart(output: torch.Tensor, name: str, inputs: dict) -> None:
    first, last = _span(output)
    for other_name, other in inputs.items():
        other_first, other_last = _span(other)
        if first < other_last and other_first < last:
            _refuse(f"{name} overlaps {other_name}")


def _require() -> None:
    """Refuse unless the kernels' library is loaded (built here when no caller asked `available()` first) and
    this is not a torch.compile trace. Cheap on purpose: the entries run every step, and the dispatcher
    (`fast_recurrence.memory_backend`, once per window) has asked `usable()`, whose environment read and
    build lock need not be paid again; reading `_library` without the lock is safe (it is set once, under it). So
    GPN_MEMORY_KERNELS=0 is read by that gate (and before the first build), not by each call. Every
    argument is still checked by the entry itself."""
    if torch.compiler.is_compiling() or (_library is None and not available()):
        _refuse(f"the kernels are unavailable ({unavailable_reason() or 'under torch.compile'})")


def memory_step(
    Z: torch.Tensor,
    columns: Columns,
    key: torch.Tensor,
    neg_decay_rate: torch.Tensor,
    memory: torch.Tensor,
    memory_out: torch.Tensor,
    rms_eps: float,
) -> MemoryStep:
    """The memory half of a step from its projections Z (B, N) (`recurrence_step.Columns` for where the
    value, beta, decay and query columns are), the carried key pre-activation (B, H*dk) and M (BH, dk, dv):
    writes M' into `memory_out` and returns the gates, layer 0's read and what backward needs.

    Raises `KernelRefusal` (reading nothing) unless every tensor is float32 on the CPU with the layout the
    kernel assumes: Z and key with unit column stride and the columns named, M and `memory_out` contiguous
    (BH, dk, dv) and apart, neg_decay_rate (H,)."""
    _require()
    _check(memory, "memory", contiguous=True)
    if memory.dim() != 3:
        _refuse(f"memory has shape {tuple(memory.shape)}, expected (rows * heads, dk, dv)")
    heads, dk, dv = memory.shape
    _check(Z, "Z")
    if Z.dim() != 2 or Z.shape[0] == 0 or heads % Z.shape[0] != 0:
        _refuse(f"Z has shape {tuple(Z.shape)}: expected (rows, columns) with rows dividing memory's {heads} heads")
    rows = Z.shape[0]
    H = heads // rows
    _check(key, "key")
    _check(neg_decay_rate, "neg_decay_rate", shape=(H,), contiguous=True)
    _check(memory_out, "memory_out", shape=memory.shape, contiguous=True)
    if Z.stride(1) != 1 or key.stride(1) != 1:
        _refuse("Z and key must have unit column stride")
    if tuple(key.shape) != (rows, H * dk):
        _refuse(f"key has shape {tuple(key.shape)}, expected {(rows, H * dk)}")
    query = columns.write + columns.query.start
    needed = {
        "value": (columns.value.start, H * dv),
        "beta": (columns.beta.start, H),
        "decay": (columns.decay.start, H),
        "query": (query, H * dk),
    }
    for name, (start, width) in needed.items():
        if start < 0 or start + width > Z.shape[1]:
            _refuse(f"the {name} columns [{start}, {start + width}) are not within Z's {Z.shape[1]} columns")
    _check_apart(memory_out, "memory_out", {"memory": memory, "Z": Z, "key": key, "neg_decay_rate": neg_decay_rate})
    empty = lambda *shape: memory.new_empty(shape)
    out = MemoryStep(
        empty(heads, 2, dk),
        empty(heads, 2, dk),
        empty(heads, 2, 1),
        empty(rows, H),
        empty(rows, H),
        empty(heads, 1),
        empty(heads, 1),
        empty(heads, dv),
        empty(heads, dv),
        empty(rows, H * dv),
        empty(rows, H * dv),
    )
    calls["memory_step"] += 1
    _library.gpn_memory_step(
        rows,
        H,
        dk,
        dv,
        Z.data_ptr(),
        Z.stride(0),
        columns.value.start,
        columns.beta.start,
        columns.decay.start,
        query,
        key.data_ptr(),
        key.stride(0),
        neg_decay_rate.data_ptr(),
        rms_eps,
        memory.data_ptr(),
        memory_out.data_ptr(),
        *(t.data_ptr() for t in out),
        torch.get_num_threads(),
    )
    return out


def memory_write_backward(
    memory_grad: torch.Tensor,
    memory: torch.Tensor,
    queries: torch.Tensor,
    read_grads: torch.Tensor,
    k: torch.Tensor,
    update: torch.Tensor,
    a: torch.Tensor,
    beta: torch.Tensor,
    memory_grad_out: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients through the write and the reads of M' (see the module docstring).

    memory_grad D = dL/dM' from later steps and memory M (BH, dk, dv); queries (L, BH, dk) and read_grads
    (L, BH, dv) of the L layers reading M'; k (BH, dk), update (BH, dv), a and beta (BH,) or (BH, 1).
    Writes dL/dM into `memory_grad_out` (contiguous, apart from every input); returns (d_update, d_k, d_a,
    dq of layer 0 (BH, dk), d_error). (The layers above need their dq before this runs, so they compute it.)

    Raises `KernelRefusal` (reading nothing) unless every tensor is float32 on the CPU of these shapes;
    inputs that are not contiguous are copied."""
    _require()
    _check(memory, "memory")
    if memory.dim() != 3:
        _refuse(f"memory has shape {tuple(memory.shape)}, expected (heads, dk, dv)")
    heads, dk, dv = memory.shape
    _check(queries, "queries")
    if queries.dim() != 3 or queries.shape[0] == 0:
        _refuse(f"queries has shape {tuple(queries.shape)}, expected (layers, {heads}, {dk})")
    layers = queries.shape[0]
    expected = {
        "memory_grad": (memory_grad, (heads, dk, dv)),
        "queries": (queries, (layers, heads, dk)),
        "read_grads": (read_grads, (layers, heads, dv)),
        "k": (k, (heads, dk)),
        "update": (update, (heads, dv)),
    }
    for name, (tensor, shape) in expected.items():
        _check(tensor, name, shape=shape)
    for name, tensor in (("a", a), ("beta", beta)):
        _check(tensor, name)
        if tensor.numel() != heads or (tensor.dim() == 2 and tensor.shape[1] != 1) or tensor.dim() > 2:
            _refuse(f"{name} has shape {tuple(tensor.shape)}, expected ({heads},) or ({heads}, 1)")
    _check(memory_grad_out, "memory_grad_out", shape=(heads, dk, dv), contiguous=True)
    inputs = dict(
        memory_grad=memory_grad,
        memory=memory,
        queries=queries,
        read_grads=read_grads,
        k=k,
        update=update,
        a=a,
        beta=beta,
    )
    _check_apart(memory_grad_out, "memory_grad_out", inputs)
    memory_grad, memory, queries, read_grads, k, update, a, beta = (t.contiguous() for t in inputs.values())
    d_update, d_error = memory.new_empty(heads, dv), memory.new_empty(heads, dv)
    d_k, d_a, dq = memory.new_empty(heads, dk), memory.new_empty(heads), memory.new_empty(heads, dk)
    scratch = memory.new_empty(heads * layers * (dk + 2))
    calls["memory_write_backward"] += 1
    _library.gpn_memory_write_backward(
        heads,
        dk,
        dv,
        layers,
        *(
            t.data_ptr()
            for t in (
                memory_grad,
                memory,
                memory_grad_out,
                queries,
                read_grads,
                k,
                update,
                a,
                beta,
                d_update,
                d_k,
                d_a,
                dq,
                d_error,
                scratch,
            )
        ),
        torch.get_num_threads(),
    )
    return d_update, d_k, d_a, dq, d_error


# ---- the step at a small batch: products at the bandwidth limit, and the whole step in one call ----------
#
# A step of 1-16 rows reads every weight once and does a few multiply-adds per weight, so it runs at the
# rate the weights stream from memory, unless the products do not keep up with it (torch's fp32 matvec
# reaches about a third of a plain read here) or the per-step work around them costs more than the
# products (a dozen small torch ops and their Python calls). `StepPlan` runs a whole step in one C call:
# the products read the modules' own weights in place (nn.Linear's (out, in) layout: float32, bfloat16 or
# torchao's int8 weight-only; nothing is folded, cast or copied; torchao's int4 values alone are packed, once per
# plan, `int4_pack`), each projection with its own RMS-norm weight applied to its input as the plain path does,
# and the elementwise work, the memory half and the reads between them, threads taking the products' row blocks
# in turn.

MAX_STEP_ROWS = 16  # the most batch rows the step kernel takes (more rows amortise the weight read in a matmul)
_TASK_BYTES = 1 << 18  # weight bytes per task of a product (threads take tasks in turn)
KIND_F32, KIND_BF16, KIND_I8, KIND_I4 = 0, 1, 2, 3
ROUND_OUTPUT, STORE_BF16, BIAS_AFTER_ROUND, STREAM_ROWS, FAR_ROWS = 1, 2, 4, 8, 16
_i64, _ptr = ctypes.c_longlong, ctypes.c_void_p


class _Segment(ctypes.Structure):  # gpn_segment
    _fields_ = [
        ("w", _ptr),
        ("scale", _ptr),
        ("bias", _ptr),
        ("x", _ptr),
        ("xb", _ptr),
        ("out", _ptr),
        ("rows", _i64),
        ("cols", _i64),
        ("x_stride", _i64),
        ("out_stride", _i64),
        ("kind", _i64),
        ("flags", _i64),
        ("tiles", _ptr),
        ("offsets", _ptr),
        ("group", _i64),
    ]


class _Slot(ctypes.Structure):  # gpn_slot
    _fields_ = [("x", _ptr), ("xr", _ptr), ("xb", _ptr), ("stride", _i64)]


_SLOT_NAMES = ("fg", "key", "write", "gate", "ffn", "read", "hidden", "gated")


class _Plan(ctypes.Structure):  # gpn_step_plan
    _fields_ = [(name, _i64) for name in ("B", "d", "f", "H", "dk", "dv", "L", "memory", "width_z", "width_part")]
    _fields_ += [
        ("eps", ctypes.c_double),
        ("segs", _ptr),
        ("tasks", _ptr),
        ("phases", _ptr),
        ("norms", _ptr),
        ("neg_decay", _ptr),
        ("slots", _Slot * len(_SLOT_NAMES)),
    ]
    _fields_ += [
        (name, _ptr)
        for name in (
            "zfg",
            "key0",
            "Z",
            "part",
            "y_ffn",
            "y_read",
            "kq_raw",
            "kq",
            "kq_inv",
            "softplus",
            "decay_factor",
            "sig_beta",
            "error",
            "update",
            "read",
            "gamma",
        )
    ]


class Operand(NamedTuple):
    """A linear map as the products read it: `kind` (KIND_F32, KIND_BF16, KIND_I8, KIND_I4), the weight (out, in)
    (int8 data for KIND_I8; for KIND_I4 the packed tiles of `int4_pack`, whose (out, in) is `dims`), its per-row
    float32 scale (int8; for int4 the groups' scales, packed), the float32 bias, whether its input and output are
    rounded to bfloat16 (bf16 weights; quantized weights of a bf16 model), as the module rounds, whether the bias is
    added after that rounding (a bias added outside the module), and for int4 the packed offsets (None: every zero
    point 0) and the weights of a group."""

    kind: int
    weight: torch.Tensor
    scale: torch.Tensor | None
    bias: torch.Tensor | None
    bf16_activations: bool
    bias_after_round: bool = False
    offsets: torch.Tensor | None = None
    group: int = 0
    dims: tuple[int, int] | None = None

    @property
    def shape(self) -> tuple[int, int]:
        """(out, in) of the linear map (the weight's shape, but for packed int4)."""
        return self.dims if self.dims is not None else tuple(self.weight.shape)


class Int4Packed(NamedTuple):
    """An int4 weight in the layout the int4 products read (`int4_pack`)."""

    tiles: torch.Tensor  # (ceil(out / 16), in / 8, 64) uint8: 8 weights of 16 rows a 64-byte vector, two a byte
    scales: torch.Tensor  # (ceil(out / 16), groups, 16) float32
    offsets: torch.Tensor | None  # the same, int8: 8 + each zero point (None: every zero point 0)


def int4_pack(parts: Int4Weight) -> Int4Packed | None:
    """`parts` (`recurrence_step.int4_weight_parts`) packed for the int4 products (the kernel's `int4_rows`): the
    values two a byte as q + 8, in tiles of 16 rows as int8's tiles hold four weights of 16 rows a vector (here 8,
    two vectors once the nibbles are split), the groups' scales in float32 (a bf16 model's are bf16: exact) and, where
    some zero point is not 0, 8 + each. None where some value or zero point lies outside int4's [-8, 7] (edited so:
    nothing the layout holds; the caller keeps the dequantized matrix). One pass over the values (`gpn_int4_pack`)."""
    _require()
    qdata = parts.qdata
    if qdata.dtype != torch.int8 or qdata.dim() != 2 or not qdata.is_cpu:
        _refuse(f"int4 values of {qdata.dtype} and shape {tuple(qdata.shape)}; expected an int8 CPU matrix")
    rows, cols = qdata.shape
    groups = cols // parts.group
    if cols % parts.group or parts.group % 8 or parts.scale.shape != (rows, groups):
        _refuse(f"int4 groups of {parts.group} weights do not fit a ({rows}, {cols}) weight and its scales")
    qdata = qdata.contiguous()
    scale = parts.scale.detach().float().contiguous()
    zero = parts.zero_point
    zero = zero.contiguous() if zero is not None and bool(zero.any()) else None
    n_tiles = -(-rows // 16)
    tiles = torch.empty(n_tiles, cols // 8, 64, dtype=torch.uint8)
    scales = torch.empty(n_tiles, groups, 16)
    offsets = torch.empty(n_tiles, groups, 16, dtype=torch.int8) if zero is not None else None
    outside = _library.gpn_int4_pack(
        qdata.data_ptr(),
        scale.data_ptr(),
        zero.data_ptr() if zero is not None else None,
        rows,
        cols,
        parts.group,
        tiles.data_ptr(),
        scales.data_ptr(),
        offsets.data_ptr() if offsets is not None else None,
    )
    return None if outside else Int4Packed(tiles, scales, offsets)


# why low-bit weights kept their dequantized matrix (`int4_operand`), by reason: counted at every operand made
# since the process began (the tests clear it before the call they look at)
int4_dequantized: Counter = Counter()


def int4_operand(weight: torch.Tensor) -> tuple[Int4Weight, Int4Packed] | None:
    """The parts of a low-bit weight (`dequantized_by_linear`) and their packing for the int4 products, or None where
    the int4 products do not take it (`int4_packing`), counted in `int4_dequantized` by reason: what the kernels'
    operands are made with."""
    operand, reason = int4_packing(weight)
    if operand is None:
        int4_dequantized[reason] += 1
    return operand


def int4_packing(weight: torch.Tensor) -> tuple[tuple[Int4Weight, Int4Packed] | None, str]:
    """The parts of a low-bit weight and their packing for the int4 products, or None and why they do not take it:
    not int4 values in groups they take (`int4_weight_parts`), products built without VNNI or AVX2 (the int4
    products run on their integer multiply-adds; without them the bf16 matrix is read faster), `GPN_INT4_KERNEL=0`
    (for A/B runs), or a value outside int4's range. Counts nothing (`int4_operand` does, for the operands made)."""
    parts = int4_weight_parts(weight)
    if parts is None:
        least, most = INT4_GROUPS
        return None, f"not int4 values in groups of a multiple of {least} weights (at most {most:,}) along the rows"
    if switched_off("GPN_INT4_KERNEL"):
        return None, "GPN_INT4_KERNEL=0"
    if not reads_int4():
        return None, f"the products were built for {products_isa()}: neither VNNI nor AVX2"
    with torch.no_grad():
        packed = int4_pack(parts)
    if packed is None:
        return None, "a value or zero point outside int4's [-8, 7]"
    return (parts, packed), ""


def operand_of(linear: torch.nn.Module, extra_bias: torch.Tensor | None = None) -> Operand:
    """The `Operand` of an nn.Linear whose weight is a plain float32 / bfloat16 CPU matrix, a torchao int8
    weight-only one (`recurrence_step.int8_weight_parts`) or a low-bit one its linear dequantizes
    (`recurrence_step.dequantized_by_linear`: int4 values packed for the int4 products where they take them,
    `int4_operand`, else the dequantized matrix; either made here and held by the operand); raises
    `KernelRefusal` for anything else. `extra_bias` is added to the module's own (float32; the decay's
    dt_bias)."""
    weight = linear.weight
    dims, offsets, group = None, None, 0
    if dequantized_by_linear(weight):
        int4 = int4_operand(weight)
        if int4 is None:
            with torch.no_grad():
                weight = weight.dequantize().contiguous()
    else:
        int4 = None
    parts = int8_weight_parts(weight) if int4 is None else None
    if int4 is not None:
        (parts4, packed), dims = int4, tuple(weight.shape)
        kind, matrix, scale, bf16 = KIND_I4, packed.tiles, packed.scales, parts4.dtype == torch.bfloat16
        offsets, group = packed.offsets, parts4.group
    elif parts is not None:
        data, scale = parts.qdata, parts.scale
        if not data.is_contiguous():
            _refuse("an int8 weight is not contiguous")
        _check(scale, "an int8 weight's scale")
        kind, matrix, scale, bf16 = KIND_I8, data, scale.contiguous(), parts.dtype == torch.bfloat16
    else:
        if type(weight) is not torch.nn.Parameter and type(weight) is not torch.Tensor:
            _refuse(f"a weight is a {type(weight).__name__}")
        if (
            weight.dtype not in (torch.float32, torch.bfloat16)
            or not weight.is_cpu
            or weight.layout is not torch.strided
        ):
            _refuse(f"a weight is a {weight.dtype} {weight.layout} tensor on {weight.device}")
        if weight.dim() != 2 or not weight.is_contiguous():
            _refuse("a weight is not a contiguous matrix")
        kind, matrix, scale = (KIND_F32 if weight.dtype == torch.float32 else KIND_BF16), weight.detach(), None
        bf16 = kind == KIND_BF16
    bias = None
    if getattr(linear, "bias", None) is not None:
        if extra_bias is not None:
            _refuse("a module with a bias of its own and one added after it")
        bias = linear.bias.detach().float().contiguous()
    elif extra_bias is not None:
        bias = extra_bias.detach().float().contiguous()
    rows, cols = dims if dims is not None else matrix.shape
    if bias is not None and (bias.shape != (rows,) or not bias.is_cpu):
        _refuse(f"a bias has shape {tuple(bias.shape)} for a ({rows}, {cols}) weight")
    return Operand(kind, matrix, scale, bias, bf16, extra_bias is not None, offsets, group, dims)


def _input_slot(rows: int, width: int) -> dict:
    """An input of products for `rows` batch rows: exact, rounded to bf16 (as float32) and its bf16 bits."""
    return {
        "x": torch.zeros(rows, width),
        "xr": torch.zeros(rows, width),
        "xb": torch.zeros(rows, width, dtype=torch.int16),
    }


def _segment(op: Operand, slot: dict, out: torch.Tensor, column: int, store_bf16: bool = False) -> _Segment:
    """The products of `op` on `slot`'s rows into columns [column, column + out rows) of `out` (B, width)."""
    rows, cols = op.shape
    if slot["x"].shape[1] != cols:
        _refuse(f"a ({rows}, {cols}) weight meets an input of width {slot['x'].shape[1]}")
    if out.dim() != 2 or column + rows > out.shape[1] or not out.is_contiguous():
        _refuse("a product's output does not fit its buffer")
    x = (
        slot["x"]
        if (op.kind == KIND_F32 or (op.kind in (KIND_I8, KIND_I4) and not op.bf16_activations))
        else slot["xr"]
    )
    flags = (ROUND_OUTPUT if op.bf16_activations else 0) | (STORE_BF16 if store_bf16 else 0)
    flags |= BIAS_AFTER_ROUND if op.bias_after_round else 0
    return _Segment(
        op.weight.data_ptr(),
        op.scale.data_ptr() if op.scale is not None else None,
        op.bias.data_ptr() if op.bias is not None else None,
        x.data_ptr(),
        slot["xb"].data_ptr(),
        out.data_ptr() + column * out.element_size(),
        rows,
        cols,
        cols,
        out.shape[1],
        op.kind,
        flags,
        offsets=op.offsets.data_ptr() if op.offsets is not None else None,
        group=op.group,
    )


def _last_level_cache_bytes() -> int:
    """The L3's size as Linux reports it for CPU 0 (32 MB where none is reported)."""
    try:
        text = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text(encoding="utf-8").strip()
        return int(text[:-1]) * {"K": 1 << 10, "M": 1 << 20}[text[-1]] if text[-1] in "KM" else int(text)
    except (OSError, ValueError, IndexError):
        return 32 << 20


FAR_BEYOND_L3 = 2  # weights this many times the L3 are read from DRAM nearly all (`FAR_ROWS`)


def _mark_streamed(segments: list, weights: list[torch.Tensor]) -> None:
    """A plan whose weights do not fit the L3 reads them from DRAM at every step: its int8 products take a row at
    a time (`STREAM_ROWS`), which streams better, and its weights go onto huge pages (`advise_huge_pages`); one
    that fits reads them from the L3, where four rows at a time share each load of the input (and, without
    VNNI, hide the conversion to float better). Weights of more
    than `FAR_BEYOND_L3` times the L3 have their rows prefetched ahead too (`FAR_ROWS`: it speeds up reads
    from DRAM, and slows a plan a little beyond the L3, much of which is still read from there)."""
    if huge_pages_if_streamed(weights):
        far = _storage_bytes(weights) > FAR_BEYOND_L3 * _last_level_cache_bytes()
        for segment in segments:
            segment.flags |= STREAM_ROWS | (FAR_ROWS if far else 0)


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    """The bytes of `tensors`' storage, each distinct storage counted once."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def huge_pages_if_streamed(tensors: list[torch.Tensor]) -> bool:
    """Put `tensors` onto huge pages (`advise_huge_pages`) if together (distinct storage counted once) they exceed
    the L3, so that a pass over them every step reads DRAM; returns whether they do. The read probe of a byte
    limit calls it too, so the limit's bytes sit on the pages the weights sit on."""
    if _storage_bytes(tensors) <= _last_level_cache_bytes():
        return False
    advise_huge_pages(tensors)
    return True


_MADV_HUGEPAGE, _MADV_COLLAPSE, _HUGE_PAGE = 14, 25, 2 << 20


def huge_pages_enabled() -> bool:
    """Whether weights streamed from DRAM go onto huge pages (`GPN_HUGE_PAGES=0` turns it off, for A/B runs)."""
    return not switched_off("GPN_HUGE_PAGES")


_madvise_function: list = []  # [libc's madvise, or None], found on first use


def _madvise():
    """libc's `madvise` where Linux offers 2 MB transparent huge pages (not switched off), else None."""
    if not _madvise_function:
        function = None
        try:
            thp = Path("/sys/kernel/mm/transparent_hugepage")
            if (
                "[never]" not in (thp / "enabled").read_text(encoding="utf-8")
                and int((thp / "hpage_pmd_size").read_text(encoding="utf-8")) == _HUGE_PAGE
            ):
                function = ctypes.CDLL(None, use_errno=True).madvise
                function.argtypes, function.restype = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int
        except (OSError, ValueError, AttributeError):
            function = None
        _madvise_function.append(function)
    return _madvise_function[0]


def advise_huge_pages(tensors: list[torch.Tensor]) -> int:
    """Put the whole 2 MB pages inside each CPU tensor's storage onto transparent huge pages, in place: advised
    (`MADV_HUGEPAGE`) and collapsed now (`MADV_COLLAPSE`: the kernel copies each into a huge page at the same
    address; contents, addresses and memory use unchanged; about a millisecond per 2 MB once, nothing when done).
    On 4 KB pages a pass over the weights meets a TLB miss and a stop of the hardware prefetcher every 4 KB. Advice
    only: where Linux refuses (no THP, no free huge page, an older kernel) the pages stay as they are. Returns the
    bytes advised."""
    madvise = _madvise()
    if madvise is None or not huge_pages_enabled():
        return 0
    advised = 0
    for tensor in tensors:
        if tensor.device.type != "cpu" or tensor.numel() == 0:
            continue
        storage = tensor.untyped_storage()
        first = -(-storage.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE
        last = (storage.data_ptr() + storage.nbytes()) // _HUGE_PAGE * _HUGE_PAGE
        if last - first >= _HUGE_PAGE and madvise(first, last - first, _MADV_HUGEPAGE) == 0:
            madvise(first, last - first, _MADV_COLLAPSE)  # (refused: they are collapsed later, or never)
            advised += last - first
    return advised


def _tasks(segments: list, first_segment: int, count: int) -> list:
    """(segment, first row, end row) triples that cut segments [first_segment, +count) into row blocks of
    about `_TASK_BYTES` of weights (multiples of 16 rows: the kernels' blocks of 4 rows, and the tiles of int8
    weights, `int8_tiles`, which a task must begin at the start of)."""
    triples = []
    for index in range(first_segment, first_segment + count):
        seg = segments[index]
        size = {KIND_F32: 4, KIND_BF16: 2, KIND_I8: 1, KIND_I4: 0.5}[seg.kind]
        block = max(16, int(_TASK_BYTES // max(1, seg.cols * size)) // 16 * 16)
        triples += [(index, r, min(r + block, seg.rows)) for r in range(0, seg.rows, block)]
    return triples


def int8_tiles(weight: torch.Tensor) -> torch.Tensor:
    """A contiguous int8 CPU weight (rows, cols) as the tiled products read it (the kernel's `tiled_int8_rows`):
    tiles of 16 rows, each a run of 64-byte vectors holding four consecutive weights of its 16 rows, the weights'
    top bits flipped (VNNI multiplies unsigned bytes by signed ones); rows padded to a multiple of 16 and columns
    to one of 64 (the input's planes are zero there). Returns (ceil(rows / 16), width / 4, 16, 4) uint8."""
    _require()
    if weight.dtype != torch.int8 or weight.dim() != 2 or not weight.is_contiguous() or not weight.is_cpu:
        _refuse(f"a {weight.dtype} weight of shape {tuple(weight.shape)}; expected a contiguous int8 CPU matrix")
    rows, cols = weight.shape
    tiles = torch.empty(-(-rows // 16), -(-cols // 64) * 16, 16, 4, dtype=torch.uint8)
    _library.gpn_int8_tiles(weight.data_ptr(), rows, cols, tiles.data_ptr())
    return tiles


def _tile_int8(segments: list[_Segment], weights: list[torch.Tensor], rows: int) -> list[torch.Tensor]:
    """Give the int8 products of a plan at one batch row whose weights sit in the L3 (not `STREAM_ROWS`) their
    weights in tiles (`int8_tiles`), where the kernels' int8 products run on VNNI; returns the tiles, which the
    plan keeps. A weight read by two products is tiled once. The copy doubles those weights' memory (the model
    keeps its own), at most the L3's size, and lives as long as the plan (one derived-weights scope).
    `segments`: the plan's `_Segment`s (the elements of the array the kernels read are written in place)."""
    if rows != 1 or "+vnni" not in products_isa():
        return []
    made: dict[int, torch.Tensor] = {}
    for segment, weight in zip(segments, weights):
        if segment.kind == KIND_I8 and not segment.flags & STREAM_ROWS:
            tiles = made.get(weight.data_ptr())
            if tiles is None:
                tiles = made[weight.data_ptr()] = int8_tiles(weight)
            segment.tiles = tiles.data_ptr()
    return list(made.values())


TILE_AFTER_STEPS = 128  # a plan tiles its int8 weights once it has run, or is about to run, this many steps


class _LazyTiles:
    """A plan's int8 tiles (`_tile_int8`), built once the plan has run `TILE_AFTER_STEPS` steps or is about to:
    building them costs about what a few steps cost, and each step then saves a little, so a short prompt
    forwarded once (a plan lives one derived-weights scope) is better off without them, and a long prompt or a
    generation is not. A decode plan adds its products to its step plan's (`add`): one count of steps."""

    __slots__ = ("parts", "rows", "steps", "tiles")

    def __init__(self, segments: list[_Segment], weights: list[torch.Tensor], rows: int):
        self.parts, self.rows, self.steps, self.tiles = [(segments, weights)], rows, 0, None

    def add(self, segments: list[_Segment], weights: list[torch.Tensor]) -> None:
        """Products of another plan that runs with this one (tiled at once if this one's are)."""
        self.parts.append((segments, weights))
        if self.tiles is not None:
            self.tiles += _tile_int8(segments, weights, self.rows)

    def count(self, steps: int) -> None:
        """Note `steps` steps about to run (the tiles are built first when they reach `TILE_AFTER_STEPS`)."""
        self.steps += steps
        if self.tiles is None and self.steps >= TILE_AFTER_STEPS:
            self.tiles = [tile for segments, weights in self.parts for tile in _tile_int8(segments, weights, self.rows)]


class StepPlan:
    """A model's step at `rows` batch rows in one C call (`gpn_step`), on the modules' own weights.

    Built once per derived-weights scope (`derived_weights.py`: one forward or generate() call, or the
    calls continuing one cache): it holds pointers to the weights, float32 copies of the norm weights and
    biases, and its workspace. Raises `KernelRefusal` for a model whose step it cannot take (a weight
    `operand_of` does not take, sizes the kernel does not assume, the kernels unavailable); `step` refuses
    state tensors that do not fit (the dispatcher then runs the torch ops)."""

    def __init__(self, model: torch.nn.Module, rows: int):
        _require()
        if not 1 <= rows <= MAX_STEP_ROWS:
            _refuse(f"{rows} rows; the step kernel takes 1 to {MAX_STEP_ROWS}")
        config = model.config
        self.rows = B = rows
        self.memory = bool(config.use_memory)
        d, f, L = config.hidden_size, config.intermediate_size, config.num_predict_layers
        H, dk, dv = (
            (config.num_memory_heads, config.memory_key_dim, config.memory_value_dim) if self.memory else (0, 0, 0)
        )
        self.sizes = (d, f, H, dk, dv, L)
        kw, vw = H * dk, H * dv
        write = kw + vw + 2 * H if self.memory else 0
        width_part = d + 2 * f + (kw + vw if self.memory else 0)
        keep = []  # every tensor a pointer of the plan points into
        slots = {name: _input_slot(B, width) for name, width in zip(_SLOT_NAMES, (d, d, d, d, d, d, f, max(vw, 1)))}
        zeros = lambda *shape: torch.zeros(*shape)
        buffers = {
            "zfg": zeros(B, d),
            "key0": zeros(B, max(kw, 1)),
            "Z": zeros(B, write + width_part),
            "part": zeros(B, width_part),
            "y_ffn": zeros(B, d),
            "y_read": zeros(B, d),
            "kq_raw": zeros(B * H, 2, dk),
            "kq": zeros(B * H, 2, dk),
            "kq_inv": zeros(B * H, 2),
            "softplus": zeros(B * H),
            "decay_factor": zeros(B * H),
            "sig_beta": zeros(B * H),
            "error": zeros(B * H, dv),
            "update": zeros(B * H, dv),
            "read": zeros(B, max(vw, 1)),
            "gamma": zeros(max(B * H, 1)),
        }
        segments, phases = [], []

        def phase(*parts) -> None:  # parts: (operand, slot name, output buffer name or tensor, column)
            first = len(segments)
            for op, slot, out, column in parts:
                keep.append(op)
                segments.append(_segment(op, slots[slot], buffers[out] if isinstance(out, str) else out, column))
            phases.append((first, len(parts)))

        def sized(module: torch.nn.Linear, rows: int, extra_bias: torch.Tensor | None = None) -> Operand:
            # (a replaced weight of another shape would run into its neighbours' columns, or leave some unwritten:
            # the plain loop raises on it, so the plan refuses it and the torch ops raise as the plain loop does)
            op = operand_of(module, extra_bias=extra_bias)
            if op.shape[0] != rows:
                _refuse(f"a weight of shape {tuple(op.shape)} where the config makes {rows} outputs")
            return op

        layers, write_module = list(model.predict_layers), model.memory_write
        norms = [model.fuse_gate_norm.weight, write_module.norm.weight if self.memory else model.fuse_gate_norm.weight]
        phase((sized(model.fuse_gate, d), "fg", "zfg", 0))
        # (one operand for the key, read by two products: a low-bit weight is packed or dequantized once per plan)
        key_op = sized(write_module.key, kw) if self.memory else None
        if self.memory:
            phase((key_op, "key", "key0", 0))
        else:
            phase()
        for index, layer in enumerate(layers):
            norms += [layer.gate_norm.weight, layer.ffn_norm.weight]
            norms += [layer.read_norm.weight, layer.read_out_norm.weight] if self.memory else [norms[0], norms[0]]
            out, base = ("Z", write) if index == 0 else ("part", 0)
            parts = []
            if index == 0 and self.memory:
                parts += [
                    (key_op, "write", "Z", 0),
                    (sized(write_module.value, vw), "write", "Z", kw),
                    (sized(write_module.beta, H), "write", "Z", kw + vw),
                    (sized(write_module.decay, H, extra_bias=write_module.dt_bias), "write", "Z", kw + vw + H),
                ]
            parts += [(sized(layer.gate, d), "gate", out, base), (sized(layer.ffn_in, 2 * f), "ffn", out, base + d)]
            if self.memory:
                parts += [
                    (sized(layer.read_query, kw), "read", out, base + d + 2 * f),
                    (sized(layer.read_gate, vw), "read", out, base + d + 2 * f + kw),
                ]
            phase(*parts)
            outputs = [(sized(layer.ffn_out, d), "hidden", "y_ffn", 0)]
            if self.memory:
                outputs.append((sized(layer.read_out, d), "gated", "y_read", 0))
            phase(*outputs)
        tasks, ranges = [], []
        for first, count in phases:
            start = len(tasks)
            tasks += _tasks(segments, first, count)
            ranges += [start, len(tasks)]
        _mark_streamed(segments, [op.weight for op in keep])
        self._segments = (_Segment * len(segments))(*segments)
        self.tiles = _LazyTiles(self._segments, [op.weight for op in keep], B)
        self._tasks = torch.tensor(tasks, dtype=torch.int64).reshape(-1)
        self._phases = torch.tensor(ranges, dtype=torch.int64)
        self._norms_f32 = [n.detach().float().contiguous() for n in norms]
        # (each norm's width: d, but vw for a layer's read output)
        widths = [d, d] + [vw if (self.memory and i % 4 == 3) else d for i in range(4 * L)]
        for n, width in zip(self._norms_f32, widths):
            if n.shape != (width,):
                _refuse(f"a norm weight has shape {tuple(n.shape)} where the config makes ({width},)")
        self._norm_pointers = (ctypes.c_void_p * len(self._norms_f32))(*(n.data_ptr() for n in self._norms_f32))
        self.neg_decay = (-torch.exp(write_module.A_log.detach().float())).contiguous() if self.memory else zeros(1)
        if self.neg_decay.shape != (max(H, 1),):
            _refuse(f"A_log has shape {tuple(self.neg_decay.shape)} where the config makes ({H},)")
        plan = _Plan(
            B, d, f, H, dk, dv, L, int(self.memory), write + width_part, width_part, float(config.rms_norm_eps)
        )
        plan.segs = ctypes.cast(self._segments, _ptr)
        plan.tasks, plan.phases = self._tasks.data_ptr(), self._phases.data_ptr()
        plan.norms, plan.neg_decay = ctypes.cast(self._norm_pointers, _ptr), self.neg_decay.data_ptr()
        for i, name in enumerate(_SLOT_NAMES):
            slot = slots[name]
            plan.slots[i] = _Slot(
                slot["x"].data_ptr(), slot["xr"].data_ptr(), slot["xb"].data_ptr(), slot["x"].shape[1]
            )
        for name, tensor in buffers.items():
            setattr(plan, name, tensor.data_ptr())
        self._plan, self._keep, self._slots, self._buffers = plan, keep, slots, buffers
        self.weights = tuple(op.weight for op in keep)  # (what the plan reads; also for the byte count)
        self.int8 = any(op.kind == KIND_I8 for op in keep)
        self.int4 = any(op.kind == KIND_I4 for op in keep)

    def step(
        self,
        state: StepState,
        u: torch.Tensor,
        real: torch.Tensor | None,
        w: FoldedWeights | None = None,
        s: Shapes | None = None,
        c: Columns | None = None,
        eps: float = 0.0,
        saved: dict | None = None,
        memory_out: torch.Tensor | None = None,
    ) -> tuple[StepState, torch.Tensor | None]:
        """`recurrence_step._step`'s contract for a no-grad step (no records: `saved` must be None) of this
        plan's rows: (new state, gamma). `state.key` may be None: the key of `state.g` is then computed
        here. The folded weights `w`, shapes and columns are not read (the plan has its own)."""
        if saved is not None:
            _refuse("the step kernel keeps no records (it runs no-grad windows only)")
        d, f, H, dk, dv, L = self.sizes
        B = self.rows
        p, g, key, memory = state
        for name, tensor, shape in (("p", p, (B, d)), ("g", g, (B, d)), ("u", u, (B, d))):
            _check(tensor, name, shape=shape)
        u = u.contiguous()
        _check(p, "p", contiguous=True)
        _check(g, "g", contiguous=True)
        new_p, new_g = p.new_empty(B, d), p.new_empty(B, d)
        if self.memory:
            if key is not None:
                _check(key, "key", shape=(B, H * dk), contiguous=True)
            _check(memory, "memory", shape=(B, H, dk, dv), contiguous=True)
            if memory_out is None:
                memory_out = memory.new_empty(B, H, dk, dv)
            _check(memory_out, "memory_out", shape=(B, H, dk, dv), contiguous=True)
            _check_apart(memory_out, "memory_out", {"memory": memory, "p": p, "g": g, "u": u})
            new_key, gamma = p.new_empty(B, H * dk), p.new_empty(B, H)
        else:
            memory_out, new_key, gamma = memory, p.new_empty(B, 0), None
        calls["step"] += 1
        calls["int8 step"] += self.int8
        calls["int4 step"] += self.int4
        self.tiles.count(1)
        _library.gpn_step(
            ctypes.addressof(self._plan),
            p.data_ptr(),
            g.data_ptr(),
            key.data_ptr() if (self.memory and key is not None) else None,
            memory.data_ptr() if self.memory else None,
            u.data_ptr(),
            new_p.data_ptr(),
            new_g.data_ptr(),
            new_key.data_ptr() if self.memory else None,
            memory_out.data_ptr() if self.memory else None,
            gamma.data_ptr() if self.memory else None,
            torch.get_num_threads(),
        )
        if not self.memory:
            new_key = key if key is not None else p.new_empty(B, 0)
        new = StepState(new_p, new_g, new_key, memory_out)
        if real is not None and key is None and self.memory:  # a padded row keeps the key of its g, computed here
            key = self._buffers["key0"][:, : H * dk].clone()
        old = StepState(p, g, key if key is not None else new_key, memory)
        return keep_padded_rows(new, old, real, None, self.memory), gamma

    def steps(self, U: torch.Tensor, state: StepState, outputs: torch.Tensor, gammas: torch.Tensor | None) -> StepState:
        """T unmasked steps in one C call (`gpn_steps`): the token inputs U (B, T, d), the predicted states into
        `outputs` (B, T, d) and gamma into `gammas` (B, T, H) when given; returns the final state (fresh
        tensors). `state.key` may be None (the first step computes the key of `state.g`)."""
        d, f, H, dk, dv, L = self.sizes
        B, T = self.rows, U.shape[1]
        p, g, key, memory = state
        _check(U, "U", shape=(B, T, d), contiguous=True)
        _check(outputs, "outputs", shape=(B, T, d), contiguous=True)
        for name, tensor in (("p", p), ("g", g)):
            _check(tensor, name, shape=(B, d), contiguous=True)
        kw = H * dk if self.memory else 0
        if self.memory:
            if key is not None:
                _check(key, "key", shape=(B, kw), contiguous=True)
            _check(memory, "memory", shape=(B, H, dk, dv), contiguous=True)
        if gammas is not None:
            _check(gammas, "gammas", shape=(B, T, H), contiguous=True)
        p_buf, g_buf = p.new_empty(2, B, d), p.new_empty(2, B, d)
        key_buf = p.new_empty(2, B, max(kw, 1))
        memory_buf = memory.new_empty(2, *memory.shape) if self.memory else p.new_empty(2, 1)
        _check_apart(outputs, "outputs", {"U": U, "p": p, "g": g, "memory": memory})
        calls["step"] += T
        calls["int8 step"] += T * self.int8
        calls["int4 step"] += T * self.int4
        self.tiles.count(T)
        pointer = lambda t: t.data_ptr() if t is not None else None
        _library.gpn_steps(
            ctypes.addressof(self._plan),
            T,
            p.data_ptr(),
            g.data_ptr(),
            pointer(key) if self.memory else None,
            memory.data_ptr() if self.memory else None,
            U.data_ptr(),
            outputs.data_ptr(),
            pointer(gammas),
            p_buf.data_ptr(),
            g_buf.data_ptr(),
            key_buf.data_ptr(),
            memory_buf.data_ptr(),
            torch.get_num_threads(),
        )
        last = (T - 1) % 2
        if not self.memory:
            return StepState(p_buf[last], g_buf[last], key if key is not None else p.new_empty(B, 0), memory)
        return StepState(p_buf[last], g_buf[last], key_buf[last], memory_buf[last])


class _DecodePlanStruct(ctypes.Structure):  # gpn_decode_plan
    _fields_ = [(name, _i64) for name in ("B", "e", "vocab", "table_kind")]
    _fields_ += [(name, _ptr) for name in ("table", "fuse_norm", "decode_norm", "segs", "tasks")]
    _fields_ += [("phases", _i64 * 6), ("slots", _Slot * 3), ("u", _ptr), ("decoded", _ptr)]


class IdsHash(NamedTuple):
    """Residues (B, 2) int64 that a decoded token's ids are folded into in place, each column as
    `h = (h * base + id) mod modulus` (what a `GPNCache` keeps of the positions it read, `ReadFingerprint`)."""

    residues: torch.Tensor
    bases: tuple[int, int]
    modulus: int


class DecodePlan:
    """A decoded token of a causal LM in one C call (`gpn_decode`): the token's embedding row, W_fuse rms(E[x]),
    the whole step (`StepPlan`'s), W_dec rms(p') (+ b_dec) and the logits against the output matrix, on the
    modules' own weights, as the separate calls compute them (the token and decoder projections as
    `module_rows`, the logits as `linear_rows`).

    Takes the pieces as they are (the caller has checked that each is the plain module it stands for): the
    embedding table (at least `vocab` rows of e; float32 or bfloat16, contiguous), the two norms' weights, the
    two projections (`operand_of`) and the output: the tied matrix (the table itself, multiplied as
    `linear_rows` does) or a head of its own (`operand_of`: a quantized nn.Linear, called as `module_rows`
    computes it, its logits in the dtype the module returns). Raises `KernelRefusal` for anything the kernels
    do not take. Built once per derived-weights scope, like the step plan it runs. A call advances the state it
    is given in place (the kernel reads every part of the old state before it writes that part) and leaves the
    new grounded state's key in the plan's own `key` buffer, which the next call may take as its given key."""

    def __init__(
        self,
        step: StepPlan,
        table: torch.Tensor,
        vocab: int,
        fuse_norm: torch.Tensor,
        fuse_proj: torch.nn.Module,
        decode_norm: torch.Tensor,
        decode_proj: torch.nn.Module,
        output: torch.Tensor | torch.nn.Module,
    ):
        B, (d, _, H, dk, _, _) = step.rows, step.sizes
        matrices = (("the embedding", table),) + (
            () if isinstance(output, torch.nn.Module) else (("the output", output),)
        )
        for name, matrix in matrices:
            if type(matrix) not in (torch.Tensor, torch.nn.Parameter) or matrix.dtype not in (
                torch.float32,
                torch.bfloat16,
            ):
                _refuse(f"{name} is a {type(matrix).__name__} of {matrix.dtype}")
            _check_weight_matrix(matrix, name)
        if table.shape[0] < vocab:
            _refuse(f"the embedding has {table.shape[0]} rows for a vocabulary of {vocab}")
        e = table.shape[1]
        fuse, decoder = operand_of(fuse_proj), operand_of(decode_proj)
        if isinstance(output, torch.nn.Module):  # a head of its own: its logits as the module returns them
            head = operand_of(output)
            logits_bf16 = head.bf16_activations
        else:  # the tied matrix, as `linear_rows` multiplies it
            logits_bf16 = output.dtype == torch.bfloat16
            head = Operand(KIND_BF16 if logits_bf16 else KIND_F32, output.detach(), None, None, logits_bf16)
        if fuse.shape != (d, e) or decoder.shape != (e, d) or head.shape[1] != e:
            _refuse("the token projection, decoder or output matrix does not fit the step's sizes")
        if fuse_norm.shape != (e,) or decode_norm.shape != (d,):
            _refuse("a norm weight has an unexpected shape")
        self.step_plan, self.rows, self.vocab = step, B, vocab
        self._norms = [fuse_norm.detach().float().contiguous(), decode_norm.detach().float().contiguous()]
        slots = [_input_slot(B, e), _input_slot(B, d), _input_slot(B, e)]
        self.u, self.decoded = torch.zeros(B, d), torch.zeros(B, e)
        self.vocab_rows, self.logits_dtype = head.shape[0], torch.bfloat16 if logits_bf16 else torch.float32
        logits = torch.zeros(B, self.vocab_rows, dtype=self.logits_dtype)  # (a call gives its segment a new one)
        self.key = torch.zeros(B, H * dk if step.memory else 0)  # (the key of the grounded state a call leaves)
        segments = [
            _segment(fuse, slots[0], self.u, 0),
            _segment(decoder, slots[1], self.decoded, 0),
            _segment(head, slots[2], logits, 0, store_bf16=logits_bf16),
        ]
        tasks, phases = [], []
        for index in range(3):
            phases.append(len(tasks) // 3)
            tasks += [x for triple in _tasks(segments, index, 1) for x in triple]
            phases.append(len(tasks) // 3)
        _mark_streamed(segments, [*step.weights, table, fuse.weight, decoder.weight, head.weight])
        self._segments = (_Segment * 3)(*segments)
        step.tiles.add(self._segments, [fuse.weight, decoder.weight, head.weight])
        self._logits_segment = self._segments[2]  # (a view into the array, whose output each call sets)
        self._tasks = torch.tensor(tasks, dtype=torch.int64)
        plan = _DecodePlanStruct(B, e, vocab, KIND_BF16 if table.dtype == torch.bfloat16 else KIND_F32)
        plan.table = table.data_ptr()
        plan.fuse_norm, plan.decode_norm = self._norms[0].data_ptr(), self._norms[1].data_ptr()
        plan.segs, plan.tasks = ctypes.cast(self._segments, _ptr), self._tasks.data_ptr()
        for i, value in enumerate(phases):
            plan.phases[i] = value
        for i, slot in enumerate(slots):
            plan.slots[i] = _Slot(
                slot["x"].data_ptr(), slot["xr"].data_ptr(), slot["xb"].data_ptr(), slot["x"].shape[1]
            )
        plan.u, plan.decoded = self.u.data_ptr(), self.decoded.data_ptr()
        self._plan, self._keep = plan, (table, fuse, decoder, head, slots)
        # (what every call passes as it is: the two plans' addresses and the key buffer's)
        self._fixed = (
            ctypes.addressof(step._plan),
            ctypes.addressof(plan),
            self.key.data_ptr() if step.memory else None,
        )

    def __call__(self, ids: torch.Tensor, state: StepState, ids_hash: IdsHash | None = None) -> torch.Tensor:
        """The logits (B, vocab) of the tokens `ids` (B,) int64 read from `state`, whose p, g and memory it
        advances in place to the state after them; the new g's key goes to `self.key`. `state.key` is the key of
        `state.g` (it may be `self.key`, as the last call left it), or None: computed here. `ids_hash`: residues
        the ids are folded into as well, in place (`IdsHash`). Raises IndexError for an id outside [0, vocab),
        having computed (and changed) nothing."""
        d, f, H, dk, dv, L = self.step_plan.sizes
        B, memory = self.rows, self.step_plan.memory
        p, g, key, M = state
        if ids.dtype is not torch.int64 or ids.shape != (B,) or not ids.is_cpu or not ids.is_contiguous():
            _refuse(f"token ids of dtype {ids.dtype} and shape {tuple(ids.shape)}; expected ({B},) int64 on the CPU")
        if ids_hash is not None:
            residues, (base0, base1), modulus = ids_hash
            if residues.dtype is not torch.int64 or residues.shape != (B, 2) or not residues.is_cpu:
                _refuse(
                    f"an ids hash of dtype {residues.dtype} and shape {tuple(residues.shape)}; expected ({B}, 2) int64"
                )
            fits = 0 < min(base0, base1) and max(base0, base1) < 2**31 and 1 < modulus < 2**31  # (no overflow)
            if not residues.is_contiguous() or not fits:
                _refuse("an ids hash that is not contiguous, or bases or a modulus outside (0, 2^31)")
        _check(p, "p", shape=(B, d), contiguous=True)
        _check(g, "g", shape=(B, d), contiguous=True)
        if memory:
            if key is not None:
                _check(key, "key", shape=(B, H * dk), contiguous=True)
            _check(M, "memory", shape=(B, H, dk, dv), contiguous=True)
        # the logits go straight into a new tensor, which the caller keeps (the kernel writes every entry)
        logits = torch.empty(B, self.vocab_rows, dtype=self.logits_dtype)
        self._logits_segment.out = logits.data_ptr()
        step_plan, plan, key_out = self._fixed
        p_at, g_at, M_at = p.data_ptr(), g.data_ptr(), M.data_ptr() if memory else None
        self.step_plan.tiles.count(1)
        outside = _library.gpn_decode(
            step_plan,
            plan,
            ids.data_ptr(),
            p_at,
            g_at,
            key.data_ptr() if (memory and key is not None) else None,
            M_at,
            p_at,  # (in place: see the class)
            g_at,
            key_out,
            M_at,
            ids_hash[0].data_ptr() if ids_hash is not None else None,
            *(ids_hash[1] if ids_hash is not None else (0, 0)),
            ids_hash[2] if ids_hash is not None else 0,
            torch.get_num_threads(),
        )
        if outside:
            raise IndexError(f"a token id of {ids.tolist()} is outside the vocabulary of {self.vocab}")
        # written in place behind torch's back: their version counters say so (a graph that saved one refuses
        # to run its backward, as after any in-place write)
        written = (p, g, M, self.key) if memory else (p, g)
        increment_version(written if ids_hash is None else (*written, ids_hash[0]))
        calls["step"] += 1
        calls["int8 step"] += self.step_plan.int8
        calls["int4 step"] += self.step_plan.int4
        calls["decode"] += 1
        return logits


def _check_weight_matrix(matrix: torch.Tensor, name: str) -> None:
    if not matrix.is_cpu or matrix.layout is not torch.strided or matrix.dim() != 2 or not matrix.is_contiguous():
        _refuse(f"{name} is not a contiguous CPU matrix")


_task_cache: dict = {}


def _rows_product(x: torch.Tensor, op: Operand, store_bf16: bool) -> torch.Tensor:
    """x (B, K) float32 times `op` for B <= MAX_STEP_ROWS: (B, out) float32 (bf16 with `store_bf16`)."""
    B, K = x.shape
    x = x.contiguous()
    slot = {"x": x, "xr": x, "xb": x}  # (xr and xb are read only with bf16 activations)
    if op.bf16_activations:
        rounded = x.to(torch.bfloat16)
        slot = {"x": x, "xr": rounded.float(), "xb": rounded.view(torch.int16)}
    out = torch.empty(B, op.shape[0], dtype=torch.bfloat16 if store_bf16 else torch.float32)
    segment = _segment(op, slot, out, 0, store_bf16=store_bf16)
    key = (op.shape[0], K, op.kind)
    tasks = _task_cache.get(key)
    if tasks is None:
        tasks = _task_cache[key] = torch.tensor(_tasks([segment], 0, 1), dtype=torch.int64).reshape(-1)
    calls["linear"] += 1
    _library.gpn_linear(ctypes.addressof(segment), tasks.data_ptr(), tasks.numel() // 3, B, torch.get_num_threads())
    return out


def module_rows(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`module(x.to(its weight's dtype)).float()` for a few rows of float32 `x` (B, K) and an nn.Linear
    whose weight the products take (`operand_of`: float32, bfloat16, torchao int8 or low-bit weight-only): as the
    module computes it, rounded to bf16 where the module's output is bf16. Raises `KernelRefusal` otherwise
    (the caller checks that the module is exactly an nn.Linear without hooks)."""
    _require()
    _check(x, "x")
    if x.dim() != 2 or not 1 <= x.shape[0] <= MAX_STEP_ROWS:
        _refuse(f"x has shape {tuple(x.shape)}; expected (1 to {MAX_STEP_ROWS} rows, features)")
    op = operand_of(module)
    if op.shape[1] != x.shape[1]:
        _refuse(f"x has {x.shape[1]} features for a ({op.shape[0]}, {op.shape[1]}) weight")
    return _rows_product(x, op, store_bf16=False)


def linear_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight^T for a few rows (1 to `MAX_STEP_ROWS`) of float32 `x` (B, K) and a contiguous float32 or
    bfloat16 CPU `weight` (N, K), as `F.linear(x.to(weight.dtype), weight)` computes it (float32
    accumulation; a bf16 weight multiplies the input rounded to bf16 and gives bf16): the one-row logits.
    Raises `KernelRefusal` for anything else."""
    _require()
    _check(x, "x")
    if x.dim() != 2 or not 1 <= x.shape[0] <= MAX_STEP_ROWS:
        _refuse(f"x has shape {tuple(x.shape)}; expected (1 to {MAX_STEP_ROWS} rows, features)")
    if type(weight) is not torch.Tensor and type(weight) is not torch.nn.Parameter:
        _refuse(f"the weight is a {type(weight).__name__}")
    if weight.dtype not in (torch.float32, torch.bfloat16) or not weight.is_cpu or weight.layout is not torch.strided:
        _refuse(f"the weight is a {weight.dtype} {weight.layout} tensor on {weight.device}")
    if weight.dim() != 2 or weight.shape[1] != x.shape[1] or not weight.is_contiguous():
        _refuse(
            f"the weight has shape {tuple(weight.shape)} (contiguous: {weight.is_contiguous()}) for x {tuple(x.shape)}"
        )
    bf16 = weight.dtype == torch.bfloat16
    # (bf16: the input rounded to bf16 as `x.to(weight.dtype)` does; the output stored as bf16, unrounded before)
    op = Operand(KIND_BF16 if bf16 else KIND_F32, weight.detach(), None, None, bf16)
    return _rows_product(x, op._replace(bf16_activations=bf16), store_bf16=bf16)


def read_probe(buffer: torch.Tensor, threads: int | None = None) -> float:
    """Read every float of the contiguous float32 CPU `buffer` once at the machine's streaming rate (the
    bandwidth behind the byte limit of a step); returns their sum (so the read cannot be skipped)."""
    _require()
    _check(buffer, "buffer", contiguous=True)
    return _library.gpn_read_probe(buffer.data_ptr(), buffer.numel(), threads or torch.get_num_threads())


def gates(x: torch.Tensor, library: ctypes.CDLL | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(sigmoid(x), silu(x)) of the contiguous float32 CPU `x` as the C step's elementwise loops of `library` (by
    default the kernels in use) compute them, on its own exponential (`gate_exp`): for the tests that hold them
    to torch's."""
    if library is None:
        _require()
        library = _library
    _check(x, "x", contiguous=True)
    sigmoid, silu = torch.empty_like(x), torch.empty_like(x)
    library.gpn_gates(x.data_ptr(), sigmoid.data_ptr(), silu.data_ptr(), x.numel())
    return sigmoid, silu


def thread_buffers() -> int:
    """How many per-thread buffers of the kernels in use are alive now, in every thread: the int8 and int4
    products' quantized inputs, one per thread that ran them, each freed when its thread ends (for the tests that hold a
    thread per call to that)."""
    _require()
    return _library.gpn_thread_buffers()


def products_isa() -> str:
    """The vector instructions the products of the kernels in use were built for: "avx512" (with "+bf16" and
    "+vnni" where the CPU has those), "avx2" (AVX2 and FMA) or "portable" (plain C the compiler vectorises). int8
    products are exact integer sums of the input rounded to 16 bits on "+vnni" and "avx2" builds, float sums
    elsewhere; int4 weights are read as int4 on "+vnni" and "avx2" builds (`reads_int4`)."""
    _require()
    return _library.gpn_products_isa().decode()


def reads_int4() -> bool:
    """Whether the kernels in use multiply int4 weights as int4 (`int4_operand`): on AVX512-VNNI's dot products
    or AVX2's byte multiply-adds, exact integer sums either way (the same outputs); elsewhere a low-bit weight is
    read as the matrix it dequantizes to."""
    isa = products_isa()
    return "+vnni" in isa or isa == "avx2"


def variant(extra_flags: tuple[str, ...]) -> ctypes.CDLL:
    """The kernels compiled with `extra_flags` after the usual ones (say `-mno-avx512f`: the AVX2 products an
    AVX-512 CPU would not run), cached and checked as the default build is. For tests and A/B runs, which put
    it in place of the default (`_library`) for the calls they time or check."""
    return _compile(tuple(extra_flags))
