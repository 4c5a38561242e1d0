"""Pure geometry of spatial decomposition: grids, shard extents and halo regions.

Glossary: an *axis* is a grid axis, a *dim* is a tensor dimension. Spatial dims are the trailing
``len(grid)`` dims of an ``(N, C, *spatial)`` tensor. A *box* is one ``(start, stop)`` interval per
spatial dim, in global coordinates.

Nothing here touches tensors or processes, so every rule can be tested on its own.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Iterator, Sequence

Interval = tuple[int, int]
Box = tuple[Interval, ...]


def check_positive_int(value: object, what: str) -> int:
    """Return ``value`` as an int, or raise a ValueError naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} must be a positive integer, got {value!r} ({type(value).__name__})")
    if value <= 0:
        raise ValueError(f"{what} must be a positive integer, got {value}")
    return value


def balanced_bounds(size: int, parts: int) -> list[Interval]:
    """Split ``range(size)`` into ``parts`` contiguous intervals whose lengths differ by at most one."""
    return [((i * size) // parts, ((i + 1) * size) // parts) for i in range(parts)]


def coord_of(index: int, grid: Sequence[int]) -> tuple[int, ...]:
    """Row-major grid coordinate of worker ``index``."""
    coord = []
    for g in reversed(grid):
        coord.append(index % g)
        index //= g
    return tuple(reversed(coord))


def index_of(coord: Sequence[int], grid: Sequence[int]) -> int:
    """Row-major worker index of grid coordinate ``coord``."""
    index = 0
    for c, g in zip(coord, grid):
        index = index * g + c
    return index


def all_coords(grid: Sequence[int]) -> Iterator[tuple[int, ...]]:
    """Every grid coordinate in worker-index order."""
    return itertools.product(*(range(g) for g in grid))


def shard_box(shape: Sequence[int], grid: Sequence[int], coord: Sequence[int]) -> Box:
    """The part of a global spatial ``shape`` owned by the shard at ``coord``."""
    return tuple(balanced_bounds(n, g)[c] for n, g, c in zip(shape, grid, coord))


def batch_share(images: int, replicas: int, replica: int) -> Interval:
    """The images ``[lo, hi)`` of a batch of ``images`` that data-parallel replica ``replica`` of
    ``replicas`` trains on (balanced; every replica needs one)."""
    if images < replicas:
        raise ValueError(f"the batch has {images} images for {replicas} replicas; give every replica at least "
                         "one image (a larger batch, or fewer replicas)")
    return balanced_bounds(images, replicas)[replica]


def box_index(box: Box, dims: int, items: Interval | None = None) -> tuple[slice, ...]:
    """The index cutting the spatial ``box`` (and, given, the images ``items``) out of a tensor of
    ``dims`` dims whose trailing ``len(box)`` dims are spatial."""
    lead = [slice(None)] * (dims - len(box))
    if items is not None:
        lead[0] = slice(*items)
    return tuple(lead) + tuple(slice(a, b) for a, b in box)


def box_size(box: Box) -> tuple[int, ...]:
    return tuple(b - a for a, b in box)


def intersect(a: Box, b: Box) -> Box | None:
    """Intersection of two boxes, or None when it is empty."""
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return out if all(lo < hi for lo, hi in out) else None


def validate_grid(grid: Sequence[int], workers: int) -> tuple[int, ...]:
    """Check a user grid against the worker count and return it as a tuple."""
    if not isinstance(grid, (tuple, list)) or len(grid) == 0:
        raise ValueError(f"grid must be a tuple with one entry per spatial dim, e.g. (2, 2); got {grid!r}")
    for axis, g in enumerate(grid):
        check_positive_int(g, f"grid[{axis}]")
    if math.prod(grid) != workers:
        raise ValueError(
            f"grid {tuple(grid)} has {math.prod(grid)} shards but the world has {workers} workers; "
            f"pick a grid whose product is {workers}, or pass grid=None to choose one automatically"
        )
    return tuple(grid)


def _factorizations(n: int, k: int) -> Iterator[tuple[int, ...]]:
    if k == 1:
        yield (n,)
        return
    for f in range(1, n + 1):
        if n % f == 0:
            for rest in _factorizations(n // f, k - 1):
                yield (f, *rest)


def choose_grid(shape: Sequence[int], workers: int) -> tuple[int, ...]:
    """The grid of ``workers`` shards over ``shape`` with the smallest total cut surface.

    The cut surface is the halo traffic of a 3x3 kernel up to a constant, so this is the balanced
    factorization: square images get square grids, long images get cuts across the long axis.
    """
    check_positive_int(workers, "workers")
    best: tuple[float, tuple[int, ...]] | None = None
    volume = math.prod(shape)
    for grid in _factorizations(workers, len(shape)):
        if any(g > n for g, n in zip(grid, shape)):
            continue
        surface = sum((g - 1) * volume / n for g, n in zip(grid, shape))
        if best is None or (surface, grid) < best:
            best = (surface, grid)
    if best is None:
        raise ValueError(
            f"an image of spatial shape {tuple(shape)} cannot be split into {workers} non-empty shards; "
            "use fewer workers or a larger image"
        )
    return best[1]


@dataclass(frozen=True)
class Window:
    """The receptive-field arithmetic of one spatial dim of a sliding-window op.

    Output index ``o`` reads inputs ``o * stride - pad_lo + dilation * j`` for ``j < kernel``.
    Inputs outside ``[0, n)`` are the global border padding.
    """

    kernel: int
    stride: int = 1
    dilation: int = 1
    pad_lo: int = 0
    pad_hi: int = 0
    ceil_mode: bool = False
    """Pooling's ``ceil_mode``: a last, partial window that starts inside the image or its low padding."""

    @property
    def span(self) -> int:
        return self.dilation * (self.kernel - 1) + 1

    def out_size(self, n: int) -> int:
        if not self.ceil_mode:
            return (n + self.pad_lo + self.pad_hi - self.span) // self.stride + 1
        out = -(-(n + self.pad_lo + self.pad_hi - self.span) // self.stride) + 1
        return out - 1 if (out - 1) * self.stride >= n + self.pad_lo else out

    def input_interval(self, out: Interval) -> Interval:
        """The (unclipped) input interval that output interval ``out`` reads."""
        o0, o1 = out
        return o0 * self.stride - self.pad_lo, (o1 - 1) * self.stride - self.pad_lo + self.span


@dataclass(frozen=True)
class TransposedWindow:
    """One spatial dim of a transposed convolution, in the interface of ``Window``.

    Input ``i`` adds into outputs ``i * stride - padding + dilation * j`` for ``j < kernel``;
    ``output_padding`` extends the output at the high end only.
    """

    kernel: int
    stride: int = 1
    dilation: int = 1
    padding: int = 0
    output_padding: int = 0

    @property
    def span(self) -> int:
        return self.dilation * (self.kernel - 1) + 1

    def out_size(self, n: int) -> int:
        return (n - 1) * self.stride - 2 * self.padding + self.span + self.output_padding

    def input_interval(self, out: Interval) -> Interval:
        """Inputs that write into output interval ``out`` (may be empty at the output padding)."""
        o0, o1 = out
        lo = -(-(o0 + self.padding - self.span + 1) // self.stride)
        hi = (o1 - 1 + self.padding) // self.stride + 1
        return lo, max(lo, hi)

    def output_origin(self, first_input: int) -> int:
        """Global output index of position 0 of a padding-free transposed conv that starts at ``first_input``."""
        return first_input * self.stride - self.padding


@dataclass(frozen=True)
class HaloPlan:
    """What one shard needs to compute its part of a windowed op's output.

    ``need`` is the input box, clipped to the image; ``pad`` is the global-border padding
    ``(lo, hi)`` per dim that completes it; ``owners`` lists, per dim, the grid coordinate along
    that axis and the interval it contributes, in order.
    """

    out_box: Box
    need: Box
    pad: tuple[Interval, ...]
    owners: tuple[tuple[tuple[int, Interval], ...], ...]

    def pieces(self) -> Iterator[tuple[tuple[int, ...], Box]]:
        """Every (owner coordinate, box) that tiles ``need``, in row-major order."""
        for combo in itertools.product(*self.owners):
            yield tuple(c for c, _ in combo), tuple(iv for _, iv in combo)


def halo_plan(
    in_shape: Sequence[int], grid: Sequence[int], coord: Sequence[int], windows: Sequence[Window]
) -> HaloPlan:
    """Plan the input region of shard ``coord`` for a windowed op over ``in_shape``.

    The output is partitioned like every tensor (balanced over the grid); this works back to the
    inputs each output range reads. Owners need not be direct neighbours, so shards thinner than
    a halo are handled by the same rule.
    """
    out_shape = [w.out_size(n) for w, n in zip(windows, in_shape)]
    out_box = shard_box(out_shape, grid, coord)
    need, pad, owners = [], [], []
    for w, n, g, out in zip(windows, in_shape, grid, out_box):
        lo, hi = w.input_interval(out)
        clipped = (max(lo, 0), min(hi, n))
        need.append(clipped)
        pad.append((clipped[0] - lo, hi - clipped[1]))
        axis_owners = []
        for c, (a, b) in enumerate(balanced_bounds(n, g)):
            part = (max(a, clipped[0]), min(b, clipped[1]))
            if part[0] < part[1]:
                axis_owners.append((c, part))
        owners.append(tuple(axis_owners))
    return HaloPlan(tuple(out_box), tuple(need), tuple(pad), tuple(owners))


def local_slices(box: Box, origin: Box) -> tuple[slice, ...]:
    """Slices that cut global ``box`` out of a tensor whose spatial extent is ``origin``."""
    return tuple(slice(a - o0, b - o0) for (a, b), (o0, _) in zip(box, origin))
