"""The one-token decode step of the fast path as a CUDA graph: captured once per batch size and weights,
replayed for every token (opt-in: `GPN_CUDA_GRAPHS=1`, or `model.model.use_cuda_graphs = True`).

Why: a decode step is a dozen small kernels (`triton_kernels.step`); launched one by one from Python each
costs several microseconds of CPU time, more than the GPU needs for it at batch 1. A captured graph
launches all of them with one call.

How: `DecodeStepGraph` keeps two state slots (p, g, M) and a workspace of static buffers per direction.
A replay reads slot i and writes slot 1 - i (M' goes straight into the other slot; the key pre-activation
is recomputed from g inside the graph, as the fast path does at the start of every window), so no state
is copied between tokens: when the state handed in is the one the previous replay returned, the next
replay just runs the other direction; any other state is first copied into the current slot (today's
`GPNCache` hands out copies, so `generate()` pays those three copies per token).
`run` (the step itself) allocates nothing and never waits for the host after the first call (the test on
CPU checks both), which is what capturing it requires.

Caveat (why it is opt-in): the returned state tensors are the graph's slots, overwritten by the replay
after next. `generate()` only keeps the latest state, so it is safe there; code that keeps an older
decode state (its own copy of an old cache) must clone it, or leave graphs off. The graph is untested on a
GPU so far (no GPU was lent to the session that wrote it); `benchmarks/gpu_check.py` checks it first.

This file ships to the Hub with the model: it imports only torch, typing and the standard library.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from .triton_kernels import _linear, unit_rms
from .triton_kernels import selected as triton_selected
from .triton_kernels import step as triton_step


def wanted(model, token_inputs: torch.Tensor) -> bool:
    """Whether `fast_recurrence` should decode this one-token window through a graph: asked for
    (`model.use_cuda_graphs` or GPN_CUDA_GRAPHS=1) and the Triton backend selected (on CUDA; on CPU only
    when forced through Triton's interpreter, where the same static step runs without a graph: the tests)."""
    asked = getattr(model, "use_cuda_graphs", False) or os.environ.get("GPN_CUDA_GRAPHS") == "1"
    return bool(asked) and triton_selected(token_inputs)


class DecodeStepGraph:
    """One decode step of a `GPNModel` for a fixed batch size and fixed weights, on static buffers.

    `__call__(u, (p, g, M))` returns (new p, (new p, new g, new M), gamma) like the fast path's window of
    one token; on CUDA (`capture()` done) each call is one copy of u and one graph replay."""

    def __init__(self, model, batch: int, device: torch.device):
        from .fast_recurrence import cached_folded_weights, columns_of, shapes_of

        self.model = model
        self.s = shapes_of(model, batch)
        self.c = columns_of(self.s)
        self.eps = model.config.rms_norm_eps
        self.w = cached_folded_weights(model, rows=batch)
        s = self.s
        zeros = lambda *shape: torch.zeros(shape, dtype=torch.float32, device=device)  # noqa: E731
        memory_shape = (batch, s.heads, s.key_dim, s.value_dim) if s.memory else (batch, 0)
        self.u = zeros(batch, s.hidden)
        self.p = [zeros(batch, s.hidden) for _ in range(2)]
        self.g = [zeros(batch, s.hidden) for _ in range(2)]
        self.memory = [zeros(*memory_shape) for _ in range(2)]
        self.gamma = zeros(batch, s.heads)
        self.workspaces: list[dict] = [{}, {}]  # one per direction
        self.current = 0  # the slot holding the state the next step reads
        self.graphs: Optional[list] = None

    def run(self, slot: int) -> None:
        """One step from slot `slot` into the other slot (what a graph captures)."""
        from .fast_recurrence import StepState

        s, w, ws, target = self.s, self.w, self.workspaces[slot], 1 - slot
        key, memory_out = self.g[slot][:, :0], None
        if s.memory:  # the key pre-activation W_k rms(g) + b_k (`fast_recurrence.key_from_grounded`)
            width = s.heads * s.key_dim
            a_g = unit_rms(self.g[slot], self.eps, ws=ws, name="a_g0")
            key = _linear(a_g, w.big_w[:, :width], w.big_b[:width], ws, "key")
            memory_out = self.memory[target]
        state = StepState(self.p[slot], self.g[slot], key, self.memory[slot])
        new, gamma = triton_step(state, self.u, None, w, s, self.c, self.eps, None, memory_out, ws=ws)
        self.p[target].copy_(new.p)
        self.g[target].copy_(new.g)
        if s.memory:
            self.gamma.copy_(gamma)

    def capture(self) -> None:
        """Capture both directions as CUDA graphs (after a warm-up on a side stream, which also compiles the
        Triton kernels and makes every workspace buffer)."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for slot in (0, 1, 0, 1):
                self.run(slot)
        torch.cuda.current_stream().wait_stream(stream)
        graphs = []
        for slot in (0, 1):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.run(slot)
            graphs.append(graph)
        self.graphs = graphs

    def load(self, state) -> None:
        """Copy a state (p, g, M) that did not come from this graph into the current slot."""
        p, g, memory = state
        slot = self.current
        self.p[slot].copy_(p)
        self.g[slot].copy_(g)
        if self.s.memory:
            self.memory[slot].copy_(memory)

    def holds(self, state) -> bool:
        """Whether `state` is the one in the current slot (returned by the previous call)."""
        p, g, memory = state
        slot = self.current
        return p is self.p[slot] and g is self.g[slot] and (not self.s.memory or memory is self.memory[slot])

    def __call__(self, u: torch.Tensor, state):
        if not self.holds(state):
            self.load(state)
        self.u.copy_(u)
        slot = self.current
        if self.graphs is not None:
            self.graphs[slot].replay()
        else:
            self.run(slot)
        self.current = target = 1 - slot
        p = self.p[target]
        return p, (p, self.g[target], self.memory[target]), (self.gamma if self.s.memory else None)


def decode_graph_of(model, batch: int, device: torch.device, capture: bool = True) -> DecodeStepGraph:
    """The model's `DecodeStepGraph` for this batch size, made (and captured, on CUDA) on first use and
    again whenever a parameter changed."""
    key = (batch, device, tuple((p.data_ptr(), p._version) for p in model.parameters()))
    cached = getattr(model, "_gpn_decode_graph", None)
    if cached is None or cached[0] != key:
        graph = DecodeStepGraph(model, batch, device)
        if capture and device.type == "cuda":
            graph.capture()
        cached = (key, graph)
        object.__setattr__(model, "_gpn_decode_graph", cached)
    return cached[1]


def decode_step(model, token_inputs: torch.Tensor, state, output_memory_decays: bool = False):
    """`fast_recurrence.fast_recurrence` for a window of one token (no mask, no autograd) through the
    model's decode graph. Returns (outputs (B, 1, d), (p, g, M), gamma (B, 1, H) or None); the outputs are
    a copy, the state the graph's slot (see the module docstring)."""
    B = token_inputs.shape[0]
    graph = decode_graph_of(model, B, token_inputs.device)
    p, final, gamma = graph(token_inputs[:, 0].float(), state)
    gammas = gamma[:, None].clone() if (output_memory_decays and gamma is not None) else None
    return p[:, None].clone(), final, gammas
