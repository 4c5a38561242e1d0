"""SyncBatchNorm, several outputs, torch.roll, modules held whole and ring attention in the SPMD mode, against one
process (issue 37).

One spawn of 4 gloo ranks runs every case of ``tests/spmd_issue37.py`` (hard timeout); each test then
checks its case on every rank: every output, the input gradient, every parameter gradient, the
losses and every weight after two SGD steps within 1e-9 of one process in float64, each against its
own size, and replicas equal. Cases with ``R2`` add data-parallel replicas: SyncBatchNorm's
statistics then span them (``bigconv.ops.norm.whole_stats``), a replicated output joins the
replicas' images (``SpmdModel._whole_batch_head``). A failure points at
``SpmdModel._structured_loss`` / ``__call__``, ``bigconv.ops.sync_norm``, ``bigconv.ops.roll`` (3D,
channels-last) or ``bigconv.ops.whole``.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # the ranks import spmd_issue37 from here
import spmd_issue37  # noqa: E402

from bigconv.runtime import spmd_launch as launch  # noqa: E402

TOL = 1e-9


@pytest.fixture(scope="module")
def runs():
    return launch.run(spmd_issue37.run_cases, 4, (sorted(spmd_issue37.CASES),), timeout=540)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", sorted(spmd_issue37.CASES))
def test_matches_single_process(runs, name):
    for rank, results in enumerate(runs):
        r = results[name]
        assert isinstance(r, dict), f"rank {rank}: {r}"
        bad = {k: v for k, v in r["errors"].items() if not v <= TOL}
        assert not bad, (rank, bad)
        assert r["replicas_equal"], rank
