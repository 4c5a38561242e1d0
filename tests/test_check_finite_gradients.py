"""``check_finite=True`` covers the summed gradients, not only inputs and targets (issue 52, item 8).

A NaN gradient can hide behind a finite loss: an operation whose derivative is infinite where its value is
not (here ``sqrt`` at 0, multiplied by 0 in the forward) turns one batch's gradients into NaN, and clipping
then spreads it to every weight. With ``check_finite`` each shard checks the gradients after the allreduce
and before the optimizer step (equal on every shard, so all refuse together): the step raises naming the
step's call and the first parameter, and the weights and the optimizer's state stay as they were, so the
next clean step trains as if the bad batch had never come. Driver mode on both transports here; the SPMD
mode's case is ``nonfinite_gradient`` in ``tests/spmd_cases.py``. A failure points at
``ShardEngine.check_gradients`` (``bigconv/engine/shard.py``) or the ``check_finite`` flag of ``ShardCall``.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn

import bigconv

MESSAGE = (r"check_finite: in the step of call \d+ the summed gradient of '0.weight' holds 27 NaN or infinite "
           r"value\(s\) of 27 \(the first such parameter of 5\); the optimizer did not step")


class NanAtZero(nn.Module):
    """The identity in the forward; its gradient is NaN where the input is exactly 0 (0 * sqrt'(0))."""

    def forward(self, x):
        return x + 0.0 * torch.sqrt(x * x)


def nan_behind_finite_loss() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 3, 3, padding=1, bias=False), NanAtZero(), nn.Conv2d(3, 3, 3, padding=1),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, 2)).double()


def batches() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A clean batch, the same with a zero patch (the first convolution's output is exactly 0 under it, where
    NanAtZero's gradient is NaN), and the labels."""
    x = torch.randn(2, 1, 16, 12, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    poisoned = x.clone()
    poisoned[0, 0, 4:9, 3:8] = 0
    return x, poisoned, torch.tensor([0, 1])


def poisoned_run(net, state_dict) -> dict:
    """A clean step, the poisoned one (refused, its error kept), a clean step: what the run tells, with
    ``state_dict`` reading the weights (on every rank in the SPMD mode)."""
    x, poisoned, y = batches()
    net.train_step(x, y, nn.CrossEntropyLoss())
    before = state_dict()
    out = {"loss_finite": bool(torch.isfinite(nn.CrossEntropyLoss()(net.full(poisoned), y))), "error": None}
    try:
        net.train_step(poisoned, y, nn.CrossEntropyLoss())
    except Exception as exc:  # noqa: BLE001 - the caller checks its type and text
        out["error"] = f"{type(exc).__name__}: {exc}"
    after = state_dict()
    out["unchanged"] = all(torch.equal(before[k], after[k]) for k in before)
    net.train_step(x, y, nn.CrossEntropyLoss())
    return out


def clean_run(net) -> None:
    x, _, y = batches()
    for _ in range(2):
        net.train_step(x, y, nn.CrossEntropyLoss())


def same_weights(got: dict, want: dict) -> bool:
    return all(torch.allclose(got[k], want[k], rtol=1e-12, atol=1e-15) for k in want)


@pytest.mark.world(2)
@pytest.mark.timeout(120)
def test_a_nan_gradient_behind_a_finite_loss_is_refused_before_the_step(world, transport):
    def made():
        net = bigconv.parallelize(nan_behind_finite_loss(), world, grid=(2, 1), check_finite=True, transport=transport)
        net.optimizer(torch.optim.SGD, lr=0.1, momentum=0.9, clip_grad_norm=1.0)  # the clipping
        return net

    reference = made()
    clean_run(reference)
    net = made()
    out = poisoned_run(net, net.state_dict)
    assert out["loss_finite"], "the loss must not show the NaN (else this tests nothing new)"
    assert out["error"] is not None and out["error"].startswith("WorkerFailure"), out
    assert re.search(r"worker\d failed during .*step \d+: NonFiniteGradientError: " + MESSAGE, out["error"]), out
    assert out["unchanged"], "the refused step changed the weights"
    assert not world.broken
    # Momentum as it was: the run went on as if the batch had never come.
    assert same_weights(net.state_dict(), reference.state_dict())
