"""Train a model on a World and in one process, side by side, and measure how far they differ.

This is the equivalence check the test suite runs, offered to users too: the evidence that a
parallelized model is the single-process model, not an approximation of it.
"""

from __future__ import annotations

import copy
from typing import Callable, Sequence

import torch

from .data.sources import SourceBatch, is_source_batch, read_targets
from .parallel import parallelize
from .world import World  # or an SPMD world


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max-norm error of ``a`` relative to the max-norm of the reference ``b``."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    scale = b.abs().max().item() if b.numel() else 0.0
    return (a - b).abs().max().item() / max(scale, 1e-300) if b.numel() else 0.0


def abs_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.detach().double().cpu() - b.detach().double().cpu()).abs().max().item() if b.numel() else 0.0


def _scale(t: torch.Tensor) -> float:
    return t.detach().double().abs().max().item() if t.numel() else 0.0


def compare_training(model: torch.nn.Module, world: World, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable,
                     grid: Sequence[int] | None = None, steps: int = 2, optimizer: type = torch.optim.SGD,
                     replicas: int = 1, **opt_kwargs) -> dict:
    """Errors of the distributed forward, losses and weights after ``steps`` optimizer steps.

    ``x`` may be a list of image sources (``bigconv.data``): the workers read their boxes, and the
    single process gets the same pixels read whole. On an SPMD world every rank calls this with the
    same arguments (``replicas`` as in ``parallelize``) and gets the same answer.
    """
    opt_kwargs = opt_kwargs or {"lr": 0.05, "momentum": 0.9}
    xt = x if isinstance(x, torch.Tensor) else SourceBatch(x).read()
    yt = read_targets(y, loss_fn) if is_source_batch(y) else y  # gradients() takes targets as a tensor
    reference = copy.deepcopy(model)
    net = parallelize(model, world, grid=grid, replicas=replicas)
    out = net(x)
    with torch.no_grad():
        ref_out = reference(xt)
    # Gradients before any step. Both sides run a training forward here, so buffers such as
    # running statistics advance alike.
    _, input_grad, param_grads = net.gradients(x, yt, loss_fn)
    xr = xt.detach().clone().requires_grad_(True)
    loss_fn(reference(xr), yt).backward()
    ref_grads = {n: p.grad.clone() for n, p in reference.named_parameters() if p.grad is not None}
    reference.zero_grad(set_to_none=True)
    net.optimizer(optimizer, **opt_kwargs)
    ref_opt = optimizer(reference.parameters(), **opt_kwargs)
    losses, ref_losses = [], []
    for _ in range(steps):
        losses.append(net.train_step(x, y, loss_fn))
        ref_opt.zero_grad()
        loss = loss_fn(reference(xt), yt)
        loss.backward()
        ref_opt.step()
        ref_losses.append(loss.item())
    replicas = net.replica_state_dicts()
    ref_state = reference.state_dict()
    state_scale = max((_scale(v) for v in ref_state.values()), default=1.0)
    return {
        "forward": rel_err(out, ref_out),
        "input_grad": rel_err(input_grad, xr.grad),
        # Relative to the largest gradient: a bias followed by normalization has an exactly zero
        # gradient, which both sides compute as rounding noise.
        "param_grads": max((abs_err(param_grads.get(n, torch.zeros_like(g)), g) for n, g in ref_grads.items()),
                           default=0.0) / max((g.abs().max().item() for g in ref_grads.values()), default=1.0),
        "loss": max(abs(a - b) / max(abs(b), 1e-300) for a, b in zip(losses, ref_losses)),
        # Per tensor, relative to its size, floored at 1e-3 of the state's largest entry: a BatchNorm
        # bias feeding another BatchNorm has an exactly zero gradient and moves by rounding noise
        # (1e-17) in both runs; against its own size that noise would read as a large error.
        "weights": max(abs_err(replicas[0][k], v) / max(_scale(v), 1e-3 * state_scale) for k, v in ref_state.items()),
        "replicas_equal": all(torch.equal(r[k], replicas[0][k]) for r in replicas for k in ref_state),
        "keys_match": set(replicas[0]) == set(ref_state),
        "net": net,
    }
