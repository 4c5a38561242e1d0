"""Dense losses computed shard by shard, without gathering the output.

A loss over the whole image is ``sum(numerators) / sum(denominators)`` over shards, where each
shard's numerator is the *sum* reduction of the loss on its pixels and its denominator is what the
``mean`` reduction divides by locally (element count, or the summed class weights of
cross-entropy). ``sum`` reductions have no denominator.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

DENSE_TYPES = (nn.MSELoss, nn.L1Loss, nn.BCEWithLogitsLoss, nn.CrossEntropyLoss)


def _spatially_constant(t: torch.Tensor | None, spatial_dims: int) -> bool:
    return t is None or t.dim() == 0 or all(s == 1 for s in t.shape[-spatial_dims:])


def is_dense(loss_fn: Callable, spatial_dims: int) -> bool:
    """Whether ``loss_fn`` can be split over shards exactly."""
    if type(loss_fn) not in DENSE_TYPES or loss_fn.reduction not in ("mean", "sum"):
        return False
    if isinstance(loss_fn, nn.BCEWithLogitsLoss):
        # weight and pos_weight broadcast against the target; a spatial pattern would need sharding.
        return (_spatially_constant(loss_fn.weight, spatial_dims)
                and _spatially_constant(loss_fn.pos_weight, spatial_dims))
    if isinstance(loss_fn, nn.CrossEntropyLoss):
        return loss_fn.label_smoothing == 0.0 or loss_fn.weight is None
    return True


def target_shape_ok(loss_fn: Callable, out_shape: tuple[int, ...], target: torch.Tensor) -> bool:
    if isinstance(loss_fn, nn.CrossEntropyLoss) and not target.is_floating_point():
        return tuple(target.shape) == (out_shape[0], *out_shape[2:])
    return tuple(target.shape) == tuple(out_shape)


LABEL_LOSSES = (nn.CrossEntropyLoss, nn.NLLLoss)
"""Losses that take class indices."""


def labels_out_of_range(loss_fn: nn.Module, target: torch.Tensor, classes: int) -> torch.Tensor:
    """The class labels of ``target`` outside [0, classes) (``ignore_index`` aside); empty when all fit or
    when ``loss_fn`` takes no class indices."""
    if not isinstance(loss_fn, LABEL_LOSSES) or target.is_floating_point():
        return target.new_empty(0)
    labels = target[target != loss_fn.ignore_index]
    return labels[(labels < 0) | (labels >= classes)]


def check_labels_here(loss_fn: nn.Module, out: torch.Tensor, target: torch.Tensor) -> None:
    """Class labels read on a worker (target sources) lie in [0, classes), or a clear ValueError."""
    bad = labels_out_of_range(loss_fn, target, out.shape[1])
    if bad.numel():
        raise ValueError(label_message(int(bad[0]), out.shape[1]))


def label_message(label: int, classes: int) -> str:
    return (f"the label maps hold {label}, outside [0, {classes}) for an output with {classes} classes; fix the "
            "label files or give the model as many outputs as classes")


def shard_parts(loss_fn: nn.Module, out: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, float | None]:
    """(numerator, denominator) of this shard's share of ``loss_fn(out, target)``."""
    mean = loss_fn.reduction == "mean"
    if isinstance(loss_fn, nn.CrossEntropyLoss):
        num = F.cross_entropy(out, target, weight=loss_fn.weight, ignore_index=loss_fn.ignore_index,
                              reduction="sum", label_smoothing=loss_fn.label_smoothing)
        if not mean:
            return num, None
        if target.is_floating_point():  # class probabilities: mean over all non-class positions
            return num, out.numel() / out.shape[1]
        valid = target != loss_fn.ignore_index
        if loss_fn.weight is None:
            return num, float(valid.sum())
        return num, float(loss_fn.weight[target[valid]].sum())
    if isinstance(loss_fn, nn.BCEWithLogitsLoss):
        num = F.binary_cross_entropy_with_logits(out, target, weight=loss_fn.weight, pos_weight=loss_fn.pos_weight,
                                                 reduction="sum")
    elif isinstance(loss_fn, nn.MSELoss):
        num = F.mse_loss(out, target, reduction="sum")
    else:
        num = F.l1_loss(out, target, reduction="sum")
    return num, (float(target.numel()) if mean else None)


def combine(parts: list[tuple[torch.Tensor, float | None]]) -> torch.Tensor:
    total = parts[0][0]
    for num, _ in parts[1:]:
        total = total + num
    dens = [den for _, den in parts]
    return total if dens[0] is None else total / sum(dens)
