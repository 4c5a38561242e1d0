"""What an op rule may ask: of the mode that called it (``RuleContext``) and of its executor (``Executor``).

Every rule is ``rule(mode, func, args, kwargs)``; ``mode`` is the ``ShardMode`` (``bigconv.ops.mode``),
but rules know it only through ``RuleContext``: the mode imports the rules' table, so a rule that
imported the mode, even for an annotation, would close an import circle. The executor is the
engine's ``ShardExecutor`` (``bigconv.engine.executor``), above ops: rules never import it, and say
here every member they call on it. ``tests/test_seams.py`` checks that rules read nothing undeclared,
that nothing declared goes unread, and that ``ShardMode`` and ``ShardExecutor`` provide it all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from typing import Any, Protocol

import torch

from ..geometry.boxes import TransposedWindow, Window
from ..geometry.index_maps import PadMap, Resize, Roll, Taps
from .shards import AttentionNote, UnsupportedOperation

Windows = Sequence[Window | TransposedWindow]
"""One window per spatial dim, in grid-axis order."""
IndexMaps = Sequence[Resize | PadMap | Roll]
"""One separable index map per spatial dim (``bigconv.geometry.index_maps``)."""
RegionOp = Callable[[torch.Tensor | None, Any], torch.Tensor]
"""``op(region, plan)`` of ``Executor.region_op``: ``plan.out_box`` is the output box to compute from
``region`` (None when no input reaches this shard), and for windows that are not plain ``Window``s
``plan.need`` the input box the region covers (a ``geometry.boxes.HaloPlan``)."""


class Executor(Protocol):
    """Where this shard lives in the grid, and how its data reaches the other shards."""

    grid: tuple[int, ...]
    coord: tuple[int, ...]
    """This shard's coordinate in ``grid``."""
    replicas: int
    """Data-parallel replicas of the whole grid (1 without data parallelism)."""
    ring_passes: bool
    """Whether ``ring`` may run inside an autograd Function's backward on this transport."""

    def local_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]: ...

    def local_part(self, t: torch.Tensor, shape: Sequence[int], dims: Sequence[int] | None = ...
                   ) -> torch.Tensor: ...

    def fits(self, shape: Sequence[int]) -> bool: ...

    def allsum(self, partial: torch.Tensor) -> torch.Tensor: ...

    def allgather(self, partial: torch.Tensor, what: str = ..., shapes: Sequence | None = ...
                  ) -> list[torch.Tensor]: ...

    def across_replicas(self, t: torch.Tensor, what: str) -> list[torch.Tensor]: ...

    def ring(self, x: torch.Tensor, arriving: Sequence[int], what: str = ...) -> torch.Tensor: ...

    def gather_all(self, x: torch.Tensor, shape: Sequence[int]) -> torch.Tensor: ...

    def windowed(self, x: torch.Tensor, shape: Sequence[int], windows: Windows, op: Callable[..., torch.Tensor],
                 where: str) -> torch.Tensor: ...

    def region_op(self, x: torch.Tensor, shape: Sequence[int], windows: Windows, op: RegionOp, where: str,
                  fill: float | None = ...) -> torch.Tensor: ...

    def index_map(self, x: torch.Tensor, shape: Sequence[int], maps: IndexMaps,
                  apply: Callable[[torch.Tensor, list[Taps]], torch.Tensor], where: str) -> torch.Tensor: ...


class KeySource(Protocol):
    """A forward's random draws (``bigconv.ops.random.ForwardDraws``): each draw takes the next key."""

    def next_key(self) -> int: ...


class RuleContext(Protocol):
    """What a rule may ask of the mode: the grid's view of tensors, refusals that name the module, and
    the ways to build outputs. The members a rule only reads are properties: a rule never sets them."""

    @property
    def executor(self) -> Executor: ...

    @property
    def dims(self) -> int:
        """Spatial dims of the grid."""
        ...

    @property
    def known(self) -> AbstractSet[tuple[int, ...]]:
        """Global spatial shapes of the sharded tensors this forward has seen."""
        ...

    @property
    def random(self) -> KeySource:
        """This forward's random draws, the same on every shard."""
        ...

    def where(self) -> str: ...

    def note_attention(self, note: AttentionNote) -> None:
        """Record what an attention rule did (``shards.ModulePath.note``; ``bigconv.check`` reads it)."""
        ...

    def attention_setting(self) -> tuple[str, int | None] | None:
        """The running module's global attention setting (``bigconv.ops.global_attention.use``), or None."""
        ...

    def unsupported(self, func: Callable, reason: str, fix: str) -> UnsupportedOperation: ...

    def layout(self, t: torch.Tensor) -> tuple[int, ...]: ...

    def one_shape(self, func: Callable, leaves: list) -> tuple[int, ...]: ...

    def one_layout(self, func: Callable, leaves: list) -> tuple[int, ...]: ...

    def require_channels_first(self, func: Callable, leaves: list) -> None: ...

    def tag_outputs(self, out: Any, shape: tuple[int, ...], dims: Sequence[int] | None = ...) -> Any: ...

    def after_replicated(self, out: Any) -> Any: ...

    def windowed_whole(self, x: torch.Tensor, shape: Sequence[int], out_shape: Sequence[int],
                       whole: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor: ...
