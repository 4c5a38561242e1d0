"""The habits users train with, against one process in float64 (issue 22, items 1-5).

Random draws (dropout, stochastic depth, noise) are compared *bitwise in law's place*: the single
process draws under ``bigconv.ops.random.RandomDraws(seed)``, the generator the shards use, so the
comparison is exact; against torch's own generator the draws agree in law only. Errors are asserted
raw (error over the tensor's own size; residues, zero in exact arithmetic, against their rounding noise:
``tests/verdicts.py``).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from verdicts import assert_exact

import bigconv
from bigconv.compat import allow_torchvision_without_ops
from bigconv.ops.random import RandomDraws
from bigconv.verify import compare_training

TOL = 1e-9
allow_torchvision_without_ops()  # before torchvision (and timm/smp, which import it)


class DropPath(nn.Module):
    """timm's ``DropPath`` as timm writes it: one (N, 1, 1, 1) draw per image."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x):
        if not self.training or self.p == 0:
            return x
        keep = 1 - self.p
        mask = x.new_empty((x.shape[0],) + (1,) * (x.dim() - 1)).bernoulli_(keep)
        return x * mask.div_(keep)


class Block(nn.Module):
    def __init__(self, c: int, drop) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.drop = drop

    def forward(self, x):
        return x + self.drop(torch.tanh(self.conv(x)))


def stochastic_net(c: int = 4) -> nn.Module:
    """Every kind of draw: per image (DropPath, torchvision's StochasticDepth), per position
    (Dropout, AlphaDropout, noise), per channel (Dropout2d), and dropout in the replicated head."""
    from torchvision.ops import StochasticDepth

    class Noisy(nn.Module):
        def forward(self, x):
            return x + 0.1 * torch.randn_like(x) + 0.05 * torch.rand(x.shape, dtype=x.dtype)

    return nn.Sequential(
        nn.Conv2d(2, c, 3, padding=1), Block(c, DropPath(0.5)), Block(c, StochasticDepth(0.5, "row")),
        nn.Dropout(0.3), Block(c, nn.Dropout2d(0.4)), Noisy(), nn.AlphaDropout(0.2), nn.Conv2d(c, c, 3, stride=2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.5), nn.Linear(c, 3),
    ).double()


@pytest.mark.world(4)
@pytest.mark.timeout(300)
def test_training_randomness_is_one_process_draw(world):
    torch.manual_seed(0)
    model = stochastic_net().train()
    x = torch.randn(4, 2, 13, 11, dtype=torch.float64)
    y = torch.randint(0, 3, (4,))
    r = compare_training(model, world, x, y, nn.CrossEntropyLoss(), grid=(2, 2), seed=11)
    assert_exact(r)


@pytest.mark.world(4)
@pytest.mark.timeout(300)
def test_draws_do_not_depend_on_the_grid(world):
    """The same seed on another grid gives the same output: the draws follow global positions."""
    torch.manual_seed(0)
    model = stochastic_net().train()
    x = torch.randn(2, 2, 12, 12, dtype=torch.float64)
    outs = [bigconv.parallelize(copy.deepcopy(model), world, grid=g, seed=3)(x) for g in ((2, 2), (4, 1))]
    with RandomDraws(3).forward():
        want = model(x)
    for out in outs:
        assert torch.allclose(out, want, rtol=1e-12, atol=1e-12)


def test_draws_follow_torch_law():
    """Uniform, Bernoulli and normal draws with the laws torch's own generator gives."""
    x = torch.ones(200, 500, dtype=torch.float64)
    with RandomDraws(7).forward():
        kept = (F.dropout(x, 0.3, True) != 0).double().mean().item()
        per_image = torch.empty(4000, 1, 1, 1).bernoulli_(0.8).mean().item()
        z = torch.randn(100000, dtype=torch.float64)
        u = torch.rand(100000, dtype=torch.float32)
    assert abs(kept - 0.7) < 0.01 and abs(per_image - 0.8) < 0.03
    assert abs(z.mean().item()) < 0.02 and abs(z.std().item() - 1) < 0.02
    assert 0.0 <= u.min().item() and u.max().item() < 1.0 and abs(u.mean().item() - 0.5) < 0.01
    with RandomDraws(7).forward():
        again = F.dropout(x, 0.3, True)
    with RandomDraws(8).forward():
        other = F.dropout(x, 0.3, True)
    with RandomDraws(7).forward():
        same = F.dropout(x, 0.3, True)
    assert torch.equal(again, same) and not torch.equal(again, other)


@pytest.mark.world(4)
@pytest.mark.timeout(120)
def test_unsupported_draws_are_refused(world):
    class Shuffle(nn.Module):
        def forward(self, x):
            return x * torch.randint(0, 2, x.shape, dtype=x.dtype)

    net = bigconv.parallelize(nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), Shuffle()).double(), world, grid=(2, 2))
    with pytest.raises(ValueError, match="each worker would draw its own values"):
        net.plan(torch.zeros(1, 1, 8, 8, dtype=torch.float64))


@pytest.mark.world(4)
@pytest.mark.timeout(300)
def test_rrelu_in_eval_mode_is_exact(world):
    """Its training mode is refused (tests/test_errors.py); in eval mode it is pointwise."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.RReLU(0.1, 0.3), nn.Conv2d(3, 2, 3, padding=1)).double()
    x = torch.randn(2, 1, 10, 10, dtype=torch.float64)
    r = compare_training(model.eval(), world, x, torch.randn(2, 2, 10, 10, dtype=torch.float64), nn.MSELoss(),
                         grid=(2, 2))
    assert r["exact"], r["worst"]


def parametrized_net(old_style: bool) -> nn.Module:
    from torch.nn.utils import parametrizations

    wn = nn.utils.weight_norm if old_style else parametrizations.weight_norm
    sn = nn.utils.spectral_norm if old_style else parametrizations.spectral_norm
    return nn.Sequential(
        wn(nn.Conv2d(2, 4, 3, padding=1)), nn.ReLU(), sn(nn.Conv2d(4, 4, 3, padding=1)), nn.Tanh(),
        wn(nn.Conv2d(4, 4, 3, stride=2)), nn.AdaptiveAvgPool2d(1), nn.Flatten(), sn(nn.Linear(4, 3)),
    ).double()


@pytest.mark.world(4)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("old_style", [False, True], ids=["parametrizations", "hooks"])
def test_parametrized_weights_train_exactly(world, old_style):
    """weight_norm and spectral_norm (whose power iteration updates u and v in every training forward):
    the weights, their originals and the power-iteration buffers end as one process's on every replica."""
    import warnings

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nn.utils.weight_norm is deprecated
        model = parametrized_net(old_style).train()
    x = torch.randn(2, 2, 12, 10, dtype=torch.float64)
    y = torch.randint(0, 3, (2,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = compare_training(model, world, x, y, nn.CrossEntropyLoss(), grid=(2, 2))
    assert_exact(r)
    names = {t["tensor"] for t in r["tensors"] if t["category"] == "weights"}
    assert any(n.endswith(("_u", "weight_u", "original0")) for n in names), names


class Offloaded(nn.Module):
    """Activations saved for backward go to host memory (``save_on_cpu``), as IBM LMS users do."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(2, 4, 3, padding=1)
        self.b = nn.Conv2d(4, 4, 3, stride=2, padding=1)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))

    def forward(self, x):
        with torch.autograd.graph.save_on_cpu():
            x = self.b(torch.tanh(self.a(x)))
        return self.head(torch.relu(x))


@pytest.mark.world(4)
@pytest.mark.timeout(300)
def test_save_on_cpu_trains_exactly(world):
    torch.manual_seed(0)
    x = torch.randn(2, 2, 12, 10, dtype=torch.float64)
    r = compare_training(Offloaded().double(), world, x, torch.randint(0, 3, (2,)), nn.CrossEntropyLoss(), grid=(2, 2))
    assert_exact(r)


class PlainAttribute(nn.Module):
    """A tensor held as a plain attribute (not a buffer): ``model.to(device)`` would not move it."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3, padding=1)
        self.scale = torch.ones(1, 2, 1, 1)

    def forward(self, x):
        return self.conv(x) * self.scale


def test_dry_run_is_all_meta(monkeypatch):
    """A real tensor other than a CPU scalar in the dry run is a clear error; 0-dim buffers (BatchNorm's
    ``num_batches_tracked``) are kept on the CPU whatever the model's device."""
    from bigconv.engine.dry_run import dry_run, meta_copy

    with pytest.raises(ValueError, match=r"tensor of shape \(1, 2, 1, 1\) on cpu.*'<root>' \(PlainAttribute\).*"
                                         r"register_buffer"):
        dry_run(meta_copy(PlainAttribute()), (2, 2), (1, 1, 8, 8), torch.float32, True)
    bn = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2, momentum=None))
    moved = []
    real_cpu = torch.Tensor.cpu

    def cpu(t, *args, **kwargs):  # on a CUDA host the scalar would come from the GPU: record the move
        moved.append(tuple(t.shape))
        return real_cpu(t, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "cpu", cpu)
    meta = meta_copy(bn)
    monkeypatch.undo()
    assert () in moved
    assert {b.device.type for b in meta.buffers()} == {"meta", "cpu"}
    assert {b.device.type for b in meta.buffers() if b.dim()} == {"meta"}
    dry_run(meta, (2, 2), (1, 1, 8, 8), torch.float32, True)


def test_planned_shapes_are_checked_against_one_process():
    """The guard names the module whose planned global shape differs from one process's."""
    from bigconv.engine.dry_run import PlanMismatch, check_shapes, meta_copy

    meta = meta_copy(nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU()))
    right = [("'0' (Conv2d)", [(1, 2, 6, 6)]), ("'1' (ReLU)", [(1, 2, 6, 6)]), ("'<root>' (Sequential)", [(1, 2, 6, 6)])]
    check_shapes(meta, right, (1, 1, 8, 8), torch.float32, True)
    wrong = right[:1] + [("'1' (ReLU)", [(1, 2, 7, 6)])] + right[2:]
    with pytest.raises(PlanMismatch, match=r"\[\(1, 2, 7, 6\)\] for module '1' \(ReLU\).*one process gives "
                                           r"\[\(1, 2, 6, 6\)\].*bug in bigconv"):
        check_shapes(meta, wrong, (1, 1, 8, 8), torch.float32, True)


def test_smp_efficientnet_plans_one_process_shape():
    """smp's EfficientNet pads with F.pad computed from x.shape, then returns its input as the first feature:
    the pad rule marked that very input with the padded shape, so the plan became 65x65."""
    import segmentation_models_pytorch as smp

    from bigconv.planning import Planner

    torch.manual_seed(0)
    model = smp.Unet(encoder_name="efficientnet-b0", encoder_weights=None, encoder_depth=3,
                     decoder_channels=(16, 8, 8), classes=2)
    plan = Planner(model, (2, 2), 4, False).plan(torch.zeros(1, 3, 64, 64), True)
    assert plan.out_full_shape == (1, 2, 64, 64)


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(2, 4, 3, padding=1)
        self.b = nn.Conv2d(4, 3, 3, stride=2)

    def forward(self, x):
        return self.b(F.gelu(self.a(x))).mean((2, 3))


@pytest.mark.world(2)
@pytest.mark.timeout(600)
@pytest.mark.parametrize("how", ["compiled_model", "compile_option"])
def test_torch_compile_trains_exactly(world, how):
    """``parallelize(torch.compile(model))`` and ``parallelize(model, compile=True)``: every worker runs its
    shard's forward through torch.compile; the one process runs the compiled (or plain) model."""
    torch.manual_seed(0)
    model = Tiny().double()
    x = torch.randn(2, 2, 10, 8, dtype=torch.float64)
    y = torch.randint(0, 3, (2,))
    if how == "compiled_model":
        r = compare_training(torch.compile(model), world, x, y, nn.CrossEntropyLoss(), grid=(2, 1))
    else:
        import bigconv.verify as verify

        real = verify.parallelize
        verify.parallelize = lambda *a, **k: real(*a, compile=True, **k)
        try:
            r = compare_training(model, world, x, y, nn.CrossEntropyLoss(), grid=(2, 1))
        finally:
            verify.parallelize = real
    assert_exact(r)


class CheckpointedDropout(nn.Module):
    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.checkpointed = checkpointed
        self.block = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.Dropout(0.4), nn.Tanh(), DropPath(0.25),
                                   nn.Conv2d(4, 4, 3, padding=1))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.3), nn.Linear(4, 3))

    def forward(self, x):
        if self.checkpointed:
            x = torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)
        else:
            x = self.block(x)
        return self.head(x)


@pytest.mark.world(4)
@pytest.mark.timeout(300)
def test_checkpoint_recompute_draws_the_forward_masks(world):
    """A checkpointed block's recompute (in backward) must draw the masks its forward drew: the
    gradients equal those of the same model without checkpointing, on the same seed."""
    torch.manual_seed(0)
    plain = CheckpointedDropout(False).double().train()
    ckpt = copy.deepcopy(plain)
    ckpt.checkpointed = True
    x = torch.randn(4, 1, 12, 10, dtype=torch.float64)
    y = torch.randint(0, 3, (4,))
    got = [bigconv.parallelize(m, world, grid=(2, 2), seed=9).gradients(x, y, nn.CrossEntropyLoss())
           for m in (plain, ckpt)]
    (loss_a, gx_a, gp_a), (loss_b, gx_b, gp_b) = got
    assert loss_a == loss_b and torch.equal(gx_a, gx_b)
    assert gx_a.abs().sum() > 0 and set(gp_a) == set(gp_b)
    for name in gp_a:
        assert torch.equal(gp_a[name], gp_b[name]), name
