"""Every layer beyond convolution, in every dimension it supports, against a single process.

Each case trains a small model for two optimizer steps on a World and in one process and compares
the forward output, the input gradient, the parameter gradients (before any step), the losses,
and every entry of the state dict after the steps (weights *and* buffers such as running
statistics), in float64: the verdict ``exact`` (``tests/verdicts.py``'s ``assert_exact``: each tensor within
1e-9 of its own size where rounding alone stays within it, none ill-conditioned, residues within 10x their
measured noise) and each raw relative error <= 1e-9. Grids are chosen so that shards are uneven
and strided layers end mid-stride on some shards; several cases shrink feature maps below the
grid, where bigconv holds them whole on every worker.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from verdicts import assert_exact

from bigconv.models import FCN2D
from bigconv.verify import compare_training

TOL = 1e-9
CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}


def head(dims: int, channels: int, classes: int = 3) -> list[nn.Module]:
    pool = {1: nn.AdaptiveAvgPool1d, 2: nn.AdaptiveAvgPool2d, 3: nn.AdaptiveAvgPool3d}[dims]
    return [pool(1), nn.Flatten(), nn.Linear(channels, classes)]


def around(dims: int, *layers: nn.Module, channels: int = 3) -> nn.Sequential:
    """conv -> layers -> conv -> head: the layers get a gradient from both sides."""
    conv = CONV[dims]
    return nn.Sequential(conv(1, channels, 3, padding=1), nn.Tanh(), *layers,
                         conv(channels, channels, 3, padding=1), nn.ReLU(), *head(dims, channels))


def nd(name: str, dims: int):
    return getattr(nn, f"{name}{dims}d")


class UNetLike(nn.Module):
    """Residual add, U-Net skip by channel concatenation, pooling down and transposed conv up."""

    def __init__(self, dims: int = 2) -> None:
        super().__init__()
        conv = CONV[dims]
        self.inc = conv(1, 4, 3, padding=1)
        self.res = conv(4, 4, 3, padding=1)
        self.down = nd("MaxPool", dims)(2)
        self.mid = nn.Sequential(conv(4, 8, 3, padding=1), nd("BatchNorm", dims)(8), nn.ReLU())
        self.up = nd("ConvTranspose", dims)(8, 4, 2, stride=2)
        self.out = conv(8, 3, 1)

    def forward(self, x):
        a = self.inc(x)
        a = torch.relu(a + self.res(a))
        b = self.up(self.mid(self.down(a)))
        return self.out(torch.cat([a, b], dim=1))


LAYERS_1D = [
    ("maxpool1d-ceil-dilated", lambda: around(1, nn.MaxPool1d(3, 2, 1, dilation=2, ceil_mode=True))),
    ("avgpool1d-exclude-pad-ceil", lambda: around(1, nn.AvgPool1d(4, 3, 2, ceil_mode=True, count_include_pad=False))),
    ("avgpool1d-include-pad", lambda: around(1, nn.AvgPool1d(3, 2, 1))),
    ("adaptive-avg1d-local", lambda: around(1, nn.AdaptiveAvgPool1d(7))),
    ("adaptive-max1d-uneven", lambda: around(1, nn.AdaptiveMaxPool1d(5))),
    ("batchnorm1d", lambda: around(1, nn.BatchNorm1d(3))),
    ("batchnorm1d-cumulative", lambda: around(1, nn.BatchNorm1d(3, momentum=None, affine=False))),
    ("instancenorm1d-running", lambda: around(1, nn.InstanceNorm1d(3, affine=True, track_running_stats=True))),
    ("groupnorm1d", lambda: around(1, nn.GroupNorm(3, 3))),
    ("layernorm1d", lambda: around(1, nn.LayerNorm([3, 21]))),
    ("convtranspose1d", lambda: around(1, nn.ConvTranspose1d(3, 3, 4, stride=3, padding=2, output_padding=2,
                                                             dilation=2))),
    ("upsample-linear-corners", lambda: around(1, nn.Upsample(scale_factor=2.5, mode="linear", align_corners=True))),
    ("upsample-nearest-exact", lambda: around(1, nn.Upsample(size=33, mode="nearest-exact"))),
    ("pads1d", lambda: around(1, nn.ReflectionPad1d((2, 3)), nn.CircularPad1d((4, 1)), nn.ReplicationPad1d(2),
                              nn.ConstantPad1d((1, 2), 0.5))),
    ("conv1d-padding-modes", lambda: nn.Sequential(
        nn.Conv1d(1, 3, 5, padding=2, padding_mode="reflect"), nn.Tanh(),
        nn.Conv1d(3, 3, 3, padding=3, dilation=2, padding_mode="circular"), nn.Tanh(),
        nn.Conv1d(3, 3, 4, stride=2, padding=1, padding_mode="replicate"), *head(1, 3))),
]

LAYERS_2D = [
    ("maxpool2d", lambda: around(2, nn.MaxPool2d(3, 2, 1))),
    ("maxpool2d-ceil", lambda: around(2, nn.MaxPool2d((2, 3), (2, 2), (1, 0), ceil_mode=True))),
    ("avgpool2d-exclude-pad", lambda: around(2, nn.AvgPool2d(3, 2, 1, ceil_mode=True, count_include_pad=False))),
    ("avgpool2d-divisor", lambda: around(2, nn.AvgPool2d(2, divisor_override=3))),
    ("adaptive-max2d-local", lambda: around(2, nn.AdaptiveMaxPool2d((7, 5)))),
    ("batchnorm2d", lambda: around(2, nn.BatchNorm2d(3))),
    ("batchnorm2d-no-running", lambda: around(2, nn.BatchNorm2d(3, track_running_stats=False))),
    ("instancenorm2d", lambda: around(2, nn.InstanceNorm2d(3))),
    ("groupnorm2d", lambda: around(2, nn.GroupNorm(1, 3, affine=False))),
    ("layernorm2d", lambda: around(2, nn.LayerNorm([14, 15]))),
    ("convtranspose2d", lambda: around(2, nn.ConvTranspose2d(3, 3, (3, 2), stride=(2, 3), padding=(1, 0),
                                                             output_padding=(1, 2), groups=3))),
    ("upsample-bilinear", lambda: around(2, nn.Upsample(scale_factor=2, mode="bilinear"))),
    ("upsample-bilinear-size", lambda: around(2, nn.Upsample(size=(23, 31), mode="bilinear", align_corners=True))),
    ("upsample-nearest", lambda: around(2, nn.UpsamplingNearest2d(scale_factor=3))),
    ("pads2d", lambda: around(2, nn.ReflectionPad2d((1, 2, 3, 0)), nn.CircularPad2d(2), nn.ZeroPad2d((0, 1, 1, 0)))),
    ("conv2d-padding-modes", lambda: nn.Sequential(
        nn.Conv2d(1, 3, 3, padding=1, padding_mode="reflect"), nn.Tanh(),
        nn.Conv2d(3, 3, 5, padding=2, padding_mode="circular"), nn.Tanh(),
        nn.Conv2d(3, 3, 3, stride=2, padding=1, padding_mode="replicate"), *head(2, 3))),
    ("upsample-nearest-exact2d", lambda: around(2, nn.Upsample(size=(23, 31), mode="nearest-exact"))),
    ("upsample-nearest-exact2d-scale", lambda: around(2, nn.Upsample(scale_factor=(1.5, 0.7), mode="nearest-exact"))),
]

LAYERS_3D = [
    ("maxpool3d", lambda: around(3, nn.MaxPool3d(2, ceil_mode=True))),
    ("avgpool3d", lambda: around(3, nn.AvgPool3d(3, 2, 1, count_include_pad=False))),
    ("batchnorm3d", lambda: around(3, nn.BatchNorm3d(3))),
    ("instancenorm3d", lambda: around(3, nn.InstanceNorm3d(3, affine=True))),
    ("groupnorm3d", lambda: around(3, nn.GroupNorm(3, 3))),
    ("convtranspose3d", lambda: around(3, nn.ConvTranspose3d(3, 3, 3, stride=2, padding=1, output_padding=1))),
    ("upsample-trilinear", lambda: around(3, nn.Upsample(scale_factor=2, mode="trilinear"))),
    ("pads3d", lambda: around(3, nn.ReplicationPad3d(1), nn.CircularPad3d((1, 0, 0, 2, 1, 1)))),
    ("pads3d-reflect-constant", lambda: around(3, nn.ReflectionPad3d((2, 1, 0, 1, 1, 2)),
                                               nn.ConstantPad3d((1, 0, 2, 0, 0, 1), -0.5))),
    ("conv3d-padding-modes", lambda: nn.Sequential(
        nn.Conv3d(1, 3, 3, padding=1, padding_mode="reflect"), nn.Tanh(),
        nn.Conv3d(3, 3, (3, 5, 3), padding=(1, 2, 1), padding_mode="circular"), nn.Tanh(),
        nn.Conv3d(3, 3, 3, stride=2, padding=1, padding_mode="replicate"), *head(3, 3))),
    ("upsample-nearest-exact3d", lambda: around(3, nn.Upsample(size=(11, 7, 13), mode="nearest-exact"))),
]

CASES = (
    [(f"{i}-2w", 2, (2,), f, (2, 1, 21)) for i, f in LAYERS_1D]
    + [(f"{i}-3w", 3, (3,), f, (2, 1, 22)) for i, f in LAYERS_1D[:6]]
    + [(f"{i}-4w", 4, (2, 2), f, (2, 1, 14, 15)) for i, f in LAYERS_2D]
    + [(f"{i}-3w-rows", 3, (3, 1), f, (2, 1, 13, 10)) for i, f in LAYERS_2D if "layernorm" not in i]
    + [(f"{i}-4w", 4, (2, 1, 2), f, (2, 1, 8, 6, 10)) for i, f in LAYERS_3D]
)


def _params(cases):
    return [pytest.param(*c[1:], id=c[0], marks=pytest.mark.world(c[1])) for c in cases]


def check(r: dict) -> None:
    """The verdict ``exact`` (no tensor wrong or ill-conditioned, each residue within its allowance), the raw
    errors behind it, equal replicas and the plain model's keys: ``tests/verdicts.py``'s ``assert_exact``."""
    assert_exact(r, TOL)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers,grid,factory,shape", _params(CASES))
def test_layer_matches_single_process(world, workers, grid, factory, shape):
    x = torch.randn(shape, dtype=torch.float64)
    y = torch.randint(0, 3, (shape[0],))
    check(compare_training(factory().double(), world, x, y, nn.CrossEntropyLoss(), grid=grid))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers,grid,dims,shape", [
    pytest.param(4, (2, 2), 2, (2, 1, 14, 16), marks=pytest.mark.world(4), id="2d-2x2"),
    pytest.param(3, (3, 1), 2, (2, 1, 14, 10), marks=pytest.mark.world(3), id="2d-3x1"),
    pytest.param(4, (2, 1, 2), 3, (1, 1, 8, 6, 10), marks=pytest.mark.world(4), id="3d-2x1x2"),
])
def test_skip_connections(world, workers, grid, dims, shape):
    x = torch.randn(shape, dtype=torch.float64)
    y = torch.randint(0, 3, (shape[0], *shape[2:]))
    check(compare_training(UNetLike(dims).double(), world, x, y, nn.CrossEntropyLoss(), grid=grid))


@pytest.mark.world(4)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("factory", [lambda: around(2, nn.BatchNorm2d(3)), UNetLike], ids=["bn", "unet"])
def test_adam_and_running_statistics(world, factory):
    x = torch.randn(2, 1, 12, 10, dtype=torch.float64)
    r = compare_training(factory().double(), world, x, torch.randint(0, 3, (2, 12, 10)) if factory is UNetLike
                         else torch.tensor([0, 2]), nn.CrossEntropyLoss(), grid=(2, 2), optimizer=torch.optim.Adam,
                         lr=0.01)
    check(r)


@pytest.mark.world(4)
@pytest.mark.timeout(120)
def test_eval_mode_uses_running_statistics(world):
    model = around(2, nn.BatchNorm2d(3), nn.InstanceNorm2d(3, track_running_stats=True)).double()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.BatchNorm2d, nn.InstanceNorm2d)):
                m.running_mean.uniform_(-1, 1)
                m.running_var.uniform_(0.5, 2)
    model.eval()
    r = compare_training(model, world, torch.randn(2, 1, 13, 11, dtype=torch.float64), torch.tensor([1, 0]),
                         nn.CrossEntropyLoss(), grid=(2, 2))
    check(r)


class Shrinking(nn.Module):
    """Maps shrink to fewer positions than the grid has shards, grow back, and join a skip."""

    def __init__(self, dims: int) -> None:
        super().__init__()
        conv = CONV[dims]
        self.a = conv(1, 4, 3, padding=1)
        self.down = nn.Sequential(nd("MaxPool", dims)(2), conv(4, 4, 3, padding=1), nd("BatchNorm", dims)(4),
                                  nn.ReLU(), nd("AvgPool", dims)(2), conv(4, 4, 3, padding=1), nn.GroupNorm(2, 4))
        self.up = nd("ConvTranspose", dims)(4, 4, 4, stride=4)
        self.out = conv(8, 4, 3, padding=1)

    def forward(self, x):
        a = torch.relu(self.a(x))
        return self.out(torch.cat([a, self.up(self.down(a))], dim=1))


class TinyHead(nn.Module):
    """A deep trunk down to a 1-voxel map, then a flatten into a linear layer (as in a 3D ResNet)."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Conv3d(1, 4, 3, stride=2, padding=1), nn.BatchNorm3d(4), nn.ReLU(),
                                   nn.MaxPool3d(3, 2, 1), nn.Conv3d(4, 4, 3, stride=2, padding=1), nn.ReLU(),
                                   nn.AdaptiveAvgPool3d(1))
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(self.trunk(x).flatten(1))


@pytest.mark.world(4)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("factory,grid,shape,dense", [
    (lambda: Shrinking(2), (4, 1), (2, 1, 8, 8), True),     # 8 rows -> 2 rows on 4 shards, and back
    (lambda: Shrinking(1), (4,), (2, 1, 12), True),          # 12 -> 3 positions on 4 shards
    (lambda: Shrinking(3), (2, 1, 2), (1, 1, 8, 4, 4), True),
    (TinyHead, (2, 1, 2), (2, 1, 9, 5, 7), False),           # down to 1x1x1
    (lambda: nn.Sequential(nn.Conv2d(1, 2, 3), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(16, 3)), (2, 2),
     (2, 1, 6, 10), False),                                  # a flatten into a dense head: gathered whole
], ids=["2d-rows", "1d", "3d", "3d-to-1-voxel", "flatten-small-map"])
def test_feature_maps_smaller_than_grid(world, factory, grid, shape, dense):
    x = torch.randn(shape, dtype=torch.float64)
    y = torch.randint(0, 4, (shape[0], *shape[2:])) if dense else torch.randint(0, 3, (shape[0],))
    check(compare_training(factory().double(), world, x, y, nn.CrossEntropyLoss(), grid=grid))


@pytest.mark.world(4)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("grid", [(2, 2), (4, 1)])
def test_fcn2d_per_pixel_loss(world, grid):
    x = torch.randn(2, 1, 24, 16, dtype=torch.float64)
    y = torch.randint(0, 3, (2, 24, 16))
    check(compare_training(FCN2D(1, 3, width=4, depth=3).double(), world, x, y, nn.CrossEntropyLoss(), grid=grid))
