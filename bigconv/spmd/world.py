"""``bigconv.spmd.world``: the SPMD world and its rank mesh, at the path users know.

They live in the runtime layer (``bigconv.runtime.spmd_world``); this module only gives them their
public names.
"""

from ..runtime.spmd_world import Mesh, SpmdWorld

__all__ = ["Mesh", "SpmdWorld"]
