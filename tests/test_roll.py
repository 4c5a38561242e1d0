"""``torch.roll`` on sharded dims is exact (issue 37): Swin's cyclic shift as a neighbour exchange.

A roll between two convolutions, against one process in float64 on a 2x2 grid of uneven shards
(11x9: shards of 6/5 and 5/4): every shift sign, shifts larger than a shard and larger than the
image, one axis only, a channels-last map (Swin's layout), a roll of channels and positions at
once. Forward, input and parameter gradients and weights after two steps, raw per-tensor errors.
A failure points at ``bigconv.ops.roll`` or ``bigconv.geometry.index_maps.Roll``; a roll without
dims is refused in the dry run, before remote work. SPMD and 3D: ``test_issue37_spmd.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bigconv.geometry.index_maps import Roll
from exactness import assert_exact, compare
from issue37_models import RollNet, roll_case

ROLLS = {
    "positive": ((3, 2), (2, 3), False),
    "negative": ((-2, -3), (2, 3), False),
    "mixed-signs": ((4, -1), (-2, -1), False),
    "beyond-a-shard": ((-7, 6), (2, 3), False),
    "beyond-the-image": ((25, -13), (2, 3), False),
    "one-axis": (5, 3, False),
    "repeated-dim": ((2, 3), (2, 2), False),
    "channels-last-swin": ((-3, -3), (1, 2), True),
    "channels-and-rows": ((1, 4), (1, 2), False),
}


def test_roll_map_is_torch_roll():
    for n in (1, 5, 9):
        for shift in range(-2 * n, 2 * n + 1):
            index = Roll(n, shift % n).taps((0, n))[0][0]
            assert np.array_equal(np.arange(n)[index], np.roll(np.arange(n), shift)), (n, shift)


@pytest.mark.world(4)
@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", sorted(ROLLS))
def test_roll_matches_single_process(world, name):
    model, x, y, loss = roll_case(*ROLLS[name])
    r = compare(model, world, x, y, loss, grid=(2, 2))
    assert_exact(r)


@pytest.mark.world(4)
@pytest.mark.timeout(120)
def test_roll_rpc_transport(world):
    model, x, y, loss = roll_case(*ROLLS["channels-last-swin"])
    assert_exact(compare(model, world, x, y, loss, grid=(2, 2), transport="rpc"))


@pytest.mark.world(4)
@pytest.mark.timeout(60)
def test_roll_without_dims_refused(refused_before_remote_work):
    class Flat(RollNet):
        def forward(self, x):
            return torch.roll(self.a(x), 3)

    refused_before_remote_work(Flat(0, None), ["torch.roll", "'<root>' (Flat)", "flattened tensor", "Give dims"])
