"""Resuming the random draws from checkpoints bigconv does not write: your own SPMD loop's and Lightning's.

In float64, ``test_resume_draws``'s model (Conv + timm-style DropPath x2 + Dropout, 13 x 11 maps, uneven on
(2, 1)), on 2 gloo ranks in one spawn:

- **Your own loop** (``net(x)``, ``shard_loss``, ``backward``, your SGD with momentum): 3 steps uninterrupted
  against 2 steps, the user's own ``torch.save({"model": net.state_dict(), "optimizer": opt.state_dict(),
  "draws": net.draws_state()})``, a *new* ``SpmdModel`` made from other weights and another seed, everything
  loaded (``net.load_draws_state(ck["draws"])``), step 3: the uninterrupted run's weights and one process's
  drawing what ``RandomDraws(seed)`` draws (``tests/draws_reference.py``), each tensor within 1e-12 of its own
  size. The restore skipped (a new model draws forward 1 again) or off by one must each be seen (> 1e-4 off);
  malformed or differing dicts are a ``ValueError`` on every rank, the counter unchanged.
- **Lightning** (``BigconvStrategy``, a validation loader and its sanity check, one step per epoch): 3 epochs
  uninterrupted against 2 epochs, ``trainer.save_checkpoint``, a new Trainer and a LightningModule made from
  other weights resuming with ``fit(ckpt_path=)``: the uninterrupted Trainer's weights and one process's
  (the validation forwards count, the sanity check's do not). A checkpoint without the entry (an older
  bigconv's) loads with a warning naming it, and is seen off.

And the driver mode's ``draws_state``/``load_draws_state`` on the shared World.
"""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch
import torch.nn as nn

import bigconv
from bigconv.runtime import spmd_launch as launch

sys.path.insert(0, os.path.dirname(__file__))  # the ranks import this module and test_resume_draws
from draws_reference import Forward  # noqa: E402
from test_resume_draws import LR, SEED, forward_drawn, make_case, worst  # noqa: E402

TOL = 1e-12
SEEN = 1e-4  # a planted error moves the weights by at least this much (measured: ~1e-2)
GRID = (2, 1)


def reference(model: nn.Module, x, y, steps: int, seed: int, skip: int = 0, shuffled: bool = False) -> dict:
    """One process: step k's forward draws what that forward of the parallel model made with ``seed`` draws
    (``tests/draws_reference.py``, from the documented rule; forwards numbered from 1); ``skip`` forwards
    (validation's, drawing nothing) follow each step. ``shuffled``: step k takes the images in the order of
    epoch k of Lightning's ``DistributedSampler`` (shuffled, seed 0)."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), **LR)
    sampler = torch.utils.data.DistributedSampler(range(len(x)), num_replicas=1, rank=0, shuffle=True, seed=0)
    for k in range(steps):
        sampler.set_epoch(k)
        order = list(sampler) if shuffled else list(range(len(x)))
        opt.zero_grad()
        out = forward_drawn(model, x[order], Forward(seed, k * (1 + skip) + 1))
        loss = nn.MSELoss()(out, y[order])
        loss.backward()
        opt.step()
    return model.state_dict()


def other_weights(model: nn.Module) -> nn.Module:
    fresh = copy.deepcopy(model)
    with torch.no_grad():  # the new net's own weights differ: loading must replace them
        for p in fresh.parameters():
            p.add_(0.5)
    return fresh


def clone(state: dict) -> dict:
    return {k: v.detach().clone() for k, v in state.items()}


# -- your own SPMD loop -----------------------------------------------------------------------------------
def own_loop(world, folder: str) -> dict:
    """The loop of docs/loop.md, its checkpoint with ``draws_state()``; see the module doc."""
    model, x, y = make_case()
    mse = nn.MSELoss()

    def make(m, seed):
        net = bigconv.parallelize(copy.deepcopy(m), world, grid=GRID, seed=seed)
        return net, torch.optim.SGD(net.parameters(), **LR)

    def step(net, opt):
        opt.zero_grad()
        net.shard_loss(mse, net(x), y).backward()
        opt.step()

    out = {}
    net, opt = make(model, SEED)
    for _ in range(2):
        step(net, opt)
    path = os.path.join(folder, "own.pt")
    if world.rank == 0:  # the user's own checkpoint: rank 0 writes, draws_state() needs no other rank
        torch.save({"model": net.state_dict(), "optimizer": opt.state_dict(), "draws": net.draws_state()}, path)
    world.barrier()
    step(net, opt)  # the run that never stopped
    ends = clone(net.state_dict())
    out["uninterrupted/reference"] = worst(ends, reference(model, x, y, 3, SEED))

    ck = torch.load(path, weights_only=True)  # every rank
    out["saved draws"] = ck["draws"]

    def resumed(draws, seed=SEED + 1):
        net, opt = make(other_weights(model), seed)
        net.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        if draws is not None:
            net.load_draws_state(draws)
        step(net, opt)
        return net, worst(net.state_dict(), ends)

    net, out["resumed"] = resumed(ck["draws"])
    out["resumed/reference"] = worst(net.state_dict(), reference(model, x, y, 3, SEED))
    out["resumed/draws"] = net.draws_state()
    _, out["restore skipped"] = resumed(None)
    _, out["one forward short"] = resumed({**ck["draws"], "forwards": ck["draws"]["forwards"] - 1})

    # Refused on every rank before any rank changes: malformed (on one rank or all), or differing between ranks.
    before = net.draws_state()
    bad = {"missing": {"seed": SEED}, "negative": {"seed": SEED, "forwards": -1},
           "whole checkpoint": ck, "bool": {"seed": SEED, "forwards": True},
           "rank 1 only": ck["draws"] if world.rank == 0 else {"seed": SEED, "forwards": "2"},
           "differing": {"seed": SEED, "forwards": 2 + world.rank}}
    for name, state in bad.items():
        try:
            net.load_draws_state(state)
            out[f"refused/{name}"] = None
        except ValueError as exc:
            out[f"refused/{name}"] = str(exc)
    out["refused/unchanged"] = net.draws_state() == before
    return out


# -- Lightning ----------------------------------------------------------------------------------------------
def lightning_runs(folder: str, ports) -> dict:
    """Uninterrupted (3 epochs) against 2 epochs + ``trainer.save_checkpoint`` + a resumed Trainer (1 more);
    the checkpoint without the entry resumed too. One step and one validation batch per epoch."""
    import warnings

    import lightning.pytorch as pl
    import torch.nn.functional as F

    from bigconv.lightning import BigconvStrategy

    model, x, y = make_case()
    data = torch.utils.data.TensorDataset(x, y)

    class Lit(pl.LightningModule):
        def __init__(self, network):
            super().__init__()
            self.model = network

        def training_step(self, batch, index):
            return F.mse_loss(self.model(batch[0]), batch[1])

        def validation_step(self, batch, index):
            self.log("val", F.mse_loss(self.model(batch[0]), batch[1]), sync_dist=True)

        def configure_optimizers(self):
            return torch.optim.SGD(self.model.parameters(), **LR)

    class SaveAtEnd(pl.Callback):
        def on_train_end(self, trainer, lit):  # inside fit: the ranks' world still open
            trainer.save_checkpoint(os.path.join(folder, "lit.ckpt"))

    def fit(lit, epochs, ckpt_path=None, callbacks=()):
        os.environ["BIGCONV_PORT"] = str(next(ports))  # each Trainer's world its own store port
        t = pl.Trainer(strategy=BigconvStrategy(grid=GRID, timeout=30.0), accelerator="cpu", devices=2,
                       max_epochs=epochs, num_sanity_val_steps=1, logger=False, enable_checkpointing=False,
                       enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks))
        loader = torch.utils.data.DataLoader(data, batch_size=len(data))
        t.fit(lit, loader, loader, ckpt_path=ckpt_path)
        return clone(lit.model.state_dict())

    out = {}
    whole = Lit(copy.deepcopy(model))
    ends = fit(whole, 3)
    seed = whole.model.draws_state()["seed"]
    out["uninterrupted/draws"] = whole.model.draws_state()
    out["uninterrupted/reference"] = worst(ends, reference(model, x, y, 3, seed, skip=1, shuffled=True))
    first = Lit(copy.deepcopy(model))
    fit(first, 2, callbacks=[SaveAtEnd()])
    path = os.path.join(folder, "lit.ckpt")
    ck = torch.load(path, weights_only=False)  # Lightning's own entries are not all plain data
    out["saved"] = ck.get("bigconv")
    resumed = Lit(other_weights(model))
    got = fit(resumed, 3, ckpt_path=path)
    out["resumed"] = worst(got, ends)
    out["resumed/reference"] = worst(got, reference(model, x, y, 3, seed, skip=1, shuffled=True))
    out["resumed/draws"] = resumed.model.draws_state()

    old = os.path.join(folder, f"old-{os.environ['RANK']}.ckpt")  # an older bigconv's: no entry (each rank its copy)
    torch.save({k: v for k, v in ck.items() if k != "bigconv"}, old)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = fit(Lit(other_weights(model)), 3, ckpt_path=old)
    out["no entry/warned"] = any(old in str(w.message) and "draws" in str(w.message) for w in caught)
    out["no entry"] = worst(got, ends)
    return out


def run_ranks(folder: str) -> dict:
    import importlib.util
    import itertools

    torch.set_num_threads(1)
    port = int(os.environ["BIGCONV_PORT"])
    ports = itertools.count(port + 10, 10)
    with bigconv.World.from_env(mode="spmd", device="cpu", timeout=60.0) as world:
        out = {"own": own_loop(world, folder)}
        # BIGCONV_COMM_CHECKS=order (CI's NCCL rules): one order of communication on every rank
        out["order"] = world.comm_order_mismatches() if world.checks.order else []
    out["lightning"] = (lightning_runs(folder, ports) if importlib.util.find_spec("lightning") is not None
                        else "lightning is not installed")
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return launch.run(run_ranks, 2, (str(tmp_path_factory.mktemp("draws_loops")),), timeout=280)


@pytest.mark.timeout(300)
def test_own_loop_resumes_the_draws_with_draws_state(ranks):
    for rank, r in enumerate(ranks):
        assert not r["order"], (rank, "the ranks issued their communication in orders NCCL cannot run")
    for rank, r in enumerate(r["own"] for r in ranks):
        assert r["saved draws"] == {"seed": SEED, "forwards": 2}, (rank, r["saved draws"])
        assert r["uninterrupted/reference"] <= TOL, (rank, r)
        assert r["resumed"] <= TOL and r["resumed/reference"] <= TOL, (rank, r)
        assert r["resumed/draws"] == {"seed": SEED, "forwards": 3}, (rank, r)  # the saved seed won over SEED + 1
        assert r["restore skipped"] > SEEN and r["one forward short"] > SEEN, (rank, r)
        for name, why in (("missing", "'forwards' is missing"), ("negative", "expected an int >= 0"),
                          ("whole checkpoint", "unexpected keys"), ("bool", "expected an int >= 0"),
                          ("rank 1 only", "rank 1's state is malformed"), ("differing", "rank 1 was given")):
            assert r[f"refused/{name}"] is not None and why in r[f"refused/{name}"], (rank, name, r[f"refused/{name}"])
        assert r["refused/unchanged"], rank


@pytest.mark.timeout(300)
def test_lightning_resume_draws_what_the_uninterrupted_trainer_draws(ranks):
    pytest.importorskip("lightning", reason="the lightning extra (pip install 'bigconv[lightning]')")
    for rank, r in enumerate(r["lightning"] for r in ranks):
        assert isinstance(r, dict), (rank, r)
        # 3 training and 3 validation forwards; the sanity check's left the count as it found it
        assert r["uninterrupted/draws"]["forwards"] == 6, (rank, r["uninterrupted/draws"])
        assert r["saved"] == {"draws": {**r["uninterrupted/draws"], "forwards": 4}}, (rank, r["saved"])
        assert r["uninterrupted/reference"] <= TOL, (rank, r)
        assert r["resumed"] <= TOL and r["resumed/reference"] <= TOL, (rank, r)
        assert r["resumed/draws"] == r["uninterrupted/draws"], (rank, r)
        assert r["no entry/warned"] and r["no entry"] > SEEN, (rank, r)


# -- the driver mode ----------------------------------------------------------------------------------------
@pytest.mark.world(4)
@pytest.mark.timeout(300)
def test_driver_draws_state_round_trip(world, monkeypatch):
    """2 steps; a new net made from the weights they reached, another seed, ``load_draws_state``: its next
    forward draws the first net's forward 3 (and without the restore it does not)."""
    model, x, y = make_case()
    first = bigconv.parallelize(copy.deepcopy(model), world, grid=(2, 2), seed=SEED)
    first.optimizer(torch.optim.SGD, **LR)
    for _ in range(2):
        first.train_step(x, y, nn.MSELoss())
    state = first.draws_state()
    assert state == {"seed": SEED, "forwards": 2}
    third = first.full(x)
    reached = copy.deepcopy(model)
    reached.load_state_dict(first.state_dict())
    nets = {}
    for name in ("restored", "not restored"):
        nets[name] = bigconv.parallelize(copy.deepcopy(reached), world, grid=(2, 2), seed=SEED + 1)
        if name == "restored":
            nets[name].load_draws_state(state)
            assert nets[name].seed == SEED
    assert worst({"out": nets["restored"].full(x)}, {"out": third}) <= TOL
    assert worst({"out": nets["not restored"].full(x)}, {"out": third}) > SEEN
    assert nets["restored"].draws_state() == {"seed": SEED, "forwards": 3}
    monkeypatch.setattr(world, "call_part", lambda *_: pytest.fail("remote work started"))
    with pytest.raises(ValueError, match="'forwards' is -1"):
        nets["restored"].load_draws_state({"seed": SEED, "forwards": -1})
