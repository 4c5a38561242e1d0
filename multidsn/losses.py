"""The four DSN losses, as plain differentiable functions of tensors (no modules, no state).

Each is written for one domain's batch (or, for the similarity, one list of per-domain codes), so
that the single-process model and the distributed workers call the very same code.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F


def task_loss(logits_NC: torch.Tensor, labels_N: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the classifier on the labelled source batch, averaged over the batch."""
    return F.cross_entropy(logits_NC, labels_N)


def scale_invariant_mse(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """(1/k) ||d||^2 - (1/k^2) (sum d)^2 per image, d = pred - target, k its number of values; batch mean.

    The second term removes the mean offset of d, so adding a constant to an image's reconstruction
    costs nothing: the model spends no capacity on absolute intensity. (The popular PyTorch port adds
    it and takes the sum over the whole batch; the paper subtracts it per image.)
    """
    if pred.shape != target.shape:
        raise ValueError(f"reconstruction of shape {tuple(pred.shape)} does not match images of shape "
                         f"{tuple(target.shape)}")
    d = (pred - target).flatten(1)
    k = d.shape[1]
    per_image = d.pow(2).sum(1) / k - d.sum(1).pow(2) / k**2
    return per_image.mean()


def difference_loss(shared_NK: torch.Tensor, private_NK: torch.Tensor, normalized: bool = True) -> torch.Tensor:
    """Soft orthogonality of one domain's shared and private codes.

    ``normalized=False``: the paper's ||H_c^T H_p||_F^2, rows of H being the batch's codes.
    ``normalized=True``: the TF original's version: each code dimension centred over the batch, each
    code L2-normalised, then the mean (not the sum) of the squared entries of H_c^T H_p. It measures
    correlation, so it cannot be lowered by shrinking the private codes towards zero.
    """
    if shared_NK.shape != private_NK.shape:
        raise ValueError(f"shared codes {tuple(shared_NK.shape)} and private codes {tuple(private_NK.shape)} "
                         f"must have the same shape")
    if not normalized:
        return (shared_NK.t() @ private_NK).pow(2).sum()
    # eps as tf.nn.l2_normalize's 1e-12 on the squared norm
    s = F.normalize(shared_NK - shared_NK.mean(0, keepdim=True), dim=1, eps=1e-6)
    p = F.normalize(private_NK - private_NK.mean(0, keepdim=True), dim=1, eps=1e-6)
    return (s.t() @ p).pow(2).mean()


class GradientReversal(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by -scale (the DANN trick)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return -ctx.scale * grad, None


def reverse_gradient(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    return GradientReversal.apply(x, scale)


def dann_loss(domain_classifier: torch.nn.Module, codes: Sequence[torch.Tensor],
              grl_scale: float = 1.0) -> torch.Tensor:
    """Domain-adversarial similarity: the classifier learns which domain each shared code came from, while
    the reversed gradient teaches the encoder to make that impossible. Cross-entropy over the K + 1
    domains, averaged over all images; ``codes[d]`` holds domain d's batch of shared codes.
    """
    return dann_terms(domain_classifier, codes, grl_scale)[0]


def dann_terms(domain_classifier: torch.nn.Module, codes: Sequence[torch.Tensor],
               grl_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(``dann_loss``, the domain classifier's accuracy on these codes, detached) from one forward."""
    logits = domain_classifier(reverse_gradient(torch.cat(list(codes)), grl_scale))
    labels = torch.cat([torch.full((len(c),), d, dtype=torch.long, device=c.device) for d, c in enumerate(codes)])
    accuracy = (logits.detach().argmax(1) == labels).double().mean()
    return F.cross_entropy(logits, labels), accuracy


def rbf_kernel_sum(x_NK: torch.Tensor, y_MK: torch.Tensor, scales: Sequence[float]) -> torch.Tensor:
    """sum_s exp(-|x_i - y_j|^2 / (2 s)), an N x M matrix."""
    # Differences, not |x|^2 + |y|^2 - 2 x.y: that expansion can go slightly negative and is less exact.
    dist = (x_NK[:, None, :] - y_MK[None, :, :]).pow(2).sum(-1)
    beta = torch.tensor([1.0 / (2.0 * s) for s in scales], dtype=dist.dtype, device=dist.device)
    return torch.exp(-dist[..., None] * beta).sum(-1)


def mmd(x_NK: torch.Tensor, y_MK: torch.Tensor, scales: Sequence[float]) -> torch.Tensor:
    """Biased squared maximum mean discrepancy between two batches of codes, clipped at 0 as in the original."""
    cost = (rbf_kernel_sum(x_NK, x_NK, scales).mean() + rbf_kernel_sum(y_MK, y_MK, scales).mean()
            - 2 * rbf_kernel_sum(x_NK, y_MK, scales).mean())
    return cost.clamp(min=0.0)


def median_sq_distance(codes: Sequence[torch.Tensor]) -> float:
    """The median squared distance between all pairs of distinct codes of every domain (detached): the
    codes' own distance scale, for the 'median' MMD bandwidth."""
    x = torch.cat([c.detach() for c in codes])
    dist = (x[:, None, :] - x[None, :, :]).pow(2).sum(-1)
    off = dist[~torch.eye(len(x), dtype=torch.bool, device=x.device)]
    return max(float(off.median()), 1e-12)


def mmd_loss(codes: Sequence[torch.Tensor], scales: Sequence[float], median: bool = False) -> torch.Tensor:
    """MMD between the source's shared codes (``codes[0]``) and each target's, averaged over the targets,
    so that gamma keeps its meaning as K grows. ``median``: every scale times ``median_sq_distance(codes)``."""
    if median:
        m = median_sq_distance(codes)
        scales = [s * m for s in scales]
    source = codes[0]
    return torch.stack([mmd(source, t, scales) for t in codes[1:]]).mean()
