"""Small models of issue 51's patterns, shared by the driver-mode tests and the SPMD ranks.

Sequences (attention over a 1D map's positions, PhysicsNeMo's sequence-parallel SDPA; a learned latent array
as whole queries; split queries over learned keys and values; causal, key masks and a relative bias over one
process's order), foundation-model ViTs at sizes other than their native one (timm's ``dynamic_img_size``:
DINOv2 with registers, UNI- and Virchow-style), current attention layouts (SAM's image encoder, MaxViT, Hiera)
and ops with a global order along a dim (flip, cummax/cummin, fold) at the smallest sizes that exercise them.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from bigconv.compat import allow_torchvision_without_ops

allow_torchvision_without_ops()  # before timm


# -- sequences ----------------------------------------------------------------------------------------------
class SequenceSDPA(nn.Module):
    """Tokens from an ``(N, C, *spatial)`` map, multi-head SDPA over all of them, then a pooled head (``out="pool"``)
    or the map back through a 1x1 head (``out="map"``). ``form``: how the tokens are made, as users write it:
    ``x.reshape(b, c, -1).transpose(1, 2)`` (the docs' own), ``x.flatten(2).transpose(1, 2)``, ``x.transpose(1, 2)``
    (a 1D map's positions as they are), or ``heads``: one reshape of a 1x1 convolution's output that splits the
    heads too, ``(b, 3 * h, d, -1)``."""

    def __init__(self, form: str = "reshape", out: str = "pool", c: int = 8, heads: int = 2, dims: int = 1) -> None:
        super().__init__()
        conv = nn.Conv1d if dims == 1 else nn.Conv2d
        self.form, self.out, self.h = form, out, heads
        self.conv = conv(2, c, 3, padding=1)
        self.qkv, self.proj, self.head = nn.Linear(c, 3 * c), nn.Linear(c, c), nn.Linear(c, 3)
        self.qkv_conv, self.dense = conv(c, 3 * c, 1), conv(c, 3, 1)

    def forward(self, x):
        h = torch.tanh(self.conv(x))
        b, c = h.shape[:2]
        if self.form == "heads":
            q, k, v = self.qkv_conv(h).reshape(b, 3 * self.h, c // self.h, -1).transpose(-1, -2).chunk(3, 1)
            t = F.scaled_dot_product_attention(q, k, v).transpose(-1, -2).reshape(b, c, -1).transpose(1, 2)
        else:
            t = {"reshape": lambda: h.reshape(b, c, -1), "flatten": lambda: h.flatten(2),
                 "transpose": lambda: h}[self.form]().transpose(1, 2)
            n = t.shape[1]
            q, k, v = self.qkv(t).reshape(b, n, 3, self.h, c // self.h).permute(2, 0, 3, 1, 4).unbind(0)
            t = self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, c))
        if self.out == "pool":
            return self.head(t.mean(1))
        return self.dense(t.transpose(1, 2).reshape(h.shape))


class SequenceVariants(nn.Module):
    """SDPA over a map's flattened positions in the other layouts users bring: ``latent`` (a learned latent array
    as whole queries over the split keys and values: Perceiver, PhysicsNeMo's replicated queries), ``learned-kv``
    (split queries over keys and values every shard holds whole), ``causal``, ``keymask`` (a boolean mask over
    the keys, one process's order), ``bias`` (an additive relative bias ``-|i - j| / 4`` with a row per query of
    the whole image)."""

    def __init__(self, kind: str, c: int = 8, heads: int = 2, latents: int = 3, dims: int = 1) -> None:
        super().__init__()
        conv = nn.Conv1d if dims == 1 else nn.Conv2d
        self.kind, self.h = kind, heads
        self.conv, self.dense = conv(2, c, 3, padding=1), conv(c, 3, 1)
        self.qkv, self.head = nn.Linear(c, 3 * c), nn.Linear(c, 3)
        self.latent = nn.Parameter(torch.randn(latents, c))

    def forward(self, x):
        hmap = torch.tanh(self.conv(x))
        b, c = hmap.shape[:2]
        t = hmap.reshape(b, c, -1).transpose(1, 2)
        n = t.shape[1]

        def heads(z):
            return z.reshape(z.shape[0], z.shape[1], self.h, c // self.h).transpose(1, 2)

        q, k, v = self.qkv(t).chunk(3, -1)
        if self.kind == "latent":
            lat = self.latent.expand(b, -1, -1) @ self.qkv.weight[:c].T
            o = F.scaled_dot_product_attention(heads(lat), heads(k), heads(v))
            return self.head(o.transpose(1, 2).reshape(b, -1, c).sum(1))
        if self.kind == "learned-kv":
            kv = self.latent.expand(b, -1, -1)
            o = F.scaled_dot_product_attention(heads(q), heads(kv), heads(kv * 0.5))
        elif self.kind == "causal":
            o = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        elif self.kind == "keymask":
            keep = (torch.arange(n) % 5 != 3)[None, :]
            o = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), attn_mask=keep)
        else:
            i = torch.arange(n, dtype=x.dtype)
            bias = -(i[:, None] - i[None, :]).abs() / 4
            o = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), attn_mask=bias)
        return self.dense(o.transpose(1, 2).reshape(b, n, c).transpose(1, 2).reshape(hmap.shape))


class FlattenBack(nn.Module):
    """The issue's flatten-then-reshape-back on a map with a size-1 spatial dim: ``(x.reshape(b, c, -1) * 2)
    .reshape(b, c, h, 1)``, returned as the map."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1)

    def forward(self, x):
        b, c, h, _ = x.shape
        return (self.conv(x).reshape(b, c, -1) * 2).reshape(b, c, h, 1)


# -- foundation-model ViTs at other sizes -----------------------------------------------------------------------
VIT_SMALL = dict(img_size=16, patch_size=4, embed_dim=16, depth=2, num_heads=2, num_classes=3, dynamic_img_size=True)
"""Built for 16 px (4x4 tokens), run at other sizes: the position embedding resampled by bicubic with antialias."""


def dinov2_registers() -> nn.Module:
    """DINOv2 with 4 registers (LayerScale, no position embedding for the prefix tokens)."""
    import timm

    return timm.create_model("vit_small_patch14_reg4_dinov2", pretrained=False, **VIT_SMALL)


def uni_style() -> nn.Module:
    """UNI: a ViT-L/16 with LayerScale and a class token."""
    import timm

    return timm.create_model("vit_large_patch16_224", pretrained=False, init_values=1e-5, **VIT_SMALL)


def virchow_style() -> nn.Module:
    """Virchow 2: a ViT-H/14 with SwiGLU (packed) MLPs, SiLU, LayerScale, 4 registers, average pooling."""
    import timm
    from timm.layers import SwiGLUPacked

    return timm.create_model("vit_huge_patch14_224", pretrained=False, init_values=1e-5, mlp_layer=SwiGLUPacked,
                             act_layer=nn.SiLU, mlp_ratio=5.3375, reg_tokens=4, global_pool="avg",
                             **{**VIT_SMALL, "embed_dim": 24})


def dpt_on_vit() -> nn.Module:
    """smp's DPT on a timm ViT encoder (12 blocks of width 16, class token read out beside every patch token),
    built for 16 px and run larger."""
    import segmentation_models_pytorch as smp

    return smp.DPT(encoder_name="tu-vit_small_patch16_224", encoder_weights=None, encoder_depth=4, classes=3,
                   decoder_intermediate_channels=(8, 8, 8, 8), decoder_fusion_channels=8, img_size=16, patch_size=4,
                   embed_dim=16, num_heads=2, dynamic_img_size=True)


class Resampled(nn.Module):
    """``F.interpolate(mode="bicubic")`` of a sharded map between convolutions, both align_corners, up and down."""

    def __init__(self, align_corners: bool = False, scale=1.7, antialias: bool = False) -> None:
        super().__init__()
        self.conv, self.head = nn.Conv2d(1, 3, 3, padding=1), nn.Conv2d(3, 3, 3, padding=1)
        self.align_corners, self.scale, self.antialias = align_corners, scale, antialias

    def forward(self, x):
        y = F.interpolate(torch.tanh(self.conv(x)), scale_factor=self.scale, mode="bicubic",
                          align_corners=self.align_corners, antialias=self.antialias)
        return F.interpolate(self.head(y), size=x.shape[-2:], mode="bicubic", align_corners=self.align_corners)


# -- current attention layouts -------------------------------------------------------------------------------
def sam(img=32, window: int = 3, global_at=(1,)) -> nn.Module:
    """timm's SAM image encoder (``VisionTransformerSAM``): a windowed block (8x8 tokens padded to a multiple of the
    window) and a global block, both with relative position tables, the neck, a small head."""
    import timm

    model = timm.create_model("samvit_base_patch16", pretrained=False, img_size=img, patch_size=4, embed_dim=16,
                              depth=2, num_heads=2, window_size=window, global_attn_indexes=global_at,
                              num_classes=3, neck_chans=8)
    for block in model.blocks:  # timm starts the tables at 0: the bias would vanish from the first forward
        nn.init.normal_(block.attn.rel_pos_h, std=0.5)
        nn.init.normal_(block.attn.rel_pos_w, std=0.5)
    return model


def maxvit(img=32, window: int = 2, nchw: bool = False) -> nn.Module:
    """timm's MaxViT (rw configuration): MBConv, block attention and grid attention with relative position bias."""
    from timm.models.maxxvit import MaxxVit, MaxxVitCfg, _rw_max_cfg

    cfg = _rw_max_cfg(window_size=(window, window), dim_head=4)
    cfg["transformer_cfg"].use_nchw_attn = nchw
    return MaxxVit(MaxxVitCfg(embed_dim=(8, 16), depths=(1, 1), block_type=("M", "M"), stem_width=(8, 8), **cfg),
                   img_size=img, num_classes=3)


def hiera(img=32) -> nn.Module:
    """timm's Hiera (its ``Unroll``/``Reroll`` of the patch tokens, mask-unit attention, then global)."""
    import timm

    return timm.create_model("hiera_tiny_224", pretrained=False, img_size=img, num_classes=3, embed_dim=8,
                             num_heads=1, stages=(1, 1, 1, 1))


# -- ops with a global order along a dim -------------------------------------------------------------------
class GlobalOrder(nn.Module):
    """``torch.flip`` of sharded dims (and of channels), ``cummax``/``cummin`` along them (values and indices), and
    ``F.fold`` of ``F.unfold``'s columns with overlapping blocks (kernel 3, stride 2, padding 1: each output summed
    over up to four blocks), between convolutions; a dense head."""

    def __init__(self, c: int = 3) -> None:
        super().__init__()
        self.conv, self.mid = nn.Conv2d(1, c, 3, padding=1), nn.Conv2d(c, c, 3, padding=1)
        self.cols, self.head = nn.Conv1d(c * 9, c * 9, 1), nn.Conv2d(2 * c, 3, 3, padding=1)

    def forward(self, x):
        h = torch.tanh(self.conv(x))
        h = torch.flip(h, (-1,)) + 0.5 * h.flip(1, 2)
        up, at = torch.cummax(h, dim=2)
        down = h.cummin(-1).values
        g = torch.tanh(self.mid(up * (at.to(h.dtype) + 1) / x.shape[2] + down))
        cols = self.cols(F.unfold(g, 3, padding=1, stride=2))
        folded = F.fold(cols, g.shape[-2:], 3, padding=1, stride=2)
        return self.head(torch.cat([folded, torch.fliplr(g)], 1))


# -- what bigconv.check reports of them ---------------------------------------------------------------------
class EcaGate(nn.Module):
    """ECA's channel gate: a Conv1d with 'same' padding across the pooled channels of a 2D map."""

    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.conv, self.gate, self.head = nn.Conv2d(3, c, 3, padding="same"), nn.Conv1d(1, 1, 3, padding="same"), \
            nn.Conv2d(c, 3, 1)

    def forward(self, x):
        h = torch.relu(self.conv(x))
        w = torch.sigmoid(self.gate(h.mean((2, 3)).unsqueeze(1))).transpose(1, 2).unsqueeze(-1)
        return self.head(h * w)


class FlatAttention(nn.Module):
    """FastViT's global attention: a map in, its positions flattened inside (flatten(2)), SDPA, the map back out."""

    def __init__(self, c: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.num_heads, self.head_dim = heads, c // heads
        self.qkv, self.proj = nn.Linear(c, 3 * c), nn.Linear(c, c)

    def forward(self, x):
        b, c, h, w = x.shape
        t = x.flatten(2).transpose(-2, -1)
        q, k, v = self.qkv(t).reshape(b, h * w, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        o = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, h * w, c)
        return self.proj(o).transpose(-2, -1).reshape(b, c, h, w)


def eca_net() -> nn.Module:
    return EcaGate()


def fastvit_like() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), FlatAttention(), nn.Conv2d(8, 3, 1))
