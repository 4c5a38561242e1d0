"""Checks of a batch on the driver, before any remote work: each failure names the problem and the fix.

A bad label or a mismatched target would otherwise surface as an ``IndexError`` or a shape error
from inside the workers' loss, after every worker has run its forward.
"""

from __future__ import annotations

from typing import Callable

import torch

from . import losses

def check_input(x, check_finite: bool) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x must be a tensor of shape (N, C, *spatial), got {type(x).__name__}")
    if x.dim() >= 1 and x.shape[0] == 0:
        raise ValueError(f"the batch is empty: x has shape {tuple(x.shape)}; pass at least one image")
    if x.is_floating_point() and check_finite and not bool(torch.isfinite(x).all()):
        bad = int((~torch.isfinite(x)).sum())
        raise ValueError(f"x holds {bad} NaN or infinite values; clean the input (check_finite=True found them)")


def check_finite_target(y) -> None:
    """An infinite or NaN target gives an infinite or NaN loss with no word; ``check_finite`` names it."""
    if isinstance(y, torch.Tensor) and y.is_floating_point() and not bool(torch.isfinite(y).all()):
        bad = int((~torch.isfinite(y)).sum())
        raise ValueError(f"y holds {bad} NaN or infinite values; clean the targets (check_finite=True found them)")


def model_dtype(model: torch.nn.Module) -> torch.dtype | None:
    """The floating dtype of the model's first floating parameter or buffer; None if it holds none."""
    for tensor in (*model.parameters(), *model.buffers()):
        if tensor.is_floating_point():
            return tensor.dtype
    return None


def check_dtype(x_dtype: torch.dtype, model_dtype: torch.dtype | None, sources: bool) -> None:
    """The input's dtype against the model's, once the dry run has failed: PyTorch would say "Input type (unsigned char) and bias type
    (float) should be the same", which names neither the fix nor which side to change."""
    if model_dtype is None or x_dtype == model_dtype:
        return
    model_name = str(model_dtype).replace("torch.", "")
    x_name = str(x_dtype).replace("torch.", "")
    if sources:
        raise ValueError(
            f"the image sources give {x_name} but the model is {model_name}; open them with "
            f"open_image(..., dtype={model_name!r}) (with scale=1/255 for 8-bit images), or convert the model "
            f"with model.to(torch.{x_name})"
        )
    if not x_dtype.is_floating_point:
        raise ValueError(
            f"x is {x_name} but the model is {model_name}; convert the images first: "
            f"x.to(torch.{model_name}) / 255 for 8-bit images (or open_image(..., scale=1/255) for files)"
        )
    raise ValueError(
        f"x is {x_name} but the model is {model_name}; cast one to the other: x.to(torch.{model_name}) "
        f"(x.float() or x.double()), or model.to(torch.{x_name})"
    )


def check_target(x, y, loss_fn: Callable, out_shape: tuple[int, ...]) -> None:
    """``y`` and ``loss_fn`` against the model's output shape ``out_shape`` (from the dry run); ``x``
    is a tensor or a list of image sources."""
    if isinstance(x, (list, tuple)):
        from .data.sources import SourceBatch

        x = SourceBatch(x)
    if not callable(loss_fn):
        raise ValueError(f"loss_fn must be callable as loss_fn(output, target), got {type(loss_fn).__name__}")
    if not isinstance(y, torch.Tensor):
        raise ValueError(f"y must be a tensor of targets, got {type(y).__name__}; wrap labels with torch.tensor(...)")
    if y.dim() >= 1 and y.shape[0] != x.shape[0]:
        raise ValueError(f"x holds {x.shape[0]} images but y holds {y.shape[0]} targets; pass one target per image")
    if len(out_shape) >= 2 and not y.is_meta:
        # (target sources arrive as a meta stand-in: their labels are read, and checked, on the workers)
        _check_labels(y, loss_fn, out_shape[1])
    _check_loss_on_meta(y, loss_fn, out_shape, x.dtype)


def _check_labels(y: torch.Tensor, loss_fn, classes: int) -> None:
    bad = losses.labels_out_of_range(loss_fn, y, classes)
    if bad.numel():
        raise ValueError(
            f"class labels must lie in [0, {classes}) for a {type(loss_fn).__name__} on an output with {classes} "
            f"classes, but y holds {int(bad[0])} ({bad.numel()} labels out of range); fix the labels, or give the "
            f"model as many outputs as classes"
        )


def _check_loss_on_meta(y: torch.Tensor, loss_fn: Callable, out_shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """Run ``loss_fn`` on shapes alone: a target that does not fit, or a non-scalar loss, shows up here."""
    out = torch.empty(out_shape, dtype=dtype if dtype.is_floating_point else torch.float32, device="meta")
    try:
        loss = loss_fn(out, y.to("meta"))
    except Exception as exc:  # a loss that reads values cannot be judged on shapes; the real run will tell
        if "meta" in str(exc).lower() or isinstance(exc, NotImplementedError):
            return
        raise ValueError(
            f"loss_fn cannot take the model's output of shape {tuple(out_shape)} with targets of shape "
            f"{tuple(y.shape)} and dtype {y.dtype} ({type(exc).__name__}: {exc}); give targets of the shape the "
            "loss expects for this output"
        ) from exc
    if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(
            f"loss_fn must return a scalar tensor, got {shape}; use reduction='mean' or 'sum' (or call .mean() on it)"
        )


def check_structured_target(x, y, loss_fn: Callable, outs) -> None:
    """Targets and loss of a model with several outputs: ``outs`` is the output's structure of meta
    tensors of the full shapes; ``y`` a tensor or any structure of tensors, one item per image."""
    import torch.utils._pytree as pytree

    if not callable(loss_fn):
        raise ValueError(f"loss_fn must be callable as loss_fn(outputs, targets), got {type(loss_fn).__name__}")
    n = len(x) if isinstance(x, (list, tuple)) else x.shape[0]
    for t in pytree.tree_leaves(y):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"y must hold tensors of targets, got {type(t).__name__}; "
                             "wrap them with torch.tensor(...)")
        if t.dim() >= 1 and t.shape[0] != n:
            raise ValueError(f"x holds {n} images but a target of y holds {t.shape[0]}; pass one target per image")
    shapes = pytree.tree_map(lambda t: tuple(t.shape), outs)
    try:
        loss = loss_fn(outs, pytree.tree_map(lambda t: t.to("meta"), y))
    except Exception as exc:  # a loss that reads values cannot be judged on shapes; the real run will tell
        if "meta" in str(exc).lower() or isinstance(exc, NotImplementedError):
            return
        raise ValueError(f"loss_fn cannot take the model's outputs of shapes {shapes} with these targets "
                         f"({type(exc).__name__}: {exc}); give targets of the shapes the loss expects") from exc
    if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
        raise ValueError("loss_fn must return a scalar tensor; use reduction='mean' or 'sum' (or call .mean() on it)")


def check_optimizer_class(cls) -> None:
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ValueError(f"optimizer expects a torch.optim.Optimizer class such as torch.optim.SGD, got {cls!r}")


def check_no_backward_hooks(model: torch.nn.Module) -> None:
    """Module backward hooks are refused with their real reason (they used to fail in the dry run on the
    ``view_as`` torch's hook wrapper makes, with advice about flattening that did not apply)."""
    from torch.nn.modules import module as torch_module

    hooked = [name or type(model).__name__ for name, m in model.named_modules()
              if m._backward_hooks or m._backward_pre_hooks]
    if torch_module._global_backward_hooks or torch_module._global_backward_pre_hooks:
        hooked.append("every module (a global backward hook)")
    if hooked:
        raise ValueError(
            f"module backward hooks are registered on {', '.join(hooked)}: on the workers each module runs on its "
            "shard of the image, so such a hook could only see a shard's gradient, never the module's, and torch's "
            "wrapper of the module's outputs (a view_as in an autograd Function) is not split by bigconv. Remove "
            "the hook (handle.remove()) and ask for the gradient reaching the module whole: net.capture(['NAME'], "
            "x, target=CLASS) or net.capture(['NAME'], x, y, loss_fn=...) (docs/capture.md); forward hooks run "
            "per shard on the workers")


def optimizer_spec(meta: torch.nn.Module, cls_or_factory, kwargs: dict, scheduler, clip_grad_norm) -> dict:
    """Check ``net.optimizer``'s arguments on the meta model (a factory and a scheduler factory are called on
    it, so a wrong group or argument fails here, before any remote work); returns the keyword arguments of
    ``ShardEngine.make_optimizer``."""
    if isinstance(cls_or_factory, type):
        check_optimizer_class(cls_or_factory)
        cls, factory = cls_or_factory, None
    elif callable(cls_or_factory):
        if kwargs:
            raise ValueError(f"an optimizer factory takes no keyword arguments (got {sorted(kwargs)}); set them inside "
                             "it: net.optimizer(lambda named: torch.optim.AdamW(groups(named), lr=...))")
        cls, factory = None, cls_or_factory
    else:
        raise ValueError("optimizer expects a torch.optim.Optimizer class (net.optimizer(torch.optim.SGD, lr=0.1)) "
                         "or a factory named_parameters -> Optimizer, got " + repr(cls_or_factory))
    if scheduler is not None and not callable(scheduler):
        raise ValueError(f"scheduler must be a factory optimizer -> scheduler (e.g. lambda opt: "
                         f"torch.optim.lr_scheduler.LambdaLR(opt, f)), got {scheduler!r}")
    if clip_grad_norm is not None and (isinstance(clip_grad_norm, bool) or not isinstance(clip_grad_norm, (int, float))
                                       or not clip_grad_norm > 0):
        raise ValueError(f"clip_grad_norm must be a positive number (the largest global gradient norm), got "
                         f"{clip_grad_norm!r}")
    try:
        opt = factory(list(meta.named_parameters())) if factory else cls(meta.parameters(), **kwargs)
    except Exception as exc:
        raise ValueError(f"the optimizer cannot be made over this model's parameters ({type(exc).__name__}: {exc}); "
                         "it was tried on a copy of the model before any remote work") from exc
    if not isinstance(opt, torch.optim.Optimizer):
        raise ValueError(f"the optimizer factory must return a torch.optim.Optimizer, got {type(opt).__name__}")
    if scheduler is not None:
        try:
            scheduler(opt)
        except Exception as exc:
            raise ValueError(f"the scheduler factory failed on the optimizer ({type(exc).__name__}: {exc}); it was "
                             "tried on a copy of the model before any remote work") from exc
    return {"cls": cls, "kwargs": kwargs, "factory": factory, "scheduler": scheduler,
            "clip": None if clip_grad_norm is None else float(clip_grad_norm)}


def by_value(obj, what: str) -> bytes:
    """``obj`` pickled for the workers, functions and classes of the user's script by value (cloudpickle):
    a plain pickle names ``__main__``, which the workers cannot import."""
    try:
        import cloudpickle
    except ImportError as exc:
        raise ValueError(f"sending {what} to the workers needs cloudpickle (pip install cloudpickle), which sends "
                         "what the script defines by value") from exc
    try:
        return cloudpickle.dumps(obj)
    except Exception as exc:
        raise ValueError(f"{what} cannot be sent to the workers ({type(exc).__name__}: {exc}); it must be "
                         "picklable (a function, lambda or class of your script is; an open file or lock is not)") \
            from exc
