"""Errors planted in a distributed run, to show that the exactness verdict (``bigconv.verify``) fails.

A verdict that cannot fail proves nothing. Each sabotage here changes the distributed side's ``Run``
the way a bug would, and ``panel`` asks the verdict about each one: every answer must be ``not exact``.
The masks of another seed need a distributed run of their own (``parallelize(..., seed=other)``), which
the caller makes and passes in; the rest change a run that was already made.

Sabotages that pick a tensor pick one that the verdict can judge against its own size
(``well_conditioned``): an error that rounding alone could make cannot be told from rounding by anyone.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Sequence

import torch

from .verify import Reference, Run, negligible, verdict, well_conditioned


def _well_conditioned(ref: Reference, category: str, tol: float) -> dict[str, float]:
    """Names of ``category`` tensors (param_grads or weights) that the verdict judges against ``tol`` of their
    own size (``well_conditioned``, not ``negligible``), with that size."""
    source = ref.run.param_grads if category == "param_grads" else ref.run.state
    floating = {n: t for n, t in source.items() if t.is_floating_point() and t.numel()}
    sizes = {n: t.detach().double().abs().max().item() for n, t in floating.items()}
    largest = max(sizes.values(), default=0.0)
    sizes = {n: s for n, s in sizes.items() if s > 0 and well_conditioned(ref.noise.get((category, n), 0.0), s, tol)
             and not negligible(s, largest, floating[n].dtype)}
    return sizes


def doubled_output(got: Run, ref: Reference, tol: float) -> Run:
    return replace(got, output=got.output * 2)


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
    "gradient lost": gradient_lost,
    "last loss x(1+1e-8)": loss_off_1e_8,
}
OTHER_SEED = "masks of another seed"


def panel(got: Run, ref: Reference, tol: float, replica_states: Sequence[dict] | None = None,
          other_seed: Run | None = None) -> dict[str, str | None]:
    """The verdict on ``got`` under each sabotage (None where it does not apply: no running mean, no
    random draws); ``other_seed``: the distributed run of the same model with another seed's draws."""
    out: dict[str, str | None] = {}
    for name, plant in SABOTAGES.items():
        planted = plant(got, ref, tol)  # replica_states only tell whether the replicas agree: got's state is judged
        out[name] = None if planted is None else verdict(planted, ref, tol, replica_states)["verdict"]
    out[OTHER_SEED] = None if other_seed is None else verdict(other_seed, ref, tol)["verdict"]
    return out


def run_panel(model: torch.nn.Module, world, x: torch.Tensor, y, loss_fn: Callable, grid: Sequence[int] | None = None,
              seed: int = 0, tol: float | None = None, steps: int = 2) -> dict:
    """The clean verdict of ``model`` on ``world`` and the verdict under every sabotage: one reference
    (from the untouched ``model``), one distributed run, and one more with another seed where the model
    draws random numbers."""
    from .engine.dry_run import copy_model
    from .verify import _tol, distributed_run, reference

    tol = _tol(model, x) if tol is None else tol
    ref = reference(model, x, y, loss_fn, steps, seed=seed, tol=tol)
    got, states, _ = distributed_run(copy_model(model), world, x, y, loss_fn, grid, steps, seed=seed)
    other = distributed_run(copy_model(model), world, x, y, loss_fn, grid, steps, seed=seed + 1)[0] if ref.run.drew \
        else None
    clean = verdict(got, ref, tol, states)
    return {"clean": clean, "sabotaged": panel(got, ref, tol, states, other)}
