"""Errors planted in a distributed run, to show that the exactness verdict (``bigconv.verify``) fails.

A verdict that cannot fail proves nothing. Each sabotage here changes the distributed side's ``Run``
the way a bug would, and ``panel`` asks the verdict about each one: every answer must be ``not exact``.
The masks of another seed need a distributed run of their own (``parallelize(..., seed=other)``), which
the caller makes and passes in; the rest change a run that was already made.

Sabotages that pick a tensor pick one that the verdict can judge against its own size
(``well_conditioned``): an error that rounding alone could make cannot be told from rounding by anyone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import torch

from .engine.dry_run import copy_model
from .verify import (
    ILL_CONDITIONED,
    Reference,
    Run,
    conditioned_size,
    distributed_run,
    map_output,
    reference,
    verdict,
    well_conditioned,
)


def _well_conditioned(ref: Reference, category: str, tol: float) -> dict[str, float]:
    """Names of ``category`` tensors (param_grads or weights) that the verdict judges against ``tol`` of their
    own size (``well_conditioned``: the noise runs determined them), with that size, however small."""
    source = ref.run.param_grads if category == "param_grads" else ref.run.state
    floating = {n: t for n, t in source.items() if t.is_floating_point() and t.numel()}
    sizes = {n: t.detach().double().abs().max().item() for n, t in floating.items()}
    return {n: s for n, s in sizes.items() if s > 0 and well_conditioned(ref.noise.get((category, n), 0.0), s, tol)}


def doubled_output(got: Run, ref: Reference, tol: float) -> Run:
    return replace(got, output=map_output(got.output, lambda t: t * 2))


def negated_input_gradient(got: Run, ref: Reference, tol: float) -> Run:
    return replace(got, input_grad=-got.input_grad)


def weights_times_1_5(got: Run, ref: Reference, tol: float) -> Run:
    return replace(got, state={k: v * 1.5 if v.is_floating_point() else v for k, v in got.state.items()})


def running_mean_negated(got: Run, ref: Reference, tol: float) -> Run | None:
    sizes = {n: s for n, s in _well_conditioned(ref, "weights", tol).items() if n.endswith("running_mean")}
    if not sizes:
        return None
    name = max(sizes, key=sizes.get)
    return replace(got, state={**got.state, name: -got.state[name]})


def small_gradient_off_1e_6(got: Run, ref: Reference, tol: float) -> Run | None:
    sizes = _well_conditioned(ref, "param_grads", tol)
    if not sizes:
        return None
    name = min(sizes, key=sizes.get)
    return replace(got, param_grads={**got.param_grads, name: got.param_grads[name] * (1 + 1e-6)})


def smallest_gradient_negated(got: Run, ref: Reference, tol: float) -> Run | None:
    sizes = _well_conditioned(ref, "param_grads", tol)
    if not sizes:
        return None
    name = min(sizes, key=sizes.get)
    return replace(got, param_grads={**got.param_grads, name: -got.param_grads[name]})


def smallest_gradient_zeroed(got: Run, ref: Reference, tol: float) -> Run | None:
    sizes = _well_conditioned(ref, "param_grads", tol)
    if not sizes:
        return None
    name = min(sizes, key=sizes.get)
    return replace(got, param_grads={**got.param_grads, name: torch.zeros_like(got.param_grads[name])})


def optimizer_state_off(got: Run, ref: Reference, tol: float) -> Run | None:
    """The largest well-measured optimizer state (a momentum buffer, Adam's second moment) x1.001 on the first
    worker: what a wrong state acts like before it reaches the weights."""
    if not got.optimizer:
        return None
    sizes = {n: t.detach().double().abs().max().item() for n, t in got.optimizer.items()
             if t.is_floating_point() and t.numel() > 1}
    sizes = {n: s for n, s in sizes.items() if s > 0 and well_conditioned(ref.noise.get(("optimizer", n), 0.0), s, tol)}
    if not sizes:
        return None
    name = max(sizes, key=sizes.get)
    state = {**got.optimizer, name: got.optimizer[name] * 1.001}
    return replace(got, optimizer=state, replica_optimizers=[state, *got.replica_optimizers[1:]])


def gradient_lost(got: Run, ref: Reference, tol: float) -> Run | None:
    sizes = _well_conditioned(ref, "param_grads", tol)
    if not sizes:
        return None
    name = max(sizes, key=sizes.get)
    return replace(got, param_grads={k: v for k, v in got.param_grads.items() if k != name})


def loss_off_1e_8(got: Run, ref: Reference, tol: float) -> Run | None:
    if not got.losses:
        return None
    losses = list(got.losses)
    losses[-1] = torch.as_tensor(losses[-1], dtype=torch.float64) * (1 + 1e-8)
    return replace(got, losses=losses)


SABOTAGES: dict[str, Callable[[Run, Reference, float], Run | None]] = {
    "doubled output": doubled_output,
    "negated input gradient": negated_input_gradient,
    "every weight x1.5": weights_times_1_5,
    "running mean negated": running_mean_negated,
    "small gradient x(1+1e-6)": small_gradient_off_1e_6,
    "smallest gradient negated": smallest_gradient_negated,
    "smallest gradient zeroed": smallest_gradient_zeroed,
    "optimizer state x1.001": optimizer_state_off,
    "gradient lost": gradient_lost,
    "last loss x(1+1e-8)": loss_off_1e_8,
}
OTHER_SEED = "masks of another seed"
WORKER_APART = "another worker's weight 1 ulp off"


def panel(got: Run, ref: Reference, tol: float, replica_states: Sequence[dict] | None = None,
          other_seed: Run | None = None) -> dict[str, str | None]:
    """The verdict on ``got`` under each sabotage (None where it does not apply: no running mean, no
    random draws, one worker); ``other_seed``: the distributed run of the same model with another seed's draws."""
    out: dict[str, str | None] = {}
    for name, plant in SABOTAGES.items():
        planted = plant(got, ref, tol)  # replica_states only tell whether the replicas agree: got's state is judged
        out[name] = None if planted is None else verdict(planted, ref, tol, replica_states)["verdict"]
    out[OTHER_SEED] = None if other_seed is None else verdict(other_seed, ref, tol)["verdict"]
    out[WORKER_APART] = None
    if replica_states and len(replica_states) > 1:
        last = dict(replica_states[-1])
        name = next((k for k, v in last.items() if v.is_floating_point() and v.numel()), None)
        if name is not None:
            flat = last[name].clone().reshape(-1)
            flat[0] = torch.nextafter(flat[0], torch.tensor(math.inf, dtype=flat.dtype))
            last[name] = flat.reshape(last[name].shape)
            r = verdict(got, ref, tol, [*replica_states[:-1], last])
            named = [t for t in r["replicas_disagree"] if t["tensor"] == f"weights {name}"
                     and t["workers"] == [len(replica_states) - 1]]
            out[WORKER_APART] = r["verdict"] if named else f"{r['verdict']} (without naming weights {name})"
    return out


@dataclass
class PanelRuns:
    """What the panel judges: the reference, the distributed run (and every replica's state), and the run
    with another seed's draws (None for a model that draws nothing)."""

    ref: Reference
    got: Run
    states: list
    other: Run | None


def panel_runs(model: torch.nn.Module, world, x: torch.Tensor, y, loss_fn: Callable,
               grid: Sequence[int] | None = None, tol: float = 1e-9) -> PanelRuns:
    """One reference (from the untouched ``model``), one distributed run, and one more with another seed
    where the model draws random numbers."""
    ref = reference(model, x, y, loss_fn, tol=tol)
    got, states, _ = distributed_run(copy_model(model), world, x, y, loss_fn, grid)
    other = distributed_run(copy_model(model), world, x, y, loss_fn, grid, seed=1)[0] if ref.run.drew else None
    return PanelRuns(ref, got, states, other)


def run_panel(name: str, model: torch.nn.Module, world, x: torch.Tensor, y, loss_fn: Callable,
              grid: Sequence[int], tol: float = 1e-9, runs: PanelRuns | None = None, rerun: bool = True) -> dict:
    """A JSON-ready record: the clean verdict (and, where it is ill-conditioned and ``rerun``, the verdict again
    at the size ``conditioned_size`` names) and the verdict under every sabotage."""
    runs = runs or panel_runs(model, world, x, y, loss_fn, grid, tol)
    clean = verdict(runs.got, runs.ref, tol, runs.states)
    record = {"model": name, "shape": list(x.shape), "grid": list(grid), "draws": runs.ref.run.drew,
              "clean": clean["verdict"], "reorderings": clean["reorderings"], "residues": len(clean["residues"]),
              "ill_conditioned": [t["tensor"] for t in clean["ill_conditioned"]],
              "wrong": [t["tensor"] for t in clean["wrong"]],
              "raw_worst": {k: clean[k] for k in ("forward", "input_grad", "param_grads", "loss", "weights")},
              "sabotaged": panel(runs.got, runs.ref, tol, runs.states, runs.other)}
    if rerun and clean["verdict"] == ILL_CONDITIONED:  # again at a size where one process pins every tensor down
        record["rerun"] = _rerun(model, world, x, y, loss_fn, grid, tol)
    return record


def _rerun(model, world, x, y, loss_fn, grid, tol) -> dict:
    """The clean verdict at the size ``conditioned_size`` names (labels drawn anew for a dense target)."""
    classes = int(y.max()) + 1

    def target(inp):
        if y.dim() <= 1:
            return y
        return torch.randint(0, classes, (inp.shape[0], *inp.shape[2:]), generator=torch.Generator().manual_seed(3))

    size = conditioned_size(model, x, target, loss_fn, tol=tol)
    if size is None:
        return {"shape": None, "clean": None}
    xs = torch.randn(size, dtype=x.dtype, generator=torch.Generator().manual_seed(4))
    ys = target(xs)
    ref = reference(model, xs, ys, loss_fn, tol=tol)
    got, states, _ = distributed_run(copy_model(model), world, xs, ys, loss_fn, grid)
    return {"shape": list(size), "clean": verdict(got, ref, tol, states)["verdict"]}
