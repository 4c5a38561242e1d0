"""Ops with a global order along a sharded dim (issue 51, item 4): flip, cummax/cummin, fold.

The contract: ``torch.flip`` (``fliplr``, ``flipud``) of a sharded dim is the shards' order reversed and each part
flipped (an index map of one tap, ``bigconv.geometry.index_maps.Flip``, through the exchange ``torch.roll`` uses);
``cummax``/``cummin`` along one are prefix scans as ``cumsum`` is (this shard's running extreme, then the running
extreme of the shards before it, taken where it wins as torch's sequential scan decides: ties to the later
position, NaN sticks), their indices global; ``F.fold`` (``nn.Fold``) of ``F.unfold``'s columns sums every block
that covers an output, across shards, as a transposed convolution's window does. A model using all of them trains
exactly on uneven shards (the verdict, float64, 1e-9 of each tensor's own size); their forward on threads matches
one process, and planted errors (a flip that keeps the shards' order, a scan that ignores the shards before it, a
fold that drops the blocks of the shard before) must fail. A failure points at ``bigconv.ops.roll._flip``,
``bigconv.ops.reduce._cum_extreme`` or ``bigconv.ops.unfold._fold``.
"""

from __future__ import annotations

import pytest
import torch
from issue51_models import GlobalOrder
from shard_threads import forward_on_threads, relative_error
from verdicts import assert_exact, verdict

from bigconv.geometry.boxes import TransposedWindow
from bigconv.geometry.index_maps import Flip
from bigconv.ops import reduce, roll, unfold


def _batch(shape, seed=1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen, dtype=torch.float64)
    return x, torch.randint(0, 3, (shape[0], *shape[2:]), generator=gen)


@pytest.mark.world(4)
@pytest.mark.timeout(300)
def test_flip_scans_and_fold_exact_on_uneven_shards(world):
    """An 11x9 map on 2x2 shards (6/5 by 5/4)."""
    torch.manual_seed(0)
    x, y = _batch((2, 1, 11, 9))
    assert_exact(verdict(GlobalOrder().double(), world, x, y))


@pytest.mark.world(3)
@pytest.mark.timeout(300)
def test_flip_scans_and_fold_exact_on_three_shards_along_rows(world):
    """A 13x10 map on 3x1 shards: a flip reads the mirror shard (the middle one itself), the last shard's scan folds
    in two shards before it."""
    torch.manual_seed(0)
    x, y = _batch((2, 1, 13, 10))
    assert_exact(verdict(GlobalOrder().double(), world, x, y, grid=(3, 1)))


def test_scan_ties_and_nans_as_torch():
    """Ties across shards go to the later position, a NaN wins and stays (indices as torch gives them)."""

    class Scans(torch.nn.Module):
        def forward(self, x):
            mx, imx = torch.cummax(x, 3)
            mn, imn = torch.cummin(x, 2)
            return torch.cat([mx, imx.to(x.dtype), mn, imn.to(x.dtype)], 1)

    x = torch.tensor([[1.0, 3, 3, 2, 3, 0, 5, 5], [2, 2, 2, float("nan"), 1, 7, float("nan"), 0]],
                     dtype=torch.float64).reshape(1, 1, 2, 8).repeat(1, 1, 3, 1)
    x[0, 0, 2] = torch.tensor([4.0, 4, 1, 1, 1, 1, 4, 0])
    got = forward_on_threads(Scans(), x, (3, 4))
    assert torch.equal(got.isnan(), Scans()(x).isnan())
    assert torch.equal(torch.nan_to_num(got, 9.0), torch.nan_to_num(Scans()(x), 9.0))


@pytest.mark.parametrize("plant", ["flip-local", "scan-alone", "fold-own-blocks"])
def test_planted_errors_fail(monkeypatch, plant):
    """Each planted error makes the model's forward on uneven 2x2 shards (threads, the workers' code) differ from one
    process; without it, it matches."""
    torch.manual_seed(0)
    model = GlobalOrder().double().eval()
    x, _ = _batch((2, 1, 11, 9))
    with torch.no_grad():
        want = model(x)
    assert relative_error(forward_on_threads(model, x, (2, 2)), want) <= 1e-12
    if plant == "flip-local":  # each shard flips its own part, the shards' order kept

        class LocalFlip(Flip):
            def taps(self, out):
                return [(list(range(out[1] - 1, out[0] - 1, -1)), None)]

        monkeypatch.setattr(roll, "Flip", LocalFlip)
    elif plant == "scan-alone":  # the shards before never win
        monkeypatch.setattr(reduce, "_wins", lambda new, old, largest: torch.ones_like(new, dtype=torch.bool))
    else:  # a shard folds only blocks that start inside it: overlaps from the shard before are not summed

        class OwnBlocks(TransposedWindow):
            def input_interval(self, out):
                lo, hi = super().input_interval(out)
                return max(lo, -(-(out[0] + self.padding) // self.stride)), hi

        monkeypatch.setattr(unfold, "TransposedWindow", OwnBlocks)
    assert relative_error(forward_on_threads(model, x, (2, 2)), want) > 1e-6
