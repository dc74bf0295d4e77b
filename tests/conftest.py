"""Shared test setup.

The reference fixtures and data live outside the repository, in the folder named by the environment
variable GPN_SHARED_DIR (default: `../shared` beside the repository root). Tests that need them skip
with a message saying what is missing; `.ci/run` sets GPN_REQUIRE_SHARED=1, which turns those skips
into failures so CI can never pass by skipping.

The same holds for what the machine provides (`require_environment`): a C compiler for the memory kernels
(GPN_REQUIRE_C_KERNELS), root for the cache-ownership test (GPN_REQUIRE_ROOT), a mountable tmpfs for the
full-disk test (GPN_REQUIRE_MOUNT), triton for the Triton kernels' tests (GPN_REQUIRE_TRITON). `.ci/run`
sets each one CI's machine can satisfy; the skips left are listed at the end of the run (`-ra`).
"""

from __future__ import annotations

import os
from pathlib import Path

# Triton's interpreter runs the Triton kernels on CPU tensors (tests/test_triton_kernels.py). Triton reads this
# when it decorates functions, and importing torch already imports triton.language, so it is set before torch.
# It changes nothing else on CPU (the fast path uses Triton on CPU only when GPN_TRITON=1 forces it).
os.environ.setdefault("TRITON_INTERPRET", "1")
TRITON_INTERPRETER_AT_START = os.environ["TRITON_INTERPRET"].lower() in ("1", "true", "yes", "on")

import pytest  # noqa: E402
import torch  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DIR = Path(os.environ.get("GPN_SHARED_DIR", REPO_ROOT.parent / "shared")).resolve()
FIXTURES = SHARED_DIR / "fixtures" / "reference"
DATA = SHARED_DIR / "data"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One thread: on 2 shared cores, small-op recurrences run several times slower with 2 threads.
torch.set_num_threads(1)


@pytest.fixture
def one_thread():
    """One thread for the test (as set above), and the count as it was afterwards: for modules whose tests
    must not inherit a count another test raised (`pytestmark = pytest.mark.usefixtures("one_thread")`)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_configure(config):
    # The marks of transformers' tests/test_modeling_common.py (tests/test_transformers_common.py runs it),
    # registered as transformers' own conftest registers them.
    for mark in ("accelerate_tests", "flash_attn_test", "flash_attn_3_test", "flash_attn_4_test", "torch_compile_test"):
        config.addinivalue_line("markers", f"{mark}: a mark of transformers' common model tests")


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


def require_c_kernels() -> None:
    """Skip (fail under GPN_REQUIRE_C_KERNELS=1) unless the C memory kernels build and are enabled here."""
    from modeling_gpn import memory_kernels

    available = memory_kernels.available()
    require_environment(available, f"C memory kernels unavailable: {memory_kernels.unavailable_reason()}", "GPN_REQUIRE_C_KERNELS")


@pytest.fixture
def shared():
    return require_shared


def tiny_config(**overrides):
    """A small GPN+M config (the fixtures' shapes) for fast tests."""
    from modeling_gpn import GPNConfig

    values = dict(
        vocab_size=97, hidden_size=48, embedding_size=32, intermediate_size=64,
        num_memory_heads=3, memory_key_dim=8, memory_value_dim=16, eos_token_id=0, bos_token_id=None,
    )  # fmt: skip
    values.update(overrides)
    return GPNConfig(**values)


def perturbed_model(config, seed: int = 0):
    """A model whose zero-initialised gates and outputs are perturbed, so every code path matters."""
    from modeling_gpn import GPNForCausalLM

    torch.manual_seed(seed)
    model = GPNForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.1 * torch.randn_like(param))
            elif param.dim() == 1:
                param.add_(0.1 * torch.randn_like(param))
            elif "embed" not in name:
                param.copy_(0.5 * torch.randn_like(param) / param.shape[1] ** 0.5)
    return model.eval()
