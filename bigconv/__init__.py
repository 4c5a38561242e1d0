"""bigconv: train ordinary PyTorch CNNs on images split over many workers, exactly.

Layers, bottom up (each imports only those below it; ``tests/test_architecture.py`` checks it):
``geometry`` (index math) -> ``data`` (slides, read box by box) -> ``transport`` (links between
shards: point-to-point, RPC) -> ``ops`` (what each torch op means on shards) -> ``engine`` (the
shard-step every front end runs) -> ``runtime`` (processes, ``World``) -> the front ends
(``parallel`` for the driver mode, ``spmd`` for SPMD, with ``planning``) -> ``harness``/``verify``.

The public names below load on first use (PEP 562), so importing one layer (``bigconv.geometry``)
loads only what that layer imports, not the front ends, the runtime and RPC.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .import_guard import install_import_guard

if TYPE_CHECKING:
    from .capture import gradcam
    from .ops.shards import UnsupportedOperation
    from .ops.whole import hold_whole
    from .parallel import ParallelModel, parallelize
    from .runtime.world import World
    from .transport import WorkerFailure

__all__ = ["World", "parallelize", "ParallelModel", "UnsupportedOperation", "WorkerFailure", "hold_whole", "gradcam"]
__version__ = "0.1.0"
SUBPACKAGES = ("data", "models", "losses", "saving", "spmd", "harness", "verify", "check", "memory", "geometry",
               "engine", "ops", "runtime", "transport")
"""Reached as attributes of ``bigconv`` they import on first use too."""

# torchvision's CUDA wheel beside a CPU torch cannot load its compiled ops, and then `import torchvision`
# (and timm, which imports it) fails; declaring the two op schemas it needs, only in that case, lets its models run.
# An installed bigconv applies it at `import torch` (bigconv.compat.torch_plugin); here too, for a checkout on
# PYTHONPATH without the install's entry point. Lazily: only when torchvision is imported.
install_import_guard()


def __getattr__(name: str):
    """The public names, imported where they live at first use, then kept as attributes."""
    if name in ("parallelize", "ParallelModel"):
        from . import parallel as home
    elif name == "World":
        from .runtime import world as home
    elif name == "UnsupportedOperation":
        from .ops import shards as home
    elif name == "hold_whole":
        from .ops import whole as home
    elif name == "WorkerFailure":
        from . import transport as home
    elif name == "gradcam":
        from . import capture as home
    elif name in SUBPACKAGES:  # `import bigconv; bigconv.data.open_image(...)` as before the names were lazy
        return importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(home, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
