"""``F.scaled_dot_product_attention`` on shards: over an image's flattened positions, a 1D map's, or windows.

Its sequence dim (-2) holding an image's flattened positions in q, k and v (``x.flatten(2).transpose(1, 2)``,
``x.reshape(N, C, -1).transpose(1, 2)``): ring attention (``bigconv.ops.global_attention``), the output's
positions where the queries' are; whole queries (a pooling head's latents, a learned latent array) over split
keys and values, each shard computing the whole output from every block in one fixed order; split queries
over whole keys and values, row by row (``_local_queries``). A 1D map's positions in the sequence dim are a
run of one process's order: they are flattened positions as they are (``_sdpa_map``). A mask (boolean or
additive, a row per query of the whole image or one, a column per key) and ``is_causal`` are taken by every
key's global index (``RingPlan.columns``). Positions in a batch dim of q, k and v are window attention
(``bigconv.ops.windows``' rule, which ``over_positions`` wraps).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .context import RuleContext
from .global_attention import FIX, RingPlan, attend
from .positions import localize
from .shards import (
    GATHER_ATTR, POSITIONS_ATTR, AttentionNote, bind, global_shape, mark, mark_positions, positions, prefix,
)


# -- F.scaled_dot_product_attention over flattened positions -------------------------------------------
SDPA_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def sdpa_over_positions(mode: RuleContext, func, args, kwargs, refuse, whole_queries: bool = False):
    """``F.scaled_dot_product_attention`` whose sequence dim (-2) holds an image's flattened positions, in q,
    k and v alike: ring attention, the output's positions where the queries' are. ``refuse(reason)``:
    the caller's refusal. ``whole_queries``: q is an ordinary tensor, the same on every shard (timm's
    ``AttentionPoolLatent``, a learned latent array): each shard computes the whole output from every block,
    in one fixed order. A mask (boolean or additive; SAM's relative position bias) over every key in one
    process's order: each block adds its own columns (``_ring_mask``)."""
    b = bind(SDPA_NAMES, args, kwargs)
    q, k, v = b["query"], b["key"], b["value"]
    _refuse_draws_and_groups(b, refuse)
    if b.get("is_causal") and b.get("attn_mask") is not None:
        raise refuse("it has both a mask and is_causal (torch refuses that too)")
    if q.dim() < 3 or q.shape[:-2] != k.shape[:-2] or k.shape[:-2] != v.shape[:-2]:
        raise refuse("its query, key and value differ in their batch dims")
    shape = positions(k)[0]
    qshape = shape if whole_queries else positions(q)[0]
    if tuple(qshape) != tuple(shape) or prefix(qshape) != prefix(shape):
        raise refuse(f"its queries hold an image's positions {qshape!r} and its keys {shape!r}")
    if qshape != shape and b.get("is_causal"):  # a pooled subset of the queries (Hiera's q_stride)
        raise refuse("it is causal with queries other than the keys' positions")
    lead = q.shape[:-2]
    g = math.prod(lead)
    scale = b.get("scale") or 1.0 / math.sqrt(q.shape[-1])
    plan = RingPlan(mode, tuple(shape), scale, q.device, prefix(shape), q.shape[-2] if whole_queries else None,
                    getattr(shape, "lead", 1), getattr(shape, "trail", 1))
    mask = b.get("attn_mask")
    if b.get("is_causal"):  # one process's causal mask, by global indices (the order of every key's column)
        rows = (torch.arange(q.shape[-2], device=q.device) if whole_queries
                else torch.cat([torch.arange(plan.prefix, device=q.device), plan.columns(plan.index)]))
        mask = torch.arange(plan.prefix + sum(plan.counts), device=q.device)[None, :] <= rows[:, None]
        if not whole_queries:  # rows of this shard's queries, as flattened positions
            mark_positions(mask, shape, -2)
    if mask is not None:
        mask = _ring_mask(mode, mask, q, shape, qshape, whole_queries, refuse).reshape(g, q.shape[-2], -1)
    strategy = plan.strategy(mode.attention_setting(), g, q.shape[-1], v.shape[-1], q.element_size())
    strategy = strategy if mode.executor.ring_passes else "gathered"  # as attend decides
    mode.note_attention(AttentionNote(strategy, sum(plan.counts), plan.prefix, whole_queries))
    out = attend(plan, q.reshape(g, *q.shape[-2:]), k.reshape(g, *k.shape[-2:]), v.reshape(g, *v.shape[-2:]),
                 strategy=strategy, mask=mask)
    out = out.reshape(*lead, *out.shape[-2:])
    return out if whole_queries else mark_positions(out, qshape, -2)


def _refuse_draws_and_groups(b: dict, refuse) -> None:
    if b.get("dropout_p", 0.0):
        raise refuse("its attention dropout would be drawn per shard (set dropout_p=0)")
    if b.get("enable_gqa"):
        raise refuse("grouped-query attention (enable_gqa) is not split")


def _count(shape) -> int:
    """How long a dim holding flattened positions of ``shape`` is in one process (whole items and tokens too)."""
    return prefix(shape) + getattr(shape, "lead", 1) * getattr(shape, "trail", 1) * math.prod(shape)


def _additive(mask: torch.Tensor, dtype) -> torch.Tensor:
    """A boolean mask (True: attend) as the additive one torch makes of it; an additive one as it is."""
    if mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, -math.inf)


def _ring_mask(mode: RuleContext, mask, q, shape, qshape, whole_queries: bool, refuse) -> torch.Tensor:
    """The SDPA's ``attn_mask`` as this shard's additive rows (``q``'s, broadcast to its batch dims) over every
    key in one process's order: rows that are this shard's queries' (flattened positions like them, or an
    ordinary tensor with a row per query of the whole image, of which this shard's are cut), or one row for
    all; columns one per key (the whole tokens', then the image's positions row-major), or one for all."""
    keys, queries = _count(shape), _count(qshape)
    mark = positions(mask)
    rows = mask.shape[-2] if mask.dim() >= 2 else 1
    if mark is not None:
        if whole_queries or mark[0] != qshape or mark[1] % mask.dim() != mask.dim() - 2:
            raise refuse("its mask holds an image's positions other than where its queries hold them")
    elif rows != 1 and not whole_queries:
        if rows != queries:
            raise refuse(f"its mask has {rows} rows, neither one nor one per query of the whole image ({queries})")
        mask = localize(mode, mask, qshape, -2)
    if mask.shape[-1] not in (1, keys):
        raise refuse(f"its mask has {mask.shape[-1]} columns, neither one nor one per key of the whole image "
                     f"({keys}, in one process's order)")
    mask = _additive(mask, q.dtype)
    return mask.expand(*q.shape[:-1], keys)


def _local_queries(mode: RuleContext, func, args, kwargs, refuse):
    """This shard's queries (flattened positions) over keys and values every shard holds whole (a learned
    latent array; cross-attention to a whole context): each query's row on its own, as one process computes
    it; a mask with a row per query of the whole image cut to this shard's rows. The keys' and values'
    gradients are each shard's part, summed over the shards as every whole tensor's are."""
    b = bind(SDPA_NAMES, args, kwargs)
    q = b["query"]
    _refuse_draws_and_groups(b, refuse)
    shape = positions(q)[0]
    mask = b.get("attn_mask")
    if b.pop("is_causal", False):  # one process's causal mask: the keys up to each query's global index
        if mask is not None:
            raise refuse("it has both a mask and is_causal (torch refuses that too)")
        plan = RingPlan(mode, tuple(shape), 1.0, q.device, prefix(shape), None, getattr(shape, "lead", 1),
                        getattr(shape, "trail", 1))
        rows = torch.cat([torch.arange(plan.prefix, device=q.device), plan.columns(plan.index)])
        b["attn_mask"] = mask = mark_positions(torch.arange(b["key"].shape[-2], device=q.device)[None, :]
                                               <= rows[:, None], shape, -2)
    if mask is not None and positions(mask) is None and mask.dim() >= 2 and mask.shape[-2] != 1:
        b["attn_mask"] = localize(mode, mask, shape, -2)
    elif mask is not None and positions(mask) is not None and positions(mask)[0] != shape:
        raise refuse("its mask holds an image's positions other than its queries'")
    out = func(**{n: b[n] for n in SDPA_NAMES if n in b})
    mode.note_attention(AttentionNote("local"))
    return mark_positions(out, shape, -2)


def over_positions(inner):
    """The positions rule of ``F.scaled_dot_product_attention``: ``sdpa_over_positions`` when k and v hold an
    image's flattened positions in their sequence dim (-2) (the queries too, or whole queries);
    ``_local_queries`` when only the queries do; else ``inner`` (window attention, whose windows are a batch
    dim: ``bigconv.ops.windows``). ``bigconv.ops.table`` puts it in place of ``inner``."""

    def rule(mode: RuleContext, func, args, kwargs):
        b = bind(("query", "key", "value"), args, kwargs)
        tensors = (b["query"], b["key"], b["value"])
        seq = [positions(t) is not None and positions(t)[1] % t.dim() == t.dim() - 2 for t in tensors]
        if not any(seq):  # positions in a batch dim: window attention
            return inner(mode, func, args, kwargs)
        return sdpa_positions(mode, func, args, kwargs)

    return rule


def sdpa_positions(mode: RuleContext, func, args, kwargs):
    """SDPA with an image's flattened positions in the sequence dim (-2) of some of q, k, v (``over_positions``)."""
    b = bind(("query", "key", "value"), args, kwargs)
    tensors = (b["query"], b["key"], b["value"])
    marks = [positions(t) for t in tensors]
    seq = [m is not None and m[1] % t.dim() == t.dim() - 2 for m, t in zip(marks, tensors)]
    if any(m is not None and not s for m, s in zip(marks, seq)):
        raise mode.unsupported(func, "its query, key and value hold an image's positions in different dims (some in "
                               "the sequence dim, some in a batch dim)", FIX)
    if any(global_shape(t) is not None for t in tensors):
        raise mode.unsupported(func, "it joins flattened positions with a sharded map", FIX)
    if seq[1] != seq[2]:
        raise mode.unsupported(func, "only one of its key and value holds an image's positions (keys and values "
                               "must both be split, or both whole)", FIX)
    images = {(tuple(m[0]), prefix(m[0])) for m in marks if m is not None}
    if len(images) != 1 or (seq[1] and marks[1][0] != marks[2][0]):
        raise mode.unsupported(func, "its query, key and value come from images of different shapes", FIX)
    if not seq[1]:  # split queries over whole keys and values

        def refuse_local(reason):
            return mode.unsupported(func, f"its queries are an image's flattened positions over whole keys and values, "
                                    f"and {reason}", FIX)

        return _local_queries(mode, func, args, kwargs, refuse_local)
    if not seq[0]:  # whole queries (a pooling head's latents, the same on every shard) over split tokens

        def refuse_whole(reason):
            return mode.unsupported(func, f"its whole queries attend over an image's flattened positions and "
                                    f"{reason}", FIX)

        return sdpa_over_positions(mode, func, args, kwargs, refuse_whole, whole_queries=True)

    def refuse(reason):
        return mode.unsupported(func, f"it attends over an image's flattened positions and {reason}", FIX)

    return sdpa_over_positions(mode, func, args, kwargs, refuse)


# -- a 1D map's positions are its sequence ---------------------------------------------------------------
def _sdpa_map(mode: RuleContext, func, args, kwargs):
    """``F.scaled_dot_product_attention`` given sharded maps: on a 1D grid whose map holds its positions in the
    sequence dim (-2; ``x.transpose(1, 2)`` of ``(N, C, L)``), a shard's positions are a run of the sequence in
    one process's order, so they are flattened positions as they are: the rule of ``sdpa_positions``, the
    output a map again. A map of more dims in the sequence dim would be attention along one axis: refused."""
    b = bind(SDPA_NAMES, args, kwargs)
    names = [n for n in ("query", "key", "value", "attn_mask") if global_shape(b.get(n)) is not None]
    layouts = {tuple(mode.layout(b[n])) for n in names}
    if mode.dims != 1 or layouts != {(-2,)}:
        axes = "its sequence dim" if layouts <= {(-2,)} else "the sequence dim (-2) of each"
        raise mode.unsupported(
            func, f"it is given sharded {mode.dims}D maps whose spatial dims are not {axes} (attention along one "
            "axis of a map, or over its channels)", "Flatten the positions into the sequence dim first: "
            "x.flatten(2).transpose(1, 2) or x.reshape(N, C, -1).transpose(1, 2) of an (N, C, *spatial) map, "
            "then heads by reshape/permute of the other dims")
    shape = mode.one_shape(func, [b[n] for n in names])
    for n in names:
        b[n] = mark_positions(b[n].view_as(b[n]), shape, -2)
    out = sdpa_positions(mode, func, (), {n: b[n] for n in SDPA_NAMES if n in b})
    if isinstance(out, torch.Tensor) and positions(out) is not None:
        out = mark(_unmark_positions(out), shape, (-2,))
    return out


def _unmark_positions(t: torch.Tensor) -> torch.Tensor:
    t.__dict__.pop(POSITIONS_ATTR, None)
    t.__dict__.pop(GATHER_ATTR, None)
    return t


RULES: dict = {F.scaled_dot_product_attention: _sdpa_map}
"""SDPA given sharded maps (a 1D map's positions); over flattened positions: ``over_positions``, placed by
``bigconv.ops.table`` among the positions' rules."""
WHOLE_RULES: dict = {}
LAYOUT_AWARE: set = {F.scaled_dot_product_attention}  # a 1D map's positions in the sequence dim
PROPERTY_RULES: dict = {}
