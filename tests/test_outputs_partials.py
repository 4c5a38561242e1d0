"""What an interrupted prediction leaves beside its ``out=`` is named by the next run (never deleted: another
run may still be writing it), for every output format: a zarr's staging array, an OME-TIFF's staging
OME-Zarr (``.NAME.ome.tif.zarr.bigconv-partial-*``) and its half-written TIFF."""

from __future__ import annotations

import os

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
