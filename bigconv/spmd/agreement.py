"""One plan, agreed by every rank: SPMD ranks given different plans must fail, not train apart.

Every rank plans on its own (grid, replicas, input shape, model, loss). Ranks that disagree (rank 0
on a (2, 1) grid and rank 1 on (1, 2), say) would exchange halos that fit neither and train silently
wrong (issue 34: losses 4.6% off one process). At the first call with each plan (a new input shape,
dtype, mode or loss type) each rank contributes a 64-bit fingerprint of its plan to one small
allreduce (the min and the max); only when they differ do the ranks gather the fields themselves, so
that every rank raises the same error naming the first rank and the first field that differ from
rank 0's.

Only new plans, not every call: a collective in every step would be where a dead or stalled rank is
first noticed, and a collective cannot say which rank is missing (the halo exchange that follows
names its peer). The cost: a rank whose call is new to it while another rank's is not enters the
check alone and fails at the process group's timeout instead of agreeing.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

MASK = (1 << 62) - 1  # fits an int64 and its negation


def model_structure(model: torch.nn.Module) -> tuple:
    """Parameter and buffer names, shapes and dtypes: what every rank's copy must share."""
    return tuple((n, tuple(t.shape), str(t.dtype)) for n, t in
                 [*model.named_parameters(), *model.named_buffers()])


def plan_fields(net, plan, x, loss_fn) -> dict:
    """What every rank must agree on for one call, as plain, printable values."""
    shape = (len(x), *x[0].shape) if isinstance(x, (list, tuple)) else tuple(x.shape)
    dtype = x[0].dtype if isinstance(x, (list, tuple)) else str(x.dtype).replace("torch.", "")
    loss = None if loss_fn is None else f"{type(loss_fn).__module__}.{type(loss_fn).__qualname__}"
    if net._structure is None:
        net._structure = model_structure(net.model)
    digest = hashlib.blake2b(repr(net._structure).encode(), digest_size=8).hexdigest()
    return {"grid": tuple(plan.grid), "replicas": net.replicas, "input shape": tuple(shape), "input dtype": dtype,
            "training": net.training, "model (parameter names and shapes)": digest, "loss": loss}


def fingerprint(fields: dict) -> int:
    return int.from_bytes(hashlib.blake2b(repr(sorted(fields.items())).encode(), digest_size=8).digest(),
                          "little") & MASK


def agree(net, plan, x, loss_fn=None) -> None:
    """Raise the same ValueError on every rank unless every rank's plan is this rank's."""
    fields = plan_fields(net, plan, x, loss_fn)
    mine = fingerprint(fields)
    if mine in net._agreed:
        return
    both = torch.tensor([mine, -mine], dtype=torch.int64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    if int(both[0]) == -int(both[1]):  # max == min: every rank's fingerprint is this one
        net._agreed.add(mine)
        return
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, fields)
    first = everyone[0]
    for rank, theirs in enumerate(everyone[1:], 1):
        for name in first:
            if theirs.get(name) != first[name]:
                raise ValueError(
                    f"the ranks were given different plans: rank {rank}'s {name} is {theirs.get(name)!r} but rank "
                    f"0's is {first[name]!r}; every rank must call parallelize, the model and the loss with the "
                    "same arguments (nothing was exchanged)")
    raise ValueError("the ranks were given different plans (their fingerprints differ); every rank must call "
                     "parallelize, the model and the loss with the same arguments")
