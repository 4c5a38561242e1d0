"""SPMD ranks that disagree fail together, naming the rank and the field; SPMD predict refuses the
same way on every rank and never destroys the user's files (issue 34).

One spawn of 2 gloo ranks runs every case (``cases``), with a hard timeout; each test checks its
case. A failure points to ``bigconv/spmd/agreement.py`` or the ``predict`` of ``bigconv/spmd/model.py``.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.nn as nn

import bigconv
from bigconv.runtime import spmd_launch as launch


def _dense() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 2, 3, padding=1)).double()


def _error(call) -> str:
    try:
        call()
        return "no error"
    except ValueError as exc:
        return f"ValueError: {exc}"
    except Exception as exc:
        return f"wrong type {type(exc).__name__}: {exc}"


def cases(folder: str) -> dict:
    """Run on every rank; returns what each case saw on this rank."""
    from bigconv.data import open_image

    torch.set_num_threads(1)
    out = {}
    with bigconv.World.from_env(mode="spmd", device="cpu", timeout=30) as world:
        x, y = torch.randn(2, 1, 16, 16, dtype=torch.float64), torch.randn(2, 2, 16, 16, dtype=torch.float64)
        mine = (2, 1) if world.rank == 0 else (1, 2)  # each rank believes in its own grid
        net = bigconv.parallelize(_dense(), world, grid=mine)
        net.optimizer(torch.optim.SGD, lr=0.1)
        out["grid"] = _error(lambda: net.train_step(x, y, nn.MSELoss()))
        net = bigconv.parallelize(_dense(), world, grid=(2, 1))
        net.optimizer(torch.optim.SGD, lr=0.1)
        mine_x = x if world.rank == 0 else x[:, :, :, :12]
        out["shape"] = _error(lambda: net(mine_x))
        loss = nn.MSELoss() if world.rank == 0 else nn.L1Loss()
        out["loss"] = _error(lambda: net.train_step(x, y, loss))
        out["agreed"] = net.train_step(x, y, nn.MSELoss())  # after refusals the world is still in step
        src = [open_image(os.path.join(folder, "in.npy"), dtype="float64")] * 2
        out["predict_onto_input"] = _error(lambda: net.predict(src, out=os.path.join(folder, "in.npy"),
                                                               overwrite=True))
        out["predict_onto_user_folder"] = _error(lambda: net.predict(src, out=os.path.join(folder, "mine"),
                                                                     overwrite=True))
        path = net.predict(src, out=os.path.join(folder, "pred.zarr"))
        net.predict(src, out=path, overwrite=True)
        out["predict_exists"] = _error(lambda: net.predict(src, out=path))
        world.barrier()
        out["listing"] = sorted(os.listdir(folder))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("spmd_agreement")
    np.save(folder / "in.npy", np.random.default_rng(0).random((1, 32, 32)))
    (folder / "mine").mkdir()
    (folder / "mine" / "notes.txt").write_text("my notes")
    return launch.run(cases, 2, (str(folder),), timeout=240), folder


@pytest.mark.timeout(300)
def test_ranks_with_different_grids_fail_on_every_rank_naming_rank_and_field(runs):
    per_rank, _ = runs
    for r in per_rank:
        assert r["grid"] == per_rank[0]["grid"], per_rank  # the same error, word for word, on every rank
        assert "rank 1's grid is (1, 2) but rank 0's is (2, 1)" in r["grid"], r["grid"]
        assert "rank 1's input shape" in r["shape"] and "rank 1's loss" in r["loss"], r
    assert per_rank[0]["agreed"] == per_rank[1]["agreed"]


@pytest.mark.timeout(300)
def test_spmd_predict_refuses_identically_on_every_rank_and_keeps_user_files(runs):
    per_rank, folder = runs
    for key, words in (("predict_onto_input", "is one of the inputs"), ("predict_onto_user_folder",
                                                                       "was not written by bigconv"),
                       ("predict_exists", "exists; choose another out=")):
        assert per_rank[0][key] == per_rank[1][key] and words in per_rank[0][key], (key, per_rank)
    assert per_rank[0]["listing"] == ["in.npy", "mine", "pred.zarr"], per_rank[0]["listing"]
    assert (folder / "mine" / "notes.txt").read_text() == "my notes"
