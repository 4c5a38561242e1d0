"""The sabotage panel: every error planted in a distributed run reads ``not exact`` (``bigconv.sabotage``).

A verdict that cannot fail proves nothing. For each model, one reference (from the untouched model), one
distributed run on a World and, for a model that draws random numbers, one more with another seed's
draws; then each sabotage (a doubled output, a negated input gradient, every weight x1.5, a negated
running mean, one small gradient x(1+1e-6), a lost gradient, the last loss off by 1e-8, another seed's
masks) is judged and must read ``not exact``, and the clean run must read ``exact`` (or ``ill-conditioned
at this size`` and ``exact`` again at the size ``conditioned_size`` names). The models are the
known traps: dropout and DropPath (timm tinynet_e; ConvNeXt-atto with layer scale 1e-6 and DropPath),
BatchNorm on small maps (timm regnetx_002, gernet_s), an FPN on mobileone_s0 at 64x64, and plain models.
The timm/smp ones take minutes on 2 cores and run under the ``zoo`` marker; the SPMD path has its own
case (``tests/spmd_cases.py``, ``panel/...``).

Broken on purpose once: with the noise runs sharing one copy of the model (the old in-place noise run,
which trained the copy it measured), tinynet_e's clean and sabotaged runs stop reading as they must.
A failure points at bigconv/verify.py or bigconv/sabotage.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from test_habits import stochastic_net

from bigconv.sabotage import OTHER_SEED, SABOTAGES, run_panel
from bigconv.verify import ILL_CONDITIONED

ALWAYS = set(SABOTAGES) - {"running mean negated"}
"""Sabotages every model has a tensor for (a running mean needs BatchNorm; another seed needs draws)."""


def bn_net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1),
                         nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))


def assert_panel(r: dict, batchnorm: bool, draws: bool) -> None:
    """The clean run exact (or ill-conditioned and exact at a larger size), every sabotage not exact."""
    if r["clean"] != "exact":
        assert r["clean"] == "ill-conditioned at this size" and r["rerun"]["clean"] == "exact", r
    applied = {name for name, v in r["sabotaged"].items() if v is not None}
    assert ALWAYS <= applied, r["sabotaged"]
    assert ("running mean negated" in applied) == batchnorm and (OTHER_SEED in applied) == draws, r["sabotaged"]
    let_through = {name: v for name, v in r["sabotaged"].items() if v not in (None, "not exact")}
    assert not let_through, let_through


def inputs(shape, classes=3):
    g = torch.Generator().manual_seed(1)
    return torch.randn(*shape, generator=g, dtype=torch.float64), torch.randint(0, classes, (shape[0],), generator=g)


@pytest.mark.world(4)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name, build, shape, batchnorm, draws", [
    ("bigconv/CNN2D", None, None, False, False),
    ("bn_net", bn_net, (2, 2, 12, 10), True, False),
    ("stochastic_net", stochastic_net, (4, 2, 13, 11), False, True),
])
def test_the_panel_on_small_models(world, name, build, shape, batchnorm, draws):
    if build is None:
        build, (x, y), _, grid = _panel_models()[name]
    else:
        (x, y), grid = inputs(shape), (2, 2)
    torch.manual_seed(0)
    assert_panel(run_panel(name, build().double(), world, x, y, nn.CrossEntropyLoss(), grid), batchnorm, draws)


TRAPS = {"timm/tinynet_e_droppath": (True, True, 4), "timm/convnext_atto_droppath": (False, True, 4),
         "timm/regnetx_002": (True, False, 2), "timm/gernet_s": (True, False, 2),
         "smp/FPN_mobileone_s0": (True, True, 2)}
"""name -> (has BatchNorm, draws random numbers, workers)."""


def _panel_models() -> dict:
    from experiments.verdict_panel import panel_models  # not at import: SPMD ranks import this module

    return panel_models()


def _traps(workers: int) -> list[str]:
    return sorted(n for n, (_, _, w) in TRAPS.items() if w == workers)


OPEN_CLEAN = {"smp/FPN_mobileone_s0": ILL_CONDITIONED}
"""Traps whose clean verdict is an open finding, each with the verdict it is declared to read: the FPN on
mobileone_s0 at 2x3x64x64 reads ill-conditioned at this size (its stem's BatchNorm and more; the issue expected
it), with no tensor wrong, and whether a larger size makes it exact is not established here: the search for a
conditioned size takes over 15 minutes on 2 cores for this 6M-parameter float64 model (the fresh-clone run of
2026-11-26 failed this test in that search). Its sabotages are asserted, then its clean verdict is asserted to be
the declared one with no tensor wrong (``not exact`` fails; so does ``exact``: update the declaration), and only
then reported as an expected failure naming the tensors."""


def _trap_panel(world, name):
    build, (x, y), workers, grid = _panel_models()[name]
    batchnorm, draws, expected_workers = TRAPS[name]
    assert workers == expected_workers
    torch.manual_seed(0)
    r = run_panel(name, build().double(), world, x, y, nn.CrossEntropyLoss(), grid, rerun=name not in OPEN_CLEAN)
    if name in OPEN_CLEAN:
        assert_panel({**r, "clean": "exact"}, batchnorm, draws)  # every sabotage, whatever the clean verdict
        assert r["clean"] == OPEN_CLEAN[name] and not r["wrong"] and r["ill_conditioned"], (
            f"{name}'s clean run is declared {OPEN_CLEAN[name]!r} but reads {r['clean']!r}: wrong {r['wrong'][:5]}, "
            f"ill-conditioned {r['ill_conditioned'][:5]}; if that is right, update OPEN_CLEAN")
        pytest.xfail(f"clean verdict {r['clean']!r} as declared: ill-conditioned {r['ill_conditioned'][:3]} "
                     "(open finding: no size where it is exact established)")
    assert_panel(r, batchnorm, draws)


@pytest.mark.zoo
@pytest.mark.world(2)
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", _traps(2))
def test_the_panel_on_the_known_traps_2_workers(world, name):
    _trap_panel(world, name)


@pytest.mark.zoo
@pytest.mark.world(4)
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", _traps(4))
def test_the_panel_on_the_known_traps_4_workers(world, name):
    _trap_panel(world, name)
