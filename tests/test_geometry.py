"""Pure geometry: partitions, grid choice, receptive fields and halo plans, with no processes.

These rules decide what every worker computes; a bug here shows up as wrong windows everywhere.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from bigconv.geometry.boxes import (
    Window, all_coords, balanced_bounds, choose_grid, coord_of, halo_plan, index_of, intersect, shard_box,
    validate_grid,
)
from bigconv.ops.window import conv_windows


@pytest.mark.parametrize("size,parts", [(10, 3), (7, 7), (100, 8), (5, 1)])
def test_balanced_bounds_tile_the_range(size, parts):
    bounds = balanced_bounds(size, parts)
    assert bounds[0][0] == 0 and bounds[-1][1] == size
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    lengths = [b - a for a, b in bounds]
    assert max(lengths) - min(lengths) <= 1


def test_coords_round_trip():
    grid = (2, 3, 4)
    assert [index_of(c, grid) for c in all_coords(grid)] == list(range(24))
    assert all(coord_of(i, grid) == c for i, c in enumerate(all_coords(grid)))


@pytest.mark.parametrize("shape,workers,expect", [
    ((64, 64), 4, (2, 2)), ((256, 64), 4, (4, 1)), ((64, 64, 64), 8, (2, 2, 2)), ((100,), 6, (6,)),
    ((3, 50), 6, (1, 6)),
])
def test_choose_grid_minimises_cut_surface(shape, workers, expect):
    assert choose_grid(shape, workers) == expect


def test_choose_grid_refuses_impossible_split():
    with pytest.raises(ValueError, match="cannot be split"):
        choose_grid((2, 2), 5)


@pytest.mark.parametrize("grid,workers,match", [
    ((2, 3), 4, "product is 4"), ((2, 2.0), 4, "positive integer"), ((-2, -2), 4, "positive integer"),
    ((), 1, "one entry per spatial dim"), ("22", 4, "one entry"),
])
def test_validate_grid_errors(grid, workers, match):
    with pytest.raises(ValueError, match=match):
        validate_grid(grid, workers)


def _conv_cases():
    for k, s, d, p in itertools.product((1, 2, 3, 4, 7), (1, 2, 3), (1, 2), (0, 1, 3, "same", "valid")):
        if p == "same" and s != 1:
            continue
        yield k, s, d, p


@pytest.mark.parametrize("k,s,d,p", list(_conv_cases()))
def test_window_matches_torch_conv(k, s, d, p):
    """Output size and every output's input window agree with F.conv1d, padding included."""
    n = 17
    (w,) = conv_windows((k,), s, p, d)
    x = torch.arange(n, dtype=torch.float64).view(1, 1, n) + 1
    weight = torch.zeros(1, 1, k, dtype=torch.float64)
    out_size = F.conv1d(x, weight, stride=s, padding=p, dilation=d).shape[-1]
    assert w.out_size(n) == out_size
    for j in range(k):  # a one-hot kernel reads input o*s - pad_lo + d*j
        weight.zero_()
        weight[..., j] = 1
        out = F.conv1d(x, weight, stride=s, padding=p, dilation=d)[0, 0]
        for o in range(out_size):
            i = o * s - w.pad_lo + d * j
            assert out[o].item() == (i + 1 if 0 <= i < n else 0)


@pytest.mark.parametrize("shape,grid", [((13, 11), (2, 2)), ((9,), (4,)), ((7, 6, 9), (2, 1, 2)), ((5, 40), (1, 8))])
def test_halo_plan_pieces_tile_the_need(shape, grid):
    windows = [Window(5, 1, 2, 4, 4)] * len(shape)
    for coord in all_coords(grid):
        plan = halo_plan(shape, grid, coord, windows)
        volume = 0
        for owner, box in plan.pieces():
            assert intersect(box, shard_box(shape, grid, owner)) == box
            volume += math.prod(b - a for a, b in box)
        assert volume == math.prod(b - a for a, b in plan.need)
