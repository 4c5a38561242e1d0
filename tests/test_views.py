"""Views of sharded maps (issue 37, item 6): ``flatten(1)`` by another name, positions viewed back into a map.

A ``view``/``reshape`` that is ``flatten(1)`` by another name is treated as ``flatten(1)``.

``x.view(x.size(0), -1)`` before a classifier, MONAI SegResNetVAE's ``view(-1, 256)`` of its 4x4 latent
map: the batch kept, channels and every spatial dim merged. As ``flatten(1)`` into a dense head, the map
is gathered whole on every worker and the head runs replicated (``bigconv.ops.layout``). Before, such a
reshape made flattened positions with the channels as a whole leading count, and the ``Linear`` after it
was refused for acting along the positions. Against one process in float64 on a 2x2 grid: outputs, input
and parameter gradients, losses and weights after two steps (``tests/exactness.py``), with the model's
several outputs where it has them (SegResNetVAE returns the map and its VAE loss).

An image's positions flattened by ``view(B, C, -1)`` and viewed back into ``(B, C, H, W)`` after per-position
math (SegFormer MiT's LayerNorm over channels) is this shard's part of the map again
(``bigconv.ops.windows.positions_to_map``); it was refused as "mixing the positions with other dims".
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from exactness import assert_exact, compare


class ViewHead(nn.Module):
    """A convolution, ``view`` to ``(N, C*H*W)`` (as written: ``-1`` first, or the batch and ``-1``), a Linear;
    ``channels_last``: the same of a permuted ``(N, H, W, C)`` map."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.conv = nn.Conv2d(1, 2, 3, padding=1)
        self.fc = nn.Linear(2 * 8 * 8, 3)

    def forward(self, x):
        h = torch.tanh(self.conv(x))
        if self.form == "batch-first":
            h = h.view(h.size(0), -1)
        elif self.form == "minus-one-first":
            h = h.reshape(-1, self.fc.in_features)
        else:
            h = h.permute(0, 2, 3, 1).reshape(h.shape[0], -1)
        return self.fc(h)


@pytest.mark.world(4)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("form", ["batch-first", "minus-one-first", "channels-last"])
def test_view_as_flatten_into_a_linear_is_exact(world, form):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 1, 8, 8, generator=g, dtype=torch.float64)
    y = torch.tensor([0, 2])
    assert_exact(compare(ViewHead(form).double(), world, x, y, nn.CrossEntropyLoss(), grid=(2, 2)))


def _vae_loss(outs, y):
    seg, vae_loss = outs
    return F.mse_loss(seg, y) + vae_loss


@pytest.mark.zoo  # about 30 s on two cores
@pytest.mark.world(4)
@pytest.mark.timeout(300)
def test_monai_segresnet_vae_trains_exactly(world):
    """Its VAE branch: ``view(-1, 8 * 4 * 4)`` of the 4x4 latent map into a Linear, noise by ``randn_like``
    (bigconv's draws; scaled by ``vae_default_std=0`` here, so one process's own draws give the same sum),
    ``view`` back to a 4x4 map, upsampled to the image and ``F.mse_loss`` against the input inside forward
    (a global mean over the shards)."""
    from monai.networks.nets import SegResNetVAE

    torch.manual_seed(0)
    model = SegResNetVAE(input_image_size=(32, 32), spatial_dims=2, init_filters=4, in_channels=1, out_channels=2,
                         norm=("GROUP", {"num_groups": 2}), vae_nz=8, vae_default_std=0.0,
                         blocks_down=(1, 1, 1, 1), blocks_up=(1, 1, 1)).double()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 1, 32, 32, generator=g, dtype=torch.float64)
    y = torch.randn(2, 2, 32, 32, generator=g, dtype=torch.float64)
    assert_exact(compare(model, world, x, y, _vae_loss, grid=(2, 2)))


class ChannelsLayerNorm(nn.Module):
    """SegFormer MiT's LayerNorm of a 4D map (smp's ``mix_transformer.LayerNorm``): ``view(B, C, -1)``,
    transpose, ``layer_norm`` over channels, transpose, ``view(B, C, H, W)``; between two convolutions."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(1, 4, 3, padding=1), nn.Conv2d(4, 2, 3, padding=1)
        self.norm = nn.LayerNorm(4)

    def forward(self, x):
        h = self.a(x)
        b, c, hh, ww = h.shape
        h = h.view(b, c, -1).transpose(1, 2)
        h = F.layer_norm(h, self.norm.normalized_shape, self.norm.weight, self.norm.bias, self.norm.eps)
        h = h.transpose(1, 2).view(b, c, hh, ww)
        return self.b(torch.tanh(h))


@pytest.mark.world(4)
@pytest.mark.timeout(120)
def test_positions_viewed_back_into_the_map_are_exact(world):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 1, 10, 9, generator=g, dtype=torch.float64)
    y = torch.randn(2, 2, 10, 9, generator=g, dtype=torch.float64)
    assert_exact(compare(ChannelsLayerNorm().double(), world, x, y, nn.MSELoss(), grid=(2, 2)))


@pytest.mark.world(4)
@pytest.mark.timeout(120)
def test_segformer_mit_refused_at_its_attention_between_positions(refused_before_remote_work):
    """Its LayerNorm over channels passes now; what stops it is its attention over all positions (SegFormer's
    efficient self-attention), named with that reason."""
    import segmentation_models_pytorch as smp

    torch.manual_seed(0)
    model = smp.Segformer(encoder_name="mit_b0", encoder_weights=None, classes=2)
    refused_before_remote_work(model, ["Tensor.matmul", "'encoder.block1.0.attn' (Attention)",
                                       "attention between positions"], shape=(1, 3, 64, 64))
