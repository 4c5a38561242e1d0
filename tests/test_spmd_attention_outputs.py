"""Issue 37's driver-mode additions on SPMD ranks, against one process in float64.

- ``predict`` of a model with several outputs (``bigconv.prediction._predict_several_spmd``): a zarr group
  with an array per dense output, each rank writing its box of every one (and, with replicas, of its
  replica's images); nnU-Net's deep supervision (two scales), HoVerNet's dict, a map beside a vector
  (not written); floats within 1e-12 of one process, labels equal to its argmax; the driver mode's
  refusals, raised alike on every rank; a write failing on one rank raised on every rank, the earlier
  prediction at ``out`` kept (``bigconv.runtime.spmd_outputs``).
- Training through timm ``HaloAttn`` and neighbourhood attention (``bigconv.ops.unfold``) and EdgeNeXt's
  prefix sums (``bigconv.ops.reduce``): every output, the input gradient, every parameter gradient, the
  losses and every weight after two SGD steps within 1e-9 of one process, each against its own size.
  A model with several outputs trained with a loss over the structure on SPMD ranks is
  ``tests/test_issue37_spmd.py``'s (deep supervision, HoVerNet's dict).

One spawn of 4 gloo ranks runs every case (hard timeout).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # the ranks import spmd_attention_outputs_cases from here
import spmd_attention_outputs_cases as cases  # noqa: E402
from issue37_models import case  # noqa: E402

from bigconv.runtime import spmd_launch as launch  # noqa: E402

TOL = 1e-9


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("spmd_attention_outputs")
    (folder / "not-ours.zarr").mkdir()
    (folder / "not-ours.zarr" / "notes.txt").write_text("the user's")
    return folder, launch.run(cases.run_cases, 4, (str(folder),), timeout=540)


def _per_rank(runs, name):
    _, per_rank = runs
    for rank, results in enumerate(per_rank):
        assert not isinstance(results[name], str), f"rank {rank}: {results[name]}"
    return [results[name] for results in per_rank]


def _single(model, x) -> dict:
    with torch.no_grad():
        out = model(x)
    return dict(out) if isinstance(out, dict) else {str(i): t for i, t in enumerate(out)}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name,written", [
    ("deep-supervision/(2,2)", ["0", "1"]),
    ("dict-heads/(2,2)", ["hv", "np", "tp"]),
    ("aux-classifier/(2,2)", ["0"]),
    ("deep-supervision/R2/(1,2)", ["0", "1"]),
])
def test_predict_writes_an_array_per_dense_output(runs, name, written):
    import zarr

    per_rank = _per_rank(runs, f"predict/{name}")
    assert all(paths == per_rank[0] for paths in per_rank)  # every rank returns the same paths
    model_case, _, _, batch = cases.PREDICT[name]
    want = _single(case(model_case)[0], cases.predict_input(batch))
    floats, labels = (zarr.open_group(p, mode="r") for p in per_rank[0])
    assert sorted(floats.array_keys()) == written and sorted(labels.array_keys()) == written
    for key in written:
        got = torch.from_numpy(floats[key][...])
        assert got.shape == want[key].shape and got.dtype == torch.float64, key
        assert (got - want[key]).abs().max() <= 1e-12 * want[key].abs().max(), key
        assert torch.equal(torch.from_numpy(labels[key][...]).long()[:, 0], want[key].argmax(1)), key


@pytest.mark.timeout(600)
def test_predict_refusals_on_every_rank(runs):
    folder, _ = runs
    per_rank = _per_rank(runs, "predict/refusals")
    assert all(said == per_rank[0] for said in per_rank)  # the same error on every rank
    ome, vectors, theirs = per_rank[0]
    assert "OME-TIFF holds one image per output, but this batch has 2" in ome
    assert "none of this model's 2 outputs is one" in vectors
    assert theirs.startswith("predict refused on rank 0") and "not written by bigconv" in theirs, theirs
    assert sorted(os.listdir(folder / "not-ours.zarr")) == ["notes.txt"]  # the user's folder, untouched
    assert not (folder / "p.ome.tif").exists() and not (folder / "q.zarr").exists()
    assert not [n for n in os.listdir(folder) if "partial" in n]  # every store made was moved into place


@pytest.mark.timeout(600)
def test_a_failed_write_leaves_the_earlier_prediction(runs):
    import zarr

    folder, _ = runs
    per_rank = [r["said"] for r in _per_rank(runs, "predict/failed-write")]
    assert all(said == per_rank[0] for said in per_rank)  # the same error on every rank
    said = per_rank[0]
    assert said.startswith("WorkerFailure: predict (several outputs) failed on rank 1: OSError: no space left"), said
    assert said.endswith("is as it was"), said
    want = _single(case("dict-heads")[0], cases.predict_input(2))
    kept = zarr.open_group(str(folder / "kept.zarr"), mode="r")
    for key in ("hv", "np", "tp"):  # the first prediction's, of x (not of 2 x)
        assert (torch.from_numpy(kept[key][...]) - want[key]).abs().max() <= 1e-12 * want[key].abs().max(), key
    assert not [n for n in os.listdir(folder) if "partial" in n]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", sorted(cases.TRAINING))
def test_training_matches_single_process(runs, name):
    for rank, r in enumerate(_per_rank(runs, name)):
        bad = {k: v for k, v in r["errors"].items() if not v <= TOL}
        assert not bad, (rank, bad)
        assert r["replicas_equal"], rank
