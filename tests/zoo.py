"""A zoo of real convolutional networks from torchvision, timm, segmentation_models_pytorch and MONAI.

Each entry builds the library's own model, unchanged (no subclass, no edited layer), with
``weights=None`` / ``pretrained=False`` and the smallest widths and depths its constructor accepts,
so that the whole zoo runs on a 2-core CPU in float64. The caller seeds torch, calls ``factory()``
and then ``.double()``; every factory is deterministic given ``torch.manual_seed``.

Training-time randomness (dropout, stochastic depth, drop-connect) is switched off through the
constructors' own arguments (``dropout=0``, ``drop_rate=0``, ``stochastic_depth_prob=0`` ...): a
single process and a sharded one cannot draw the same random masks, so with it on no comparison
could be exact.

torchvision's segmentation models return a dict; they are wrapped in :class:`OutOnly`, which
returns ``model(x)["out"]``, as a user would.

``expect="ill-conditioned"`` marks models that rounding alone leaves undetermined past 1e-9 at their size
(each with its ``reason``); ``test_zoo`` fails any other entry that reads so. ``expect="refused"`` marks models
that contain a genuinely non-decomposable operation (attention over all positions); bigconv must refuse them
with a ``ValueError`` before any remote work.

Used by ``tests/test_zoo.py`` and ``experiments/zoo_coverage.py``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from bigconv.compat import allow_torchvision_without_ops

allow_torchvision_without_ops()  # before torchvision (and timm/smp, which import it)

NUM_CLASSES = 3
EXPECTED = ("exact", "ill-conditioned", "refused")
"""An entry's declared verdict. ``ill-conditioned``: at its input size rounding alone moves some tensor past 1e-9
of its size (``bigconv.verify``'s ``ill-conditioned at this size``), so the test asks for that verdict with no tensor
wrong, and fails on ``exact`` (update the declaration) as on ``not exact``."""


@dataclass(frozen=True)
class ZooEntry:
    name: str                   # "library/model"
    family: str
    library: str                # torchvision | timm | smp | monai
    factory: Callable[[], nn.Module]
    shape: tuple                # input shape (N, C, *spatial)
    workers: int
    grid: tuple
    dense: bool                 # per-pixel CrossEntropy target (else a class label per sample)
    num_classes: int = NUM_CLASSES
    fast: bool = False          # in the default (fast) test subset
    expect: str = "exact"       # "exact" | "ill-conditioned" | "refused"
    reason: str = ""            # why refused, or why ill-conditioned at this size (which tensors, what amplifies)
    match: str = ""             # regex the refusal's message must match (it names the operation)
    note: str = ""              # how the model was built / wrapped

    def __post_init__(self) -> None:
        if self.expect not in EXPECTED:
            raise ValueError(f"{self.name}: expect must be one of {EXPECTED}, got {self.expect!r}")
        if self.expect != "exact" and not self.reason:
            raise ValueError(f"{self.name}: expect={self.expect!r} needs a reason")

    @property
    def spatial_dims(self) -> int:
        return len(self.shape) - 2

    def build(self) -> nn.Module:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return self.factory()

    def inputs(self, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) in float64: y is a per-pixel class map when ``dense``, else a label per sample."""
        x = torch.randn(self.shape, dtype=torch.float64, generator=generator)
        if self.dense:
            y = torch.randint(0, self.num_classes, (self.shape[0], *self.shape[2:]), generator=generator)
        else:
            y = torch.randint(0, self.num_classes, (self.shape[0],), generator=generator)
        return x, y


def zero_dropout(model: nn.Module) -> nn.Module:
    """Set ``p = 0`` on dropout layers a constructor does not expose (torchvision's FCNHead and ASPP,
    MONAI's VNet up-transitions): what a user does to train such a model deterministically."""
    for m in model.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            m.p = 0.0
    return model


class FirstOutput(nn.Module):
    """``model(x)[0]``: a model that returns its map beside tokens (MONAI's ViTAutoEnc: the map and every block's
    tokens), as a user trains it, and as bigconv's refusal of the returned tokens says to wrap it."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)[0]


class OutOnly(nn.Module):
    """``model(x)["out"]``: torchvision's segmentation models return a dict of outputs."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)["out"]


# ----------------------------------------------------------------------------------------------------
# torchvision
# ----------------------------------------------------------------------------------------------------
def _tv():
    import torchvision.models as tvm
    return tvm


def tv_resnet18():
    from torchvision.models.resnet import BasicBlock, ResNet
    return ResNet(BasicBlock, [1, 1, 1, 1], num_classes=NUM_CLASSES)


def tv_resnext():
    from torchvision.models.resnet import Bottleneck, ResNet
    return ResNet(Bottleneck, [1, 1, 1, 1], groups=4, width_per_group=4, num_classes=NUM_CLASSES)


def tv_wide_resnet():
    # wide_resnet50_2's width_per_group=128 on one block per stage, 1/4 of the base widths otherwise not
    # reachable through ResNet's constructor.
    from torchvision.models.resnet import Bottleneck, ResNet
    return ResNet(Bottleneck, [1, 1, 1, 1], width_per_group=128, num_classes=NUM_CLASSES)


def tv_vgg11():
    from torchvision.models.vgg import VGG, cfgs, make_layers
    return VGG(make_layers(cfgs["A"], batch_norm=False), num_classes=NUM_CLASSES, dropout=0.0)


def tv_vgg11_bn():
    from torchvision.models.vgg import VGG, cfgs, make_layers
    return VGG(make_layers(cfgs["A"], batch_norm=True), num_classes=NUM_CLASSES, dropout=0.0)


def tv_alexnet():
    return _tv().alexnet(weights=None, num_classes=NUM_CLASSES, dropout=0.0)


def tv_squeezenet():
    return _tv().squeezenet1_1(weights=None, num_classes=NUM_CLASSES, dropout=0.0)


def tv_densenet():
    from torchvision.models.densenet import DenseNet
    return DenseNet(growth_rate=8, block_config=(2, 2, 2, 2), num_init_features=16, bn_size=2,
                    num_classes=NUM_CLASSES)


def tv_mobilenet_v2():
    return _tv().mobilenet_v2(weights=None, num_classes=NUM_CLASSES, width_mult=0.25, dropout=0.0)


def tv_mobilenet_v3_small():
    return _tv().mobilenet_v3_small(weights=None, num_classes=NUM_CLASSES, width_mult=0.25, dropout=0.0)


def tv_mobilenet_v3_large():
    return _tv().mobilenet_v3_large(weights=None, num_classes=NUM_CLASSES, width_mult=0.25, dropout=0.0)


def tv_mnasnet():
    from torchvision.models.mnasnet import MNASNet
    return MNASNet(alpha=0.5, num_classes=NUM_CLASSES, dropout=0.0)


def tv_shufflenet_v2():
    from torchvision.models.shufflenetv2 import ShuffleNetV2
    return ShuffleNetV2([1, 1, 1], [8, 16, 32, 64, 128], num_classes=NUM_CLASSES)


def tv_efficientnet_b0():
    from torchvision.models.efficientnet import EfficientNet, _efficientnet_conf
    setting, last = _efficientnet_conf("efficientnet_b0", width_mult=0.25, depth_mult=0.34)
    return EfficientNet(setting, dropout=0.0, stochastic_depth_prob=0.0, num_classes=NUM_CLASSES, last_channel=last)


def tv_efficientnet_v2_s():
    # efficientnet_v2_s's structure (FusedMBConv stages, then MBConv with SE), one block per stage,
    # narrow channels: its builder takes no width argument.
    from functools import partial

    from torchvision.models.efficientnet import EfficientNet, FusedMBConvConfig, MBConvConfig
    setting = [
        FusedMBConvConfig(1, 3, 1, 8, 8, 1),
        FusedMBConvConfig(4, 3, 2, 8, 16, 1),
        FusedMBConvConfig(4, 3, 2, 16, 24, 1),
        MBConvConfig(4, 3, 2, 24, 32, 1),
        MBConvConfig(6, 3, 1, 32, 40, 1),
        MBConvConfig(6, 3, 2, 40, 64, 1),
    ]
    return EfficientNet(setting, dropout=0.0, stochastic_depth_prob=0.0, num_classes=NUM_CLASSES,
                        norm_layer=partial(nn.BatchNorm2d, eps=1e-03), last_channel=128)


def tv_regnet_x():
    from torchvision.models.regnet import BlockParams, RegNet
    params = BlockParams.from_init_params(depth=4, w_0=8, w_a=8.0, w_m=2.0, group_width=8)
    return RegNet(params, num_classes=NUM_CLASSES, stem_width=8)


def tv_regnet_y():
    from torchvision.models.regnet import BlockParams, RegNet
    params = BlockParams.from_init_params(depth=4, w_0=8, w_a=8.0, w_m=2.0, group_width=8, se_ratio=0.25)
    return RegNet(params, num_classes=NUM_CLASSES, stem_width=8)


def tv_convnext():
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt
    setting = [CNBlockConfig(16, 32, 1), CNBlockConfig(32, 64, 1), CNBlockConfig(64, 128, 1),
               CNBlockConfig(128, None, 1)]
    return ConvNeXt(setting, stochastic_depth_prob=0.0, num_classes=NUM_CLASSES)


def tv_googlenet():
    return _tv().googlenet(weights=None, num_classes=NUM_CLASSES, aux_logits=False, transform_input=False,
                           init_weights=True, dropout=0.0)


def tv_inception_v3():
    return _tv().inception_v3(weights=None, num_classes=NUM_CLASSES, aux_logits=False, transform_input=False,
                              init_weights=True, dropout=0.0)


def _tv_bottleneck_backbone():
    # resnet50's Bottleneck with one block per stage, thinner mid widths, dilated as in fcn_resnet50.
    from torchvision.models.resnet import Bottleneck, ResNet
    return ResNet(Bottleneck, [1, 1, 1, 1], width_per_group=16, replace_stride_with_dilation=[False, True, True])


def tv_fcn_resnet50():
    from torchvision.models.segmentation.fcn import _fcn_resnet
    return OutOnly(zero_dropout(_fcn_resnet(_tv_bottleneck_backbone(), NUM_CLASSES, False)))


def tv_deeplabv3_resnet50():
    from torchvision.models.segmentation.deeplabv3 import _deeplabv3_resnet
    return OutOnly(zero_dropout(_deeplabv3_resnet(_tv_bottleneck_backbone(), NUM_CLASSES, False)))


def tv_deeplabv3_mobilenet_v3_large():
    from torchvision.models.segmentation.deeplabv3 import _deeplabv3_mobilenetv3
    backbone = _tv().mobilenet_v3_large(weights=None, dilated=True, width_mult=0.25)
    return OutOnly(zero_dropout(_deeplabv3_mobilenetv3(backbone, NUM_CLASSES, False)))


def tv_lraspp_mobilenet_v3_large():
    from torchvision.models.segmentation.lraspp import _lraspp_mobilenetv3
    backbone = _tv().mobilenet_v3_large(weights=None, dilated=True, width_mult=0.25)
    return OutOnly(_lraspp_mobilenetv3(backbone, NUM_CLASSES))


# ----------------------------------------------------------------------------------------------------
# timm
# ----------------------------------------------------------------------------------------------------
def timm_model(name: str, **kwargs) -> Callable[[], nn.Module]:
    kwargs.setdefault("drop_rate", 0.0)  # rexnet and ghostnet default to 0.2 (dropout in the head)

    def factory():
        import timm
        return timm.create_model(name, pretrained=False, num_classes=NUM_CLASSES, **kwargs)
    factory.__name__ = f"timm_{name}"
    return factory


def _efficientvit_b0_float64() -> nn.Module:
    from issue37_models import efficientvit_b0_float64

    return efficientvit_b0_float64(NUM_CLASSES)


# ----------------------------------------------------------------------------------------------------
# segmentation_models_pytorch
# ----------------------------------------------------------------------------------------------------
def _hipt() -> nn.Module:
    from hipt_models import hipt

    return hipt()


def monai_vit_autoenc() -> nn.Module:
    from monai.networks.nets import ViTAutoEnc
    return FirstOutput(ViTAutoEnc(in_channels=3, img_size=32, patch_size=4, out_channels=NUM_CLASSES, deconv_chns=8,
                                  hidden_size=32, mlp_dim=64, num_layers=2, num_heads=2, spatial_dims=2))


def smp_model(arch: str, **kwargs) -> Callable[[], nn.Module]:
    def factory():
        import segmentation_models_pytorch as smp
        args = dict(encoder_name="resnet18", encoder_weights=None, in_channels=3, classes=NUM_CLASSES)
        args.update(kwargs)
        return getattr(smp, arch)(**args)
    factory.__name__ = f"smp_{arch}"
    return factory


# ----------------------------------------------------------------------------------------------------
# MONAI
# ----------------------------------------------------------------------------------------------------
def monai_unet(dims):
    from monai.networks.nets import UNet
    return UNet(dims, 1, NUM_CLASSES, channels=(4, 8, 16), strides=(2, 2), num_res_units=2, norm="batch")


def monai_basic_unet():
    from monai.networks.nets import BasicUNet
    return BasicUNet(2, 1, NUM_CLASSES, features=(4, 4, 8, 8, 16, 4))


def monai_dynunet(dims):
    from monai.networks.nets import DynUNet
    return DynUNet(dims, 1, NUM_CLASSES, kernel_size=[3, 3, 3], strides=[1, 2, 2], upsample_kernel_size=[2, 2],
                   filters=[4, 8, 16], norm_name="instance", res_block=True)


def monai_segresnet(dims):
    from monai.networks.nets import SegResNet
    return SegResNet(dims, init_filters=4, in_channels=1, out_channels=NUM_CLASSES, blocks_down=(1, 1, 2),
                     blocks_up=(1, 1), norm=("group", {"num_groups": 2}))


def monai_vnet():
    from monai.networks.nets import VNet
    return zero_dropout(VNet(2, 1, NUM_CLASSES, dropout_prob_down=0.0, dropout_prob_up=(0.0, 0.0), dropout_dim=2))


def monai_highresnet():
    from monai.networks.nets import HighResNet
    layers = ({"name": "conv_0", "n_features": 4, "kernel_size": 3},
              {"name": "res_1", "n_features": 4, "kernels": (3, 3), "repeat": 1},
              {"name": "res_2", "n_features": 8, "kernels": (3, 3), "repeat": 1},
              {"name": "res_3", "n_features": 16, "kernels": (3, 3), "repeat": 1},
              {"name": "conv_1", "n_features": 16, "kernel_size": 1},
              {"name": "conv_2", "kernel_size": 1})
    return HighResNet(2, 1, NUM_CLASSES, layer_params=layers)


def monai_attention_unet():
    from monai.networks.nets import AttentionUnet
    return AttentionUnet(2, 1, NUM_CLASSES, channels=(4, 8, 16), strides=(2, 2))


def monai_densenet121():
    from monai.networks.nets import DenseNet121
    return DenseNet121(2, 1, NUM_CLASSES, init_features=4, growth_rate=2, block_config=(1, 1, 1, 1))


def monai_resnet():
    from monai.networks.nets import ResNet
    return ResNet("basic", [1, 1, 1, 1], [4, 8, 8, 16], spatial_dims=2, n_input_channels=1, num_classes=NUM_CLASSES)


def monai_seresnet50():
    from monai.networks.nets import SEResNet50
    return SEResNet50(layers=(1, 1, 1, 1), spatial_dims=2, in_channels=1, num_classes=NUM_CLASSES, inplanes=16)


def monai_efficientnet():
    # EfficientNetBN("efficientnet-b0")'s blocks through the EfficientNet class, which (unlike
    # EfficientNetBN) lets width, dropout and drop-connect be set.
    from monai.networks.nets.efficientnet import EfficientNet
    blocks = ["r1_k3_s11_e1_i32_o16_se0.25", "r2_k3_s22_e6_i16_o24_se0.25", "r2_k5_s22_e6_i24_o40_se0.25",
              "r3_k3_s22_e6_i40_o80_se0.25", "r3_k5_s11_e6_i80_o112_se0.25", "r4_k5_s22_e6_i112_o192_se0.25",
              "r1_k3_s11_e6_i192_o320_se0.25"]
    return EfficientNet(blocks, spatial_dims=2, in_channels=1, num_classes=NUM_CLASSES, width_coefficient=0.25,
                        depth_coefficient=0.34, dropout_rate=0.0, image_size=64, drop_connect_rate=0.0)


def monai_flexible_unet():
    from monai.networks.nets import FlexibleUNet
    return FlexibleUNet(1, NUM_CLASSES, backbone="resnet10", pretrained=False, spatial_dims=2,
                        decoder_channels=(32, 16, 8, 8, 4))


# ----------------------------------------------------------------------------------------------------
# The registry
def monai_subpixel_decoder():
    """MONAI's ``SubpixelUpsample`` (conv to r^d times the channels, MONAI's own pixel shuffle) as a
    decoder step back to the input's size."""
    from monai.networks.blocks import SubpixelUpsample
    return nn.Sequential(nn.Conv2d(1, 8, 3, stride=2, padding=1), nn.ReLU(),
                         SubpixelUpsample(2, 8, 4, scale_factor=2), nn.Conv2d(4, NUM_CLASSES, 3, padding=1))


# ----------------------------------------------------------------------------------------------------
# written with torch.nn only, as the papers' users write them
# ----------------------------------------------------------------------------------------------------
class SubPixelSR(nn.Module):
    """ESPCN (Shi et al. 2016) as a decoder: a strided encoder, then conv to r*r times the channels
    and ``PixelShuffle`` back to the input's size."""

    def __init__(self, width: int = 8, r: int = 2) -> None:
        super().__init__()
        self.encode = nn.Sequential(nn.Conv2d(1, width, 5, stride=r, padding=2), nn.Tanh(),
                                    nn.Conv2d(width, width, 3, padding=1), nn.Tanh())
        self.subpixel = nn.Sequential(nn.Conv2d(width, width * r * r, 3, padding=1), nn.PixelShuffle(r))
        self.head = nn.Conv2d(width, NUM_CLASSES, 3, padding=1)

    def forward(self, x):
        return self.head(self.subpixel(self.encode(x)))


class SpaceToDepthNet(nn.Module):
    """TResNet's stem written with ``nn.PixelUnshuffle(4)`` (space to depth), then a small residual body
    and a global-pooling head."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.PixelUnshuffle(4), nn.Conv2d(16, width, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(width), nn.LeakyReLU(0.01))
        self.body = nn.Sequential(nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width),
                                  nn.ReLU(), nn.Conv2d(width, width, 3, padding=1))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, NUM_CLASSES))

    def forward(self, x):
        y = self.stem(x)
        return self.head(torch.relu(y + self.body(y)))


def _center_crop(skip: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    dh, dw = (skip.shape[-2] - like.shape[-2]) // 2, (skip.shape[-1] - like.shape[-1]) // 2
    return skip[:, :, dh:dh + like.shape[-2], dw:dw + like.shape[-1]]


class ValidUNet(nn.Module):
    """The original U-Net's valid convolutions (and HoVerNet's): the input is mirror-padded by the
    border it loses, and each skip is center-cropped to the upsampled map it joins."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()

        def block(cin, cout):
            return nn.Sequential(nn.Conv2d(cin, cout, 3), nn.ReLU(), nn.Conv2d(cout, cout, 3), nn.ReLU())

        self.down, self.bottom = block(1, width), block(width, 2 * width)
        self.pool = nn.MaxPool2d(2)
        self.up = nn.ConvTranspose2d(2 * width, width, 2, stride=2)
        self.decode = block(2 * width, width)
        self.head = nn.Conv2d(width, NUM_CLASSES, 1)

    def forward(self, x):
        x = nn.functional.pad(x, (8, 8, 8, 8), mode="reflect")  # the 16 rows and columns the valid convs lose
        skip = self.down(x)
        y = self.up(self.bottom(self.pool(skip)))
        return self.head(self.decode(torch.cat([_center_crop(skip, y), y], dim=1)))


class AttentionPoolNet(nn.Module):
    """A conv trunk with an attention-pooling head: softmax over the flattened positions, contracted
    with the features by ``einsum``, and a ``GlobalContext``-style gate by ``matmul`` before it."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Conv2d(1, width, 3, padding=1), nn.GroupNorm(2, width), nn.ReLU(),
                                   nn.Conv2d(width, width, 3, stride=2, padding=1), nn.ReLU())
        self.gc_attn = nn.Conv2d(width, 1, 1)
        self.gc_mlp = nn.Sequential(nn.Linear(width, width // 2), nn.ReLU(), nn.Linear(width // 2, width))
        self.pool_logits = nn.Conv2d(width, 2, 1)
        self.fc = nn.Linear(2 * width, NUM_CLASSES)

    def forward(self, x):
        y = self.trunk(x)
        b, c, h, w = y.shape
        attn = torch.softmax(self.gc_attn(y).reshape(b, 1, h * w), dim=-1).unsqueeze(3)
        context = (y.reshape(b, c, h * w).unsqueeze(1) @ attn).view(b, c)
        y = y * torch.sigmoid(self.gc_mlp(context)).view(b, c, 1, 1)
        weights = self.pool_logits(y).flatten(2).softmax(dim=-1)  # two pooling queries
        pooled = torch.einsum("bcp,bqp->bqc", y.flatten(2), weights)
        return self.fc(pooled.flatten(1))


# ----------------------------------------------------------------------------------------------------
def _e(name, family, factory, shape, workers, grid, dense=False, **kw) -> ZooEntry:
    return ZooEntry(name=name, family=family, library=name.split("/")[0], factory=factory, shape=tuple(shape),
                    workers=workers, grid=tuple(grid), dense=dense, **kw)


ATTENTION = "self-attention over all positions (a matmul across the flattened spatial map)"

ZOO: list[ZooEntry] = [
    # -- torchvision classification ---------------------------------------------------------------
    _e("torchvision/resnet18", "resnet", tv_resnet18, (2, 3, 64, 64), 4, (2, 2), fast=True,
       note="ResNet(BasicBlock, [1,1,1,1])"),
    _e("torchvision/resnext", "resnet", tv_resnext, (2, 3, 72, 88), 2, (2, 1),
       note="ResNet(Bottleneck, [1,1,1,1], groups=4, width_per_group=4)"),
    _e("torchvision/wide_resnet", "resnet", tv_wide_resnet, (2, 3, 64, 64), 2, (1, 2),
       note="ResNet(Bottleneck, [1,1,1,1], width_per_group=128)"),
    _e("torchvision/vgg11", "vgg", tv_vgg11, (2, 3, 64, 64), 2, (2, 1), note="VGG(cfg A), dropout=0"),
    _e("torchvision/vgg11_bn", "vgg", tv_vgg11_bn, (2, 3, 64, 64), 2, (1, 2), note="VGG(cfg A, batch_norm), dropout=0"),
    _e("torchvision/alexnet", "alexnet", tv_alexnet, (2, 3, 80, 80), 2, (2, 1), note="dropout=0"),
    _e("torchvision/squeezenet1_1", "squeezenet", tv_squeezenet, (2, 3, 64, 64), 2, (1, 2), fast=True,
       note="dropout=0"),
    _e("torchvision/densenet", "densenet", tv_densenet, (2, 3, 64, 64), 4, (2, 2),
       note="DenseNet(growth 8, blocks (2,2,2,2), 16 init features)"),
    _e("torchvision/mobilenet_v2", "mobilenet", tv_mobilenet_v2, (2, 3, 64, 64), 3, (3, 1),
       note="width_mult=0.25, dropout=0"),
    _e("torchvision/mobilenet_v3_small", "mobilenet", tv_mobilenet_v3_small, (2, 3, 64, 64), 2, (2, 1), fast=True,
       note="width_mult=0.25, dropout=0"),
    _e("torchvision/mobilenet_v3_large", "mobilenet", tv_mobilenet_v3_large, (2, 3, 72, 88), 4, (2, 2),
       note="width_mult=0.25, dropout=0"),
    _e("torchvision/mnasnet0_5", "mnasnet", tv_mnasnet, (2, 3, 64, 64), 2, (1, 2),
       note="MNASNet(alpha=0.5), dropout=0"),
    _e("torchvision/shufflenet_v2", "shufflenet", tv_shufflenet_v2, (2, 3, 64, 64), 2, (2, 1),
       note="ShuffleNetV2([1,1,1], [8,16,32,64,128])"),
    _e("torchvision/efficientnet_b0", "efficientnet", tv_efficientnet_b0, (2, 3, 64, 64), 4, (2, 2),
       note="_efficientnet_conf(b0, width 0.25, depth 0.34), no dropout/stochastic depth"),
    _e("torchvision/efficientnet_v2_s", "efficientnet", tv_efficientnet_v2_s, (2, 3, 64, 64), 2, (1, 2),
       note="v2_s structure (Fused-MBConv then MBConv), 1 block/stage, narrow"),
    _e("torchvision/regnet_x", "regnet", tv_regnet_x, (2, 3, 64, 64), 2, (2, 1), note="RegNet(depth 4, w_0 8)"),
    _e("torchvision/regnet_y", "regnet", tv_regnet_y, (2, 3, 72, 88), 3, (1, 3), note="RegNet(depth 4, w_0 8, SE)"),
    _e("torchvision/convnext", "convnext", tv_convnext, (2, 3, 64, 64), 2, (2, 1),
       note="ConvNeXt(1 block/stage, dims 16..128), stochastic_depth_prob=0"),
    _e("torchvision/swin_t", "swin", lambda: _tv().swin_t(num_classes=NUM_CLASSES), (1, 3, 112, 112), 4, (2, 2),
       note="unchanged swin_t (stochastic depth 0.2 drawn by position) at 112 px: windows of 7 split by the rules "
       "on 28x28 and 14x14 maps, 7x7 and 4x4 held whole (bigconv/ops/windows.py)"),
    _e("torchvision/swin_v2_t", "swin", lambda: _tv().swin_v2_t(num_classes=NUM_CLASSES), (1, 3, 128, 128), 4,
       (2, 2), note="unchanged swin_v2_t at 128 px: windows of 8 split on 32x32 and 16x16, 8x8 and 4x4 held whole"),
    _e("torchvision/googlenet", "inception", tv_googlenet, (2, 3, 64, 64), 2, (2, 1),
       note="aux_logits=False, transform_input=False, dropout=0"),
    _e("torchvision/inception_v3", "inception", tv_inception_v3, (4, 3, 128, 128), 2, (1, 2),
       note="aux_logits=False, transform_input=False, dropout=0; batch 4 at 128 px", expect="ill-conditioned",
       reason="since the optimizer state is judged (issue 48): Mixed_7c.branch_pool's momentum buffer (size 0.19) "
              "moves by 2.8e-10 under rounding alone, past 1e-9 of its size; the decomposition by 1.8e-10 (CI "
              "clone run, 2026-11-29)"),
    # -- torchvision segmentation (dict outputs: OutOnly returns ["out"]) ---------------------------
    _e("torchvision/fcn_resnet50", "fcn", tv_fcn_resnet50, (1, 3, 64, 64), 2, (2, 1), dense=True,
       note="OutOnly(_fcn_resnet(ResNet(Bottleneck,[1,1,1,1],width_per_group=16,dilated))), FCNHead dropout p=0"),
    _e("torchvision/deeplabv3_resnet50", "deeplab", tv_deeplabv3_resnet50, (2, 3, 64, 64), 2, (1, 2), dense=True,
       note="OutOnly(_deeplabv3_resnet(ResNet(Bottleneck,[1,1,1,1],width_per_group=16,dilated))), ASPP dropout p=0"),
    _e("torchvision/deeplabv3_mobilenet_v3_large", "deeplab", tv_deeplabv3_mobilenet_v3_large, (2, 3, 64, 64), 4,
       (2, 2), dense=True,
       note="OutOnly(_deeplabv3_mobilenetv3(mobilenet_v3_large(width_mult=0.25, dilated))), ASPP dropout p=0"),
    _e("torchvision/lraspp_mobilenet_v3_large", "lraspp", tv_lraspp_mobilenet_v3_large, (2, 3, 64, 64), 2, (2, 1),
       dense=True, fast=True, note="OutOnly(_lraspp_mobilenetv3(mobilenet_v3_large(width_mult=0.25, dilated)))"),
    # -- timm ----------------------------------------------------------------------------------------
    _e("timm/resnet18", "resnet", timm_model("resnet18", layers=(1, 1, 1, 1), channels=(16, 32, 64, 128)),
       (2, 3, 64, 64), 4, (2, 2), fast=True, note="layers (1,1,1,1), channels 16..128"),
    _e("timm/resnext26ts", "resnet", timm_model("resnext26ts"), (2, 3, 64, 64), 2, (1, 2)),
    _e("timm/seresnet18", "resnet", timm_model("seresnet18", layers=(1, 1, 1, 1), channels=(16, 32, 64, 128)),
       (2, 3, 72, 88), 2, (2, 1), note="layers (1,1,1,1), channels 16..128"),
    _e("timm/resnest14d", "resnest", timm_model("resnest14d"), (2, 3, 64, 64), 2, (2, 1)),
    _e("timm/skresnet18", "sknet", timm_model("skresnet18", layers=(1, 1, 1, 1)), (2, 3, 64, 64), 2, (1, 2),
       note="layers (1,1,1,1)"),
    _e("timm/regnetx_002", "regnet", timm_model("regnetx_002"), (2, 3, 64, 64), 2, (2, 1)),
    _e("timm/regnety_002", "regnet", timm_model("regnety_002"), (2, 3, 64, 64), 4, (2, 2)),
    _e("timm/tinynet_e", "efficientnet", timm_model("tinynet_e"), (2, 3, 64, 64), 2, (2, 1)),
    _e("timm/tf_efficientnet_lite0", "efficientnet", timm_model("tf_efficientnet_lite0"), (2, 3, 72, 88), 2, (2, 1),
       fast=True, note="TF 'same' padding"),
    _e("timm/tf_efficientnetv2_b0", "efficientnet", timm_model("tf_efficientnetv2_b0"), (2, 3, 64, 64), 4, (2, 2),
       note="TF 'same' padding"),
    _e("timm/mobilenetv3_small_050", "mobilenet", timm_model("mobilenetv3_small_050"), (2, 3, 64, 64), 2, (1, 2)),
    _e("timm/mobilenetv4_conv_small_050", "mobilenet", timm_model("mobilenetv4_conv_small_050"), (4, 3, 96, 96), 2,
       (2, 1), note="batch 4 at 96²: at 2×64² its last BatchNorms see 8 values and one process's own rounding "
       "moves the loss by 1e-8"),
    _e("timm/tinynet_e_droppath", "efficientnet", timm_model("tinynet_e", drop_path_rate=0.2, drop_rate=0.3),
       (2, 3, 64, 64), 4, (2, 2), note="drop_path_rate=0.2 and head dropout 0.3, in training mode"),
    _e("timm/mixnet_s", "efficientnet", timm_model("mixnet_s"), (2, 3, 64, 64), 2, (2, 1)),
    _e("timm/lcnet_050", "mobilenet", timm_model("lcnet_050"), (2, 3, 64, 64), 3, (3, 1)),
    _e("timm/convnext_atto", "convnext",
       timm_model("convnext_atto", depths=(1, 1, 1, 1), dims=(16, 32, 64, 128)), (2, 3, 64, 64), 2, (2, 1), fast=True,
       note="conv_mlp=True (LayerNorm2d), depths 1, dims 16..128"),
    _e("timm/convnext_atto_droppath", "convnext",
       timm_model("convnext_atto", depths=(1, 2, 1, 1), dims=(16, 32, 64, 128), drop_path_rate=0.3), (2, 3, 64, 64),
       4, (2, 2), note="drop_path_rate=0.3 in training mode: stochastic depth drawn once per image, equal on every "
       "shard (bigconv.ops.random)"),
    _e("timm/convnext_atto_linear", "convnext",
       timm_model("convnext_atto", depths=(1, 1, 1, 1), dims=(16, 32, 64, 128), conv_mlp=False), (2, 3, 64, 64), 2,
       (1, 2), note="conv_mlp=False: channels-last LayerNorm + Linear MLP"),
    _e("timm/densenet121", "densenet", timm_model("densenet121", growth_rate=8, block_config=(2, 2, 2, 2)),
       (2, 3, 64, 64), 2, (2, 1), note="growth 8, blocks (2,2,2,2)"),
    _e("timm/cspresnet50", "cspnet", timm_model("cspresnet50"), (2, 3, 64, 64), 2, (1, 2)),
    _e("timm/cs3darknet_focus_s", "cspnet", timm_model("cs3darknet_focus_s"), (2, 3, 64, 64), 2, (2, 1),
       note="Focus stem (space-to-depth)"),
    _e("timm/hrnet_w18_small", "hrnet", timm_model("hrnet_w18_small"), (2, 3, 64, 64), 2, (2, 1)),
    _e("timm/dla46_c", "dla", timm_model("dla46_c"), (2, 3, 64, 64), 4, (2, 2)),
    _e("timm/dpn48b", "dpn", timm_model("dpn48b", k_sec=(1, 1, 1, 1)), (2, 3, 64, 64), 2, (2, 1),
       note="k_sec (1,1,1,1)"),
    _e("timm/rexnet_100", "rexnet", timm_model("rexnet_100", width_mult=0.5), (4, 3, 96, 96), 2, (1, 2),
       note="width_mult=0.5; batch 4 at 96² (at 2×64² one process's own rounding moves the weights by 5e-8)"),
    _e("timm/ghostnet_050", "ghostnet", timm_model("ghostnet_050"), (2, 3, 64, 64), 2, (2, 1)),
    _e("timm/ghostnetv2_100", "ghostnet", timm_model("ghostnetv2_100"), (2, 3, 64, 64), 2, (1, 2),
       note="DFC attention: pooled gate interpolated back (local, decomposable)", expect="ill-conditioned",
       reason="the DFC branches' short_conv BatchNorm weight gradients (7e-11 to 3e-9) cancel; rounding alone "
              "moves them by 1e-7 to 2e-7 of their size in one process (2026-11-29)"),
    _e("timm/res2net50_14w_8s", "res2net", timm_model("res2net50_14w_8s", layers=(1, 1, 1, 1)), (2, 3, 64, 64), 2,
       (2, 1), note="layers (1,1,1,1)"),
    _e("timm/selecsls42b", "selecsls", timm_model("selecsls42b"), (8, 3, 64, 64), 2, (2, 1),
       note="batch 8: at batch 2 rounding noise alone moves the weights by 1e-7"),
    _e("timm/ese_vovnet19b_slim_dw", "vovnet", timm_model("ese_vovnet19b_slim_dw"), (2, 3, 64, 64), 2, (1, 2)),
    _e("timm/xception41", "xception", timm_model("xception41"), (2, 3, 64, 64), 2, (2, 1)),
    _e("timm/repvgg_a0", "byobnet", timm_model("repvgg_a0"), (2, 3, 64, 64), 2, (2, 1), expect="ill-conditioned",
       reason="since the optimizer state is judged (issue 48): stage 2's momentum buffers (sizes 0.02-0.07) move "
              "by 1.5e-11 to 4.3e-11 under rounding alone, past 1e-9 of their size; the decomposition by twice "
              "that (CI clone run, 2026-11-29)"),
    _e("timm/gernet_s", "byobnet", timm_model("gernet_s"), (2, 3, 64, 64), 2, (1, 2)),
    _e("timm/nf_regnet_b0", "nfnet", timm_model("nf_regnet_b0"), (2, 3, 64, 64), 2, (2, 1),
       note="scaled weight-standardized convs, no norm layers"),
    _e("timm/inception_v3", "inception", timm_model("inception_v3"), (4, 3, 128, 128), 2, (2, 1),
       note="batch 4 at 128 px: at 2x80x80 its 1x1 maps make batch norm ill-conditioned (rounding noise 2e-2)",
       expect="ill-conditioned",
       reason="since the optimizer state is judged (issue 48): Mixed_6's momentum buffers (sizes 0.5-1.4) move "
              "by 5e-10 to 1.7e-9 under rounding alone, past 1e-9 of their size (CI clone run, 2026-11-29)"),
    _e("timm/tresnet_m", "tresnet", timm_model("tresnet_m"), (2, 3, 64, 64), 2, (2, 1),
       note="space-to-depth stem (timm's view-permute-view, decomposed as space to depth), anti-aliased "
       "downsampling"),
    _e("timm/hgnetv2_b0", "hgnet", timm_model("hgnetv2_b0"), (2, 3, 64, 64), 2, (2, 1), expect="ill-conditioned",
       reason="the learnable-affine scales' gradients (1.6e-8, 6.7e-8) cancel; rounding alone moves them by "
              "2e-16 to 6e-16, past 1e-9 of their size, and so their momentum buffers (CI clone run, 2026-11-29)"),
    _e("timm/swin_tiny_patch4_window7_224", "swin", timm_model("swin_tiny_patch4_window7_224", img_size=112),
       (1, 3, 112, 112), 4, (2, 2), note="img_size=112; PatchMerging's reshape re-sharded by whole 2x2 blocks"),
    _e("timm/swinv2_tiny_window8_256", "swin", timm_model("swinv2_tiny_window8_256", img_size=128),
       (1, 3, 128, 128), 4, (2, 2), note="img_size=128"),
    _e("timm/botnet26t_256", "botnet", timm_model("botnet26t_256", img_size=64), (2, 3, 64, 64), 4, (2, 2),
       note="img_size=64; BottleneckAttn over all positions of its 4x4 and 2x2 maps by ring attention, relative "
       "positions global (bigconv.ops.global_attention)"),
    _e("timm/vit_small_patch16_224_gap", "vit", timm_model("vit_small_patch16_224", img_size=64, depth=2,
                                                          class_token=False, global_pool="avg"),
       (2, 3, 64, 64), 4, (2, 2), note="img_size=64, depth=2, class_token=False, global_pool='avg': its blocks' SDPA "
       "over 4x4 patch tokens by ring attention, the position embedding cut per shard"),
    _e("timm/edgenext_xx_small", "edgenext", timm_model("edgenext_xx_small"), (1, 3, 64, 64), 4, (2, 2),
       note="unchanged: its positional encoding's cumsum over rows and columns (a prefix sum across shards) and "
       "cross-covariance attention (channels normalized over all positions: a global norm; q k^T over positions)"),
    _e("timm/halonet26t", "halonet", timm_model("halonet26t"), (1, 3, 256, 256), 4, (2, 2),
       note="unchanged at 256 px (its last stage's blocks of 8 need a multiple of 256): blocks of 8 with halos of "
       "2 split on 16x16 (keys and values unfolded with a halo exchange), the 8x8 stage held whole"),
    _e("timm/efficientvit_b0", "efficientvit", _efficientvit_b0_float64, (1, 3, 128, 128), 4, (2, 2),
       note="LiteMLA's linear attention: heads by reshape into flattened positions, keys times values contracted over "
       "them (a global sum), F.pad of values by a row of ones, queries per position; reshaped back into the map. "
       "Its _attn casts to float32 (q.float()): kept in float64 here (tests/issue37_models.efficientvit_b0_float64)"),
    # -- segmentation_models_pytorch -----------------------------------------------------------------
    _e("smp/Unet", "unet", smp_model("Unet", encoder_depth=3, decoder_channels=(16, 8, 8)), (2, 3, 64, 64), 2,
       (2, 1), dense=True, fast=True, note="resnet18 encoder, depth 3"),
    _e("smp/Unet_efficientnet-b0", "unet", smp_model("Unet", encoder_name="efficientnet-b0", encoder_depth=3,
                                                     decoder_channels=(16, 8, 8)), (1, 3, 64, 64), 4, (2, 2),
       dense=True, note="smp's own EfficientNet: dynamic TF 'same' padding from x.shape (planned 65x65 before)"),
    _e("smp/UnetPlusPlus", "unet", smp_model("UnetPlusPlus", encoder_depth=3, decoder_channels=(16, 8, 8)),
       (1, 3, 64, 64), 4, (2, 2), dense=True, note="resnet18 encoder, depth 3"),
    _e("smp/FPN", "fpn", smp_model("FPN", encoder_depth=5, decoder_pyramid_channels=32,
                                   decoder_segmentation_channels=32, decoder_dropout=0.0),
       (2, 3, 64, 64), 2, (1, 2), dense=True, fast=True, note="resnet18 encoder, depth 5, dropout 0"),
    _e("smp/PSPNet", "pspnet", smp_model("PSPNet", encoder_depth=3, psp_out_channels=16, psp_dropout=0.0),
       (2, 3, 96, 96), 2, (2, 1), dense=True, note="resnet18 encoder, depth 3, dropout 0"),
    _e("smp/DeepLabV3", "deeplab", smp_model("DeepLabV3", encoder_depth=5, decoder_channels=16,
                                             decoder_aspp_dropout=0.0),
       (2, 3, 64, 64), 2, (2, 1), dense=True, note="resnet18 encoder, output stride 8, dropout 0"),
    _e("smp/DeepLabV3Plus", "deeplab", smp_model("DeepLabV3Plus", encoder_depth=5, decoder_channels=16,
                                                 decoder_aspp_dropout=0.0),
       (2, 3, 64, 64), 2, (1, 2), dense=True, note="resnet18 encoder, output stride 16, dropout 0"),
    _e("smp/Linknet", "linknet", smp_model("Linknet", encoder_depth=3), (2, 3, 64, 64), 3, (3, 1), dense=True,
       note="resnet18 encoder, depth 3"),
    _e("smp/MAnet", "manet", smp_model("MAnet", encoder_depth=3, decoder_channels=(16, 8, 8), decoder_pab_channels=8),
       (2, 3, 64, 64), 2, (2, 1), dense=True,
       note="resnet18 encoder, depth 3; its position attention runs on the whole (gathered) 8×8 centre map"),
    _e("smp/PAN", "pan", smp_model("PAN", encoder_depth=5, decoder_channels=16), (2, 3, 128, 128), 2, (2, 1),
       dense=True, note="resnet18 encoder, output stride 16 (its pyramid needs >= 128 px)", expect="ill-conditioned",
       reason="since the optimizer state is judged (issue 48): decoder.gau3.conv1's momentum buffer (size 0.0048) "
              "moves by 4e-11 under rounding alone, past 1e-9 of its size; the decomposition by 1.4e-11 (CI "
              "clone run, 2026-11-29)"),
    _e("smp/UPerNet", "upernet", smp_model("UPerNet", encoder_depth=3, decoder_channels=16), (2, 3, 64, 64), 2,
       (1, 2), dense=True, note="resnet18 encoder, depth 3"),
    _e("smp/Segformer", "segformer", smp_model("Segformer", encoder_depth=3, decoder_segmentation_channels=16),
       (2, 3, 64, 64), 2, (2, 1), dense=True, note="resnet18 encoder (not MiT), depth 3"),
    _e("smp/Unet_tu-mobilenetv3_small_050", "unet",
       smp_model("Unet", encoder_name="tu-mobilenetv3_small_050", encoder_depth=5, decoder_channels=(16, 16, 8, 8, 8)),
       (2, 3, 64, 64), 4, (2, 2), dense=True, note="timm-universal encoder"),
    # -- MONAI ---------------------------------------------------------------------------------------
    _e("monai/UNet", "unet", lambda: monai_unet(2), (2, 1, 40, 36), 2, (2, 1), dense=True,
       note="channels (4,8,16), 2 residual units, batch norm"),
    _e("monai/UNet3d", "unet", lambda: monai_unet(3), (2, 1, 16, 16, 16), 4, (2, 1, 2), dense=True,
       note="3D, channels (4,8,16)"),
    _e("monai/BasicUNet", "unet", monai_basic_unet, (1, 1, 48, 32), 3, (3, 1), dense=True),
    _e("monai/DynUNet", "unet", lambda: monai_dynunet(2), (2, 1, 32, 32), 2, (1, 2), dense=True, fast=True,
       note="filters (4,8,16), residual blocks, instance norm"),
    _e("monai/DynUNet3d", "unet", lambda: monai_dynunet(3), (1, 1, 16, 16, 16), 2, (2, 1, 1), dense=True,
       note="3D"),
    _e("monai/SegResNet", "segresnet", lambda: monai_segresnet(2), (2, 1, 32, 32), 4, (2, 2), dense=True, fast=True,
       note="init_filters 4, group norm (2 groups)"),
    _e("monai/SegResNet3d", "segresnet", lambda: monai_segresnet(3), (1, 1, 16, 16, 16), 4, (1, 2, 2), dense=True,
       note="3D"),
    _e("monai/VNet", "vnet", monai_vnet, (1, 1, 32, 32), 2, (2, 1), dense=True,
       note="2D, dropout 0 (up-transitions' fixed Dropout p set to 0)"),
    _e("monai/HighResNet", "highresnet", monai_highresnet, (2, 1, 32, 32), 2, (1, 2), dense=True,
       note="features 4/4/8/16"),
    _e("monai/AttentionUnet", "unet", monai_attention_unet, (2, 1, 32, 32), 2, (2, 1), dense=True, fast=True,
       note="channels (4,8,16); additive attention gates (pointwise)"),
    _e("monai/DenseNet121", "densenet", monai_densenet121, (2, 1, 32, 32), 4, (2, 2)),
    _e("monai/ResNet", "resnet", monai_resnet, (2, 1, 32, 24), 2, (1, 2)),
    _e("monai/SEResNet50", "senet", monai_seresnet50, (2, 1, 64, 64), 2, (2, 1), note="layers (1,1,1,1), inplanes 16"),
    _e("monai/EfficientNet", "efficientnet", monai_efficientnet, (2, 1, 64, 64), 2, (2, 1),
       note="b0 blocks, width 0.25, no dropout/drop-connect"),
    _e("monai/FlexibleUNet", "unet", monai_flexible_unet, (2, 1, 64, 64), 2, (1, 2), dense=True,
       note="resnet10 backbone"),
    _e("monai/SubpixelUpsample", "subpixel", monai_subpixel_decoder, (2, 1, 26, 22), 3, (3, 1), dense=True,
       note="a strided conv, then SubpixelUpsample (MONAI's own reshape-and-permute pixel shuffle) back"),
    # -- torch.nn only: sub-pixel layers, crops, attention pooling ------------------------------------
    _e("nn/ESPCN", "subpixel", SubPixelSR, (2, 1, 26, 22), 3, (3, 1), dense=True, fast=True,
       note="ESPCN as a decoder: PixelShuffle(2); shard borders off the factor"),
    _e("nn/SpaceToDepthStem", "tresnet", SpaceToDepthNet, (2, 1, 64, 44), 3, (3, 1), fast=True,
       note="TResNet-style PixelUnshuffle(4) stem; 64 rows over 3 shards, borders off multiples of 4"),
    _e("nn/ValidUNet", "unet", ValidUNet, (2, 1, 40, 36), 4, (2, 2), dense=True, fast=True,
       note="valid convolutions, center-cropped skip (x[:, :, a:b, c:d]) as in HoVerNet"),
    _e("nn/AttentionPool", "attention-pool", AttentionPoolNet, (2, 1, 30, 26), 3, (1, 3), fast=True,
       note="GlobalContext gate (reshape, softmax over positions, matmul) and an einsum attention-pooling head"),
    _e("nn/HIPT", "hipt", _hipt, (2, 3, 256, 256), 4, (2, 2),
       note="HIPT_4K.forward as mahmoodlab/HIPT writes it, scaled down (tests/hipt_models.hipt: 8-px patches, 64-px "
       "regions, depth 2 per level): the image unfolded into regions that become the batch, ViT-256 per region "
       "(its class token by expand + cat along the tokens) split with no exchange; ViT-4K over the 4x4 region "
       "grid gathered where its own class token joins, whole on every worker"),
    _e("timm/gcresnet33ts", "byobnet", timm_model("gcresnet33ts"), (2, 3, 64, 64), 2, (2, 1),
       note="GlobalContext attention (softmax over positions, matmul contracting them)"),
]

# -- issue 51: sequences' layouts in current backbones, ViTs at other sizes -----------------------------
ZOO += [
    _e("timm/vit_small_patch14_reg4_dinov2_dynamic", "vit", timm_model(
        "vit_small_patch14_reg4_dinov2", img_size=56, depth=2, dynamic_img_size=True), (2, 3, 70, 84), 4, (2, 2),
       note="DINOv2 with 4 registers built for 56 px (4x4 tokens), depth 2, run at 70x84 (5x6 tokens): the position "
       "embedding resampled by bicubic with antialias (float32, timm's resample_abs_pos_embed) computed whole and cut "
       "per shard; registers and class token whole; blocks' SDPA by ring passes"),
    _e("timm/samvit_base_patch16", "sam", timm_model(
        "samvit_base_patch16", img_size=80, embed_dim=64, depth=2, num_heads=2, window_size=3,
        global_attn_indexes=(1,), neck_chans=16), (2, 3, 80, 80), 4, (2, 2),
       note="SAM's image encoder, width 64, one windowed block (5x5 tokens padded to windows of 3) and one global "
       "block (ring passes, its decomposed relative position bias a mask over every key in one process's order)"),
    _e("timm/hiera_tiny_224", "hiera", timm_model(
        "hiera_tiny_224", img_size=64, embed_dim=32, num_heads=1, stages=(1, 1, 1, 1)), (2, 3, 64, 64), 4, (2, 2),
       note="Unroll's reorder into mask units (the offsets inside a unit in front of the units' positions), "
       "mask-unit attention per window, q-pooled global attention by ring passes; width 32, one block a stage"),
    _e("smp/DPT_tu-vit_small", "dpt", smp_model(
        "DPT", encoder_name="tu-vit_small_patch16_224", encoder_depth=4, decoder_intermediate_channels=(8, 8, 8, 8),
        decoder_fusion_channels=8, img_size=16, patch_size=4, embed_dim=16, num_heads=2, dynamic_img_size=True),
       (2, 3, 32, 32), 4, (2, 2), dense=True,
       note="DPT on a timm ViT (12 blocks, width 16) built for 16 px, run at 32: resampled position embedding, the "
       "class token read out beside every patch token (expand_as), the reassembled maps"),
    _e("monai/ViTAutoEnc", "vit", monai_vit_autoenc, (2, 3, 32, 32), 4, (2, 2), dense=True,
       note="2D, hidden 32, 2 layers; wrapped to return its map (model(x)[0]): the block tokens it returns beside "
       "it are refused, naming this wrapper"),
]

BY_NAME = {e.name: e for e in ZOO}
assert len(BY_NAME) == len(ZOO), "duplicate zoo names"
