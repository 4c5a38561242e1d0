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


class ConvEncoder(nn.Module):
    """The TF original's MNIST encoders (``dann_mnist`` for the shared one, ``default_encoder`` for the private
    ones): (5x5 conv, [batch norm], ReLU, 2x2 max-pool) per width, flatten, a fully connected code layer with
    [batch norm and] ReLU."""

    def __init__(self, channels: int, widths: Sequence[int], image_size: int, code_size: int, batch_norm: bool):
        super().__init__()
        layers: list[nn.Module] = []
        prev = channels
        for w in widths:
            layers += [nn.Conv2d(prev, w, 5, padding=2), *([nn.BatchNorm2d(w)] if batch_norm else []), nn.ReLU(),
                       nn.MaxPool2d(2)]
            prev = w
        side = image_size // 2 ** len(widths)
        self.features = nn.Sequential(*layers, nn.Flatten())
        self.code = nn.Sequential(nn.Linear(prev * side * side, code_size),
                                  *([nn.BatchNorm1d(code_size)] if batch_norm else []), nn.ReLU())

    def forward(self, x_NCHW: torch.Tensor) -> torch.Tensor:
        return self.code(self.features(x_NCHW))


class SmallDecoder(nn.Module):
    """The TF original's ``small_decoder``: fc to 600 values as a 6 x 10 x 10 map, then one (5x5 conv, ReLU)
    per width, the first at 10 x 10 and the others at image_size / 2**(n - 1 - i) after nearest upsampling,
    and a 3x3 conv to the image's channels at full size. (No batch norm: the decoder is replicated across
    workers with ``decoder='domain'``, and replicas would keep different running statistics.)"""

    def __init__(self, code_size: int, widths: Sequence[int], image_size: int, channels: int):
        super().__init__()
        self.fc = nn.Linear(code_size, 600)
        n = len(widths)
        self.sizes = [10] + [image_size // 2 ** (n - 1 - i) for i in range(1, n)]
        self.image_size = image_size
        prev, convs = 6, []
        for w in widths:
            convs.append(nn.Conv2d(prev, w, 5, padding=2))
            prev = w
        self.convs = nn.ModuleList(convs)
        self.out = nn.Conv2d(prev, channels, 3, padding=1)

    def forward(self, code_NK: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.fc(code_NK)).view(len(code_NK), 6, 10, 10)
        for size, conv in zip(self.sizes, self.convs):
            if x.shape[-1] != size:
                x = nn.functional.interpolate(x, size=(size, size), mode="nearest")
            x = torch.relu(conv(x))
        if x.shape[-1] != self.image_size:
            x = nn.functional.interpolate(x, size=(self.image_size, self.image_size), mode="nearest")
        return self.out(x)


def encoders_and_decoder(cfg: DSNConfig) -> tuple[nn.Module, list[nn.Module], nn.Module]:
    """(shared encoder, private encoders, decoder) of ``cfg.architecture``."""
    if cfg.architecture == "dann_mnist":
        shared = ConvEncoder(cfg.channels, cfg.shared_widths, cfg.image_size, cfg.code_size, False)
        private = [ConvEncoder(cfg.channels, cfg.private_widths, cfg.image_size, cfg.code_size, cfg.private_batch_norm)
                   for _ in range(cfg.num_domains)]
        return shared, private, SmallDecoder(cfg.code_size, cfg.decoder_widths, cfg.image_size, cfg.channels)
    if cfg.private_batch_norm:
        raise ValueError("private_batch_norm needs architecture='dann_mnist'")
    shared = Encoder(cfg.channels, cfg.shared_widths, cfg.image_size, cfg.code_grid, cfg.code_size)
    private = [Encoder(cfg.channels, cfg.private_widths, cfg.image_size, cfg.code_grid, cfg.code_size)
               for _ in range(cfg.num_domains)]
    return shared, private, Decoder(cfg.code_size, cfg.decoder_widths, cfg.image_size, cfg.channels)


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
    domain_accuracy: float | None = None
    """DANN only: the fraction of the step's shared codes whose domain the domain classifier got right (a
    diagnostic: near 1 / (K + 1) when the codes are aligned, near 1 when it wins)."""

    def record(self) -> dict:
        return {"loss": float(self.total.detach()), "task": self.task, "recon": self.recon,
                "difference": self.difference, "similarity": self.similarity,
                "domain_accuracy": self.domain_accuracy}

    def detached(self) -> "LossTerms":
        return LossTerms(self.total.detach(), self.task, self.recon, self.difference, self.similarity,
                         self.domain_accuracy)


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
    """[task] before the warm-up ends (only the source's code given), [task, similarity] after, and for DANN
    [task, similarity, domain accuracy] (the last detached: a diagnostic, not a loss).
    ``step`` sets DANN's gradient reversal factor (``cfg.grl_factor``)."""
    task = losses.task_loss(classifier(shared_codes[0]), labels)
    if len(shared_codes) == 1:
        return task.reshape(1)
    if cfg.similarity == "dann":
        sim, acc = losses.dann_terms(domain_classifier, shared_codes, cfg.grl_factor(step))
        return torch.stack([task, sim, acc.to(task.dtype)])
    sim = losses.mmd_loss(shared_codes, cfg.mmd_scales, median=cfg.mmd_bandwidth == "median")
    return torch.stack([task, sim])


def combine(cfg: DSNConfig, head: torch.Tensor, recon: Sequence[torch.Tensor],
            difference: Sequence[torch.Tensor]) -> LossTerms:
    """The weighted total, summed in one fixed order by the reference and the distributed driver alike."""
    total = head[0]
    if len(head) > 1:
        if recon:  # none when alpha = beta = 0 (cfg.separating is False): the private encoders never ran
            total = total + cfg.alpha * sum_in_order(recon) + cfg.beta * sum_in_order(difference)
        total = total + cfg.gamma * head[1]
    return LossTerms(total=total, task=float(head[0].detach()), recon=[float(r.detach()) for r in recon],
                     difference=[float(d.detach()) for d in difference],
                     similarity=float(head[1].detach()) if len(head) > 1 else None,
                     domain_accuracy=float(head[2].detach()) if len(head) > 2 else None)


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
        shared, private, decoder = encoders_and_decoder(cfg)
        self.shared_encoder = shared
        self.private_encoders = nn.ModuleList(private)
        self.decoder = decoder
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
        if not self.cfg.separating:  # DANN or MMD alone: the shared codes and the head, nothing else
            shared = [self.shared_encoder(x) for x in images]
            head = head_terms(self.cfg, self.classifier, self.domain_classifier, shared, batch.labels, step)
            return combine(self.cfg, head, [], [])
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
