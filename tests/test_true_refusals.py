"""Refusals that name the op that blocks and a true reason, and the rules that replaced three wrong ones
(issue 37, item 6).

- MONAI VoxelMorph was refused at ``getset_descriptor.__set__`` (its ``ref_grid.requires_grad = False``):
  setting that flag and ``grid[..., i] = ...`` on channels are local now, and it is refused at
  ``grid_sample`` (data-dependent positions anywhere in the image); held whole (``bigconv.hold_whole(model,
  Warp)``) it trains exactly.
- EdgeNeXt was refused at a ``cumsum`` over rows "reducing some spatial dims": a running sum along a
  sharded dim is a prefix sum across shards (``bigconv.ops.reduce``), the row counts divided by their last
  row broadcast along the other dim (``bigconv.ops.layout.pointwise``), and its cross-covariance attention
  normalizes channels over all positions (a global norm: ``bigconv.ops.windows``); ``timm/edgenext_xx_small``
  is a zoo entry now.
- SegFormer MiT's LayerNorm: ``tests/test_views.py``.
Exact against one process in float64 on a 2x2 grid (``tests/exactness.py``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from exactness import assert_exact, compare

import bigconv


class CountsAndCovariance(nn.Module):
    """EdgeNeXt's habits on a small map: cumsum over rows and columns, divided by the last row and column,
    a channel written in place, channels L2-normalized over all positions, channel-by-channel attention."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(1, 4, 3, padding=1), nn.Conv2d(4, 2, 3, padding=1)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        rows, cols = h.cumsum(2), torch.cumsum(h, dim=3)
        h = h + rows / (rows[:, :, -1:, :].abs() + 1) + cols / (cols[..., -1:].abs() + 1)
        h[:, 0] = h[:, 0] * 2
        b, c, hh, ww = h.shape
        f = h.reshape(b, c, hh * ww)
        q = F.normalize(f, dim=-1)
        attn = (q @ q.transpose(-2, -1)).softmax(-1)
        return self.b((attn @ f).reshape(b, c, hh, ww))


@pytest.mark.world(4)
@pytest.mark.timeout(120)
def test_prefix_sums_global_norms_and_channel_writes_are_exact(world):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 1, 11, 10, generator=g, dtype=torch.float64)  # uneven shards: 6/5 rows, 5/5 columns
    y = torch.randn(2, 2, 11, 10, generator=g, dtype=torch.float64)
    assert_exact(compare(CountsAndCovariance().double(), world, x, y, nn.MSELoss(), grid=(2, 2)))


class Pair(nn.Module):
    """VoxelMorph on a two-channel input: moving and fixed image, the warped image out."""

    def __init__(self) -> None:
        super().__init__()
        from monai.networks.nets import VoxelMorph
        from monai.networks.nets.voxelmorph import VoxelMorphUNet

        unet = VoxelMorphUNet(2, 2, 4, channels=(4, 4, 4, 4), final_conv_channels=(4, 4))
        self.net = VoxelMorph(backbone=unet, integration_steps=3, spatial_dims=2)

    def forward(self, x):
        return self.net(x[:, :1], x[:, 1:])[0]


@pytest.mark.world(4)
@pytest.mark.timeout(120)
def test_voxelmorph_refused_at_grid_sample(refused_before_remote_work):
    torch.manual_seed(0)
    refused_before_remote_work(Pair(), ["grid_sample", "'net.dvf2ddf.warp_layer' (Warp)",
                                        "positions its grid names", "bigconv.hold_whole(model, Warp)"],
                               shape=(1, 2, 32, 32))


@pytest.mark.zoo
@pytest.mark.world(4)
@pytest.mark.timeout(300)
def test_voxelmorph_with_its_warp_held_whole_trains_exactly(world):
    from monai.networks.blocks.warp import Warp

    torch.manual_seed(0)
    model = bigconv.hold_whole(Pair().double(), Warp)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 2, 32, 32, generator=g, dtype=torch.float64)
    y = torch.randn(1, 1, 32, 32, generator=g, dtype=torch.float64)
    assert_exact(compare(model, world, x, y, nn.MSELoss(), grid=(2, 2)))
