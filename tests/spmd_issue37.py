"""What each SPMD rank runs for ``tests/test_issue37_spmd.py``: SyncBatchNorm and several outputs.

Every rank opens one SPMD world and runs every case in it; ranks seed alike, so each builds the same
model, batch and targets. A case returns ``exactness.compare``'s result; an exception its text.
"""

from __future__ import annotations

import torch
import torch.nn as nn

import bigconv
from exactness import compare
from issue37_models import case, roll_case, sync_bn_net


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


def _roll(grid, replicas: int = 1, **kw):
    def run(world):
        model, x, y, loss = roll_case(**kw)
        return compare(model, world, x, y, loss, grid=grid, replicas=replicas)
    return run


def _held(kind: str, grid, replicas: int = 1, batch: int = 2):
    def run(world):
        import test_hold_whole as th

        torch.manual_seed(0)
        model = th._swin(False) if kind == "swin" else th._timm(kind)
        shape = (batch, 3, 36, 28) if kind == "swin" else (batch, 1, 12, 12)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(*shape, generator=g, dtype=torch.float64)
        y = torch.randint(0, 3, (batch,), generator=g)
        return compare(model, world, x, y, nn.CrossEntropyLoss(), grid=grid, replicas=replicas)
    return run


def _ring(grid, replicas: int = 1, batch: int = 2):
    """timm's bottleneck attention split by ring passes (bigconv.ops.global_attention), not held."""
    def run(world):
        from issue37_models import TimmAttention

        torch.manual_seed(0)
        model = TimmAttention("bottleneck").double()
        g = torch.Generator().manual_seed(1)
        x = torch.randn(batch, 1, 12, 12, generator=g, dtype=torch.float64)
        y = torch.randint(0, 3, (batch,), generator=g)
        return compare(model, world, x, y, nn.CrossEntropyLoss(), grid=grid, replicas=replicas)
    return run


def _hipt(grid, replicas: int = 1, batch: int = 2, size: int = 256):
    """tests/hipt_models.HIPT: regions of 64 px as the batch (level 1 per shard), level 2 gathered whole."""
    def run(world):
        from hipt_models import HIPT

        torch.manual_seed(0)
        model = HIPT(grid=size // 64).double()
        g = torch.Generator().manual_seed(1)
        x = torch.randn(batch, 3, size, size, generator=g, dtype=torch.float64)
        y = torch.randint(0, 3, (batch,), generator=g)
        return compare(model, world, x, y, nn.CrossEntropyLoss(), grid=grid, replicas=replicas)
    return run


CASES = {
    "ring/bottleneck/(2,2)": _ring((2, 2)),
    "ring/bottleneck/R2/(2,1)": _ring((2, 1), 2, batch=4),
    "hipt/R2/(2,1)": _hipt((2, 1), 2, batch=4, size=128),
    "held/swin/(2,2)": _held("swin", (2, 2)),
    "held/halo/R2/(2,1)": _held("halo", (2, 1), 2, batch=4),
    "held/bottleneck/(1,4)": _held("bottleneck", (1, 4)),
    "roll/channels-last/(2,2)": _roll((2, 2), shifts=(-3, -3), dims=(1, 2), channels_last=True),
    "roll/3d/(1,2,2)": _roll((1, 2, 2), shifts=(1, -6, 4), dims=(2, 3, 4), shape=(2, 1, 5, 9, 7)),
    "roll/R2/(2,1)": _roll((2, 1), 2, shifts=(7, -2), dims=(2, 3), shape=(4, 1, 11, 9)),
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
