"""No-grad windows of the fast path as CUDA graphs: the one-token decode step, and chunks of
`WINDOW_CHUNK` steps for longer windows (prefill, scoring), each captured once per batch size and weights
and replayed (opt-in: `GPN_CUDA_GRAPHS=1`, or `model.model.use_cuda_graphs = True`).

Why: a decode step is a dozen small kernels (`triton_kernels.step`); launched one by one from Python each
costs several microseconds of CPU time, more than the GPU needs for it at batch 1. A captured graph
launches all of them with one call.

How: `StepsGraph` keeps two state slots (p, g, M) and a workspace of static buffers per direction. A step
reads slot i and writes slot 1 - i (M' goes straight into the other slot; the key pre-activation is
recomputed from g at the start of a replay, as the fast path does at the start of every window), so no
state is copied between steps or tokens: when the state handed in is the one the previous replay
returned, the next replay just starts from that slot; any other state is first copied into the current slot (today's
`GPNCache` hands out copies, so `generate()` pays those three copies per token).
`run` (the steps themselves) allocates nothing and never waits for the host after the first call (the
test on CPU checks both), which is what capturing it requires. Training windows (with autograd) do not
run through graphs: their steps keep per-step records for the backward pass.

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


WINDOW_CHUNK = 32  # steps per graph replay for windows of more than one token (prefill, scoring)


def wanted(model, token_inputs: torch.Tensor) -> bool:
    """Whether `fast_recurrence` should run this no-grad, unmasked window through graphs: asked for
    (`model.use_cuda_graphs` or GPN_CUDA_GRAPHS=1) and the Triton backend selected (on CUDA; on CPU only
    when forced through Triton's interpreter, where the same static steps run without a graph: the tests)."""
    asked = getattr(model, "use_cuda_graphs", False) or os.environ.get("GPN_CUDA_GRAPHS") == "1"
    return bool(asked) and sizes_fit(model.config) and triton_selected(token_inputs)


def sizes_fit(config) -> bool:
    """Whether the Triton step takes this model's sizes (the graphs have no torch-ops fallback inside)."""
    from .triton_kernels import MAX_KEY_BLOCK, MAX_ROW_BLOCK

    widths = [config.hidden_size, config.intermediate_size]
    if config.use_memory:
        widths.append(config.num_memory_heads * config.memory_value_dim)
        if config.memory_key_dim > MAX_KEY_BLOCK:
            return False
    return max(widths) <= MAX_ROW_BLOCK


class StepsGraph:
    """`steps` consecutive steps of a `GPNModel` for a fixed batch size and fixed weights, on static buffers.

    `__call__(u, (p, g, M))` with u (B, steps, d) (or (B, d) for one step) returns (outputs (B, steps, d),
    (p, g, M), gammas (B, steps, H) or None) like the fast path's window, all of them this object's
    buffers; on CUDA (`capture()` done) each call is one copy of u and one graph replay."""

    def __init__(self, model, batch: int, device: torch.device, steps: int = 1):
        from .fast_recurrence import cached_folded_weights, columns_of, shapes_of

        self.model = model
        self.steps = steps
        self.s = shapes_of(model, batch)
        self.c = columns_of(self.s)
        self.eps = model.config.rms_norm_eps
        self.w = cached_folded_weights(model, rows=batch)
        s = self.s
        zeros = lambda *shape: torch.zeros(shape, dtype=torch.float32, device=device)  # noqa: E731
        memory_shape = (batch, s.heads, s.key_dim, s.value_dim) if s.memory else (batch, 0)
        self.u = zeros(batch, steps, s.hidden)
        self.outputs = zeros(batch, steps, s.hidden)
        self.gammas = zeros(batch, steps, s.heads)
        self.p = [zeros(batch, s.hidden) for _ in range(2)]
        self.g = [zeros(batch, s.hidden) for _ in range(2)]
        self.memory = [zeros(*memory_shape) for _ in range(2)]
        self.workspaces: list[dict] = [{}, {}]  # one per direction (slot read -> slot written)
        self.current = 0  # the slot holding the state the next call reads
        self.graphs: Optional[list] = None

    def run(self, slot: int) -> None:
        """`steps` steps from slot `slot`, alternating the two slots (what a graph captures)."""
        from .fast_recurrence import StepState

        s, w = self.s, self.w
        key = self.g[slot][:, :0]
        if s.memory:  # the key pre-activation W_k rms(g) + b_k (`fast_recurrence.key_from_grounded`)
            width = s.heads * s.key_dim
            a_g = unit_rms(self.g[slot], self.eps, ws=self.workspaces[slot], name="a_g0")
            key = _linear(a_g, w.big_w[:, :width], w.big_b[:width], self.workspaces[slot], "key")
        for j in range(self.steps):
            source = (slot + j) % 2
            target = 1 - source
            state = StepState(self.p[source], self.g[source], key, self.memory[source])
            memory_out = self.memory[target] if s.memory else None
            new, gamma = triton_step(state, self.u[:, j], None, w, s, self.c, self.eps, None, memory_out,
                                     ws=self.workspaces[source])  # fmt: skip
            self.p[target].copy_(new.p)
            self.g[target].copy_(new.g)
            self.outputs[:, j].copy_(new.p)
            if s.memory:
                self.gammas[:, j].copy_(gamma)
            # the next key is a view of this step's Z: valid while the next step runs (it uses the other
            # workspace), overwritten only by the step after
            key = new.key

    def capture(self) -> None:
        """Capture a graph for each starting slot (after a warm-up on a side stream, which also compiles the
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
        self.u.copy_(u.view(self.u.shape))
        slot = self.current
        if self.graphs is not None:
            self.graphs[slot].replay()
        else:
            self.run(slot)
        self.current = end = (slot + self.steps) % 2
        return self.outputs, (self.p[end], self.g[end], self.memory[end]), (self.gammas if self.s.memory else None)


def graph_of(model, batch: int, device: torch.device, steps: int = 1, capture: bool = True) -> StepsGraph:
    """The model's `StepsGraph` for this batch size and number of steps, made (and captured, on CUDA) on first
    use and again whenever a parameter changed."""
    weights = tuple((p.data_ptr(), p._version) for p in model.parameters())
    graphs = getattr(model, "_gpn_graphs", None)
    if graphs is None:
        graphs = {}
        object.__setattr__(model, "_gpn_graphs", graphs)
    cached = graphs.get((batch, device, steps))
    if cached is None or cached[0] != weights:
        graph = StepsGraph(model, batch, device, steps)
        if capture and device.type == "cuda":
            graph.capture()
        cached = graphs[(batch, device, steps)] = (weights, graph)
    return cached[1]


def window_forward(model, token_inputs: torch.Tensor, state, output_memory_decays: bool = False):
    """`fast_recurrence.fast_recurrence` for a window without mask or autograd, through graphs: chunks of
    `WINDOW_CHUNK` steps (one replay each), then single steps (the decode graph: one replay per token).
    Returns (outputs (B, T, d), (p, g, M), gammas (B, T, H) or None); outputs and gammas are fresh tensors,
    the state the graph's buffers (see the module docstring)."""
    B, T, d = token_inputs.shape
    device = token_inputs.device
    if T == 1:  # decoding: nothing else is allocated
        outputs, final, gammas = graph_of(model, B, device)(token_inputs, state)
        return outputs.clone(), final, (gammas.clone() if output_memory_decays and gammas is not None else None)
    outputs = torch.empty(B, T, d, dtype=torch.float32, device=device)
    heads = model.config.num_memory_heads if model.config.use_memory else 0
    gammas = torch.zeros(B, T, heads, device=device) if (output_memory_decays and heads) else None
    start = 0
    while start < T:
        steps = WINDOW_CHUNK if T - start >= WINDOW_CHUNK else 1
        chunk_outputs, state, chunk_gammas = graph_of(model, B, device, steps)(token_inputs[:, start : start + steps], state)
        outputs[:, start : start + steps] = chunk_outputs
        if gammas is not None:
            gammas[:, start : start + steps] = chunk_gammas
        start += steps
    return outputs, state, gammas
