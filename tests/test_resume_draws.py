"""A resumed run draws what the run that never stopped draws (dropout, timm's DropPath), in float64.

3 steps uninterrupted against 2 steps, ``net.save``, a *new* parallel model (fresh weights, counter at 0),
``net.load`` and step 3: the weights after step 3 equal the uninterrupted run's and one process's drawing what
``RandomDraws(seed)`` draws, its masks made by ``tests/draws_reference.py`` from the documented rule (each
tensor within 1e-12 of its own size), on a (2, 2) grid with uneven shards, in the driver mode (both
transports, each resuming the other's file) and on SPMD gloo ranks (also 2 replicas x (2, 1), against the
uninterrupted run only: replicas draw exact in law, not bitwise, against one process; there the run that
never stopped is the one that saved, going on).

The errors the counter's restore guards against are planted in the file itself and must each fail: the
counter removed (a file of an older bigconv: it loads, with a warning naming the file, and draws from
forward 1 again) and the counter off by one either way.
"""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch
import torch.nn as nn

import bigconv
from bigconv.ops.random import RandomDraws

sys.path.insert(0, os.path.dirname(__file__))  # the ranks import this module and draws_reference
import draws_reference as drawn  # noqa: E402
from draws_reference import Forward  # noqa: E402
from bigconv.runtime import spmd_launch as launch

SEED = 17
TOL = 1e-12
LR = {"lr": 0.05, "momentum": 0.9}  # momentum: the optimizer's state is resumed too


class DropPath(nn.Module):
    """timm's ``DropPath`` (``timm.layers.drop``): one Bernoulli draw per image, scaled by keep."""

    def __init__(self, drop_prob: float = 0.0, scale_by_keep: bool = True) -> None:
        super().__init__()
        self.drop_prob, self.scale_by_keep = drop_prob, scale_by_keep

    def forward(self, x):
        if self.drop_prob == 0.0 or not self.training:
            return x
        keep_prob = 1 - self.drop_prob
        shape = (x.shape[0],) + (1,) * (x.ndim - 1)
        random_tensor = x.new_empty(shape).bernoulli_(keep_prob)
        if keep_prob > 0.0 and self.scale_by_keep:
            random_tensor.div_(keep_prob)
        return x * random_tensor


class Residual(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.drop_path = DropPath(0.5)

    def forward(self, x):
        return x + self.drop_path(torch.tanh(self.conv(x)))


def make_case():
    """The model (float64, training mode), an input whose 13 x 11 map splits unevenly on (2, 2), targets."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), Residual(4), nn.Dropout(0.3), Residual(4),
                          nn.Conv2d(4, 3, 3, padding=1)).double().train()
    x = torch.randn(4, 2, 13, 11, dtype=torch.float64)
    y = torch.randn(4, 3, 13, 11, dtype=torch.float64)
    return model, x, y


def forward_drawn(model: nn.Module, x: torch.Tensor, draws: Forward) -> torch.Tensor:
    """``make_case``'s model in training, written out, its masks from ``draws`` (``tests/draws_reference.py``, the
    documented rule, not the library's generator): three draws per forward in call order, the first Residual's
    DropPath, the Dropout, the second Residual's DropPath."""
    conv0, first, drop, second, conv4 = model
    h = conv0(x)
    h = h + drawn.drop_path(torch.tanh(first.conv(h)), first.drop_path.drop_prob, draws.key())
    h = drawn.dropout(h, drop.p, draws.key())
    h = h + drawn.drop_path(torch.tanh(second.conv(h)), second.drop_path.drop_prob, draws.key())
    return conv4(h)


def reference(model: nn.Module, x, y, steps: int) -> dict:
    """One process, forward k (from 1) drawing what forward k of the parallel model made with ``SEED`` draws."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), **LR)
    for k in range(1, steps + 1):
        opt.zero_grad()
        loss = nn.MSELoss()(forward_drawn(model, x, Forward(SEED, k)), y)
        loss.backward()
        opt.step()
    return model.state_dict()


@pytest.mark.parametrize("seed", [SEED, 2 ** 40 + 5])
def test_the_documented_generator_draws_what_random_draws_does(seed):
    """``tests/draws_reference.py`` against ``RandomDraws``: the same masks, forward by forward (a seed past 32
    bits mixes its high half), and another seed's differ: the references built on it pin the library's draws."""
    model, x, _ = make_case()
    draws = RandomDraws(seed)
    for k in range(1, 4):
        with draws.forward():
            want = model(x)
        assert torch.equal(forward_drawn(model, x, Forward(seed, k)), want), k
    assert not torch.equal(forward_drawn(model, x, Forward(seed + 1, 1)), forward_drawn(model, x, Forward(seed, 1)))


def worst(got: dict, want: dict) -> float:
    """The largest difference over every tensor, each against its own size."""
    assert got.keys() == want.keys()
    return max(((got[k] - want[k]).abs().max() / want[k].abs().max().clamp_min(1e-300)).item() for k in want)


def planted(path: str) -> dict[str, str]:
    """Copies of the checkpoint at ``path`` with the counter removed (an older bigconv's file) or off by one."""
    ck = torch.load(path, weights_only=True)
    assert ck["draws"] == {"seed": SEED, "forwards": 2}, ck["draws"]  # two training forwards, none else
    out = {}
    for name, draws in (("no counter", None), ("one forward short", 1), ("one forward over", 3)):
        bad = dict(ck)
        if draws is None:
            del bad["draws"]
        else:
            bad["draws"] = {"seed": SEED, "forwards": draws}
        out[name] = f"{path}.{name.replace(' ', '_')}"
        torch.save(bad, out[name])
    return out


# -- driver mode -------------------------------------------------------------------------------------------
def _driver_net(model, world, seed=SEED, transport="p2p"):
    net = bigconv.parallelize(copy.deepcopy(model), world, grid=(2, 2), seed=seed, transport=transport)
    net.optimizer(torch.optim.SGD, **LR)
    return net


@pytest.mark.world(4)
@pytest.mark.timeout(300)
def test_driver_resume_draws_what_the_uninterrupted_run_draws(world, tmp_path, monkeypatch, transport):
    """On both transports; the file of one resumes on the other (their draws are the same)."""
    model, x, y = make_case()
    loss = nn.MSELoss()
    want = reference(model, x, y, 3)
    uninterrupted = _driver_net(model, world, transport=transport)
    for _ in range(3):
        uninterrupted.train_step(x, y, loss)
    assert worst(uninterrupted.state_dict(), want) <= TOL

    first = _driver_net(model, world, transport=transport)
    for _ in range(2):
        first.train_step(x, y, loss)
    path = first.save(tmp_path / "ck.pt")
    bad = planted(path)

    fresh = copy.deepcopy(model)
    with torch.no_grad():  # the new net's own weights differ: load must replace them
        for p in fresh.parameters():
            p.add_(0.5)
    resumed = _driver_net(fresh, world, transport="rpc" if transport == "p2p" else "p2p")
    resumed.load(path)
    resumed.train_step(x, y, loss)
    got = resumed.state_dict()
    assert worst(got, uninterrupted.state_dict()) <= TOL and worst(got, want) <= TOL

    # A net made with another explicit seed takes the file's (a warning says so) and resumes alike.
    other = _driver_net(fresh, world, seed=SEED + 1, transport=transport)
    with pytest.warns(UserWarning, match=f"seed {SEED}.*seed {SEED + 1}"):
        other.load(path)
    assert other.seed == SEED
    other.train_step(x, y, loss)
    assert worst(other.state_dict(), want) <= TOL

    # Each planted error is seen: a new net on an older bigconv's file warns naming it and draws forward 1
    # again; a counter off by one either way (loaded over the net above: load replaces its counter) draws
    # another forward's masks.
    for name, bad_path in bad.items():
        net = _driver_net(fresh, world, transport=transport) if name == "no counter" else other
        if name == "no counter":
            with pytest.warns(UserWarning, match=f"{bad_path}.*counter.*drop_path"):
                net.load(bad_path)
        else:
            net.load(bad_path)
        net.train_step(x, y, loss)
        assert worst(net.state_dict(), want) > 1e-4, name

    # A malformed counter is refused before any worker changes.
    ck = torch.load(path, weights_only=True)
    ck["draws"] = {"seed": SEED, "forwards": -1}
    torch.save(ck, tmp_path / "malformed.pt")
    monkeypatch.setattr(world, "call_part", lambda *_: pytest.fail("remote work started"))
    with pytest.raises(ValueError, match="malformed 'draws'"):
        other.load(tmp_path / "malformed.pt")


# -- SPMD ranks ---------------------------------------------------------------------------------------------
def spmd_resume(folder: str) -> dict:
    """On each of 4 gloo ranks, on (2, 2) and on 2 replicas x (2, 1): 2 steps, save, step 3 (the run that never
    stopped, checked against one process on (2, 2)); a new net loads the file and takes step 3. The worst
    error of each comparison; whether the file without a counter warned (loaded into that net before the
    good file: load replaces whatever the net's counter holds); on (2, 2), one planted off-by-one file."""
    import warnings

    torch.set_num_threads(1)
    model, x, y = make_case()
    loss = nn.MSELoss()
    want = reference(model, x, y, 3)
    out = {}
    with bigconv.World.from_env(mode="spmd", device="cpu", timeout=60.0) as world:
        def net(grid, replicas):
            n = bigconv.parallelize(copy.deepcopy(model), world, grid=grid, replicas=replicas, seed=SEED)
            n.optimizer(torch.optim.SGD, **LR)
            return n

        for grid, replicas in (((2, 2), 1), ((2, 1), 2)):
            tag = f"{replicas}x{grid[0]}x{grid[1]}"
            uninterrupted = net(grid, replicas)
            for _ in range(2):
                uninterrupted.train_step(x, y, loss)
            path = uninterrupted.save(os.path.join(folder, f"{tag}.pt"))
            uninterrupted.train_step(x, y, loss)
            ends = uninterrupted.state_dict()
            holder = [planted(path) if world.rank == 0 else None]
            torch.distributed.broadcast_object_list(holder, src=0)  # the files are whole before anyone reads
            bad = holder[0]
            resumed = net(grid, replicas)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                resumed.load(bad["no counter"])
            out[f"{tag}/no counter/warned"] = any(bad["no counter"] in str(w.message) and "counter" in str(w.message)
                                                  for w in caught)
            runs = {"resumed": path, "one forward short": bad["one forward short"]} if replicas == 1 else \
                {"resumed": path}
            for name, p in runs.items():
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    resumed.load(p)
                out[f"{tag}/{name}/warned"] = bool(caught)
                resumed.train_step(x, y, loss)
                out[f"{tag}/{name}"] = worst(resumed.state_dict(), ends)
                if replicas == 1:
                    out[f"{tag}/{name}/reference"] = worst(resumed.state_dict(), want)
            if replicas == 1:
                out[f"{tag}/uninterrupted/reference"] = worst(ends, want)
        # BIGCONV_COMM_CHECKS=order (CI's NCCL rules): one order of communication on every rank
        out["order"] = world.comm_order_mismatches() if world.checks.order else []
    return out


@pytest.mark.timeout(240)
def test_spmd_resume_draws_what_the_uninterrupted_run_draws(tmp_path):
    sys.path.insert(0, os.path.dirname(__file__))  # the ranks import this module
    per_rank = launch.run(spmd_resume, 4, (str(tmp_path),), timeout=200)
    for rank, r in enumerate(per_rank):
        assert not r.pop("order"), (rank, "the ranks issued their communication in orders NCCL cannot run")
        assert r["1x2x2/uninterrupted/reference"] <= TOL and r["1x2x2/resumed/reference"] <= TOL, (rank, r)
        assert r["1x2x2/one forward short"] > 1e-4 and r["1x2x2/one forward short/reference"] > 1e-4, (rank, r)
        for tag in ("1x2x2", "2x2x1"):
            assert r[f"{tag}/resumed"] <= TOL, (rank, tag, r)
            assert not r[f"{tag}/resumed/warned"] and r[f"{tag}/no counter/warned"], (rank, tag, r)
    assert len({tuple(sorted(r.items())) for r in per_rank}) == 1  # the same on every rank
