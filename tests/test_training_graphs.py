"""Training windows on static buffers (`cuda_graphs.TrainingSweep`): what the CUDA graphs of a training
window's forward and backward sweeps capture, run eagerly on CPU through Triton's interpreter.

The sweep must give the outputs and every gradient of the plain loop and of the fast path without graphs
(1 and 2 layers, BPTT segments with a shorter last one, chunks that do not divide the segment, awkward
sizes), fall back to the fast path for what it does not take (masks, truncation, a second call while one
holds its buffers), and, after the first call, run a chunk without any allocating op or host sync, every
buffer staying at its address (what capturing it requires).
"""

from __future__ import annotations

import pytest
import torch

from modeling_gpn import cuda_graphs
from modeling_gpn import triton_kernels as tk

from .conftest import perturbed_model, tiny_config
from .test_fast_path import assert_same, random_problem, run_recurrence
from .test_triton_kernels import VARIANTS, OpRecorder, allocating, triton_on  # noqa: F401 (a fixture)

CASES = [  # (variant, bptt segment, length): chunks of 2 steps
    ("gpn+m", None, 5),  # one segment of 5: chunks 2, 2, 1
    ("gpn+m-2l-awkward-seg2", 2, 5),  # segments 2, 2, 1 (the last one's records kept from the forward)
    ("gpn+m-awkward", 3, 4),  # segments 3 (chunks 2, 1) and 1
    ("gpn", 2, 3),
]


@pytest.fixture
def graphs_on(triton_on, monkeypatch):
    monkeypatch.setattr(cuda_graphs, "TRAINING_CHUNK", 2)
    monkeypatch.setenv("GPN_CUDA_GRAPHS", "1")
    return monkeypatch


def sweeps_of(model) -> list:
    return list(getattr(model.model, "_gpn_training_sweeps", {}).values())


@pytest.mark.parametrize("variant,segment,length", CASES)
def test_training_sweep_equals_the_fast_path_and_the_plain_loop(graphs_on, variant, segment, length):
    config = dict(VARIANTS[variant], bptt_segment_length=segment)
    model = perturbed_model(tiny_config(**config), seed=21)
    tokens, state, _, weights = random_problem(model, batch=3, length=length, mask_kind=None, seed=5)
    plain = run_recurrence(model, False, tokens, state, None, weights)
    graphs_on.setenv("GPN_CUDA_GRAPHS", "0")
    fast = run_recurrence(model, True, tokens, state, None, weights)
    assert not sweeps_of(model)
    graphs_on.setenv("GPN_CUDA_GRAPHS", "1")
    for call in range(2):  # the second call reuses the buffers (and would replay the graphs)
        swept = run_recurrence(model, True, tokens, state, None, weights)
        assert_same(plain, swept)
        assert_same(fast, swept)
    (sweep,) = sweeps_of(model)
    assert sweep.length == min(segment or length, length) and sweep.owner is None
    assert all(record is not None for record in sweep.records)  # every position ran on the static buffers
