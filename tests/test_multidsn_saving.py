"""multidsn checkpoints: the file of a DistributedDSN is the single-process layout, so a run resumes on
the workers or in one process, and continues as if it had never stopped (float64, <= 1e-12 on the
workers, <= 1e-9 against one process, the repo's exactness bound)."""

from __future__ import annotations

import pytest
import torch

import multidsn
from multidsn.trainer import LocalDSN
from test_multidsn_parallel import batches, rel_errors, tiny


def dsn(cfg, seed):
    torch.manual_seed(seed)
    return multidsn.DSN(cfg).double()


@pytest.mark.world(3)
@pytest.mark.timeout(180)
def test_dsn_resumes_exactly_on_workers_and_in_one_process(world, tmp_path, placement="domain"):
    cfg = tiny(1, "mmd")
    data = batches(cfg, 3)
    adam = dict(lr=0.01, betas=(0.8, 0.9))
    ref = multidsn.parallelize(dsn(cfg, 0), world, placement=placement)
    ref.optimizer(torch.optim.Adam, **adam)
    for b in data:
        ref.train_step(b)
    want = ref.state_dict()
    ref.close()

    first = multidsn.parallelize(dsn(cfg, 0), world, placement=placement)
    first.optimizer(torch.optim.Adam, **adam)
    first.train_step(data[0])
    path = first.save(tmp_path / "dsn.pt", extra={"seed": 0})
    first.close()

    again = multidsn.parallelize(dsn(cfg, 5), world, placement=placement)
    again.optimizer(torch.optim.Adam, **adam)
    assert again.load(path) == {"seed": 0} and again.steps == 1
    for b in data[1:]:
        again.train_step(b)
    assert max(rel_errors(want, again.state_dict()).values()) <= 1e-12
    again.close()

    local = LocalDSN(dsn(cfg, 7))
    local.optimizer(torch.optim.Adam, **adam)
    local.load(path)
    for b in data[1:]:
        local.train_step_terms(b)
    assert max(rel_errors(want, local.state_dict()).values()) <= 1e-9


@pytest.mark.world(3)
def test_dsn_checkpoint_of_another_config_is_refused(world, tmp_path):
    small = multidsn.parallelize(dsn(tiny(1, "mmd"), 0), world)
    small.optimizer(torch.optim.Adam, lr=0.01)
    path = small.save(tmp_path / "small.pt")
    small.close()
    wide = multidsn.parallelize(dsn(tiny(1, "mmd", code_size=8), 0), world)
    wide.optimizer(torch.optim.Adam, lr=0.01)
    before = wide.state_dict()
    with pytest.raises(ValueError, match="from another architecture"):
        wide.load(path)
    assert all(torch.equal(before[k], v) for k, v in wide.state_dict().items())
    wide.close()
