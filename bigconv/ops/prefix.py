"""Whole tokens in front of an image's flattened positions: a ViT's class (and register) tokens.

timm's ``VisionTransformer`` joins its class token before the patch tokens (``torch.cat([cls_token.expand(B,
-1, -1), x], dim=1)``), adds a position embedding with a row for it, runs its blocks over all tokens and
reads the class token (``x[:, 0]``) into its head. The patch tokens are an image's flattened positions,
split over the shards (``bigconv.ops.positions``); the class token is one token, held whole on every shard
in front of that shard's positions (``shards.Prefixed``: the dim holds ``prefix`` whole tokens, then the
shard's own). Per-position math runs on it redundantly, identically on every shard; attention
(``bigconv.ops.global_attention``) lets every shard's queries see the whole tokens' keys once and every
shard's block by the ring, and computes the whole tokens' own output in one fixed block order, so every
shard holds the same class token.

Gradients: a whole token's cotangent on a shard is that shard's *part*, and the parts summed over the
shards are the one-process cotangent, as for the replicated head after a global pool (whose loss
gradient lives on shard 0 only). Each rule below is linear in the cotangents, so the convention holds
through the blocks: a weight's gradient is summed over the shards by the engine, which counts each
whole token's contribution once.

Rules here: ``torch.cat`` of ordinary tokens before positions (``cat``), and indexing the whole tokens
(``x[:, 0]``: an ordinary tensor) or slicing them off (``x[:, 1:]``: the plain positions) (``getitem``,
around the positions' own rule); ``F.normalize`` over the tokens refused (``not_over_whole``). In
``bigconv.ops.positions``: sums and means over the tokens count the whole ones once; softmax, max,
logsumexp and contractions over them refuse (tokens made by ``flatten`` are then gathered whole, the
whole tokens in front, once); reshapes back into a map refuse.
"""

from __future__ import annotations

import torch

from .context import RuleContext
from .shards import Prefixed, bind, global_shape, lead, mark_positions, positions, prefix, trail

FIX = ("Join whole tokens (a class token) only in front of a ViT's patch tokens, along their dim (torch.cat([cls, "
       "x], dim=1)), and read them back by x[:, 0] or drop them by x[:, n:]")


def _refuse(mode: RuleContext, func, reason: str):
    return mode.unsupported(func, f"it acts on an image's positions flattened into one dim with whole tokens in "
                            f"front, and {reason}", FIX)


def _cat(mode: RuleContext, func, args, kwargs):
    """``torch.cat([tokens..., x], dim)`` along ``x``'s positions: the tokens (ordinary tensors, the same
    on every shard) go in front of this shard's positions, marked as whole tokens (``Prefixed``)."""
    b = bind(("tensors", "dim"), args, kwargs)
    tensors, dim = list(b["tensors"]), b.get("dim", 0)
    flat = [t for t in tensors if positions(t) is not None]
    if len(flat) != 1 or positions(tensors[-1]) is None:
        raise _refuse(mode, func, "it joins them other than ordinary tokens in front of one tensor of positions")
    x = tensors[-1]
    shape, pos = positions(x)
    if dim % x.dim() != pos % x.dim():
        raise _refuse(mode, func, "it joins along another dim than the positions")
    if lead(shape) * trail(shape) != 1:  # windows merged with whole items (bigconv.ops.windows)
        raise _refuse(mode, func, "its positions are windows merged with other dims")
    tokens = tensors[:-1]
    if any(not isinstance(t, torch.Tensor) or global_shape(t) is not None or t.dim() != x.dim() for t in tokens):
        raise _refuse(mode, func, "a tensor in front is not an ordinary tensor of tokens")
    added = sum(t.shape[pos] for t in tokens)
    out = torch.cat([*tokens, x], dim)
    return mark_positions(out, Prefixed(tuple(shape), prefix(shape) + added), pos % x.dim() - x.dim())


def _whole_slice(x: torch.Tensor, index, pos: int):
    """``index`` with a slice ``0:`` (or ``::1``) of the positions' dim written ``:``."""
    if not isinstance(index, tuple):
        index = (index,)
    if Ellipsis in index or len(index) <= pos:
        return index
    i = index[pos]
    if isinstance(i, slice) and i.start in (None, 0) and i.stop is None and i.step in (None, 1):
        return index[:pos] + (slice(None),) + index[pos + 1:]
    return index


def getitem(inner):
    """``x[index]`` of positions behind whole tokens: an int or slice within the whole tokens gives an
    ordinary tensor (the class token, the same on every shard); a slice from the last whole token on
    gives the plain positions; anything else, or no index on the positions, goes to ``inner``."""

    def rule(mode: RuleContext, func, args, kwargs):
        x, index = args[0], args[1]
        mark = positions(x)
        if mark is not None and not prefix(mark[0]):  # x[:, 0:] (timm's x[:, num_prefix_tokens:] without any)
            whole = _whole_slice(x, index, mark[1] % x.dim())
            return inner(mode, func, (x, whole) + tuple(args[2:]), kwargs)
        if mark is None or not prefix(mark[0]):
            return inner(mode, func, args, kwargs)
        shape, pos = mark[0], mark[1] % x.dim()
        index = index if isinstance(index, tuple) else (index,)
        if Ellipsis in index:
            at = index.index(Ellipsis)
            index = index[:at] + (slice(None),) * (x.dim() - len(index) + 1) + index[at + 1:]
        index = index + (slice(None),) * (x.dim() - len(index))
        if any(i is None or not isinstance(i, (int, slice)) for i in index) or index[pos] == slice(None):
            return inner(mode, func, args, kwargs)
        p, i = prefix(shape), index[pos]
        ints_before = sum(isinstance(j, int) for j in index[:pos])
        if isinstance(i, int):
            if not 0 <= i < p:
                raise _refuse(mode, func, f"it indexes position {i}, not one of the {p} whole token(s) in front")
            return x[index]
        if i.step not in (None, 1) or (i.start or 0) < 0 or (i.stop is not None and i.stop < 0):
            raise _refuse(mode, func, f"it slices them by {i} (steps and negative bounds are each shard's own)")
        start = i.start or 0
        if i.stop is not None and i.stop <= p:  # within the whole tokens: ordinary tokens
            return x[index]
        if i.stop is not None or start > p:
            raise _refuse(mode, func, f"it slices them by {i}, cutting into the image's positions")
        out = x[index]
        rest = tuple(shape) if start == p else Prefixed(tuple(shape), p - start)
        return mark_positions(out, rest, pos - ints_before - out.dim())

    return rule


def joining(inner):
    """``torch.cat`` along the dim of an operand's positions: whole tokens joined in front (``_cat``); along
    another dim (HIPT's class token beside each window's tokens, the windows in the batch): ``inner``,
    ``bigconv.ops.windows``'s rule."""

    def rule(mode: RuleContext, func, args, kwargs):
        b = bind(("tensors", "dim"), args, kwargs)
        dim = b.get("dim", 0)
        along = [t for t in b["tensors"] if isinstance(t, torch.Tensor) and positions(t) is not None
                 and isinstance(dim, int) and dim % t.dim() == positions(t)[1] % t.dim()]
        return (_cat if along else inner)(mode, func, args, kwargs)

    return rule


def not_over_whole(inner, dim_at: int, default: int):
    """``inner`` (a rule of ``bigconv.ops.windows``, ``F.normalize``'s: a sum over the positions on every
    shard) refused when it reduces over positions behind whole tokens, which each shard would count once;
    the call's ``dim`` is its argument ``dim_at`` (``default`` when not given)."""

    def rule(mode: RuleContext, func, args, kwargs):
        x = args[0] if args else kwargs.get("input")
        mark = positions(x)
        dim = args[dim_at] if len(args) > dim_at else kwargs.get("dim", default)
        if mark is not None and prefix(mark[0]) and isinstance(dim, int) and dim % x.dim() == mark[1] % x.dim():
            raise _refuse(mode, func, "it reduces over them, which each shard would count the whole tokens in")
        return inner(mode, func, args, kwargs)

    return rule


RULES: dict = {}
WHOLE_RULES: dict = {}
LAYOUT_AWARE: set = set()
PROPERTY_RULES: dict = {}
POSITION_RULES: dict = {}
"""Rules for calls given flattened positions (merged with ``bigconv.ops.positions``'s by ``bigconv.ops.table``);
``torch.cat`` is not here but wraps ``bigconv.ops.windows``'s (``joining``): one function, one rule."""
