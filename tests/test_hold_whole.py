"""Attention modules held whole (``bigconv.hold_whole``) train exactly on shards (issue 37).

Window attention (torchvision Swin v1/v2), global MHSA (timm's ``BottleneckAttn``, botnet's), halo
attention (timm's ``HaloAttn``) and MONAI's SwinUNETR encoder are not split by the op rules; held
whole, each call gathers its input on every shard, runs the library's own forward and keeps this
shard's part of the output (``bigconv.ops.whole``). Against one process in float64 on a 2x2 grid:
every output, the input gradient, every parameter gradient and every weight after two steps,
raw per-tensor errors. A failure points at ``bigconv.ops.whole`` (the gather's gradient, the local
part of the output), or at the layout-aware ``F.pad``/slicing that Swin's channels-last stages use.
Without ``hold_whole`` the dry run refuses these models, naming the module and this fix.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import bigconv
from bigconv.compat import allow_torchvision_without_ops
from exactness import assert_exact, compare
from issue37_models import TimmAttention, tiny_swin

allow_torchvision_without_ops()  # before torchvision (and timm, which imports it)


def _swin(v2: bool):
    from torchvision.models.swin_transformer import ShiftedWindowAttention, ShiftedWindowAttentionV2

    return bigconv.hold_whole(tiny_swin(v2), ShiftedWindowAttention, ShiftedWindowAttentionV2).double()


def _timm(kind: str):
    from timm.layers.bottleneck_attn import BottleneckAttn
    from timm.layers.halo_attn import HaloAttn

    return bigconv.hold_whole(TimmAttention(kind), BottleneckAttn, HaloAttn).double()


@pytest.mark.world(4)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name,factory,shape", [
    ("swin-v1", lambda: _swin(False), (2, 3, 32, 32)),
    ("swin-v2", lambda: _swin(True), (2, 3, 32, 32)),
    ("swin-v1-unaligned", lambda: _swin(False), (2, 3, 36, 28)),  # 9x7 patches: windows padded
    ("timm-bottleneck-mhsa", lambda: _timm("bottleneck"), (2, 1, 12, 12)),
    ("timm-halo", lambda: _timm("halo"), (2, 1, 12, 12)),
])
def test_held_attention_matches_single_process(world, transport, name, factory, shape):
    torch.manual_seed(0)
    model = factory()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    r = compare(model, world, x, torch.tensor([0, 2]), nn.CrossEntropyLoss(), grid=(2, 2), transport=transport)
    assert_exact(r)


@pytest.mark.world(4)
@pytest.mark.timeout(300)
def test_swin_unetr_2d_encoder_held_whole(world):
    from monai.networks.nets import SwinUNETR
    from monai.networks.nets.swin_unetr import SwinTransformer

    torch.manual_seed(0)
    model = SwinUNETR(in_channels=1, out_channels=2, feature_size=12, spatial_dims=2, depths=(1, 1, 1, 1),
                      num_heads=(1, 1, 1, 1))
    model = bigconv.hold_whole(model, SwinTransformer).double()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 1, 64, 64, generator=g, dtype=torch.float64)  # 2x2 at the deepest stage
    y = torch.randn(1, 2, 64, 64, generator=g, dtype=torch.float64)
    assert_exact(compare(model, world, x, y, nn.MSELoss(), grid=(2, 2)))


@pytest.mark.world(4)
@pytest.mark.timeout(120)
def test_global_attention_refused_with_the_fix(refused_before_remote_work):
    """Window attention and botnet's global MHSA are split by the rules now (tests/test_attention_windows.py,
    tests/test_ring_attention.py); timm's lambda layer (positions reshaped with the heads) is still refused,
    naming this fix."""
    from timm.layers.lambda_layer import LambdaLayer

    model = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), LambdaLayer(8, 8, num_heads=2, dim_head=4, r=3))
    refused_before_remote_work(model.double(), ["LambdaLayer", "bigconv.hold_whole(model, LambdaLayer)"],
                               shape=(2, 1, 12, 12))


@pytest.mark.world(4)
@pytest.mark.timeout(120)
def test_holding_a_module_given_flattened_positions_refused(refused_before_remote_work):
    """Flattened positions are in each shard's own order: a held module would silently mix them up."""

    class Tokens(nn.Module):
        def forward(self, t):
            return t.softmax(-1)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.tokens = nn.Conv2d(1, 2, 3, padding=1), Tokens()

        def forward(self, x):
            return self.tokens(self.conv(x).flatten(2)).sum(-1)

    refused_before_remote_work(bigconv.hold_whole(Net(), Tokens), ["'tokens' (Tokens)", "positions flattened",
                                                                  "one level up"])
