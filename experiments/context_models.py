"""The networks of the context benchmark (``experiments.context``): the CNN every method shares, and the
tile methods built on it."""

from __future__ import annotations

import torch
import torch.nn as nn


class ContextCNN(nn.Module):
    """A patchify stem, ``levels`` conv+BN+ReLU+max-pool levels, dilated convs, global max pool, linear head.

    ``embed`` is everything before the head: what the MIL method applies to each tile.
    """

    STRIDE = 32
    """Total downsampling of the trunk (stem 4 x three 2x pools)."""

    def __init__(self, width: int = 16, num_classes: int = 2) -> None:
        super().__init__()

        def block(c_in: int, dilation: int = 1) -> list[nn.Module]:
            return [nn.Conv2d(c_in, width, 3, padding=dilation, dilation=dilation), nn.BatchNorm2d(width),
                    nn.ReLU()]

        layers = [nn.Conv2d(1, width, 4, stride=4), nn.BatchNorm2d(width), nn.ReLU()]
        for _ in range(3):
            layers += [*block(width), nn.MaxPool2d(2)]
        for d in (1, 2, 4, 8):
            layers += block(width, d)
        self.trunk = nn.Sequential(*layers)
        self.pool = nn.AdaptiveMaxPool2d(1)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(width, num_classes))

    def embed(self, x_NCHW: torch.Tensor) -> torch.Tensor:
        return self.pool(self.trunk(x_NCHW)).flatten(1)

    def forward(self, x_NCHW: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(self.trunk(x_NCHW)))


class TileMIL(nn.Module):
    """The CNN embeds every tile; torchmil's attention-MIL head (ABMIL) pools the bag into one logit."""

    def __init__(self, cnn: ContextCNN, width: int) -> None:
        super().__init__()
        from torchmil.models import ABMIL

        self.cnn = cnn
        self.abmil = ABMIL(in_shape=(width,), att_dim=width)

    def forward(self, bags: torch.Tensor) -> torch.Tensor:
        n, k = bags.shape[:2]
        emb = self.cnn.embed(bags.flatten(0, 1)).reshape(n, k, -1)
        return self.abmil(emb)
