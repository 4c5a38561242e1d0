"""``capture`` on SPMD ranks against one process (issue 39, item 1): a torchvision ResNet-18 and an smp
U-Net with scSE attention, gradients of an output score and of a loss (per shard for the dense loss),
on 4 spawned gloo ranks; every rank gets the same whole captures, each within 1e-9 of one process.
Then ``bigconv.gradcam`` on the same ranks: Grad-CAM at two layers (upsampled across shard edges) and
saliency, gathered on every rank and written by the ranks (an OME-Zarr of 3 levels, a zarr array).

A failure here points to ``capture_spmd`` in ``bigconv/capture.py``.
"""

from __future__ import annotations

import os
import sys

import pytest

from bigconv.runtime import spmd_launch as launch

sys.path.insert(0, os.path.dirname(__file__))  # the ranks import capture_spmd_cases from here
import capture_spmd_cases  # noqa: E402


@pytest.mark.own_world
@pytest.mark.timeout(600)
def test_capture_on_spmd_ranks_is_exact(exclusive, tmp_path):
    per_rank = launch.run(capture_spmd_cases.run, 4, (str(tmp_path),), timeout=540)
    assert len(per_rank) == 4
    assert per_rank[0], "no capture was compared"
    assert {"gradcam/layer2", "gradcam/layer3", "saliency", "written/ome.zarr", "written/zarr"} <= set(per_rank[0])
    for rank, errors in enumerate(per_rank):
        bad = {k: v for k, v in errors.items() if not v <= 1e-9}
        assert not bad, f"rank {rank}: {bad}"
    assert len({tuple(sorted(e.items())) for e in per_rank}) == 1  # the same captures on every rank
