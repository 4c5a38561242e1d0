"""What each SPMD rank runs for ``tests/test_issue51_spmd.py``: issue 51's rules in the SPMD mode.

Every rank opens one SPMD world and runs every case in it; ranks seed alike, so each builds the same model, batch
and targets. A case returns ``exactness.compare``'s result (every output, the input gradient, every parameter
gradient, the losses and every weight after two SGD-momentum steps against one process); an exception its text.
"""

from __future__ import annotations

import torch
import torch.nn as nn

import bigconv
from exactness import compare
from issue51_models import GlobalOrder, Resampled, SequenceSDPA, SequenceVariants, dinov2_registers, sam


def _case(factory, shape, grid, dense: bool, replicas: int = 1):
    def run(world):
        torch.manual_seed(0)
        model = factory().double()
        g = torch.Generator().manual_seed(1)
        x = torch.randn(*shape, generator=g, dtype=torch.float64)
        y = torch.randint(0, 3, (shape[0], *shape[2:]) if dense else (shape[0],), generator=g)
        return compare(model, world, x, y, nn.CrossEntropyLoss(), grid=grid, replicas=replicas)
    return run


CASES = {
    "sequence/heads-map/(4,)": _case(lambda: SequenceSDPA("heads", "map"), (2, 2, 37), (4,), True),
    "sequence/latent/R2/(2,)": _case(lambda: SequenceVariants("latent"), (4, 2, 37), (2,), False, 2),
    "sequence/causal/(4,)": _case(lambda: SequenceVariants("causal"), (2, 2, 37), (4,), True),
    "positions/bias/(2,2)": _case(lambda: SequenceVariants("bias", dims=2), (2, 2, 9, 7), (2, 2), True),
    "vit/dinov2-registers-28x20/(2,2)": _case(dinov2_registers, (2, 3, 28, 20), (2, 2), False),
    "bicubic/(2,2)": _case(Resampled, (2, 1, 11, 9), (2, 2), True),
    "sam/window3/(2,2)": _case(sam, (2, 3, 32, 32), (2, 2), False),
    "order/flip-scans-fold/(2,2)": _case(GlobalOrder, (2, 1, 11, 9), (2, 2), True),
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
