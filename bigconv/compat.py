"""Make torchvision's model definitions importable where its compiled ops cannot load.

torchvision's wheels on the package index are CUDA builds: on a CPU-only torch wheel its ``_C``
extension fails to load (it links ``libtorch_cuda``). torchvision tolerates that for every op
except ``nms``/``qnms``, whose fake kernels it registers unconditionally, so ``import torchvision``
raises ``operator torchvision::nms does not exist``. The model definitions (ResNet, DeepLabV3, ...)
are plain Python and need none of those ops.

``allow_torchvision_without_ops`` declares the two op schemas when, and only when, the extension
cannot load; calling an op then still fails with torchvision's own error. Workers call it at
startup, so a torchvision model pickled by the driver unpickles there too.

Import order must not matter (``import timm`` first is what most scripts do), so the fix is applied
by the environment, not by ``import bigconv``: the package declares ``torch_plugin`` under torch's
``torch.backends`` entry points (``pyproject.toml``), which ``import torch`` calls at its end in
every interpreter of an environment where bigconv is installed (editable or not: entry points are
package metadata). The plugin only installs ``TorchvisionGuard``, a finder that applies the fix the
first time a torchvision module is looked up, so nothing is loaded where torchvision is never
imported, and where its compiled ops load (a cluster's matching CUDA build) the fix does nothing.
``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` turns torch's plugins off, this one included.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import sys
from pathlib import Path

import torch

log = logging.getLogger(__name__)
_LIB: torch.library.Library | None = None


def allow_torchvision_without_ops() -> bool:
    """Declare torchvision's ``nms``/``qnms`` schemas if its ``_C`` cannot load; True if it did."""
    global _LIB
    if _LIB is not None:
        return True
    spec = importlib.util.find_spec("torchvision")
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


class TorchvisionGuard(importlib.abc.MetaPathFinder):
    """Applies ``allow_torchvision_without_ops`` at the first lookup of ``torchvision`` or one of its
    modules (the plugin may be installed while ``import torchvision`` is already running, by the
    ``import torch`` it starts: its ``extension`` module comes next). It never finds anything itself,
    and it stays in ``sys.meta_path`` (removing a finder while the import system walks that list
    would skip the next one)."""

    def __init__(self) -> None:
        self.done = False

    def find_spec(self, name, path=None, target=None):
        if not self.done and (name == "torchvision" or name.startswith("torchvision.")):
            self.done = True  # first: the fix looks torchvision up itself
            try:
                allow_torchvision_without_ops()
            except Exception as exc:  # never break an import over a fix for another import
                log.warning("bigconv could not check torchvision's compiled ops: %s: %s", type(exc).__name__, exc)
        return None


def install_import_guard() -> None:
    """Put one ``TorchvisionGuard`` first in ``sys.meta_path`` (idempotent)."""
    if not any(isinstance(f, TorchvisionGuard) for f in sys.meta_path):
        sys.meta_path.insert(0, TorchvisionGuard())


def torch_plugin() -> None:
    """torch's ``torch.backends`` entry point (see the module doc): called at the end of ``import
    torch``; it must never raise, since torch would then fail to import. (Loading it imports the
    ``bigconv`` package, whose ``__init__`` installs the guard too, for a checkout on PYTHONPATH.)"""
    try:
        install_import_guard()
    except Exception:  # pragma: no cover - a broken sys.meta_path is not ours to report from here
        pass
