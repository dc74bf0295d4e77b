"""No-grad windows of the fast path as CUDA graphs: the one-token decode step, and chunks of
`WINDOW_CHUNK` steps for longer windows (prefill, scoring), each captured once per batch size and the step
matrices' dtypes and replayed (opt-in: `GPN_CUDA_GRAPHS=1`, or `model.model.use_cuda_graphs = True`); the
`MAX_INFERENCE_GRAPHS` last used are kept.

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
test on CPU checks both), which is what capturing it requires. The weights a graph reads are static
buffers too: the dispatcher hands in the folded weights of the current forward or generate() call
(`derived_weights.py`) and `graph_of` copies them in once per call, so a graph never replays weights the
parameters no longer hold, whatever route changed them (no new capture needed).

Training windows (with autograd, unmasked, without truncated BPTT, outside saved-tensor hooks: the sweeps'
static buffers keep what the hooks would not see) run their forward and backward sweeps
on `TrainingSweep`'s static buffers, one graph replay per chunk of `TRAINING_CHUNK` steps of each BPTT
segment (see the class). GPN_CUDA_GRAPHS=inference keeps them off while the no-grad windows use graphs.

Caveat (why it is opt-in): the returned state tensors are the graph's slots, overwritten by the replay
after next. `generate()` only keeps the latest state, so it is safe there; code that keeps an older
decode state (its own copy of an old cache) must clone it, or leave graphs off. `benchmarks/gpu_check.py`
checks the graphs on a GPU before any timing (docs/gpu.md).

The steps the graphs replay are handed in (`GraphKernels`: the dispatcher, `fast_recurrence`, passes
Triton's, which take static buffers), and so is the decision to use graphs at all (`asked` is the user's
side of it); this file imports no backend.

This file ships to the Hub with the model: it imports only torch, typing, the standard library and
`recurrence_step` (the contract of the steps it replays).
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import NamedTuple

import torch

from .recurrence_step import (
    FoldedWeights,
    PackedMatrix,
    StaticWeightGrads,
    StepState,
    _flatten,
    _unflatten,
    columns_of,
    first_key_gradient,
    key_from_grounded,
    shapes_of,
    transpose_weights,
)

WINDOW_CHUNK = 32  # steps per graph replay for windows of more than one token (prefill, scoring)
# no-grad graphs a model keeps at most, the least recently used dropped first: each holds two state slots and
# two step workspaces for every batch row, and a server or an evaluation that meets many batch sizes would
# otherwise keep a pair (decode, prompt chunks) for every size it ever saw
MAX_INFERENCE_GRAPHS = 8
# the model's attributes holding its captured graphs and their static buffers (read from its weights: never
# copied or pickled with it, `fast_recurrence.DERIVED_ATTRIBUTES`)
GRAPHS_ATTRIBUTE, SWEEPS_ATTRIBUTE = "_gpn_graphs", "_gpn_training_sweeps"
replays: Counter = Counter()  # graph replays so far, "no-grad window" / "training" (benchmarks say what ran)


class GraphKernels(NamedTuple):
    """The backend functions the graphs replay, each taking a workspace `ws` of static buffers (so a step
    allocates nothing): the dispatcher passes Triton's (`fast_recurrence.GRAPH_KERNELS`)."""

    step: Callable  # `recurrence_step._step`'s contract, plus `ws`  (`triton_kernels.step`)
    step_backward: Callable  # `recurrence_step._step_backward`'s, plus `ws`  (`triton_kernels.step_backward`)
    unit_rms: Callable  # (x, eps, ws=, name=) -> x / sqrt(mean(x^2) + eps)  (`triton_kernels.unit_rms`)
    linear: Callable  # (x, w, b, ws, name) -> x @ w + b as float32  (`triton_kernels._linear`)


def asked(model: torch.nn.Module, training: bool = False) -> bool:
    """Whether graphs are asked for: `model.use_cuda_graphs` True or GPN_CUDA_GRAPHS=1 ("inference", as the
    setting or the variable, asks for the no-grad windows only, not for `training` ones). The dispatcher runs an unmasked window
    through them when they are asked for and the Triton backend is selected and takes the model's sizes (on
    CUDA; on CPU only when forced through Triton's interpreter, where the same static steps run without a
    graph: the tests)."""
    setting = getattr(model, "use_cuda_graphs", False)
    if setting is False or setting is None:
        setting = os.environ.get("GPN_CUDA_GRAPHS")
    return setting is True or setting == "1" or (setting == "inference" and not training)


class StepsGraph:
    """`steps` consecutive steps of a `GPNModel` for a fixed batch size and fixed weights, on static buffers.

    `__call__(u, (p, g, M))` with u (B, steps, d) (or (B, d) for one step) returns (outputs (B, steps, d),
    (p, g, M), gammas (B, steps, H) or None) like the fast path's window, all of them this object's
    buffers; on CUDA (`capture()` done) each call is one copy of u and one graph replay."""

    def __init__(
        self,
        model: torch.nn.Module,
        batch: int,
        device: torch.device,
        steps: int = 1,
        *,
        kernels: GraphKernels,
        w: FoldedWeights,
    ):
        self.model = model
        self.kernels = kernels
        self.steps = steps
        self.s = shapes_of(model, batch)
        self.c = columns_of(self.s)
        self.eps = model.config.rms_norm_eps
        self.w = w  # the folded weights the steps read (`load_weights` refreshes them)
        s = self.s
        zeros = lambda *shape: torch.zeros(shape, dtype=torch.float32, device=device)
        memory_shape = (batch, s.heads, s.key_dim, s.value_dim) if s.memory else (batch, 0)
        self.u = zeros(batch, steps, s.hidden)
        self.outputs = zeros(batch, steps, s.hidden)
        self.gammas = zeros(batch, steps, s.heads)
        self.p = [zeros(batch, s.hidden) for _ in range(2)]
        self.g = [zeros(batch, s.hidden) for _ in range(2)]
        self.memory = [zeros(*memory_shape) for _ in range(2)]
        self.workspaces: list[dict] = [{}, {}]  # one per direction (slot read -> slot written)
        self.current = 0  # the slot holding the state the next call reads
        self.graphs: list | None = None

    def run(self, slot: int) -> None:
        """`steps` steps from slot `slot`, alternating the two slots (what a graph captures)."""
        s, w, kernels = self.s, self.w, self.kernels
        key = self.g[slot][:, :0]
        if s.memory:  # the key pre-activation W_k rms(g) + b_k (`recurrence_step.key_from_grounded`)
            width = s.heads * s.key_dim
            # (bf16 step matrices are prepacked for oneDNN on CPU, where the tests run this eagerly)
            big_w = w.big_w.matrix if isinstance(w.big_w, PackedMatrix) else w.big_w
            a_g = kernels.unit_rms(self.g[slot], self.eps, ws=self.workspaces[slot], name="a_g0")
            key = kernels.linear(a_g, big_w[:, :width], w.big_b[:width], self.workspaces[slot], "key")
        for j in range(self.steps):
            source = (slot + j) % 2
            target = 1 - source
            state = StepState(self.p[source], self.g[source], key, self.memory[source])
            memory_out = self.memory[target] if s.memory else None
            new, gamma = kernels.step(
                state, self.u[:, j], None, w, s, self.c, self.eps, None, memory_out, ws=self.workspaces[source]
            )
            self.p[target].copy_(new.p)
            self.g[target].copy_(new.g)
            self.outputs[:, j].copy_(new.p)
            if s.memory:
                self.gammas[:, j].copy_(gamma)
            # the next key is a view of this step's Z: valid while the next step runs (it uses the other
            # workspace), overwritten only by the step after
            key = new.key

    def capture(self) -> None:
        """Capture a graph for each starting slot (`captured`: after a warm-up of both on a side stream,
        which also compiles the Triton kernels and makes every workspace buffer)."""

        def warm_up() -> None:
            for slot in (0, 1, 0, 1):
                self.run(slot)

        # The graph reads its weights from here on, and `load_weights` copies each later call's into them: a folded
        # weight that is a model's parameter itself (fuse_gate's bias in float32, a memory-less model's output
        # matrices) would have the next parameters' values copied into it, a model's weights swapped by assigning
        # new Parameters overwriting the old ones. Those (small) ones are the graph's own copies, and so are
        # weights folded under torch.inference_mode() (inference tensors, which a later call outside it could not
        # copy its weights into)
        self.w = self.own_weights()
        self.graphs = captured(warm_up, [lambda: self.run(0), lambda: self.run(1)], self.p[0])

    def own_weights(self) -> FoldedWeights:
        """`self.w` with the graph's own copy of each weight it could not write into later: those sharing a
        parameter's storage and inference tensors (see `capture`); the others as they are."""
        parameters = {param.untyped_storage().data_ptr() for param in self.model.parameters()}
        own = lambda t: t.clone() if t.is_inference() or t.untyped_storage().data_ptr() in parameters else t
        return _unflatten([own(t) for t in _flatten(self.w)], self.s)

    def load_weights(self, w: FoldedWeights) -> None:
        """Read the folded weights `w` from now on: copied into the captured graph's static ones (same shapes and
        dtypes); without a capture (CPU, the tests) the steps simply read `w`."""
        if self.graphs is None:
            self.w = w
            return
        for target, source in zip(_flatten(self.w), _flatten(w)):
            target.copy_(source)

    def load(self, state: StepState) -> None:
        """Copy a state (p, g, M) that did not come from this graph into the current slot."""
        p, g, memory = state
        slot = self.current
        self.p[slot].copy_(p)
        self.g[slot].copy_(g)
        if self.s.memory:
            self.memory[slot].copy_(memory)

    def holds(self, state: StepState) -> bool:
        """Whether `state` is the one in the current slot (returned by the previous call)."""
        p, g, memory = state
        slot = self.current
        return p is self.p[slot] and g is self.g[slot] and (not self.s.memory or memory is self.memory[slot])

    def __call__(
        self, u: torch.Tensor, state: StepState
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor | None]:
        """Run the captured steps on token inputs `u` from `state`: (outputs, final (p, g, M), gammas or None)."""
        if not self.holds(state):
            self.load(state)
        self.u.copy_(u.view(self.u.shape))
        slot = self.current
        if self.graphs is not None:
            self.graphs[slot].replay()
            replays["no-grad window"] += 1
        else:
            self.run(slot)
        self.current = end = (slot + self.steps) % 2
        return self.outputs, (self.p[end], self.g[end], self.memory[end]), (self.gammas if self.s.memory else None)


def captured(warm_up: Callable[[], object], runs: list, like: torch.Tensor) -> list:
    """One CUDA graph of each function of `runs`, on the GPU of tensor `like`, after `warm_up()` ran once on
    a side stream (which compiles the kernels and makes every buffer the runs use, so that a capture
    allocates nothing; CUDA requires work before a capture to run outside the default stream's legacy sync).

    Captured with `capture_error_mode="thread_local"`: the training graphs are captured lazily inside the
    first forward and in autograd's thread during the first backward, while other threads (HF Trainer's
    pin-memory thread, NCCL's watchdog) may make CUDA calls; in the default "global" mode any such call
    during the capture breaks it, "thread_local" only forbids unsafe calls from this thread."""
    with torch.cuda.device(like.device):  # (the tensors' GPU, not the current one)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            warm_up()
        torch.cuda.current_stream().wait_stream(stream)
        graphs = []
        for run in runs:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                run()
            graphs.append(graph)
    return graphs


def graph_of(
    model: torch.nn.Module,
    batch: int,
    device: torch.device,
    steps: int,
    w: FoldedWeights,
    derived: dict,
    *,
    kernels: GraphKernels,
) -> StepsGraph:
    """The model's `StepsGraph` for this batch size, number of steps and step matrices' dtypes, made (and
    captured, on CUDA) on first use, reading the folded weights `w` of the current forward or generate() call:
    `derived` is that call's dict of derived weights (`derived_weights.py`), where the graphs that already read
    `w` are noted, so each graph copies the weights in once per call, not once per replay.

    Keyed by every step matrix's dtype, not one: a captured graph multiplies in its static weights' dtypes and
    `load_weights` copies (casts) into them, so a model with one module cast since (its fuse gate kept in
    float32 beside bf16 matrices) would otherwise replay that module's products in the old dtype.

    Each thread has its own graphs (the thread is part of the key): a graph's token input, state slots, outputs and
    weights are static buffers, written by every call, so two threads running one graph at once would each read the
    other's tokens and state in silence (and a state one call returned, a slot, would be overwritten by the other's
    call before it is copied into the cache).

    At most `MAX_INFERENCE_GRAPHS` are kept, the least recently used dropped to make room for a new one (a thread
    that ended leaves its graphs until then)."""
    unpacked = lambda m: m.matrix if isinstance(m, PackedMatrix) else m
    dtypes = tuple(unpacked(m).dtype for m in (w.fg_w, w.big_w, *w.out_w, *w.layer_w))
    key = (batch, device, steps, dtypes, threading.get_ident())
    loaded = derived.setdefault("graphs holding these weights", set())
    with _graphs_lock:  # (the least recently used order, which other threads' calls move and trim meanwhile)
        graphs = getattr(model, GRAPHS_ATTRIBUTE, None)
        if graphs is None:
            graphs = OrderedDict()  # least recently used first
            object.__setattr__(model, GRAPHS_ATTRIBUTE, graphs)
        graph = graphs.get(key)
        if graph is None:
            while len(graphs) >= MAX_INFERENCE_GRAPHS:  # (before the new one's buffers are made)
                # a state a dropped graph returned stays valid (its slots are referenced by whoever holds it) and is
                # copied into the slots of the graph that reads it next
                graphs.popitem(last=False)
        else:
            graphs.move_to_end(key)
    if graph is None:  # (made and captured outside the lock: no other thread makes or reads this thread's graphs)
        graph = StepsGraph(model, batch, device, steps, kernels=kernels, w=w)
        if device.type == "cuda":
            graph.capture()
        with _graphs_lock:
            graphs[key] = graph
    elif key not in loaded:
        graph.load_weights(w)
    loaded.add(key)
    return graph


_graphs_lock = threading.Lock()


def window_forward(
    model: torch.nn.Module,
    token_inputs: torch.Tensor,
    state: StepState,
    output_memory_decays: bool = False,
    *,
    kernels: GraphKernels,
    w: FoldedWeights,
    derived: dict,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor | None]:
    """`fast_recurrence.fast_recurrence` for a window without mask or autograd, through graphs: chunks of
    `WINDOW_CHUNK` steps (one replay each), then single steps (the decode graph: one replay per token), on the
    folded weights `w` of the current call (`derived`: see `graph_of`).
    Returns (outputs (B, T, d), (p, g, M), gammas (B, T, H) or None); outputs and gammas are fresh tensors,
    the state the graph's buffers (see the module docstring).

    Outside `torch.inference_mode()` even when called inside it: the graph's static buffers (made on its
    first call, written in place by every later one) must be normal tensors, since torch lets nothing write an
    inference tensor in place outside inference mode, and a graph made under it (an evaluation harness) is
    replayed later under no_grad (generate()); reading the inference tensors handed in is allowed."""
    if torch.is_inference_mode_enabled():  # (no grad inside either: inference_mode(False) turns grad mode on)
        with torch.inference_mode(False), torch.no_grad():
            return window_forward(
                model, token_inputs, state, output_memory_decays, kernels=kernels, w=w, derived=derived
            )
    B, T, d = token_inputs.shape
    device = token_inputs.device
    if T == 1:  # decoding: nothing else is allocated
        outputs, final, gammas = graph_of(model, B, device, 1, w, derived, kernels=kernels)(token_inputs, state)
        return outputs.clone(), final, (gammas.clone() if output_memory_decays and gammas is not None else None)
    outputs = torch.empty(B, T, d, dtype=torch.float32, device=device)
    heads = model.config.num_memory_heads if model.config.use_memory else 0
    gammas = torch.zeros(B, T, heads, device=device) if (output_memory_decays and heads) else None
    start = 0
    while start < T:
        steps = WINDOW_CHUNK if T - start >= WINDOW_CHUNK else 1
        chunk_outputs, state, chunk_gammas = graph_of(model, B, device, steps, w, derived, kernels=kernels)(
            token_inputs[:, start : start + steps], state
        )
        outputs[:, start : start + steps] = chunk_outputs
        if gammas is not None:
            gammas[:, start : start + steps] = chunk_gammas
        start += steps
    return outputs, state, gammas


# --------------------------------------------------------------------------------------------------
# Training windows: the forward and backward sweeps of each BPTT segment on static buffers
# --------------------------------------------------------------------------------------------------

TRAINING_CHUNK = 32  # steps per graph replay in a training window's forward and backward sweeps


_take_lock = threading.Lock()  # (`TrainingSweep.take`)


class _Owner:
    """What a training call holds while a `TrainingSweep`'s buffers carry its records (see `take`)."""


class TrainingSweep:
    """The steps of a training window (`fast_recurrence.GPNRecurrenceFunction`) for one batch size, segment
    length and weight dtype, on static buffers: on CUDA each chunk of `TRAINING_CHUNK` steps, forward or
    backward, is one captured graph replay.

    Layout: segment position j (0 <= j < `length`) has a workspace of its own for the forward step
    (`forward_ws[j]`): the step's intermediates, which are exactly its records for the backward step, stay
    there until the same position of another segment is run, and M' goes into `memory[j]`. So step j + 1
    reads its state straight from step j's buffers (nothing copied), and a chunk's graph reads and writes
    the same addresses in every segment. Each segment is fed through `u`, `state_in` (its boundary) and
    `d_outputs` (its slice of dL/dP), and hands back `outputs`, `gammas` and `d_inputs` (dL/dU). The
    backward steps alternate two workspaces and two dL/dM slots; a backward chunk starts from `grad_in`
    and leaves its carried gradient there (one copy per chunk: the chunk at a segment's end then reads the
    same buffers whatever the segment's length). Weight gradients go into a `StaticWeightGrads` with one
    block per chunk, summed (in place) at the end of the chunk. The folded weights and their transposes
    are copied into static buffers once per call, so a weight update needs no new capture.

    Graphs are captured per (direction, first position, steps): bounded by the segment's chunks (plus
    those of a shorter last segment). Without CUDA (the tests, through Triton's interpreter) the same
    chunks run eagerly. The buffers hold one training call's records from its forward to its backward:
    `take` refuses a second call meanwhile (it then runs the fast path without graphs).
    `model._gpn_training_sweeps.clear()` frees the buffers and graphs."""

    def __init__(
        self,
        model: torch.nn.Module,
        batch: int,
        length: int,
        w: FoldedWeights,
        device: torch.device,
        *,
        kernels: GraphKernels,
    ):
        s = self.s = shapes_of(model, batch)
        self.kernels = kernels
        self.c = columns_of(s)
        self.eps = model.config.rms_norm_eps
        self.length = length
        self.chunk = max(1, min(TRAINING_CHUNK, length))
        self.device = device
        self.w = _unflatten([torch.zeros(t.shape, dtype=t.dtype, device=device) for t in _flatten(w)], s)
        self.wt = transpose_weights(self.w)  # (static buffers too; neg_decay_rate shares self.w's)
        zeros = lambda *shape: torch.zeros(shape, dtype=torch.float32, device=device)
        memory_shape = (batch, s.heads, s.key_dim, s.value_dim) if s.memory else (batch, 0)
        key_width = s.heads * s.key_dim
        self.u, self.outputs = zeros(batch, length, s.hidden), zeros(batch, length, s.hidden)
        self.d_outputs, self.d_inputs = zeros(batch, length, s.hidden), zeros(batch, length, s.hidden)
        self.gammas = zeros(batch, length, s.heads)
        self.state_in = StepState(
            zeros(batch, s.hidden), zeros(batch, s.hidden), zeros(batch, key_width), zeros(*memory_shape)
        )
        self.grad_in = StepState(
            zeros(batch, s.hidden), zeros(batch, s.hidden), zeros(batch, key_width), zeros(*memory_shape)
        )
        self.memory = zeros(length, *memory_shape) if s.memory else None
        self.memory_grads = zeros(2, *memory_shape) if s.memory else None
        self.forward_ws: list[dict] = [{} for _ in range(length)]
        self.backward_ws: list[dict] = [{}, {}]
        self.weight_grads = StaticWeightGrads(self.w, batch, self.chunk)
        self.records: list[dict | None] = [None] * length
        self.new_states: list = [None] * length  # the StepState each forward position returned (its buffers)
        self.graphs: dict = {}
        self.capture = device.type == "cuda"
        self.owner = None

    def nbytes(self) -> int:
        """Bytes of the buffers this sweep holds now (static buffers, weight copies, the workspaces its steps
        made so far; not the graphs' own memory pools, which hold nothing since the steps allocate nothing)."""
        tensors, seen = [], set()
        stack = [
            self.w,
            self.wt,
            self.state_in,
            self.grad_in,
            self.u,
            self.outputs,
            self.d_outputs,
            self.d_inputs,
            self.gammas,
            self.memory,
            self.memory_grads,
            self.forward_ws,
            self.backward_ws,
            self.weight_grads.grads,
            self.weight_grads.bias_grads,
            self.weight_grads.neg_decay,
            self.weight_grads.blocks,
            self.weight_grads.products,
            self.weight_grads.bias_sums,
            self.weight_grads.cast_blocks,
        ]
        while stack:
            item = stack.pop()
            if isinstance(item, torch.Tensor):
                tensors.append(item)
            elif isinstance(item, dict):
                stack.extend(item.values())
            elif isinstance(item, (list, tuple)):
                stack.extend(item)
        total = 0
        for tensor in tensors:
            storage = tensor.untyped_storage()
            key = (tensor.device, storage.data_ptr()) if tensor.device.type != "meta" else id(tensor)
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
        return total

    # ---- the steps a graph captures --------------------------------------------------------------------

    def forward_steps(self, first: int, steps: int) -> None:
        """Forward steps first..first+steps-1 of the segment in the static buffers, keeping their records."""
        s = self.s
        state = self.state_in if first == 0 else self.new_states[first - 1]
        for j in range(first, first + steps):
            saved: dict = {}
            memory_out = self.memory[j] if s.memory else None
            state, gamma = self.kernels.step(
                state, self.u[:, j], None, self.w, s, self.c, self.eps, saved, memory_out, ws=self.forward_ws[j]
            )
            self.records[j], self.new_states[j] = saved, state
            self.outputs[:, j].copy_(state.p)
            if s.memory:
                self.gammas[:, j].copy_(gamma)

    def backward_steps(self, first: int, steps: int) -> None:
        """Backward steps first+steps-1 down to first from `grad_in`, leaving the carried gradient there."""
        step_backward = self.kernels.step_backward
        grads = self.grad_in
        for j in reversed(range(first, first + steps)):
            grads.p.add_(self.d_outputs[:, j])
            memory_out = self.memory_grads[j % 2] if self.s.memory else None
            grads, d_input = step_backward(
                self.records[j],
                grads,
                self.wt,
                self.s,
                self.c,
                self.eps,
                self.weight_grads,
                memory_out,
                ws=self.backward_ws[j % 2],
            )
            self.d_inputs[:, j].copy_(d_input)
        self.weight_grads.flush()
        for carried, new in zip(self.grad_in, grads):
            if carried.data_ptr() != new.data_ptr():
                carried.copy_(new)

    def _run(self, direction: str, first: int, steps: int) -> None:
        run = self.forward_steps if direction == "forward" else self.backward_steps
        if not self.capture:
            run(first, steps)
            return
        key = (direction, first, steps)
        graph = self.graphs.get(key)
        if graph is not None:
            graph.replay()
            replays["training"] += 1
            return
        # first time: a real run on a side stream (compiling the kernels, making every workspace buffer), then
        # the capture (which runs nothing: the buffers keep the warm-up's results, the same the replay writes)
        self.graphs[key] = captured(lambda: run(first, steps), [lambda: run(first, steps)], self.u)[0]

    def _chunks(self, steps: int):
        return [(first, min(self.chunk, steps - first)) for first in range(0, steps, self.chunk)]

    # ---- one training call -----------------------------------------------------------------------------

    def take(self) -> _Owner | None:
        """Reserve the buffers for one call (its forward to its backward); None while another call holds
        them (a call whose autograd graph was dropped without backward frees them with its owner object). Under a
        lock: two threads' calls (a worker thread calling the model outside `torch.no_grad()`, whose grad mode is
        its own) would otherwise both find the buffers free and both run on them, each reading the other's records."""
        with _take_lock:
            if self.owner is not None and self.owner() is not None:
                return None
            owner = _Owner()
            self.owner = weakref.ref(owner)
        return owner

    def release(self) -> None:
        """Let the next call take the buffers (drops the owner `take` gave out)."""
        self.owner = None

    def load_weights(self, w: FoldedWeights) -> None:
        """Copy this call's folded weights (fresh tensors every training call) into the static ones."""
        for target, source in zip(_flatten(self.w), _flatten(w)):
            target.copy_(source.detach())

    def _segment_forward(self, U: torch.Tensor, boundary: StepState, start: int, stop: int) -> None:
        steps = stop - start
        for target, source in zip(self.state_in, boundary):
            target.copy_(source)
        self.u[:, :steps].copy_(U[:, start:stop])
        for first, n in self._chunks(steps):
            self._run("forward", first, n)

    def forward(
        self, U: torch.Tensor, p0: torch.Tensor, g0: torch.Tensor, M0: torch.Tensor
    ) -> tuple[torch.Tensor, StepState, torch.Tensor | None, list[StepState]]:
        """The forward sweep of a window (weights loaded): (outputs, final StepState (fresh tensors), gammas,
        boundaries). The last segment's records stay in the buffers for `backward`."""
        s = self.s
        B, T, d = U.shape
        outputs = U.new_empty(B, T, d)
        gammas = U.new_zeros(B, T, s.heads if s.memory else 0)
        key0 = key_from_grounded(g0, self.w, s, self.eps) if s.memory else g0.new_zeros(B, 0)
        state, boundaries = StepState(p0, g0, key0, M0), []
        for start in range(0, T, self.length):
            stop = min(start + self.length, T)
            boundaries.append(state)
            self._segment_forward(U, state, start, stop)
            outputs[:, start:stop] = self.outputs[:, : stop - start]
            if s.memory:
                gammas[:, start:stop] = self.gammas[:, : stop - start]
            state = StepState(*(x.clone() for x in self.new_states[stop - start - 1]))
        return outputs, state, gammas, boundaries

    def backward(
        self,
        U: torch.Tensor,
        g0: torch.Tensor,
        w: FoldedWeights,
        boundaries: list[StepState],
        records_kept: bool,
        dP: torch.Tensor,
        dp_final: torch.Tensor,
        dg_final: torch.Tensor,
        dM_final: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list]:
        """The backward sweep: (dU, dp0, dg0, dM0, weight gradients in `_flatten`'s order). `records_kept`:
        the buffers still hold the last segment's records from `forward` (else it is recomputed too)."""
        s, eps = self.s, self.eps
        B, T, d = U.shape
        if not records_kept:  # another call used the buffers since: its weights may be in them
            self.load_weights(w)
        for target, source in zip(self.wt, (w.fg_w, w.big_w, w.out_w, w.layer_w)):
            pairs = zip(target, source) if isinstance(target, tuple) else [(target, source)]
            for t, x in pairs:
                t.copy_(x.detach().t())
        self.weight_grads.zero()
        for carried, given in zip(self.grad_in, (dp_final, dg_final, None, dM_final)):
            carried.zero_() if given is None else carried.copy_(given)
        dU = torch.empty(B, T, d, dtype=torch.float32, device=U.device)
        starts = list(range(0, T, self.length))
        for index in reversed(range(len(starts))):
            start = starts[index]
            stop = min(start + self.length, T)
            steps = stop - start
            if stop != T or not records_kept:
                self._segment_forward(U, boundaries[index], start, stop)
            boundaries[index] = None
            if dP is None:
                self.d_outputs.zero_()
            else:
                self.d_outputs[:, :steps].copy_(dP[:, start:stop])
            for first, n in reversed(self._chunks(steps)):
                self._run("backward", first, n)
            dU[:, start:stop] = self.d_inputs[:, :steps]
        grads = self.grad_in
        d_g0 = first_key_gradient(grads, g0, w, s, eps, self.weight_grads).clone()
        return dU, grads.p.clone(), d_g0, grads.memory.clone(), self.weight_grads.finish()


# the segment length of a training sweep when the model sets none (`config.bptt_segment_length` None): the
# default of `gpn train --bptt-segment` and `gpn bench --segment-length`. A sweep holds M' of every position
# of its segment, so without one a window's sweep would hold M' of every token (for the 130M model at
# 16 x 2048 some 64 GB); the gradients are the same either way (the segments are recomputed, not cut).
SWEEP_SEGMENT_LENGTH = 256


def training_sweep(
    model: torch.nn.Module,
    batch: int,
    segment: int | None,
    length: int,
    w: FoldedWeights,
    device: torch.device,
    *,
    kernels: GraphKernels,
) -> TrainingSweep | None:
    """The model's `TrainingSweep` for this batch size, BPTT segment length (`config.bptt_segment_length`,
    else `SWEEP_SEGMENT_LENGTH`) and these weights' dtype, or None where the Triton step does not take these
    weights (then the plain fast path runs). A window shorter than the segment runs as one shorter segment.

    Only the last shape's sweep is kept: one of another shape (a smaller last batch, another dtype) replaces
    it and the old one's buffers and graphs are freed (a call still holding it keeps it until its backward),
    so the memory held is one sweep's (`TrainingSweep.nbytes`), not one per shape ever seen."""
    dtypes = tuple(t.dtype for t in (w.fg_w, w.big_w, *w.out_w, *w.layer_w))
    if len(set(dtypes)) != 1 or dtypes[0] not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    sweeps = getattr(model, SWEEPS_ATTRIBUTE, None)
    if sweeps is None:
        sweeps = {}
        object.__setattr__(model, SWEEPS_ATTRIBUTE, sweeps)
    segment = segment or SWEEP_SEGMENT_LENGTH
    key = (batch, segment, dtypes[0], device)
    sweep = sweeps.get(key)
    if sweep is None:
        sweeps.clear()  # (before the new one's buffers are made: the two never need to fit together)
        # (its sizes were checked by the dispatcher (`triton_kernels.sizes_fit`); its buffers are float32 and
        # contiguous)
        sweep = sweeps[key] = TrainingSweep(model, batch, segment, w, device, kernels=kernels)
    return sweep
