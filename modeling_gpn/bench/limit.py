"""The physical limit of a batch-1 step: the bytes it must read, over the bandwidth the machine reads them
at, measured in the same run.

A GPN reads each weight once per token (the tied embedding as the output matrix: every row) and its state
(p, g, M read, M' written); nothing grows with the context. `step_bytes` counts those bytes (an int8
weight as its int8 data and scales, an int4 weight the C kernels' int4 products take as the packing they
read). A prompt token reads less (`prefill_bytes`): the recurrence's weights only, since the token-side
projection runs for the whole prompt at once and only the last position is decoded. The bandwidth is that of
reading a buffer of the same size: a step whose weights fit the L3 cache streams from it, a larger one from
DRAM, so the probe reads as many bytes as the step, timed alternately with the step (`ReadProbe`). limit = time
of that read; a figure's ratio to the limit is its time per token over the probe's time (1.0: the step costs its
bytes and nothing else).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from .. import memory_kernels
from ..recurrence_step import dequantized_by_linear

if TYPE_CHECKING:
    from torch import nn


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes a tensor occupies: its elements, or for a tensor subclass (a torchao quantized weight) the
    tensors it holds (`__tensor_flatten__`)."""
    flatten = getattr(type(tensor), "__tensor_flatten__", None)
    if flatten is None:
        return tensor.numel() * tensor.element_size()
    return sum(tensor_bytes(getattr(tensor, name)) for name in flatten(tensor)[0])


def weight_bytes(weight: torch.Tensor) -> int:
    """Bytes a step reads of `weight`: what it holds (`tensor_bytes`), but for a low-bit weight the C kernels'
    int4 products take (`memory_kernels.int4_packing`), the packing they read (two values a byte, a scale and an
    offset per group), not torchao's int4 values held a byte each: counted as held, the limit would be nearly
    twice the bytes actually read, and each ratio to it flattering. (Not counted among the kernels' operands:
    `int4_dequantized` tells why operands made kept the dequantized matrix, and a limit made none.)"""
    if dequantized_by_linear(weight) and memory_kernels.available():
        int4, _ = memory_kernels.int4_packing(weight)
        if int4 is not None:
            return sum(tensor_bytes(part) for part in int4[1] if part is not None)
    return tensor_bytes(weight)


def step_bytes(model: nn.Module, rows: int = 1) -> int:
    """Bytes a GPN's one-token step reads and writes at `rows` batch rows: every parameter once (the
    weights are shared by the rows), and per row the state (p and g read, M read and M' written)."""
    config = model.config
    weights = sum(weight_bytes(p) for p in model.parameters())
    cells = config.memory_cells if config.use_memory else 0
    return weights + rows * 4 * (2 * config.hidden_size + 2 * cells)


# parameters a prompt token does not read in the recurrence: the token side (its projection runs for every
# prompt position at once, before the steps) and the decoder (a prefill decodes only the last position)
_NOT_IN_THE_RECURRENCE = ("embed_tokens.", "fuse_norm.", "fuse_proj.", "decode_norm.", "decode_proj.", "lm_head.")


def prefill_bytes(model: nn.Module, rows: int = 1) -> int:
    """Bytes one prompt token's step reads at `rows` batch rows: the recurrence's weights once (not the
    token side, projected for the whole prompt beforehand, nor the decoder) and the state per row."""
    config = model.config
    core = getattr(model, "model", model)
    weights = sum(weight_bytes(p) for name, p in core.named_parameters() if not name.startswith(_NOT_IN_THE_RECURRENCE))
    cells = config.memory_cells if config.use_memory else 0
    return weights + rows * 4 * (2 * config.hidden_size + 2 * cells)


class ReadProbe:
    """A call reads `nbytes` once, as fast as this machine streams them from where the step's weights sit: on the
    CPU the C kernels' read (`memory_kernels.read_probe`, on the widest vectors the CPU has and torch's threads)
    where they are built, else `torch.sum`; on a GPU (`device`) `torch.sum` of a buffer in its memory. What the
    limit of a figure is measured with, alternated with the figure's own timings."""

    def __init__(self, nbytes: int, device: str | torch.device = "cpu"):
        from modeling_gpn import memory_kernels

        self.nbytes = nbytes
        self.device = torch.device(device)
        self.buffer = torch.ones(max(16, nbytes // 4), device=self.device)
        if self.device.type != "cpu":  # (a step on a GPU reads its weights from the GPU's memory, not the host's)
            self.kind = f"torch.sum on {self.device}"
            self._read = self.buffer.sum
            return
        if memory_kernels.available():  # (on the pages a plan's weights of this size sit on: huge ones from DRAM)
            memory_kernels.huge_pages_if_streamed([self.buffer])
        self.kind = f"C read kernel, {memory_kernels.products_isa()}" if memory_kernels.available() else "torch.sum"
        self._read = (lambda: memory_kernels.read_probe(self.buffer)) if memory_kernels.available() else self.buffer.sum

    def __call__(self) -> None:
        """Read the probe's buffer once."""
        self._read()

    def seconds(self, reads: int) -> list[float]:
        """`reads` timed reads, each after an untimed one: the bytes then sit where a decode loop's weights
        sit between its tokens (in L3 when they fit it, else in DRAM), not where whatever ran before left
        them."""
        times = []
        for _ in range(reads):
            self._read()
            self._synchronize()
            start = time.perf_counter()
            self._read()
            self._synchronize()
            times.append(time.perf_counter() - start)
        return times

    def _synchronize(self) -> None:
        if self.device.type == "cuda":  # (a GPU's read is launched, not done, when the call returns)
            torch.cuda.synchronize(self.device)
