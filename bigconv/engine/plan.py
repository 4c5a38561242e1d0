"""What a forward over one input shape looks like: the grid, the input's and the outputs' shapes.

The planner (``bigconv.planning``) finds it by a dry run; the engine's step and both front ends read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree


@dataclass(frozen=True)
class Plan:
    """What a forward over one input shape looks like."""

    grid: tuple[int, ...]
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...] | None
    """Global spatial shape of a sharded output; None when the output is replicated (a head)."""
    out_full_shape: tuple[int, ...]
    outputs: tuple = ()
    """Several outputs: each one's ``(out_shape, out_full_shape)`` in the order of ``spec``; empty for one
    tensor (then ``out_shape`` and ``out_full_shape`` describe it)."""
    spec: Any = None
    """The structure of several outputs (list, tuple, dict; a ``torch.utils._pytree`` spec), else None."""

    @property
    def several(self) -> bool:
        return self.spec is not None

    def leaf_shapes(self) -> tuple:
        """``(out_shape, out_full_shape)`` of each output tensor: one for a single tensor."""
        return self.outputs if self.several else ((self.out_shape, self.out_full_shape),)

    def rebuild(self, leaves: list) -> Any:
        """The model's output structure around ``leaves`` (one tensor: the tensor)."""
        return pytree.tree_unflatten(list(leaves), self.spec) if self.several else leaves[0]


def output_leaves(out: Any) -> list:
    """The tensors of a model's output, in the order of its plan's ``outputs`` (a tensor: itself)."""
    return [out] if isinstance(out, torch.Tensor) else pytree.tree_leaves(out)
