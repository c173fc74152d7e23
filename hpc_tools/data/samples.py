"""``Samples``: a source's training windows of ``seq_length + 1`` tokens, and the seeded order in which a run visits
them (a permutation per epoch, or an O(1)-memory affine one over an already shuffled source). Every source builds
them: synthetic, files and tokenized text (``hpc_tools.train.data``), prepared indexed data (``data/indexed.py``).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable

import numpy as np


class Samples:
    """Training windows of ``seq_length + 1`` int64 tokens; ``samples[i]`` is a fresh numpy array."""

    def __init__(self, *, length: int, seq_length: int, seed: int, get: Callable[[int], np.ndarray], source: str,
                 get_rows: Callable[[np.ndarray], np.ndarray] | None = None, shuffle: bool = True):
        self._length = length
        self.seq_length = seq_length
        self.seed = seed
        self._get = get
        self._get_rows = get_rows
        self.source = source
        self.shuffle = shuffle
        """False: the samples are already in a seeded random order (megatron's shuffle index); epoch 0 keeps it and
        later epochs use an O(1)-memory affine permutation, so no per-rank array grows with the corpus."""

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> np.ndarray:
        if not 0 <= index < self._length:
            raise IndexError(f"sample {index} out of range 0..{self._length - 1}")
        return self._get(int(index))

    def __repr__(self) -> str:
        return f"Samples({self.source}, {self._length} x {self.seq_length + 1} tokens, seed {self.seed})"

    def rows(self, indices: np.ndarray) -> np.ndarray:
        """``samples[i]`` for every index, as one int64 array [len(indices), seq_length + 1]."""
        indices = np.asarray(indices, dtype=np.int64)
        if indices.size and (indices.min() < 0 or indices.max() >= self._length):
            raise IndexError(f"sample indices outside 0..{self._length - 1}")
        if self._get_rows is not None:
            return self._get_rows(indices)
        return np.stack([self._get(int(i)) for i in indices]) if indices.size else \
            np.zeros((0, self.seq_length + 1), dtype=np.int64)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The seeded permutation of sample indices for one epoch."""
        if not self.shuffle:
            return self.order_at(epoch, np.arange(self._length, dtype=np.int64))
        return _permutation(self.seed, epoch, self._length)

    def order_at(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        """``epoch_order(epoch)[positions]``, without building the whole order when the samples are unshuffled."""
        if self.shuffle:
            return _permutation(self.seed, epoch, self._length)[positions]
        if epoch == 0:
            return np.asarray(positions, dtype=np.int64)
        a, b = _affine(self.seed, epoch, self._length)
        if self._length > 1 << 32:  # a p could pass int64: Python integers
            return ((np.asarray(positions, dtype=object) * a + b) % self._length).astype(np.int64)
        return (np.asarray(positions, dtype=np.int64) * a + b) % self._length


@lru_cache(maxsize=4)
def _permutation(seed: int, epoch: int, length: int) -> np.ndarray:
    return np.random.default_rng([seed, 0x5EED, epoch]).permutation(length)


def _affine(seed: int, epoch: int, length: int) -> tuple[int, int]:
    """(a, b) with gcd(a, length) = 1: p -> (a p + b) mod length is a permutation of 0..length-1, seeded per epoch."""
    import math

    rng = np.random.default_rng([seed, 0xAFF1, epoch])
    b = int(rng.integers(length))
    top = max(min(length, 1 << 31), 2)
    a = int(rng.integers(1, top))
    while math.gcd(a, length) != 1:
        a = a % (top - 1) + 1
    return a, b
