"""A HIPT-style two-level ViT over windows (Chen et al., CVPR 2022, github.com/mahmoodlab/HIPT), scaled down.

HIPT's ``HIPT_4K.forward`` (``HIPT_4K/hipt_4k.py``) cuts the image into non-overlapping 256-px regions
that become the batch (``x.unfold(2, 256, 256).unfold(3, 256, 256)``, then ``rearrange(x, 'b c p1 p2 w h
-> (b p1 p2) c w h')``), runs a ViT-256 on them (DINO's ``vision_transformer.py``: a 16-px patch
embedding by a strided convolution, ``flatten(2).transpose(1, 2)``, its class token by
``cls_token.expand(B, -1, -1)`` and ``torch.cat`` along the tokens, the position embedding, ViT blocks
with full attention over a region's tokens, the class token's output ``x[:, 0]``), lays those class
tokens on the region grid (``reshape(w_256, h_256, 384).transpose(0, 1).transpose(0, 2).unsqueeze(0)``)
and runs ViT-4K over that grid (``vision_transformer4k.py``: ``phi`` = Linear + GELU per region token, its
own class token, blocks, ``x[:, 0]``). Here the same code at a size a CPU runs in float64: 8-px patches,
64-px regions (8x8 tokens each), widths 16 and 12, depth ``depth`` per level, and a linear head on the
ViT-4K class token. The region grid's reshape keeps a batch dim (HIPT's is written for one image); for
batch 1 it is HIPT's.

Written anew from the source's structure; ``rearrange`` is the ``permute`` and ``reshape`` it is.
"""

from __future__ import annotations

import torch
import torch.nn as nn


def position_encoding(pos_embed: torch.Tensor, x: torch.Tensor, w: int, h: int) -> torch.Tensor:
    """HIPT's ``interpolate_pos_encoding`` at the size its table was built for: the table itself, decided by
    size queries of the tokens and the map (HIPT resizes the table otherwise; this copy runs at that size)."""
    if x.shape[1] - 1 != pos_embed.shape[1] - 1 or w != h:
        raise ValueError(f"built for {pos_embed.shape[1] - 1} tokens of a square map, given {x.shape[1] - 1} of {w}x{h}")
    return pos_embed


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Attention(nn.Module):
    """DINO's (and HIPT's) attention: qkv by one Linear, ``q @ k^T`` over all tokens, softmax, ``@ v``."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.scale = (dim // num_heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        attn = (q @ k.transpose(-2, -1)) * self.scale
        attn = attn.softmax(dim=-1)
        x = (attn @ v).transpose(1, 2).reshape(B, N, C)
        return self.proj(x)


class Block(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim, eps=1e-6), Attention(dim, num_heads)
        self.norm2, self.mlp = nn.LayerNorm(dim, eps=1e-6), Mlp(dim, 4 * dim)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViT256(nn.Module):
    """DINO's ``VisionTransformer`` as HIPT's ``vit_small`` builds it: one region's tokens and a class token."""

    def __init__(self, region: int, patch: int, in_chans: int, dim: int, depth: int, num_heads: int) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(in_chans, dim, patch, stride=patch)  # PatchEmbed.proj
        num_patches = (region // patch) ** 2
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, num_patches + 1, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, num_heads) for _ in range(depth))
        self.norm = nn.LayerNorm(dim, eps=1e-6)

    def prepare_tokens(self, x):
        B, nc, w, h = x.shape
        x = self.patch_embed(x).flatten(2).transpose(1, 2)  # PatchEmbed.forward
        cls_tokens = self.cls_token.expand(B, -1, -1)
        x = torch.cat((cls_tokens, x), dim=1)
        return x + position_encoding(self.pos_embed, x, w, h)

    def forward(self, x):
        x = self.prepare_tokens(x)
        for blk in self.blocks:
            x = blk(x)
        return self.norm(x)[:, 0]


class ViT4K(nn.Module):
    """HIPT's ``VisionTransformer4K``: the region tokens through ``phi``, its own class token, blocks."""

    def __init__(self, grid: int, input_dim: int, dim: int, depth: int, num_heads: int) -> None:
        super().__init__()
        self.phi = nn.Sequential(nn.Linear(input_dim, dim), nn.GELU())
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, grid * grid + 1, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, num_heads) for _ in range(depth))
        self.norm = nn.LayerNorm(dim, eps=1e-6)

    def prepare_tokens(self, x):
        B, embed_dim, w, h = x.shape
        x = x.flatten(2, 3).transpose(1, 2)
        x = self.phi(x)
        cls_tokens = self.cls_token.expand(B, -1, -1)
        x = torch.cat((cls_tokens, x), dim=1)
        return x + position_encoding(self.pos_embed, x, w, h)

    def forward(self, x):
        x = self.prepare_tokens(x)
        for blk in self.blocks:
            x = blk(x)
        return self.norm(x)[:, 0]


class HIPT(nn.Module):
    """``HIPT_4K.forward`` for an image of ``grid x grid`` regions of ``region`` px, then a linear head."""

    def __init__(self, region: int = 64, patch: int = 8, grid: int = 4, in_chans: int = 3, dim256: int = 16,
                 dim4k: int = 12, depth: int = 1, num_heads: int = 2, num_classes: int = 3) -> None:
        super().__init__()
        self.region = region
        self.model256 = ViT256(region, patch, in_chans, dim256, depth, num_heads)
        self.model4k = ViT4K(grid, dim256, dim4k, depth, num_heads)
        self.head = nn.Linear(dim4k, num_classes)

    def grid_256(self, x):
        """Steps 2-4 of ``HIPT_4K.forward``: regions as the batch, ViT-256, class tokens on the region grid."""
        B = x.shape[0]
        r = self.region
        w_256, h_256 = x.shape[2] // r, x.shape[3] // r
        batch_256 = x.unfold(2, r, r).unfold(3, r, r)  # [B x C x w_256 x h_256 x r x r]
        # rearrange(batch_256, 'b c p1 p2 w h -> (b p1 p2) c w h')
        batch_256 = batch_256.permute(0, 2, 3, 1, 4, 5).reshape(-1, x.shape[1], r, r)
        features_cls256 = self.model256(batch_256)  # [B * w_256 * h_256 x dim256]
        # [B x dim256 x w_256 x h_256]
        return features_cls256.reshape(B, w_256, h_256, -1).transpose(1, 2).transpose(1, 3)

    def forward(self, x):
        return self.head(self.model4k(self.grid_256(x)))  # step 5, then the head: [B x classes]


def hipt() -> HIPT:
    """The zoo's HIPT: depth 2 per level (``bigconv.check tests/hipt_models.py:hipt``)."""
    return HIPT(depth=2)
