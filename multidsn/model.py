"""``DSN``: the single-process Domain Separation Network, the reference every distributed run must match.

Parts (names as in ``state_dict``): ``shared_encoder`` E_c, ``private_encoders.d`` E_p^d for each domain d
(0 = source), ``decoder`` D, ``classifier`` G and, for DANN, ``domain_classifier``. The pieces of the
loss are module-level functions (``separation_terms``, ``head_terms``, ``combine``) so that the workers
of ``multidsn.parallelize`` compute them with the same code, in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn as nn

from . import losses
from .batch import Batch
from .config import DSNConfig


class Encoder(nn.Module):
    """Conv blocks (3x3 conv, ReLU, 2x2 max-pool), adaptive pooling to a fixed grid, a linear code layer."""

    def __init__(self, channels: int, widths: Sequence[int], image_size: int, code_grid: int, code_size: int):
        super().__init__()
        blocks: list[nn.Module] = []
        prev = channels
        for w in widths:
            blocks += [nn.Conv2d(prev, w, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)]
            prev = w
        grid = min(code_grid, image_size // 2 ** len(widths))
        self.features = nn.Sequential(*blocks, nn.AdaptiveAvgPool2d(grid), nn.Flatten())
        self.code = nn.Linear(prev * grid * grid, code_size)

    def forward(self, x_NCHW: torch.Tensor) -> torch.Tensor:
        return self.code(self.features(x_NCHW))


class Decoder(nn.Module):
    """Code -> image: a linear layer to a small map, then (2x nearest upsampling, 3x3 conv, ReLU) blocks."""

    def __init__(self, code_size: int, widths: Sequence[int], image_size: int, channels: int):
        super().__init__()
        self.start = image_size // 2 ** len(widths)
        self.width0 = widths[0]
        self.fc = nn.Linear(code_size, widths[0] * self.start**2)
        blocks: list[nn.Module] = []
        prev = widths[0]
        for w in widths:
            blocks += [nn.Upsample(scale_factor=2, mode="nearest"), nn.Conv2d(prev, w, 3, padding=1), nn.ReLU()]
            prev = w
        self.blocks = nn.Sequential(*blocks, nn.Conv2d(prev, channels, 3, padding=1))

    def forward(self, code_NK: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.fc(code_NK)).view(len(code_NK), self.width0, self.start, self.start)
        return self.blocks(x)


def mlp(inputs: int, hidden: int, outputs: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(inputs, hidden), nn.ReLU(), nn.Linear(hidden, outputs))


@dataclass
class LossTerms:
    """One step's loss and its parts (the parts detached, for logging). Lists are per domain, source first;
    they are empty, and similarity is None, during the warm-up."""

    total: torch.Tensor
    task: float
    recon: list[float]
    difference: list[float]
    similarity: float | None

    def record(self) -> dict:
        return {"loss": float(self.total.detach()), "task": self.task, "recon": self.recon,
                "difference": self.difference, "similarity": self.similarity}


def separation_terms(cfg: DSNConfig, x: torch.Tensor, h_c: torch.Tensor, h_p: torch.Tensor,
                     decoder: nn.Module | None) -> torch.Tensor:
    """[difference] or [recon, difference] of one domain, as one tensor (one message when sent)."""
    diff = losses.difference_loss(h_c, h_p, cfg.difference_normalized)
    if decoder is None:
        return diff.reshape(1)
    return torch.stack([reconstruction_term(x, h_c, h_p, decoder), diff])


def reconstruction_term(x: torch.Tensor, h_c: torch.Tensor, h_p: torch.Tensor, decoder: nn.Module) -> torch.Tensor:
    # The codes are added, not concatenated (paper, Sec. 3): D sees E_c(x) + E_p(x).
    return losses.scale_invariant_mse(decoder(h_c + h_p), x)


def head_terms(cfg: DSNConfig, classifier: nn.Module, domain_classifier: nn.Module | None,
               shared_codes: Sequence[torch.Tensor], labels: torch.Tensor, step: int) -> torch.Tensor:
    """[task] before the warm-up ends (only the source's code given), [task, similarity] after.
    ``step`` sets DANN's gradient reversal factor (``cfg.grl_factor``)."""
    task = losses.task_loss(classifier(shared_codes[0]), labels)
    if len(shared_codes) == 1:
        return task.reshape(1)
    if cfg.similarity == "dann":
        sim = losses.dann_loss(domain_classifier, shared_codes, cfg.grl_factor(step))
    else:
        sim = losses.mmd_loss(shared_codes, cfg.mmd_scales)
    return torch.stack([task, sim])


def combine(cfg: DSNConfig, head: torch.Tensor, recon: Sequence[torch.Tensor],
            difference: Sequence[torch.Tensor]) -> LossTerms:
    """The weighted total, summed in one fixed order by the reference and the distributed driver alike."""
    total = head[0]
    if len(head) > 1:
        total = total + cfg.alpha * sum_in_order(recon) + cfg.beta * sum_in_order(difference) + cfg.gamma * head[1]
    return LossTerms(total=total, task=float(head[0].detach()), recon=[float(r.detach()) for r in recon],
                     difference=[float(d.detach()) for d in difference],
                     similarity=float(head[1].detach()) if len(head) > 1 else None)


def sum_in_order(values: Sequence[torch.Tensor]) -> torch.Tensor:
    total = values[0]
    for v in values[1:]:
        total = total + v
    return total


class DSN(nn.Module):
    """Domain Separation Network for one labelled source and ``cfg.num_targets`` unlabelled targets."""

    def __init__(self, cfg: DSNConfig) -> None:
        super().__init__()
        if not isinstance(cfg, DSNConfig):
            raise ValueError(f"DSN expects a multidsn.DSNConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self.shared_encoder = Encoder(cfg.channels, cfg.shared_widths, cfg.image_size, cfg.code_grid, cfg.code_size)
        self.private_encoders = nn.ModuleList(
            Encoder(cfg.channels, cfg.private_widths, cfg.image_size, cfg.code_grid, cfg.code_size)
            for _ in range(cfg.num_domains))
        self.decoder = Decoder(cfg.code_size, cfg.decoder_widths, cfg.image_size, cfg.channels)
        self.classifier = mlp(cfg.code_size, cfg.classifier_hidden, cfg.num_classes)
        self.domain_classifier = (mlp(cfg.code_size, cfg.classifier_hidden, cfg.num_domains)
                                  if cfg.similarity == "dann" else None)

    def forward(self, x_NCHW: torch.Tensor) -> torch.Tensor:
        """Class logits of images from any domain: G(E_c(x))."""
        return self.classifier(self.shared_encoder(x_NCHW))

    def codes(self, x_NCHW: torch.Tensor, domain: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(shared code, private code) of images of ``domain`` (0 = source)."""
        return self.shared_encoder(x_NCHW), self.private_encoders[domain](x_NCHW)

    def reconstruct(self, x_NCHW: torch.Tensor, domain: int) -> torch.Tensor:
        h_c, h_p = self.codes(x_NCHW, domain)
        return self.decoder(h_c + h_p)

    def loss_terms(self, batch: Batch, step: int) -> LossTerms:
        """The loss at training step ``step`` (counted from 0), with its parts."""
        batch.check(self.cfg)
        dtype = next(self.parameters()).dtype
        images = [x.to(dtype) for x in batch.images]
        if not self.cfg.adapting(step):
            # Warm-up: the task loss alone, and nothing else computed, so unused parts get no gradient.
            return combine(self.cfg, head_terms(self.cfg, self.classifier, None, [self.shared_encoder(images[0])],
                                                batch.labels, step), [], [])
        shared, recon, difference = [], [], []
        for d, x in enumerate(images):
            h_c, h_p = self.codes(x, d)
            terms = separation_terms(self.cfg, x, h_c, h_p, self.decoder)
            shared.append(h_c)
            recon.append(terms[0])
            difference.append(terms[1])
        head = head_terms(self.cfg, self.classifier, self.domain_classifier, shared, batch.labels, step)
        return combine(self.cfg, head, recon, difference)

    def loss(self, batch: Batch, step: int) -> torch.Tensor:
        """The scalar loss; ``step`` decides whether the warm-up is over."""
        return self.loss_terms(batch, step).total
