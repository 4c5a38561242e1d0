"""multidsn across workers: a DSN trained for 3 steps by ``multidsn.parallelize`` ends with the weights of
the same DSN trained in one process (float64, relative error <= 1e-9 per tensor), for both similarity
losses, both placements, both decoder modes, K = 1 and K = 3, with the warm-up ending after step 0 (so
steps before and after it are both checked); also for the paper recipe's networks (batch norm in the private
encoders: its running statistics are compared with the weights) and for alpha = beta = 0 (the private
encoders must not run), with SGD weight decay and a learning rate changed through ``set_lr``. Also: replicas stay equal, bad input fails before any
remote work, and the world stays usable after it.

Why 1e-9: float64 rounding of a re-associated sum (allreduce order, per-domain forwards) is ~1e-16
relative per operation, and 3 SGD steps amplify it little; a gradient averaged instead of summed, a
missing domain's contribution or a lost FAST-mode dependency are errors of order 1.

A failure points at multidsn/parallel.py (the driver's routing), multidsn/remote.py (the worker's
gradient sums) or multidsn/placement.py.
"""

import time

import pytest
import torch

import multidsn
from bigconv import WorkerFailure, World

TOL = 1e-9


def tiny(num_targets: int, similarity: str, **overrides) -> multidsn.DSNConfig:
    base = {"image_size": 8, "channels": 2, "num_classes": 3, "num_targets": num_targets, "code_size": 6,
            "shared_widths": (4,), "private_widths": (3,), "decoder_widths": (4,), "code_grid": 2,
            "classifier_hidden": 5, "similarity": similarity, "warmup_steps": 1, "alpha": 0.5, "beta": 0.5,
            "gamma": 0.5}
    return multidsn.DSNConfig(**{**base, **overrides})


def batches(cfg: multidsn.DSNConfig, steps: int = 3) -> list[multidsn.Batch]:
    g = torch.Generator().manual_seed(1)
    shape = (cfg.channels, cfg.image_size, cfg.image_size)
    # Different batch sizes per domain: nothing may assume they match.
    return [multidsn.Batch(source=(torch.randn(4, *shape, generator=g, dtype=torch.float64),
                                   torch.randint(0, cfg.num_classes, (4,), generator=g)),
                           targets=[torch.randn(3 + k, *shape, generator=g, dtype=torch.float64)
                                    for k in range(cfg.num_targets)])
            for _ in range(steps)]


def rel_errors(ref: dict, got: dict) -> dict:
    assert list(ref) == list(got)
    # .double(): batch norm's num_batches_tracked is an integer buffer
    return {k: float((ref[k].double() - got[k].double()).norm() / ref[k].double().norm().clamp_min(1e-300))
            for k in ref}


def check_equivalence(world: World, num_targets: int, similarity: str, placement: str, decoder: str = "domain",
                      head: str = "separate", weight_decay_check: bool = False, **overrides) -> None:
    """``weight_decay_check``: SGD with weight decay and a learning rate changed after step 1 through
    ``set_lr`` (the paper recipe's optimizer and schedule)."""
    cfg = tiny(num_targets, similarity, **overrides)
    torch.manual_seed(0)
    dsn = multidsn.DSN(cfg).double()
    initial = {n: p.detach().clone() for n, p in dsn.named_parameters() if n.startswith("private_encoders.")}
    net = multidsn.parallelize(dsn, world, placement=placement, decoder=decoder, head=head)
    sgd = dict(lr=0.1, momentum=0.9, weight_decay=0.01 if weight_decay_check else 0.0)
    try:
        net.optimizer(torch.optim.SGD, **sgd)
        opt = torch.optim.SGD(dsn.parameters(), **sgd)
        for step, b in enumerate(batches(cfg)):
            if weight_decay_check and step == 2:
                net.set_lr(0.05)
                for group in opt.param_groups:
                    group["lr"] = 0.05
            opt.zero_grad()
            loss = dsn.loss(b, step)
            loss.backward()
            opt.step()
            assert net.train_step(b) == pytest.approx(loss.item(), rel=TOL)
        errors = rel_errors(dsn.state_dict(), net.state_dict())
        worst = max(errors, key=errors.get)
        assert errors[worst] <= TOL, f"{worst}: relative error {errors[worst]:.2e}"
        # Every replica of a shared module ends equal to the reference too, not only the first holder.
        for replica in net.replica_state_dicts():
            for k, v in replica.items():
                want = dsn.state_dict()[k].double()
                assert float((v.double() - want).norm() / want.norm().clamp_min(1e-300)) <= TOL, k
        # Every private encoder trained (the adaptation losses did switch on after the warm-up): each of its
        # weights moved from the value it started at, in the same model instance. With alpha = beta = 0 (DANN
        # or MMD alone) none may move: the private encoders must not run at all.
        trained = net.state_dict()
        assert {n.split(".")[1] for n in initial} == {str(k) for k in range(cfg.num_targets + 1)}
        still = [n for n, v in initial.items() if torch.equal(v, trained[n])]
        if cfg.separating:
            assert not still, f"private encoder weights never updated: {still}"
        else:
            assert len(still) == len(initial), "alpha = beta = 0, yet private encoder weights moved"
    finally:
        net.close()


@pytest.mark.world(2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("similarity", ["dann", "mmd"])
def test_domain_placement_k1_head_on_source(world, similarity):
    check_equivalence(world, 1, similarity, "domain", head="source")


@pytest.mark.world(2)
@pytest.mark.timeout(60)
def test_too_few_workers_says_how_many(world):
    dsn = multidsn.DSN(tiny(1, "dann")).double()
    with pytest.raises(ValueError, match=r"needs 3 workers but the World has 2; start bigconv.World\(workers=3\)"):
        multidsn.parallelize(dsn, world, placement="domain")
    with pytest.raises(ValueError, match="needs 4 workers but the World has 2"):
        multidsn.parallelize(dsn, world, placement="encoder", head="source")


@pytest.mark.world(2)
@pytest.mark.timeout(60)
def test_bad_batches_fail_before_remote_work(world):
    cfg = tiny(1, "mmd")
    net = multidsn.parallelize(multidsn.DSN(cfg).double(), world, placement="domain", head="source")
    try:
        with pytest.raises(ValueError, match="before train_step"):
            net.train_step(batches(cfg, 1)[0])
        net.optimizer(torch.optim.SGD, lr=0.1)
        good = batches(cfg, 1)[0]
        with pytest.raises(ValueError, match="the batch has 2 target batches but the model has num_targets=1"):
            net.train_step(multidsn.Batch(good.source, [good.targets[0], good.targets[0]]))
        with pytest.raises(ValueError, match=r"target 1's images \(targets\[0\]\) have shape \(3, 2, 8, 7\)"):
            net.train_step(multidsn.Batch(good.source, [torch.randn(3, 2, 8, 7, dtype=torch.float64)]))
        with pytest.raises(ValueError, match=r"source labels range over \[-1, 0\]"):
            net.train_step(multidsn.Batch((good.source[0], torch.tensor([0, -1, 0, 0])), good.targets))
        assert net.steps == 0 and world.broken is None
        net.train_step(good)  # the world is still fine
        assert net.steps == 1
    finally:
        net.close()


@pytest.mark.world(2)
@pytest.mark.timeout(90)
def test_dead_worker_is_named_in_bounded_time(world):
    # Last of the 2-worker tests: it breaks the shared World, which the fixture then replaces.
    cfg = tiny(1, "dann")
    net = multidsn.parallelize(multidsn.DSN(cfg).double(), world, placement="domain", head="source")
    net.optimizer(torch.optim.SGD, lr=0.1)
    b = batches(cfg, 2)
    net.train_step(b[0])
    world._procs[1].kill()
    world._procs[1].wait()
    start = time.monotonic()
    with pytest.raises(WorkerFailure, match="worker1"):
        net.train_step(b[1])
    assert time.monotonic() - start < world.timeout
    assert world.broken


@pytest.mark.world(3)
@pytest.mark.timeout(120)
def test_domain_placement_k1_separate_head_with_decoder_on_head(world):
    check_equivalence(world, 1, "mmd", "domain", decoder="head", head="separate")


@pytest.mark.world(4)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("similarity, decoder", [("dann", "domain"), ("mmd", "head")])
def test_encoder_placement_k1(world, similarity, decoder):
    check_equivalence(world, 1, similarity, "encoder", decoder=decoder, head="source")


@pytest.mark.world(4)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("similarity", ["dann", "mmd"])
def test_domain_placement_k3(world, similarity):
    check_equivalence(world, 3, similarity, "domain", head="source")


@pytest.mark.world(4)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("placement, head", [("domain", "separate"), ("encoder", "source")])
def test_dann_schedule_reaches_the_head_worker(world, placement, head):
    # The reversal factor ramps after the warm-up: 0 at step 1, 2 x 0.93 at step 2. A head worker that used
    # another step's factor, or the constant one, would move the shared encoder away from the reference.
    check_equivalence(world, 1, "dann", placement, head=head, grl_schedule="dann", grl_ramp_steps=3,
                      grl_scale=2.0)


@pytest.mark.world(4)
@pytest.mark.timeout(120)
def test_extra_workers_stay_idle_and_evaluation_matches(world):
    cfg = tiny(1, "dann")
    dsn = multidsn.DSN(cfg).double()
    net = multidsn.parallelize(dsn, world, placement="domain")  # 3 of 4 workers
    try:
        assert net.workers == [0, 1, 2]
        x = torch.randn(5, 2, 8, 8, dtype=torch.float64)
        with torch.no_grad():
            assert torch.allclose(net.predict(x, domain=1, batch_size=2), dsn(x), rtol=1e-12, atol=1e-12)
            h_c, h_p = net.codes(x, domain=1)
            want_c, want_p = dsn.codes(x, 1)
        assert torch.allclose(h_c, want_c, rtol=1e-12, atol=1e-12)
        assert torch.allclose(h_p, want_p, rtol=1e-12, atol=1e-12)
    finally:
        net.close()


@pytest.mark.world(8)
@pytest.mark.timeout(180)
@pytest.mark.parametrize("similarity, decoder", [("dann", "domain"), ("mmd", "head")])
def test_encoder_placement_k3(world, similarity, decoder):
    # 2 (K + 1) = 8 workers, each private encoder and each shared replica alone on its worker.
    check_equivalence(world, 3, similarity, "encoder", decoder=decoder, head="source")


@pytest.mark.world(4)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("placement, head", [("domain", "separate"), ("encoder", "source")])
def test_paper_architecture_with_batch_norm_private_encoders(world, placement, head):
    # The TF networks (multidsn.recipes' paper recipe): 5x5 convs, fc codes, the small decoder, and batch norm
    # in the private encoders. Each private encoder runs once per step on its own worker, so its batch
    # statistics and running averages (compared with the weights: state_dict holds them) match one process.
    check_equivalence(world, 1, "dann", placement, head=head, architecture="dann_mnist", private_batch_norm=True,
                      shared_widths=(4, 5), private_widths=(3, 4), decoder_widths=(4, 4), weight_decay_check=True)


@pytest.mark.world(4)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("placement, head, similarity", [("domain", "separate", "dann"),
                                                         ("encoder", "source", "mmd")])
def test_similarity_alone_skips_the_private_encoders_exactly(world, placement, head, similarity):
    # alpha = beta = 0 is the recipe's "dann" row: only the shared encoders and the head run, on both paths;
    # with weight decay, a private encoder given a zero gradient instead of none would still move.
    check_equivalence(world, 1, similarity, placement, head=head, alpha=0.0, beta=0.0, mmd_bandwidth="median",
                      weight_decay_check=True)
