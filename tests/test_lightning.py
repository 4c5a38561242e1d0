"""``BigconvStrategy``: an unchanged LightningModule under a Lightning ``Trainer`` on a spatial grid.

One spawn of 4 gloo ranks (``tests/lightning_cases.py``) runs each Trainer: AdamW with two param groups,
a warmup-cosine schedule stepped per step, ``gradient_clip_val``, ``accumulate_grad_batches=2``,
``self.log(..., sync_dist=True)``; on a (2, 2) grid and on 2 replicas × (2, 1) (a replicated head and a
dense map), each against one process in float64 on the batches Lightning's sampler drew. A failure
points at ``bigconv.lightning`` (the sampler over replicas, the replicas' average, the network swap) or
``SpmdModel.replica_batches``.
"""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("lightning", reason="the lightning extra (pip install 'bigconv[lightning]')")

sys.path.insert(0, os.path.dirname(__file__))
import lightning_cases as cases  # noqa: E402

from bigconv.runtime import spmd_launch as launch  # noqa: E402

TOL = 1e-9


@pytest.fixture(scope="module")
def ranks():
    return launch.run(cases.run_all, 4, (), timeout=1200)


def _case(ranks, name):
    for rank, results in enumerate(ranks):
        assert isinstance(results[name], dict), f"rank {rank}: {results[name]}"
    return [results[name] for results in ranks]


@pytest.mark.timeout(1300)
@pytest.mark.parametrize("name", [n for n in cases.CASES if not n.startswith("plant/")])
def test_an_unchanged_lightning_module_trains_as_one_process(ranks, name):
    per_rank = _case(ranks, name)
    for rank, r in enumerate(per_rank):
        bad = {k: v for k, v in r["errors"].items() if not v <= TOL}
        assert not bad, (rank, bad)
        assert len(r["logged"]) == cases.STEPS * cases.ACCUMULATE
        # the checkpoint's keys: the plain network's, under the LightningModule's attribute
        assert r["keys"] and all(k.startswith("model.body.") for k in r["keys"]), r["keys"]
    assert len({tuple(r["logged"]) for r in per_rank}) <= 2  # one loss per replica
    assert len({r["callback_loss"] for r in per_rank}) == 1  # sync_dist: the same logged value everywhere


@pytest.mark.timeout(1300)
@pytest.mark.parametrize("name", [n for n in cases.CASES if n.startswith("plant/")])
def test_each_broken_habit_is_seen(ranks, name):
    """The replicas' gradients summed instead of averaged; the data split over every rank instead of over
    replicas: each fails the float64 comparison. (AdamW and the clip are nearly blind to a gradient's scale:
    summing instead of averaging moves the weights by ~5e-8 only, still 50 times the tolerance.)"""
    for rank, r in enumerate(ranks):
        result = r[name]
        if isinstance(result, dict):
            assert max(result["errors"].values()) > 10 * TOL, (rank, name, result["errors"])
        else:  # refused or failed outright is seen too
            assert result, (rank, name)
