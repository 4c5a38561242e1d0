"""Presets named after the ORNL study figures they reproduce (Tsaris and Hinkle, 2021).

Each preset has the study's own scale (``full``: V100 16 GB GPUs, batch 1, worker counts as in the
figure) and a ``quick`` scale that finishes on a 2-core CPU machine in a few minutes. The quick
worker counts (1, 2, 4, 8) are the ones our targets are stated at; its sizes are chosen so that the
largest one is big enough for per-worker fixed costs (RPC buffers, halos) to be small.
"""

from __future__ import annotations

from dataclasses import dataclass, field

GiB = 2**30
MiB = 2**20


@dataclass(frozen=True, kw_only=True)
class Scale:
    """One scale of a preset: what the sweep and the size search run."""

    sizes: list[int]
    """Input edges (lengths for 1D) of the sweep."""
    workers: list[int]
    """Worker counts of the sweep; the plain single process is always added."""
    maxsize_workers: list[int]
    """Worker counts of the largest-size search."""
    budget_bytes: int
    """Per-worker memory budget of the size search (and the limit marked on memory plots)."""
    device: str = "cuda"
    """Device the scale is meant for."""
    batch: int = 1
    """Images per step."""


@dataclass(frozen=True, kw_only=True)
class Preset:
    name: str
    """Also the results file's stem: ``results/<name>[_quick].jsonl``."""
    figure: str
    """What it reproduces."""
    model: str
    full: Scale
    quick: Scale
    extra: dict = field(default_factory=dict)
    """Model-specific options (e.g. DSN domains)."""

    def scale(self, quick: bool) -> Scale:
        return self.quick if quick else self.full


_QUICK_W = [1, 2, 4, 8]

PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset(name="fig2_cnn1d", figure="Figure 2: CNN1D memory and utilization vs input length", model="cnn1d",
           full=Scale(sizes=[2**20 * k for k in (1, 2, 4, 6, 8, 10, 12, 16)], workers=[6, 12],
                      maxsize_workers=[1, 2, 4, 6, 12], budget_bytes=16 * GiB),
           quick=Scale(sizes=[2**18, 2**20, 2**22], workers=_QUICK_W, maxsize_workers=_QUICK_W,
                       budget_bytes=256 * MiB, device="cpu")),
    Preset(name="fig3_cnn2d", figure="Figure 3: CNN2D memory and utilization vs image edge", model="cnn2d",
           full=Scale(sizes=[512, 1024, 1536, 2048, 2200, 3072, 4096, 5120, 6144], workers=[5, 10],
                      maxsize_workers=[1, 2, 4, 5, 8, 10], budget_bytes=16 * GiB),
           quick=Scale(sizes=[512, 1024, 2048], workers=_QUICK_W, maxsize_workers=_QUICK_W,
                       budget_bytes=256 * MiB, device="cpu")),
    Preset(name="fig4_cnn3d", figure="Figure 4: CNN3D memory and utilization vs volume edge", model="cnn3d",
           full=Scale(sizes=[64, 96, 128, 170, 200, 256, 300, 350, 400], workers=[9, 28],
                      maxsize_workers=[1, 2, 4, 8, 9, 27], budget_bytes=16 * GiB),
           quick=Scale(sizes=[64, 112, 160], workers=_QUICK_W, maxsize_workers=_QUICK_W,
                       budget_bytes=128 * MiB, device="cpu")),
    Preset(name="fig5_fcn2d", figure="Figure 5: FCN2D memory and utilization vs image edge", model="fcn2d",
           full=Scale(sizes=[512, 1024, 1504, 2048, 3072, 4096, 4608], workers=[10],
                      maxsize_workers=[1, 2, 4, 8, 10], budget_bytes=16 * GiB),
           quick=Scale(sizes=[256, 512, 1024], workers=_QUICK_W, maxsize_workers=_QUICK_W,
                       budget_bytes=256 * MiB, device="cpu")),
    Preset(name="fig7_dsn", figure="Figure 7: DSN, 1 source + 1/4/7 targets, single process vs distributed",
           model="dsn", extra={"targets": [1, 4, 7]},
           full=Scale(sizes=[128, 256, 384, 512, 768, 1024], workers=[], maxsize_workers=[],
                      budget_bytes=16 * GiB, batch=2),
           # python -m experiments.fig7 [--quick] runs both placements and the largest-size search
           quick=Scale(sizes=[128, 256, 512], workers=[], maxsize_workers=[], budget_bytes=256 * MiB, device="cpu",
                       batch=2)),
)}


def preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}") from None
