"""The driver mode's EMA of the weights, kept on the workers (``net.optimizer(..., ema=decay)``) and read with
``net.state_dict(ema=True)``; ``save``/``load`` carry it with the optimizer, the scheduler, the step and the
epoch, so a resumed run ends where one uninterrupted process does. Exact in float64 against one process
running timm's ``ModelEmaV3`` in the same loop (AdamW with two param groups, warmup-cosine, clipping,
2-micro-batch accumulation). A failure points at ``ShardEngine.update_ema``/``load`` or
``ParallelModel.state_dict``/``save``/``load``."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import bigconv

from test_driver_optimizer import data, groups, model, rel, warmup_cosine

TOL = 1e-9
DECAY = 0.7
CLIP = 0.05


def one_process(steps: int) -> tuple[dict, dict]:
    """The weights and timm's EMA of them (made with the optimizer, updated after every step)."""
    from timm.utils import ModelEmaV3

    m = model()
    opt = torch.optim.AdamW(groups(m.named_parameters()), lr=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine)
    ema = ModelEmaV3(m, decay=DECAY)
    batches = data() + data()[:2]
    for s in range(steps):
        for x, y in batches[2 * s: 2 * s + 2]:
            nn.MSELoss()(m(x), y).backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), CLIP)
        opt.step()
        sched.step()
        opt.zero_grad()
        ema.update(m)
    return m.state_dict(), ema.module.state_dict()


def fresh(world, seed: int = 0, ema: float | None = DECAY):
    torch.manual_seed(seed)
    net = bigconv.parallelize(nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.Tanh(),
                                            nn.Conv2d(4, 2, 3, padding=1)).double(), world, grid=(2, 1))
    net.optimizer(lambda named: torch.optim.AdamW(groups(named), lr=0.05),
                  scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine), clip_grad_norm=CLIP,
                  ema=ema)
    return net


def steps(net, which):
    batches = data() + data()[:2]
    for s in which:
        (x1, y1), (x2, y2) = batches[2 * s: 2 * s + 2]
        net.train_step(x1, y1, nn.MSELoss(), step=False)
        net.train_step(x2, y2, nn.MSELoss())


def errors(got: dict, ref: dict) -> dict:
    return {k: rel(got[k], v) if v.is_floating_point() else float(not torch.equal(got[k], v)) for k, v in ref.items()}


@pytest.mark.world(2)
@pytest.mark.timeout(300)
def test_the_workers_ema_is_one_processs(world):
    ref_weights, ref_ema = one_process(3)
    net = fresh(world)
    steps(net, range(3))
    ema, weights = net.state_dict(ema=True), net.state_dict()
    assert list(ema) == list(ref_ema)
    bad = {k: v for k, v in errors(ema, ref_ema).items() if not v <= TOL}
    assert not bad, bad
    assert max(errors(weights, ref_weights).values()) <= TOL
    assert max(rel(ema[k], weights[k]) for k in weights if weights[k].is_floating_point()) > 1e-3  # not the weights


@pytest.mark.world(2)
@pytest.mark.timeout(300)
def test_a_resumed_run_carries_the_ema_and_ends_where_one_process_does(world, tmp_path):
    """save after 2 of 4 steps; load into a model made from other weights; 2 more steps: the weights and the EMA
    of the run that never stopped (bit for bit) and of one process (float64)."""
    whole = fresh(world)
    steps(whole, range(4))
    first = fresh(world)
    steps(first, range(2))
    path = first.save(tmp_path / "ck.pt", epoch=1)
    assert torch.load(path, weights_only=True)["ema"] is not None
    resumed = fresh(world, seed=7).load(path)
    assert (resumed.steps, resumed.epoch) == (2, 1)
    steps(resumed, range(2, 4))
    ref_weights, ref_ema = one_process(4)
    for ema in (False, True):
        a, b = whole.state_dict(ema=ema), resumed.state_dict(ema=ema)
        assert all(torch.equal(a[k], b[k]) for k in a), (ema, {k: rel(b[k], a[k]) for k in a})
        bad = {k: v for k, v in errors(b, ref_ema if ema else ref_weights).items() if not v <= TOL}
        assert not bad, (ema, bad)


@pytest.mark.world(2)
@pytest.mark.timeout(300)
def test_ema_misuse_is_refused_before_remote_work(world, rpc_calls, tmp_path):
    net = fresh(world)
    path = net.save(tmp_path / "ck.pt")
    plain = fresh(world, ema=None)
    before = len(rpc_calls)
    for bad in (1.0, 0, -0.5, True, "0.9"):
        with pytest.raises(ValueError, match="ema must be a decay between 0 and 1"):
            plain.optimizer(torch.optim.SGD, lr=0.1, ema=bad)
    with pytest.raises(ValueError, match=r"keeps no EMA.*ema=0.999"):
        plain.state_dict(ema=True)
    with pytest.raises(ValueError, match=r"holds an EMA.*ema=<decay>"):
        plain.load(path)
    assert len(rpc_calls) == before
