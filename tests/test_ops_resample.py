"""Bicubic resampling and foundation-model ViTs at sizes other than their native one (issue 51, item 2).

The contract: ``F.interpolate(mode="bicubic")`` of a sharded map is a separable index map of four taps per output
(a 2-pixel halo; ``bigconv.geometry.index_maps.Resize``'s ``cubic`` taps, which match PyTorch's CPU kernel), exact
with align_corners both ways, up and down; antialiased bicubic of a sharded map is refused naming the way out. A
whole small tensor resampled to a sharded map's size (timm's ``resample_abs_pos_embed``: a ViT's position
embedding, bicubic with antialias, in float32) is computed whole by torch's own kernel and cut to each shard's
tokens, its backward run once on shard 0 with the whole cotangent (``bigconv.ops.window._first_copy``), so
timm ViTs with ``dynamic_img_size`` (DINOv2 with registers, UNI- and Virchow-style) train exactly at sizes other
than the one they were built for. Models are judged by the verdict (float64, 1e-9 of each tensor's own size); a
planted error in the taps must fail. A failure points at ``Resize._cubic``, ``window._resize_maps`` or
``window._interpolate_whole``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from issue51_models import Resampled, dinov2_registers, dpt_on_vit, uni_style, virchow_style
from shard_threads import forward_on_threads, relative_error
from verdicts import assert_exact, verdict

from bigconv.geometry import index_maps
from bigconv.geometry.index_maps import Resize, resize_sizes


def _taps_applied(x: torch.Tensor, maps) -> torch.Tensor:
    out = x
    for axis, m in enumerate(maps):
        dim = out.dim() - len(maps) + axis
        total = None
        for index, weights in m.taps((0, m.n_out)):
            view = [1] * out.dim()
            view[dim] = -1
            part = out.index_select(dim, torch.tensor(index)) * torch.tensor(weights, dtype=out.dtype).view(view)
            total = part if total is None else total + part
        out = total
    return out


@pytest.mark.parametrize("align_corners", [False, True])
@pytest.mark.parametrize("sizes", [dict(size=(11, 6)), dict(size=(3, 13)), dict(scale_factor=2.5),
                                   dict(scale_factor=(1.7, 0.6)), dict(scale_factor=0.5, recompute_scale_factor=True)],
                         ids=["up-down", "down-up", "x2.5", "x1.7-x0.6", "half-recomputed"])
def test_cubic_taps_are_torchs_bicubic(sizes, align_corners):
    """The four taps per output, applied whole, against ``F.interpolate(mode="bicubic")`` (pure index math)."""
    x = torch.randn(2, 3, 5, 7, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    want = F.interpolate(x, mode="bicubic", align_corners=align_corners, **sizes)
    out, scales = resize_sizes((5, 7), sizes.get("size"), sizes.get("scale_factor"),
                               sizes.get("recompute_scale_factor"))
    maps = [Resize(n, m, "cubic", align_corners, s) for n, m, s in zip((5, 7), out, scales)]
    assert relative_error(_taps_applied(x, maps), want) <= 1e-14


@pytest.mark.world(4)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("align_corners", [False, True])
def test_bicubic_of_a_sharded_map_exact(world, align_corners):
    """An 11x9 map on uneven 2x2 shards upsampled by 1.7 (the 2-pixel halo from each neighbour) and resampled back
    to 11x9 (downsampling)."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 1, 11, 9, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (2, 11, 9), generator=gen)
    assert_exact(verdict(Resampled(align_corners).double(), world, x, y))


@pytest.mark.world(4)
@pytest.mark.timeout(120)
def test_antialiased_bicubic_of_a_sharded_map_refused(refused_before_remote_work):
    refused_before_remote_work(Resampled(antialias=True), ["interpolate", "antialiased bicubic",
                                                           "antialias=False", "whole small tensor"])


@pytest.mark.world(4)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("factory", [pytest.param(dinov2_registers, marks=pytest.mark.slow),  # 21 s
                                     uni_style, pytest.param(virchow_style, marks=pytest.mark.slow)],  # 13 s
                         ids=lambda f: f.__name__)
def test_foundation_vit_at_another_size_exact(world, factory):
    """Built for 16 px (4x4 tokens), run at 28x20 (7x5 tokens) on uneven 2x2 shards: the position embedding resampled
    by bicubic with antialias (float32, as timm does), cut to each shard's tokens; class/register tokens whole;
    every block's attention by ring passes."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 28, 20, generator=gen, dtype=torch.float64)
    assert_exact(verdict(factory().double(), world, x, torch.tensor([0, 2])))


@pytest.mark.zoo
@pytest.mark.world(4)
@pytest.mark.timeout(600)
def test_dpt_on_a_vit_encoder_at_another_size_exact(world):
    """smp's DPT on a timm ViT (12 blocks) built for 16 px, at 32 px on 2x2 shards: the resampled position embedding,
    the class token read out beside every patch token (``expand_as``), the reassembled maps (50 s)."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 32, 32, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (2, 32, 32), generator=gen)
    assert_exact(verdict(dpt_on_vit().double(), world, x, y))


def test_planted_cubic_taps_off_by_one_fail(monkeypatch):
    """A planted error: every cubic tap reads the input one place further. The resampling model's forward on 2x2
    shards (threads, the workers' code) must then differ from one process."""
    torch.manual_seed(0)
    model = Resampled().double().eval()
    x = torch.randn(2, 1, 11, 9, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    with torch.no_grad():
        want = model(x)
    assert relative_error(forward_on_threads(model, x, (2, 2)), want) <= 1e-12
    real = index_maps.Resize._cubic

    def shifted(self, o):
        return [([min(i + 1, self.n_in - 1) for i in index], w) for index, w in real(self, o)]

    monkeypatch.setattr(index_maps.Resize, "_cubic", shifted)
    assert relative_error(forward_on_threads(model, x, (2, 2)), want) > 1e-3
