"""``DSNConfig``: every size, width and loss weight of a Domain Separation Network, validated up front.

Glossary: a *domain* is one image source; domain 0 is the labelled source and domains 1..K are the
unlabelled targets. A *code* is the vector an encoder maps an image to (``code_size`` long).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

SIMILARITIES = ("dann", "mmd")
GRL_SCHEDULES = ("constant", "dann")
ARCHITECTURES = ("small", "dann_mnist")
MMD_BANDWIDTHS = ("fixed", "median")

# The bandwidths of the TF original's MMD kernel (domain_separation/utils.py): a kernel per scale s,
# exp(-|x - y|^2 / (2 s)), so that the loss sees structure at every distance scale of the codes.
TF_MMD_SCALES = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0, 5.0, 10.0, 15.0, 20.0, 25.0, 30.0, 35.0, 100.0,
                 1e3, 1e4, 1e5, 1e6)


def _positive_int(value, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _widths(value, name: str) -> None:
    if not isinstance(value, tuple) or not value:
        raise ValueError(f"{name} must be a non-empty tuple of channel counts such as (32, 64), got {value!r}")
    for w in value:
        _positive_int(w, f"every entry of {name}")


@dataclass(kw_only=True)
class DSNConfig:
    """The architecture and the loss of a DSN (Bousmalis et al. 2016).

    L = L_task + alpha * sum_d L_recon(d) + beta * sum_d L_difference(d) + gamma * L_similarity,
    with d over the source and every target. Before ``warmup_steps`` only L_task is used, as in the
    paper (the reconstruction, difference and similarity losses switch on at that step).
    """

    image_size: int = 28
    """Height and width of every image in pixels; must be divisible by 2**len(decoder_widths)."""
    channels: int = 3
    """Colour channels of every image (all domains share them)."""
    num_classes: int = 10
    """Classes of the source labels."""
    num_targets: int = 1
    """K, the number of unlabelled target domains (1 to 7 in the benchmark; any K >= 1 works)."""
    code_size: int = 64
    """Length of the shared and the private codes; they are added before decoding, so they match."""
    shared_widths: tuple[int, ...] = (32, 64)
    """Channels of the shared encoder's conv blocks; each block halves the image (depth = length)."""
    private_widths: tuple[int, ...] = (16, 32)
    """Channels of each private encoder's conv blocks."""
    decoder_widths: tuple[int, ...] = (32, 16)
    """Channels of the decoder's upsampling blocks; the decoder starts at image_size / 2**length."""
    code_grid: int = 4
    """Encoders pool their last feature map to code_grid x code_grid before the linear code layer, so the
    code layer's size does not grow with the image."""
    classifier_hidden: int = 100
    """Hidden units of the task classifier G (and of the DANN domain classifier)."""
    similarity: str = "dann"
    """'dann' (gradient reversal and a domain classifier over K + 1 domains) or 'mmd' (sum of RBF kernels)."""
    alpha: float = 0.1
    """Weight of the reconstruction loss (paper: 0.01 to 0.15)."""
    beta: float = 0.05
    """Weight of the difference loss (paper: 0.05 to 0.075)."""
    gamma: float = 0.25
    """Weight of the similarity loss (paper: 0.25 to 0.3)."""
    warmup_steps: int = 0
    """Steps trained on the task loss alone before the other losses switch on (paper: 10,000)."""
    difference_normalized: bool = True
    """True: the TF original's difference loss (codes centred over the batch, rows L2-normalised, mean of the
    squared correlations), which cannot be lowered by shrinking the codes. False: the paper's raw
    ||H_c^T H_p||_F^2."""
    grl_scale: float = 1.0
    """Factor of the gradient reversal layer of DANN (the encoder sees -grl_scale * gradient); with
    ``grl_schedule='dann'`` the factor that the ramp reaches."""
    grl_schedule: str = "constant"
    """'constant': the reversal factor is ``grl_scale`` from the end of the warm-up on. 'dann': Ganin &
    Lempitsky's ramp, ``grl_scale * (2 / (1 + exp(-10 p)) - 1)``, p going from 0 at the end of the warm-up
    to 1 after ``grl_ramp_steps`` more steps, so that the domain classifier's early, noisy gradient barely
    reaches the encoder. Only DANN's similarity loss has a reversal layer; MMD ignores both fields."""
    grl_ramp_steps: int = 1
    """Steps of the 'dann' ramp after the warm-up (the training steps left after it, for the paper's p)."""
    mmd_scales: tuple[float, ...] = field(default=TF_MMD_SCALES)
    """Kernel scales s of the MMD loss, kernel exp(-|x - y|^2 / (2 s)) summed over s; with
    ``mmd_bandwidth='median'`` they are multiples of the batch's median squared code distance."""
    mmd_bandwidth: str = "fixed"
    """'fixed': ``mmd_scales`` as given. 'median': each scale multiplied by the median squared distance
    between all the shared codes of the step (every domain, detached), so that the kernels sit at the codes'
    own distance scale whatever their norm (the median heuristic of Gretton et al. 2012)."""
    architecture: str = "small"
    """'small': 3x3 conv blocks, adaptive pooling to ``code_grid``, a linear code (the demo recipe).
    'dann_mnist': the TF original's MNIST networks (research/domain_separation/models.py): 5x5 conv blocks
    (``shared_widths``, e.g. (32, 48)) and a ReLU fc code for the shared encoder; 5x5 conv blocks
    (``private_widths``, e.g. (32, 64)) and a ReLU fc code for the private encoders; the small decoder
    (fc to a 6 x 10 x 10 map, one 5x5 conv per ``decoder_widths`` entry, see ``model.SmallDecoder``)."""
    private_batch_norm: bool = False
    """Batch norm after every conv and the code layer of the private encoders (the TF original's). A private
    encoder runs once per step on one domain's batch, in one process and across workers alike, so its batch
    statistics and running averages are the same on both paths."""

    def __post_init__(self) -> None:
        for name in ("image_size", "channels", "num_targets", "code_size", "code_grid", "classifier_hidden"):
            _positive_int(getattr(self, name), name)
        _positive_int(self.num_classes, "num_classes")
        if self.num_classes < 2:
            raise ValueError(f"num_classes must be at least 2, got {self.num_classes}")
        for name in ("shared_widths", "private_widths", "decoder_widths"):
            _widths(getattr(self, name), name)
        if self.similarity not in SIMILARITIES:
            raise ValueError(f"similarity must be one of {SIMILARITIES}, got {self.similarity!r}")
        for name in ("alpha", "beta", "gamma", "grl_scale"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{name} must be a non-negative number, got {value!r}")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be a non-negative integer, got {self.warmup_steps!r}")
        if self.mmd_bandwidth not in MMD_BANDWIDTHS:
            raise ValueError(f"mmd_bandwidth must be one of {MMD_BANDWIDTHS}, got {self.mmd_bandwidth!r}")
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture must be one of {ARCHITECTURES}, got {self.architecture!r}")
        if self.grl_schedule not in GRL_SCHEDULES:
            raise ValueError(f"grl_schedule must be one of {GRL_SCHEDULES}, got {self.grl_schedule!r}")
        _positive_int(self.grl_ramp_steps, "grl_ramp_steps")
        if not self.mmd_scales or any(not isinstance(s, (int, float)) or s <= 0 for s in self.mmd_scales):
            raise ValueError(f"mmd_scales must be a non-empty tuple of positive numbers, got {self.mmd_scales!r}")
        for name in ("shared_widths", "private_widths"):
            smallest = self.image_size // 2 ** len(getattr(self, name))
            if smallest < 1:
                raise ValueError(f"{name} has {len(getattr(self, name))} blocks, each halving the image, too many for "
                                 f"image_size {self.image_size}; use at most {self.image_size.bit_length() - 1}")
        up = 2 ** len(self.decoder_widths)
        if self.image_size % up:
            raise ValueError(f"image_size {self.image_size} must be divisible by 2**len(decoder_widths) = {up}; "
                             f"change image_size or use fewer decoder blocks")

    @property
    def num_domains(self) -> int:
        """Source plus targets."""
        return self.num_targets + 1

    @property
    def separating(self) -> bool:
        """Whether the private encoders and the decoder take part (alpha or beta above 0). With alpha = beta = 0
        the model is DANN or MMD alone: neither is run, in one process or across workers."""
        return self.alpha > 0 or self.beta > 0

    def adapting(self, step: int) -> bool:
        """Whether the reconstruction, difference and similarity losses are on at ``step`` (counted from 0)."""
        return step >= self.warmup_steps

    def grl_factor(self, step: int) -> float:
        """The gradient reversal factor at ``step`` (counted from 0); see ``grl_schedule``."""
        if self.grl_schedule == "constant":
            return float(self.grl_scale)
        p = min(1.0, max(0.0, (step - self.warmup_steps) / self.grl_ramp_steps))
        return self.grl_scale * (2.0 / (1.0 + math.exp(-10.0 * p)) - 1.0)
