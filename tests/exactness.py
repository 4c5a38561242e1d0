"""Raw per-tensor errors of a parallelized model against one process, for any output structure.

``bigconv.verify.compare_training`` judges one output tensor and floors errors by measured noise;
the tests of issue 37 (SyncBatchNorm, several outputs) assert the raw error of every tensor against
its own size instead: the forward's every output, the input gradient, every parameter gradient,
each step's loss and every weight and buffer after the steps. Used by the driver-mode tests and by
the SPMD ranks (``tests/spmd_issue37.py``) alike.
"""

from __future__ import annotations

import copy
from typing import Callable

import torch
from torch.nn.modules.batchnorm import _BatchNorm

import bigconv
from bigconv.verify import output_leaves

STEPS = 2
OPT = dict(lr=0.05, momentum=0.9)


def leaves(tree) -> dict[str, torch.Tensor]:
    """The tensors of a nested list/tuple/dict, by path (``out[0]``, ``out['aux']``)."""
    return output_leaves(tree, "out")


class OneProcessSyncBatchNorm(torch.nn.SyncBatchNorm):
    """SyncBatchNorm in one process (world size 1): BatchNorm. An SPMD rank computing the reference has
    a process group, under which SyncBatchNorm's own forward would refuse CPU tensors."""

    forward = _BatchNorm.forward


def single(model: torch.nn.Module, x: torch.Tensor, y, loss_fn: Callable) -> dict[str, torch.Tensor]:
    """One process: output, input and parameter gradients, then ``STEPS`` SGD-momentum steps."""
    model = copy.deepcopy(model)
    for m in model.modules():
        if isinstance(m, torch.nn.SyncBatchNorm):
            m.__class__ = OneProcessSyncBatchNorm
    found: dict = {}
    with torch.no_grad():
        found.update(leaves(model(x)))
    xr = x.detach().clone().requires_grad_(True)
    loss_fn(model(xr), y).backward()
    found["input_grad"] = xr.grad
    found.update({f"grad:{n}": p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    model.zero_grad(set_to_none=True)
    opt = torch.optim.SGD(model.parameters(), **OPT)
    for step in range(STEPS):
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        found[f"loss{step}"] = loss.detach()
    found.update({f"state:{k}": v for k, v in model.state_dict().items()})
    return found


def parallel(net, x: torch.Tensor, y, loss_fn: Callable) -> tuple[dict[str, torch.Tensor], bool]:
    """The same on a parallelized model; and whether every replica ends with the same state."""
    found = dict(leaves(net.full(x)))  # the whole output (SPMD: net(x) is a rank's share)
    _, input_grad, grads = net.gradients(x, y, loss_fn)
    found["input_grad"] = input_grad
    found.update({f"grad:{n}": g for n, g in grads.items()})
    net.optimizer(torch.optim.SGD, **OPT)
    for step in range(STEPS):
        found[f"loss{step}"] = torch.as_tensor(net.train_step(x, y, loss_fn), dtype=torch.float64)
    states = net.replica_state_dicts()
    found.update({f"state:{k}": v for k, v in states[0].items()})
    equal = all(torch.equal(s[k], states[0][k]) for s in states for k in states[0])
    return found, equal


def errors(got: dict, want: dict) -> dict[str, float]:
    """Every tensor's largest error over its own largest magnitude (the plain error when that is 0)."""
    out = {}
    for key, ref in want.items():
        mine = got.get(key)
        if mine is None:
            out[key] = float("inf")
            continue
        ref, mine = ref.detach().double().cpu(), mine.detach().double().cpu()
        if ref.shape != mine.shape:
            out[key] = float("inf")
            continue
        err = (mine - ref).abs().max().item() if ref.numel() else 0.0
        scale = ref.abs().max().item() if ref.numel() else 0.0
        out[key] = err / scale if scale else err
    out.update({key: float("inf") for key in got if key not in want})
    return out


def compare(model: torch.nn.Module, world, x, y, loss_fn: Callable, **parallelize_kw) -> dict:
    """``{"errors": {tensor: relative error}, "worst": float, "replicas_equal": bool}``."""
    want = single(model, x, y, loss_fn)
    net = bigconv.parallelize(copy.deepcopy(model), world, **parallelize_kw)
    got, equal = parallel(net, x, y, loss_fn)
    errs = errors(got, want)
    return {"errors": errs, "worst": max(errs.values()), "replicas_equal": equal}


def assert_exact(r: dict, tol: float = 1e-9) -> None:
    bad = {k: v for k, v in r["errors"].items() if not v <= tol}
    assert not bad, bad
    assert r["replicas_equal"], "replicas drifted apart"
