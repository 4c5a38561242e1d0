"""``nn.SyncBatchNorm.convert_sync_batchnorm(model)`` trains exactly on shards (issue 37).

SyncBatchNorm means BatchNorm statistics over the whole batch; on shards that is what bigconv's
BatchNorm rule computes (over the grid, then over replicas). Its own forward refuses CPU shards
once a process group exists and would sync over the wrong group on a GPU, so bigconv runs the rule
instead (``bigconv.ops.sync_norm``). Compared with one process in float64, raw per-tensor errors:
a failure points at ``sync_norm.adopt`` (not applied on the workers: "expected input tensor to be
on GPU") or at the BatchNorm rule's statistics. The SPMD mode's replicas: ``tests/test_issue37_spmd.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from bigconv.engine.dry_run import meta_copy
from bigconv.ops.sync_norm import ShardedSyncBatchNorm, adopt
from exactness import assert_exact, compare
from issue37_models import sync_bn_net


@pytest.mark.world(4)
@pytest.mark.timeout(240)
def test_sync_batchnorm_matches_single_process(world, transport):
    x = torch.randn(2, 2, 11, 9, dtype=torch.float64)
    r = compare(sync_bn_net(), world, x, torch.tensor([0, 2]), nn.CrossEntropyLoss(), grid=(2, 2),
                transport=transport)
    assert_exact(r)
    assert r["errors"]["state:1.running_var"] <= 1e-9 and r["errors"]["state:4.num_batches_tracked"] == 0


def test_adopt_keeps_class_keys_and_plain_forward():
    """The adopted module is still a SyncBatchNorm with the same keys; outside a sharded forward it is
    SyncBatchNorm's own forward (here, no process group: BatchNorm's)."""
    model = sync_bn_net()
    keys = list(model.state_dict())
    x = torch.randn(2, 2, 6, 6, dtype=torch.float64)
    want = model(x)
    adopt(model)
    assert isinstance(model[1], nn.SyncBatchNorm) and type(model[1]) is ShardedSyncBatchNorm
    assert list(model.state_dict()) == keys
    assert torch.equal(model(x), want)  # batch statistics, no process group: BatchNorm's forward
    assert type(meta_copy(sync_bn_net())[4]) is ShardedSyncBatchNorm  # the dry run runs what workers run


def test_own_process_group_refused():
    model = sync_bn_net()
    model[1].process_group = object()  # stands for a subgroup: bigconv cannot restrict statistics to it
    with pytest.raises(ValueError, match="'1' \\(SyncBatchNorm\\) has its own process_group"):
        adopt(model)


@pytest.mark.world(4)
@pytest.mark.timeout(300)
def test_compare_training_on_sync_batchnorm(world):
    """The user-facing verdict: its one-process reference computes SyncBatchNorm as BatchNorm over the batch."""
    import verdicts

    from bigconv.verify import compare_training

    torch.manual_seed(0)
    model = sync_bn_net()
    assert any(isinstance(m, torch.nn.SyncBatchNorm) for m in model.modules())
    x = torch.randn(2, 2, 11, 9, dtype=torch.float64)
    verdicts.assert_exact(compare_training(model, world, x, torch.tensor([0, 2]), nn.CrossEntropyLoss(), grid=(2, 2)))
