"""Import order never matters: torchvision is importable first, before bigconv, wherever bigconv is installed.

``import torchvision`` (and timm, segmentation_models_pytorch, lightning, which import it) fails beside a
CPU torch unless ``bigconv.compat``'s fix ran first; most scripts import their model libraries before
bigconv. So the environment applies it, not the user's script: the package declares ``torch_plugin``
under torch's ``torch.backends`` entry points (``pyproject.toml``), which ``import torch`` calls at its
end in every interpreter of an environment holding bigconv (editable or not: entry points are package
metadata). The plugin only installs ``TorchvisionGuard``, a finder that runs the fix the first time a
torchvision module is looked up: nothing is loaded where torchvision is never imported, and where its
compiled ops load (a cluster's matching CUDA build) the fix does nothing. ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``
turns torch's plugins off, this one included.

This module imports neither torch nor the rest of bigconv at its top: torch may be half imported when
it loads it (``import bigconv`` imports torch, whose plugin then loads this module).
"""

from __future__ import annotations

import importlib.abc
import logging
import sys

log = logging.getLogger(__name__)


class TorchvisionGuard(importlib.abc.MetaPathFinder):
    """Runs ``bigconv.compat.allow_torchvision_without_ops`` at the first lookup of ``torchvision`` or one of
    its modules (the plugin may be installed while ``import torchvision`` already runs, by the ``import
    torch`` it starts: its ``extension`` module comes next). It never finds anything itself, and it stays in
    ``sys.meta_path`` (removing a finder while the import system walks that list would skip the next one)."""

    def __init__(self) -> None:
        self.done = False

    def find_spec(self, name, path=None, target=None):
        if not self.done and (name == "torchvision" or name.startswith("torchvision.")):
            self.done = True  # first: the fix looks torchvision up itself
            try:
                from .compat import allow_torchvision_without_ops

                allow_torchvision_without_ops()
            except Exception as exc:  # never break an import over a fix for another import
                log.warning("bigconv could not check torchvision's compiled ops: %s: %s", type(exc).__name__, exc)
        return None


def install_import_guard() -> None:
    """Put one ``TorchvisionGuard`` first in ``sys.meta_path`` (idempotent)."""
    if not any(type(f).__name__ == "TorchvisionGuard" for f in sys.meta_path):
        sys.meta_path.insert(0, TorchvisionGuard())


def torch_plugin() -> None:
    """torch's ``torch.backends`` entry point: called at the end of ``import torch``; it must never raise,
    since torch would then fail to import."""
    try:
        install_import_guard()
    except Exception:  # pragma: no cover - a broken sys.meta_path is not ours to report from here
        pass
