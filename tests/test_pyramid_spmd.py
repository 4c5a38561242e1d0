"""``predict`` of the SPMD mode writes the driver mode's pyramids (issue 39, item 3): an OME-Zarr with a
label image and an OME-TIFF from 4 spawned gloo ranks, each rank writing its region of every level; read
with ome-zarr's reader and tifffile and compared with one process.

A failure here points to ``predict_spmd`` in ``bigconv/prediction.py``.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

from bigconv.data import pyramid
from bigconv.runtime import spmd_launch as launch

sys.path.insert(0, os.path.dirname(__file__))  # the ranks import pyramid_spmd_cases from here
import pyramid_spmd_cases  # noqa: E402
from test_pyramid import naive_reduce  # noqa: E402


@pytest.mark.own_world
@pytest.mark.timeout(600)
def test_spmd_ranks_write_the_one_process_pyramid(exclusive, tmp_path):
    import tifffile
    import zarr
    from ome_zarr.io import parse_url
    from ome_zarr.reader import Reader

    per_rank = launch.run(pyramid_spmd_cases.run, 4, (str(tmp_path),), timeout=540)
    assert len({tuple(p) for p in per_rank}) == 1  # every rank returns the same paths and refusal
    assert "holds one image" in per_rank[0][3]
    with torch.no_grad():
        full = pyramid_spmd_cases.segmenter()(pyramid_spmd_cases.batch())
    assert sorted(os.listdir(tmp_path)) == ["labels.zarr", "pred.ome.tif", "pred.ome.zarr"]

    nodes = list(Reader(parse_url(per_rank[0][0]))())
    image, label = nodes[0], next(n for n in nodes if "color" in n.metadata)
    for kind, node in (("probabilities", image), ("labels", label)):
        level = pyramid.convert(kind, full[:1], 3)[0]
        assert len(node.data) == 4
        for k, data in enumerate(node.data):
            assert np.array_equal(np.asarray(data), level), (kind, k)
            level = naive_reduce(level, kind)
    assert image.metadata["coordinateTransformations"][3][0]["scale"] == [1.0, 4.0, 4.0]  # 0.25 µm x 2 x 2^3
    with tifffile.TiffFile(per_rank[0][1]) as tif:
        level = pyramid.convert("labels", full[:1], 3)[0]
        assert [lv.shape for lv in tif.series[0].levels] == [(200, 120), (100, 60), (50, 30)]
        for lv in tif.series[0].levels:
            assert np.array_equal(lv.asarray(), level[0])
            level = naive_reduce(level, "labels")
    got = zarr.open_array(per_rank[0][2], mode="r")
    assert got.dtype == np.uint8 and np.array_equal(got[:], pyramid.convert("labels", full, 3))
