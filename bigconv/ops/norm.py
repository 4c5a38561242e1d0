"""Normalization with whole-image statistics: BatchNorm, InstanceNorm, GroupNorm, LayerNorm.

Each shard reduces its own part to (mean, centred sum of squares) per statistic, every shard gets
every part (``allgather``, differentiable), and all combine them in worker order with the
parallel-variance formula, so the statistics are the whole image's on every replica and the
backward pass flows through them exactly as in a single process. Running statistics are updated
from the combined values, so they end equal on every replica and equal to the single-process ones.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .context import RuleContext
from .shards import bind, global_shape, mark


RULES: dict = {}
"""This module's rules for calls with a sharded argument (merged by ``bigconv.ops.table``)."""
WHOLE_RULES: dict = {}
"""Its rules for calls without one that may build a sharded result."""
LAYOUT_AWARE: set = set()
"""The functions among them whose rules handle spatial dims wherever they are."""
PROPERTY_RULES: dict = {}
"""Its rules for tensor attributes, by name."""


class _LocalMoments(torch.autograd.Function):
    """This shard's mean and centred sum of squares over ``dims``, saving only ``x``.

    Autograd through ``(x - mean).square().sum()`` would keep a centred copy of the whole shard
    alive until backward; a single process's fused normalization keeps only its input.
    """

    @staticmethod
    def forward(ctx, x, dims):
        mean = x.mean(dim=dims, keepdim=True)
        m2 = (x - mean).square_().sum(dim=dims, keepdim=True)
        ctx.save_for_backward(x, mean)
        ctx.count = math.prod(x.shape[d] for d in dims)
        return mean, m2

    @staticmethod
    def backward(ctx, g_mean, g_m2):
        x, mean = ctx.saved_tensors
        grad = None
        if g_m2 is not None:  # d m2 / dx = 2 (x - mean); the mean's own dependence cancels
            grad = (x - mean).mul_(2 * g_m2)
        if g_mean is not None:
            grad = g_mean / ctx.count + (grad if grad is not None else 0)
        return grad, None


class _Normalize(torch.autograd.Function):
    """``(x - mean) * invstd * weight + bias`` with broadcast statistics, saving only ``x``.

    The gradients of ``mean`` and ``invstd`` flow on into the statistics' graph (and from there to
    every shard), as the single process's flow into its own statistics.
    """

    @staticmethod
    def forward(ctx, x, mean, invstd, weight, bias):
        out = (x - mean).mul_(invstd)
        if weight is not None:
            out.mul_(weight)
        if bias is not None:
            out.add_(bias)
        ctx.save_for_backward(x, mean, invstd, weight)
        ctx.has_bias = bias is not None
        return out

    @staticmethod
    def backward(ctx, g):
        x, mean, invstd, weight = ctx.saved_tensors
        centred = x - mean
        g_weight = (g * centred * invstd).sum_to_size(weight.shape) if weight is not None else None
        g_bias = g.sum_to_size(weight.shape if weight is not None else mean.shape) if ctx.has_bias else None
        gy = g * weight if weight is not None else g
        g_invstd = (gy * centred).sum_to_size(invstd.shape)
        g_x = gy.mul_(invstd) if weight is not None else gy * invstd
        g_mean = -g_x.sum_to_size(mean.shape)
        return g_x, g_mean, g_invstd, g_weight, g_bias


def whole_stats(mode: RuleContext, x: torch.Tensor, dims: list[int], shape, count_dims: list[int]):
    """Mean and biased variance of ``x`` over ``dims`` across every shard, kept as broadcastable dims.

    ``count_dims`` are the non-spatial reduced dims (their sizes are the same on every shard); the
    spatial part of each shard's count comes from the geometry, so counts are never exchanged.
    """
    from ..geometry.boxes import all_coords, box_size, shard_box

    base = math.prod(x.shape[d] for d in count_dims)
    counts = [base * math.prod(box_size(shard_box(shape, mode.executor.grid, c)))
              for c in all_coords(mode.executor.grid)]
    mean, m2 = _LocalMoments.apply(x, dims)
    parts = torch.stack(mode.executor.allgather(torch.stack([mean, m2]), "normalization statistics"))
    total = sum(counts)
    # One op over the shards' stacked moments, not one per shard: a Python sum made 3 ops per shard in every
    # normalization layer of every shard, which the planner's dry run pays shards x shards times (ResNet-50 on
    # 16 GPUs: ~40,000 dispatched ops of the 29 s an estimate took).
    # The counts and the sums in float32 at least (as a Python count's product was): a bfloat16 count of an
    # uneven shard (20160) would be off by up to 0.4%; the result is rounded back to the moments' dtype once.
    opmath = torch.promote_types(parts.dtype, torch.float32)
    n = torch.tensor(counts, dtype=opmath, device=parts.device).view(-1, *([1] * (parts.dim() - 2)))
    wide = parts.to(opmath)
    mean_wide = (n * wide[:, 0]).sum(0) / total
    m2_all = (wide[:, 1] + n * (wide[:, 0] - mean_wide).square()).sum(0).to(parts.dtype)
    mean_all = mean_wide.to(parts.dtype)
    if 0 in count_dims and mode.executor.replicas > 1:
        # Batch statistics span the whole batch, which data-parallel replicas split: combine theirs too
        # (what SyncBatchNorm does, here exact and in replica order on every rank).
        stats = torch.stack([mean_all, m2_all, torch.full_like(mean_all, total)])
        per = mode.executor.across_replicas(stats, "batch statistics")
        total_t = sum(p[2] for p in per)
        mean_all = sum(p[2] * p[0] for p in per) / total_t
        m2_all = sum(p[1] + p[2] * (p[0] - mean_all).square() for p in per)
        # Kept a tensor: float() here waited for the device in every BatchNorm layer of every step.
        total = total_t.reshape(-1)[0]
    return mean_all, m2_all / total, total


def _bessel(total):
    """n / (n - 1), never dividing by zero; ``total`` a count or a 0-dim tensor of one (no host sync)."""
    return total / max(total - 1, 1) if isinstance(total, (int, float)) else total / (total - 1).clamp_min(1)


def _normalize(x, mean, var, eps, weight, bias, channel_view):
    weight = weight.view(channel_view) if weight is not None else None
    bias = bias.view(channel_view) if bias is not None else None
    return _Normalize.apply(x, mean, torch.rsqrt(var + eps), weight, bias)


def _update_running(running: torch.Tensor | None, value: torch.Tensor, momentum: float) -> None:
    # Through .data: PyTorch's fused kernel updates running statistics without bumping their version
    # counter, and a module used twice in one forward (its first call's backward saved them) relies on it.
    if running is not None:
        running.data.mul_(1 - momentum).add_(value.detach().to(running.dtype), alpha=momentum)


_BN_NAMES = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")


def _batch_norm(mode: RuleContext, func, args, kwargs):
    b = bind(_BN_NAMES, args, kwargs)
    x, shape = b["input"], global_shape(b["input"])
    training, momentum, eps = b.get("training", False), b.get("momentum", 0.1), b.get("eps", 1e-5)
    if not training:  # eval: running statistics, a per-channel affine map
        return mode.tag_outputs(func(*args, **kwargs), shape)
    spatial = list(range(2, x.dim()))
    mean, var, total = whole_stats(mode, x, [0] + spatial, shape, [0])
    view = (1, -1) + (1,) * len(spatial)
    out = _normalize(x, mean, var, eps, b.get("weight"), b.get("bias"), view)
    _update_running(b.get("running_mean"), mean.reshape(-1), momentum)
    _update_running(b.get("running_var"), var.reshape(-1) * _bessel(total), momentum)
    return mark(out, shape)


_IN_NAMES = ("input", "running_mean", "running_var", "weight", "bias", "use_input_stats", "momentum", "eps")


def _instance_norm(mode: RuleContext, func, args, kwargs):
    b = bind(_IN_NAMES, args, kwargs)
    x, shape = b["input"], global_shape(b["input"])
    use_input_stats, momentum, eps = b.get("use_input_stats", True), b.get("momentum", 0.1), b.get("eps", 1e-5)
    if not use_input_stats:
        return mode.tag_outputs(func(*args, **kwargs), shape)
    spatial = list(range(2, x.dim()))
    mean, var, total = whole_stats(mode, x, spatial, shape, [])
    view = (1, -1) + (1,) * len(spatial)
    out = _normalize(x, mean, var, eps, b.get("weight"), b.get("bias"), view)
    # PyTorch updates instance norm's running statistics with the batch mean of per-instance values.
    _update_running(b.get("running_mean"), mean.reshape(x.shape[:2]).mean(0), momentum)
    _update_running(b.get("running_var"), (var * (total / max(total - 1, 1))).reshape(x.shape[:2]).mean(0), momentum)
    return mark(out, shape)


_GN_NAMES = ("input", "num_groups", "weight", "bias", "eps")


def _group_norm(mode: RuleContext, func, args, kwargs):
    b = bind(_GN_NAMES, args, kwargs)
    x, shape, groups = b["input"], global_shape(b["input"]), b["num_groups"]
    if x.shape[1] % groups:
        return mode.tag_outputs(func(*args, **kwargs), shape)  # PyTorch raises its own error if indivisible
    n, c = x.shape[:2]
    grouped = x.reshape(n, groups, c // groups, *x.shape[2:])
    dims = list(range(2, grouped.dim()))
    mean, var, _ = whole_stats(mode, grouped, dims, shape, [2])
    view = (1, groups, c // groups) + (1,) * (x.dim() - 2)
    out = _normalize(grouped, mean, var, b.get("eps", 1e-5), b.get("weight"), b.get("bias"), view)
    return mark(out.reshape(x.shape), shape)


_LN_NAMES = ("input", "normalized_shape", "weight", "bias", "eps")


def _layer_norm(mode: RuleContext, func, args, kwargs):
    """Over channels of a channels-last view (ConvNeXt): per position. Over every spatial dim: whole-image
    statistics. Over some spatial dims only: refused."""
    b = bind(_LN_NAMES, args, kwargs)
    x, shape = b["input"], global_shape(b["input"])
    normalized = list(b["normalized_shape"])
    over = set(range(-len(normalized), 0))
    spatial = set(mode.layout(x))
    if not over & spatial:
        return mode.tag_outputs(func(*args, **kwargs), shape, mode.layout(x))
    if not spatial <= over:
        raise mode.unsupported(
            func, f"it normalizes over {len(over & spatial)} of the {mode.dims} spatial dims",
            "Normalize over all spatial dims, e.g. LayerNorm([C, *spatial]), or over channels only "
            "(a channels-last view), or use GroupNorm(1, C)")
    mode.require_channels_first(func, [x])
    dims = list(range(x.dim() - len(normalized), x.dim()))
    mean, var, _ = whole_stats(mode, x, dims, shape, dims[: len(normalized) - mode.dims])
    # Elementwise weights vary over the image: each shard uses its own part of them.
    weight = mode.executor.local_part(b["weight"], shape) if b.get("weight") is not None else None
    bias = mode.executor.local_part(b["bias"], shape) if b.get("bias") is not None else None
    return mark(_Normalize.apply(x, mean, torch.rsqrt(var + b.get("eps", 1e-5)), weight, bias), shape)


RULES[F.batch_norm] = _batch_norm
RULES[F.instance_norm] = _instance_norm
RULES[F.group_norm] = _group_norm
RULES[F.layer_norm] = _layer_norm
LAYOUT_AWARE.add(F.layer_norm)
