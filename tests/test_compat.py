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
