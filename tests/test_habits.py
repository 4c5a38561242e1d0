"""The habits users train with, against one process in float64 (issue 22, items 1-5).

Random draws (dropout, stochastic depth, noise) are compared *bitwise in law's place*: the single
process draws under ``bigconv.ops.random.RandomDraws(seed)``, the generator the shards use, so the
comparison is exact; against torch's own generator the draws agree in law only. Errors are asserted
raw (error over the tensor's own size), not floored by the perturbed runs' noise.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import bigconv
from bigconv.compat import allow_torchvision_without_ops
from bigconv.ops.random import RandomDraws
from bigconv.verify import ERROR_KEYS, compare_training

TOL = 1e-9
allow_torchvision_without_ops()  # before torchvision (and timm/smp, which import it)


def assert_exact(r: dict, tol: float = TOL) -> None:
    raw = {}
    for t in r["tensors"]:
        rel = t["error"] / t["scale"] if t["scale"] else t["error"]
        if rel > tol:
            raw[(t["category"], t["tensor"])] = rel
    assert not raw, raw
    assert all(r[k] <= tol for k in ERROR_KEYS), {k: r[k] for k in ERROR_KEYS}
    assert r["keys_match"] and r["replicas_equal"]


class DropPath(nn.Module):
    """timm's ``DropPath`` as timm writes it: one (N, 1, 1, 1) draw per image."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x):
        if not self.training or self.p == 0:
            return x
        keep = 1 - self.p
        mask = x.new_empty((x.shape[0],) + (1,) * (x.dim() - 1)).bernoulli_(keep)
        return x * mask.div_(keep)


class Block(nn.Module):
    def __init__(self, c: int, drop) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.drop = drop

    def forward(self, x):
        return x + self.drop(torch.tanh(self.conv(x)))


def stochastic_net(c: int = 4) -> nn.Module:
    """Every kind of draw: per image (DropPath, torchvision's StochasticDepth), per position
    (Dropout, AlphaDropout, noise), per channel (Dropout2d), and dropout in the replicated head."""
    from torchvision.ops import StochasticDepth

    class Noisy(nn.Module):
        def forward(self, x):
            return x + 0.1 * torch.randn_like(x) + 0.05 * torch.rand(x.shape, dtype=x.dtype)

    return nn.Sequential(
        nn.Conv2d(2, c, 3, padding=1), Block(c, DropPath(0.5)), Block(c, StochasticDepth(0.5, "row")),
        nn.Dropout(0.3), Block(c, nn.Dropout2d(0.4)), Noisy(), nn.AlphaDropout(0.2), nn.Conv2d(c, c, 3, stride=2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.5), nn.Linear(c, 3),
    ).double()


@pytest.mark.world(4)
@pytest.mark.timeout(300)
def test_training_randomness_is_one_process_draw(world):
    torch.manual_seed(0)
    model = stochastic_net().train()
    x = torch.randn(4, 2, 13, 11, dtype=torch.float64)
    y = torch.randint(0, 3, (4,))
    r = compare_training(model, world, x, y, nn.CrossEntropyLoss(), grid=(2, 2), seed=11)
    assert_exact(r)


@pytest.mark.world(4)
@pytest.mark.timeout(300)
def test_draws_do_not_depend_on_the_grid(world):
    """The same seed on another grid gives the same output: the draws follow global positions."""
    torch.manual_seed(0)
    model = stochastic_net().train()
    x = torch.randn(2, 2, 12, 12, dtype=torch.float64)
    outs = [bigconv.parallelize(copy.deepcopy(model), world, grid=g, seed=3)(x) for g in ((2, 2), (4, 1))]
    with RandomDraws(3).forward():
        want = model(x)
    for out in outs:
        assert torch.allclose(out, want, rtol=1e-12, atol=1e-12)


def test_draws_follow_torch_law():
    """Uniform, Bernoulli and normal draws with the laws torch's own generator gives."""
    x = torch.ones(200, 500, dtype=torch.float64)
    with RandomDraws(7).forward():
        kept = (F.dropout(x, 0.3, True) != 0).double().mean().item()
        per_image = torch.empty(4000, 1, 1, 1).bernoulli_(0.8).mean().item()
        z = torch.randn(100000, dtype=torch.float64)
        u = torch.rand(100000, dtype=torch.float32)
    assert abs(kept - 0.7) < 0.01 and abs(per_image - 0.8) < 0.03
    assert abs(z.mean().item()) < 0.02 and abs(z.std().item() - 1) < 0.02
    assert 0.0 <= u.min().item() and u.max().item() < 1.0 and abs(u.mean().item() - 0.5) < 0.01
    with RandomDraws(7).forward():
        again = F.dropout(x, 0.3, True)
    with RandomDraws(8).forward():
        other = F.dropout(x, 0.3, True)
    with RandomDraws(7).forward():
        same = F.dropout(x, 0.3, True)
    assert torch.equal(again, same) and not torch.equal(again, other)


@pytest.mark.world(4)
@pytest.mark.timeout(120)
def test_unsupported_draws_are_refused(world):
    class Shuffle(nn.Module):
        def forward(self, x):
            return x * torch.randint(0, 2, x.shape, dtype=x.dtype)

    net = bigconv.parallelize(nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), Shuffle()).double(), world, grid=(2, 2))
    with pytest.raises(ValueError, match="each worker would draw its own values"):
        net.plan(torch.zeros(1, 1, 8, 8, dtype=torch.float64))


def parametrized_net(old_style: bool) -> nn.Module:
    from torch.nn.utils import parametrizations

    wn = nn.utils.weight_norm if old_style else parametrizations.weight_norm
    sn = nn.utils.spectral_norm if old_style else parametrizations.spectral_norm
    return nn.Sequential(
        wn(nn.Conv2d(2, 4, 3, padding=1)), nn.ReLU(), sn(nn.Conv2d(4, 4, 3, padding=1)), nn.Tanh(),
        wn(nn.Conv2d(4, 4, 3, stride=2)), nn.AdaptiveAvgPool2d(1), nn.Flatten(), sn(nn.Linear(4, 3)),
    ).double()


@pytest.mark.world(4)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("old_style", [False, True], ids=["parametrizations", "hooks"])
def test_parametrized_weights_train_exactly(world, old_style):
    """weight_norm and spectral_norm (whose power iteration updates u and v in every training forward):
    the weights, their originals and the power-iteration buffers end as one process's on every replica."""
    import warnings

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nn.utils.weight_norm is deprecated
        model = parametrized_net(old_style).train()
    x = torch.randn(2, 2, 12, 10, dtype=torch.float64)
    y = torch.randint(0, 3, (2,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = compare_training(model, world, x, y, nn.CrossEntropyLoss(), grid=(2, 2))
    assert_exact(r)
    names = {t["tensor"] for t in r["tensors"] if t["category"] == "weights"}
    assert any(n.endswith(("_u", "weight_u", "original0")) for n in names), names
