"""The native loop: ``parallelize`` on an SPMD world as a module in the user's own training loop.

One spawn of 4 gloo ranks (``tests/native_loop_cases.py``) runs everything: AdamW with two param groups,
warmup-cosine, ``clip_grad_norm_``, 2-micro-batch accumulation under ``no_sync`` and timm's EMA, on a
(2, 2) grid and on 2 replicas × (2, 1), with a per-shard loss (``shard_loss``) and a loss on the whole
output (``whole_loss``), a dense map and a replicated head; then bf16 autocast, fp16 with a GradScaler,
the module's API, and each habit broken on purpose. A failure points at ``bigconv.spmd.native``
(the sum's start and end, the head's counted copy) or ``SpmdModel.forward``/``shard_loss``/``gather``.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import native_loop_cases as cases  # noqa: E402

from bigconv.runtime import spmd_launch as launch  # noqa: E402

TOL = 1e-9
BF16_FACTOR = 8.0
"""How far past one process's own bf16 rounding of the same tensor (its bf16 run against its float32 run) the
ranks' bf16 run may be: each tensor against its own, and never past ``BF16_CAP`` times the largest such error
over the model's tensors (the rule before, which alone let a tensor that bf16 barely moves be off by tens of
times its own rounding). Measured (4 ranks, 2026-11-29): the ranks' error reaches 5.6 times a tensor's own
(R2x(2,1)/seg, the second convolution's bias gradient: the shards round their partial sums of a cancelling sum
to bf16, which one process's whole-image kernel does not), 3.2 on (2,2), 2.2 on the heads."""
BF16_CAP = 4.0


@pytest.fixture(scope="module")
def ranks():
    return launch.run(cases.run_all, 4, (), timeout=900)


def _case(ranks, name):
    for rank, results in enumerate(ranks):
        assert isinstance(results[name], dict), f"rank {rank}: {results[name]}"
    return [results[name] for results in ranks]


EXACT = [f"{cfg}/{kind}/{how}" for cfg in cases.CONFIGS for kind, how in cases.RUNS]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", EXACT)
def test_the_users_loop_matches_one_process_in_float64(ranks, name):
    per_rank = _case(ranks, name)
    for rank, errors in enumerate(per_rank):
        bad = {k: v for k, v in errors.items() if not v <= TOL}
        assert not bad, f"rank {rank}: {bad}"
    assert set(per_rank[0]) >= {"losses", "norms", "lrs"} and any(k.startswith("ema/") for k in per_rank[0])


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", [f"bf16/{n}" for n in EXACT])
def test_bf16_autocast_within_one_processs_own_rounding(ranks, name):
    for rank, r in enumerate(_case(ranks, name)):
        assert r["dtype"] == r["ref_dtype"] == r["whole_dtype"] == "torch.bfloat16", (rank, r)
        got, own = r["output"]
        assert got <= BF16_CAP * own, (rank, "output", got, own)  # one tensor: its own, 4x as before
        grads = {k: v for k, v in r.items() if k.startswith("grad/")}
        largest = max(own for _, own in grads.values())
        bad = {k: (v, own) for k, (v, own) in grads.items()
               if not v <= min(BF16_FACTOR * own, BF16_CAP * largest)}
        assert not bad, (rank, "(error, own bf16 error)", bad)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("cfg", list(cases.CONFIGS))
def test_fp16_grad_scaler_skips_the_same_steps_on_every_rank(ranks, cfg):
    """Every rank's scaler sees the summed gradients, so its inf check is every rank's: the same scales and
    weights everywhere, the first overflow where one process has it, and an inf in one rank's own part of
    a gradient skips that step on every rank. (Later overflows may differ from one process's: they depend
    on fp16 rounding, which differs between a whole image and shards.)"""
    per_rank = _case(ranks, f"fp16/{cfg}")
    first = per_rank[0]
    assert first["scales"][0] == first["ref_scales"][0] < 2.0 ** 22, first  # the first step overflowed, as in one process
    assert any(b > a for a, b in zip(first["scales"], first["scales"][1:])), first["scales"]  # and steps were taken
    p = first["poisoned_scales"]
    assert p[cases.POISONED] == p[cases.POISONED - 1] / 2, p  # the poisoned step was skipped
    for rank, r in enumerate(per_rank):
        assert r["scales"] == first["scales"] and r["poisoned_scales"] == p, (rank, r["scales"], r["poisoned_scales"])
        for key in ("state", "poisoned_state"):
            for k, v in r[key].items():
                assert (v == first[key][k]).all(), (rank, key, k)


@pytest.mark.timeout(900)
def test_the_module_api(ranks):
    for rank, r in enumerate(_case(ranks, "api")):
        assert r["keys"] and r["names"] and r["is_module"], (rank, r)
        assert r["local_input"], (rank, r)
        assert "this rank's share of a batch" in r["wrong_share"], r["wrong_share"]
        assert "fit neither the whole output" in r["wrong_target"], r["wrong_target"]
        assert "call out = net(x) first" in r["loss_before_forward"], r["loss_before_forward"]
        assert "use net.whole_loss" in r["head_shard_loss"], r["head_shard_loss"]
        assert r["loaded"], r
        assert r["eval"] == (False, False, False), r


@pytest.mark.timeout(900)
@pytest.mark.parametrize("plant", [p for p, *_ in cases.PLANTS])
def test_each_broken_habit_is_seen(ranks, plant):
    """Summing nothing, forgetting no_sync's accumulation, counting every shard's copy of a head, clipping by
    a rank's own norm: each one fails the float64 comparison on every rank."""
    for rank, errors in enumerate(_case(ranks, f"plant/{plant}")):
        assert max(errors.values()) > 1e-3, (rank, plant, errors)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", [n for n in cases.RESUMES if n.startswith("resume/")])
def test_a_resumed_loop_ends_where_one_uninterrupted_process_does(ranks, name):
    """Stopped after ``RESUME_AT`` steps, its checkpoint (the plain state dicts of the module, the optimizer,
    the scheduler and the EMA, and the step) loaded into a module made from other weights: weights, EMA
    weights, losses, norms and learning rates of one process that never stopped, in float64."""
    per_rank = _case(ranks, name)
    for rank, errors in enumerate(per_rank):
        bad = {k: v for k, v in errors.items() if not v <= TOL}
        assert not bad, f"rank {rank}: {bad}"
    assert any(k.startswith("ema/") for k in per_rank[0]) and "lrs" in per_rank[0]


@pytest.mark.timeout(900)
def test_a_resume_that_drops_the_schedule_is_seen(ranks):
    for rank, errors in enumerate(_case(ranks, "resume_plant/drop_scheduler")):
        assert errors["lrs"] > 1e-3 and max(errors.values()) > 1e-3, (rank, errors)
