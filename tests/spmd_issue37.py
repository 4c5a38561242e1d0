"""What each SPMD rank runs for ``tests/test_issue37_spmd.py``: SyncBatchNorm and several outputs.

Every rank opens one SPMD world and runs every case in it; ranks seed alike, so each builds the same
model, batch and targets. A case returns ``exactness.compare``'s result; an exception its text.
"""

from __future__ import annotations

import torch
import torch.nn as nn

import bigconv
from exactness import compare
from issue37_models import case, sync_bn_net


def _outputs(name: str, grid, replicas: int = 1, batch: int | None = None):
    def run(world):
        model, x, y, loss = case(name, batch=batch)
        return compare(model, world, x, y, loss, grid=grid, replicas=replicas)
    return run


def _sync_bn(grid, replicas: int):
    def run(world):
        torch.manual_seed(0)
        model = sync_bn_net()
        g = torch.Generator().manual_seed(1)
        x = torch.randn(4, 2, 11, 9, generator=g, dtype=torch.float64)
        return compare(model, world, x, torch.randint(0, 3, (4,), generator=g), nn.CrossEntropyLoss(), grid=grid,
                       replicas=replicas)
    return run


CASES = {
    "syncbn/(2,2)": _sync_bn((2, 2), 1),
    "syncbn/R2/(2,1)": _sync_bn((2, 1), 2),
    "deep-supervision/R2/(1,2)": _outputs("deep-supervision", (1, 2), 2, batch=4),
    "dict-heads/(2,2)": _outputs("dict-heads", (2, 2)),
    "aux-classifier/(2,2)": _outputs("aux-classifier", (2, 2)),
    "aux-classifier/R2/(2,1)": _outputs("aux-classifier", (2, 1), 2, batch=4),
    "two-heads/R2/(1,2)": _outputs("two-heads", (1, 2), 2, batch=3),
}


def run_cases(names: list[str], timeout: float = 60.0) -> dict:
    torch.set_num_threads(1)
    results = {}
    with bigconv.World.from_env(mode="spmd", device="cpu", timeout=timeout) as world:
        for name in names:
            try:
                results[name] = CASES[name](world)
            except Exception as exc:
                results[name] = f"{type(exc).__name__}: {exc}"
    return results
