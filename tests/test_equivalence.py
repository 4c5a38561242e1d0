"""Equivalence with a single process: the contract of bigconv.

Each case trains a model for two SGD-with-momentum steps on a World and in one process, then
compares the forward output, the losses and every weight. In float64 the only differences are
summation order (shard sums, gradient allreduce), so the verdict must be ``exact``: each tensor's error
relative to its own size <= 1e-9 (residues, zero in exact arithmetic, against their rounding noise: see
``bigconv.verify`` and ``tests/verdicts.py``); float32 gets 1e-4. Every
case asserts all five kinds: the forward output, the input gradient, every parameter's gradient, each
step's loss and every weight and buffer after the steps. A failure points at the halo geometry
(forward), the backward through RPC (gradients, weights), or the gradient reduction (replicas disagree).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from verdicts import assert_exact

from bigconv.models import CNN1D, CNN2D, CNN3D
from bigconv.verify import compare_training

TOL64 = 1e-9
TOL32 = 1e-4


class Scaled(nn.Module):
    """Elementwise arithmetic inside a custom module: a residual join and a scalar gain."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.gain = nn.Parameter(torch.tensor(0.5))

    def forward(self, x):
        return torch.relu(x + self.gain * self.conv(x)) * 2.0 - 1.0


def head(dims: int, channels: int, classes: int = 3) -> list[nn.Module]:
    pool = {1: nn.AdaptiveAvgPool1d, 2: nn.AdaptiveAvgPool2d, 3: nn.AdaptiveAvgPool3d}[dims]
    return [pool(1), nn.Flatten(), nn.Linear(channels, classes)]


def strided_1d():
    return nn.Sequential(nn.Conv1d(2, 4, 4, stride=2, padding=1), nn.Tanh(), nn.Conv1d(4, 4, 1), nn.GELU(),
                         nn.Conv1d(4, 6, 5, stride=2), *head(1, 6))


def dilated_1d():
    return nn.Sequential(nn.Conv1d(1, 4, 7, dilation=2, padding="same"), nn.ReLU(),
                         nn.Conv1d(4, 4, 3, dilation=2, padding=2), nn.SiLU(), *head(1, 4))


def mixed_2d():
    """Kernels 1-7, stride 2, dilation 2, groups, 'same' and 'valid' padding, in one model."""
    return nn.Sequential(
        nn.Conv2d(2, 4, 7, padding=3), nn.ReLU(),
        nn.Conv2d(4, 4, (2, 5), padding="same"), nn.LeakyReLU(0.1),
        nn.Conv2d(4, 8, 3, stride=2, dilation=2, padding=1, groups=2), nn.ELU(),
        nn.Conv2d(8, 8, 4, padding="valid", groups=4, bias=False), nn.Sigmoid(),
        nn.Conv2d(8, 6, 1), Scaled(6), *head(2, 6))


def mixed_3d():
    return nn.Sequential(nn.Conv3d(1, 3, 3, padding=1), nn.ReLU(), nn.Conv3d(3, 4, (3, 1, 5), stride=(1, 2, 2),
                         padding=(0, 0, 2)), nn.ReLU(), nn.Conv3d(4, 4, 2, dilation=2, padding="same"), *head(3, 4))


CASES = [
    # (id, workers, grid, model factory, input shape)
    ("cnn2d-1w", 1, (1, 1), lambda: CNN2D(1, 3), (2, 1, 9, 8)),
    ("cnn1d-1w", 1, (1,), lambda: CNN1D(2, 3), (2, 2, 17)),
    ("cnn1d-2w", 2, (2,), lambda: CNN1D(1, 3, kernel_size=5), (2, 1, 23)),
    ("strided1d-2w", 2, (2,), strided_1d, (2, 2, 31)),
    ("cnn2d-2w-rows", 2, (2, 1), lambda: CNN2D(1, 3), (2, 1, 11, 7)),
    ("mixed2d-2w-cols", 2, (1, 2), mixed_2d, (2, 2, 21, 19)),
    ("cnn2d-3w-1x3", 3, (1, 3), lambda: CNN2D(1, 3), (2, 1, 8, 13)),
    ("cnn2d-3w-3x1", 3, (3, 1), lambda: CNN2D(1, 3, kernel_size=7), (2, 1, 14, 9)),
    ("dilated1d-3w", 3, (3,), dilated_1d, (2, 1, 29)),
    ("cnn3d-3w", 3, (3, 1, 1), lambda: CNN3D(1, 3), (2, 1, 7, 5, 6)),
    ("cnn2d-4w-2x2", 4, (2, 2), lambda: CNN2D(1, 3), (2, 1, 13, 11)),
    ("mixed2d-4w-2x2", 4, (2, 2), mixed_2d, (2, 2, 23, 21)),
    ("mixed2d-4w-4x1", 4, (4, 1), mixed_2d, (1, 2, 29, 20)),
    ("cnn3d-4w-2x1x2", 4, (2, 1, 2), lambda: CNN3D(1, 3), (2, 1, 7, 6, 9)),
    ("mixed3d-4w-2x1x2", 4, (2, 1, 2), mixed_3d, (1, 1, 9, 8, 11)),
    ("cnn1d-4w-thin", 4, (4,), lambda: CNN1D(1, 3, kernel_size=7), (2, 1, 9)),  # shards of 2, halos of 3
    ("cnn2d-4w-auto", 4, None, lambda: CNN2D(1, 3), (1, 1, 16, 10)),
]


def _params(cases):
    return [pytest.param(*c[1:], id=c[0], marks=pytest.mark.world(c[1])) for c in cases]


@pytest.mark.parametrize("workers,grid,factory,shape", _params(CASES))
def test_matches_single_process_float64(world, transport, workers, grid, factory, shape):
    model = factory().double()
    x = torch.randn(shape, dtype=torch.float64)
    y = torch.randint(0, 3, (shape[0],))
    r = compare_training(model, world, x, y, nn.CrossEntropyLoss(), grid=grid, transport=transport)
    assert_exact(r)


@pytest.mark.world(4)
def test_matches_single_process_float32(world, transport):
    x = torch.randn(2, 2, 23, 21)
    r = compare_training(mixed_2d(), world, x, torch.tensor([0, 2]), nn.CrossEntropyLoss(), grid=(2, 2),
                         transport=transport)
    assert r["tol"] == TOL32
    assert_exact(r, TOL32)


@pytest.mark.world(4)
def test_adam_matches(world, transport):
    x = torch.randn(2, 1, 12, 10, dtype=torch.float64)
    r = compare_training(CNN2D(1, 3).double(), world, x, torch.tensor([1, 2]), nn.CrossEntropyLoss(),
                         grid=(2, 2), transport=transport, optimizer=torch.optim.Adam, lr=0.01)
    assert_exact(r)


def fcn_2d():
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 3, 5, padding=2))


DENSE_LOSSES = [
    ("mse-mean", nn.MSELoss(), "float"),
    ("mse-sum", nn.MSELoss(reduction="sum"), "float"),
    ("l1-mean", nn.L1Loss(), "float"),
    ("bce-mean", nn.BCEWithLogitsLoss(), "binary"),
    ("bce-sum-posweight", nn.BCEWithLogitsLoss(reduction="sum", pos_weight=torch.tensor([2.0, 1.0, 0.5])
                                               .double().view(3, 1, 1)), "binary"),
    ("ce-mean", nn.CrossEntropyLoss(), "classes"),
    ("ce-sum", nn.CrossEntropyLoss(reduction="sum"), "classes"),
    ("ce-weight-ignore", nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 0.5]).double(), ignore_index=1),
     "classes"),
    ("ce-smoothing-ignore", nn.CrossEntropyLoss(label_smoothing=0.1, ignore_index=2), "classes"),
    ("ce-probabilities", nn.CrossEntropyLoss(), "probabilities"),
    ("ce-weight-smoothing-gathered", nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 0.5]).double(),
                                                         label_smoothing=0.1), "classes"),
]


def _target(kind: str, shape):
    n, _, h, w = shape
    if kind == "classes":
        return torch.randint(0, 3, (n, h, w))
    if kind == "probabilities":
        return torch.softmax(torch.randn(n, 3, h, w, dtype=torch.float64), dim=1)
    if kind == "binary":
        return torch.randint(0, 2, (n, 3, h, w)).double()
    return torch.randn(n, 3, h, w, dtype=torch.float64)


@pytest.mark.world(4)
@pytest.mark.parametrize("loss_fn,kind", [pytest.param(fn, k, id=i) for i, fn, k in DENSE_LOSSES])
def test_dense_losses_shard_local(world, transport, loss_fn, kind):
    x = torch.randn(2, 1, 13, 11, dtype=torch.float64)
    y = _target(kind, (2, 3, 13, 11))
    r = compare_training(fcn_2d().double(), world, x, y, loss_fn, grid=(2, 2), transport=transport)
    assert_exact(r)


@pytest.mark.world(4)
def test_dense_loss_never_gathers_output(world, transport, monkeypatch):
    """Shard-local losses: the driver receives (numerator, denominator) pairs, not output shards."""
    import bigconv.parallel as parallel

    gathered = []
    monkeypatch.setattr(parallel, "join_shards", lambda *a: gathered.append(1) or pytest.fail("output gathered"))
    net = parallel.parallelize(fcn_2d().double(), world, grid=(2, 2), transport=transport)
    net.optimizer(torch.optim.SGD, lr=0.1)
    x = torch.randn(1, 1, 10, 10, dtype=torch.float64)
    loss = net.train_step(x, torch.randn(1, 3, 10, 10, dtype=torch.float64), nn.MSELoss())
    assert loss > 0 and not gathered


@pytest.mark.world(4)
def test_other_loss_gets_gathered_output(world, transport):
    """Any other callable sees the full output: here a loss that mixes positions across shards."""
    def corner_loss(out, y):
        return ((out[:, :, 0, 0] - out[:, :, -1, -1]) ** 2).sum() + (out.mean() - y) ** 2

    x = torch.randn(1, 1, 12, 9, dtype=torch.float64)
    r = compare_training(fcn_2d().double(), world, x, torch.tensor(0.3, dtype=torch.float64), corner_loss,
                         grid=(2, 2), transport=transport)
    assert_exact(r)
