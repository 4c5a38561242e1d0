"""What an interrupted prediction leaves beside its ``out=`` is named by the next run (never deleted: another
run may still be writing it), for every output format: a zarr's staging array, an OME-TIFF's staging
OME-Zarr (``.NAME.ome.tif.zarr.bigconv-partial-*``) and its half-written TIFF."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from bigconv.data import outputs


@pytest.mark.parametrize("name, leftover", [
    ("pred.zarr", ".pred.zarr.bigconv-partial-0123456789ab"),
    ("pred.ome.zarr", ".pred.ome.zarr.bigconv-partial-0123456789ab"),
    ("pred.ome.tif", ".pred.ome.tif.bigconv-partial-0123456789ab"),
    ("pred.ome.tif", ".pred.ome.tif.zarr.bigconv-partial-0123456789ab"),  # the TIFF's staging levels
])
def test_the_next_run_names_what_an_interrupted_one_left(tmp_path, name, leftover):
    os.makedirs(tmp_path / leftover)
    out = str(tmp_path / name)
    with pytest.warns(UserWarning, match="interrupted predictions") as seen:
        tmp = outputs.temporary(out)
    assert leftover in str(seen[0].message)
    assert (tmp_path / leftover).is_dir()  # named, not deleted
    assert os.path.basename(tmp).startswith(f".{name}{outputs.PARTIAL}")


def test_another_outputs_leftover_is_not_named(tmp_path, recwarn):
    os.makedirs(tmp_path / ".other.ome.tif.zarr.bigconv-partial-0123456789ab")
    os.makedirs(tmp_path / ".pred.ome.tif.zarr.old")  # not a partial of ours
    outputs.temporary(str(tmp_path / "pred.ome.tif"))
    assert not [w for w in recwarn if "interrupted" in str(w.message)]


# -- issue 52 item 6: a destination is claimed while a run writes it --------------------------------------------------
def _run(out: str, overwrite: bool = False) -> tuple[str, str]:
    """What a prediction does on the driver (or SPMD rank 0) before its workers start: check and claim ``out``,
    then make its staging array."""
    path = outputs.check_out(out, [], overwrite)
    return path, outputs.begin(path, (1, 1, 4, 4), (4, 4), "float32")


def test_a_second_run_to_the_same_out_is_refused_while_the_first_writes(tmp_path):
    out = str(tmp_path / "pred.zarr")
    first, tmp = _run(out)
    with pytest.raises(ValueError, match=rf"pid {os.getpid()} on {socket.gethostname()}.*another out="):
        outputs.check_out(out, [], False)  # before the claim: both ran, the second replaced the first silently
    with pytest.raises(ValueError, match="being written by another"):
        outputs.check_out(out, [], True)  # overwrite=True does not take a running prediction's place either
    assert outputs.finish(tmp, first) == out
    assert sorted(os.listdir(tmp_path)) == ["pred.zarr"]  # the claim is gone with the run
    with pytest.raises(ValueError, match="exists"):
        outputs.check_out(out, [], False)
    again, tmp = _run(out, overwrite=True)
    outputs.finish(tmp, again)
    assert sorted(os.listdir(tmp_path)) == ["pred.zarr"]


def test_finish_without_overwrite_never_replaces_an_output_that_appeared(tmp_path):
    out = str(tmp_path / "pred.zarr")
    path, tmp = _run(out)
    with pytest.warns(UserWarning, match="interrupted"):  # the first run's staging array, named
        other = outputs.begin(out, (1, 1, 4, 4), (4, 4), "float32")
    os.rename(other, out)  # an output of ours appeared meanwhile (a run that took no claim: an older bigconv)
    with pytest.raises(ValueError, match="appeared during the prediction.*overwrite=False.*kept at"):
        outputs.finish(tmp, path)
    assert os.path.isdir(tmp) and os.path.isdir(out)  # both kept
    assert not os.path.exists(outputs.claim_path(out))


def test_a_dead_runs_claim_is_taken_over_and_a_live_or_foreign_one_refuses(tmp_path):
    out = str(tmp_path / "pred.zarr")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    claim = outputs.claim_path(out)
    for holder in ({"host": socket.gethostname(), "pid": int(dead.stdout)},):
        with open(claim, "w") as fh:
            json.dump({**holder, "token": "x", "since": "then"}, fh)
        path, tmp = _run(out)  # a claim whose process on this host is gone: taken over
        outputs.finish(tmp, path)
    os.rename(out, str(tmp_path / "kept.zarr"))
    for holder, words in (({"host": socket.gethostname(), "pid": os.getppid()}, "being written by another"),
                          ({"host": "elsewhere", "pid": 12345}, "pid 12345 on elsewhere")):
        with open(claim, "w") as fh:
            json.dump({**holder, "token": "x", "since": "then"}, fh)
        with pytest.raises(ValueError, match=words) as info:
            outputs.check_out(out, [], True)
        assert claim in str(info.value)  # named, to delete by hand once that run is known to be gone
        assert os.path.exists(claim)  # never removed
