"""Train a model on a World and in one process, side by side, and measure how far they differ.

This is the equivalence check the test suite runs, offered to users too: the evidence that a
parallelized model is the single-process model, not an approximation of it.

Every tensor is judged against its own size. A model's gradients span many orders of magnitude
(a ConvNeXt block's layer-scale branch can sit 1e-9 below the stem), and one model-wide denominator
would let a completely wrong small tensor pass. Where a tensor is legitimately near zero or
ill-conditioned (a BatchNorm bias whose exact gradient is 0 holds rounding noise; BatchNorm over
2x2 maps amplifies rounding a millionfold), its denominator is floored by what rounding alone moves
it in one process: the same single-process training run with the input and every weight moved by
one ulp per element (``perturbed_copy``), twice, with different signs, the second time on the batch
in reverse order, so that reductions over the batch also sum in another order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .data.sources import SourceBatch, is_source_batch, read_targets
from .engine.dry_run import copy_model
from .ops.random import RandomDraws
from .ops.support import unwrap_compiled
from .parallel import parallelize
from .runtime.world import World  # or an SPMD world

ERROR_KEYS = ("forward", "input_grad", "param_grads", "loss", "weights")
# A tensor may differ from one process by this many times what a one-ulp change of the input and
# weights moves it in one process. The decomposition re-associates sums (shard sums, the gradient
# allreduce) where the perturbed run changes the operands, so the two noises agree in order of
# magnitude, not exactly: the factor is that margin. Measured over the zoo (results/zoo.jsonl,
# ``floored_error_over_noise``): the largest ratio of an exact model is recorded there. A wrong
# computation misses by orders of magnitude more (a 0.1% error on a tensor is 1e13 ulps).
NOISE_FACTOR = 100.0
# Differences of float64 runs are summation order alone (~1e-16 per operation); float32 gets more.
DEFAULT_TOL = {torch.float64: 1e-9, torch.float32: 1e-4}
PERTURBED_RUNS = 2


def abs_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max-norm of ``a - b``."""
    return (a.detach().double().cpu() - b.detach().double().cpu()).abs().max().item() if b.numel() else 0.0


def _scale(t: torch.Tensor) -> float:
    return t.detach().double().abs().max().item() if t.numel() else 0.0


@dataclass(frozen=True)
class TensorError:
    """How far one tensor of the distributed run is from the single process's.

    ``error`` and ``scale`` are max-norms (of the difference, of the reference); ``noise`` is the
    max-norm of what one-ulp perturbations of the input and weights move the reference; ``rel`` is
    ``error / max(scale, spread, NOISE_FACTOR * noise / tol)``, so ``rel <= tol`` means "within tol of
    its own size (or of the spread a running mean averages), or within NOISE_FACTOR times rounding's
    own effect on this tensor". Integer tensors are
    compared exactly: ``rel`` is 0 or inf.
    """

    category: str
    name: str
    rel: float
    error: float
    scale: float
    noise: float
    spread: float = 0.0

    def as_dict(self) -> dict:
        return {"category": self.category, "tensor": self.name, "rel": self.rel, "error": self.error,
                "scale": self.scale, "noise": self.noise, "spread": self.spread}


def tensor_error(category: str, name: str, got: torch.Tensor | None, ref: torch.Tensor, noise: float,
                 tol: float, spread: float = 0.0) -> TensorError:
    """Judge ``got`` against ``ref``; ``noise`` is what one-ulp perturbations move ``ref`` in one process;
    ``spread`` is a scale the tensor is only determined to beside its own (see ``_spread``)."""
    if got is None:  # the distributed run produced nothing where one process has a tensor (a lost gradient)
        got = torch.zeros_like(ref)
    if tuple(got.shape) != tuple(ref.shape):
        return TensorError(category, name, float("inf"), float("inf"), _scale(ref), 0.0)
    if not ref.is_floating_point():
        same = torch.equal(got.cpu(), ref.cpu())
        return TensorError(category, name, 0.0 if same else float("inf"), 0.0 if same else abs_err(got, ref),
                           _scale(ref), 0.0)
    error, scale = abs_err(got, ref), _scale(ref)
    denominator = max(scale, spread, NOISE_FACTOR * noise / tol)
    if math.isnan(error):  # nan compares false with everything: it must read as the worst, not be skipped
        rel = float("inf")
    else:
        rel = error / denominator if denominator > 0 else (0.0 if error == 0 else float("inf"))
    return TensorError(category, name, rel, error, scale, noise, spread)


@dataclass
class Run:
    """What one training run yields, in the sequence ``compare_training`` follows: the output of a
    first forward, the input and parameter gradients of a second, and the losses and state dict of
    ``steps`` optimizer steps after it."""

    output: torch.Tensor
    input_grad: torch.Tensor
    param_grads: dict
    losses: list
    state: dict


def named_tensors(run: Run) -> dict[tuple[str, str], torch.Tensor]:
    """Every tensor of a run by (category, name), the keys ``judge`` and ``Noise`` share."""
    named = {("forward", "output"): run.output, ("input_grad", "input"): run.input_grad}
    named.update({("param_grads", n): g for n, g in run.param_grads.items()})
    # A distributed run's losses are Python floats: keep all their digits (as_tensor would make float32).
    named.update({("loss", f"step {i}"): v if isinstance(v, torch.Tensor) else torch.tensor(v, dtype=torch.float64)
                  for i, v in enumerate(run.losses)})
    named.update({("weights", k): v for k, v in run.state.items()})
    return named


Noise = dict  # (category, name) -> the largest max-norm move of that tensor under one-ulp perturbations


def measure_noise(model: torch.nn.Module, x: torch.Tensor, y, loss_fn: Callable, ref: Run, steps: int = 2,
                  optimizer: type = torch.optim.SGD, opt_kwargs: dict | None = None,
                  runs: int = PERTURBED_RUNS, seed: int = 0) -> Noise:
    """How far rounding alone moves each tensor of ``ref`` (the run of ``model`` on ``x``): the largest
    difference over ``runs`` runs of ``perturbed_copy``, every second one with the batch in reverse order
    (``_reversed_run``). One perturbed model lives at a time, so a large model costs two copies, not
    ``runs + 1``."""
    reference = named_tensors(ref)
    noise: Noise = {key: 0.0 for key in reference}
    draws_seed = seed
    for seed in range(1, runs + 1):
        copy_, xp = perturbed_copy(model, x, seed)
        run = _reversed_run(copy_, xp, y, loss_fn, ref, steps, optimizer, opt_kwargs, draws_seed) if seed % 2 == 0 \
            else None
        run = run or train_single(copy_, xp, y, loss_fn, steps, optimizer, opt_kwargs, draws_seed)
        other = named_tensors(run)
        for key, want in reference.items():
            if want.is_floating_point() and key in other:
                noise[key] = max(noise[key], abs_err(other[key], want))
            elif key[0] == "param_grads" and key not in other:  # unset there: its noise is the value itself
                noise[key] = max(noise[key], _scale(want))
    return noise


def _reversed_run(model: torch.nn.Module, x: torch.Tensor, y, loss_fn: Callable, ref: Run, steps: int,
                  optimizer: type, opt_kwargs: dict | None, seed: int = 0) -> Run | None:
    """The run on the batch in reverse order, its output and input gradient put back in order.

    Reductions over the batch (BatchNorm statistics, every weight gradient) then sum in another order,
    as the decomposition's shard sums and allreduce do; a one-ulp perturbation leaves some of those
    rounding residues nearly unchanged (a conv bias before BatchNorm on a whole-slide read: 5e-14
    against 9e-11 for the reversed batch and 6e-11 for 4 workers). None where reversing is not
    meaningful: one image, targets without a batch dim, or a model or loss that is not the same
    function of a reordered batch (its output would differ by more than rounding).
    """
    n = x.shape[0] if x.dim() else 0
    if n < 2 or not isinstance(y, torch.Tensor) or y.dim() == 0 or y.shape[0] != n:
        return None
    try:
        run = train_single(model, x.flip(0), y.flip(0), loss_fn, steps, optimizer, opt_kwargs, seed)
    except Exception:  # a model that cannot take the reordered batch: the other runs still measure
        return None
    if run.output.dim() == 0 or run.output.shape[0] != n:
        return None
    run = Run(run.output.flip(0), run.input_grad.flip(0), run.param_grads, run.losses, run.state)
    if not torch.allclose(run.output.double(), ref.output.double(), rtol=1e-6, atol=1e-6 * _scale(ref.output)):
        return None
    return run


def train_single(model: torch.nn.Module, x: torch.Tensor, y, loss_fn: Callable, steps: int = 2,
                 optimizer: type = torch.optim.SGD, opt_kwargs: dict | None = None, seed: int = 0) -> Run:
    """The single-process run, in the distributed run's order: forward, gradients, ``steps`` steps.

    Both sides run a training forward first, so buffers such as running statistics advance alike.
    Random draws in the forward (dropout, stochastic depth) are those of a model parallelized with
    ``seed`` (``bigconv.ops.random``), forward by forward.
    """
    opt_kwargs = opt_kwargs or {"lr": 0.05, "momentum": 0.9}
    draws = RandomDraws(seed)
    with torch.no_grad(), draws.forward():
        output = model(x)
    xr = x.detach().clone().requires_grad_(True)
    with draws.forward():
        out = model(xr)
    loss_fn(out, y).backward()
    plain = unwrap_compiled(model)[0]  # torch.compile(model): the names are the module's own
    param_grads = {n: p.grad.clone() for n, p in plain.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    opt = optimizer(model.parameters(), **opt_kwargs)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        with draws.forward():
            out = model(x)
        loss = loss_fn(out, y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return Run(output, xr.grad, param_grads, losses, plain.state_dict())


def perturb_one_ulp(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """``x`` with every element moved one ulp up or down (a random sign per element)."""
    if not x.is_floating_point() or x.numel() == 0:
        return x
    up = torch.rand(x.shape, generator=generator) < 0.5
    toward = torch.where(up, torch.tensor(float("inf"), dtype=x.dtype), torch.tensor(float("-inf"), dtype=x.dtype))
    return torch.nextafter(x, toward.to(x.device))


def perturbed_copy(model: torch.nn.Module, x: torch.Tensor, seed: int) -> tuple[torch.nn.Module, torch.Tensor]:
    """A copy of ``model`` and ``x`` with every floating weight, buffer and input element one ulp off.

    Moving the weights too, not only the input, changes the rounding inside every layer: a gradient
    that is exactly zero in exact arithmetic (a bias before BatchNorm) is a rounding residue, and an
    input perturbation alone can leave that residue bit-identical while the decomposition's other
    summation order does not.
    """
    generator = torch.Generator().manual_seed(seed)
    other = copy_model(model)
    with torch.no_grad():
        for t in (*other.parameters(), *other.buffers()):
            t.copy_(perturb_one_ulp(t, generator))
    return other, perturb_one_ulp(x, generator)


def compare_training(model: torch.nn.Module, world: World, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable,
                     grid: Sequence[int] | None = None, steps: int = 2, optimizer: type = torch.optim.SGD,
                     replicas: int = 1, tol: float | None = None, transport: str = "p2p", seed: int = 0,
                     **opt_kwargs) -> dict:
    """Errors of the distributed forward, gradients, losses and weights after ``steps`` optimizer steps.

    Each of ``forward``, ``input_grad``, ``param_grads``, ``loss`` and ``weights`` is the worst
    ``TensorError.rel`` of its category (every parameter's gradient, every floating weight and
    buffer, each step's loss, each judged against its own size); ``worst`` names the tensor behind
    each, and ``tensors`` lists them all. ``exact`` says whether all of them are <= ``tol`` (1e-9
    for float64, 1e-4 for float32 by default), integer buffers are equal, every replica holds the
    same weights and the state dict has the plain model's keys. ``ill_conditioned`` lists the
    tensors that rounding alone moves by more than ``tol`` of their size in one process.

    ``x`` may be a list of image sources (``bigconv.data``): the workers read their boxes, and the
    single process gets the same pixels read whole. On an SPMD world every rank calls this with the
    same arguments (``replicas`` as in ``parallelize``) and gets the same answer. ``transport``: the
    driver mode's, as in ``parallelize``. ``seed``: of the model's random draws, on both sides.
    """
    opt_kwargs = opt_kwargs or {"lr": 0.05, "momentum": 0.9}
    xt = x if isinstance(x, torch.Tensor) else SourceBatch(x).read()
    yt = read_targets(y, loss_fn) if is_source_batch(y) else y  # gradients() takes targets as a tensor
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), xt.dtype)
    tol = DEFAULT_TOL.get(dtype, 1e-2) if tol is None else tol
    # The single-process runs first, on copies: parallelize leaves ``model`` to the workers.
    ref = train_single(copy_model(model), xt, yt, loss_fn, steps, optimizer, opt_kwargs, seed)
    noise = measure_noise(model, xt, yt, loss_fn, ref, steps, optimizer, opt_kwargs, seed=seed)
    net = parallelize(model, world, grid=grid, replicas=replicas, transport=transport, seed=seed)
    out = net(x)
    _, input_grad, param_grads = net.gradients(x, yt, loss_fn)
    net.optimizer(optimizer, **opt_kwargs)
    losses = [net.train_step(x, y, loss_fn) for _ in range(steps)]
    replica_states = net.replica_state_dicts()
    got = Run(out, input_grad, param_grads, losses, replica_states[0])
    result = summarize(judge(got, ref, noise, tol), tol)
    result["replicas_equal"] = all(torch.equal(r[k], replica_states[0][k]) for r in replica_states
                                   for k in ref.state)
    result["keys_match"] = set(replica_states[0]) == set(ref.state)
    result["exact"] = result["exact"] and result["replicas_equal"] and result["keys_match"]
    result["net"] = net
    return result


def judge(got: Run, ref: Run, noise: Noise, tol: float) -> list[TensorError]:
    """Every tensor of ``got`` against ``ref``, each floored by its ``noise`` (see ``measure_noise``)."""
    mine, reference = named_tensors(got), named_tensors(ref)
    keys = list(reference) + [k for k in mine if k not in reference]
    errors = []
    for key in keys:
        want = reference.get(key)
        if want is None:  # one process leaves this gradient unset: the distributed one must be zero
            want = torch.zeros_like(mine[key])
        got_t = mine.get(key)
        if key[0] == "loss" and got_t is None:
            got_t = torch.tensor(float("nan"))
        errors.append(tensor_error(*key, got_t, want, noise.get(key, 0.0), tol, _spread(key, ref.state)))
    return errors


def _spread(key: tuple[str, str], state: dict) -> float:
    """A running mean is determined only to rounding of the spread of what it averages: judge it against
    the square root of its running variance too. Where the batch mean is a structural zero of one
    process's summation order (BatchNorm over two values: (a - m) + (b - m) rounds to exactly 0), the
    other order leaves a residue 1e-18 of that spread, which no perturbation of the inputs reproduces."""
    category, name = key
    if category != "weights" or not name.endswith("running_mean"):
        return 0.0
    var = state.get(name[: -len("running_mean")] + "running_var")
    return var.detach().double().clamp_min(0).max().sqrt().item() if var is not None and var.numel() else 0.0


class TensorList(list):
    """Per-tensor dicts; printed short, so a failed assertion that shows a whole result stays readable."""

    def __repr__(self) -> str:
        return f"<{len(self)} tensors; see the list's items>"


def summarize(errors: Sequence[TensorError], tol: float) -> dict:
    """The worst ``rel`` of each category, the tensor behind it, every tensor, and whether all are <= ``tol``."""
    result: dict = {"worst": {}}
    for key in ERROR_KEYS:
        worst = max((e for e in errors if e.category == key), key=lambda e: e.rel, default=None)
        result[key] = worst.rel if worst else 0.0
        result["worst"][key] = worst.as_dict() if worst else None
    result["tol"] = tol
    # Tensors that one process itself cannot pin down to ``tol``: rounding alone moves them more (a
    # gradient that is exactly zero, BatchNorm over a few values). They are judged against that noise,
    # and listed, since no comparison can say more about them.
    result["ill_conditioned"] = TensorList(e.as_dict() for e in errors if e.noise > tol * max(e.scale, e.spread))
    # nan never compares <= tol, so a nan anywhere reads as not exact.
    result["exact"] = all(result[k] <= tol for k in ERROR_KEYS)
    result["tensors"] = TensorList(e.as_dict() for e in errors)
    return result
