"""torchvision's model definitions import and run here, whether or not its compiled ops load.

A failure points to ``bigconv.compat``: torchvision's CUDA wheel on a CPU-only torch.
"""

import torch

from bigconv.compat import allow_torchvision_without_ops


def test_torchvision_models_import_and_run():
    allow_torchvision_without_ops()
    from torchvision.models import resnet18

    out = resnet18(weights=None, num_classes=3).eval()(torch.randn(1, 3, 32, 32))
    assert out.shape == (1, 3)


def test_import_bigconv_alone_makes_timm_and_torchvision_importable():
    """In a fresh interpreter (nothing applied the shim yet), ``import bigconv`` is enough."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    code = "import bigconv, timm, torchvision; print(torchvision.models.resnet18 is not None)"
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "True" in done.stdout, done.stderr[-2000:]
