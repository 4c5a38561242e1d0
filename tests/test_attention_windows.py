"""Window attention on shards, split by the op rules (issue 37, item 1): no gather, no ``hold_whole``.

A window partition (``view`` splitting a sharded spatial dim into ``(windows, window)``) is local
when every shard holds whole windows; the permutes, the merge of windows with the batch, the
attention inside each window (linear, batched matmul, softmax, ``scaled_dot_product_attention``),
Swin's shifted-window mask (built for the whole image, a row per window: cut to this shard's
windows) and the reverse merge run shard by shard (``bigconv.ops.windows``). Against one process in
float64 on a 2x2 grid, judged by ``bigconv.verify.compare_training``'s verdict: forward, input and
parameter gradients, weights after two steps. A failure points at ``bigconv.ops.windows`` (the
reshape groups, the window grid's lead, the mask's local rows) or at the positions rules
(``bigconv.ops.positions``: batched matmul, full-extent operands). Sizes whose shards cut windows
are refused in the dry run, naming the window and sizes that work.
"""

from __future__ import annotations


import pytest
import torch
import torch.nn as nn
from issue37_models import tiny_swin
from verdicts import assert_exact, verdict as _verdict

from bigconv.compat import allow_torchvision_without_ops

allow_torchvision_without_ops()  # before torchvision (and timm, which imports it)


SWIN_SIZES = {
    "aligned": (2, 3, 32, 32),  # 8x8 patches: 2x2 windows of 2 per shard in stage 1 (shifted by 1), 1 in stage 2
    "rectangular": (2, 3, 64, 32),  # 16x8 patches: 4x2 windows per shard, then 2x1
    "held-whole": (2, 3, 16, 16),  # stage 2 is 2x2: one window for two shards along each dim, held whole
    "unaligned": (2, 3, 36, 28),  # 9x7 patches padded to 10x8: 5 windows of 2 on 2 shards, re-sharded 3/2
}


@pytest.mark.world(4)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("size", sorted(SWIN_SIZES))
@pytest.mark.parametrize("v2", [False, True], ids=["swin-v1", "swin-v2"])
def test_torchvision_swin_windows_split_exactly(world, v2, size):
    torch.manual_seed(0)
    model = tiny_swin(v2).double()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(*SWIN_SIZES[size], generator=g, dtype=torch.float64)
    r = _verdict(model, world, x, torch.tensor([0, 2]))
    assert_exact(r)


class RowWindows(nn.Module):
    """Windows of 4 rows only (a partition of one spatial dim): 12 rows on 2 shards of 6 cut windows."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        b, c, h, w = y.shape
        rows = y.view(b, c, h // 4, 4, w).softmax(3)
        return rows.view(b, c, h, w)


@pytest.mark.world(4)
@pytest.mark.timeout(120)
def test_windows_cut_by_shards_refused_naming_sizes_that_work(refused_before_remote_work):
    refused_before_remote_work(RowWindows(), ["Tensor.view", "windows of 4", "[6, 6]", "e.g. 8, 16 instead of 12",
                                              "fewer windows than shards"], shape=(2, 1, 12, 12))


def _swin_unetr(dims: int):
    from monai.networks.nets import SwinUNETR

    torch.manual_seed(0)
    return SwinUNETR(in_channels=1, out_channels=2, feature_size=12, spatial_dims=dims, depths=(1, 1, 1, 1),
                     num_heads=(1, 1, 1, 1), window_size=4).double()


@pytest.mark.world(4)
@pytest.mark.timeout(600)
@pytest.mark.parametrize("dims,shape,grid", [
    pytest.param(2, (1, 1, 64, 64), (2, 2), id="2d"),
    pytest.param(3, (1, 1, 64, 64, 64), (1, 2, 2), id="3d", marks=pytest.mark.zoo),  # 5 min on 2 cores: -m zoo
])
def test_monai_swin_unetr_windows_split_exactly(world, dims, shape, grid):
    """Windows of 4: stages of 32, 16 and 8 positions split (16, 8 and 4 per shard), 4 and 2 held whole."""
    model = _swin_unetr(dims)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    y = torch.randn(shape[0], 2, *shape[2:], generator=g, dtype=torch.float64)
    assert_exact(_verdict(model, world, x, y, nn.MSELoss(), grid=grid))


class PadBeyondAShard(nn.Module):
    """Swin v2 pads a 4x4 map to its window of 8: on 2x2 shards, the second shard's part is all padding and
    reads none of its input; its backward must still take back the gradients of the halos it sent."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(1, 3, 3, padding=1), nn.Conv2d(3, 2, 3, padding=1)

    def forward(self, x):
        h = torch.tanh(self.a(x)).permute(0, 2, 3, 1)
        h = nn.functional.pad(h, (0, 0, 0, 4, 0, 4)).permute(0, 3, 1, 2)
        return self.b(h)[..., 1:5, 1:5]


@pytest.mark.world(4)
@pytest.mark.timeout(240)
def test_padding_beyond_a_shard_trains_exactly(world):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 1, 4, 4, generator=g, dtype=torch.float64)
    y = torch.randn(2, 2, 4, 4, generator=g, dtype=torch.float64)
    assert_exact(_verdict(PadBeyondAShard().double(), world, x, y, nn.MSELoss()))
