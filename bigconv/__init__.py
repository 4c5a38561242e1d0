"""bigconv: train ordinary PyTorch CNNs on images split over many workers, exactly.

Layers, bottom up: ``geometry`` (pure index math) -> ``transport`` and ``world`` (RPC, mailboxes,
process groups) -> ``sharding``/``executors`` (what each op means on shards) -> ``parallel``
(the driver's training API).
"""

from .parallel import ParallelModel, parallelize
from .sharding import UnsupportedOperation
from .transport import WorkerFailure
from .world import World

__all__ = ["World", "parallelize", "ParallelModel", "UnsupportedOperation", "WorkerFailure"]
__version__ = "0.1.0"
