"""Small models of issue 37's habits, shared by the driver-mode tests and the SPMD ranks.

Each returns what the field's models return: nnU-Net's deep supervision (a list of maps at several
scales, the loss over a list of targets), HoVerNet's dict of heads, an auxiliary classifier beside a
dense map (a tuple of a map and a vector), two classifier heads; and a SyncBatchNorm model.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F


def block(cin: int, cout: int) -> nn.Sequential:
    # No bias before a norm: its gradient is 0 in exact arithmetic, a rounding residue on both sides.
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.GroupNorm(2, cout), nn.LeakyReLU(0.01))


class DeepSupervision(nn.Module):
    """A two-level U-Net returning [full-resolution logits, half-resolution logits] (nnU-Net's order)."""

    def __init__(self, c: int = 4, classes: int = 3) -> None:
        super().__init__()
        self.enc1, self.enc2 = block(1, c), block(c, c)
        self.down = nn.Conv2d(c, c, 2, stride=2)
        self.up = nn.ConvTranspose2d(c, c, 2, stride=2)
        self.dec = block(2 * c, c)
        self.seg1, self.seg2 = nn.Conv2d(c, classes, 1), nn.Conv2d(c, classes, 1)

    def forward(self, x):
        a = self.enc1(x)
        b = self.enc2(self.down(a))
        d = self.dec(torch.cat([a, self.up(b)], 1))
        return [self.seg1(d), self.seg2(b)]


def deep_supervision_loss(outs, targets):
    """nnU-Net's DeepSupervisionWrapper: weights 1/2^k, normalized, one target per scale."""
    weights = [1 / 2 ** k for k in range(len(outs))]
    total = sum(weights)
    return sum(w / total * F.cross_entropy(o, t) for w, o, t in zip(weights, outs, targets))


def deep_supervision_targets(n: int, h: int, w: int, g: torch.Generator) -> list:
    full = torch.randint(0, 3, (n, h, w), generator=g)
    return [full, full[:, ::2, ::2].contiguous()]


class DictHeads(nn.Module):
    """HoVerNet's three maps as a dict: nuclear pixels, horizontal/vertical distances, types."""

    def __init__(self, c: int = 4) -> None:
        super().__init__()
        self.trunk = nn.Sequential(block(1, c), block(c, c))
        self.np, self.hv, self.tp = nn.Conv2d(c, 2, 1), nn.Conv2d(c, 2, 3, padding=1), nn.Conv2d(c, 3, 1)

    def forward(self, x):
        f = self.trunk(x)
        return {"np": self.np(f), "hv": torch.tanh(self.hv(f)), "tp": self.tp(f)}


def dict_loss(outs, y):
    return (F.cross_entropy(outs["np"], y["np"]) + F.mse_loss(outs["hv"], y["hv"])
            + 0.5 * F.cross_entropy(outs["tp"], y["tp"]))


def dict_targets(n: int, h: int, w: int, g: torch.Generator) -> dict:
    return {"np": torch.randint(0, 2, (n, h, w), generator=g),
            "hv": torch.rand(n, 2, h, w, generator=g, dtype=torch.float64) * 2 - 1,
            "tp": torch.randint(0, 3, (n, h, w), generator=g)}


class AuxClassifier(nn.Module):
    """A dense map and an image-level vector from the pooled trunk (a tuple: dense + replicated)."""

    def __init__(self, c: int = 4) -> None:
        super().__init__()
        self.trunk = nn.Sequential(block(1, c), nn.Conv2d(c, c, 3, stride=2, padding=1), nn.Tanh())
        self.seg = nn.Conv2d(c, 2, 1)
        self.cls = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, 3))

    def forward(self, x):
        f = self.trunk(x)
        return self.seg(f), self.cls(f)


def aux_loss(outs, y):
    seg, cls = outs
    return F.cross_entropy(seg, y[0]) + 0.4 * F.cross_entropy(cls, y[1])


def aux_targets(n: int, h: int, w: int, g: torch.Generator) -> tuple:
    return torch.randint(0, 2, (n, (h + 1) // 2, (w + 1) // 2), generator=g), torch.randint(0, 3, (n,), generator=g)


class TwoHeads(nn.Module):
    """GoogLeNet-style: the main classifier and an auxiliary one, both image-level (both replicated)."""

    def __init__(self, c: int = 4) -> None:
        super().__init__()
        self.a, self.b = block(1, c), block(c, c)
        self.aux = nn.Sequential(nn.AdaptiveMaxPool2d(1), nn.Flatten(), nn.Linear(c, 3))
        self.main = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, 3))

    def forward(self, x):
        a = self.a(x)
        return {"main": self.main(self.b(a)), "aux": self.aux(a)}


def two_heads_loss(outs, y):
    return F.cross_entropy(outs["main"], y) + 0.3 * F.cross_entropy(outs["aux"], y)


def sync_bn_net() -> nn.Module:
    net = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4, momentum=None), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))
    return nn.SyncBatchNorm.convert_sync_batchnorm(net).double()


CASES = {
    # name: (model factory, input shape, targets(n, h, w, generator), loss)
    "deep-supervision": (DeepSupervision, (2, 1, 12, 10), deep_supervision_targets, deep_supervision_loss),
    "dict-heads": (DictHeads, (2, 1, 11, 9), dict_targets, dict_loss),
    "aux-classifier": (AuxClassifier, (2, 1, 11, 9), aux_targets, aux_loss),
    "two-heads": (TwoHeads, (2, 1, 11, 9), lambda n, h, w, g: torch.randint(0, 3, (n,), generator=g), two_heads_loss),
}


def case(name: str, seed: int = 0, batch: int | None = None):
    """(model in float64, x, y, loss) of a case, the same on every rank for one seed."""
    factory, shape, targets, loss = CASES[name]
    if batch is not None:
        shape = (batch, *shape[1:])
    torch.manual_seed(seed)
    model = factory().double()
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    return model, x, targets(shape[0], shape[2], shape[3], g), loss


class RollNet(nn.Module):
    """A convolution, ``torch.roll`` of the map (channels-last, as Swin rolls it, with ``channels_last``),
    another convolution: the roll's exchange sits between two halos, forward and backward."""

    def __init__(self, shifts, dims, channels_last: bool = False, spatial: int = 2) -> None:
        super().__init__()
        conv = nn.Conv2d if spatial == 2 else nn.Conv3d
        self.shifts, self.dims, self.channels_last = shifts, dims, channels_last
        self.a, self.b = conv(1, 3, 3, padding=1), conv(3, 2, 3, padding=1)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if self.channels_last:
            h = h.movedim(1, -1)
        h = torch.roll(h, self.shifts, self.dims)
        if self.channels_last:
            h = h.movedim(-1, 1)
        return self.b(h)


def roll_case(shifts, dims, channels_last=False, shape=(2, 1, 11, 9), seed: int = 0):
    torch.manual_seed(seed)
    model = RollNet(shifts, dims, channels_last, len(shape) - 2).double()
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    y = torch.randn(shape[0], 2, *shape[2:], generator=g, dtype=torch.float64)
    return model, x, y, nn.MSELoss()


def tiny_swin(v2: bool = False) -> nn.Module:
    """torchvision's Swin (v1 or v2) at a test's size: 4x4 patches, windows of 2, two stages."""
    from torchvision.models.swin_transformer import (
        PatchMergingV2, SwinTransformer, SwinTransformerBlockV2)

    extra = dict(block=SwinTransformerBlockV2, downsample_layer=PatchMergingV2) if v2 else {}
    return SwinTransformer(patch_size=[4, 4], embed_dim=8, depths=[2, 2], num_heads=[2, 2], window_size=[2, 2],
                           stochastic_depth_prob=0.0, num_classes=3, **extra)


class TimmAttention(nn.Module):
    """timm's bottleneck (global MHSA, botnet's) or halo attention (halonet's) between convolutions."""

    def __init__(self, kind: str, c: int = 8, block: int = 2, halo: int = 1, stride: int = 1) -> None:
        super().__init__()
        from timm.layers.bottleneck_attn import BottleneckAttn
        from timm.layers.halo_attn import HaloAttn

        self.stem = nn.Sequential(nn.Conv2d(1, c, 3, stride=2, padding=1), nn.GroupNorm(2, c), nn.ReLU())
        self.attn = (BottleneckAttn(c, c, feat_size=(6, 6), num_heads=2) if kind == "bottleneck"
                     else HaloAttn(c, c, feat_size=(6, 6), block_size=block, halo_size=halo, num_heads=2,
                                   stride=stride))
        self.head = nn.Sequential(nn.Conv2d(c, 3, 3, padding=1), nn.AdaptiveAvgPool2d(1), nn.Flatten())

    def forward(self, x):
        return self.head(self.attn(self.stem(x)))


class NeighbourhoodAttention(nn.Module):
    """Neighbourhood attention in torch ops, as NATTEN's legacy torch module computes it: each query attends to
    the k x k keys around it (every d-th position with dilation d), the window clamped inside the map at its
    borders (unfold the keys into the map's k x k windows, then pad that map of windows by replication), plus a
    relative position bias. Odd and even k (an even window holds k // 2 keys before the query, k // 2 - 1
    after). Channels-last, as NAT's blocks run it. ``fold``: the windows by ``F.unfold`` (im2col) instead of
    ``Tensor.unfold`` (the legacy module's mode 1)."""

    def __init__(self, dim: int, heads: int, kernel: int, dilation: int = 1, fold: bool = False) -> None:
        super().__init__()
        self.heads, self.kernel, self.dilation, self.fold = heads, kernel, dilation, fold
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.rpb = nn.Parameter(torch.randn(heads, 2 * kernel - 1, 2 * kernel - 1) * 0.1)

    def forward(self, x):  # (B, H, W, C)
        b, h, w, c = x.shape
        d = self.dilation
        if d > 1:  # each residue class of positions mod d on its own: a partition of both dims into (n / d, d)
            x = x.view(b, h // d, d, w // d, d, c).permute(0, 2, 4, 1, 3, 5).reshape(b * d * d, h // d, w // d, c)
        x = self._attend(x)
        if d > 1:
            x = x.view(b, d, d, h // d, w // d, c).permute(0, 3, 1, 4, 2, 5).reshape(b, h, w, c)
        return self.proj(x)

    def _windows(self, kv):  # (B, H, W, 2C) -> (B, 2C, k * k, H, W): each position's clamped window
        b, h, w, c2 = kv.shape
        k = self.kernel
        if self.fold:
            win = F.unfold(kv.permute(0, 3, 1, 2), (k, k)).reshape(b * c2, k * k, h - k + 1, w - k + 1)
        else:
            win = kv.permute(0, 3, 1, 2).flatten(0, 1).unfold(1, k, 1).unfold(2, k, 1).permute(0, 3, 4, 1, 2)
            win = win.flatten(1, 2)
        win = F.pad(win, (k // 2, (k - 1) // 2, k // 2, (k - 1) // 2), mode="replicate")
        return win.reshape(b, c2, k * k, h, w)

    def _bias(self, h: int, w: int):  # (heads, H * W, k * k): the relative position bias of each query's keys
        k = self.kernel
        starts = [torch.clamp(torch.arange(n) - k // 2, 0, n - k) for n in (h, w)]
        rel = [s[:, None] + torch.arange(k)[None, :] - torch.arange(n)[:, None] + k - 1 for s, n in zip(starts, (h, w))]
        index = (rel[0][:, None, :, None] * (2 * k - 1) + rel[1][None, :, None, :]).reshape(h * w, k * k)
        return self.rpb.flatten(1)[:, index]

    def _attend(self, x):
        b, h, w, c = x.shape
        hd = c // self.heads
        qkv = self.qkv(x)
        q = qkv[..., :c].reshape(b, h * w, self.heads, 1, hd) * hd ** -0.5
        kv = self._windows(qkv[..., c:]).reshape(b, 2, self.heads, hd, self.kernel ** 2, h * w)
        k, v = kv.permute(1, 0, 5, 2, 4, 3).unbind(0)  # (B, HW, heads, k*k, hd)
        attn = (q @ k.transpose(-2, -1)).squeeze(-2) + self._bias(h, w).transpose(0, 1)
        out = attn.softmax(-1).unsqueeze(-2) @ v  # (B, HW, heads, 1, hd)
        return out.reshape(b, h, w, c)


class NeighbourhoodNet(nn.Module):
    """A convolution stem, a NAT-style block (LayerNorm, neighbourhood attention, residual), a convolution head."""

    def __init__(self, kernel: int, dilation: int = 1, fold: bool = False, c: int = 8) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, c, 3, padding=1), nn.GELU())
        self.norm = nn.LayerNorm(c)
        self.attn = NeighbourhoodAttention(c, 2, kernel, dilation, fold)
        self.head = nn.Conv2d(c, 2, 3, padding=1)

    def forward(self, x):
        h = self.stem(x).permute(0, 2, 3, 1)
        h = h + self.attn(self.norm(h))
        return self.head(h.permute(0, 3, 1, 2))


def _attn_float64(self, q, k, v):
    """timm LiteMLA's ``_attn`` without its cast to float32 (``q.float()``): in float32 the sum over positions
    rounds differently when added shard by shard, so only float64 arithmetic can be compared at 1e-9."""
    kv = k.transpose(-1, -2) @ v
    out = q @ kv
    return out[..., :-1] / (out[..., -1:] + self.eps)


@functools.lru_cache(maxsize=None)
def _lite_mla_float64() -> type:
    from timm.models.efficientvit_mit import LiteMLA

    return type("LiteMLAFloat64", (LiteMLA,), {"_attn": _attn_float64, "__module__": __name__,
                                               "__qualname__": "LiteMLAFloat64"})


def __getattr__(name: str):  # the class above, built on first use (timm imported then), found by pickle
    if name == "LiteMLAFloat64":
        return _lite_mla_float64()
    raise AttributeError(name)


def efficientvit_b0_float64(num_classes: int = 3) -> nn.Module:
    """timm ``efficientvit_b0`` with its LiteMLA attention kept in the model's dtype (see ``_attn_float64``)."""
    import timm
    from timm.models.efficientvit_mit import LiteMLA

    model = timm.create_model("efficientvit_b0", pretrained=False, num_classes=num_classes, drop_rate=0.0)
    for m in model.modules():
        if type(m) is LiteMLA:
            m.__class__ = _lite_mla_float64()
    return model
