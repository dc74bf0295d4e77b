"""`torch.inference_mode()`, as serving code and evaluation harnesses use it in place of `no_grad`: the tensors made
inside it (a cache's state, a model built or loaded there) track no version counter and accept no in-place write
outside it. The fast path keys what it derives on version counters, and the cache updates its buffers in place:
each must still compute what `no_grad` computes, on the fast path and the plain one (each test shows which ran,
`tests/backend_observer.py`)."""

from __future__ import annotations

import pytest
import torch

from ..backend_observer import DECODE_CALLS, FAST_PATH, PLAIN_PATH, ran
from ..environment import require_c_kernels
from ..tiny_models import perturbed_model, tiny_config

PATHS = [(True, (FAST_PATH, DECODE_CALLS), (PLAIN_PATH,)), (False, (PLAIN_PATH,), (FAST_PATH, DECODE_CALLS))]
PATH_IDS = ["fast", "plain"]


def tiny_model():
    return perturbed_model(tiny_config(), seed=31).eval()


def generated_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """generate()'s logits of 3 greedy tokens (steps, rows, vocab): a prompt's window, then decoded tokens."""
    out = model.generate(
        ids, max_new_tokens=3, do_sample=False, output_logits=True, return_dict_in_generate=True, eos_token_id=None
    )
    return torch.stack(out.logits)


@pytest.fixture
def ids():
    return torch.randint(1, 97, (2, 5), generator=torch.Generator().manual_seed(32))


@pytest.mark.parametrize("fast, runs, not_runs", PATHS, ids=PATH_IDS)
def test_generate_under_inference_mode_gives_no_grads_logits(ids, fast, runs, not_runs):
    """A cache filled inside inference_mode holds inference tensors: the one-call decode, which remembers the
    version of the state it computed a key for, once raised 'Inference tensors do not track version counter'."""
    require_c_kernels()
    model = tiny_model()
    model.model.use_fast_path = fast
    with torch.no_grad():
        expected = generated_logits(model, ids)
    with ran(*runs, not_ran=not_runs), torch.inference_mode():
        logits = generated_logits(model, ids)
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)


@pytest.mark.parametrize("fast, runs, not_runs", PATHS, ids=PATH_IDS)
def test_a_model_built_under_inference_mode_runs(ids, fast, runs, not_runs, tmp_path):
    """Parameters made inside inference_mode (a model built or loaded there) are inference tensors: keying the
    derived weights on their versions once made every forward raise, on either path (and saving a cache, which
    hashes the weights, too)."""
    require_c_kernels()
    reference = tiny_model()
    reference.model.use_fast_path = fast
    expected = generated_logits(reference, ids)
    with torch.inference_mode():
        model = tiny_model()
        model.model.use_fast_path = fast
        with ran(*runs, not_ran=not_runs):
            logits = generated_logits(model, ids)
        model(ids, use_cache=True).cache.save(tmp_path / "state.gpn")
    # (the last bits of float32: torch's kernels round differently under inference_mode)
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("fast, runs, not_runs", PATHS, ids=PATH_IDS)
def test_a_cache_filled_under_inference_mode_continues_outside_it(ids, fast, runs, not_runs):
    """A prompt read inside inference_mode, its tokens decoded outside it under no_grad: the same logits and
    positions as a cache filled under no_grad. (The plain path once raised torch's 'Inplace update to inference
    tensor outside InferenceMode' after it had written p but not g and M; the one-call decode writes them from C.)"""
    require_c_kernels()
    model = tiny_model()
    model.model.use_fast_path = fast

    def decoded(cache) -> torch.Tensor:
        logits = []
        with torch.no_grad(), ran(*runs, not_ran=not_runs):
            for token in (7, 8, 9):
                out = model(torch.full((2, 1), token), cache=cache, use_cache=True)
                logits.append(out.logits)
        return torch.cat(logits, dim=1)

    with torch.no_grad():
        expected = decoded(model(ids, use_cache=True).cache)
    with torch.inference_mode():
        cache = model(ids, use_cache=True).cache
    torch.testing.assert_close(decoded(cache), expected, rtol=0, atol=0)
    assert cache.get_seq_length() == 8
