"""Box-consistent augmentation: flips and 90° rotations of a 2D image as remapped boxes.

A view of an image is a crop (a box of the stored level, which may reach beyond the image) seen
through one of the 8 symmetries of the square (``dihedral`` k: ``k % 4`` quarter turns as
``np.rot90`` makes them, then a left-right flip when ``k >= 4``). A worker reading box B of the view
reads the one stored box that maps onto B, and turns the array it read: the same pixels one process
gets by transforming the whole image, without reading anything else.
"""

from __future__ import annotations

import numpy as np

Box = tuple[tuple[int, int], ...]


def view_shape(crop_shape: tuple[int, int], dihedral: int) -> tuple[int, int]:
    h, w = crop_shape
    return (w, h) if dihedral % 4 in (1, 3) else (h, w)


def _undo(i: int, j: int, shape: tuple[int, int], dihedral: int) -> tuple[int, int]:
    """The crop position that lands on view position (i, j); ``shape`` is the crop's (H, W)."""
    shapes = [shape]
    for _ in range(dihedral % 4):
        shapes.append((shapes[-1][1], shapes[-1][0]))
    if dihedral >= 4:  # the flip came last: undo it first
        j = shapes[-1][1] - 1 - j
    for before in reversed(shapes[:-1]):  # np.rot90: out[i, j] = a[j, W_before - 1 - i]
        i, j = j, before[1] - 1 - i
    return i, j


def preimage(box: Box, crop_shape: tuple[int, int], dihedral: int) -> Box:
    """The box of the crop whose pixels make up ``box`` of the view."""
    (i0, i1), (j0, j1) = box
    corners = [_undo(i, j, crop_shape, dihedral) for i in (i0, i1 - 1) for j in (j0, j1 - 1)]
    rows, cols = [c[0] for c in corners], [c[1] for c in corners]
    return (min(rows), max(rows) + 1), (min(cols), max(cols) + 1)


def apply(data: np.ndarray, dihedral: int) -> np.ndarray:
    """``data`` (C, H, W) as the view sees it."""
    out = np.rot90(data, k=dihedral % 4, axes=(1, 2))
    if dihedral >= 4:
        out = out[:, :, ::-1]
    return np.ascontiguousarray(out)
