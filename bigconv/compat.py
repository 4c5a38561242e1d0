"""Make torchvision's model definitions importable where its compiled ops cannot load.

torchvision's wheels on the package index are CUDA builds: on a CPU-only torch wheel its ``_C``
extension fails to load (it links ``libtorch_cuda``). torchvision tolerates that for every op
except ``nms``/``qnms``, whose fake kernels it registers unconditionally, so ``import torchvision``
raises ``operator torchvision::nms does not exist``. The model definitions (ResNet, DeepLabV3, ...)
are plain Python and need none of those ops.

``allow_torchvision_without_ops`` declares the two op schemas when, and only when, the extension
cannot load; calling an op then still fails with torchvision's own error. Workers call it at
startup, so a torchvision model pickled by the driver unpickles there too.

Import order must not matter: ``bigconv.import_guard`` applies this fix from ``import torch``,
whichever library is imported first.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)
_LIB: torch.library.Library | None = None


def allow_torchvision_without_ops() -> bool:
    """Declare torchvision's ``nms``/``qnms`` schemas if its ``_C`` cannot load; True if it did."""
    global _LIB
    if _LIB is not None:
        return True
    spec = importlib.util.find_spec("torchvision")  # may run bigconv.import_guard's finder, and this function
    if _LIB is not None:  # ... which then did the work
        return True
    if spec is None or spec.origin is None:
        return False
    for library in sorted(Path(spec.origin).parent.glob("_C*.so")):
        try:
            torch.ops.load_library(str(library))
            return False  # the real ops load: nothing to do
        except (OSError, RuntimeError):
            continue
    _LIB = torch.library.Library("torchvision", "DEF")
    _LIB.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _LIB.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    log.info("torchvision's compiled ops cannot load here; its models are usable, its detection ops are not")
    return True

