"""Window attention on shards, split by the op rules (issue 37, item 1): no gather, no ``hold_whole``.

A window partition (``view`` splitting a sharded spatial dim into ``(windows, window)``) is local
when every shard holds whole windows; the permutes, the merge of windows with the batch, the
attention inside each window (linear, batched matmul, softmax, ``scaled_dot_product_attention``),
Swin's shifted-window mask (built for the whole image, a row per window: cut to this shard's
windows) and the reverse merge run shard by shard (``bigconv.ops.windows``). Against one process in
float64 on a 2x2 grid, judged by ``bigconv.verify.compare_training``'s verdict: forward, input and
parameter gradients, weights after two steps. A failure points at ``bigconv.ops.windows`` (the
reshape groups, the window grid's lead, the mask's local rows) or at the positions rules
(``bigconv.ops.positions``: batched matmul, full-extent operands). Sizes whose shards cut windows
are refused in the dry run, naming the window and sizes that work.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import bigconv
from bigconv.compat import allow_torchvision_without_ops
from bigconv.verify import compare_training
from issue37_models import tiny_swin
from verdicts import assert_exact

allow_torchvision_without_ops()  # before torchvision (and timm, which imports it)


def _verdict(model, world, x, y, loss=None, grid=(2, 2)):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = compare_training(model, world, x, y, loss or nn.CrossEntropyLoss(), grid=grid)
    r.pop("net", None)
    return r


@pytest.mark.world(4)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("v2", [False, True], ids=["swin-v1", "swin-v2"])
def test_torchvision_swin_windows_split_exactly(world, v2):
    """8x8 patches on 2x2 shards: 2x2 windows of 2 per shard in stage 1 (shifted by 1), one in stage 2."""
    torch.manual_seed(0)
    model = tiny_swin(v2).double()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 32, 32, generator=g, dtype=torch.float64)
    r = _verdict(model, world, x, torch.tensor([0, 2]))
    assert_exact(r)
