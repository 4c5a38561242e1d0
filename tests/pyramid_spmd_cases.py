"""What each SPMD rank runs for ``tests/test_pyramid_spmd.py``: predictions written as pyramids."""

from __future__ import annotations

import os

import torch
import torch.nn as nn

import bigconv


def segmenter() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.Conv2d(6, 3, 3, stride=2, padding=1)).double()


def batch() -> torch.Tensor:
    return torch.randn(2, 3, 400, 240, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def run(folder: str) -> list[str]:
    x = batch()
    with bigconv.World.from_env(mode="spmd") as world:
        net = bigconv.parallelize(segmenter(), world, grid=(2, 2))
        paths = [net.predict(x[:1], os.path.join(folder, "pred.ome.zarr"), keep=("probabilities", "labels"), levels=4,
                             mpp=0.25, max_chunk=32),
                 net.predict(x[:1], os.path.join(folder, "pred.ome.tif"), keep="labels", levels=3, mpp=0.25),
                 net.predict(x, os.path.join(folder, "labels.zarr"), keep="labels")]
        try:
            net.predict(x, os.path.join(folder, "two.ome.zarr"))
        except ValueError as exc:
            paths.append(str(exc))
        return paths
