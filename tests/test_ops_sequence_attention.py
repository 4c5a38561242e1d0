"""Attention over a split sequence (issue 51, item 1): ring attention exact in every form users write it.

The contract: ``F.scaled_dot_product_attention`` whose sequence dim holds a 1D map's positions (``x.transpose(1,
2)``, ``x.reshape(b, c, -1)``, ``x.flatten(2)``, one reshape that splits the heads too) or a map's flattened
positions (one with a size-1 spatial dim too, reshaped back) runs by ring passes; whole queries (a learned latent
array) over split keys and values, and split queries over whole keys and values, are exact too; so are a causal
flag, a boolean key mask and an additive bias with a row per query, all in one process's order (every key's
column by its global index, ``RingPlan.columns``). Each model is trained on a World and in one process in float64
(the verdict of ``bigconv.verify.compare_training``: outputs, input and parameter gradients, weights after two
SGD-momentum steps, each within 1e-9 of its own size). The op itself (``attend`` with a mask) is checked against
an explicit softmax(QKᵀ·s + M)V on uneven shards, its gradients too, the mask's included. Planted errors (a mask
column off by one, a ring pass that keeps its own block) must fail. A failure points at
``bigconv.ops.global_attention`` (``_RingAttention``'s mask), ``bigconv.ops.sdpa`` (``sdpa_positions``,
``_sdpa_map``, ``_local_queries``) or at ``bigconv.ops.positions._back_to_map``.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from issue51_models import FlattenBack, SequenceSDPA, SequenceVariants
from shard_threads import forward_on_threads, on_threads, relative_error
from verdicts import assert_exact, verdict

from bigconv.geometry.boxes import all_coords
from bigconv.ops import global_attention
from bigconv.ops.global_attention import Alone, RingPlan, attend, block_coords, flat_index

TOL = 1e-12


# -- the op: a mask over every key in one process's order --------------------------------------------------
def _reference(q, k, v, mask, scale):
    """softmax(scale q kᵀ + mask) v, written out (no library attention)."""
    s = (q @ k.transpose(-1, -2)) * scale + mask
    p = torch.exp(s - s.amax(-1, keepdim=True))
    return (p / p.sum(-1, keepdim=True)) @ v


def _rows(shape, grid, coord):
    return flat_index(shape, block_coords(shape, grid, coord, "cpu"))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("strategy", ["ring", "gathered"])
@pytest.mark.parametrize("shape,grid", [((13,), (3,)), ((7, 5), (2, 2))], ids=["1d", "2d"])
def test_op_with_mask_exact(shape, grid, strategy):
    """One whole token in front and the image's positions split unevenly; an additive mask with -inf entries (one
    shard's block of keys hidden from the first rows entirely, so a ring step sees only -inf there) that requires
    grad: output and the gradients of q, k, v and the mask against the explicit reference, each within 1e-12 of its
    own size."""
    gen = torch.Generator().manual_seed(3)
    n, g, p, scale = math.prod(shape), 3, 1, 0.4
    q, k, v = (torch.randn(g, p + n, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    mask = torch.randn(g, p + n, p + n, generator=gen, dtype=torch.float64)
    last = _rows(shape, grid, list(all_coords(grid))[-1])
    mask[:, :3, p + last] = -math.inf  # rows 0-2 see nothing of the last shard's keys
    mask[:, 4, p:] = -math.inf  # row 4 sees the whole token only
    w = torch.randn(g, p + n, 4, generator=gen, dtype=torch.float64)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, mask)]
    ref = _reference(*leaves, scale)
    ref.backward(w)
    coords = list(all_coords(grid))
    shares = torch.tensor([0.6, 0.3, 0.1, 0.0][:len(coords)], dtype=torch.float64)  # the whole token's cotangent

    def run(ex, i):
        rows = torch.cat([torch.arange(p), p + _rows(shape, grid, coords[i])])
        mine = [t[:, rows].clone().requires_grad_(True) for t in (q, k, v)]
        m = mask[:, rows].clone().requires_grad_(True)
        out = attend(RingPlan(SimpleNamespace(executor=ex), shape, scale, "cpu", prefix=p), *mine, (), strategy,
                     mask=m)
        return rows, out, mine + [m]

    parts = on_threads(grid, run)
    cot = [torch.cat([shares[i] * w[:, :p], w[:, part[0][p:]]], 1) for i, part in enumerate(parts)]
    if strategy == "ring":
        on_threads(grid, lambda ex, i: parts[i][1].backward(cot[i]))
    else:
        torch.autograd.backward([part[1] for part in parts], cot)
    out = torch.zeros_like(ref)
    grads = [torch.zeros_like(t) for t in leaves]
    for rows, o, mine in parts:
        out[:, rows[p:]] = o[:, p:].detach()
        out[:, :p] = o[:, :p].detach()
        for grad, leaf in zip(grads[:3], mine[:3]):
            grad[:, :p] += leaf.grad[:, :p]
            grad[:, rows[p:]] = leaf.grad[:, p:]
        grads[3][:, rows] += mine[3].grad
    assert relative_error(out, ref) <= TOL
    for name, grad, leaf in zip(["q", "k", "v", "mask"], grads, leaves):
        assert relative_error(grad, leaf.grad) <= TOL, name


@pytest.mark.timeout(60)
def test_planted_mask_column_off_by_one_fails(monkeypatch):
    """A planted error: each block reads the mask's columns one place over. The op test's comparison must fail."""
    real = RingPlan.columns
    monkeypatch.setattr(RingPlan, "columns", lambda self, j: (real(self, j) + 1) % (self.prefix + sum(self.counts)))
    with pytest.raises(AssertionError):
        test_op_with_mask_exact((7, 5), (2, 2), "ring")


def test_one_process_stand_in_matches_the_reference():
    """``Alone`` (one process's stand-in for the mode) with a mask: the explicit reference, so the op tests above
    compare against what one process computes."""
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 6, 3, generator=gen, dtype=torch.float64) for _ in range(3))
    mask = torch.randn(2, 6, 6, generator=gen, dtype=torch.float64)
    got = attend(RingPlan(Alone(1), (6,), 0.5, "cpu"), q, k, v, mask=mask)
    assert relative_error(got, _reference(q, k, v, mask, 0.5)) <= TOL


# -- models: every form of a sequence's attention ----------------------------------------------------------
def _seq(batch=2, length=37, seed=1, dense=False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 2, length, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (batch, length) if dense else (batch,), generator=gen)
    return x, y


@pytest.mark.world(3)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("out", ["pool", "map"])
@pytest.mark.parametrize("form", ["reshape", "flatten", "transpose", "heads"])
def test_sequence_sdpa_on_a_1d_map_exact(world, form, out):
    """37 positions on 3 shards (13/12/12): the docs' ``reshape(b, c, -1)``, ``flatten(2)``, the map's positions as
    they are, and one reshape that splits the heads too; pooled into a head, or the map returned."""
    torch.manual_seed(0)
    x, y = _seq(dense=out == "map")
    assert_exact(verdict(SequenceSDPA(form, out).double(), world, x, y, grid=(3,)))


@pytest.mark.world(3)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["latent", "learned-kv", "causal", "keymask", "bias"])
def test_sequence_attention_layouts_on_a_1d_map_exact(world, kind):
    """Replicated queries (a learned latent array) over the split sequence, split queries over replicated keys and
    values, a causal flag, a boolean key mask and an additive relative bias with a row per query of the whole
    sequence: each in one process's order, on 13/12/12 positions."""
    torch.manual_seed(0)
    x, y = _seq(dense=kind != "latent")
    assert_exact(verdict(SequenceVariants(kind).double(), world, x, y, grid=(3,)))


@pytest.mark.world(4)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["latent", "learned-kv", "causal", "bias"])
def test_attention_layouts_over_a_maps_positions_exact(world, kind):
    """The same layouts over a 9x7 map's flattened positions on uneven 2x2 shards: the order of a mask's rows and
    columns is one process's row-major order of the whole map, not a shard's."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 2, 9, 7, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (2,) if kind == "latent" else (2, 9, 7), generator=gen)
    assert_exact(verdict(SequenceVariants(kind, dims=2).double(), world, x, y))


@pytest.mark.world(2)
@pytest.mark.timeout(300)
def test_flatten_then_reshape_back_with_a_size_one_dim_exact(world):
    """The issue's case: ``(x.reshape(b, c, -1) * 2).reshape(b, c, 32, 1)`` on (1, 2, 32, 1), grid (2, 1), returns
    the map (it was refused as returning flattened positions); and SDPA over such a map's positions."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 2, 32, 1, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (1, 32, 1), generator=gen)
    assert_exact(verdict(FlattenBack().double(), world, x, torch.randint(0, 2, (1, 32, 1), generator=gen),
                         grid=(2, 1)))
    assert_exact(verdict(SequenceSDPA("reshape", "map", dims=2).double(), world, x, y, grid=(2, 1)))


@pytest.mark.world(4)
@pytest.mark.timeout(120)
def test_attention_along_one_axis_of_a_2d_map_refused_naming_the_flatten(refused_before_remote_work):
    """SDPA given a 2D map with its rows in the sequence dim (attention along one axis) is refused, naming the
    forms that split: flatten the positions into the sequence dim first."""

    class AxisAttention(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(1, 4, 3, padding=1)

        def forward(self, x):
            t = self.conv(x).permute(0, 3, 2, 1)  # (b, w, h, c): rows in the sequence dim
            return F.scaled_dot_product_attention(t, t, t).mean((1, 2))

    refused_before_remote_work(AxisAttention(), ["scaled_dot_product_attention", "x.flatten(2).transpose(1, 2)",
                                                 "x.reshape(N, C, -1).transpose(1, 2)"])


def test_planted_ring_pass_that_keeps_its_own_block_fails(monkeypatch):
    """A planted error: every ring pass hands back the block it was given (no keys from other shards). The
    sequence model's forward on three shards (threads, the workers' code) must then differ from one process."""
    torch.manual_seed(0)
    model = SequenceSDPA("reshape", "map").double().eval()
    x, _ = _seq()
    with torch.no_grad():
        want = model(x)
    assert relative_error(forward_on_threads(model, x, (3,)), want) <= 1e-12
    monkeypatch.setattr(global_attention.RingPlan, "pass_on", lambda self, parts, src, widths: list(parts))
    assert relative_error(forward_on_threads(model, x, (3,)), want) > 1e-3
