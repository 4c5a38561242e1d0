"""multidsn: Domain Separation Networks (Bousmalis et al. 2016) for one source and K targets, single-process
or across the workers of a ``bigconv.World`` with exact gradients.

Layers, bottom up: ``config``/``batch``/``losses`` (pure) -> ``model`` (the single-process reference) ->
``placement`` (which worker holds what; pure) -> ``remote`` (worker side) -> ``parallel`` (the driver).
"""

from .batch import Batch
from .config import DSNConfig
from .model import DSN, LossTerms
from .parallel import DistributedDSN, parallelize

__all__ = ["DSNConfig", "DSN", "Batch", "LossTerms", "parallelize", "DistributedDSN"]
