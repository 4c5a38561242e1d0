"""What each SPMD rank runs for ``tests/test_nccl_rules.py`` (spawned ranks import it from here)."""

from __future__ import annotations

import torch
import torch.nn as nn

import bigconv


def stride2_chain() -> nn.Module:
    """conv → stride-2 conv → conv: on a (2, 1) grid the stride-2 layer's exchange is one-sided (only one
    shard sends), the case whose gradient batch once landed between two gradient allreduces."""
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, stride=2, padding=1),
                         nn.ReLU(), nn.Conv2d(4, 3, 3, padding=1), nn.AdaptiveAvgPool2d(1), nn.Flatten())


def train_two_steps(net) -> None:
    torch.manual_seed(1)
    x, y = torch.randn(2, 1, 16, 12, dtype=torch.float64), torch.tensor([0, 2])
    net.optimizer(torch.optim.SGD, lr=0.1, momentum=0.9)
    for _ in range(2):
        net.train_step(x, y, nn.CrossEntropyLoss())


def one_bucket_per_parameter() -> None:
    from bigconv.engine import buckets

    buckets.BUCKET_BYTES = 1


def stride2_order() -> dict:
    """Two training steps of the stride-2 chain on a (2, 1) grid, one gradient bucket per parameter:
    the order mismatches the recorder found (run with BIGCONV_COMM_CHECKS=order), and whether the
    halo link runs tag-free."""
    one_bucket_per_parameter()
    torch.manual_seed(0)
    with bigconv.World.from_env(mode="spmd", device="cpu", timeout=60) as world:
        net = bigconv.parallelize(stride2_chain().double(), world, grid=(2, 1))
        world.comm_order_mismatches()  # forget the setup's collectives
        train_two_steps(net)
        return {"mismatches": world.comm_order_mismatches(), "tag_free": net.engine.rt.link.tag_free}


def environment_variable(name: str) -> str | None:
    """A worker's value of ``name`` (RPC entry for the tests)."""
    import os

    return os.environ.get(name)
