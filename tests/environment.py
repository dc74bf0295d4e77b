"""What the tests run in: the environment they set before torch is imported, the shared folder, and the
skips (or failures) for what is missing.

The reference fixtures and data live outside the repository, in the folder named by the environment
variable GPN_SHARED_DIR (default: `../shared` beside the repository root). Tests that need them skip
with a message saying what is missing; `.ci/run` sets GPN_REQUIRE_SHARED=1, which turns those skips
into failures so CI can never pass by skipping.

The same holds for what the machine provides (`require_environment`): a C compiler for the memory kernels
(GPN_REQUIRE_C_KERNELS), root for the cache-ownership test (GPN_REQUIRE_ROOT), a mountable tmpfs for the
full-disk tests (GPN_REQUIRE_MOUNT), triton for the Triton kernels' tests (GPN_REQUIRE_TRITON). `.ci/run`
sets each one CI's machine can satisfy; the skips left are listed at the end of the run (`-ra`).

tests/conftest.py imports this module before it imports torch; this module must not import torch itself.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

# Triton's interpreter runs the Triton kernels on CPU tensors (tests/fast_path/test_triton_kernels.py). Triton
# reads this when it decorates functions, and importing torch already imports triton.language, so it is set
# before torch. It changes nothing else on CPU (the fast path uses Triton on CPU only when GPN_TRITON=1 forces it).
os.environ.setdefault("TRITON_INTERPRET", "1")
TRITON_INTERPRETER_AT_START = os.environ["TRITON_INTERPRET"].lower() in ("1", "true", "yes", "on")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The caches the suite writes, none of them the user's: the tests wrote the datasets library's lock files and
# prepared copies of every corpus they read (~/.cache/huggingface/datasets), trust_remote_code's copies of the model
# code (~/.cache/huggingface/modules), gpn's token shards and tokenizers (~/.cache/gpn), the C kernels
# (~/.cache/gpn/kernels) and Triton's compiled kernels (~/.triton/cache). Set here, before torch and the Hugging
# Face libraries are imported (they read them then), over the user's own settings, which name the user's caches
# too; the processes the tests launch inherit them. A test about a default location gives itself a HOME of its own.
# Left out: GPN_TRANSFORMERS_TESTS_CACHE (the transformers sdist test_transformers_common.py downloads, kept to be
# read offline).
SESSION_CACHES_VARIABLE = "GPN_TESTS_SESSION_CACHES"
if SESSION_CACHES_VARIABLE not in os.environ:  # (a process the session launches that imports this keeps its folder)
    os.environ[SESSION_CACHES_VARIABLE] = tempfile.mkdtemp(prefix="gpn-tests-caches-")
    atexit.register(shutil.rmtree, os.environ[SESSION_CACHES_VARIABLE], ignore_errors=True)
SESSION_CACHES = Path(os.environ[SESSION_CACHES_VARIABLE])


def _build_caches() -> Path:
    """The folder of the costly builds' caches, kept between sessions under the temporary folder (one a user, as
    torch's inductor keeps its own): a session of its own built the C kernels again (seconds a build) and compiled
    every Triton kernel for sm_90 again (test_triton_compile: 130 s cold against 41 s warm, loaded); both caches are
    keyed by what they were built from. Where that folder is not this user's alone, the session's own."""
    folder = Path(tempfile.gettempdir()) / f"gpn-tests-build-caches-{os.getuid()}"
    with contextlib.suppress(OSError):
        folder.mkdir(mode=0o700, exist_ok=True)
        info = folder.lstat()
        if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o077:
            return folder
    return SESSION_CACHES / "builds"


BUILD_CACHES = _build_caches()
# (the older names, which the libraries read before HF_HUB_CACHE)
for legacy in ("HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_CACHE", "PYTORCH_TRANSFORMERS_CACHE"):
    os.environ.pop(legacy, None)
os.environ.update(
    HF_HOME=str(SESSION_CACHES / "huggingface"),
    HF_HUB_CACHE=str(SESSION_CACHES / "huggingface" / "hub"),
    HF_DATASETS_CACHE=str(SESSION_CACHES / "huggingface" / "datasets"),
    HF_MODULES_CACHE=str(SESSION_CACHES / "huggingface" / "modules"),
    HF_XET_CACHE=str(SESSION_CACHES / "huggingface" / "xet"),
    HF_ASSETS_CACHE=str(SESSION_CACHES / "huggingface" / "assets"),
    GPN_CACHE=str(SESSION_CACHES / "gpn"),
    MPLCONFIGDIR=str(SESSION_CACHES / "matplotlib"),
    GPN_KERNEL_CACHE=str(BUILD_CACHES / "kernels"),
    TRITON_CACHE_DIR=str(BUILD_CACHES / "triton"),
)

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DIR = Path(os.environ.get("GPN_SHARED_DIR", REPO_ROOT.parent / "shared")).resolve()
FIXTURES = SHARED_DIR / "fixtures" / "reference"
DATA = SHARED_DIR / "data"


def require_shared(relative: str) -> Path:
    """Path of `relative` inside the shared folder, or skip (fail under GPN_REQUIRE_SHARED=1)."""
    path = SHARED_DIR / relative
    if not path.exists():
        message = (
            f"missing shared file {path} (set GPN_SHARED_DIR to the folder holding fixtures/ and data/; "
            "default ../shared beside the repository)"
        )
        if os.environ.get("GPN_REQUIRE_SHARED") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return path


def require_environment(satisfied: bool, missing: str, variable: str) -> None:
    """Skip, saying what is `missing`, unless `satisfied`; fail instead when `variable` is set to 1 (CI
    sets it where its machine can provide the thing, so a test cannot pass there by skipping)."""
    if satisfied:
        return
    if os.environ.get(variable) == "1":
        pytest.fail(f"{missing} ({variable}=1: this machine must provide it)")
    pytest.skip(missing)


@contextlib.contextmanager
def small_disk(path: Path, size: str, read_only: bool = False):
    """A real filesystem of `size` at `path` (tmpfs; mounting needs root), for writes that meet a full disk, or
    (`read_only`) a read-only file system."""
    path.mkdir(parents=True, exist_ok=True)
    options = f"{'ro,' if read_only else ''}size={size}"
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True)
    problem = f"cannot mount a small tmpfs here (needs root, or CAP_SYS_ADMIN in a container): {mounted.stderr.decode().strip()}"
    require_environment(mounted.returncode == 0, problem, "GPN_REQUIRE_MOUNT")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def require_c_kernels() -> None:
    """Skip (fail under GPN_REQUIRE_C_KERNELS=1) unless the C memory kernels build and are enabled here."""
    from modeling_gpn import memory_kernels

    available = memory_kernels.available()
    require_environment(
        available, f"C memory kernels unavailable: {memory_kernels.unavailable_reason()}", "GPN_REQUIRE_C_KERNELS"
    )


def require_int4_products() -> None:
    """Skip unless the C kernels run here with int4 products (`memory_kernels.reads_int4`: on AVX512-VNNI's dot
    products or AVX2's byte multiply-adds; elsewhere int4 weights keep the matrices dequantized from them)."""
    require_c_kernels()
    from modeling_gpn import memory_kernels

    isa = memory_kernels.products_isa()
    if not memory_kernels.reads_int4():
        pytest.skip(f"the C kernels are built for {isa}: int4 weights are multiplied as their dequantized matrices")


def require_int8_tiles() -> None:
    """Skip unless the C kernels run here with int8 products that read their weights from tiles
    (`memory_kernels._tile_int8`: on AVX512-VNNI's dot products; AVX2's exact int8 products read them by rows)."""
    require_c_kernels()
    from modeling_gpn import memory_kernels

    isa = memory_kernels.products_isa()
    if "+vnni" not in isa:
        pytest.skip(f"the C kernels are built for {isa}: int8 weights are read by rows, never tiled")


def require_exact_int8() -> None:
    """Skip unless the C kernels run here with int8 products on integer sums of the input rounded to 16 bits:
    AVX512-VNNI's dot products or AVX2's 16-bit multiply-adds (elsewhere they convert each weight to float)."""
    require_c_kernels()
    from modeling_gpn import memory_kernels

    isa = memory_kernels.products_isa()
    if "vnni" not in isa and isa != "avx2":
        pytest.skip(f"the C kernels are built for {isa}: int8 products convert each weight to float")
