"""The driver mode's optimizer opened up: a factory with param groups by name, a scheduler factory, clipping
by the global norm, and accumulation with ``train_step(..., step=False)``; exact in float64 against one
process running the same loop; the SPMD ``train_step`` takes the same arguments. A class and a factory
defined in the user's script (``__main__``) travel by value. A failure points at
``bigconv.input_checks.optimizer_spec``/``by_value``, ``ShardEngine.make_optimizer``/``begin``/``end``
or ``StepCommand.accumulate``."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import bigconv

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-9


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.Tanh(), nn.Conv2d(4, 2, 3, padding=1)
                         ).double()


def groups(named):
    named = list(named)
    return [{"params": [p for n, p in named if p.dim() > 1], "weight_decay": 0.05},
            {"params": [p for n, p in named if p.dim() <= 1], "weight_decay": 0.0}]


def warmup_cosine(step):
    return (step + 1) / 2 if step < 2 else 0.5 * (1 + math.cos(math.pi * (step - 2) / 2))


def data():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(2, 1, 10, 8, generator=g, dtype=torch.float64),
             torch.randn(2, 2, 10, 8, generator=g, dtype=torch.float64)) for _ in range(6)]


def one_process(loss_fn, clip):
    m = model()
    opt = torch.optim.AdamW(groups(m.named_parameters()), lr=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine)
    batches = data()
    for s in range(3):
        for x, y in batches[2 * s: 2 * s + 2]:
            loss_fn(m(x), y).backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
        opt.step()
        sched.step()
        opt.zero_grad()
    return m.state_dict(), [g["lr"] for g in opt.param_groups]


def rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.world(2)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("loss_fn", [nn.MSELoss(), lambda out, y: (out - y).abs().amax(dim=(2, 3)).sum()],
                         ids=["per-shard", "on-the-driver"])
def test_factory_groups_scheduler_clip_and_accumulation_match_one_process(world, loss_fn):
    clip = 0.05
    ref, lrs = one_process(loss_fn, clip)
    net = bigconv.parallelize(model(), world, grid=(2, 1))
    net.optimizer(lambda named: torch.optim.AdamW(groups(named), lr=0.05),
                  scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine), clip_grad_norm=clip)
    assert net.optimizer_class == "torch.optim.adamw.AdamW" and net.optimizer_groups == [2, 4]
    batches = data()
    for s in range(3):
        (x1, y1), (x2, y2) = batches[2 * s: 2 * s + 2]
        net.train_step(x1, y1, loss_fn, step=False)
        net.train_step(x2, y2, loss_fn)
    assert net.steps == 3
    got = net.state_dict()
    errors = {k: rel(got[k], v) for k, v in ref.items()}
    assert max(errors.values()) <= TOL, errors
    assert lrs[0] != 0.05  # the schedule moved


@pytest.mark.world(2)
@pytest.mark.timeout(300)
def test_bad_optimizer_arguments_are_refused_before_remote_work(world, rpc_calls):
    net = bigconv.parallelize(model(), world, grid=(2, 1))
    before = len(rpc_calls)
    cases = {
        "factory takes no keyword": lambda: net.optimizer(lambda named: torch.optim.SGD(named, lr=0.1), lr=0.1),
        "cannot be made over this model's parameters": lambda: net.optimizer(
            lambda named: torch.optim.SGD([dict(named)["head.weight"]], lr=0.1)),  # a name this model lacks
        "must return a torch.optim.Optimizer": lambda: net.optimizer(lambda named: None),
        "scheduler factory failed": lambda: net.optimizer(torch.optim.SGD, lr=0.1, scheduler=lambda opt: 1 / 0),
        "positive number": lambda: net.optimizer(torch.optim.SGD, lr=0.1, clip_grad_norm=-1),
        "cannot be sent to the workers": lambda: net.optimizer(lambda named, lock=threading.Lock(): torch.optim.SGD(
            [p for _, p in named], lr=0.1)),
    }
    for words, call in cases.items():
        with pytest.raises(ValueError) as info:
            call()
        assert words in str(info.value), (words, info.value)
    assert len(rpc_calls) == before


SCRIPT = textwrap.dedent('''
    import torch, torch.nn as nn, bigconv

    class ClipSGD(torch.optim.SGD):  # defined in the user's script: the workers cannot import it
        def step(self, closure=None):
            torch.nn.utils.clip_grad_norm_([p for g in self.param_groups for p in g["params"]], 0.01)
            return super().step(closure)

    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.Tanh(), nn.Conv2d(2, 2, 3, padding=1)).double()

    if __name__ == "__main__":
        x = torch.randn(2, 1, 8, 8, dtype=torch.float64)
        y = torch.randn(2, 2, 8, 8, dtype=torch.float64)
        plain = build()
        opt = ClipSGD(plain.parameters(), lr=0.5)
        nn.MSELoss()(plain(x), y).backward(); opt.step()
        with bigconv.World(workers=2, timeout=60, device="cpu") as world:
            for how in ("class", "factory"):
                net = bigconv.parallelize(build(), world, grid=(2, 1))
                if how == "class":
                    net.optimizer(ClipSGD, lr=0.5)
                else:
                    net.optimizer(lambda named: ClipSGD([p for _, p in named], lr=0.5))
                net.train_step(x, y, nn.MSELoss())
                got = net.state_dict()
                err = max(float((got[k] - v).norm() / v.norm()) for k, v in plain.state_dict().items())
                print(how, net.optimizer_class, err)
''')


@pytest.mark.own_world
@pytest.mark.timeout(300)
def test_a_class_and_a_factory_of_the_users_script_travel_by_value(tmp_path, exclusive):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    import os

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict((line.split()[0], line.split()[1:]) for line in done.stdout.splitlines() if line.split())
    for how in ("class", "factory"):
        name, err = lines[how]
        assert name == "__main__.ClipSGD" and float(err) <= TOL, (how, lines[how])


@pytest.mark.world(2)
@pytest.mark.timeout(300)
def test_a_resumed_run_ends_where_an_uninterrupted_one_does(world, tmp_path):
    """save after 2 of 4 steps (optimizer, scheduler, step, epoch), load into a freshly made model, 2 more
    steps: the weights, learning rates and step count of the run that never stopped (issue 38, item 5)."""
    def fresh(seed):
        torch.manual_seed(seed)
        net = bigconv.parallelize(nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.Tanh(),
                                                nn.Conv2d(4, 2, 3, padding=1)).double(), world, grid=(2, 1))
        net.optimizer(lambda named: torch.optim.AdamW(groups(named), lr=0.05),
                      scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine), clip_grad_norm=0.05)
        return net

    batches = data() + data()[:2]

    def steps(net, which):
        for s in which:
            (x1, y1), (x2, y2) = batches[2 * s: 2 * s + 2]
            net.train_step(x1, y1, nn.MSELoss(), step=False)
            net.train_step(x2, y2, nn.MSELoss())

    whole = fresh(0)
    steps(whole, range(4))
    first = fresh(0)
    steps(first, range(2))
    path = first.save(tmp_path / "ck.pt", epoch=1)
    resumed = fresh(7).load(path)
    assert resumed.epoch == 1 and resumed.steps == 2
    steps(resumed, range(2, 4))
    a, b = whole.state_dict(), resumed.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a), {k: rel(b[k], a[k]) for k in a}
    ck = torch.load(path, weights_only=True)
    assert ck["scheduler"]["last_epoch"] == 2 and ck["epoch"] == 1
    plain = bigconv.parallelize(model(), world, grid=(2, 1))
    plain.optimizer(lambda named: torch.optim.AdamW(groups(named), lr=0.05))
    with pytest.raises(ValueError, match="scheduler"):
        plain.load(path)
