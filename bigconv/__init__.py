"""bigconv: train ordinary PyTorch CNNs on images split over many workers, exactly.

Layers, bottom up (each imports only those below it; ``tests/test_architecture.py`` checks it):
``geometry`` (index math) -> ``data`` (slides, read box by box) -> ``transport`` (links between
shards: point-to-point, RPC) -> ``ops`` (what each torch op means on shards) -> ``engine`` (the
shard-step every front end runs) -> ``runtime`` (processes, ``World``) -> the front ends
(``parallel`` for the driver mode, ``spmd`` for SPMD, with ``planning``) -> ``harness``/``verify``.
"""

from .compat import allow_torchvision_without_ops
from .parallel import ParallelModel, parallelize
from .ops.shards import UnsupportedOperation
from .ops.whole import hold_whole
from .transport import WorkerFailure
from .runtime.world import World

__all__ = ["World", "parallelize", "ParallelModel", "UnsupportedOperation", "WorkerFailure", "hold_whole"]
__version__ = "0.1.0"

# torchvision's CUDA wheel beside a CPU torch cannot load its compiled ops, and then `import torchvision`
# (and timm, which imports it) fails; declaring the two op schemas it needs, only in that case, lets its models run.
allow_torchvision_without_ops()
