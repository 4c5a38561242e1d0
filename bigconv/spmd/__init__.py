"""The SPMD mode: every rank runs the same script (torchrun, srun, jsrun) and there is no driver.

Halos travel by point-to-point (``bigconv.transport.p2p``) between the ranks of a spatial group,
backward is plain local autograd, and parameter gradients are summed over every rank (spatial
partial sums and data-parallel replicas alike) in buckets launched as backward produces them. The
op rules, the executor and the dry run are the driver mode's own.

Layout: ``world`` (process groups and the rank mesh), ``buckets`` (gradient allreduce overlapped
with backward), ``model`` (the training API), ``launch`` (local ranks for tests and benchmarks).
"""

from .model import SpmdModel
from ..runtime.spmd_world import SpmdWorld

__all__ = ["SpmdModel", "SpmdWorld"]
