"""The op patterns the model zoos use around convolutions, each against a single process.

Every model here is written the way torchvision, timm, smp and MONAI write theirs: sizes read from
the input inside ``forward``, channels-last views with ``LayerNorm``/``Linear`` over channels,
global-context branches upsampled back and joined, attention gates, channel shuffles, tensors
built in forward. Forward, input and parameter gradients, losses and every weight after two
SGD-momentum steps must match a single process to 1e-9 in float64 (as in ``test_layers``), on
uneven shards. What cannot be decomposed must be refused with a ``ValueError`` before any remote
work. A failure names the pattern whose rule (``bigconv/rules_*.py``) is wrong.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from verdicts import assert_exact

import bigconv
from bigconv.verify import compare_training

TOL = 1e-9
Conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
BN = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}


class SizeQueries(nn.Module):
    """Sizes from the input: upsample to a skip's size, TF 'same' padding, factories from shapes."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.d = d
        self.down = Conv[d](1, 4, 3, stride=2, padding=1)
        self.stem = Conv[d](1, 4, 3, stride=2)
        self.head = Conv[d](12, 3, 1)

    def forward(self, x):
        skip = torch.relu(self.down(x))
        assert x.dim() == self.d + 2 and x.numel() == x.shape.numel()
        pads = []
        for n in reversed(x.shape[2:]):  # timm's pad_same: TF 'same' from the input size
            total = max((-(-n // 2) - 1) * 2 + 3 - n, 0)
            pads += [total // 2, total - total // 2]
        y = torch.relu(self.stem(F.pad(x, pads)))
        up = F.interpolate(y, size=x.shape[2:], mode="nearest")
        bias = torch.zeros(up.shape, dtype=up.dtype) + up.new_ones(up.size()) * 0.5
        up = F.interpolate(up + bias, size=skip.shape[-self.d:], mode="linear" if self.d == 1 else "nearest")
        scale = skip.new_full((1, skip.size(1)) + (1,) * self.d, 2.0)
        out = self.head(torch.cat([skip * scale, up, skip.new_zeros(skip.shape)], dim=1))
        return F.interpolate(out, size=x.shape[2:])


class ConvNeXtBlock(nn.Module):
    """timm/torchvision ConvNeXt: depthwise conv, channels-last LayerNorm and MLP, layer scale."""

    def __init__(self, d: int, c: int = 4) -> None:
        super().__init__()
        self.d = d
        self.stem = Conv[d](1, c, 3, padding=1)
        self.dw = Conv[d](c, c, 7, padding=3, groups=c)
        self.norm = nn.LayerNorm(c)
        self.fc1, self.fc2 = nn.Linear(c, 3 * c), nn.Linear(3 * c, c)
        self.gamma = nn.Parameter(torch.full((c,), 0.5))
        self.head = Conv[d](c, 3, 1)

    def forward(self, x):
        x = self.stem(x)
        last = (0, *range(2, self.d + 2), 1)
        y = self.dw(x).permute(*last)
        y = self.fc2(F.gelu(self.fc1(self.norm(y)))) * self.gamma
        y = y.movedim(-1, 1).contiguous()
        return self.head(x + y)


class Joins(nn.Module):
    """stack, unsqueeze/squeeze, chunk/split/narrow, repeat/expand/tile, reductions over channels."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.d = d
        self.a, self.b = Conv[d](1, 4, 3, padding=1), Conv[d](1, 4, 3, padding=1)
        self.head = Conv[d](12, 3, 1)

    def forward(self, x):
        a, b = self.a(x), self.b(x)
        s = torch.stack([a, b], dim=1).sum(dim=1)  # FPN-style merge
        s = s.unsqueeze(2).squeeze(2).squeeze()  # squeeze() must not drop a one-row shard's dim
        c1, c2 = torch.chunk(s, 2, dim=1)
        n1 = s.narrow(1, 0, 1)
        sp = torch.split(s, [3, 1], dim=1)[1]
        rep = n1.repeat(1, 2, *([1] * self.d)) + x.expand(-1, 2, *([-1] * self.d)) + sp.tile((1, 2) + (1,) * self.d)
        stats = [s.mean(1, keepdim=True), s.amax(dim=1, keepdim=True), torch.max(s, dim=1, keepdim=True)[0],
                 s.std(1, keepdim=True), torch.softmax(s, dim=1)[:, :1]]
        return self.head(torch.cat([c1 * c2, rep, a.unbind(1)[0].unsqueeze(1), *stats, x.repeat(1, 2, *[1] * self.d)],
                                   dim=1))


class GlobalContext(nn.Module):
    """ASPP image pooling, PSP pyramid (1, 2, 3, 6), SE and CBAM gates, LRASPP's sigmoid scale."""

    def __init__(self, d: int, sizes=(1, 2, 3, 6)) -> None:
        super().__init__()
        self.d = d
        self.sizes = sizes
        self.stem = Conv[d](1, 4, 3, padding=1)
        self.pool_conv = nn.ModuleList([Conv[d](4, 2, 1) for _ in sizes])
        self.se = nn.Sequential(nn.Linear(4, 2), nn.ReLU(), nn.Linear(2, 4))
        self.spatial = Conv[d](2, 1, 7, padding=3)
        self.bn = BN[d](2)
        self.head = Conv[d](4 + 2 * len(sizes), 3, 1)

    def forward(self, x):
        x = torch.relu(self.stem(x))
        b = x.shape[0]
        pooled = F.adaptive_avg_pool1d(x, 1) if self.d == 1 else x.mean(dim=tuple(range(2, self.d + 2)))
        gate = torch.sigmoid(self.se(pooled.reshape(b, -1)) + self.se(x.amax(dim=tuple(range(2, self.d + 2)))))
        x = x * gate.view(b, -1, *([1] * self.d))  # SE / CBAM channel gate
        att = torch.cat([x.mean(1, keepdim=True), x.max(1, keepdim=True)[0]], dim=1)
        x = x * torch.sigmoid(self.spatial(att))  # CBAM spatial gate
        mode = {1: "linear", 2: "bilinear", 3: "trilinear"}[self.d]
        branches = [x]
        for size, conv in zip(self.sizes, self.pool_conv):
            p = conv([F.adaptive_avg_pool1d, F.adaptive_avg_pool2d, F.adaptive_avg_pool3d][self.d - 1](x, size))
            if size > 1:
                p = self.bn(p)
            branches.append(F.interpolate(torch.relu(p), size=x.shape[2:], mode=mode, align_corners=size > 2))
        return self.head(torch.cat(branches, dim=1))


class ShuffleAndConstants(nn.Module):
    """ShuffleNet's channel shuffle (view, transpose, view) and tensors built in forward."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.d = d
        self.stem = Conv[d](1, 4, 3, padding=1)
        self.head = Conv[d](4, 3, 1)

    def forward(self, x):
        x = self.stem(x)
        b, c, *sp = x.shape
        x = x.view(b, 2, c // 2, *sp).transpose(1, 2).contiguous().view(b, -1, *sp)
        w = torch.as_tensor([1.0, 2.0, 3.0, 4.0], dtype=x.dtype).view(1, -1, *([1] * self.d))
        scale = torch.tensor(0.5, dtype=x.dtype) + torch.arange(c, dtype=x.dtype).view(1, -1, *([1] * self.d)) / c
        return self.head(x * w * scale)


class GlobalMax(nn.Module):
    """A global maximum with ties (zeros after ReLU) as a normalizer: its gradient must be shared as in one process."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.conv = Conv[d](1, 3, 3, padding=1)
        self.d = d

    def forward(self, x):
        y = torch.relu(self.conv(x))
        flat = torch.relu(-y).amax(dim=tuple(range(2, self.d + 2)), keepdim=True)  # mostly ties at 0
        return y / (1 + y.amax(dim=tuple(range(1, self.d + 2)), keepdim=True)) + flat * y + y.max() * 0.1


class SpatialNorm(nn.Module):
    """L2 norms over all spatial dims (``Tensor.norm``, ``torch.norm``, ``linalg.vector_norm``) as normalizers."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.conv = Conv[d](1, 3, 3, padding=1)
        self.dims = tuple(range(2, d + 2))

    def forward(self, x):
        y = torch.tanh(self.conv(x))
        a = y / (1 + y.norm(p=2, dim=self.dims, keepdim=True))
        # PyTorch's default p="fro" takes at most two dims (it raises on three, in one process too).
        b = torch.norm(y, dim=self.dims, keepdim=True) if len(self.dims) <= 2 else torch.norm(y, 2, self.dims, True)
        c = torch.linalg.vector_norm(y, dim=self.dims, keepdim=True)
        return a + b * c * y


PATTERNS = {"sizes": SizeQueries, "norm": SpatialNorm, "convnext": ConvNeXtBlock, "joins": Joins, "context": GlobalContext,
            "shuffle": ShuffleAndConstants, "globalmax": GlobalMax}
SHAPES = {1: ((2, 1, 37), (3,)), 2: ((2, 1, 19, 22), (2, 2)), 3: ((2, 1, 13, 12, 14), (2, 1, 2))}
CASES = [(name, d) for name in PATTERNS for d in (1, 2, 3)]


def _workers(d: int) -> int:
    return 3 if d == 1 else 4


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name,d", [pytest.param(n, d, id=f"{n}-{d}d", marks=pytest.mark.world(_workers(d)))
                                    for n, d in CASES])
def test_pattern_matches_single_process(world, name, d):
    model = PATTERNS[name](d).double()
    shape, grid = SHAPES[d]
    x = torch.randn(shape, dtype=torch.float64)
    y = torch.randint(0, 3, (shape[0], *shape[2:]))
    r = compare_training(model, world, x, y, nn.CrossEntropyLoss(), grid=grid)
    assert_exact(r, TOL)


class AttentionOverPositions(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        q = y.flatten(2)  # (N, C, HW): every position attends to every other
        att = torch.softmax(q.transpose(1, 2) @ q, dim=-1)
        return (q @ att).view_as(y)


class LinearOverWidth(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3, padding=1)
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return self.fc(self.conv(x))


class ReadsValue(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        return y * 2 if y[0, 0].sum().item() > 0 else y


class IntegerNoiseOfImageSize(nn.Module):
    """Integer noise drawn at the image's size: a draw bigconv does not make consistently on every shard
    (``torch.randn`` of an image's size is exact: tests/test_habits.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        return y + 0.1 * torch.randint(0, 2, y.shape, dtype=y.dtype, device=y.device)


class ArgmaxOverPositions(nn.Module):
    """The index of the strongest value of the whole map: a shard knows only its own positions."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        return y * (y.argmax() % 7).to(y.dtype)


@pytest.mark.world(4)
@pytest.mark.parametrize("model,words", [
    (AttentionOverPositions, ["view_as", "'<root>'"]),
    (LinearOverWidth, ["linear", "'fc' (Linear)"]),
    (ReadsValue, ["item", "'<root>'"]),
    (IntegerNoiseOfImageSize, ["randint", "'<root>'", "each worker would draw its own values"]),
    (ArgmaxOverPositions, ["argmax", "'<root>'"]),
])
def test_non_decomposable_refused_before_remote_work(refused_before_remote_work, model, words):
    refused_before_remote_work(model(), words)


class FailsOnWorkers(nn.Module):
    """Runs in the dry run (meta tensors) but raises on the workers: the worker's error must reach the user whole."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3, padding=1)

    def forward(self, x):
        if not x.is_meta:
            raise KeyError("boom on a real shard")
        return self.conv(x)


@pytest.mark.world(4)
def test_worker_error_names_type_message_and_module(world):
    net = bigconv.parallelize(nn.Sequential(FailsOnWorkers()).double(), world, grid=(2, 2))
    with pytest.raises(bigconv.WorkerFailure) as info:
        net(torch.randn(1, 1, 8, 8, dtype=torch.float64))
    text = str(info.value)
    for word in ("KeyError", "boom on a real shard", "'0' (FailsOnWorkers)", "worker"):
        assert word in text, text
