"""One process's captures and Grad-CAM from plain torch: the references of the capture tests.

Written here, not taken from ``bigconv.capture_local``/``gradcam_local``: those share the workers' ``Recorder``
and ``score_gradient``, so a reference built from them would agree with the workers' bugs. What they compute,
as ``docs/capture.md`` states it:

- a capture of module ``name`` is a copy of its output at each call (``name``, then ``name#1``, ``name#2``... for
  later calls), taken before anything after it changes it in place; with ``target=`` or ``y=``/``loss_fn=``
  also the gradient reaching that output (the gradient of the value it had when the module returned);
- the gradient of ``target`` (a class index, or one per image) is that of ``out[n, target[n]]`` summed over
  the images (and over a map's pixels): ``out[arange(n), target].sum().backward()``;
- Grad-CAM at a layer: ReLU of its channels weighted by the mean over positions of the target's gradient,
  upsampled to the input grid (``F.interpolate``, bilinear or trilinear, ``align_corners=False``); saliency:
  the largest ``|d score / d input|`` over the input's channels.

Forward hooks and tensor hooks only; the model is left without gradients.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F


class Capture(NamedTuple):
    output: torch.Tensor
    grad: torch.Tensor | None = None


def _score(out: torch.Tensor, target) -> torch.Tensor:
    n = out.shape[0]
    classes = torch.as_tensor([target] * n if isinstance(target, int) else list(target))
    return out[torch.arange(n), classes].sum()


def capture_reference(model: nn.Module, layers, x: torch.Tensor, y=None, loss_fn=None, target=None
                      ) -> dict[str, Capture]:
    """Each call's output of each module in ``layers`` (a name or a list of names) on ``x``, and its gradient
    (of ``target``'s score, or of ``loss_fn(out, y)``; None without either)."""
    names = [layers] if isinstance(layers, str) else list(layers)
    modules = dict(model.named_modules())
    grads = target is not None or loss_fn is not None
    calls: dict[str, list[dict]] = {n: [] for n in names}

    def hook(name):
        def record(module, args, output):
            entry = {"output": output.detach().clone(), "grad": None}
            if grads and output.requires_grad:
                output.register_hook(lambda g: entry.__setitem__("grad", g.detach().clone()))
            calls[name].append(entry)
        return record

    handles = [modules[n].register_forward_hook(hook(n)) for n in names]
    try:
        with torch.set_grad_enabled(grads):
            out = model(x)
            if target is not None:
                _score(out, target).backward()
            elif loss_fn is not None:
                loss_fn(out, y).backward()
    finally:
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
    found = {}
    for name, entries in calls.items():
        for i, e in enumerate(entries):
            found[name if i == 0 else f"{name}#{i}"] = Capture(e["output"], e["grad"])
    return found


def gradcam_reference(model: nn.Module, x: torch.Tensor, layer: str | None = None, target=None,
                      method: str = "gradcam") -> torch.Tensor:
    """Grad-CAM of ``target`` at ``layer`` (N, 1, *input spatial), or the input-gradient saliency."""
    if method == "saliency":
        xr = x.detach().clone().requires_grad_(True)
        _score(model(xr), target).backward()
        model.zero_grad(set_to_none=True)
        return xr.grad.abs().amax(1, keepdim=True)
    got = capture_reference(model, layer, x, target=target)[layer]
    a, g = got.output, got.grad
    weights = g.flatten(2).mean(2)
    cam = torch.relu((a * weights.reshape(*weights.shape, *[1] * (a.dim() - 2))).sum(1, keepdim=True))
    mode = "bilinear" if a.dim() == 4 else "trilinear"
    return F.interpolate(cam, size=tuple(x.shape[2:]), mode=mode, align_corners=False)
