"""What each SPMD rank runs for ``tests/test_spmd_attention_outputs.py``: ``predict`` of models with several
outputs, and training through halo attention, neighbourhood attention and EdgeNeXt's prefix sums.

Every rank opens one SPMD world and runs every case in it; ranks seed alike, so each builds the same
model and batch. A training case returns ``exactness.compare``'s result; a predict case the paths it
wrote (read and compared with one process by the test); an exception its text.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn

import bigconv
from exactness import compare
from issue37_models import NeighbourhoodNet, TimmAttention, case

PREDICT = {
    # name: (model case, grid, replicas, batch)
    "deep-supervision/(2,2)": ("deep-supervision", (2, 2), 1, 2),
    "dict-heads/(2,2)": ("dict-heads", (2, 2), 1, 2),
    "aux-classifier/(2,2)": ("aux-classifier", (2, 2), 1, 2),
    "deep-supervision/R2/(1,2)": ("deep-supervision", (1, 2), 2, 4),
}
"""Each written as floats and as labels; the input 64x64 (chunks of 16 and more at both scales)."""


def predict_input(batch: int) -> torch.Tensor:
    return torch.randn(batch, 1, 64, 64, generator=torch.Generator().manual_seed(3), dtype=torch.float64)


def _predict(name: str, folder: str):
    def run(world):
        model_case, grid, replicas, batch = PREDICT[name]
        model = case(model_case)[0]
        net = bigconv.parallelize(model, world, grid=grid, replicas=replicas)
        x = predict_input(batch)
        stem = os.path.join(folder, name.replace("/", "_"))
        return [net.predict(x, stem + ".zarr"), net.predict(x, stem + "-labels.zarr", keep="labels")]
    return run


def _refusals(folder: str):
    """The driver mode's refusals, raised alike on every rank: an OME-TIFF, outputs that are all vectors,
    and (checked by rank 0 alone) an ``out`` bigconv did not write, even with ``overwrite=True``."""
    def run(world):
        said = []
        for model_case, out in (("deep-supervision", "p.ome.tif"), ("two-heads", "q.zarr"),
                                ("dict-heads", "not-ours.zarr")):
            model, x, _, _ = case(model_case)
            x = predict_input(2) if out == "not-ours.zarr" else x  # chunk edges on the shards' (the case's 11x9 has none)
            net = bigconv.parallelize(model, world, grid=(2, 2))
            try:
                net.predict(x, os.path.join(folder, out), overwrite=out == "not-ours.zarr")  # overwrites only ours
                said.append("written")
            except ValueError as exc:
                said.append(str(exc))
        return said
    return run


def _failed_write(folder: str):
    """Rank 1's write fails while replacing an earlier prediction: every rank raises naming rank 1, and the
    earlier prediction stays (the partial group is removed by rank 0)."""
    def run(world):
        from bigconv.data import outputs

        net = bigconv.parallelize(case("dict-heads")[0], world, grid=(2, 2))
        x, out = predict_input(2), os.path.join(folder, "kept.zarr")
        net.predict(x, out)
        write = outputs.write

        def full_disk(*args, **kwargs):
            raise OSError("no space left on device (planted on rank 1)")

        if world.rank == 1:
            outputs.write = full_disk
        try:
            net.predict(2 * x, out, overwrite=True)
            return {"said": "written"}
        except Exception as exc:
            return {"said": f"{type(exc).__name__}: {exc}"}
        finally:
            outputs.write = write
    return run


def _timm_halo(world):
    """timm ``HaloAttn`` split by the unfold rule: blocks of 2, a halo of 1, an 8x8 map on 2x2 shards."""
    torch.manual_seed(0)
    model = TimmAttention("halo", block=2, halo=1).double()
    x = torch.randn(2, 1, 16, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    return compare(model, world, x, torch.tensor([0, 2]), nn.CrossEntropyLoss(), grid=(2, 2))


def _neighbourhood(world):
    """NATTEN's torch pattern, an even kernel of 4 with dilation 2, 16x16 on 2x2 shards."""
    torch.manual_seed(0)
    model = NeighbourhoodNet(4, 2).double()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 1, 16, 16, generator=g, dtype=torch.float64)
    y = torch.randn(2, 2, 16, 16, generator=g, dtype=torch.float64)
    return compare(model, world, x, y, nn.MSELoss(), grid=(2, 2))


def _prefix_sums(world):
    """EdgeNeXt's habits (``test_true_refusals.CountsAndCovariance``): cumsum over both sharded dims on uneven
    shards (6/5 rows), divided by the last row and column; a global channel norm."""
    from test_true_refusals import CountsAndCovariance

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 1, 11, 10, generator=g, dtype=torch.float64)
    y = torch.randn(2, 2, 11, 10, generator=g, dtype=torch.float64)
    return compare(CountsAndCovariance().double(), world, x, y, nn.MSELoss(), grid=(2, 2))


TRAINING = {
    "halo/timm/(2,2)": _timm_halo,
    "neighbourhood/k4-dilated/(2,2)": _neighbourhood,
    "cumsum/edgenext/(2,2)": _prefix_sums,
}


def run_cases(folder: str, timeout: float = 60.0) -> dict:
    torch.set_num_threads(1)
    cases = {**{f"predict/{n}": _predict(n, folder) for n in PREDICT}, "predict/refusals": _refusals(folder),
             "predict/failed-write": _failed_write(folder),
             **TRAINING}
    results = {}
    with bigconv.World.from_env(mode="spmd", device="cpu", timeout=timeout) as world:
        for name, run in cases.items():
            try:
                results[name] = run(world)
            except Exception as exc:
                results[name] = f"{type(exc).__name__}: {exc}"
    return results
