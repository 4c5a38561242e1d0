"""multidsn without workers: the four losses against hand-computed values, the config and batch checks,
the single-process DSN's warm-up, and the placement arithmetic.

A failure here points at multidsn/losses.py, config.py, batch.py, model.py or placement.py; the
distributed tests build on all of them.
"""

import math

import pytest
import torch

import multidsn
from multidsn import losses
from multidsn.placement import Placement, workers_needed


def tiny(**kw) -> multidsn.DSNConfig:
    base = dict(image_size=8, channels=2, num_classes=3, num_targets=1, code_size=6, shared_widths=(4,),
                private_widths=(3,), decoder_widths=(4,), code_grid=2, classifier_hidden=5)
    base.update(kw)
    return multidsn.DSNConfig(**base)


def batch_for(cfg, n=4, dtype=torch.float32, seed=0) -> multidsn.Batch:
    g = torch.Generator().manual_seed(seed)
    shape = (cfg.channels, cfg.image_size, cfg.image_size)
    return multidsn.Batch(source=(torch.randn(n, *shape, generator=g, dtype=dtype),
                                  torch.randint(0, cfg.num_classes, (n,), generator=g)),
                          targets=[torch.randn(n + 1, *shape, generator=g, dtype=dtype)
                                   for _ in range(cfg.num_targets)])


# -- losses ------------------------------------------------------------------------------------------
def test_scale_invariant_mse_by_hand():
    pred = torch.tensor([[[[1.0, 2.0], [3.0, 4.0]]]])
    # d = 1, 2, 3, 4; k = 4: 30 / 4 - 10^2 / 16 = 1.25
    assert losses.scale_invariant_mse(pred, torch.zeros_like(pred)).item() == pytest.approx(1.25)


def test_scale_invariant_mse_ignores_a_constant_per_image():
    pred, target = torch.randn(3, 2, 5, 5, dtype=torch.float64), torch.randn(3, 2, 5, 5, dtype=torch.float64)
    shift = torch.tensor([0.5, -3.0, 7.0], dtype=torch.float64).view(3, 1, 1, 1)
    base = losses.scale_invariant_mse(pred, target)
    assert losses.scale_invariant_mse(pred + shift, target).item() == pytest.approx(base.item(), rel=1e-12)
    assert base.item() < torch.nn.functional.mse_loss(pred + shift, target).item()  # a plain MSE is not invariant


def test_difference_loss_raw_is_frobenius_of_the_correlation():
    shared = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    private = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    # H_c^T H_p = H_p: 1 + 4 + 9 + 16
    assert losses.difference_loss(shared, private, normalized=False).item() == pytest.approx(30.0)


def test_difference_loss_normalized_centres_and_normalises():
    # One-dimensional codes of two images: centred [-1, 1] and [1, -1], each row normalised to +-1;
    # correlation (-1)(1) + (1)(-1) = -2, squared 4, mean over the 1 x 1 matrix.
    shared, private = torch.tensor([[1.0], [3.0]]), torch.tensor([[2.0], [0.0]])
    assert losses.difference_loss(shared, private).item() == pytest.approx(4.0)
    # Shrinking the private codes cannot lower it (the collapse route of the raw version).
    s, p = torch.randn(6, 4), torch.randn(6, 4)
    assert losses.difference_loss(s, 1e-3 * p).item() == pytest.approx(losses.difference_loss(s, p).item(), rel=1e-4)
    assert losses.difference_loss(s, 1e-3 * p, normalized=False) < 1e-5 * losses.difference_loss(s, p, normalized=False)


def test_dann_loss_by_hand_and_gradient_reversal():
    clf = torch.nn.Linear(2, 2)
    with torch.no_grad():
        clf.weight.copy_(torch.eye(2))
        clf.bias.zero_()
    source = torch.tensor([[1.0, 0.0]], requires_grad=True)
    target = torch.tensor([[0.0, 0.0]], requires_grad=True)
    loss = losses.dann_loss(clf, [source, target], grl_scale=0.5)
    # source: logits (1, 0), label 0 -> log(1 + e^-1); target: logits (0, 0), label 1 -> log 2
    assert loss.item() == pytest.approx((math.log(1 + math.exp(-1)) + math.log(2)) / 2)
    loss.backward()
    plain = torch.tensor([[1.0, 0.0]], requires_grad=True)
    torch.nn.functional.cross_entropy(clf(torch.cat([plain, target.detach()])), torch.tensor([0, 1])).backward()
    assert torch.allclose(source.grad, -0.5 * plain.grad)  # the encoder climbs the domain loss
    assert clf.weight.grad is not None and clf.weight.grad.abs().sum() > 0  # the classifier descends it


def test_dann_schedule_ramps_the_reversal_factor():
    cfg = tiny(warmup_steps=10, grl_schedule="dann", grl_ramp_steps=100, grl_scale=0.5)
    assert cfg.grl_factor(0) == cfg.grl_factor(10) == 0.0  # off through the warm-up and at its end
    # Ganin & Lempitsky: lambda_p = 2 / (1 + exp(-10 p)) - 1, p the progress through the ramp
    assert cfg.grl_factor(35) == pytest.approx(0.5 * (2 / (1 + math.exp(-2.5)) - 1))
    assert cfg.grl_factor(110) == cfg.grl_factor(10_000) == pytest.approx(0.5 * (2 / (1 + math.exp(-10)) - 1))
    assert tiny(grl_scale=0.5).grl_factor(0) == 0.5  # constant by default
    with pytest.raises(ValueError, match="grl_schedule"):
        tiny(grl_schedule="linear")


def test_dann_schedule_scales_the_encoder_gradient_only():
    cfg = tiny(similarity="dann", grl_schedule="dann", grl_ramp_steps=4, alpha=0.0, beta=0.0)
    b = batch_for(cfg)
    grads = []
    for step in (0, 2):
        torch.manual_seed(0)
        dsn = multidsn.DSN(cfg)
        multidsn.model.head_terms(cfg, dsn.classifier, dsn.domain_classifier,
                                  [dsn.shared_encoder(x) for x in b.images], b.labels, step)[1].backward()
        grads.append((dsn.shared_encoder.code.weight.grad.clone(), dsn.domain_classifier[0].weight.grad.clone()))
    assert grads[0][0].abs().max() == 0  # factor 0 at the ramp's start: the encoder sees nothing
    assert torch.allclose(grads[0][1], grads[1][1])  # the domain classifier always learns at full rate
    assert grads[1][0].abs().max() > 0


def test_mmd_by_hand():
    x, y = torch.tensor([[0.0]]), torch.tensor([[1.0]])
    # k(x, x) = k(y, y) = 1, k(x, y) = exp(-1 / (2 * 0.5))
    assert losses.mmd(x, y, [0.5]).item() == pytest.approx(2 - 2 * math.exp(-1))
    assert losses.mmd(x, y, [0.5, 2.0]).item() == pytest.approx(4 - 2 * math.exp(-1) - 2 * math.exp(-0.25))
    same = torch.randn(5, 3)
    assert losses.mmd(same, same.clone(), [1.0]).item() == pytest.approx(0.0, abs=1e-6)


def test_mmd_loss_averages_over_targets():
    s, t1, t2 = torch.zeros(1, 1), torch.ones(1, 1), 2 * torch.ones(1, 1)
    want = (losses.mmd(s, t1, [1.0]) + losses.mmd(s, t2, [1.0])) / 2
    assert losses.mmd_loss([s, t1, t2], [1.0]).item() == pytest.approx(want.item())


# -- the model -----------------------------------------------------------------------------------------
def test_dsn_shapes_and_state_dict_names():
    cfg = tiny(num_targets=3)
    dsn = multidsn.DSN(cfg)
    x = torch.randn(2, 2, 8, 8)
    assert dsn(x).shape == (2, 3)
    assert dsn.reconstruct(x, 3).shape == x.shape
    names = {k.split(".")[0] for k in dsn.state_dict()}
    assert names == {"shared_encoder", "private_encoders", "decoder", "classifier", "domain_classifier"}
    assert multidsn.DSN(tiny(similarity="mmd")).domain_classifier is None


@pytest.mark.parametrize("size", [28, 64])
def test_dsn_runs_at_several_image_sizes(size):
    cfg = tiny(image_size=size, shared_widths=(4, 4, 4), decoder_widths=(4, 4))
    loss = multidsn.DSN(cfg).loss(batch_for(cfg, n=2), step=0)
    assert torch.isfinite(loss)


def test_warmup_uses_the_task_loss_alone():
    cfg = tiny(warmup_steps=2)
    dsn = multidsn.DSN(cfg)
    b = batch_for(cfg)
    terms = dsn.loss_terms(b, step=1)
    want = torch.nn.functional.cross_entropy(dsn(b.source[0]), b.source[1])
    assert terms.total.item() == pytest.approx(want.item())
    terms.total.backward()
    assert all(p.grad is None for p in dsn.private_encoders.parameters())
    assert all(p.grad is None for p in dsn.decoder.parameters())
    after = dsn.loss_terms(b, step=2)
    assert len(after.recon) == len(after.difference) == 2 and after.similarity is not None


def test_loss_after_warmup_is_the_weighted_sum():
    cfg = tiny(similarity="mmd", alpha=0.3, beta=0.7, gamma=0.2)
    dsn = multidsn.DSN(cfg).double()
    t = dsn.loss_terms(batch_for(cfg, dtype=torch.float64), step=0)
    want = t.task + 0.3 * sum(t.recon) + 0.7 * sum(t.difference) + 0.2 * t.similarity
    assert t.total.item() == pytest.approx(want, rel=1e-12)


# -- bad input -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, match", [
    (dict(similarity="coral"), "similarity must be one of"),
    (dict(image_size=12, decoder_widths=(4, 4, 4)), "divisible by"),
    (dict(num_targets=0), "num_targets must be a positive integer"),
    (dict(shared_widths=()), "shared_widths must be a non-empty tuple"),
    (dict(alpha=-1.0), "alpha must be a non-negative"),
    (dict(image_size=8, shared_widths=(4, 4, 4, 4)), "too many for image_size 8"),
])
def test_config_rejects_bad_values(kw, match):
    with pytest.raises(ValueError, match=match):
        tiny(**kw)


def test_batch_errors_name_the_problem():
    cfg = tiny(num_targets=2)
    dsn = multidsn.DSN(cfg)
    good = batch_for(cfg)
    with pytest.raises(ValueError, match="1 target batches but the model has num_targets=2"):
        dsn.loss(multidsn.Batch(good.source, good.targets[:1]), 0)
    with pytest.raises(ValueError, match=r"target 2's images \(targets\[1\]\) have shape \(5, 2, 9, 9\)"):
        dsn.loss(multidsn.Batch(good.source, [good.targets[0], torch.randn(5, 2, 9, 9)]), 0)
    with pytest.raises(ValueError, match=r"the source images have shape \(4, 3, 8, 8\)"):
        dsn.loss(multidsn.Batch((torch.randn(4, 3, 8, 8), good.source[1]), good.targets), 0)
    with pytest.raises(ValueError, match=r"source labels range over \[0, 3\] but num_classes=3"):
        dsn.loss(multidsn.Batch((good.source[0], torch.tensor([0, 1, 2, 3])), good.targets), 0)
    with pytest.raises(ValueError, match="1-D tensor of length 4"):
        dsn.loss(multidsn.Batch((good.source[0], torch.tensor([0, 1])), good.targets), 0)
    with pytest.raises(ValueError, match="integer class indices"):
        dsn.loss(multidsn.Batch((good.source[0], torch.zeros(4)), good.targets), 0)


# -- placement -------------------------------------------------------------------------------------------
def test_worker_counts():
    assert [workers_needed(k, "domain") for k in (1, 3, 7)] == [3, 5, 9]
    assert [workers_needed(k, "domain", head="source") for k in (1, 3, 7)] == [2, 4, 8]
    assert [workers_needed(k, "encoder") for k in (1, 3, 7)] == [5, 9, 17]
    assert [workers_needed(k, "encoder", head="source") for k in (1, 3, 7)] == [4, 8, 16]


def test_encoder_placement_gives_every_encoder_a_worker():
    p = Placement("encoder", "domain", "separate", num_domains=2, has_domain_classifier=True)
    assert [p.modules(w) for w in range(p.workers_needed)] == [
        ["shared_encoder"], ["shared_encoder"], ["decoder", "private_encoders.0"], ["decoder", "private_encoders.1"],
        ["classifier", "domain_classifier"]]
    assert p.groups() == {"decoder": [2, 3], "shared_encoder": [0, 1]}
    head_decoder = Placement("encoder", "head", "source", num_domains=2, has_domain_classifier=False)
    assert head_decoder.modules(0) == ["classifier", "decoder", "shared_encoder"]
    assert head_decoder.groups() == {"shared_encoder": [0, 1]}


def test_bad_placement_names():
    with pytest.raises(ValueError, match="placement must be one of"):
        Placement("pipeline", "domain", "separate", 2, False)
    with pytest.raises(ValueError, match="decoder must be one of"):
        Placement("domain", "everywhere", "separate", 2, False)
