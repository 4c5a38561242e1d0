"""Issue 52's edges in the SPMD mode: NaN outputs kept as uint8 are refused on every rank, naming the rank, the
output and the first NaN in the output's coordinates (item 10); a ``net.save`` that fails on rank 0 only raises
on every rank promptly, naming rank 0 and the save, and leaves the ranks in step (item 9).

One spawn of 2 gloo ranks (grid (2, 1): rank 0 holds rows 0-15 of the 32x32 output, rank 1 rows 16-31) runs every
case, with a hard timeout; each test checks its case on every rank. The driver mode's tests of the same shared code
are in ``tests/test_predict_safety.py``; a failure in both points at ``bigconv/data/pyramid.py`` (``convert``), one
here only at ``bigconv/prediction.py``'s ``predict_spmd`` or ``bigconv/runtime/spmd_outputs.py``. The save's case
is last: before its fix it left rank 1 in a barrier rank 0 never reached.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.nn as nn

import bigconv
from bigconv.runtime import spmd_launch as launch

WORLD_TIMEOUT_S = 20.0


def _dense() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 2, 3, padding=1)).double()


def _error(call) -> str:
    try:
        call()
        return "no error"
    except Exception as exc:  # noqa: BLE001 - the test reads the type and the words
        return f"{type(exc).__name__}: {exc}"


def cases(folder: str) -> dict:
    """Run on every rank; what each case saw on this rank."""
    torch.set_num_threads(1)
    out = {}
    with bigconv.World.from_env(mode="spmd", device="cpu", timeout=WORLD_TIMEOUT_S) as world:
        net = bigconv.parallelize(_dense(), world, grid=(2, 1))
        net.optimizer(torch.optim.SGD, lr=0.1)
        x = torch.rand(1, 1, 32, 32, dtype=torch.float64)
        x[0, 0, 24, 5] = float("nan")  # rank 1's rows; through two 3x3 convolutions: rows 22-26, columns 3-7
        out["nan_probabilities"] = _error(lambda: net.predict(x, out=os.path.join(folder, "nan.zarr"),
                                                              keep="probabilities"))
        world.barrier()
        out["listing"] = sorted(os.listdir(folder))
        # A folder rank 0 cannot make (a regular file stands where it goes): rank 0 alone writes, so it alone fails.
        started = time.monotonic()
        out["save_fails"] = _error(lambda: net.save(os.path.join(folder, "..", "blocked", "ck.pt")))
        out["save_took"] = time.monotonic() - started
        out["save_after"] = _error(lambda: net.save(os.path.join(folder, "ck.pt")))  # every rank still in step
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("issue52_spmd")
    (folder / "out").mkdir()
    (folder / "blocked").write_text("a file, not a folder")
    return launch.run(cases, 2, (str(folder / "out"),), timeout=150), folder


@pytest.mark.timeout(200)
def test_nan_kept_as_uint8_is_refused_on_every_rank_naming_rank_output_and_position(runs):
    per_rank, folder = runs
    for rank, r in enumerate(per_rank):
        seen = r["nan_probabilities"]
        assert seen.startswith("WorkerFailure: predict (level 0) failed on rank 1"), (rank, seen)
        for words in (os.path.join(folder, "out", "nan.zarr"), "keep='probabilities'", "NaN at 25 ", "position (22, 3)",
                      "keep='float'"):
            assert words in seen, (rank, words, seen)
        assert r["listing"] == [], (rank, r["listing"])  # nothing written, no claim or partial left


@pytest.mark.timeout(200)
def test_a_save_failing_on_rank_zero_raises_on_every_rank_promptly(runs):
    per_rank, folder = runs
    for rank, r in enumerate(per_rank):
        seen = r["save_fails"]
        assert seen.startswith("WorkerFailure: save of ") and "failed on rank 0" in seen, (rank, seen)
        assert "blocked" in seen and "Error" in seen.split("failed on rank 0", 1)[1], (rank, seen)  # rank 0's error
        assert r["save_took"] < WORLD_TIMEOUT_S / 2, (rank, r["save_took"])  # not the collective's timeout
        assert r["save_after"] == "no error", (rank, r["save_after"])
    assert (folder / "out" / "ck.pt").is_file() and (folder / "blocked").is_file()
