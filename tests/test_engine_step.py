"""The pieces of the engine's step that both front ends share, without processes: a replica's share
of the batch, the box-to-slices mapping, and the ``ShardCall`` each shard gets (compact tensors, or
the read of its own box of the slides). The step itself runs in every equivalence test."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from bigconv.data.sources import ShardRead, open_image
from bigconv.engine.executor import join_shards
from bigconv.engine.plan import Plan
from bigconv.engine.step import shard_calls
from bigconv.geometry.boxes import batch_share, box_index


@pytest.mark.parametrize("images,replicas", [(4, 2), (5, 2), (7, 3), (3, 3)])
def test_batch_share_tiles_the_batch(images, replicas):
    shares = [batch_share(images, replicas, r) for r in range(replicas)]
    assert shares[0][0] == 0 and shares[-1][1] == images
    assert all(a[1] == b[0] for a, b in zip(shares, shares[1:]))
    assert max(hi - lo for lo, hi in shares) - min(hi - lo for lo, hi in shares) <= 1


def test_batch_share_refuses_a_batch_smaller_than_the_replicas():
    with pytest.raises(ValueError, match="2 images for 3 replicas"):
        batch_share(2, 3, 0)


def test_box_index_cuts_items_and_box():
    x = torch.arange(4 * 2 * 6 * 5).reshape(4, 2, 6, 5)
    index = box_index(((1, 4), (2, 5)), x.dim(), items=(1, 3))
    assert torch.equal(x[index], x[1:3, :, 1:4, 2:5])
    y = torch.arange(4 * 6 * 5).reshape(4, 6, 5)  # class-index targets: no channel dim
    assert torch.equal(y[box_index(((0, 3), (0, 5)), y.dim())], y[:, 0:3])


def plan(grid, in_shape, out_shape=None):
    return Plan(grid, in_shape, out_shape if out_shape is not None else in_shape, (1, 1, *in_shape))


def test_shard_calls_are_compact_and_join_back():
    """Each shard's input and target is its own small tensor (a view would pickle the whole batch's
    storage into every message), and together they are the batch."""
    x = torch.randn(3, 2, 90, 70, dtype=torch.float64)
    y = torch.randn(3, 1, 90, 70, dtype=torch.float64)
    calls = shard_calls(5, plan((3, 2), (90, 70)), x, y)
    assert [c.call for c in calls] == [5] * 6 and all(c.grid == (3, 2) and c.in_shape == (90, 70) for c in calls)
    for c in calls:
        assert c.x.untyped_storage().nbytes() == c.x.numel() * c.x.element_size()
        assert len(pickle.dumps(c)) < (x.numel() * x.element_size() + y.numel() * y.element_size()) / 5
    assert torch.equal(join_shards([c.x for c in calls], (3, 2)), x)
    assert torch.equal(join_shards([c.target for c in calls], (3, 2)), y)


def test_a_replicas_shard_call_takes_its_images_only():
    x = torch.randn(5, 1, 8, 8)
    (c,) = shard_calls(1, plan((2, 1), (8, 8)), x, coords=[(1, 0)], items=(3, 5))
    assert torch.equal(c.x, x[3:5, :, 4:8, :]) and c.target is None


def test_sources_become_reads_of_the_shards_box(tmp_path):
    paths = []
    for i in range(3):
        np.save(tmp_path / f"s{i}.npy", np.full((1, 10, 6), i, dtype=np.float32))
        paths.append(str(tmp_path / f"s{i}.npy"))
    sources = [open_image(p) for p in paths]
    calls = shard_calls(2, plan((2, 1), (10, 6)), sources, coords=[(1, 0)], items=(1, 3), check_finite=True)
    (c,) = calls
    assert isinstance(c.x, ShardRead) and c.x.box == ((5, 10), (0, 6)) and c.x.check_finite
    assert [s.path for s in c.x.sources] == paths[1:3]
    read = c.x.read()
    assert read.shape == (2, 1, 5, 6) and read[0].eq(1).all() and read[1].eq(2).all()
