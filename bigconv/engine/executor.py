"""Executors: how windowed ops and global sums run, on real shards or in the driver's dry run.

``ShardExecutor`` runs inside a worker or an SPMD rank. A windowed op starts an exchange that sends
every other shard exactly the part of its input that shard reads (distributed autograd's FAST mode
needs every send to be consumed), convolves its own data into its whole output while halos are in
flight, then adds the halos' contribution to the border slabs (convolution is linear). The output is
cut the same way as every tensor: balanced over the grid. Which transport carries the exchanges is
the runtime's link (``bigconv.transport``), handed to the executor with its runtime: the executor only says what goes where.

The driver's dry run (``bigconv.engine.dry_run``) runs this same executor for every shard, on meta
tensors, with an in-process transport: whatever a worker would raise, the dry run raises first.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from .. import transport
from ..geometry.boxes import (
    Box, HaloPlan, Window, all_coords, balanced_bounds, coord_of, halo_plan, index_of, intersect, local_slices,
    shard_box,
)
from ..geometry.index_maps import Taps, needed, runs
from ..ops.context import Executor, IndexMaps, RegionOp, Windows
from ..ops.shards import UnsupportedOperation, mark


class _AddInto(torch.autograd.Function):
    """``out[index] += delta`` in place, whose backward passes ``out``'s gradient through untouched.

    Autograd's own in-place-on-a-view path (CopySlices) clones the whole gradient for every slab;
    an addition does not change the gradient, so no copy is needed.
    """

    @staticmethod
    def forward(ctx, out, delta, index):
        ctx.index = index
        out[index] += delta
        ctx.mark_dirty(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, grad[ctx.index], None


class _Tied(torch.autograd.Function):
    """``out``, made to depend on ``x`` with a zero gradient: a shard whose output reads none of its input
    (all padding) still runs the backward of the exchange that sent its input's halos, which receives
    the gradients its peers send back (without it they wait forever)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        ctx.x_meta = (x.shape, x.dtype, x.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        shape, dtype, device = ctx.x_meta
        return grad, torch.zeros(shape, dtype=dtype, device=device)


def check_output_fits(in_shape, windows: Sequence[Window], grid, where: str) -> tuple[int, ...]:
    out_shape = tuple(w.out_size(n) for w, n in zip(windows, in_shape))
    for axis, (m, g) in enumerate(zip(out_shape, grid)):
        if m < g:
            raise UnsupportedOperation(
                f"{where} turns spatial shape {tuple(in_shape)} into {out_shape}: {m} positions along dim {axis} "
                f"cannot be split over {g} shards; use a grid with at most {m} shards on that axis, or a larger image"
            )
    return out_shape


def pad_spec(pad: Sequence[tuple[int, int]]) -> list[int]:
    """F.pad's argument (last dim first) for per-dim (lo, hi) padding."""
    return [p for lo_hi in reversed(pad) for p in lo_hi]


def nested_cat(blocks: dict[tuple[int, ...], torch.Tensor], keys: Sequence[Sequence[int]], first_dim: int,
               prefix: tuple[int, ...] = ()) -> torch.Tensor:
    """Join blocks laid out on a product of per-axis keys, last axis innermost.

    Plain recursion, not a recursive closure: a closure that refers to itself is a reference
    cycle, and it would keep every block (activations) alive until the garbage collector runs.
    """
    axis = len(prefix)
    if axis == len(keys):
        return blocks[prefix]
    parts = [nested_cat(blocks, keys, first_dim, prefix + (k,)) for k in keys[axis]]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=first_dim + axis)


def split_axis(out: tuple[int, int], inner: tuple[int, int]) -> list[tuple[str, tuple[int, int]]]:
    """Cut an output interval into low border, interior and high border (empty parts dropped)."""
    i0, i1 = max(inner[0], out[0]), min(inner[1], out[1])
    if i0 >= i1:
        return [("border", out)]
    parts = [("border", (out[0], i0)), ("inner", (i0, i1)), ("border", (i1, out[1]))]
    return [(kind, iv) for kind, iv in parts if iv[0] < iv[1]]


def slab_boxes(out_box: Box, inner_box: Box) -> tuple[Box | None, list[Box], list[list[tuple[int, int]]]]:
    """Split ``out_box`` into its interior box and border slabs that need halos.

    Returns the interior (or None), the slabs, and per axis the interval keys used to join the
    computed parts back in order.
    """
    inner: Box | None = None
    slabs: list[Box] = []
    layout: list[list[tuple[int, int]]] = []
    for combo in itertools.product(*(split_axis(o, i) for o, i in zip(out_box, inner_box))):
        box = tuple(iv for _, iv in combo)
        if all(kind == "inner" for kind, _ in combo):
            inner = box
        else:
            slabs.append(box)
    for axis in range(len(out_box)):
        layout.append([iv for _, iv in split_axis(out_box[axis], inner_box[axis])])
    return inner, slabs, layout


def own_padding(windows: Sequence[Window], my_box: Box, out_box: Box) -> list[tuple[int, int]] | None:
    """Per dim, the symmetric padding that lets a plain convolution of this shard alone produce its
    output box, and where that box starts in the result; None if the shard has rows it must skip.
    """
    own = []
    for w, (a, b), out in zip(windows, my_box, out_box):
        lo, hi = w.input_interval(out)
        lo_pad, hi_pad = a - lo, hi - b
        if lo_pad < 0 or hi_pad < 0:
            return None
        pad = lo_pad + w.stride * -(-max(0, hi_pad - lo_pad) // w.stride)  # keeps outputs on the stride
        own.append((pad, (pad - lo_pad) // w.stride))
    return own


def interior_interval(w: Window, own: tuple[int, int]) -> tuple[int, int]:
    """Outputs whose whole window lies inside ``own`` (no halo, no border padding)."""
    a, b = own
    lo = -((-(a + w.pad_lo)) // w.stride)
    hi = (b + w.pad_lo - w.span) // w.stride + 1
    return lo, max(lo, hi)


@dataclass(frozen=True)
class _Part:
    """The output box an op computes (the interface of ``HaloPlan`` that region ops read)."""

    out_box: Box


class ShardExecutor(Executor):
    """Runs on one worker for one forward call: every member the op rules call is declared by
    ``bigconv.ops.context.Executor``, named as the base so a type checker holds this class to it."""

    def __init__(self, grid: tuple[int, ...], call: int, rt: transport.WorkerRuntime) -> None:
        """``rt``: the shard this executor runs (its index, device and links), handed in by its caller."""
        self.grid = grid
        self.call = call
        self.rt = rt
        if rt.link is None:
            raise RuntimeError(f"shard {rt.index} has no link to the other shards; set its runtime's link")
        self.link = rt.link
        self.replicas, self.replica_link = self.rt.replicas, self.rt.replica_link
        self.coord = coord_of(self.rt.index, grid)
        self.ring_passes: bool = getattr(self.link, "ring_in_backward", True)
        """Whether ``ring`` may run in backward on this link (not under the rpc transport's distributed autograd)."""
        self.exchange = 0
        self.recorders: list[dict] = []
        """Caches that keep what this forward receives, for a checkpointed block's recompute."""

    def local_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(b - a for a, b in shard_box(shape, self.grid, self.coord))

    # Every exchange of a forward goes through these; messages are keyed (call, exchange, sender, n).
    def _next_key(self) -> tuple[int, int]:
        self.exchange += 1
        return (self.call, self.exchange - 1)

    def _start(self, x: torch.Tensor, key: tuple, sends: list, recvs: list, link=None):
        """Begin an exchange: ``sends`` (shard, index into x), ``recvs`` (shard, full shape)."""
        link = link or self.link
        x, pending = link.start(x, key, sends, recvs)
        return x, (pending, key, [src for src, _ in recvs], link)

    def _finish(self, started, describe: str) -> list[torch.Tensor]:
        pending, key, sources, link = started
        tensors = link.finish(pending, describe)
        for cache in self.recorders:
            for (src, n), t in zip(transport.numbered(sources), tensors):
                cache[key + (src, n)] = t
        return tensors

    def windowed(self, x: torch.Tensor, shape: Sequence[int], windows: Windows, op: Callable[..., torch.Tensor],
                 where: str) -> torch.Tensor:
        out_shape = check_output_fits(shape, windows, self.grid, where)
        key = self._next_key()
        first = x.dim() - len(self.grid)
        my_box = shard_box(shape, self.grid, self.coord)
        plan = halo_plan(shape, self.grid, self.coord, windows)
        x, started = self._start_halos(x, shape, windows, plan, my_box, key, first)
        own = own_padding(windows, my_box, plan.out_box)
        if own is None:
            out = self._by_slabs(x, shape, windows, op, plan, my_box, started, first, where)
        else:
            out = self._own_plus_halos(x, shape, windows, op, plan, my_box, own, started, first, where)
        return mark(out, out_shape)

    def _own_plus_halos(self, x, shape, windows, op, plan: HaloPlan, my_box: Box, own, started, first, where):
        """Convolution is linear: conv(own data, zero-extended) + conv(halos only, no bias).

        The first term is the whole output, computed straight from the shard while halos are in
        flight, with no copy of the input (so memory matches a single process); halos then add
        their contribution to the border slabs in place.
        """
        lead = (slice(None),) * first
        out = op(x, padding=tuple(p for p, _ in own))
        for dim, ((_, j0), (a, b)) in enumerate(zip(own, plan.out_box), start=first):
            if j0 != 0 or out.shape[dim] != b - a:  # a no-op slice would still cost a full gradient copy
                out = out.narrow(dim, j0, b - a)
        # Outputs at the global border read only zero padding beyond it: nothing to add there.
        reach = tuple((a if a > 0 else -(10**18), b if b < n else 10**18) for (a, b), n in zip(my_box, shape))
        inner_box = tuple(interior_interval(w, r) for w, r in zip(windows, reach))
        _, slabs, _ = slab_boxes(plan.out_box, inner_box)
        sources = self._receive_halos(plan, x, my_box, started, where)  # also when no slab reads them
        if slabs:
            for box in slabs:
                delta = op(self._region(box, windows, shape, sources, first, own_as_zeros=True), bias=False)
                out = _AddInto.apply(out, delta, lead + local_slices(box, plan.out_box))
        return out

    def _by_slabs(self, x, shape, windows, op, plan: HaloPlan, my_box: Box, started, first, where):
        """General fallback (a shard whose outputs skip some of its own rows): interior + border slabs."""
        inner_box = tuple(interior_interval(w, own) for w, own in zip(windows, my_box))
        inner, slabs, layout = slab_boxes(plan.out_box, inner_box)
        parts: dict[tuple, torch.Tensor] = {}
        if inner is not None:  # computed while the halos are in flight
            parts[inner] = op(self._region(inner, windows, shape, {self.coord: (x, my_box)}, first))
        sources = self._receive_halos(plan, x, my_box, started, where)
        if slabs:
            for box in slabs:
                parts[box] = op(self._region(box, windows, shape, sources, first))
        blocks = {tuple(iv[0] for iv in box): t for box, t in parts.items()}
        return nested_cat(blocks, [[iv[0] for iv in axis] for axis in layout], first)

    def gather_window(self, x, shape, windows) -> torch.Tensor:
        """The exchange on its own: this shard's whole zero-padded input window, from its owners."""
        key = self._next_key()
        first = x.dim() - len(self.grid)
        my_box = shard_box(shape, self.grid, self.coord)
        plan = halo_plan(shape, self.grid, self.coord, windows)
        x, started = self._start_halos(x, shape, windows, plan, my_box, key, first)
        sources = self._receive_halos(plan, x, my_box, started, "the halo exchange")
        return self._region(plan.out_box, windows, shape, sources, first)

    def _start_halos(self, x, shape, windows, plan: HaloPlan, my_box: Box, key, first: int):
        """Send every other shard its part of ``x``, and post this shard's receives (from ``plan``).
        Returns ``x`` to use from here on and the started exchange."""
        lead = (slice(None),) * first
        sends = []
        for index, coord in enumerate(all_coords(self.grid)):
            if index == self.rt.index:
                continue
            part = intersect(halo_plan(shape, self.grid, coord, windows).need, my_box)
            if part is not None:
                sends.append((index, lead + local_slices(part, my_box)))
        recvs = [(index_of(owner, self.grid), (*x.shape[:first], *(b - a for a, b in box)))
                 for owner, box in plan.pieces() if owner != self.coord]
        return self._start(x, key, sends, recvs)

    def _receive_halos(self, plan: HaloPlan, x, my_box: Box, started, where: str) -> dict:
        key = started[1]
        arrived = iter(self._finish(started, f"halo {key[1]} of call {key[0]} for {where}"))
        return {owner: (x, my_box) if owner == self.coord else (next(arrived), box) for owner, box in plan.pieces()}

    def _region(self, out_box: Box, windows, shape, sources: dict, first: int, own_as_zeros: bool = False,
                fill: float | None = 0.0):
        """The padded input that ``out_box`` reads, joined from the owners' pieces.

        With ``own_as_zeros`` this shard's own part is zeros: the halos' contribution alone. Beyond
        the image border the region is padded with ``fill`` (-inf for max pooling), or not at all
        when ``fill`` is None.
        """
        lead = (slice(None),) * first
        want = [w.input_interval(o) for w, o in zip(windows, out_box)]
        clipped = tuple((max(lo, 0), min(hi, n)) for (lo, hi), n in zip(want, shape))
        pad = [(c[0] - lo, hi - c[1]) for (lo, hi), c in zip(want, clipped)]
        blocks, keys = {}, [[] for _ in shape]
        for owner, (tensor, origin) in sources.items():
            owned = shard_box(shape, self.grid, owner)
            part = intersect(clipped, owned)
            if part is None:
                continue
            # The whole tensor rather than a full-range slice: autograd gives every slice its own
            # full-size zero gradient in backward.
            piece = tensor if part == tuple(origin) else tensor[lead + local_slices(part, origin)]
            blocks[owner] = torch.zeros_like(piece) if own_as_zeros and owner == self.coord else piece
            for axis, c in enumerate(owner):
                if c not in keys[axis]:
                    keys[axis].append(c)
        if not blocks:  # the region lies wholly in the border padding (a padding layer's margin)
            like = next(iter(sources.values()))[0]
            size = tuple(hi - lo for lo, hi in want)
            return like.new_full((*like.shape[:first], *size), 0.0 if fill is None else fill)
        region = nested_cat(blocks, [sorted(k) for k in keys], first)
        if fill is None or not any(p for lo_hi in pad for p in lo_hi):
            return region
        return F.pad(region, pad_spec(pad), value=fill)

    def allgather(self, partial: torch.Tensor, what: str = "partial sum", shapes: Sequence | None = None
                  ) -> list[torch.Tensor]:
        """Every shard's ``partial``, in worker order, on every worker (differentiably). ``shapes[i]``:
        shard i's shape, where they differ (default: all like this one)."""
        key = self._next_key()
        others = [i for i in range(self.rt.workers) if i != self.rt.index]
        partial, started = self._start(partial, key, [(i, None) for i in others],
                                       [(i, tuple(shapes[i] if shapes else partial.shape)) for i in others])
        arrived = iter(self._finish(started, f"{what} {key[1]} of call {key[0]}"))
        return [partial if i == self.rt.index else next(arrived) for i in range(self.rt.workers)]

    def across_replicas(self, t: torch.Tensor, what: str) -> list[torch.Tensor]:
        """Every data-parallel replica's ``t`` (this shard position), in replica order (differentiably)."""
        if self.replicas == 1:
            return [t]
        key = self._next_key()
        me = self.rt.replica
        others = [i for i in range(self.replicas) if i != me]
        t, started = self._start(t, key, [(i, None) for i in others], [(i, tuple(t.shape)) for i in others],
                                 link=self.replica_link)
        arrived = iter(self._finish(started, f"{what} {key[1]} of call {key[0]} across replicas"))
        return [t if i == me else next(arrived) for i in range(self.replicas)]

    def ring(self, x: torch.Tensor, arriving: Sequence[int], what: str = "ring pass") -> torch.Tensor:
        """One pass of a ring in worker order: ``x`` goes to the next shard, the previous shard's tensor (of
        shape ``arriving``) comes back. Not differentiable: ring attention (``bigconv.ops.global_attention``)
        calls it inside its own autograd Function, forward and backward, every shard in the same order."""
        n = math.prod(self.grid)
        if n == 1:
            return x
        me = index_of(self.coord, self.grid)
        key = self._next_key()
        with torch.no_grad():
            _, started = self._start(x.detach().contiguous(), key, [((me + 1) % n, None)],
                                     [((me - 1) % n, tuple(arriving))])
            return self._finish(started, f"{what} {key[1]} of call {key[0]}")[0]

    def allsum(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum of every shard's ``partial``, in worker order so all replicas agree bit for bit."""
        return functools.reduce(torch.add, self.allgather(partial))

    # -- ops beyond convolution ------------------------------------------------------------------
    def fits(self, shape: Sequence[int]) -> bool:
        return all(n >= g for n, g in zip(shape, self.grid))

    def local_part(self, t: torch.Tensor, shape: Sequence[int], dims: Sequence[int] | None = None) -> torch.Tensor:
        """This shard's part of a whole tensor of spatial ``shape`` whose spatial dims sit at ``dims``
        (negative; default the trailing ones)."""
        index = [slice(None)] * t.dim()
        for d, (a, b) in zip(dims or range(-len(self.grid), 0), shard_box(shape, self.grid, self.coord)):
            index[d] = slice(a, b)
        return t[tuple(index)]

    def gather_all(self, x: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
        """The whole tensor on every worker, for maps too small to split over the grid."""
        first = x.dim() - len(self.grid)
        shapes = [(*x.shape[:first], *(b - a for a, b in shard_box(shape, self.grid, c))) for c in all_coords(self.grid)]
        return join_shards(self.allgather(x, "whole-map gather", shapes), self.grid)

    def region_op(self, x: torch.Tensor, shape: Sequence[int], windows: Windows, op: RegionOp, where: str,
                  fill: float | None = 0.0) -> torch.Tensor:
        """A windowed op that is not linear (pooling) or not a plain window (transposed conv).

        The shard joins its input region from the owners (padded with ``fill`` at the global
        border) and ``op(region, box)`` computes its output box from it, where ``box`` is the
        region's global input box (``want`` with padding, the clipped box without).
        """
        key = self._next_key()
        first = x.dim() - len(self.grid)
        my_box = shard_box(shape, self.grid, self.coord)
        plan = halo_plan(shape, self.grid, self.coord, windows)
        x, started = self._start_halos(x, shape, windows, plan, my_box, key, first)
        if any(a >= b for a, b in plan.need):
            self._receive_halos(plan, x, my_box, started, where)  # its sends must still complete
            out = op(None, plan)
            if isinstance(out, torch.Tensor) and x.requires_grad and torch.is_grad_enabled():
                out = _Tied.apply(out, x)
            return out
        if not all(isinstance(w, Window) for w in windows):
            sources = self._receive_halos(plan, x, my_box, started, where)
            return op(self._region(plan.out_box, windows, shape, sources, first, fill=fill), plan)
        # Sliding windows: the interior reads a view of this shard (no copy of the input for
        # autograd to keep), the border slabs read small joined regions.
        inner_box = tuple(interior_interval(w, own) for w, own in zip(windows, my_box))
        inner, slabs, layout = slab_boxes(plan.out_box, inner_box)
        parts: dict[tuple, torch.Tensor] = {}
        if inner is not None:
            region = self._region(inner, windows, shape, {self.coord: (x, my_box)}, first, fill=fill)
            parts[inner] = op(region, _Part(inner))
        sources = self._receive_halos(plan, x, my_box, started, where)
        if slabs:
            for box in slabs:
                parts[box] = op(self._region(box, windows, shape, sources, first, fill=fill), _Part(box))
        blocks = {tuple(iv[0] for iv in box): t for box, t in parts.items()}
        return nested_cat(blocks, [[iv[0] for iv in axis] for axis in layout], first)

    def index_map(self, x: torch.Tensor, shape: Sequence[int], maps: IndexMaps,
                  apply: Callable[[torch.Tensor, list[Taps]], torch.Tensor], where: str) -> torch.Tensor:
        """A separable index map (upsampling, padding modes); see ``bigconv.geometry.index_maps``.

        Each shard reads exactly the inputs its outputs' taps name, wherever they live (circular
        padding wraps around the image), and ``apply(region, taps)`` evaluates the taps on them.
        """
        key = self._next_key()
        first = x.dim() - len(self.grid)
        lead = (slice(None),) * first
        out_shape = [m.n_out for m in maps]
        bounds = [balanced_bounds(n, g) for n, g in zip(shape, self.grid)]
        my_box = shard_box(shape, self.grid, self.coord)

        def wants(coord):
            out_box = shard_box(out_shape, self.grid, coord)
            taps = [m.taps(o) for m, o in zip(maps, out_box)]
            return taps, [runs(needed(t), b) for t, b in zip(taps, bounds)]

        sends = []
        for index, coord in enumerate(all_coords(self.grid)):
            if index == self.rt.index:
                continue
            their_runs = wants(coord)[1]
            per_axis = [[iv for c, iv in axis_runs if c == mine] for axis_runs, mine in zip(their_runs, self.coord)]
            sends += [(index, lead + local_slices(box, my_box)) for box in itertools.product(*per_axis)]

        taps, my_runs = wants(self.coord)
        combos = list(itertools.product(*(list(enumerate(r)) for r in my_runs)))
        recvs = []
        for combo in combos:
            owner = tuple(c for _, (c, _) in combo)
            if owner != self.coord:
                recvs.append((index_of(owner, self.grid), (*x.shape[:first], *(b - a for _, (_, (a, b)) in combo))))
        x, started = self._start(x, key, sends, recvs)
        arrived = iter(self._finish(started, f"index-map input {key[1]} of call {key[0]} for {where}"))
        blocks = {}
        for combo in combos:
            owner = tuple(c for _, (c, _) in combo)
            box = tuple(iv for _, (_, iv) in combo)
            piece = x[lead + local_slices(box, my_box)] if owner == self.coord else next(arrived)
            blocks[tuple(i for i, _ in combo)] = piece
        region = nested_cat(blocks, [list(range(len(r))) for r in my_runs], first)
        local = []
        for t, axis_runs in zip(taps, my_runs):
            position = {g: i for i, g in enumerate(i for _, (a, b) in axis_runs for i in range(a, b))}
            local.append([([position[i] for i in idx], w) for idx, w in t])
        return apply(region, local)


def split_shards(x: torch.Tensor, grid: Sequence[int]) -> list[torch.Tensor]:
    """Cut a global ``(N, C, *spatial)`` tensor into compact shards in worker order."""
    shape = x.shape[x.dim() - len(grid):]
    lead = (slice(None),) * (x.dim() - len(grid))
    return [
        x[lead + tuple(slice(a, b) for a, b in shard_box(shape, grid, c))].clone(memory_format=torch.contiguous_format)
        for c in all_coords(grid)
    ]


def join_shards(shards: Sequence[torch.Tensor], grid: Sequence[int]) -> torch.Tensor:
    """Inverse of ``split_shards``."""
    blocks = {c: s for c, s in zip(all_coords(grid), shards)}
    return nested_cat(blocks, [list(range(g)) for g in grid], shards[0].dim() - len(grid))

