"""The exactness metric itself (``bigconv.verify``): it must be able to fail.

Every other equivalence test trusts ``compare_training``; here the metric is shown to flag errors
that a model-wide denominator hid, and to pass what is exact:

- a 0.1% error in the smallest gradient tensor of a timm ConvNeXt (1e-9 of the largest gradient)
  and a 1e-6 relative error in a trained BatchNorm bias of a timm ResNet are flagged, each named;
- an integer buffer off by one (``num_batches_tracked``) is flagged, a nan anywhere is flagged;
- end to end, a branch whose gradient is a millionth of the largest, computed 0.1% wrong on the
  workers only, is flagged by ``compare_training`` on a World;
- a conv -> BatchNorm model, whose conv bias has an exact gradient of 0 that both sides compute as
  rounding residue (the same residue read against its own size is 1.0), passes: the residue is
  judged against what one-ulp perturbations move it in one process;
- an ill-conditioned zoo model (timm's MobileNetV4 on 2x64x64, where BatchNorm over 2x2 maps lets a
  one-ulp perturbation move running statistics and biases by more than their own size) passes
  against its own sensitivity, and the tensors judged that way are listed.

A failure points at bigconv/verify.py.
"""

from __future__ import annotations

import copy
import dataclasses
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from zoo import BY_NAME

from bigconv.verify import (
    ERROR_KEYS, Run, compare_training, judge, measure_noise, named_tensors, summarize, train_single,
)

TOL = 1e-9


def runs(entry_name: str):
    """The reference run of a zoo model and its noise (single process, float64)."""
    entry = BY_NAME[entry_name]
    torch.manual_seed(0)
    model = entry.build().double()
    x, y = entry.inputs(torch.Generator().manual_seed(1))
    loss_fn = nn.CrossEntropyLoss()
    ref = train_single(copy.deepcopy(model), x, y, loss_fn)
    return ref, measure_noise(model, x, y, loss_fn, ref)


def with_tensor(run, field: str, name: str, value: torch.Tensor):
    return dataclasses.replace(run, **{field: {**getattr(run, field), name: value}})


@pytest.fixture(scope="module")
def convnext():
    return runs("timm/convnext_atto")


@pytest.fixture(scope="module")
def resnet():
    return runs("timm/resnet18")


def test_the_reference_passes_and_the_noise_is_rounding(convnext):
    ref, noise = convnext
    assert summarize(judge(ref, ref, noise, TOL), TOL)["exact"]
    named = named_tensors(ref)
    assert set(noise) == set(named)
    # One-ulp perturbations move each tensor by rounding, far below its tolerance (the floor matters only
    # where a tensor is a residue or ill-conditioned).
    moved = [k for k, v in named.items() if v.is_floating_point() and noise[k] > 1e-9 * v.abs().max().item()]
    assert not moved or all(named[k].abs().max().item() < 1e-12 for k in moved), moved


def test_a_wrong_smallest_convnext_gradient_is_flagged(convnext):
    ref, noise = convnext
    sizes = {n: g.abs().max().item() for n, g in ref.param_grads.items()}
    smallest = min((n for n in sizes if sizes[n] > 0), key=sizes.get)
    assert sizes[smallest] < 1e-6 * max(sizes.values())  # the case a model-wide denominator cannot see
    got = with_tensor(ref, "param_grads", smallest, ref.param_grads[smallest] * (1 + 1e-3))
    r = summarize(judge(got, ref, noise, TOL), TOL)
    assert not r["exact"]
    assert r["worst"]["param_grads"]["tensor"] == smallest
    assert r["param_grads"] == pytest.approx(1e-3, rel=1e-6)
    # The old check divided by the largest gradient of the model: it read this as exact.
    old = (got.param_grads[smallest] - ref.param_grads[smallest]).abs().max().item() / max(sizes.values())
    assert old < TOL


def test_a_wrong_batchnorm_bias_is_flagged(resnet):
    ref, noise = resnet
    name = "layer4.0.bn1.bias"
    got = with_tensor(ref, "state", name, ref.state[name] * (1 + 1e-6))
    r = summarize(judge(got, ref, noise, TOL), TOL)
    assert not r["exact"]
    assert r["worst"]["weights"]["tensor"] == name
    assert r["weights"] == pytest.approx(1e-6, rel=1e-3)


def test_integer_buffers_are_compared_exactly(resnet):
    ref, noise = resnet
    name = "bn1.num_batches_tracked"
    r = summarize(judge(with_tensor(ref, "state", name, ref.state[name] + 1), ref, noise, TOL), TOL)
    assert r["weights"] == float("inf") and r["worst"]["weights"]["tensor"] == name and not r["exact"]


def test_nan_is_never_exact(resnet):
    ref, noise = resnet
    grad = ref.param_grads["fc.weight"].clone()
    grad[0, 0] = float("nan")
    r = summarize(judge(with_tensor(ref, "param_grads", "fc.weight", grad), ref, noise, TOL), TOL)
    assert not r["exact"] and r["worst"]["param_grads"]["tensor"] == "fc.weight"


def test_a_missing_gradient_is_flagged(resnet):
    ref, noise = resnet
    got = dataclasses.replace(ref, param_grads={n: g for n, g in ref.param_grads.items() if n != "conv1.weight"})
    r = summarize(judge(got, ref, noise, TOL), TOL)
    assert not r["exact"] and r["worst"]["param_grads"]["tensor"] == "conv1.weight"


class _WrongGradOnWorkers(torch.autograd.Function):
    """Identity; in backward, scales the gradient by 1.001 in any process but the one that built the model."""

    @staticmethod
    def forward(ctx, w, driver_pid):
        ctx.wrong = os.getpid() != driver_pid
        return w.view_as(w)

    @staticmethod
    def backward(ctx, g):
        return (g * (1 + 1e-3) if ctx.wrong else g), None


class SmallBranchWrongOnWorkers(nn.Module):
    """A residual branch scaled by 1e-6 (its weights' gradients a millionth of the trunk's), whose weight
    gradient the workers compute 0.1% wrong."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Conv2d(1, 4, 3, padding=1)
        self.branch = nn.Conv2d(4, 4, 3, padding=1)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))
        self.driver_pid = os.getpid()

    def forward(self, x):
        y = torch.tanh(self.trunk(x))
        w = _WrongGradOnWorkers.apply(self.branch.weight, self.driver_pid)
        return self.head(y + 1e-6 * F.conv2d(y, w, self.branch.bias, padding=1))


@pytest.mark.world(4)
@pytest.mark.timeout(120)
def test_a_small_branch_wrong_on_the_workers_is_flagged(world):
    torch.manual_seed(0)
    x = torch.randn(2, 1, 12, 10, dtype=torch.float64)
    r = compare_training(SmallBranchWrongOnWorkers().double(), world, x, torch.tensor([0, 2]), nn.CrossEntropyLoss(),
                         grid=(2, 2))
    assert not r["exact"]
    assert r["worst"]["param_grads"]["tensor"] == "branch.weight"
    assert r["param_grads"] == pytest.approx(1e-3, rel=1e-3)
    # Everything the wrong gradient does not touch stays exact, so the verdict names the right place.
    assert r["forward"] <= TOL and r["input_grad"] <= TOL


@pytest.mark.world(4)
@pytest.mark.timeout(120)
def test_a_rounding_residue_judged_against_its_noise_passes(world):
    """conv -> BatchNorm: the conv bias's exact gradient is 0; both sides hold rounding residue."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(), nn.Conv2d(3, 3, 3, padding=1),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, 3)).double()
    x = torch.randn(2, 1, 12, 10, dtype=torch.float64)
    r = compare_training(model, world, x, torch.tensor([0, 2]), nn.CrossEntropyLoss(), grid=(2, 2))
    bias = next(t for t in r["tensors"] if t["category"] == "param_grads" and t["tensor"] == "0.bias")
    assert bias["error"] > 1e-3 * bias["scale"]  # against its own size alone this would read as wrong
    assert bias["scale"] < 1e-14 * max(t["scale"] for t in r["tensors"] if t["category"] == "param_grads")
    assert r["exact"], {k: r["worst"][k] for k in ERROR_KEYS}


@pytest.mark.world(2)
@pytest.mark.timeout(180)
def test_an_ill_conditioned_zoo_model_passes_against_its_noise(world):
    """The zoo runs this model at 4x96x96 because at 2x64x64 the old check read a mismatch (loss 1e-8)."""
    entry = BY_NAME["timm/mobilenetv4_conv_small_050"]
    torch.manual_seed(0)
    model = entry.build().double()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64, generator=g)
    r = compare_training(model, world, x, torch.randint(0, entry.num_classes, (2,), generator=g), nn.CrossEntropyLoss(),
                         grid=entry.grid)
    assert r["exact"], {k: r["worst"][k] for k in ERROR_KEYS}
    # It is ill-conditioned: some tensors differ from one process by more than 1e-6 of their own size, and
    # each of those is one that rounding alone moves as far in one process.
    far = [t for t in r["tensors"] if t["error"] > 1e-6 * max(t["scale"], t["spread"])]
    assert far
    listed = {(t["category"], t["tensor"]) for t in r["ill_conditioned"]}
    assert all((t["category"], t["tensor"]) in listed for t in far), far


def test_a_running_mean_is_judged_against_its_spread():
    """A mean that one process computes as a structural 0.0 is known only to rounding of the spread it
    averages: a residue of 1e-18 passes, a mean off by 1e-6 of the spread does not."""
    state = {"bn.running_mean": torch.zeros(3, dtype=torch.float64), "bn.running_var": torch.full((3,), 4.0).double()}
    ref = Run(torch.ones(1, dtype=torch.float64), torch.ones(1, dtype=torch.float64), {}, [], state)
    noise = {k: 0.0 for k in named_tensors(ref)}
    for offset, exact in ((1e-18, True), (2e-6, False)):
        got = dataclasses.replace(ref, state={**state, "bn.running_mean": torch.tensor([0.0, offset, 0.0]).double()})
        r = summarize(judge(got, ref, noise, TOL), TOL)
        assert r["exact"] is exact, r["worst"]["weights"]


class DependsOnBatchOrder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 3, padding=1)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())

    def forward(self, x):
        y = self.head(self.conv(x))
        return y * torch.arange(1, y.shape[0] + 1, dtype=y.dtype).view(-1, 1)  # sample i scaled by i + 1


def test_the_reversed_batch_run_is_used_only_where_the_model_allows_it():
    """The noise run on a reversed batch puts output and input gradient back in order; a model that is not
    the same function of a reordered batch gets no such run (its differences are not rounding)."""
    from bigconv.verify import _reversed_run

    torch.manual_seed(0)
    x, y = torch.randn(3, 1, 6, 5, dtype=torch.float64), torch.tensor([0, 2, 1])
    loss_fn = nn.CrossEntropyLoss()
    plain = nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.BatchNorm2d(3), nn.AdaptiveAvgPool2d(1), nn.Flatten()).double()
    ref = train_single(copy.deepcopy(plain), x, y, loss_fn)
    run = _reversed_run(copy.deepcopy(plain), x, y, loss_fn, ref, 2, torch.optim.SGD, None)
    assert run is not None
    assert torch.allclose(run.output, ref.output, rtol=1e-12) and torch.allclose(run.input_grad, ref.input_grad,
                                                                                   rtol=1e-9, atol=1e-15)
    odd = DependsOnBatchOrder().double()
    assert _reversed_run(copy.deepcopy(odd), x, y, loss_fn, train_single(copy.deepcopy(odd), x, y, loss_fn), 2,
                         torch.optim.SGD, None) is None
    assert _reversed_run(copy.deepcopy(plain), x[:1], y[:1], loss_fn, ref, 2, torch.optim.SGD, None) is None
