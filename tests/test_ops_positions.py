"""Reductions over an image's positions flattened into one dim, against a single process in float64.

``x.flatten(2)``, ``x.reshape(N, C, -1)`` and ``x.view(N, C, H * W)`` give each shard its own
positions; softmax over them (global max and log-sum-exp), sums, means, maxima, and ``matmul``/
``bmm``/``einsum`` contracting them must equal one process: forward, input and parameter gradients,
losses and every weight after two SGD-momentum steps, to 1e-9, on uneven shards. Anything else done
to positions made by ``reshape``/``view`` is refused in the dry run, before any remote work; after
``flatten`` it gathers them whole, as ``flatten`` always did (exact, but the whole map per worker).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from verdicts import assert_exact

import bigconv
from bigconv.verify import compare_training

TOL = 1e-9


def gc_matmul(x, attn):
    """timm's GlobalContext: softmax over positions, then a matmul contracting them."""
    b, c, h, w = x.shape
    attn = attn.reshape(b, 1, h * w)
    attn = torch.softmax(attn, dim=-1).unsqueeze(3)
    return (x.reshape(b, c, h * w).unsqueeze(1) @ attn).view(b, c)


def einsum_pool(x, attn):
    w = attn.flatten(2).softmax(-1)
    return torch.einsum("bcp,bkp->bck", x.flatten(2), w).flatten(1)


def bmm_pool(x, attn):
    b, c, h, w = x.shape
    weights = torch.log_softmax(attn.view(b, 1, h * w), dim=2).exp()
    return torch.bmm(x.view(b, c, h * w), weights.transpose(1, 2)).squeeze(-1)


def statistics(x, attn):
    flat = x.flatten(2)
    a = attn.flatten(2)
    return (flat.sum(-1) + flat.mean(dim=2) + flat.amax(-1) - flat.amin(-1, keepdim=True).squeeze(-1)
            + torch.logsumexp(flat, dim=-1) + (flat * flat).mean(-1) + (torch.sigmoid(a) * flat).sum(-1)
            + torch.max(flat, dim=1).values.mean(-1, keepdim=True))


def positions_as_rows(x, attn):
    """Positions as rows of a matrix times an ordinary one (per position), then a mean over them."""
    b, c, h, w = x.shape
    rows = x.reshape(b, c, -1).permute(0, 2, 1)  # (b, P, c)
    mixed = torch.relu(rows @ torch.linspace(-1, 1, c * c, dtype=x.dtype).view(c, c))
    return mixed.mean(1) + (log_softmax_weighted(x))


def log_softmax_weighted(x):
    flat = x.flatten(2)
    return (torch.log_softmax(flat, -1) * flat).sum(-1)


POOLS = {"gc_matmul": gc_matmul, "einsum": einsum_pool, "bmm": bmm_pool, "statistics": statistics,
         "rows": positions_as_rows}


class AttentionPool(nn.Module):
    """Convolutions, a pool over positions, a linear head (one label per image)."""

    def __init__(self, pool) -> None:
        super().__init__()
        self.pool = pool
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.attn = nn.Conv2d(4, 1, 1)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        y = torch.relu(self.conv(x))
        return self.fc(self.pool(y, self.attn(y)))


class GlobalContextGate(nn.Module):
    """A global-context block gating the map it pooled (dense output): the context's gradient
    reaches every position of every shard."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.attn = nn.Conv2d(4, 1, 1)
        self.mlp = nn.Linear(4, 4)
        self.head = nn.Conv2d(4, 3, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        ctx = gc_matmul(y, self.attn(y))
        return self.head(y * torch.sigmoid(self.mlp(ctx))[:, :, None, None])


@pytest.mark.world(3)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(POOLS))
def test_pool_over_positions_exact(world, name):
    torch.manual_seed(0)
    x = torch.randn(2, 1, 13, 11, dtype=torch.float64)
    y = torch.tensor([0, 2])
    r = compare_training(AttentionPool(POOLS[name]).double(), world, x, y, nn.CrossEntropyLoss(), grid=(3, 1))
    assert_exact(r, TOL)


@pytest.mark.world(4)
@pytest.mark.timeout(300)
def test_global_context_gate_exact_on_2d_grid(world):
    torch.manual_seed(0)
    x = torch.randn(2, 1, 11, 14, dtype=torch.float64)
    y = torch.randint(0, 3, (2, 11, 14))
    r = compare_training(GlobalContextGate().double(), world, x, y, nn.CrossEntropyLoss(), grid=(2, 2))
    assert_exact(r, TOL)


class AfterFlatten(nn.Module):
    def __init__(self, then) -> None:
        super().__init__()
        self.then = then
        self.conv = nn.Conv2d(1, 4, 3, padding=1)

    def forward(self, x):
        return self.then(self.conv(x))


def flat(y):
    """Positions by reshape: anything but per-position math and reductions over them is refused."""
    return y.reshape(y.shape[0], y.shape[1], -1)


REFUSED = {
    "attention_between_positions": (lambda y: (flat(y).transpose(1, 2) @ flat(y)).sum(),
                                    ["matmul", "does not contract"]),
    "unflatten": (lambda y: flat(y).softmax(-1).view_as(y), ["view_as", "reductions over them"]),
    "index_a_position": (lambda y: flat(y)[:, :, 0], ["__getitem__", "flattened"]),
    "linear_over_positions": (lambda y: nn.functional.linear(flat(y), torch.ones(3, 256, dtype=y.dtype)),
                              ["linear"]),
    "returned": (lambda y: flat(y), ["cannot return"]),
    "returned_after_flatten": (lambda y: y.flatten(2) * 2, ["cannot return"]),
    # An operand as long as the positions is cut to this shard's part (a ViT's position embedding, exact in
    # tests/test_ring_attention.py), so only the return of positions is refused here
    "operand_as_long_as_positions": (lambda y: flat(y) * torch.ones(256, dtype=y.dtype), ["cannot return"]),
    "with_the_map": (lambda y: (flat(y).unsqueeze(-1) + y).sum(), ["mixes them with a sharded map"]),
    "flatten_then_unflatten": (lambda y: y.flatten(2).softmax(-1).view_as(y), ["view_as", "'<root>'"]),
}


class GatheredAfterFlatten(nn.Module):
    """What ``flatten`` always allowed: positions gathered whole when no reduction follows
    (attention between positions as smp's MAnet, a per-position MLP and a reshape back as
    Segformer's decoder). Exact, at the cost of the whole map on every worker."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.mlp = nn.Linear(4, 4)
        self.head = nn.Conv2d(4, 3, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        b, c, h, w = y.shape
        q = y.flatten(2)
        att = torch.softmax(torch.bmm(q.transpose(1, 2), q), dim=-1)  # (b, P, P): between positions
        mixed = self.mlp(torch.bmm(q, att).transpose(1, 2))  # (b, P, c)
        return self.head(y + mixed.transpose(1, 2).reshape(b, c, h, w))


@pytest.mark.world(4)
@pytest.mark.timeout(300)
def test_flatten_without_reduction_gathers_whole_exactly(world):
    torch.manual_seed(0)
    x = torch.randn(2, 1, 9, 7, dtype=torch.float64)
    y = torch.randint(0, 3, (2, 9, 7))
    r = compare_training(GatheredAfterFlatten().double(), world, x, y, nn.CrossEntropyLoss(), grid=(2, 2))
    assert_exact(r, TOL)


@pytest.mark.world(4)
@pytest.mark.parametrize("name", list(REFUSED))
def test_anything_else_after_flatten_refused_before_remote_work(world, name, monkeypatch):
    then, words = REFUSED[name]
    net = bigconv.parallelize(AfterFlatten(then).double(), world, grid=(2, 2))
    monkeypatch.setattr(net, "_launch", lambda *_: pytest.fail("remote work started"))
    with pytest.raises(ValueError) as info:
        net(torch.randn(2, 1, 16, 16, dtype=torch.float64))
    for word in words:
        assert word in str(info.value), info.value
