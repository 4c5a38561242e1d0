"""Bad input gets a clear ValueError before any RPC traffic, naming the problem and the fix.

Every check here runs with ``rpc.rpc_async`` counted (the ``rpc_calls`` fixture of conftest.py): a failure that leaked to the workers first
would show up as remote calls, or as a confusing remote traceback instead of the message matched.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import bigconv
from bigconv.models import CNN1D, CNN2D


class RandPerm(nn.Module):
    """A draw bigconv cannot make consistently on every shard."""

    def forward(self, x):
        return x[:, torch.randperm(x.shape[1])]


@pytest.mark.world(4)
@pytest.mark.parametrize("model,grid,match", [
    (lambda: CNN2D(), (2, 3), "product is 4"),
    (lambda: CNN2D(), (2, 2.5), "positive integer"),
    (lambda: CNN2D(), (-2, -2), "positive integer"),
    (lambda: nn.Sequential(nn.Conv2d(1, 2, 3), nn.Conv1d(2, 2, 3)), None, "mixes convolutions"),
    (lambda: "not a model", (2, 2), "expects a torch.nn.Module"),
])
def test_parallelize_rejects(world, rpc_calls, model, grid, match):
    with pytest.raises(ValueError, match=match):
        bigconv.parallelize(model(), world, grid=grid)
    assert rpc_calls == []


@pytest.mark.world(4)
@pytest.mark.parametrize("transport", ["nccl", "P2P", None])
def test_unknown_transport_is_refused(world, rpc_calls, transport):
    with pytest.raises(ValueError, match=r"transport must be one of 'p2p', 'rpc' .*got " + repr(transport)):
        bigconv.parallelize(CNN2D(), world, grid=(2, 2), transport=transport)
    assert rpc_calls == []


class SpatialLinear(nn.Module):
    """A Linear applied along the width axis: cannot be split by rows of the image."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3, padding=1)
        self.mix = nn.Linear(8, 8)

    def forward(self, x):
        return self.mix(self.conv(x)).mean(dim=(2, 3))


@pytest.mark.world(4)
@pytest.mark.parametrize("model,grid,shape,match", [
    (lambda: CNN2D(), (2, 2), (1, 1, 16), r"expects \(N, C, \*2 spatial dims\)"),
    (lambda: CNN2D(), (2, 2), (1, 1, 8, 8, 8), r"expects \(N, C, \*2 spatial dims\)"),
    (lambda: CNN1D(), (2, 2), (1, 1, 16), r"expects \(N, C, \*2 spatial dims\)"),
    (lambda: CNN2D(in_channels=3), (2, 2), (1, 1, 8, 8), "cannot run on an input of shape"),
    (lambda: CNN2D(), (4, 1), (1, 1, 3, 8), "use at most 3 shards on that axis"),
    (lambda: nn.Sequential(nn.Conv2d(1, 2, 3), nn.MaxPool2d(2, return_indices=True)), (2, 2), (1, 1, 8, 8),
     r"max_pool2d_with_indices in module '1' \(MaxPool2d\).*return_indices=False"),
    (lambda: nn.Sequential(nn.Conv2d(1, 2, 3), nn.LayerNorm(6)), (2, 2), (1, 1, 8, 8),
     r"layer_norm in module '1' \(LayerNorm\): it normalizes over 1 of the 2 spatial dims.*GroupNorm\(1, C\)"),
    (lambda: nn.Sequential(nn.Conv2d(1, 2, 3), nn.Upsample(scale_factor=2, mode="area")), (2, 2), (1, 1, 8, 8),
     r"interpolate in module '1' \(Upsample\): mode 'area'.*'bicubic'"),
    (SpatialLinear, (2, 2), (1, 1, 8, 8), r"linear in module 'mix' \(Linear\)"),
    (lambda: nn.Sequential(nn.Conv2d(1, 2, 3), nn.Unfold(2)), (2, 2), (1, 1, 8, 8),  # im2col's columns: positions
     r"cannot return, from the model's forward, positions flattened"),
    (lambda: nn.Sequential(nn.Conv2d(1, 2, 3), nn.MaxUnpool2d(2)), (2, 2), (1, 1, 8, 8), r"module '1' \(MaxUnpool2d\)"),
    (lambda: nn.Sequential(nn.Conv2d(1, 2, 3), RandPerm()), (2, 2), (1, 1, 8, 8),
     r"randperm in module '1' \(RandPerm\): each worker would draw its own values"),
    (lambda: nn.Sequential(nn.Conv2d(1, 2, 3), nn.RReLU()), (2, 2), (1, 1, 8, 8),
     r"rrelu in module '1' \(RReLU\): in training mode it draws a slope per element.*nn.LeakyReLU"),
])
def test_first_call_rejects_before_remote_work(world, rpc_calls, model, grid, shape, match):
    net = bigconv.parallelize(model(), world, grid=grid)
    rpc_calls.clear()  # installing the model is the only remote work allowed so far
    with pytest.raises(ValueError, match=match):
        net(torch.randn(shape))
    net.optimizer(torch.optim.SGD, lr=0.1)
    rpc_calls.clear()
    with pytest.raises(ValueError, match=match):
        net.train_step(torch.randn(shape), torch.zeros(shape[0], dtype=torch.long), nn.CrossEntropyLoss())
    assert rpc_calls == []


@pytest.mark.world(4)
def test_train_step_needs_optimizer(world, rpc_calls):
    net = bigconv.parallelize(CNN2D(), world, grid=(2, 2))
    rpc_calls.clear()
    with pytest.raises(ValueError, match=r"net.optimizer\(torch.optim.SGD"):
        net.train_step(torch.randn(1, 1, 8, 8), torch.tensor([0]), nn.CrossEntropyLoss())
    with pytest.raises(ValueError, match="torch.optim.Optimizer class"):
        net.optimizer("sgd")
    assert rpc_calls == []


@pytest.mark.parametrize("kwargs,match", [
    ({"workers": 0}, "positive integer"), ({"workers": -3}, "positive integer"), ({"workers": 2.5}, "positive integer"),
    ({"workers": "4"}, "positive integer"), ({"workers": 2, "device": "tpu"}, "device must be"),
    ({"workers": 2, "timeout": 0}, "timeout must be"), ({"workers": 2, "threads_per_worker": 0}, "positive integer"),
])
def test_world_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        bigconv.World(**kwargs)


@pytest.mark.parametrize("kwargs", [{"width": 0}, {"depth": -1}, {"num_classes": 2.0}, {"kernel_size": True}])
def test_models_reject_bad_sizes(kwargs):
    with pytest.raises(ValueError, match="must be a positive integer"):
        CNN2D(**kwargs)


def _dense() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.ReLU(), nn.Conv2d(2, 2, 3, padding=1))


@pytest.mark.world(4)
@pytest.mark.parametrize("model,x,y,loss_fn,match", [
    (CNN2D, torch.randn(0, 1, 8, 8), torch.zeros(0, dtype=torch.long), nn.CrossEntropyLoss(), "the batch is empty"),
    (CNN2D, torch.randn(2, 1, 8, 8), torch.tensor([0, 5]), nn.CrossEntropyLoss(),
     r"class labels must lie in \[0, 2\).*y holds 5"),
    (CNN2D, torch.randn(2, 1, 8, 8), torch.tensor([-3, 1]), nn.NLLLoss(), r"class labels must lie in \[0, 2\)"),
    (_dense, torch.randn(1, 1, 8, 8), torch.full((1, 8, 8), 2), nn.CrossEntropyLoss(), r"\[0, 2\)"),
    (CNN2D, torch.randn(2, 1, 8, 8), torch.tensor([0, 1, 1]), nn.CrossEntropyLoss(), "x holds 2 images but y holds 3"),
    (_dense, torch.randn(1, 1, 8, 8), torch.randn(1, 2, 4, 4), nn.MSELoss(),
     r"cannot take the model's output of shape \(1, 2, 8, 8\) with targets of shape \(1, 2, 4, 4\)"),
    (CNN2D, torch.randn(2, 1, 8, 8), torch.tensor([0, 1]), nn.CrossEntropyLoss(reduction="none"),
     r"must return a scalar tensor, got \(2,\); use reduction='mean'"),
    (CNN2D, torch.randn(2, 1, 8, 8), [0, 1], nn.CrossEntropyLoss(), r"y must be a tensor.*torch.tensor"),
    (CNN2D, torch.randn(2, 1, 8, 8), torch.tensor([0, 1]), "cross_entropy", "loss_fn must be callable"),
])
def test_bad_batches_are_refused_before_remote_work(world, rpc_calls, model, x, y, loss_fn, match):
    net = bigconv.parallelize(model(), world, grid=(2, 2))
    net.optimizer(torch.optim.SGD, lr=0.1)
    rpc_calls.clear()
    with pytest.raises(ValueError, match=match):
        net.train_step(x, y, loss_fn)
    with pytest.raises(ValueError, match=match):
        net.gradients(x, y, loss_fn)
    assert rpc_calls == []


@pytest.mark.world(4)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_is_refused_when_asked(world, rpc_calls, bad):
    x = torch.randn(1, 1, 8, 8)
    x[0, 0, 3, 4] = bad
    x[0, 0, 6, 1] = bad  # on another shard of the (2, 2) grid: the count is of the whole image
    net = bigconv.parallelize(CNN2D(), world, grid=(2, 2), check_finite=True)
    rpc_calls.clear()
    with pytest.raises(ValueError, match="x holds 2 NaN or infinite values"):
        net(x)
    assert rpc_calls == []
    unchecked = bigconv.parallelize(CNN2D(), world, grid=(2, 2))  # off by default: the value flows through
    assert not torch.isfinite(unchecked(x)).all()


@pytest.mark.own_world
@pytest.mark.timeout(60)
def test_a_closed_world_is_refused(exclusive):
    with bigconv.World(workers=1) as world:
        pass
    with pytest.raises(ValueError, match="this World is closed; open a new one"):
        bigconv.parallelize(CNN2D(), world)


@pytest.mark.world(4)
@pytest.mark.parametrize("x,model_dtype,match", [
    (torch.randint(0, 256, (1, 1, 8, 8), dtype=torch.uint8), torch.float32,
     r"x is uint8 but the model is float32.*x.to\(torch.float32\) / 255.*scale=1/255"),
    (torch.randn(1, 1, 8, 8), torch.float64, r"x is float32 but the model is float64.*x.to\(torch.float64\)"),
    (torch.randn(1, 1, 8, 8, dtype=torch.float64), torch.float32, r"x is float64 but the model is float32.*x.float\(\)"),
])
def test_dtype_mismatch_names_both_dtypes_and_the_fix(world, rpc_calls, x, model_dtype, match):
    net = bigconv.parallelize(CNN2D().to(model_dtype), world, grid=(2, 2))
    rpc_calls.clear()
    with pytest.raises(ValueError, match=match):
        net(x)
    assert rpc_calls == []


def test_sources_of_another_dtype_name_open_image_dtype(tmp_path):
    """Sources read as float32 (open_image's default) into a float64 model: the fix is open_image's dtype."""
    import numpy as np

    from bigconv.data import open_image
    from bigconv.planning import Planner

    np.save(tmp_path / "img.npy", np.zeros((1, 16, 16), dtype=np.uint8))
    planner = Planner(CNN2D().double(), (2, 2), 4, check_finite=False)
    with pytest.raises(ValueError, match=r"sources give float32 but the model is float64.*dtype='float64'"):
        planner.plan([open_image(tmp_path / "img.npy", scale=1 / 255)], training=True)
    plan = planner.plan([open_image(tmp_path / "img.npy", dtype="float64", scale=1 / 255)], training=True)
    assert plan.grid == (2, 2)


def test_unsupported_operation_is_a_value_error():
    """The README promises a ValueError for refused ops; UnsupportedOperation keeps that promise."""
    assert issubclass(bigconv.UnsupportedOperation, ValueError)
