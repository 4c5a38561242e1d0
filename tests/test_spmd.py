"""The SPMD mode against one process: every case of ``tests/spmd_cases.py`` on spawned gloo ranks.

One spawn per world size runs all of that size's cases (session fixtures), with a hard timeout;
each test then checks its case's errors. Forward, input gradient, parameter gradients, losses and
weights after two SGD-momentum steps must match one process to 1e-9 in float64, on every rank.
"""

from __future__ import annotations

import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # the ranks import spmd_cases, test_layers and zoo from here
import spmd_cases  # noqa: E402
from selection import selected  # noqa: E402
from verdicts import assert_exact  # noqa: E402

from bigconv.runtime import spmd_launch as launch  # noqa: E402

TOL = 1e-9
SIZES = spmd_cases.case_sizes()


class Runs:
    """One spawn per world size, running that size's cases among ``names`` (the session's selection)."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.done: dict[int, list[dict]] = {}

    def get(self, size: int) -> list[dict]:
        if size not in self.done:
            names = [n for n in self.names if SIZES[n] == size]
            self.done[size] = launch.run(spmd_cases.run_cases, size, (names,), timeout=600)
        return self.done[size]


@pytest.fixture(scope="module")
def spmd_runs(request):
    return Runs(selected(request))


def _result(spmd_runs, name):
    per_rank = spmd_runs.get(SIZES[name])
    for rank, results in enumerate(per_rank):
        assert isinstance(results[name], dict), f"rank {rank}: {results[name]}"
    return per_rank


EQUIVALENCE = sorted(n for n in SIZES if n not in ("adjoint", "bad_input", "nonfinite_gradient")
                     and not n.startswith("panel/"))
"""Every case but the adjoint and bad-input ones returns compare_training's errors (sources cases add
``predict``)."""


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", EQUIVALENCE)
def test_matches_single_process(spmd_runs, name):
    per_rank = _result(spmd_runs, name)
    for rank, results in enumerate(per_rank):
        r = results[name]
        # The verdict, and the raw errors behind it (tests/verdicts.py).
        try:
            assert_exact(r, TOL)
        except AssertionError as exc:
            raise AssertionError(f"rank {rank}: {exc}") from exc
    # The same answer on every rank.
    assert len({tuple(results[name][k] for k in spmd_cases.KEYS) for results in per_rank}) == 1


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["sources/R1", "sources/R2"])
def test_prediction_from_sources_matches_single_process(spmd_runs, name):
    for rank, results in enumerate(_result(spmd_runs, name)):
        assert results[name]["predict"] <= TOL, (rank, results[name])
        assert results[name]["prefetch_equal"] and results[name]["prefetch_used"], (rank, results[name])


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name, batchnorm, draws", [("panel/stochastic_net", False, True),
                                                    ("panel/bn_net", True, False)])
def test_the_sabotage_panel_on_spmd_ranks(spmd_runs, name, batchnorm, draws):
    """Every error planted in an SPMD run, another seed's masks among them, reads not exact on every rank."""
    from test_verdict_panel import assert_panel

    for results in _result(spmd_runs, name):
        assert_panel(results[name], batchnorm, draws)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["adjoint"])
def test_halo_exchange_is_its_own_adjoint(spmd_runs, name):
    r = _result(spmd_runs, name)[0][name]
    assert r["messages"] > 0
    assert abs(r["lhs"] - r["rhs"]) <= 1e-12 * abs(r["lhs"]), r


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["bad_input"])
def test_bad_layouts_refused_on_every_rank(spmd_runs, name):
    for results in _result(spmd_runs, name):
        r = results[name]
        assert "prod(grid) * replicas" in r["grid-times-replicas"], r
        assert "does not divide" in r["replicas-not-dividing"], r
        assert "positive integer" in r["replicas-not-int"], r
        assert "at least one image" in r["too-few-images"], r


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["nonfinite_gradient"])
def test_a_nan_gradient_behind_a_finite_loss_is_refused_on_every_rank(spmd_runs, name):
    """``check_finite`` on SPMD ranks (tests/test_check_finite_gradients.py has the driver mode's)."""
    from test_check_finite_gradients import MESSAGE

    for rank, results in enumerate(_result(spmd_runs, name)):
        r = results[name]
        assert r["loss_finite"] and r["error"] is not None, (rank, r)
        assert re.match("NonFiniteGradientError: " + MESSAGE, r["error"]), (rank, r)
        assert r["unchanged"] and r["same_as_clean_run"], (rank, r)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["kill", "stall"])
def test_dead_or_stalled_rank_is_an_error_naming_it(how):
    timeout = 8.0
    r0, r1 = launch.run(spmd_cases.failing_rank, 2, (how, timeout), timeout=90, partial=True)
    assert isinstance(r0, dict) and r0["error"], r0
    assert "rank 1" in r0["error"], r0["error"]
    assert r0["seconds"] <= timeout + 10, r0


@pytest.mark.timeout(150)
@pytest.mark.parametrize("how", ["kill", "stall"])
@pytest.mark.parametrize("where, what", [("allreduce", "gradient allreduce"), ("loss", "the loss's sum")])
def test_a_rank_lost_in_a_collective_is_named_by_every_survivor(how, where, what):
    """A collective involves every rank, so its error alone cannot say who is gone: the survivors'
    roll call names rank 1, and only rank 1, on ranks 0 and 2, within the timeout and the roll call's wait."""
    timeout = 8.0
    r0, _, r2 = launch.run(spmd_cases.failing_rank, 3, (how, timeout, where), timeout=120, partial=True)
    for r in (r0, r2):
        assert isinstance(r, dict) and r["error"], r
        assert what in r["error"] and "rank 1 did not answer a roll call" in r["error"], r["error"]
        assert "rank 0 did not" not in r["error"] and "rank 2 did not" not in r["error"], r["error"]
        assert r["seconds"] <= timeout + min(10.0, timeout / 2) + 10, r
