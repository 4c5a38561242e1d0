"""Global attention over every position of a sharded map, exact on shards: ring passes or a gather.

``softmax(scale * q kᵀ + bias) v`` whose keys span all positions of an image cannot be cut by
positions: every query reads every key. Two exact ways, both here:

- **ring** (the default): each shard keeps its queries and sends its block of keys and values
  round the shards in worker order, ``P - 1`` passes; each shard folds every block it sees into a
  running maximum, sum of exponentials and weighted sum of values (the online softmax of ring and
  flash attention), and divides once at the end. Its backward (``_RingAttention.backward``) runs
  the ring again from the saved log-sum-exp, the blocks' key and value gradients travelling with
  them, and one more pass takes them home: ``P`` passes. A shard holds its own keys plus one block
  in flight and a ``queries x block`` score tile, never the whole image's keys.
- **gathered**: every shard gathers the whole image's keys and values (``executor.allgather``, whose
  backward returns each shard's gradient to the owners) and runs plain attention on them: one
  exchange, but ``N x d`` keys and a ``queries x N`` score matrix per shard.

Relative position embeddings (timm's botnet ``PosEmbedRel``) see *global* positions: the bias of a
query at global coordinate ``i`` and a key at ``j`` is, per spatial axis ``a``, ``q · rel_a[j_a − i_a
+ S_a − 1]``; the tables ``q @ rel_aᵀ`` (queries × ``2 S_a − 1``) are computed per shard and the bias
of each block is gathered from them by the block's global coordinates (``shard_box`` of its owner).

Whole tokens in front (a ViT's class and register tokens, the same on every shard: ``bigconv.ops.prefix``;
``RingPlan.prefix``): every shard's queries see their keys once, here, and every shard's block by the
ring; their own queries' output is combined from per-block statistics in one fixed order (theirs, then
the shards in worker order), so every shard computes the same value from the same inputs. Their
cotangents are each shard's part (summed over the shards, one process's), so their key and value
gradients stay on each shard, as parts, and are never passed round the ring.

A mask over every key (``attend``'s ``mask``): each block adds its own columns, a key's column its global
index in one process's row-major order (``RingPlan.columns``), so a relative bias or a causal mask means on
shards what it means in one process.

Entry points: ``attend_map(q, k, v, heads, scale, rel)`` (a torch-function-dispatched call, so the
``ShardMode`` sends it to ``_attend_map_rule`` when ``q`` is sharded; one process runs it as it is),
which ``install`` routes timm's ``BottleneckAttn`` to on a shard; and ``attend``, which the rules of
``F.scaled_dot_product_attention`` call (``bigconv.ops.sdpa``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
from torch.overrides import handle_torch_function, has_torch_function

from ..geometry.boxes import all_coords, index_of, shard_box
from .context import RuleContext
from .shards import ATTENTION_ATTR, bind, global_shape, mark

STRATEGY_ATTR = ATTENTION_ATTR
"""Set on a module by ``use``: ``(strategy, memory)`` for the global attention inside it."""
STRATEGIES = ("ring", "gathered", "auto")


def use(model: torch.nn.Module, strategy: str, memory: int | None = None) -> torch.nn.Module:
    """How the global attention inside ``model`` runs on shards (``model`` may be any module of a model:
    the innermost module given a setting decides for the attention it runs): ``ring`` (the default),
    ``gathered``, or ``auto`` with ``memory``: gathered where one call's gathered keys, values, scores and
    probabilities on the largest shard (``extra_bytes``) fit ``memory`` bytes, else ring. ``auto`` decides
    at each call from global sizes (the same on every shard), so the dry run makes the same choice and
    ``bigconv.check`` reports it. Returns ``model``."""
    if strategy not in STRATEGIES:
        raise ValueError(f"attention strategy {strategy!r} is not one of {STRATEGIES}")
    if (strategy == "auto") != (memory is not None):
        raise ValueError("memory= (the bytes a shard may hold for one attention call's gathered keys, values and "
                         "scores) goes with strategy 'auto', and only with it")
    if memory is not None and (isinstance(memory, bool) or not isinstance(memory, int) or memory <= 0):
        raise ValueError(f"memory={memory!r}: give a positive number of bytes (e.g. 2 * 2**30)")
    setattr(model, STRATEGY_ATTR, (strategy, memory))
    return model


def setting_in(model: torch.nn.Module, name: str):
    """The attention setting (``use``) that decides for module ``name`` of ``model``: its own or its
    innermost ancestor's; None when none was given (ring passes)."""
    modules = dict(model.named_modules())
    parts = name.split(".") if name else []
    for i in range(len(parts), -1, -1):
        setting = getattr(modules.get(".".join(parts[:i])), STRATEGY_ATTR, None)
        if setting is not None:
            return setting
    return None


def choose(setting, heads_batch: int, queries: int, total: int, block: int, dq: int, dv: int,
           itemsize: int) -> str:
    """``ring`` or ``gathered`` for one call under ``setting`` (``use``'s pair, or None), from the largest
    shard's sizes (``extra_bytes``'s arguments)."""
    strategy, memory = setting or ("ring", None)
    if strategy != "auto":
        return strategy
    need = extra_bytes("gathered", heads_batch, queries, total, block, dq, dv, itemsize)
    return "gathered" if need <= memory else "ring"


def extra_bytes(strategy: str, heads_batch: int, queries: int, total: int, block: int, dq: int, dv: int,
                itemsize: int) -> int:
    """What one shard holds for its global attention beyond its own q, k, v and output, at its peak: the ring's
    blocks in flight (sent and received, with their key and value gradients in backward) and one ``queries x
    block`` score tile with its probabilities; or the gathered form's whole keys and values and its
    ``queries x total`` scores and probabilities (both kept for backward)."""
    g = heads_batch
    if strategy == "gathered":
        return itemsize * g * (total * (dq + dv) + 2 * queries * total)
    return itemsize * g * (2 * block * 2 * (dq + dv) + 2 * queries * block)


# -- the blocks' geometry ---------------------------------------------------------------------------
def block_coords(shape: Sequence[int], grid: Sequence[int], coord: Sequence[int], device) -> list[torch.Tensor]:
    """Per spatial axis, the global coordinate of each of shard ``coord``'s positions, flattened row-major
    (the order of ``x.reshape(..., -1)`` of its part)."""
    box = shard_box(shape, grid, coord)
    axes = [torch.arange(a, b, device=device) for a, b in box]
    mesh = torch.meshgrid(*axes, indexing="ij") if len(axes) > 1 else axes
    return [m.reshape(-1) for m in mesh]


def _bias(tables: Sequence[torch.Tensor], qc: list, kc: list, shape: Sequence[int]) -> torch.Tensor | None:
    """The relative position bias of queries at ``qc`` and keys at ``kc``, from the tables ``q @ rel_aᵀ``."""
    out = None
    for t, a, b, n in zip(tables, qc, kc, shape):
        idx = (b[None, :] - a[:, None] + (n - 1)).expand(t.shape[0], -1, -1)
        term = t.gather(-1, idx)
        out = term if out is None else out + term
    return out


def flat_index(shape: Sequence[int], coords: Sequence[torch.Tensor]) -> torch.Tensor:
    """The row-major index among all of an image's positions of those at per-axis ``coords`` (the order of
    one process's ``x.reshape(..., -1)``)."""
    index = torch.zeros_like(coords[0])
    for c, n in zip(coords, shape):
        index = index * n + c
    return index


def _scores(q, k, scale, tables, qc, kc, shape, mask=None):
    """``scale q kᵀ`` plus the relative position bias and the mask's columns for these keys (``mask``: already
    cut to them, additive)."""
    s = (q @ k.transpose(-1, -2)) * scale
    bias = _bias(tables, qc, kc, shape)
    s = s if bias is None else s + bias
    return s if mask is None else s + mask


def _shift(m: torch.Tensor) -> torch.Tensor:
    """A running maximum usable as a shift: 0 where every score so far is masked (-inf), so exp(-inf - shift) is 0,
    not nan, until a key is seen."""
    return torch.where(m == -math.inf, torch.zeros_like(m), m)


class RingPlan:
    """What a ring pass needs besides tensors: who holds which block, and their coordinates."""

    def __init__(self, ctx, shape: Sequence[int], scale: float, device, prefix: int = 0,
                 whole_queries: int | None = None, lead: int = 1, trail: int = 1) -> None:
        """``ctx``: the mode (a ``RuleContext``), or anything with an ``executor``; ``prefix``: whole tokens
        (the same on every shard) in front of each shard's keys and values (``bigconv.ops.prefix``);
        ``whole_queries``: those in front of its queries (default ``prefix``; all of them for a pooling
        head's latent queries over split tokens); ``lead``, ``trail``: whole items around the positions in the
        same dim (``shards.WindowGrid``: Hiera's tokens, the offsets inside its mask units in front), so that a
        shard's block is ``lead x its positions x trail``, row-major."""
        self.ctx, self.shape, self.scale, self.prefix = ctx, tuple(shape), scale, int(prefix)
        self.lead, self.trail = int(lead), int(trail)
        self.whole_queries = self.prefix if whole_queries is None else int(whole_queries)
        self.pooled = whole_queries is not None  # every query whole (a pooling head's latents): none local
        self.grid = tuple(ctx.executor.grid)
        self.coords = list(all_coords(self.grid))
        self.index = index_of(ctx.executor.coord, self.grid)
        self.size = len(self.coords)
        self.counts = [self.lead * self.trail * math.prod(b - a for a, b in shard_box(shape, self.grid, c))
                       for c in self.coords]
        self.device = device

    def strategy(self, setting, heads_batch: int, dq: int, dv: int, itemsize: int) -> str:
        """``choose`` at the largest shard's sizes: the same answer on every shard."""
        block = max(self.counts)
        queries = self.whole_queries + (0 if self.pooled else block)
        return choose(setting, heads_batch, queries, sum(self.counts) + self.prefix, block, dq, dv, itemsize)

    def coords_of(self, j: int) -> list[torch.Tensor]:
        return block_coords(self.shape, self.grid, self.coords[j], self.device)

    def columns(self, j: int) -> torch.Tensor:
        """Where shard ``j``'s keys sit among a mask's columns (the whole tokens first, then every position of
        the image in one process's row-major order)."""
        index = flat_index(self.shape, self.coords_of(j))
        if self.lead * self.trail != 1:  # (lead, positions, trail) row-major, as the dim holds them
            items = torch.arange(self.lead, device=index.device)[:, None, None] * math.prod(self.shape)
            index = (items + index[None, :, None]) * self.trail + torch.arange(self.trail, device=index.device)
            index = index.reshape(-1)
        return self.prefix + index

    def pass_on(self, parts: list[torch.Tensor], src: int, widths: list[int]) -> list[torch.Tensor]:
        """Send ``parts`` (the block of shard ``src``) to the next shard; the previous shard's block (of
        shard ``src - 1``) arrives, cut into parts of ``widths`` features per position."""
        new = (src - 1) % self.size
        lead = parts[0].shape[0]
        flat = torch.cat([p.reshape(-1) for p in parts])
        n = self.counts[new]
        got = self.ctx.executor.ring(flat, (lead * n * sum(widths),), "ring attention block")
        out, at = [], 0
        for w in widths:
            out.append(got[at:at + lead * n * w].view(lead, n, w))
            at += lead * n * w
        return out


class _Online:
    """The online softmax of a set of queries over blocks of keys: running maximum, sum of exponentials and
    weighted sum of values, folded block by block."""

    def __init__(self) -> None:
        self.top = self.total = self.acc = None

    def fold(self, s: torch.Tensor, vb: torch.Tensor) -> None:
        m = s.amax(-1, keepdim=True)
        if self.top is None:
            self.top = m
            p = torch.exp(s - _shift(m))
            self.total, self.acc = p.sum(-1, keepdim=True), p @ vb
            return
        new = torch.maximum(self.top, m)
        shift = _shift(new)
        fix, p = torch.exp(self.top - shift), torch.exp(s - shift)
        self.total = self.total * fix + p.sum(-1, keepdim=True)
        self.acc = self.acc * fix + p @ vb
        self.top = new

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The output and the log-sum-exp."""
        return self.acc / self.total, self.top + torch.log(self.total)


def _in_order(stats: list[tuple]) -> tuple[torch.Tensor, torch.Tensor]:
    """The output and log-sum-exp of queries from their ``(max, sum, weighted sum)`` per block, combined in
    the order given: the same on every shard when every shard gives the blocks in one order."""
    top = functools.reduce(torch.maximum, [m for m, _, _ in stats])
    shift = _shift(top)
    total = acc = None
    for m, t, a in stats:
        fix = torch.exp(m - shift)
        total = t * fix if total is None else total + t * fix
        acc = a * fix if acc is None else acc + a * fix
    return acc / total, shift + torch.log(total)


def _block_stats(s: torch.Tensor, vb: torch.Tensor) -> tuple:
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - _shift(m))
    return m, p.sum(-1, keepdim=True), p @ vb


class _RingAttention(torch.autograd.Function):
    """Exact attention of this shard's queries over every shard's keys by ring passes (module doc).

    With whole tokens in front (``plan.prefix``, a ViT's class token, the same on every shard): every query
    sees their keys once, here, besides the ring's blocks; their own queries' output is combined from
    per-block statistics in one fixed order (the whole tokens' block, then the shards in worker order), so
    every shard computes the same class token. Their key and value gradients stay here: each shard's part
    (its own queries', and the whole queries' with this shard's part of their cotangent).

    ``mask``: None, or an additive bias ``(G, Nq, columns)`` over every key in one process's order (the whole
    tokens', then the image's positions row-major: ``RingPlan.columns``); each block adds its own columns, and
    its gradient is each block's score gradient put back in those columns."""

    @staticmethod
    def forward(ctx, plan: RingPlan, q, k, v, mask, *tables):
        n, nq = plan.prefix, plan.whole_queries
        qc = plan.coords_of(plan.index)
        # contiguous: the whole tokens' products then run the same kernel on every shard, whoever's block
        ql, qp = q[:, nq:], q[:, :nq].contiguous()
        ml, mp = (None, None) if mask is None else (mask[:, nq:], mask[:, :nq])
        kb, vb, src = k[:, n:].contiguous(), v[:, n:].contiguous(), plan.index
        local, whole = _Online(), {}
        if n:
            kp, vp = k[:, :n].contiguous(), v[:, :n].contiguous()
            local.fold(_plus((ql @ kp.transpose(-1, -2)) * plan.scale, ml, slice(0, n)), vp)
            if nq:
                whole[-1] = _block_stats(_plus((qp @ kp.transpose(-1, -2)) * plan.scale, mp, slice(0, n)), vp)
        for step in range(plan.size):
            kc = plan.coords_of(src)
            cols = plan.columns(src) if mask is not None else None
            local.fold(_scores(ql, kb, plan.scale, tables, qc, kc, plan.shape, _cols(ml, cols)), vb)
            if nq:
                whole[src] = _block_stats(_plus((qp @ kb.transpose(-1, -2)) * plan.scale, mp, cols), vb)
            if step < plan.size - 1:
                kb, vb = plan.pass_on([kb, vb], src, [k.shape[-1], v.shape[-1]])
                src = (src - 1) % plan.size
        out, lse = local.result()
        if nq:
            out_p, lse_p = _in_order([whole[j] for j in range(-1 if n else 0, plan.size)])
            out, lse = torch.cat([out_p, out], 1), torch.cat([lse_p, lse], 1)
        ctx.plan = plan
        ctx.save_for_backward(q, k, v, out, lse, mask, *tables)
        return out

    @staticmethod
    def backward(ctx, dout):
        plan: RingPlan = ctx.plan
        q, k, v, out, lse, mask, *tables = ctx.saved_tensors
        n = plan.prefix
        qc = plan.coords_of(plan.index)
        dout = dout.contiguous()
        delta = (dout * out).sum(-1, keepdim=True)
        dq = torch.zeros_like(q)
        dtables = [torch.zeros_like(t) for t in tables]
        dmask = torch.zeros(mask.shape, dtype=mask.dtype, device=mask.device) if mask is not None else None
        kb, vb, src = k[:, n:], v[:, n:], plan.index
        dk, dv = torch.zeros_like(kb), torch.zeros_like(vb)
        if n:  # the whole tokens' keys, seen by every query here
            kp, vp = k[:, :n], v[:, :n]
            p = torch.exp(_plus((q @ kp.transpose(-1, -2)) * plan.scale, mask, slice(0, n)) - lse)
            dvp = p.transpose(-1, -2) @ dout
            ds = p * (dout @ vp.transpose(-1, -2) - delta)
            dq = dq + (ds @ kp) * plan.scale
            dkp = (ds.transpose(-1, -2) @ q) * plan.scale
            if dmask is not None:
                dmask[..., :n] = ds
            del p, ds
        widths = [k.shape[-1], v.shape[-1], k.shape[-1], v.shape[-1]]
        for step in range(plan.size):
            kc = plan.coords_of(src)
            cols = plan.columns(src) if mask is not None else None
            p = torch.exp(_scores(q, kb, plan.scale, tables, qc, kc, plan.shape, _cols(mask, cols)) - lse)
            dv = dv + p.transpose(-1, -2) @ dout
            ds = p * (dout @ vb.transpose(-1, -2) - delta)
            del p
            dq = dq + (ds @ kb) * plan.scale
            dk = dk + (ds.transpose(-1, -2) @ q) * plan.scale
            for dt, a, b, m in zip(dtables, qc, kc, plan.shape):
                dt.scatter_add_(-1, (b[None, :] - a[:, None] + (m - 1)).expand(ds.shape[0], -1, -1), ds)
            if dmask is not None:
                dmask[..., cols] = ds  # every column is one block's: set once
            del ds
            if step < plan.size - 1:  # the block moves on with its gradients so far
                kb, vb, dk, dv = plan.pass_on([kb, vb, dk, dv], src, widths)
                src = (src - 1) % plan.size
        if plan.size > 1:  # the block here is the next shard's: its gradients go home, one more pass
            dk, dv = plan.pass_on([dk, dv], src, widths[2:])
        if n:
            dk, dv = torch.cat([dkp, dk], 1), torch.cat([dvp, dv], 1)
        return (None, dq, dk, dv, dmask, *dtables)


def _cols(mask, cols):
    """The mask's columns ``cols`` (None without a mask)."""
    return None if mask is None else mask[..., cols]


def _plus(s, mask, cols):
    """Scores plus the mask's columns ``cols`` (as they are without a mask)."""
    return s if mask is None else s + mask[..., cols]


def _gathered(plan: RingPlan, q, k, v, tables, mask=None):
    """Every shard's keys and values gathered (differentiably), then plain attention; whole tokens' keys (a
    class token's, the same on every shard) in front, once; the mask's columns in that order."""
    n = plan.prefix
    kv = torch.cat([k[:, n:], v[:, n:]], -1)
    parts = plan.ctx.executor.allgather(kv, "keys and values of global attention",
                         [(kv.shape[0], m, kv.shape[-1]) for m in plan.counts])
    whole = torch.cat(parts, 1)
    ks, vs = whole[..., :k.shape[-1]], whole[..., k.shape[-1]:]
    if n:
        ks, vs = torch.cat([k[:, :n], ks], 1), torch.cat([v[:, :n], vs], 1)
    kc = [torch.cat(c) for c in zip(*(plan.coords_of(j) for j in range(plan.size)))]
    if mask is not None:
        cols = torch.cat([torch.arange(n, device=mask.device)] + [plan.columns(j) for j in range(plan.size)])
        mask = mask[..., cols]
    s = _scores(q, ks, plan.scale, tables, plan.coords_of(plan.index), kc, plan.shape, mask)
    return torch.softmax(s, -1) @ vs


def attend(plan: RingPlan, q, k, v, tables=(), strategy: str | None = None, setting=None,
           mask: torch.Tensor | None = None) -> torch.Tensor:
    """``softmax(scale q kᵀ + bias + mask) v`` of this shard's queries ``(G, Nq, d)`` over every shard's keys;
    ``mask``: None or an additive ``(G, Nq, columns)`` over every key in one process's order
    (``RingPlan.columns``); ``strategy`` None: chosen under ``setting`` (``use``'s, which the rules read off
    the mode), ring without."""
    if strategy is None:
        strategy = plan.strategy(setting, q.shape[0], q.shape[-1], v.shape[-1], q.element_size())
    if strategy == "gathered" or not plan.ctx.executor.ring_passes:  # the rpc transport: gathered (ring_in_backward)
        return _gathered(plan, q, k, v, tables, mask)
    return _RingAttention.apply(plan, q, k, v, mask, *tables)


# -- a map's attention: timm BottleneckAttn ---------------------------------------------------------
def attend_map(q, k, v, heads: int, scale: float, rel: Sequence[torch.Tensor] = (), scale_rel: bool = False,
               strategy: str | None = None):
    """Multi-head attention over every position of maps ``q``, ``k``, ``v`` of shape ``(B, heads * d,
    *spatial)``, with relative position tables ``rel`` (one ``(2 S_a - 1, d)`` per spatial axis, timm's
    ``PosEmbedRel``; ``scale_rel``: scale them with the keys' logits). Returns ``(B, heads * dv,
    *spatial)``. On shards, the ``ShardMode`` sends this call to ``_attend_map_rule``."""
    tensors = (q, k, v, *rel)
    if has_torch_function(tensors):
        return handle_torch_function(attend_map, tensors, q, k, v, heads, scale, rel, scale_rel, strategy)
    shape = tuple(q.shape[2:])
    return _map_attention(Alone(len(shape)), q, k, v, heads, scale, rel, scale_rel, strategy, shape)


def _map_attention(ctx, q, k, v, heads, scale, rel, scale_rel, strategy, shape, setting=None):
    b, spatial = q.shape[0], tuple(q.shape[2:])
    g = b * heads

    def flat(t):
        return t.reshape(g, t.shape[1] // heads, -1).transpose(-1, -2)

    qf, kf, vf = flat(q), flat(k), flat(v)
    tables = [qf @ r.transpose(-1, -2) for r in rel]
    if scale_rel:
        tables = [t * scale for t in tables]
    plan = RingPlan(ctx, shape, scale, q.device)
    out = attend(plan, qf, kf, vf, tables, strategy, setting)
    return out.transpose(-1, -2).reshape(b, -1, *spatial)


class OneShard:
    """One process's executor: a grid of one shard, no exchange."""

    ring_passes = True

    def __init__(self, dims: int) -> None:
        self.grid, self.coord = (1,) * dims, (0,) * dims

    def ring(self, x, arriving, what=""):
        return x

    def allgather(self, partial, what="", shapes=None):
        return [partial]


class Alone:
    """One process's stand-in for the mode: what ``RingPlan`` reads of it."""

    def __init__(self, dims: int) -> None:
        self.executor = OneShard(dims)


def _attend_map_rule(mode: RuleContext, func, args, kwargs):
    b = bind(("q", "k", "v", "heads", "scale", "rel", "scale_rel", "strategy"), args, kwargs)
    q, k, v = b["q"], b["k"], b["v"]
    shape = mode.one_shape(func, [q, k, v])
    if any(global_shape(t) is None for t in (q, k, v)):
        raise mode.unsupported(func, "its query, key and value are not all sharded maps", FIX)
    out = _map_attention(mode, q, k, v, b["heads"], b["scale"], b.get("rel", ()), b.get("scale_rel", False),
                         b.get("strategy"), shape, mode.attention_setting())
    return mark(out, shape)


FIX = ("Global attention is split for timm's BottleneckAttn and for F.scaled_dot_product_attention whose sequence "
       "dim (-2) holds an image's flattened positions (x.flatten(2).transpose(1, 2) or x.reshape(N, C, -1)"
       ".transpose(1, 2); a 1D map's own positions need no flattening) in the queries, or the keys and values, or "
       "all three, with no dropout; a mask or bias may span every key in one process's order")


# -- timm BottleneckAttn on a shard -------------------------------------------------------------------
def is_bottleneck(module: torch.nn.Module) -> bool:
    """timm's ``BottleneckAttn`` (botnet): known by its parts, so timm need not be imported."""
    return (type(module).__name__ == "BottleneckAttn" and hasattr(module, "qkv")
            and hasattr(getattr(module, "pos_embed", None), "height_rel"))


def install(model: torch.nn.Module) -> None:
    """On a shard's copy of ``model``: timm ``BottleneckAttn`` modules run ``attend_map`` (ring passes by
    default); a module held whole (``bigconv.hold_whole``) keeps its own forward."""
    for m in model.modules():
        if is_bottleneck(m) and not getattr(m, "_bigconv_hold_whole", False):
            m.forward = functools.partial(_bottleneck_forward, m)


def _bottleneck_forward(m, x):
    """timm's forward, its attention by ``attend_map``; on a whole map too (replicated, or the dry run's
    one-process shape check), so that every copy calls the same submodules."""
    _, _, h, w = x.shape  # global sizes, answered by the mode
    if (h, w) != (m.pos_embed.height, m.pos_embed.width):
        raise ValueError(f"{type(m).__name__} was built for a {m.pos_embed.height}x{m.pos_embed.width} map but got "
                         f"{h}x{w} (the global map); build it with feat_size=({h}, {w})")
    y = m.qkv(x)
    q, k, v = torch.split(y, [m.dim_out_qk, m.dim_out_qk, m.dim_out_v], dim=1)
    rel = (m.pos_embed.height_rel, m.pos_embed.width_rel)
    out = attend_map(q, k, v, m.num_heads, m.scale, rel, m.scale_pos_embed)  # strategy: the path's setting (use)
    return m.pool(out)


RULES: dict = {attend_map: _attend_map_rule}
WHOLE_RULES: dict = {}
LAYOUT_AWARE: set = set()
PROPERTY_RULES: dict = {}
