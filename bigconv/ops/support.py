"""What bigconv needs to know about a model's layers before its dry run: how many spatial dims it has.

There is no list of supported module types: a module is judged by what its ``forward`` does to
sharded tensors, in the dry run (``bigconv.engine.dry_run``), which refuses any operation that
cannot be decomposed exactly, naming the module and the fix. A module that never touches a
sharded tensor (a parametrization computing a weight, an embedding of labels, attention over
pooled vectors) runs as it is, on every replica alike.
"""

from __future__ import annotations

import torch.nn as nn

CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
CONV_TRANSPOSE = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


def unwrap_compiled(model: nn.Module) -> tuple[nn.Module, bool]:
    """The module under ``torch.compile(model)`` and whether it was compiled: the dry run and the
    shards' rules run the original module's forward (each shard compiles its own, see
    ``bigconv.engine.shard``)."""
    from torch._dynamo.eval_frame import OptimizedModule

    if isinstance(model, OptimizedModule):
        return model._orig_mod, True
    return model, False


def conv_dims(model: nn.Module) -> int | None:
    """Spatial dims of the model's convolutions, or None when it has none."""
    dims = {int(c.__name__[-2]) for m in model.modules() for c in CONV + CONV_TRANSPOSE if isinstance(m, c)}
    if len(dims) > 1:
        raise ValueError(f"the model mixes convolutions of {sorted(dims)} spatial dims; bigconv shards one grid")
    return dims.pop() if dims else None
