"""``bigconv.verify``'s verdict for a training loop the tests write themselves (Lightning's, the user's own).

Such a loop ends in a state dict, not in ``compare_training``'s sequence of runs, so the reference is built
here: one process's loop on the same batches, and the same loop again with only the order of floating-point
sums changed (each batch in reverse order; the model and input channels-last), from the same start, which
measures what rounding alone moves each tensor by. ``verdict`` then judges the distributed state against it by
the same rule as every other equivalence test: each tensor against its own size, exact within ``tol`` where
rounding alone stays within it, ill-conditioned (never exact) past it within 10x its noise, wrong beyond.
"""

from __future__ import annotations

from typing import Callable

import torch

from bigconv.verify import Reference, Run, abs_err, verdict

TOL = 1e-9


def state_run(state: dict) -> Run:
    """A run that yields only a state dict (no output, gradients or losses are compared)."""
    return Run(output={}, input_grad=torch.zeros(0, dtype=torch.float64), param_grads={}, losses=[],
               state={k: v.detach().clone() for k, v in state.items()})


def state_reference(loop: Callable[..., dict]) -> Reference:
    """``loop(reverse=False, channels_last=False)`` returns one process's state dict after the loop; it is run
    as it is and with each of the two reorderings (``reverse``: every batch in reverse order;
    ``channels_last``: the model and its inputs in channels-last memory)."""
    run = state_run(loop())
    noise = {("weights", k): 0.0 for k in run.state}
    names = []
    for name, kwargs in (("reversed batch", {"reverse": True}), ("channels-last", {"channels_last": True})):
        other = loop(**kwargs)
        names.append(name)
        for k, want in run.state.items():
            if want.is_floating_point():
                noise[("weights", k)] = max(noise[("weights", k)], abs_err(other[k], want))
    # Only sums reordered, no random draws: every noise run is rounding, so residues may be recognised.
    return Reference(run, noise, names, True)


def state_verdict(state: dict, ref: Reference, tol: float = TOL) -> dict:
    """``bigconv.verify.verdict`` of a distributed run's state dict against ``ref``: ``verdict``, ``wrong``,
    ``ill_conditioned``, ``residues``, ``tensors``, ``worst``..., as ``compare_training`` returns them."""
    return verdict(state_run(state), ref, tol)
