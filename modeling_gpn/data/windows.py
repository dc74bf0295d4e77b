"""Windows, the split and the deterministic order: the token stream cut into non-overlapping windows of
`seq_len` tokens, each an independent training row that starts from the zero state (as in the paper).

The last `val_fraction` of the windows is the held-out split; the training windows are visited in a
permutation drawn from the seed, one permutation per epoch, so the rows of step `s` depend only on
(seed, s): training is deterministic and resumable from a step number alone.
"""

from __future__ import annotations

import math

import numpy as np

from .errors import DataError
from .stream import TokenStream


class WindowDataset:
    """Non-overlapping `seq_len`-token windows of a `TokenStream`, split into train and held-out.

    The held-out split is the last `val_fraction` of the windows (at least one). Training rows for
    global step `step` are `rows_for_step(step, batch_size)`: a slice of a per-epoch permutation drawn
    from `seed`, so the data position of a run is its step number.
    """

    def __init__(self, stream: TokenStream, seq_len: int, val_fraction: float, seed: int):
        if seq_len < 2:
            raise DataError(f"seq_len must be at least 2, got {seq_len}")
        self.stream, self.seq_len, self.seed = stream, seq_len, seed
        total = len(stream) // seq_len
        num_val = max(1, int(math.floor(total * val_fraction))) if val_fraction > 0 else 0
        self.num_train = total - num_val
        self.num_val = num_val
        if self.num_train < 1:
            raise DataError(
                f"The corpus has {len(stream)} tokens: only {total} windows of {seq_len} tokens, too few for "
                f"a training split after holding out {num_val} for validation; use a larger corpus or a shorter --seq-len"
            )
        self._permutations: dict[int, np.ndarray] = {}

    def window(self, index: int) -> np.ndarray:
        """The training window at `index`: `seq_len` tokens."""
        return self.stream.tokens(index * self.seq_len, (index + 1) * self.seq_len)

    def train_window(self, position: int) -> np.ndarray:
        """The `position`-th training window seen (positions continue across epochs)."""
        epoch, offset = divmod(position, self.num_train)
        if epoch not in self._permutations:
            self._permutations = {epoch: np.random.default_rng([self.seed, epoch]).permutation(self.num_train)}
        return self.window(int(self._permutations[epoch][offset]))

    def batch(self, step: int, batch_size: int, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of the global batch of optimizer step `step` (0-based), (rows, seq_len)."""
        base = step * batch_size
        return np.stack([self.train_window(base + row) for row in range(start, stop)])

    def val_window(self, index: int) -> np.ndarray:
        """The held-out window at `index` (after the training windows)."""
        return self.window(self.num_train + index)

    def epochs(self, steps: int, batch_size: int) -> float:
        """Passes over the training windows that `steps` steps of `batch_size` make."""
        return steps * batch_size / self.num_train
