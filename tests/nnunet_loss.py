"""nnU-Net's default training loss, as nnunetv2 2.8.1 ships it, for the nnU-Net tests.

Copied from ``nnunetv2/training/loss/{deep_supervision,compound_losses,dice,robust_ce_loss}.py``
(Apache License 2.0, (c) Division of Medical Image Computing, German Cancer Research Center), reduced
to the classes ``nnUNetTrainer._build_loss`` uses, without the DDP all-gather (``ddp=False``: bigconv's
driver computes the loss over the whole output, as one process does). nnunetv2 itself is not
installed: it pins ``dynamic-network-architectures>=0.4.4``, whose ``timm<1.0.23`` pin would
downgrade the timm the model zoo is tested with.

One change, named: nnU-Net's default Dice is ``MemoryEfficientSoftDiceLoss``, which sums in float32
(``sum(..., dtype=torch.float32)``) whatever the input's dtype; the float64 equivalence check uses the
same trainer's other Dice class, ``SoftDiceLoss``, which keeps the input's dtype. The two compute the
same quantity (per class: 2 tp / (2 tp + fp + fn), background left out).
"""

from __future__ import annotations

import torch
from torch import nn


def get_tp_fp_fn(net_output: torch.Tensor, gt: torch.Tensor, axes) -> tuple:
    """nnunetv2's ``get_tp_fp_fn_tn`` for soft predictions, no mask, no squaring."""
    with torch.no_grad():
        if net_output.ndim != gt.ndim:
            gt = gt.view((gt.shape[0], 1, *gt.shape[1:]))
        if net_output.shape == gt.shape:
            y_onehot = gt
        else:
            y_onehot = torch.zeros(net_output.shape, device=net_output.device, dtype=torch.bool)
            y_onehot.scatter_(1, gt.long(), 1)
    tp = net_output * y_onehot
    fp = net_output * (~y_onehot)
    fn = (1 - net_output) * y_onehot
    return tp.sum(dim=axes), fp.sum(dim=axes), fn.sum(dim=axes)


class SoftDiceLoss(nn.Module):
    def __init__(self, batch_dice: bool = False, do_bg: bool = True, smooth: float = 1.0) -> None:
        super().__init__()
        self.batch_dice, self.do_bg, self.smooth = batch_dice, do_bg, smooth

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        axes = ([0] if self.batch_dice else []) + list(range(2, x.ndim))
        tp, fp, fn = get_tp_fp_fn(torch.softmax(x, 1), y, axes)
        dc = (2 * tp + self.smooth) / torch.clip(2 * tp + fp + fn + self.smooth, 1e-8)
        if not self.do_bg:
            dc = dc[1:] if self.batch_dice else dc[:, 1:]
        return -dc.mean()


class RobustCrossEntropyLoss(nn.CrossEntropyLoss):
    """Targets as nnU-Net keeps them: float, with a channel dim of 1."""

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if target.ndim == input.ndim:
            assert target.shape[1] == 1
            target = target[:, 0]
        return super().forward(input, target.long())


class DC_and_CE_loss(nn.Module):  # noqa: N801 - nnU-Net's name
    def __init__(self, soft_dice_kwargs: dict, weight_ce: float = 1, weight_dice: float = 1) -> None:
        super().__init__()
        self.weight_ce, self.weight_dice = weight_ce, weight_dice
        self.ce = RobustCrossEntropyLoss()
        self.dc = SoftDiceLoss(**soft_dice_kwargs)

    def forward(self, net_output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.weight_ce * self.ce(net_output, target[:, 0]) + self.weight_dice * self.dc(net_output, target)


class DeepSupervisionWrapper(nn.Module):
    def __init__(self, loss: nn.Module, weight_factors) -> None:
        super().__init__()
        self.weight_factors, self.loss = tuple(weight_factors), loss

    def forward(self, *args):
        return sum(self.weight_factors[i] * self.loss(*inputs) for i, inputs in enumerate(zip(*args))
                   if self.weight_factors[i] != 0.0)


def nnunet_loss(scales: int, batch_dice: bool = True) -> nn.Module:
    """``nnUNetTrainer._build_loss``: Dice + CE; deep supervision weights 1/2^i with the lowest
    resolution's set to 0, normalized to sum 1."""
    loss = DC_and_CE_loss({"batch_dice": batch_dice, "smooth": 1e-5, "do_bg": False})
    weights = [1 / (2 ** i) for i in range(scales)]
    weights[-1] = 0
    total = sum(weights)
    return DeepSupervisionWrapper(loss, [w / total for w in weights])
