"""The attention layouts of current backbones on shards (issue 51, item 3): SAM, MaxViT, Hiera, MONAI ViTAutoEnc.

The contract: timm's SAM image encoder (windowed blocks padded to a multiple of the window, global blocks, relative
position tables added as SDPA's mask: ``einsum`` of the sharded queries with the tables, a bias over every key in
one process's order), MaxViT (block and grid partitions; its relative position bias a mask), Hiera (``Unroll``'s
reorder of the tokens into mask units: the offsets inside a unit merged into the token dim in front of the
positions, ``shards.WindowGrid``'s ``lead``; mask-unit attention per window, then global attention over all of
them) train exactly on shards (the verdict, float64, 1e-9 of each tensor's own size). MONAI's ViTAutoEnc returns
its blocks' tokens beside the map: refused naming the outputs and the way out (a wrapper returning the map),
which trains exactly. A planted error in the map ``einsum`` (another shard's rows of SAM's position table) must
fail. A failure points at ``bigconv.ops.reduce._einsum``, ``bigconv.ops.windows`` (``reshape_map``'s positions
with outer factors split off, ``_getitem``'s new dims) or ``bigconv.ops.global_attention`` (masks, ``lead``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from issue51_models import hiera, maxvit, sam
from shard_threads import forward_on_threads, relative_error
from verdicts import assert_exact, verdict

import bigconv
from bigconv.ops import reduce


def _image(shape=(2, 3, 32, 32)):
    gen = torch.Generator().manual_seed(1)
    return torch.randn(*shape, generator=gen, dtype=torch.float64), torch.tensor([0, 2])


@pytest.mark.world(4)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("window,global_at", [
    pytest.param(3, (1,), id="window3-padded"),
    pytest.param(4, (1,), id="window4-aligned", marks=pytest.mark.slow),  # 15-20 s on the loaded 2-core host
    pytest.param(3, (0, 1), id="global-only", marks=pytest.mark.slow)])
def test_sam_image_encoder_exact(world, window, global_at):
    """8x8 tokens on 2x2 shards: a window of 3 pads them to 9x9 (windows across shards, re-sharded by whole windows),
    a window of 4 keeps each shard's windows; global blocks by ring passes with the decomposed relative position
    bias as a mask over every key."""
    torch.manual_seed(0)
    x, y = _image()
    assert_exact(verdict(sam(window=window, global_at=global_at).double(), world, x, y))


@pytest.mark.slow  # 30 s
@pytest.mark.world(4)
@pytest.mark.timeout(300)
def test_sam_at_an_uneven_size_exact(world):
    """36x28 px (9x7 tokens, uneven 5/4 by 4/3 shards), padded to 9x9 windows of 3."""
    torch.manual_seed(0)
    x, y = _image((2, 3, 36, 28))
    assert_exact(verdict(sam(img=(36, 28)).double(), world, x, y))


@pytest.mark.slow
@pytest.mark.world(4)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("nchw", [False, True], ids=["channels-last", "nchw"])
def test_maxvit_block_and_grid_attention_exact(world, nchw):
    """timm MaxViT (rw): block attention (windows) and grid attention (a map of grid cells per offset, global over
    the cells: ring passes with the relative position bias as a mask), both layouts of its attention (13-45 s)."""
    torch.manual_seed(0)
    x, y = _image()
    assert_exact(verdict(maxvit(nchw=nchw).double(), world, x, y))


@pytest.mark.world(4)
@pytest.mark.timeout(300)
def test_hiera_unroll_and_mask_unit_attention_exact(world):
    """timm Hiera at 64 px (16x16 tokens on 2x2 shards): ``Unroll`` three times (the offsets inside each 8x8 mask
    unit moved in front of the units' positions), mask-unit attention, the q-pooled global stages (queries a pooled
    subset of the keys' tokens)."""
    torch.manual_seed(0)
    model = hiera(64).double()
    nn.init.normal_(model.head.fc.weight, std=0.1)  # timm initializes it to 0: no gradient would reach the blocks
    x, y = _image((2, 3, 64, 64))
    assert_exact(verdict(model, world, x, y))


class First(nn.Module):
    """The way out for a model that returns tokens beside its map: a wrapper returning the map."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x)[0]


def _vit_autoenc():
    from monai.networks.nets import ViTAutoEnc

    return ViTAutoEnc(in_channels=1, img_size=32, patch_size=4, out_channels=1, deconv_chns=4, hidden_size=16,
                      mlp_dim=32, num_layers=2, num_heads=2, spatial_dims=2)


@pytest.mark.slow  # 60 s
@pytest.mark.world(4)
@pytest.mark.timeout(300)
def test_vit_autoenc_refused_naming_its_token_outputs_and_the_wrapper_exact(world):
    """ViTAutoEnc returns (map, [tokens of each block]): refused before remote work, naming out[1][0] and the
    wrapper; the wrapper returning the map trains exactly (the blocks' attention by ring passes)."""
    torch.manual_seed(0)
    model = _vit_autoenc().double()
    x = torch.randn(2, 1, 32, 32, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    with pytest.raises(ValueError) as info:
        bigconv.parallelize(model, world, grid=(2, 2)).plan(x)
    assert "out[1][0]" in str(info.value) and "model(x)[0]" in str(info.value), info.value
    assert_exact(verdict(First(model), world, x, torch.randint(0, 2, (2, 32, 32)),
                         loss=lambda out, y: ((out[:, 0] - y) ** 2).mean()))


def test_planted_einsum_with_another_shards_table_rows_fails(monkeypatch):
    """A planted error: the map ``einsum`` cuts an ordinary operand (SAM's relative position table) at the next
    shard's rows. SAM's forward on 2x2 shards (threads) must then differ from one process."""
    torch.manual_seed(0)
    model = sam(global_at=(0, 1)).double().eval()
    x, _ = _image()
    with torch.no_grad():
        want = model(x)
    assert relative_error(forward_on_threads(model, x, (2, 2)), want) <= 1e-12
    real = reduce.shard_box  # 8x8 tokens on 2x2: the mirror shard's box is as large as this one's
    monkeypatch.setattr(reduce, "shard_box", lambda shape, grid, coord: real(
        shape, grid, tuple(g - 1 - c for c, g in zip(coord, grid))))
    assert relative_error(forward_on_threads(model, x, (2, 2)), want) > 1e-6


class TokenMixer(nn.Module):
    """An attention-like module given an image's tokens that does what no rule splits (a running sum over them)."""

    def forward(self, t):
        return torch.cumsum(t, 1) / t.shape[1]


class TokenBlock(nn.Module):
    """A block given the map, flattening it into tokens for its mixer (SAM's Block around its Attention)."""

    def __init__(self, c: int = 4) -> None:
        super().__init__()
        self.conv, self.attn = nn.Conv2d(1, c, 3, padding=1), TokenMixer()

    def forward(self, x):
        h = self.conv(x)
        b, c = h.shape[:2]
        t = self.attn(h.reshape(b, c, -1).transpose(1, 2))
        return h + t.transpose(1, 2).reshape(h.shape)


@pytest.mark.world(4)
@pytest.mark.timeout(300)
def test_refusal_inside_a_module_given_tokens_names_the_block_that_holds(world):
    """The module that refuses (an attention given tokens) cannot be held whole (its inputs are flattened positions):
    the refusal names the innermost module around it given maps, and holding that one trains exactly."""
    model = nn.Sequential(TokenBlock(), nn.Conv2d(4, 3, 1)).double()
    x = torch.randn(2, 1, 9, 7, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    with pytest.raises(ValueError) as info:
        bigconv.parallelize(model, world, grid=(2, 2)).plan(x)
    assert "hold_whole(model, TokenBlock)" in str(info.value), info.value
    torch.manual_seed(0)
    held = bigconv.hold_whole(nn.Sequential(TokenBlock(), nn.Conv2d(4, 3, 1)).double(), TokenBlock)
    assert_exact(verdict(held, world, x, torch.randint(0, 3, (2, 9, 7), generator=torch.Generator().manual_seed(2))))
