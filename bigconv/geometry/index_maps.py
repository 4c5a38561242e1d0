"""Separable index maps: ops whose every output is a fixed weighted sum of a few inputs per dim.

Upsampling (nearest, linear) and the padding modes reflect, replicate and circular are such maps:
along each spatial dim, output ``o`` is ``sum_k weight_k[o] * input[index_k[o]]``. Written in
global coordinates, the same formulas give every shard its outputs exactly, whatever inputs they
read from other shards (circular padding reads the far end of the image).

Pure arithmetic: no tensors or processes here. The index formulas follow PyTorch's CPU kernels
(``UpSample.h``), so results match a single process, not just approximately.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

Taps = list[tuple[list[int], list[float] | None]]
"""Per dim: a list of (input index per output, weight per output or None for weight 1)."""


@dataclass(frozen=True)
class Resize:
    """One dim of ``F.interpolate`` from ``n_in`` to ``n_out`` positions."""

    n_in: int
    n_out: int
    mode: str  # "nearest", "nearest-exact", "linear" or "cubic"
    align_corners: bool = False
    scale: float | None = None
    """The user's scale factor, when PyTorch uses it instead of ``n_in / n_out``."""

    def taps(self, out: tuple[int, int]) -> Taps:
        o = np.arange(out[0], out[1])
        if self.mode in ("nearest", "nearest-exact"):
            return [(self._nearest(o).tolist(), None)]
        if self.mode == "cubic":
            return self._cubic(o)
        return self._linear(o)

    def _nearest(self, o: np.ndarray) -> np.ndarray:
        if self.n_out == self.n_in:
            return o
        if self.n_out == 2 * self.n_in and self.mode == "nearest":
            return o >> 1
        # PyTorch computes nearest indices in float32 (floorf), and so must we to pick the same ones.
        scale = np.float32(1.0 / self.scale) if self.scale else np.float32(self.n_in) / np.float32(self.n_out)
        offset = np.float32(0.5) if self.mode == "nearest-exact" else np.float32(0.0)
        src = np.floor((o.astype(np.float32) + offset) * scale).astype(np.int64)
        return np.minimum(src, self.n_in - 1)

    def _linear(self, o: np.ndarray) -> Taps:
        if self.align_corners:
            scale = (self.n_in - 1) / (self.n_out - 1) if self.n_out > 1 else 0.0
            src = scale * o
        else:
            scale = 1.0 / self.scale if self.scale else self.n_in / self.n_out
            src = np.maximum(scale * (o + 0.5) - 0.5, 0.0)
        i0 = np.minimum(np.floor(src).astype(np.int64), self.n_in - 1)
        lam = np.clip(src - i0, 0.0, 1.0)
        i1 = i0 + (i0 < self.n_in - 1)
        return [(i0.tolist(), (1.0 - lam).tolist()), (i1.tolist(), lam.tolist())]


    def _cubic(self, o: np.ndarray) -> Taps:
        """Four taps per output, as PyTorch's CPU kernel (``HelperInterpCubic``): the source index unclamped
        (``cubic=True``), its floor taken in float32 (``floorf``), the Keys kernel with ``A = -0.75``, and the
        four inputs clamped to the image (a 2-position halo each side)."""
        if self.align_corners:
            scale = (self.n_in - 1) / (self.n_out - 1) if self.n_out > 1 else 0.0
            src = scale * o
        else:
            scale = 1.0 / self.scale if self.scale else self.n_in / self.n_out
            src = scale * (o + 0.5) - 0.5
        i0 = np.floor(src.astype(np.float32)).astype(np.int64)
        t = src - i0
        a = -0.75

        def near(x):  # |x| <= 1
            return ((a + 2) * x - (a + 3)) * x * x + 1

        def far(x):  # 1 < |x| < 2
            return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a

        weights = (far(t + 1), near(t), near(1 - t), far(2 - t))
        return [(np.clip(i0 - 1 + k, 0, self.n_in - 1).tolist(), w.tolist()) for k, w in enumerate(weights)]


@dataclass(frozen=True)
class Flip:
    """One dim of ``torch.flip``: output ``o`` is input ``n - 1 - o``. On shards, the shards' order reversed
    and each part flipped: a shard's outputs read the mirror shard's inputs (itself at the middle)."""

    n_in: int

    @property
    def n_out(self) -> int:
        return self.n_in

    def taps(self, out: tuple[int, int]) -> Taps:
        return [((self.n_in - 1 - np.arange(out[0], out[1])).tolist(), None)]


@dataclass(frozen=True)
class PadMap:
    """One dim of ``F.pad`` in mode reflect, replicate or circular (``lo``/``hi`` may be negative: crop)."""

    n_in: int
    lo: int
    hi: int
    mode: str

    @property
    def n_out(self) -> int:
        return self.n_in + self.lo + self.hi

    def taps(self, out: tuple[int, int]) -> Taps:
        i = np.arange(out[0], out[1]) - self.lo
        n = self.n_in
        if self.mode == "replicate":
            src = np.clip(i, 0, n - 1)
        elif self.mode == "circular":
            src = np.mod(i, n)
        elif self.mode == "reflect":
            period = 2 * (n - 1)
            src = np.abs(np.mod(i, period)) if period else np.zeros_like(i)
            src = np.where(src >= n, period - src, src)
        else:
            raise ValueError(f"unknown padding mode {self.mode!r}")
        return [(src.tolist(), None)]


@dataclass(frozen=True)
class Roll:
    """One dim of ``torch.roll`` by ``shift``: output ``o`` is input ``(o - shift) mod n``.

    On shards this is a neighbour exchange of ``|shift|`` positions (more neighbours when the shift
    exceeds a shard), with the wrap-around between the first and last shards, exact both ways: the
    backward of a gather of inputs is the scatter-add of their gradients.
    """

    n_in: int
    shift: int

    @property
    def n_out(self) -> int:
        return self.n_in

    def taps(self, out: tuple[int, int]) -> Taps:
        return [(np.mod(np.arange(out[0], out[1]) - self.shift, self.n_in).tolist(), None)]


def needed(taps: Taps) -> list[int]:
    """The sorted distinct inputs a list of taps reads."""
    return sorted({i for idx, _ in taps for i in idx})


def runs(indices: Sequence[int], bounds: Sequence[tuple[int, int]]) -> list[tuple[int, tuple[int, int]]]:
    """Split sorted ``indices`` into contiguous runs that each lie in one owner's interval.

    Returns (owner, (start, stop)) in index order; ``bounds`` are the owners' intervals.
    """
    out: list[tuple[int, tuple[int, int]]] = []
    for i in indices:
        owner = next(c for c, (a, b) in enumerate(bounds) if a <= i < b)
        if out and out[-1][0] == owner and out[-1][1][1] == i:
            out[-1] = (owner, (out[-1][1][0], i + 1))
        else:
            out.append((owner, (i, i + 1)))
    return out


def resize_sizes(in_shape: Sequence[int], size, scale_factor, recompute_scale_factor) -> tuple[list[int], list]:
    """Output sizes and the per-dim scale PyTorch's kernels use, as ``F.interpolate`` computes them."""
    dims = len(in_shape)
    if size is not None:
        sizes = [size] * dims if isinstance(size, int) else list(size)
        return [int(s) for s in sizes], [None] * dims
    factors = [scale_factor] * dims if isinstance(scale_factor, (int, float)) else list(scale_factor)
    sizes = [math.floor(n * float(f)) for n, f in zip(in_shape, factors)]
    scales = [None] * dims if recompute_scale_factor else [float(f) for f in factors]
    return sizes, scales
