"""The halo exchange on its own: forward against slicing the padded image, and the adjoint test.

F maps a sharded image to each shard's zero-padded input window. Forward: every window must equal
the same slice of the globally padded image. Adjoint: <F x, y> = <x, F^T y>, with F^T run by
distributed autograd; a mismatch means a halo's gradient went to the wrong owner or was lost.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bigconv.halo_adjoint import halo_adjoint
from bigconv.engine.executor import pad_spec
from bigconv.geometry.boxes import Window, all_coords, halo_plan

CASES = [
    ("2x2-k3", (2, 2), (13, 11), [Window(3, 1, 1, 1, 1)] * 2),
    ("4x1-k7-d2-s2", (4, 1), (23, 9), [Window(7, 2, 2, 3, 5), Window(3, 1, 1, 0, 0)]),
    ("1x4-thin", (1, 4), (6, 7), [Window(5, 1, 1, 2, 2), Window(7, 1, 1, 3, 3)]),  # owners two shards away
]


@pytest.mark.world(4)
@pytest.mark.parametrize("grid,shape,windows", [pytest.param(*c[1:], id=c[0]) for c in CASES])
def test_halo_windows_and_adjoint(world, grid, shape, windows):
    x = torch.randn(2, 3, *shape, dtype=torch.float64)
    r = halo_adjoint(world, x, grid, windows)
    padded = F.pad(x, pad_spec([(w.pad_lo, w.pad_hi) for w in windows]))
    for coord, window in zip(all_coords(grid), r["windows"]):
        plan = halo_plan(shape, grid, coord, windows)
        lo = [w.input_interval(o)[0] + w.pad_lo for w, o in zip(windows, plan.out_box)]
        expect = padded[(..., *(slice(a, a + s) for a, s in zip(lo, window.shape[2:])))]
        assert torch.equal(window, expect), f"window of shard {coord} differs from the padded image"
    lhs, rhs = r["forward_inner"], r["adjoint_inner"]
    assert abs(lhs - rhs) <= 1e-12 * max(abs(lhs), 1.0), (lhs, rhs)
