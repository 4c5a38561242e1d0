"""``torch.autocast`` around a driver-mode call: refused with a clear error before any remote work, never
silently ignored (it is a setting of the driver's thread; the model runs in the workers' processes, where
one process's bf16 output would come back float32). A failure points at ``bigconv.parallel.refuse_autocast``."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import bigconv


@pytest.mark.world(2)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("call", ["forward", "train_step", "gradients"])
def test_autocast_around_a_driver_call_is_refused_before_remote_work(world, rpc_calls, call):
    net = bigconv.parallelize(nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.Conv2d(2, 2, 1)), world, grid=(2, 1))
    net.optimizer(torch.optim.SGD, lr=0.1)
    x, y = torch.randn(2, 1, 8, 8), torch.randn(2, 2, 8, 8)
    before = len(rpc_calls)
    run = {"forward": lambda: net(x), "train_step": lambda: net.train_step(x, y, nn.MSELoss()),
           "gradients": lambda: net.gradients(x, y, nn.MSELoss())}[call]
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ValueError) as info:
        run()
    assert "torch.autocast('cpu')" in str(info.value) and "inside the model's forward" in str(info.value)
    assert len(rpc_calls) == before
    assert net(x).dtype == torch.float32  # without autocast the same call runs
