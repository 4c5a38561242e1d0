"""Halo attention on shards, split by the op rules (issue 37, item 3): timm ``HaloAttn``, halonet's.

``HaloAttn`` partitions its queries into blocks (a window partition, ``bigconv.ops.windows``) and
builds each block's keys and values from the block and a halo around it: ``F.pad`` by the halo, then
``Tensor.unfold`` of both spatial dims (``bigconv.ops.unfold``: each shard's windows from the input
range they read, joined from the owners by the exchange a convolution of the window's kernel and the
block's stride uses). Its relative-position logits merge the block's rows into the windows' batch dim
(``shards.WindowGrid``'s whole items behind the windows). Against one process in float64 on a 2x2
grid, judged by ``bigconv.verify.compare_training``: forward, input and parameter gradients, weights
after two steps. A failure points at the unfold rule (the halo's input range, the window dim's place)
or at the positions reshapes (``bigconv.ops.windows.positions_to_map``: whole items around the windows).
"""

from __future__ import annotations


import pytest
import torch
import torch.nn as nn
from issue37_models import NeighbourhoodNet, TimmAttention
from verdicts import assert_exact, verdict as _verdict



DEFAULT = {"halo-1", "k4-even-dilated", "k3-im2col"}
"""The cases in the default test command (about 8 s each on two cores); the others run with ``-m zoo``."""

HALO_CASES = {
    # name: (block, halo, stride, input shape): the map is half the input
    "halo-1": (2, 1, 1, (2, 1, 16, 16)),  # 8x8 map, 4x4 per shard: 2x2 blocks of 2, keys of 4x4
    "halo-beyond-block": (2, 3, 1, (2, 1, 16, 16)),  # windows of 8: a halo of 3 from a shard of 4
    "strided": (4, 1, 2, (2, 1, 16, 16)),  # queries at stride 2 (halonet's stage transition): blocks of 2
    "rectangular": (2, 1, 1, (2, 1, 24, 16)),  # 12x8 map: 3x2 blocks per shard
    "held-whole": (4, 2, 1, (2, 1, 8, 8)),  # 4x4 map, one block: fewer windows than shards, held whole
}


@pytest.mark.world(4)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", [c if c in DEFAULT else pytest.param(c, marks=pytest.mark.zoo) for c in sorted(HALO_CASES)])
def test_timm_halo_attention_split_exactly(world, case):
    block, halo, stride, shape = HALO_CASES[case]
    torch.manual_seed(0)
    model = TimmAttention("halo", block=block, halo=halo, stride=stride).double()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    assert_exact(_verdict(model, world, x, torch.tensor([0, 2])))


NEIGHBOURHOOD_CASES = {
    # name: (kernel, dilation, F.unfold instead of Tensor.unfold)
    "k3": (3, 1, False),
    "k4-even": (4, 1, False),
    "k3-dilated": (3, 2, False),
    "k4-even-dilated": (4, 2, False),
    "k3-im2col": (3, 1, True),
    "k7-beyond-half-a-shard": (7, 1, False),
}


@pytest.mark.world(4)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", [c if c in DEFAULT else pytest.param(c, marks=pytest.mark.zoo)
                                  for c in sorted(NEIGHBOURHOOD_CASES)])
def test_neighbourhood_attention_split_exactly(world, case):
    """NATTEN's legacy torch pattern (``issue37_models.NeighbourhoodAttention``): the keys' windows by unfold
    (a halo of k - 1), clamped at the map's borders by a replicate pad of the map of windows (an index map),
    dilation as a partition of both dims into (n / d, d); 16x16 on 2x2 shards of 8x8."""
    kernel, dilation, fold = NEIGHBOURHOOD_CASES[case]
    torch.manual_seed(0)
    model = NeighbourhoodNet(kernel, dilation, fold).double()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 1, 16, 16, generator=g, dtype=torch.float64)
    y = torch.randn(2, 2, 16, 16, generator=g, dtype=torch.float64)
    assert_exact(_verdict(model, world, x, y, nn.MSELoss()))
