"""``bigconv.spmd.launch.run``: local SPMD ranks for tests and benchmarks, at the path users know.

The launcher lives in the runtime layer (``bigconv.runtime.spmd_launch``); this module only gives it
its public name.
"""

from ..runtime.spmd_launch import RankFailure, run

__all__ = ["RankFailure", "run"]
