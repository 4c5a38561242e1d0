"""What a shard records of named modules: their outputs and the gradients reaching them (issue 39).

A ``Recorder`` puts a forward hook on each named module of this shard's model. The hook runs where the
module runs, on this shard's part of its output (``docs/capture.md``: user hooks see the same), and keeps a
copy of it with what the op rules know of it: the global spatial shape of a sharded map, or that it is
held whole (a head's vector after global pooling, a map too small to split). With ``grads`` it also hooks
that output's gradient. Hooks run with the ShardMode's rules off (``DisableTorchFunction``): a copy and
a tensor hook are bookkeeping, not operations of the model.

How the front ends join the pieces (``join``): a sharded map from every shard's piece; a whole tensor is
worker 0's copy, and its gradient the **sum** of every copy's gradient (each shard's copy carries that
shard's part of it, as a replicated weight's gradient does).

``score_gradient`` is the gradient of a chosen output score (the sum over an image of one class's logit,
for a classifier that one logit) on this shard's output: built here, so no output-sized tensor travels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn as nn

from ..ops.shards import SPATIAL_DIMS_ATTR, global_shape, is_replicated
from .executor import join_shards


@dataclass
class Piece:
    """One call of one module on this shard: a copy of its output part, and the gradient of that part."""

    value: torch.Tensor
    shape: tuple[int, ...] | None
    """The global spatial shape of a sharded map; None for a tensor every shard holds whole."""
    grad: torch.Tensor | None = None


def call_names(name: str, calls: int) -> list[str]:
    """The keys of a module's calls: its name, then ``name#1``, ``name#2``... for later calls."""
    return [name] + [f"{name}#{i}" for i in range(1, calls)]


class Recorder:
    """Forward hooks on the modules ``names`` of ``model`` (removed by ``close``)."""

    def __init__(self, model: nn.Module, names: Sequence[str], grads: bool) -> None:
        modules = dict(model.named_modules())
        missing = [n for n in names if n not in modules]
        if missing:
            raise ValueError(f"no module named {missing} in the model")
        self.grads = grads
        self.calls: dict[str, list[Piece]] = {n: [] for n in names}
        self.handles = [modules[n].register_forward_hook(self._hook(n)) for n in names]

    def _hook(self, name: str):
        def hook(module, args, output):
            if not isinstance(output, torch.Tensor):
                raise ValueError(f"capture records tensors, but {name} ({type(module).__name__}) returned "
                                 f"{type(output).__name__}; capture one of its submodules")
            with torch._C.DisableTorchFunction():  # bookkeeping, not an op of the model
                if getattr(output, SPATIAL_DIMS_ATTR, None):
                    raise ValueError(f"{name}'s output has its spatial dims moved (channels-last, inside a block); "
                                     "capture the block's output, where they are back in place")
                whole = global_shape(output) is None or is_replicated(output)
                piece = Piece(output.detach().clone(), None if whole else global_shape(output))
                if self.grads and output.requires_grad:
                    output.register_hook(lambda g, p=piece: setattr(p, "grad", g.detach().clone()))
            self.calls[name].append(piece)
        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def result(self) -> dict[str, list[tuple]]:
        """Per name, per call: (value, grad, global shape) on the CPU."""
        return {n: [(p.value.cpu(), None if p.grad is None else p.grad.cpu(), p.shape) for p in pieces]
                for n, pieces in self.calls.items()}


@dataclass(frozen=True)
class Captured:
    """A module's output and, when asked, the gradient reaching it (None where no gradient flowed)."""

    output: Any
    grad: Any = None


def join(parts: list[dict], grid: Sequence[int]) -> dict[str, Captured]:
    """The whole captures from every shard's ``Recorder.result`` (in shard order)."""
    out = {}
    for name, calls in parts[0].items():
        per_call = [[p[name][i] for p in parts] for i in range(len(calls))]
        for key, pieces in zip(call_names(name, len(calls)), per_call):
            shape = pieces[0][2]
            grads = [g for _, g, _ in pieces]
            if shape is not None:
                value = join_shards([v for v, _, _ in pieces], grid)
                grad = None if any(g is None for g in grads) else join_shards(grads, grid)
            else:
                value = pieces[0][0]
                present = [g for g in grads if g is not None]
                grad = sum(present[1:], present[0].clone()) if present else None
            out[key] = Captured(value, grad)
    return out


def score_gradient(out: torch.Tensor, target, counts: bool) -> torch.Tensor:
    """The gradient of ``sum_n out[n, target[n]]`` (summed over a map's pixels) on this shard's ``out``;
    a tensor held whole on every shard counts once (``counts``: this shard's copy is the one)."""
    with torch._C.DisableTorchFunction():
        g = torch.zeros(out.shape, dtype=out.dtype, device=out.device)
        whole = global_shape(out) is None or is_replicated(out)
        if counts or not whole:
            for n, t in enumerate(target):
                g[n, t] = 1
    return g


# -- Grad-CAM on the shards (bigconv.capture.gradcam) ------------------------------------------------------------
def channel_sums(piece: Piece) -> tuple[torch.Tensor, tuple[int, ...]]:
    """This shard's sum over its pixels of the gradient reaching a sharded map, per image and channel, and
    the map's global spatial shape."""
    if piece.shape is None:
        raise ValueError("Grad-CAM's layer output is held whole by every worker here (a map too small to split "
                         "over the grid); choose an earlier layer or a larger input")
    if piece.grad is None:
        raise ValueError("no gradient reached the Grad-CAM layer: the target's score does not depend on it")
    return piece.grad.double().flatten(2).sum(2), piece.shape


def cam_map(engine, grid: tuple[int, ...], call: int, piece: Piece, weights: torch.Tensor,
            size: tuple[int, ...]) -> torch.Tensor:
    """ReLU(sum_k weights[:, k] * A_k) on this shard of the layer's map ``piece``, upsampled (bilinear, as
    ``F.interpolate(..., size, align_corners=False)`` on one process) to the input grid ``size`` under the
    op rules, which bring the halos it needs from the neighbours: this shard's part of the input grid."""
    from ..ops.mode import ShardMode
    from ..ops.shards import mark
    from .executor import ShardExecutor

    a = piece.value.to(engine.rt.device)
    w = weights.to(device=a.device, dtype=a.dtype)
    cam = torch.relu((a * w[:, :, None, None]).sum(1, keepdim=True)) if a.dim() == 4 else \
        torch.relu((a * w[:, :, None, None, None]).sum(1, keepdim=True))
    mode = "bilinear" if a.dim() == 4 else "trilinear"
    x = mark(cam, piece.shape)
    engine.path.clear()
    with torch.no_grad(), ShardMode(ShardExecutor(grid, call, engine.rt), engine.path):
        up = torch.nn.functional.interpolate(x, size=size, mode=mode, align_corners=False)
    with torch._C.DisableTorchFunction():
        return up.detach().cpu()
