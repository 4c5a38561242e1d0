"""What each SPMD rank runs for ``tests/test_spmd.py``: named cases, each against one process.

Every rank opens one SPMD world and runs a list of cases in it (spawning ranks costs seconds on 2
cores, so one spawn serves many cases). A case returns the errors of ``compare_training`` (or its
own measurements); an exception is returned as its text, so one failing case does not hide the
others. Ranks seed alike, so every rank builds the same model and batch.
"""

from __future__ import annotations

import copy
import os
import time
import warnings

import torch
import torch.nn as nn

import bigconv
from bigconv.models import CNN1D, CNN2D, CNN3D, FCN2D
from bigconv.verify import compare_training

KEYS = ("forward", "input_grad", "param_grads", "loss", "weights")


def _compare(factory, shape, grid, loss_fn=None, target=None, replicas=1, seed=0, **kw):
    def run(world):
        torch.manual_seed(seed)
        model = factory().double()
        g = torch.Generator().manual_seed(seed + 1)
        x = torch.randn(*shape, generator=g, dtype=torch.float64)
        y = target(g) if target else torch.randint(0, 3, (shape[0],), generator=g)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            r = compare_training(model, world, x, y, loss_fn or nn.CrossEntropyLoss(), grid=grid,
                                 replicas=replicas, **kw)
        r.pop("net")
        return r
    return run


def _layer_cases():
    import test_layers as tl
    import test_model_patterns as tp

    cases = {}
    for name, f in tl.LAYERS_1D:
        cases[f"layer/{name}/(2,)"] = (2, _compare(f, (2, 1, 21), (2,)))
    for name, f in tl.LAYERS_2D:
        cases[f"layer/{name}/(2,2)"] = (4, _compare(f, (2, 1, 14, 15), (2, 2)))
        if "layernorm" not in name:
            cases[f"layer/{name}/(1,2)"] = (2, _compare(f, (2, 1, 13, 10), (1, 2)))
    for name, f in tl.LAYERS_3D:
        cases[f"layer/{name}/(2,1,2)"] = (4, _compare(f, (2, 1, 8, 6, 10), (2, 1, 2)))
    for name, cls in tp.PATTERNS.items():
        cases[f"pattern/{name}/1d"] = (2, _compare(lambda c=cls: c(1), (2, 1, 37), (2,), target=_dense_ce((2, 1, 37))))
        cases[f"pattern/{name}/2d"] = (4, _compare(lambda c=cls: c(2), (2, 1, 19, 22), (2, 2),
                                                   target=_dense_ce((2, 1, 19, 22))))
    cases["skip/unet/(2,2)"] = (4, _compare(lambda: tl.UNetLike(2), (2, 1, 16, 18), (2, 2), nn.MSELoss(),
                                            lambda g: torch.randn(2, 3, 16, 18, generator=g, dtype=torch.float64)))
    return cases


class Thin(nn.Module):
    """7×7 and dilated 5×5 convolutions on shards thinner than their halos."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(1, 3, 7, padding=3), nn.Tanh(), nn.Conv2d(3, 3, 5, padding=4, dilation=2),
                                  nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, 3))

    def forward(self, x):
        return self.body(x)


class Checkpointed(nn.Module):
    """Activation checkpointing as users write it (the recompute must not exchange halos again)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.Tanh(), nn.Conv2d(4, 4, 3, padding=1), nn.Tanh())
        self.head = nn.Sequential(nn.Conv2d(4, 4, 3, stride=2), nn.ReLU(), nn.AdaptiveMaxPool2d(1), nn.Flatten(),
                                  nn.Linear(4, 3))

    def forward(self, x):
        return self.head(torch.utils.checkpoint.checkpoint(self.a, x, use_reentrant=False))


def _dense_ce(shape):
    return lambda g: torch.randint(0, 3, (shape[0], *shape[2:]), generator=g)


def _dense_float(shape):
    return lambda g: torch.randn(*shape, generator=g, dtype=torch.float64)


def _whole_map_loss(out, y):
    return nn.functional.smooth_l1_loss(out, y) + out.amax(dim=(2, 3)).square().mean()


def _habit(name: str, *args):
    def build():
        import test_habits

        return getattr(test_habits, name)(*args)
    return build


CASES: dict = {
    "cnn1d/(2,)/uneven": (2, _compare(lambda: CNN1D(in_channels=1, num_classes=3), (2, 1, 37), (2,))),
    "cnn2d/(2,1)": (2, _compare(lambda: CNN2D(in_channels=1, num_classes=3), (2, 1, 19, 22), (2, 1))),
    "cnn2d/(1,2)/sum": (2, _compare(lambda: CNN2D(in_channels=1, num_classes=3), (2, 1, 19, 22), (1, 2),
                                    nn.CrossEntropyLoss(reduction="sum"))),
    "cnn3d/(2,1,1)": (2, _compare(lambda: CNN3D(in_channels=1, num_classes=3), (2, 1, 9, 8, 7), (2, 1, 1))),
    "thin/(1,2)": (2, _compare(Thin, (2, 1, 9, 5), (1, 2))),
    "thin/(4,1)": (4, _compare(Thin, (2, 1, 9, 8), (4, 1))),
    "checkpoint/(2,1)": (2, _compare(Checkpointed, (2, 1, 12, 11), (2, 1))),
    "fcn2d/ce-per-pixel/(2,2)": (4, _compare(lambda: FCN2D(1, 3, width=4, depth=3), (2, 1, 24, 16), (2, 2),
                                             target=_dense_ce((2, 1, 24, 16)))),
    "cnn2d/(2,2)/uneven": (4, _compare(lambda: CNN2D(in_channels=1, num_classes=3), (2, 1, 11, 9), (2, 2))),
    "cnn3d/(1,2,2)": (4, _compare(lambda: CNN3D(in_channels=1, num_classes=3), (2, 1, 7, 9, 8), (1, 2, 2))),
    # Hybrid spatial × data parallel: the full batch's loss and gradients, mean and sum alike.
    "hybrid/R2/(2,1)": (4, _compare(lambda: CNN2D(in_channels=1, num_classes=3), (4, 1, 19, 22), (2, 1),
                                    replicas=2)),
    "hybrid/R2/(1,2)/sum": (4, _compare(lambda: CNN2D(in_channels=1, num_classes=3), (4, 1, 19, 22), (1, 2),
                                        nn.CrossEntropyLoss(reduction="sum"), replicas=2)),
    "hybrid/R2/(1,2)/uneven-batch": (4, _compare(lambda: CNN2D(in_channels=1, num_classes=3), (3, 1, 13, 10),
                                                 (1, 2), replicas=2)),
    "hybrid/R2/(2,1)/batchnorm": (4, _compare(lambda: nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1),
        nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3)),
        (4, 1, 14, 15), (2, 1), replicas=2)),
    "hybrid/R2/(1,2)/fcn-per-pixel": (4, _compare(lambda: FCN2D(1, 3, width=4, depth=3), (4, 1, 24, 16),
                                                  (1, 2), target=_dense_ce((4, 1, 24, 16)), replicas=2)),
    "hybrid/R4/(1,1)": (4, _compare(lambda: CNN2D(in_channels=1, num_classes=3), (4, 1, 12, 12), (1, 1), replicas=4)),
    # Training randomness (dropout, DropPath, StochasticDepth, noise) and parametrized weights (issue 22).
    "random/(2,2)": (4, _compare(_habit("stochastic_net"), (4, 2, 13, 11), (2, 2))),
    "parametrized/(2,2)": (4, _compare(_habit("parametrized_net", False), (2, 2, 12, 10), (2, 2))),
    # A loss over the whole map that no shard can compute alone (a per-image maximum).
    "fcn2d/whole-map-loss/(2,2)": (4, _compare(lambda: FCN2D(1, 3, width=4, depth=3), (2, 1, 24, 16), (2, 2),
                                               loss_fn=_whole_map_loss, target=_dense_float((2, 3, 24, 16)))),
    "hybrid/R2/(1,2)/whole-map-loss": (4, _compare(lambda: FCN2D(1, 3, width=4, depth=3), (4, 1, 24, 16), (1, 2),
                                                   loss_fn=_whole_map_loss, target=_dense_float((4, 3, 24, 16)),
                                                   replicas=2)),
}


def _vit_class_token():
    """timm's ViT with its class token, small (``bigconv.ops.prefix``: the class token whole on every rank)."""
    from bigconv.compat import allow_torchvision_without_ops

    allow_torchvision_without_ops()
    import timm

    return timm.create_model("vit_small_patch16_224", pretrained=False, num_classes=3, img_size=40, patch_size=8,
                             embed_dim=16, depth=2, num_heads=2)


CASES["vit/class-token/(2,2)"] = (4, _compare(_vit_class_token, (2, 3, 40, 40), (2, 2)))


def zoo_cases() -> dict:
    from zoo import ZOO

    cases = {}
    for e in ZOO:
        if e.fast and e.expect == "exact":
            def run(world, e=e):
                torch.manual_seed(0)
                model = e.build().double()
                x, y = e.inputs(torch.Generator().manual_seed(1))
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    r = compare_training(model, world, x, y, nn.CrossEntropyLoss(), grid=e.grid)
                r.pop("net")
                return r
            cases[f"zoo/{e.name}"] = (e.workers, run)
    return cases


def _subpixel_slicing_positions_cases():
    """Sub-pixel layers, crops and reductions over flattened positions (issue 22) on SPMD ranks."""
    import test_ops_positions as tpos
    import test_ops_subpixel_slicing as tsub

    up = lambda g: torch.randint(0, 3, (2, 26, 22), generator=g)  # noqa: E731  # PixelShuffle(2) of 13x11
    return {
        "subpixel/shuffle/(2,2)": (4, _compare(lambda: tsub.SubPixelUp(2), (2, 1, 13, 11), (2, 2), target=up)),
        "subpixel/unshuffle/(2,2)": (4, _compare(lambda: tsub.SpaceToDepth(2), (2, 1, 14, 10), (2, 2),
                                                 target=_dense_ce((2, 1, 14, 10)))),
        "slicing/strided/(2,2)": (4, _compare(lambda: tsub.Crops(tsub.CROPS["channels_too"]), (2, 1, 16, 15), (2, 2),
                                              target=lambda g: torch.randint(0, 3, (2, 6, 7), generator=g))),
        "positions/gc_gate/(2,2)": (4, _compare(tpos.GlobalContextGate, (2, 1, 11, 14), (2, 2),
                                                target=_dense_ce((2, 1, 11, 14)))),
        "positions/einsum/(1,2)": (2, _compare(lambda: tpos.AttentionPool(tpos.einsum_pool), (2, 1, 13, 11), (1, 2))),
    }


def all_cases() -> dict:
    return {**CASES, **_layer_cases(), **_subpixel_slicing_positions_cases()}


def adjoint(world) -> dict:
    """⟨F x, y⟩ = ⟨x, Fᵀ y⟩ for the P2P halo exchange alone: F gathers each shard's padded window
    (a 5×3 kernel's, on an uneven 3-D grid), Fᵀ is what its backward computes."""
    import torch.distributed as dist

    from bigconv.engine.executor import ShardExecutor
    from bigconv.geometry.boxes import Window, all_coords, shard_box
    from bigconv.ops.shards import mark
    from bigconv.transport import WorkerRuntime
    from bigconv.transport.p2p import P2PLink

    grid, shape = (2, 2), (11, 9)
    mesh = world.mesh(1)
    rt = WorkerRuntime(index=mesh.shard, workers=4, device=world.device, timeout=world.timeout)
    rt.link = P2PLink(mesh.spatial_group, mesh.spatial_ranks, mesh.shard, world.timeout, rt.stats,
                      device=world.device, tag_free=world.checks.tag_free)
    box = shard_box(shape, grid, list(all_coords(grid))[mesh.shard])
    g = torch.Generator().manual_seed(100 + world.rank)
    x = torch.randn(2, 3, *(b - a for a, b in box), generator=g, dtype=torch.float64, requires_grad=True)
    windows = [Window(5, 1, 1, 2, 2), Window(3, 1, 1, 1, 1)]
    # The exchange alone, called as a rule calls it (outside the mode's dispatch).
    fx = ShardExecutor(grid, 1, rt).gather_window(mark(x, shape), shape, windows)
    y = torch.randn(fx.shape, generator=g, dtype=torch.float64)
    (fty,) = torch.autograd.grad(fx, x, y)
    sums = torch.stack([(fx.detach() * y).sum(), (x.detach() * fty).sum()])
    dist.all_reduce(sums)
    return {"lhs": sums[0].item(), "rhs": sums[1].item(), "window": tuple(fx.shape),
            "messages": rt.stats["messages"]}


def sources(world) -> dict:
    """Whole-slide sources in the SPMD mode: each rank reads only its box of its replica's slides;
    training equals one process on the same pixels, and ``predict`` writes the single-process map."""
    import tempfile

    import numpy as np
    import torch.distributed as dist
    import zarr

    from bigconv.data import open_image, synthetic_slide

    folder = os.path.join(tempfile.gettempdir(), f"bigconv-spmd-sources-{os.environ['BIGCONV_PORT']}")
    paths = [os.path.join(folder, f"s{i}.tif") for i in range(4)]
    if world.rank == 0:
        os.makedirs(folder, exist_ok=True)
        for i, p in enumerate(paths):
            synthetic_slide(p, (64, 128), levels=2, tile=32, seed=i, tissue=0.6)
    dist.barrier()
    srcs = [open_image(p, level=0, dtype="float64", scale=1 / 255) for p in paths]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, stride=2, padding=1), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2)).double()
    r = compare_training(model, world, srcs, torch.tensor([0, 1, 1, 0]), nn.CrossEntropyLoss(), grid=(2, 1),
                         replicas=world.size // 2)
    net = r.pop("net")
    # prefetch: the next call's reads start in the background, and that call takes them.
    out_now, before = net.full(srcs), net.stats["prefetch_read_s"]
    net.prefetch(srcs)
    out_ahead = net.full(srcs)
    r["prefetch_equal"], r["prefetch_used"] = torch.equal(out_now, out_ahead), net.stats["prefetch_read_s"] > before
    dense = nn.Sequential(nn.Conv2d(3, 4, 5, padding=2), nn.Tanh(), nn.Conv2d(4, 2, 3, padding=1)).double()
    reference = copy.deepcopy(dense)
    net = bigconv.parallelize(dense, world, grid=(1, 2), replicas=world.size // 2)
    out = net.predict(srcs, os.path.join(folder, "pred.zarr"), overwrite=True)
    from bigconv.data import SourceBatch

    with torch.no_grad():
        want = reference(SourceBatch(srcs).read())
    got = torch.from_numpy(np.asarray(zarr.open_array(out, mode="r")[...]))
    r["predict"] = ((got - want).abs().max() / want.abs().max()).item()
    return r


def bad_input(world) -> dict:
    """Each bad call must raise ValueError on every rank before any message."""
    out = {}
    for label, call in {
        "grid-times-replicas": lambda: bigconv.parallelize(CNN2D(in_channels=1), world, grid=(2, 2), replicas=2),
        "replicas-not-dividing": lambda: bigconv.parallelize(CNN2D(in_channels=1), world, replicas=3),
        "replicas-not-int": lambda: bigconv.parallelize(CNN2D(in_channels=1), world, replicas=0),
        "too-few-images": lambda: bigconv.parallelize(CNN2D(in_channels=1), world, grid=(1, 1), replicas=world.size
                                                      )(torch.randn(1, 1, 8, 8)),
    }.items():
        try:
            call()
            out[label] = "no error"
        except ValueError as exc:
            out[label] = str(exc)
        except Exception as exc:
            out[label] = f"wrong type {type(exc).__name__}: {exc}"
    return out


def run_cases(names: list[str], timeout: float = 60.0) -> dict:
    torch.set_num_threads(1)
    table = {**all_cases(), **zoo_cases(), **SPECIAL}
    results = {}
    with bigconv.World.from_env(mode="spmd", device="cpu", timeout=timeout) as world:
        for name in names:
            start = time.perf_counter()
            try:
                results[name] = table[name][1](world)
            except Exception as exc:
                results[name] = f"{type(exc).__name__}: {exc}"
            if world.checks.order:  # BIGCONV_COMM_CHECKS=order: one order of communication on every rank
                problems = world.comm_order_mismatches()
                if problems:
                    results[name] = "the ranks issued their communication in orders NCCL cannot run:\n" + \
                        "\n".join(problems)
            if isinstance(results[name], dict):
                results[name]["seconds"] = time.perf_counter() - start
    return results


def _panel(build_name: str, shape):
    """The sabotage panel (``bigconv.sabotage``) on SPMD ranks: the clean verdict and each sabotage's."""
    def run(world):
        import test_verdict_panel as tvp

        from bigconv.sabotage import run_panel

        x, y = tvp.inputs(shape)
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return run_panel(build_name, getattr(tvp, build_name)().double(), world, x, y, nn.CrossEntropyLoss(),
                             (2, 2))
    return run


def nonfinite_gradient(world) -> dict:
    """``tests/test_check_finite_gradients.py`` on SPMD ranks: the poisoned step refused on every rank, the
    weights unchanged, the run going on as if the batch had never come."""
    import test_check_finite_gradients as cf

    def made():
        net = bigconv.parallelize(cf.nan_behind_finite_loss(), world, grid=(2, 1), check_finite=True)
        net.optimizer(torch.optim.SGD, lr=0.1, momentum=0.9, clip_grad_norm=1.0)
        return net

    reference = made()
    cf.clean_run(reference)
    net = made()
    out = cf.poisoned_run(net, lambda: {k: v.detach().clone() for k, v in net.state_dict().items()})
    out["same_as_clean_run"] = cf.same_weights(net.state_dict(), reference.state_dict())
    return out


SPECIAL = {"adjoint": (4, adjoint), "bad_input": (2, bad_input), "nonfinite_gradient": (2, nonfinite_gradient),
           "sources/R1": (2, sources),
           "sources/R2": (4, sources), "panel/stochastic_net": (4, _panel("stochastic_net", (4, 2, 13, 11))),
           "panel/bn_net": (4, _panel("bn_net", (2, 2, 12, 10)))}
"""Cases with their own checks (not ``compare_training`` alone)."""


def case_sizes() -> dict[str, int]:
    table = {**all_cases(), **zoo_cases(), **SPECIAL}
    return {name: n for name, (n, _) in table.items()}


# -- failures -------------------------------------------------------------------------------------------
def failing_rank(how: str, timeout: float, where: str = "forward") -> dict:
    """Rank 1 dies (``kill``) or stalls (``stall``) in the middle of a forward, or (``where="allreduce"``)
    in its backward after its last halo exchange, so the others meet its absence in the gradient
    allreduce; every other rank reports how long it took to raise, and what."""
    world = bigconv.World.from_env(mode="spmd", device="cpu", timeout=timeout)
    x, y = torch.randn(2, 1, 16 * world.size, 32), torch.tensor([0, 1])
    model = CNN2D(in_channels=1, num_classes=3)
    if where == "loss":  # a dense map and a per-pixel loss: its sum over the ranks is a collective
        model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 3, 3, padding=1))
        y = torch.randint(0, 3, (2, 16 * world.size, 32))
    net = bigconv.parallelize(model, world, grid=(world.size, 1))
    net.optimizer(torch.optim.SGD, lr=0.1)
    net.train_step(x, y, nn.CrossEntropyLoss())  # a healthy step first
    if world.rank == 1:
        def fail(*_):
            if how == "kill":
                os._exit(3)
            time.sleep(timeout * 3)

        if where == "forward":
            fail()
            return {"stalled": True}
        if where == "loss":  # after its forward's last halo: the others meet its absence in the loss's sum
            net.model.register_forward_hook(fail)
        # The first convolution's weight gets its gradient last, after every halo of the backward (its
        # input, the image, takes no gradient): from there on only the allreduce waits on this rank.
        else:
            next(net.model.parameters()).register_hook(fail)
    start = time.monotonic()
    try:
        net.train_step(x, y, nn.CrossEntropyLoss())
        return {"error": None}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - start}
    finally:
        world.close()
