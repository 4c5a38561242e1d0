"""nnU-Net's own network and loss train exactly on a grid (issue 37): ``ResidualEncoderUNet`` from
``dynamic-network-architectures`` (the package nnU-Net builds its networks with), 3D, deep supervision
on (a list of logits at three scales), instance norms and leaky ReLUs as nnU-Net configures them,
trained with nnU-Net's Dice + cross-entropy deep-supervision loss (``nnunet_loss.py``) on a (1, 2, 2)
grid, against one process in float64: every output, the input gradient, every parameter gradient,
the loss and the weights after two SGD steps (nnU-Net trains with SGD, Nesterov momentum 0.99).

A failure points to the several-outputs path (``bigconv/engine/plan.py``'s output structure, the
driver's loss over the joined outputs) or to the 3D rules of a layer nnU-Net uses.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from nnunet_loss import nnunet_loss
from verdicts import assert_exact

from bigconv.verify import compare_training


def residual_encoder_unet() -> nn.Module:
    """nnU-Net's 3d_fullres ResidualEncoderUNet plan, shrunk: 4 stages, 8 to 32 features."""
    from dynamic_network_architectures.architectures.unet import ResidualEncoderUNet

    torch.manual_seed(0)
    return ResidualEncoderUNet(
        input_channels=1, n_stages=4, features_per_stage=(8, 16, 32, 32), conv_op=nn.Conv3d, kernel_sizes=3,
        strides=(1, 2, 2, 2), n_blocks_per_stage=(1, 1, 2, 2), num_classes=3, n_conv_per_stage_decoder=(1, 1, 1),
        conv_bias=True, norm_op=nn.InstanceNorm3d, norm_op_kwargs={"eps": 1e-5, "affine": True},
        nonlin=nn.LeakyReLU, nonlin_kwargs={"inplace": True}, deep_supervision=True).double()


def targets(n: int, size: tuple[int, ...], scales: int, g: torch.Generator) -> list:
    """Label maps as nnU-Net's data loader gives them: float, a channel dim of 1, one per output scale
    (nearest-neighbour downsampling by 2 per scale)."""
    full = torch.randint(0, 3, (n, 1, *size), generator=g).double()
    return [full[(..., *[slice(None, None, 2 ** k)] * len(size))].contiguous() for k in range(scales)]


@pytest.mark.world(4)
@pytest.mark.timeout(600)
def test_residual_encoder_unet_with_deep_supervision_trains_exactly(world):
    model = residual_encoder_unet()
    size = (8, 32, 32)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 1, *size, generator=g, dtype=torch.float64)
    y = targets(2, size, 3, g)
    assert [o.shape[2:] for o in copy.deepcopy(model)(x)] == [torch.Size(t.shape[2:]) for t in y]
    r = compare_training(model, world, x, y, nnunet_loss(3), grid=(1, 2, 2), steps=2, lr=0.01, momentum=0.99,
                         nesterov=True)
    assert_exact(r)
    outputs = [t["tensor"] for t in r["tensors"] if t["category"] == "forward"]
    assert len(outputs) == 3, outputs
