"""What the Triton path's tests share: the model variants they run on it (awkward sizes on purpose: key and
value dimensions that are not multiples of the block sizes, one and three heads, two layers, short segments),
and how they watch a call: the kernel launches it made (`launches`) and the aten ops it dispatched
(`OpRecorder`, `allocating`: a step on static buffers must allocate nothing)."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode

from modeling_gpn import triton_kernels as tk


def launches(fn):
    """(result of fn(), the Triton kernel launches it made, by kernel: a Counter)."""
    before = tk.launches.copy()
    result = fn()
    return result, tk.launches - before


AWKWARD = dict(num_memory_heads=1, memory_key_dim=5, memory_value_dim=7, hidden_size=20, intermediate_size=13)
VARIANTS = {
    "gpn+m": dict(),
    "gpn+m-2l": dict(num_predict_layers=2),
    "gpn+m-awkward": AWKWARD,
    "gpn+m-2l-awkward-seg2": dict(AWKWARD, num_predict_layers=2, num_memory_heads=3, bptt_segment_length=2),
    "gpn": dict(use_memory=False),
}


class OpRecorder(TorchDispatchMode):
    """Records the aten ops dispatched (Triton launches excluded, see `ignore_triton_launches`: the
    interpreter's host copies are not ops a GPU would run)."""

    def __init__(self, monkeypatch):
        super().__init__()
        self.ops = []
        self.paused = False
        self.ignore_triton_launches(monkeypatch)

    def ignore_triton_launches(self, monkeypatch) -> None:
        """Pause recording inside every Triton launch (its argument handling is not a dispatched GPU op)."""
        real_launch = tk._launch

        def launch(*args, **kwargs):
            self.paused = True
            try:
                return real_launch(*args, **kwargs)
            finally:
                self.paused = False

        monkeypatch.setattr(tk, "_launch", launch)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.ops.append(func)
        return func(*args, **(kwargs or {}))


def allocating(func) -> bool:
    """Whether an aten op makes a new tensor: not a view, not in place, not an out= variant."""
    name = func.overloadpacket.__name__
    return not func.is_view and not name.endswith("_") and "out" not in func._schema.overload_name
