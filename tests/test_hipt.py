"""A HIPT-style two-level ViT over windows (issue 37, item 5), written as HIPT writes it, on shards.

``tests/hipt_models.HIPT``: the image unfolded into 64-px regions that become the batch, ViT-256 on them
(8-px patch embedding by a strided convolution of the regions, a class token per region by
``cls_token.expand(B * nW, -1, -1)`` and ``torch.cat`` along the tokens, full attention over a region's
tokens), each region's class-token output laid back on the region grid, ViT-4K with its own class token
over that grid, a linear head. Against one process in float64 on a 2x2 grid, judged by
``bigconv.verify.compare_training``'s verdict (``tests/verdicts.py``): forward, input and parameter
gradients, weights after two steps.

On 256 px (a 4x4 grid of regions) each shard holds 2x2 whole regions: level 1, the compute, runs on
each shard's own regions with no exchange (``bigconv.ops.windows``: the unfold by whole regions, the
convolution and the class token's ``cat`` per region); level 2's map of 4x4 region tokens is gathered
where ViT-4K's class token joins them and runs whole on every shard. A failure points at
``bigconv.ops.windows`` (``_per_item``, ``_cat``, ``positions_to_map``) or ``bigconv.ops.unfold``. An
image whose shards cut a region is not refused: the unfold takes whole regions from their owners (an
exchange, counted in the dry run), and level 1 is exact there too.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from hipt_models import HIPT
from verdicts import assert_exact, verdict


def _hipt(grid: int, depth: int = 1) -> torch.nn.Module:
    torch.manual_seed(0)
    return HIPT(grid=grid, depth=depth).double()


@pytest.mark.world(4)
@pytest.mark.timeout(300)
def test_hipt_level_one_split_level_two_whole_exactly(world):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 256, 256, generator=g, dtype=torch.float64)
    assert_exact(verdict(_hipt(4), world, x, torch.tensor([0, 2])))


@pytest.mark.world(4)
@pytest.mark.timeout(300)
def test_hipt_regions_cut_by_shards_reshard_exactly(world):
    """320 px: 5 regions of 64 on 2 shards of 160 px cut a region; the unfold takes whole regions (3 and 2)
    from their owners with an exchange, as a convolution of kernel and stride 64 reads its input."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 3, 320, 320, generator=g, dtype=torch.float64)
    assert_exact(verdict(_hipt(5), world, x, torch.tensor([1])))


class RegionTokens(nn.Module):
    """A learned token per region (a table of ``nW`` rows, ``repeat``ed over the batch: it varies from region
    to region, unlike an expanded class token) joined to each region's patch tokens by ``cat`` along the
    tokens; the regions' pooled tokens back on the region grid, a 1x1 convolution per region."""

    def __init__(self, grid: int = 4, region: int = 8, dim: int = 6) -> None:
        super().__init__()
        self.region = region
        self.embed = nn.Conv2d(1, dim, 4, stride=4)
        self.region_token = nn.Parameter(torch.randn(grid * grid, 1, dim))
        self.head = nn.Conv2d(dim, 3, 1)

    def forward(self, x):
        B, r = x.shape[0], self.region
        h, w = x.shape[2] // r, x.shape[3] // r
        regions = x.unfold(2, r, r).unfold(3, r, r).permute(0, 2, 3, 1, 4, 5).reshape(-1, x.shape[1], r, r)
        tokens = self.embed(regions).flatten(2).transpose(1, 2)
        tokens = torch.cat((self.region_token.repeat(B, 1, 1), tokens), dim=1)
        pooled = (tokens.softmax(dim=1) * tokens).sum(dim=1)
        return self.head(pooled.reshape(B, h, w, -1).permute(0, 3, 1, 2))


@pytest.mark.world(4)
@pytest.mark.timeout(120)
def test_cat_cuts_a_whole_image_operand_to_the_shards_regions(world):
    """The ``cat`` rule takes this shard's regions of an operand as long as all of them (a region's own token)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 1, 32, 32, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (2, 4, 4), generator=g)
    assert_exact(verdict(RegionTokens().double(), world, x, y))



class RegionCNN(nn.Module):
    """A tile encoder over the regions held as the batch (CLAM-style patch features): convolutions with zero
    padding at each region's border, max, average and adaptive pooling, ``flatten``; the features back on the
    region grid and a convolution across regions (a 3x3 over the grid: a halo of one region)."""

    def __init__(self, region: int = 8, dim: int = 4) -> None:
        super().__init__()
        self.region = region
        self.conv1, self.conv2 = nn.Conv2d(1, dim, 3, padding=1), nn.Conv2d(dim, dim, 3, padding=1)
        self.head = nn.Conv2d(dim, 3, 3, padding=1)

    def forward(self, x):
        B, r = x.shape[0], self.region
        h, w = x.shape[2] // r, x.shape[3] // r
        tiles = x.unfold(2, r, r).unfold(3, r, r).permute(0, 2, 3, 1, 4, 5).reshape(-1, x.shape[1], r, r)
        f = nn.functional.max_pool2d(torch.tanh(self.conv1(tiles)), 2)
        f = nn.functional.avg_pool2d(torch.tanh(self.conv2(f)), 2)
        f = nn.functional.adaptive_max_pool2d(f, 1).flatten(1)  # [B * h * w x dim]
        return self.head(f.reshape(B, h, w, -1).permute(0, 3, 1, 2))


@pytest.mark.world(4)
@pytest.mark.timeout(120)
def test_convolutions_and_poolings_of_regions_held_as_the_batch(world):
    """The per-item rule beyond a patch embedding: padded convolutions and poolings of each region on its own."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 1, 32, 32, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (2, 4, 4), generator=g)
    assert_exact(verdict(RegionCNN().double(), world, x, y))

class LevelOne(nn.Module):
    """HIPT up to the region grid (ViT-256 and the class tokens laid on the grid): a dense map of regions."""

    def __init__(self, grid: int) -> None:
        super().__init__()
        self.hipt = _hipt(grid)

    def forward(self, x):
        return self.hipt.grid_256(x)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size,exchanged", [(256, False), (320, True)])
def test_hipt_level_one_exchanges_nothing_when_shards_hold_whole_regions(monkeypatch, size, exchanged):
    """The dry run's shards send nothing for level 1 when shard edges fall on region edges (256 px: 128-px shards,
    regions of 64); at 320 px (shards of 160) the unfold takes whole regions from their owners."""
    from bigconv.engine.dry_run import dry_run, meta_copy
    from bigconv.transport.rpc import LocalLink

    pushes = []
    real = LocalLink._push
    monkeypatch.setattr(LocalLink, "_push", lambda self, dst, key, piece: (pushes.append(key), real(self, dst, key,
                                                                                                  piece))[1])
    result = dry_run(meta_copy(LevelOne(size // 64).double()), (2, 2), (1, 3, size, size), torch.float64, True)
    assert result.out_shape == (size // 64, size // 64)  # the region grid, split over the shards
    assert bool(pushes) == exchanged, len(pushes)


@pytest.mark.timeout(120)
def test_check_reports_level_one_split_level_two_whole():
    """``bigconv.check``'s split lines: ViT-256's attention split (each worker its regions), ViT-4K's gathered
    whole (its class token joins the 4x4 region tokens in front, bigconv.ops.prefix, and its per-token layers
    stay split; the softmax over them gathers the tokens), nearly all compute split."""
    from bigconv.check import layer_report, split_share

    attention = []
    rows, error = layer_report(_hipt(4), (1, 3, 256, 256), (2, 2), torch.float64, attention=attention)
    assert error is None, error
    strategies = {name: s.split(":")[0] for name, _, s in attention}
    assert strategies == {"model256.blocks.0.attn": "split", "model4k.blocks.0.attn": "gathered whole (attention "
                          "between all positions)"}, strategies
    share = split_share(rows)
    assert share["compute"] > 0.95 and share["replicated_layers"] == 2, share  # ViT-4K's attn.proj (after the gather) and the head
