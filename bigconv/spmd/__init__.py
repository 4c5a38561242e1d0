"""The SPMD mode: every rank runs the same script (torchrun, srun, jsrun) and there is no driver.

Halos travel by point-to-point (``bigconv.transport.p2p``) between the ranks of a spatial group,
backward is plain local autograd, and parameter gradients are summed over every rank (spatial
partial sums and data-parallel replicas alike) in buckets launched as backward produces them. The
op rules, the executor and the dry run are the driver mode's own.

Layout: ``model`` (the training API, a front end on ``bigconv.engine``) and ``agreement`` (one plan on
every rank). The ranks' process groups and mesh (``SpmdWorld``) live in the runtime layer,
``bigconv.runtime.spmd_world``, and the local launcher of ranks for tests and benchmarks in
``bigconv.runtime.spmd_launch``.
"""

from ..runtime.spmd_world import SpmdWorld
from .model import SpmdModel

__all__ = ["SpmdModel", "SpmdWorld"]
