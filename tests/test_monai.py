"""Real networks of the MONAI medical-imaging library, unchanged, against a single process.

The models are MONAI's own classes with small channel counts (CI runs on two cores); nothing is
edited or subclassed. Their deep layers shrink maps below the grid (1x1 at the end of the
ResNets and DenseNets), which bigconv holds whole on every worker. Compared as in
``test_layers``: forward, input gradient, parameter gradients, losses and the whole state dict
(running statistics included) after two SGD-with-momentum steps, float64, relative error <= 1e-9.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
from monai.networks.nets import BasicUNet, DenseNet121, ResNet, UNet
from verdicts import assert_exact

from bigconv.verify import compare_training

TOL = 1e-9


def unet(dims):
    return UNet(dims, 1, 3, channels=(4, 8, 16), strides=(2, 2), num_res_units=1)


def basic_unet(dims):
    return BasicUNet(dims, 1, 3, features=(2, 2, 4, 4, 8, 2) if dims == 3 else (4, 4, 8, 8, 16, 4))


def densenet(dims):
    return DenseNet121(dims, 1, 3, init_features=4, growth_rate=2, block_config=(1, 1, 1, 1))


def resnet(dims):
    return ResNet("basic", [1, 1, 1, 1], [4, 4, 8, 8], spatial_dims=dims, n_input_channels=1, num_classes=3)


CASES = [
    # (id, workers, grid, factory, input shape, per-pixel target)
    ("unet2d-2w", 2, (2, 1), lambda: unet(2), (2, 1, 20, 16), True),
    ("unet2d-4w", 4, (2, 2), lambda: unet(2), (2, 1, 16, 16), True),
    ("unet3d-4w", 4, (2, 1, 2), lambda: unet(3), (1, 1, 8, 8, 8), True),
    ("basicunet2d-3w", 3, (3, 1), lambda: basic_unet(2), (1, 1, 48, 32), True),
    ("basicunet2d-4w", 4, (2, 2), lambda: basic_unet(2), (1, 1, 32, 32), True),
    ("basicunet3d-4w", 4, (2, 1, 2), lambda: basic_unet(3), (1, 1, 32, 16, 16), True),
    ("densenet121-2d-4w", 4, (2, 2), lambda: densenet(2), (2, 1, 32, 32), False),
    ("densenet121-3d-4w", 4, (1, 2, 2), lambda: densenet(3), (2, 1, 32, 32, 32), False),
    ("resnet2d-2w", 2, (1, 2), lambda: resnet(2), (2, 1, 32, 24), False),
    ("resnet2d-4w", 4, (2, 2), lambda: resnet(2), (2, 1, 32, 32), False),
    ("resnet3d-4w", 4, (2, 1, 2), lambda: resnet(3), (2, 1, 16, 16, 16), False),
]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("workers,grid,factory,shape,dense",
                         [pytest.param(*c[1:], id=c[0], marks=pytest.mark.world(c[1])) for c in CASES])
def test_monai_model_matches_single_process(world, workers, grid, factory, shape, dense):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # MONAI's deprecation notices
        model = factory().double()
    x = torch.randn(shape, dtype=torch.float64)
    y = torch.randint(0, 3, (shape[0], *shape[2:])) if dense else torch.randint(0, 3, (shape[0],))
    r = compare_training(model, world, x, y, nn.CrossEntropyLoss(), grid=grid)
    assert_exact(r, TOL)
