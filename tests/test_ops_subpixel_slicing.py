"""Sub-pixel layers and slices of spatial dims, each against a single process in float64.

``PixelShuffle``/``PixelUnshuffle`` move every pixel to one place in another shard's box (shard
borders are not multiples of the factor on the uneven grids here, so the exchange must fix them
up); slices crop or subsample the image and re-shard the result. Forward, input and parameter
gradients, losses and every weight after two SGD-momentum steps must match one process to 1e-9.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from verdicts import assert_exact

from bigconv.verify import compare_training

TOL = 1e-9


class SubPixelUp(nn.Module):
    """ESPCN-style: convolve to r*r times the channels, then shuffle them into space."""

    def __init__(self, r: int = 2, functional: bool = False) -> None:
        super().__init__()
        self.r, self.functional = r, functional
        self.conv = nn.Conv2d(1, 3 * r * r, 3, padding=1)
        self.shuffle = nn.PixelShuffle(r)
        self.head = nn.Conv2d(3, 3, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        y = F.pixel_shuffle(y, self.r) if self.functional else self.shuffle(y)
        return self.head(torch.relu(y))


class SpaceToDepth(nn.Module):
    """TResNet-style stem: space to depth, then convolve the stacked channels."""

    def __init__(self, r: int = 2, functional: bool = False) -> None:
        super().__init__()
        self.r, self.functional = r, functional
        self.pre = nn.Conv2d(1, 2, 3, padding=1)
        self.unshuffle = nn.PixelUnshuffle(r)
        self.conv = nn.Conv2d(2 * r * r, 3, 3, padding=1)
        self.up = nn.Upsample(scale_factor=r)

    def forward(self, x):
        y = self.pre(x)
        y = F.pixel_unshuffle(y, self.r) if self.functional else self.unshuffle(y)
        return self.up(self.conv(y))


def monai_style_pixelshuffle(x, dims: int, r: int):
    """MONAI's ``networks.utils.pixelshuffle``: reshape, permute, reshape (any number of spatial dims)."""
    size = list(x.size())
    b, c = size[:2]
    idx = list(range(2, 2 + 2 * dims))
    idx = idx[dims:] + idx[:dims]
    perm = [0, 1]
    for i in range(dims):
        perm.extend(idx[i::dims])
    x = x.reshape([b, c // r ** dims] + [r] * dims + size[2:])
    return x.permute(perm).reshape([b, c // r ** dims] + [n * r for n in size[2:]])


def timm_style_space_to_depth(x, bs: int):
    """timm's ``SpaceToDepth``: view into blocks, permute, view."""
    n, c, h, w = x.size()
    x = x.view(n, c, h // bs, bs, w // bs, bs)
    x = x.permute(0, 3, 5, 1, 2, 4).contiguous()
    return x.view(n, c * bs * bs, h // bs, w // bs)


class ReshapeShuffles(nn.Module):
    """Depth to space and space to depth written as reshapes and permutes (MONAI, timm), 2D or 3D."""

    def __init__(self, dims: int, r: int, down: bool) -> None:
        super().__init__()
        conv = nn.Conv3d if dims == 3 else nn.Conv2d
        self.dims, self.r, self.down = dims, r, down
        self.conv = conv(1, 2 * r ** dims, 3, padding=1)
        self.head = conv(2 * (r ** dims if down else 1), 3, 3, padding=1)
        self.back = nn.Upsample(scale_factor=r)

    def forward(self, x):
        y = self.conv(x)
        if self.down:
            return self.back(self.head(timm_style_space_to_depth(y[:, :2], self.r)))
        return self.head(monai_style_pixelshuffle(y, self.dims, self.r))


class Crops(nn.Module):
    """A valid-padding U-Net step: the skip is center-cropped to the upsampled map, as HoVerNet does."""

    def __init__(self, index) -> None:
        super().__init__()
        self.index = index
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.valid = nn.Conv2d(4, 4, 3)  # valid padding: 2 rows and columns fewer
        self.head = nn.Conv2d(8, 3, 3, padding=1)

    def forward(self, x):
        skip = torch.relu(self.conv(x))
        y = self.valid(skip)
        cut = self.index(skip)
        y = F.interpolate(y, size=cut.shape[-2:])
        return self.head(torch.cat([cut, y], dim=1))


CROPS = {
    "center": lambda t: t[:, :, 1:-1, 1:-1],
    "offset": lambda t: t[..., 3:11, 2:],
    "strided": lambda t: t[:, :, ::2, 1::3],
    "channels_too": lambda t: torch.cat([t[:, 1:3, 2:13:2, :7], t[:, :2, 2:13:2, :7]], dim=1),
    "narrow": lambda t: t.narrow(2, 4, 9).narrow(-1, -12, 10),
    "tiny": lambda t: t[:, :, 5:6, 4:9],  # one row on a grid of 3 rows: computed whole on every worker
}


def _check(model, world, shape, grid, dense=True):
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=torch.float64)
    r_out = model(x)
    y = torch.randint(0, 3, (shape[0], *r_out.shape[2:]))
    r = compare_training(model, world, x, y, nn.CrossEntropyLoss(), grid=grid)
    assert_exact(r, TOL)


@pytest.mark.world(3)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("functional", [False, True])
@pytest.mark.parametrize("r,shape,grid", [(2, (2, 1, 13, 11), (3, 1)), (3, (1, 1, 7, 10), (1, 3))])
def test_pixel_shuffle_exact(world, functional, r, shape, grid):
    _check(SubPixelUp(r, functional).double(), world, shape, grid)


@pytest.mark.world(3)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("functional", [False, True])
@pytest.mark.parametrize("r,shape,grid", [(2, (2, 1, 14, 10), (3, 1)), (3, (1, 1, 9, 15), (1, 3))])
def test_pixel_unshuffle_exact_on_borders_off_the_factor(world, functional, r, shape, grid):
    # 14 rows over 3 shards: 5/5/4, so the second border (row 10) is even but the first (row 5) is not.
    _check(SpaceToDepth(r, functional).double(), world, shape, grid)


@pytest.mark.world(3)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("dims,r,down,shape,grid", [
    (2, 2, False, (2, 1, 7, 10), (3, 1)),   # depth to space, MONAI's reshape-permute-reshape
    (3, 2, False, (1, 1, 5, 4, 7), (1, 1, 3)),  # ... in 3D
    (2, 4, True, (2, 1, 28, 12), (3, 1)),   # space to depth, timm's view-permute-view; borders at rows 10, 19
])
def test_shuffles_written_as_reshapes_exact(world, dims, r, down, shape, grid):
    _check(ReshapeShuffles(dims, r, down).double(), world, shape, grid)


@pytest.mark.world(3)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(CROPS))
def test_spatial_slices_exact(world, name):
    _check(Crops(CROPS[name]).double(), world, (2, 1, 16, 15), (3, 1))


@pytest.mark.world(4)
@pytest.mark.timeout(300)
def test_crop_on_2d_grid(world):
    _check(Crops(CROPS["offset"]).double(), world, (1, 1, 16, 15), (2, 2))


class IntIndex(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3, padding=1)

    def forward(self, x):
        return self.conv(x)[:, :, 3]


class UnshuffleOdd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3, padding=1)

    def forward(self, x):
        return F.pixel_unshuffle(self.conv(x), 3)


@pytest.mark.world(4)
@pytest.mark.parametrize("model,words", [
    (IntIndex, ["__getitem__", "single positions", "'<root>'"]),
    (UnshuffleOdd, ["pixel_unshuffle", "multiple of the factor"]),
])
def test_refused_before_remote_work(refused_before_remote_work, model, words):
    refused_before_remote_work(model(), words)
