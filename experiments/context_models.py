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
    """Total downsampling of the trunk with the default stem (stride 4 x three 2x pools)."""

    def __init__(self, width: int = 16, num_classes: int = 2, stem: int = 4, in_channels: int = 1) -> None:
        super().__init__()
        self.stride = stem * 8
        """Total downsampling: the stem's stride times three 2x pools (``STRIDE`` with the default stem)."""

        def block(c_in: int, dilation: int = 1) -> list[nn.Module]:
            return [nn.Conv2d(c_in, width, 3, padding=dilation, dilation=dilation), nn.BatchNorm2d(width),
                    nn.ReLU()]

        layers = [nn.Conv2d(in_channels, width, stem, stride=stem), nn.BatchNorm2d(width), nn.ReLU()]
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
    """The CNN embeds every tile; torchmil's attention-MIL head (ABMIL) pools the bag into one logit.
    ``att_dim``: the attention's width (None: ``width``, the first sweeps'; torchmil's default is 128)."""

    def __init__(self, cnn: ContextCNN, width: int, att_dim: int | None = None) -> None:
        super().__init__()
        from torchmil.models import ABMIL

        self.cnn = cnn
        self.abmil = ABMIL(in_shape=(width,), att_dim=att_dim or width)

    def forward(self, bags: torch.Tensor) -> torch.Tensor:
        n, k = bags.shape[:2]
        emb = self.cnn.embed(bags.flatten(0, 1)).reshape(n, k, -1)
        return self.abmil(emb)



def _embed_bag(cnn: ContextCNN, bags: torch.Tensor) -> torch.Tensor:
    n, k = bags.shape[:2]
    return cnn.embed(bags.flatten(0, 1)).reshape(n, k, -1)


class TileTransMIL(nn.Module):
    """The CNN embeds every tile; torchmil's TransMIL pools the bag. Its PPEG convolves the bag laid out as
    a square, row-major: with ``experiments.context_data.tiles``' row-major bag of a square grid, that square
    is the image's own grid of tiles, so the head sees where each tile lies."""

    def __init__(self, cnn: ContextCNN, width: int, att_dim: int | None = None) -> None:
        super().__init__()
        from torchmil.models import TransMIL

        self.cnn = cnn
        # att_dim None: ``width`` (the first sweeps'); TransMIL's standard width (the paper's, torchmil's default)
        # is 512
        self.head = TransMIL(in_shape=(width,), att_dim=att_dim or width, n_heads=4)

    def forward(self, bags: torch.Tensor) -> torch.Tensor:
        return self.head(_embed_bag(self.cnn, bags))


class TileGridCNN(nn.Module):
    """The CNN embeds every tile; the embeddings are laid on the image's grid of tiles (``grid`` x ``grid``)
    and a small CNN (two 3x3 conv+BN+ReLU, the second dilated 2, then a global max pool) and a linear head
    read them: the "neural image compression" family, trained end to end."""

    def __init__(self, cnn: ContextCNN, width: int, grid: int) -> None:
        super().__init__()
        self.cnn, self.grid = cnn, grid
        self.net = nn.Sequential(nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
                                 nn.Conv2d(width, width, 3, padding=2, dilation=2), nn.BatchNorm2d(width), nn.ReLU(),
                                 nn.AdaptiveMaxPool2d(1), nn.Flatten(), nn.Linear(width, 1))

    def forward(self, bags: torch.Tensor) -> torch.Tensor:
        emb = _embed_bag(self.cnn, bags)  # (N, grid * grid, width), row-major
        n, k, w = emb.shape
        if k != self.grid * self.grid:
            raise ValueError(f"a bag of {k} tiles is not a {self.grid}x{self.grid} grid")
        return self.net(emb.transpose(1, 2).reshape(n, w, self.grid, self.grid)).squeeze(-1)
