"""The SPMD mode: every rank runs the same script (torchrun, srun, jsrun) and there is no driver.

Halos travel by point-to-point (``bigconv.transport.p2p``) between the ranks of a spatial group,
backward is plain local autograd, and parameter gradients are summed over every rank (spatial
partial sums and data-parallel replicas alike) in buckets launched as backward produces them. The
op rules, the executor and the dry run are the driver mode's own.

Layout: ``model`` (the training API, a front end on ``bigconv.engine``); ``world`` (process groups
and the rank mesh) and ``launch`` (local ranks for tests and benchmarks) give the runtime layer's
``spmd_world`` and ``spmd_launch`` their public names.
"""

from . import launch
from .model import SpmdModel
from .world import SpmdWorld

__all__ = ["SpmdModel", "SpmdWorld", "launch"]
