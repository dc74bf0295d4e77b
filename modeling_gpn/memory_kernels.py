"""Fused CPU kernels for the memory half of a step and its gradient (optional: the torch ops in
`recurrence_step` compute the same and are the reference the tests compare against).

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
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import torch

from .recurrence_step import MemoryStep

SOURCE = r"""
#include <stddef.h>
#include <math.h>

/* One head per iteration: every pass over M (and D) after the first hits the cache. Sizes are 64-bit and
   there are no arrays on the stack (a thread's stack is small: a head's dv floats there overflowed it), so
   any size the Python side accepts is safe; the Python side checks every tensor before a call. */

typedef long long i64;

static float softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); } /* torch's F.softplus (threshold 20) */

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
        /* k and q: relu, then l2 normalisation (eps 1e-12 inside the root) */
        float *raw = kq_raw + bh * 2 * dk, *unit = kq + bh * 2 * dk;
        const float *sources[2] = {key + b * key_stride + h * dk, zrow + col_query + h * dk};
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
        const float sp = softplus(zrow[col_decay + h]);
        const float g = neg_decay_rate[h] * sp;
        const float ah = expf(g), beta_h = 1.f / (1.f + expf(-zrow[col_beta + h]));
        softplus_decay[bh] = sp; gamma[bh] = g; decay_factor[bh] = ah; sig_beta[bh] = beta_h;
        /* write and read */
        const float *Mh = M + bh * dk * dv;
        float *Oh = M_out + bh * dk * dv;
        const float *vh = zrow + col_value + h * dv;
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
            const float e = vh[j] - eh[j];
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
"""

_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c99"]
_SYMBOLS = ("gpn_memory_step", "gpn_memory_write_backward", "gpn_kernel_source_digest")
BUILD_TIMEOUT_S = 60.0  # default bound on one compiler run (`GPN_KERNEL_BUILD_TIMEOUT` overrides it)
_lock = threading.Lock()
_library: Optional[ctypes.CDLL] = None
_failure: Optional[str] = None
calls: Counter = Counter()  # kernel calls so far, by kernel (tests/paths.py: a test of the kernels asserts they ran)


class KernelWarning(UserWarning):
    """The kernel cache held something damaged or foreign (rebuilt), or the kernels were turned off."""


class KernelRefusal(RuntimeError):
    """A kernel cannot take these arguments (or the kernels are unavailable); the torch ops can."""


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
        with open("/proc/cpuinfo") as cpuinfo:
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


def _problem_with_owner_and_mode(info: os.stat_result) -> Optional[str]:
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
    return lib


def _remove_builds(folder: Path, key: str, keep: Optional[str] = None) -> None:
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
        command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
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
        raise RuntimeError(f"{command[0]} exited with {process.returncode}: {errors.strip()[-2000:]}")


def _build(compiler: str, folder: Path, key: str, timeout: float) -> None:
    """Compile in a private temporary folder, then publish the library under its content-hash name and the
    record naming it (each fsynced, then renamed into place: no process ever sees a half-written file under
    a final name) and remove older builds of the same key."""
    record = folder / f"gpn_memory_{key}.sha256"
    with tempfile.TemporaryDirectory(dir=folder, prefix=".build-") as scratch:
        source = Path(scratch) / "gpn_memory.c"
        source.write_text(_kernel_text())
        built = Path(scratch) / "gpn_memory.so"
        _run_compiler([compiler, *_FLAGS, str(source), "-o", str(built)], timeout)
        os.chmod(built, stat.S_IMODE(built.stat().st_mode) & ~(stat.S_IWGRP | stat.S_IWOTH))
        content_hash = hashlib.sha256(built.read_bytes()).hexdigest()
        written = Path(scratch) / record.name
        written.write_text(content_hash + "\n")
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


def _compile() -> ctypes.CDLL:
    """The kernels: this user's verified cached build, or a fresh one (replacing anything damaged or foreign)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise FileNotFoundError("no C compiler (cc, gcc or $CC) found")
    timeout = _build_timeout()
    # -march=native: the build is for this CPU, so the key names its features (a cache folder shared
    # between machines must not hand one machine's AVX-512 build to another)
    key = hashlib.sha256("\0".join([_kernel_text(), compiler, *_FLAGS, _cpu_features()]).encode()).hexdigest()[:16]
    folder = _private_folder()
    with _build_lock(folder, f"gpn_memory_{key}.lock", timeout + 30):
        record = folder / f"gpn_memory_{key}.sha256"
        if os.path.lexists(record):
            try:
                return _load_verified(folder, key)
            except _Untrusted as problem:
                _warn(f"not loading the cached build in {folder}: {problem}; building it again")
                record.unlink(missing_ok=True)  # a link is removed, not what it points to
                _remove_builds(folder, key)
        _build(compiler, folder, key, timeout)
        try:
            return _load_verified(folder, key)
        except _Untrusted as problem:  # e.g. a compiler that is not what it claims
            raise RuntimeError(f"the fresh build is unusable: {problem}") from None


def available() -> bool:
    """Whether the kernels are built (building them on first call) and enabled (`GPN_MEMORY_KERNELS` != 0).

    A failure (no compiler, a failed or timed-out build, an untrusted cache folder) is remembered for the
    process; all but a missing compiler are reported once with a `KernelWarning`."""
    global _library, _failure
    if os.environ.get("GPN_MEMORY_KERNELS", "1") == "0":
        return False
    with _lock:
        if _library is None and _failure is None:
            try:
                _library = _compile()
            except FileNotFoundError as error:  # no compiler: the usual case on many machines, no warning
                _failure = str(error)
            except (OSError, RuntimeError) as error:  # a failed build, an untrusted folder: say so once
                _failure = str(error)
                _warn(f"{error}; using the torch ops instead (GPN_MEMORY_KERNELS=0 turns the kernels off)")
        return _library is not None


def unavailable_reason() -> Optional[str]:
    """Why `available()` is False (None when it is True or was not asked yet)."""
    if os.environ.get("GPN_MEMORY_KERNELS", "1") == "0":
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


def _check(t, name: str, shape: Optional[tuple] = None, contiguous: bool = False) -> None:
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
    Z: torch.Tensor, columns, key: torch.Tensor, neg_decay_rate: torch.Tensor, memory: torch.Tensor,
    memory_out: torch.Tensor, rms_eps: float,
) -> MemoryStep:  # fmt: skip
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
    needed = {"value": (columns.value.start, H * dv), "beta": (columns.beta.start, H),
              "decay": (columns.decay.start, H), "query": (query, H * dk)}  # fmt: skip
    for name, (start, width) in needed.items():
        if start < 0 or start + width > Z.shape[1]:
            _refuse(f"the {name} columns [{start}, {start + width}) are not within Z's {Z.shape[1]} columns")
    _check_apart(memory_out, "memory_out", {"memory": memory, "Z": Z, "key": key, "neg_decay_rate": neg_decay_rate})
    empty = lambda *shape: memory.new_empty(shape)  # noqa: E731
    out = MemoryStep(
        empty(heads, 2, dk), empty(heads, 2, dk), empty(heads, 2, 1), empty(rows, H), empty(rows, H),
        empty(heads, 1), empty(heads, 1), empty(heads, dv), empty(heads, dv), empty(rows, H * dv), empty(rows, H * dv),
    )  # fmt: skip
    calls["memory_step"] += 1
    _library.gpn_memory_step(
        rows, H, dk, dv, Z.data_ptr(), Z.stride(0), columns.value.start, columns.beta.start, columns.decay.start,
        query, key.data_ptr(), key.stride(0), neg_decay_rate.data_ptr(), rms_eps,
        memory.data_ptr(), memory_out.data_ptr(), *(t.data_ptr() for t in out), torch.get_num_threads(),
    )  # fmt: skip
    return out


def memory_write_backward(
    memory_grad: torch.Tensor, memory: torch.Tensor, queries: torch.Tensor, read_grads: torch.Tensor,
    k: torch.Tensor, update: torch.Tensor, a: torch.Tensor, beta: torch.Tensor, memory_grad_out: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
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
        "memory_grad": (memory_grad, (heads, dk, dv)), "queries": (queries, (layers, heads, dk)),
        "read_grads": (read_grads, (layers, heads, dv)), "k": (k, (heads, dk)), "update": (update, (heads, dv)),
    }  # fmt: skip
    for name, (tensor, shape) in expected.items():
        _check(tensor, name, shape=shape)
    for name, tensor in (("a", a), ("beta", beta)):
        _check(tensor, name)
        if tensor.numel() != heads or (tensor.dim() == 2 and tensor.shape[1] != 1) or tensor.dim() > 2:
            _refuse(f"{name} has shape {tuple(tensor.shape)}, expected ({heads},) or ({heads}, 1)")
    _check(memory_grad_out, "memory_grad_out", shape=(heads, dk, dv), contiguous=True)
    inputs = dict(memory_grad=memory_grad, memory=memory, queries=queries, read_grads=read_grads, k=k,
                  update=update, a=a, beta=beta)  # fmt: skip
    _check_apart(memory_grad_out, "memory_grad_out", inputs)
    memory_grad, memory, queries, read_grads, k, update, a, beta = (t.contiguous() for t in inputs.values())
    d_update, d_error = memory.new_empty(heads, dv), memory.new_empty(heads, dv)
    d_k, d_a, dq = memory.new_empty(heads, dk), memory.new_empty(heads), memory.new_empty(heads, dk)
    scratch = memory.new_empty(heads * layers * (dk + 2))
    calls["memory_write_backward"] += 1
    _library.gpn_memory_write_backward(
        heads, dk, dv, layers, *(t.data_ptr() for t in (memory_grad, memory, memory_grad_out, queries, read_grads, k,
        update, a, beta, d_update, d_k, d_a, dq, d_error, scratch)), torch.get_num_threads(),
    )  # fmt: skip
    return d_update, d_k, d_a, dq, d_error
