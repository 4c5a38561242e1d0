"""Activation checkpointing inside a model, as users write it, against a single process.

``torch.utils.checkpoint.checkpoint`` (reentrant and not), ``checkpoint_sequential``, with halos
and whole-image normalization inside the checkpointed blocks, in 1D/2D/3D on uneven shards:
forward, gradients and weights after two SGD-momentum steps equal to 1e-9 in float64. The single
process runs PyTorch's own checkpoint (which, like ours, updates BatchNorm's running statistics in
the recompute too). A failure points to ``bigconv/checkpointing.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential
from verdicts import assert_exact

from bigconv.verify import compare_training

Conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
BN = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}
Pool = {1: nn.MaxPool1d, 2: nn.MaxPool2d, 3: nn.MaxPool3d}


class Checkpointed(nn.Module):
    def __init__(self, d: int, how: str) -> None:
        super().__init__()
        self.how = how
        self.stem = Conv[d](1, 4, 3, padding=1)
        self.block = nn.Sequential(Conv[d](4, 4, 3, padding=1), BN[d](4), nn.ReLU(), Conv[d](4, 4, 5, padding=2))
        self.seq = nn.Sequential(Conv[d](4, 4, 3, padding=1), nn.ReLU(), Pool[d](3, 1, 1), Conv[d](4, 4, 3, padding=2,
                                                                                              dilation=2), nn.GELU())
        self.head = Conv[d](4, 3, 1)

    def forward(self, x):
        x = self.stem(x)
        if self.how == "reentrant":
            x = x + checkpoint(self.block, x, use_reentrant=True)
        else:
            x = x + checkpoint(self.block, x, use_reentrant=False)
        x = checkpoint_sequential(self.seq, 2, x, use_reentrant=self.how == "reentrant")
        return self.head(x)


SHAPES = {1: ((2, 1, 29), (3,), 3), 2: ((2, 1, 17, 14), (2, 2), 4), 3: ((1, 1, 9, 10, 7), (2, 1, 2), 4)}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("d,how", [pytest.param(d, how, id=f"{how}-{d}d", marks=pytest.mark.world(SHAPES[d][2]))
                                   for d in (1, 2, 3) for how in ("non-reentrant", "reentrant")])
def test_checkpointed_blocks_match_single_process(world, d, how):
    shape, grid, _ = SHAPES[d]
    x = torch.randn(shape, dtype=torch.float64)
    y = torch.randint(0, 3, (shape[0], *shape[2:]))
    r = compare_training(Checkpointed(d, how).double(), world, x, y, nn.CrossEntropyLoss(), grid=grid)
    assert_exact(r)
