"""Train a model on a World and in one process, side by side, and say whether they agree.

This is the equivalence check the test suite runs, offered to users too: the evidence that a
parallelized model is the single-process model, not an approximation of it. Its verdict is one of

- ``exact``: every tensor (the output of a forward, the input gradient and every parameter gradient of a
  second, each step's loss and every weight and buffer after ``steps`` optimizer steps) is within ``tol``
  of its own size (max-norm of the difference over max-norm of one process's tensor; integers equal),
  except *residues* (below);
- ``not exact``: some tensor is further off than its allowance, or a gradient is missing, a shape or an
  integer differs, the replicas differ, the state dict has other keys;
- ``ill-conditioned at this size``: nothing is further off than rounding can explain, but some tensor is
  past ``tol`` of its size within what rounding may move it (``NOISE_FACTOR`` times its noise), or rounding
  alone moves it past ``tol`` in one process, so no comparison can say it agrees to ``tol``. The tensors are named with their noise;
  ``conditioned_size`` finds an input size at which they are well conditioned (BatchNorm over 2x2 maps
  amplifies rounding; larger maps do not).

What rounding moves a tensor by (its *noise*) is measured, not assumed: the same single-process training
run is repeated from fresh copies of the untouched model with only the order of floating-point sums
changed, as the decomposition changes it (shard partial sums, the allreduce, BatchNorm's statistics over
shards): once with the model and input in channels-last memory (other kernels, other blocking of every
convolution and reduction) and once on the batch in reverse order (every sum over the batch in another
order; not for a model that draws random numbers, whose draws follow the batch index). Random draws are
the reference's (``bigconv.ops.random.RandomDraws(seed)``). A noise run that raises is an error of the
verdict, never skipped.

Allowances:

- the output, the input gradient and the losses are exact only within ``tol`` of their own size, whatever
  their noise (no floor: a wrong output must never read exact); one that rounding alone moves past ``tol``
  in one process (a global max over tied values sends the input gradient elsewhere) is ill-conditioned if
  within ``NOISE_FACTOR`` times its noise, wrong otherwise;
- a parameter gradient or weight within ``tol`` of its size is exact where rounding alone moves it by at most
  ``tol`` of its size; past ``tol`` but within ``NOISE_FACTOR`` times its noise it is ill-conditioned (never
  exact); further off, wrong;
- a *residue*: a parameter gradient, weight or optimizer state that the noise runs leave undetermined (they
  move it by at least ``RESIDUE_NOISE`` of its own size (1%: perhaps no significant digit), the remainder of a sum that
  cancels exactly, such as the gradient of a bias before a BatchNorm, zero in exact arithmetic) and whose
  size is at most ``tol`` of the largest tensor of its kind, may differ by ``NOISE_FACTOR`` times the larger of
  its noise and its own size (both are a remainder's size: another order of the sums leaves another remainder
  of that size, of either sign) and still reads exact; residues are listed. They are recognised only when
  every noise run left the output and the losses within ``tol`` of their size and every parameter gradient
  within ``tol`` of the largest, so a noise run that is not rounding (other random masks, a backward that
  went another way) can never make one. No other floor exists: a tensor the noise runs determined
  (its noise far below its size) is judged against ``tol`` of its own size however small it is beside
  the largest of its kind, so a sign flip or a zeroing of it is never exact.

Where the first two noise runs leave some parameter gradient, weight or optimizer state bit-identical (a
batch of two reversed adds the same two partial sums; channels-last in 3D runs the same kernels), a third
runs with every sum over positions and the batch inside normalizations and symmetric convolutions taken in
mirrored order (``mirror_sums``), so that a remainder the decomposition moves is measured, not assumed.

Optimizer state (momentum buffers, Adam's moments) is judged after the steps like the weights, and every
worker's (replica's) weights, buffers and optimizer state must equal the first's bit for bit: a
disagreement names the tensor, the workers and its size.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F

from .data.sources import SourceBatch, is_source_batch, read_targets
from .engine.dry_run import copy_model
from .ops.random import RandomDraws
from .ops.support import unwrap_compiled
from .parallel import parallelize
from .runtime.world import World  # or an SPMD world

ERROR_KEYS = ("forward", "input_grad", "param_grads", "loss", "weights", "optimizer")
NEVER_FLOORED = ("forward", "input_grad", "loss")
"""Categories judged against their own size only, whatever their noise."""
EXACT, NOT_EXACT, ILL_CONDITIONED = "exact", "not exact", "ill-conditioned at this size"
# Differences of float64 runs are summation order alone (~1e-16 per operation); float32 gets more.
DEFAULT_TOL = {torch.float64: 1e-9, torch.float32: 1e-4}
NOISE_FACTOR = 10.0
"""How many times its measured noise an ill-conditioned tensor or a residue may differ by. The noise runs
and the decomposition change the order of the same sums, so their effects agree in order of magnitude,
not exactly (measured over the zoo: ``results/zoo.jsonl``, ``worst_error_over_noise``)."""
RESIDUE_NOISE = 0.01
"""A tensor that the noise runs move by at least this fraction of its own size may have no significant digit
under the decomposition: the noise runs' effect and the decomposition's agree only within an order of
magnitude (``NOISE_FACTOR``), so a tensor measured undetermined to 1% may be undetermined outright (seen:
a bias before MONAI's BasicUNet's InstanceNorm, zero in exact arithmetic, its momentum buffer moved by 0.067
of its size in the noise runs and by 1.06 of it by the decomposition). Only such a tensor may be a residue;
one the noise runs determine better is judged against its own noise like any other."""
_CHANNELS_LAST = {4: torch.channels_last, 5: torch.channels_last_3d}


MIRRORED = "mirrored sums"
_NORMS = (torch.nn.modules.batchnorm._BatchNorm, torch.nn.modules.instancenorm._InstanceNorm, torch.nn.GroupNorm)
_CONVS = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)


def mirror_sums(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` (a noise run's own copy) with every sum over positions and the batch taken in mirrored order:
    each normalization (batch, instance, group norm; layer norm over its normalized dims, with its affine
    weights) and each convolution along the dims its windows tile symmetrically sees its input mirrored (the
    batch and those dims reversed) and gives its output back mirrored. In exact arithmetic nothing changes; in
    floating point each of those sums runs in the other order, forward and, through the mirrors, backward, as
    a decomposition's shard sums reorder them. The modules' own ``forward`` is replaced on this copy, so
    activation checkpointing's recompute mirrors as the forward did. A convolution's dim is mirrored only
    where its output windows are the mirror image of each other (``(size + 2 * padding - dilation * (kernel -
    1) - 1) % stride == 0``; 'same' padding of an even total)."""
    for module in model.modules():
        if isinstance(module, _NORMS):
            module.forward = _mirrored_norm(module.forward)
        elif isinstance(module, torch.nn.LayerNorm):
            module.forward = _mirrored_layer_norm(module)
        elif isinstance(module, _CONVS):
            module.forward = _mirrored_conv(module)
    return model


def _mirrored_norm(forward: Callable) -> Callable:
    def mirrored(x):
        if not isinstance(x, torch.Tensor) or x.dim() < 2:
            return forward(x)
        dims = [0, *range(2, x.dim())]
        return forward(x.flip(dims)).flip(dims)
    return mirrored


def _mirrored_layer_norm(module: torch.nn.LayerNorm) -> Callable:
    def mirrored(x):
        k = len(module.normalized_shape)
        dims, local = list(range(x.dim() - k, x.dim())), list(range(k))
        weight = module.weight.flip(local) if module.weight is not None else None
        bias = module.bias.flip(local) if module.bias is not None else None
        return F.layer_norm(x.flip(dims), module.normalized_shape, weight, bias, module.eps).flip(dims)
    return mirrored


def _symmetric_dims(x: torch.Tensor, conv: torch.nn.modules.conv._ConvNd) -> list[int]:
    """The dims of ``x`` along which ``conv``'s output windows are the mirror image of each other."""
    n = len(conv.kernel_size)
    first = x.dim() - n  # 1 for an unbatched input, 2 for a batched one
    dims = []
    for i in range(n):
        size, span = x.shape[first + i], conv.dilation[i] * (conv.kernel_size[i] - 1)
        if conv.padding == "same":
            ok = span % 2 == 0
        else:
            p = 0 if conv.padding == "valid" else conv.padding[i]
            ok = (size + 2 * p - span - 1) % conv.stride[i] == 0
        if ok:
            dims.append(first + i)
    return dims


def _mirrored_conv(conv: torch.nn.modules.conv._ConvNd) -> Callable:
    def mirrored(x):
        dims = _symmetric_dims(x, conv)
        n = len(conv.kernel_size)
        batch = [0] if x.dim() == n + 2 else []
        wdims = [d - (x.dim() - n) + 2 for d in dims]
        return conv._conv_forward(x.flip(batch + dims), conv.weight.flip(wdims), conv.bias).flip(batch + dims)
    return mirrored


def abs_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max-norm of ``a - b``."""
    return (a.detach().double().cpu() - b.detach().double().cpu()).abs().max().item() if b.numel() else 0.0


def _scale(t: torch.Tensor) -> float:
    return t.detach().double().abs().max().item() if t.numel() else 0.0


@dataclass
class Run:
    """What one training run yields, in the sequence ``compare_training`` follows: the output of a
    first forward, the input and parameter gradients of a second, and the losses and state dict of
    ``steps`` optimizer steps after it. ``drew``: whether the model drew random numbers."""

    output: object
    """A tensor, or a list, tuple or dict of them (several outputs), as the model returns it."""
    input_grad: torch.Tensor
    param_grads: dict
    losses: list
    state: dict
    drew: bool = False
    spreads: dict = field(default_factory=dict)
    """BatchNorm module name -> the largest standard deviation of its input over a batch (per channel, over the
    batch and positions) in this run's training forwards: the scale its running mean acts on."""
    optimizer: dict | None = None
    """The optimizer's state after the steps by ``"{parameter}.{key}"`` (``optimizer_tensors``); None where the
    run did not collect it (then it is not judged)."""
    replica_optimizers: list = field(default_factory=list)
    """A distributed run's: every worker's (replica's) ``optimizer``, the first's included."""


def output_leaves(tree, prefix: str = "output") -> dict[str, torch.Tensor]:
    """The tensors of a model's output by path: ``output`` for one tensor, ``output[0]``, ``output['aux']`` for
    several."""
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree)
    found: dict = {}
    for key, value in items:
        found.update(output_leaves(value, f"{prefix}[{key!r}]"))
    return found


def map_output(tree, fn: Callable[[torch.Tensor], torch.Tensor]):
    """``tree`` with ``fn`` applied to each tensor, its structure kept."""
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, dict):
        return type(tree)((k, map_output(v, fn)) for k, v in tree.items())
    return type(tree)(map_output(v, fn) for v in tree)


def named_tensors(run: Run) -> dict[tuple[str, str], torch.Tensor]:
    """Every tensor of a run by (category, name), the keys ``judge`` and the noise share."""
    named = {("forward", name): t for name, t in output_leaves(run.output).items()}
    named[("input_grad", "input")] = run.input_grad
    named.update({("param_grads", n): g for n, g in run.param_grads.items()})
    # A distributed run's losses are Python floats: keep all their digits (as_tensor would make float32).
    named.update({("loss", f"step {i}"): v if isinstance(v, torch.Tensor) else torch.tensor(v, dtype=torch.float64)
                  for i, v in enumerate(run.losses)})
    named.update({("weights", k): v for k, v in run.state.items()})
    named.update({("optimizer", k): v for k, v in (run.optimizer or {}).items()})
    return named


def optimizer_tensors(state: dict | None, names: Sequence[str]) -> dict[str, torch.Tensor]:
    """An optimizer's ``state_dict()`` by ``"{parameter}.{key}"`` (``conv.weight.momentum_buffer``,
    ``conv.weight.exp_avg_sq``), ``names`` being the parameters' names in the order the optimizer was given
    them (``model.parameters()``'s); numbers (a step count) as float64 tensors."""
    found: dict[str, torch.Tensor] = {}
    if not state:
        return found
    for index, per_param in state.get("state", {}).items():
        name = names[index] if isinstance(index, int) and index < len(names) else f"param {index}"
        for key, value in per_param.items():
            found[f"{name}.{key}"] = value.detach() if isinstance(value, torch.Tensor) else \
                torch.tensor(float(value), dtype=torch.float64)
    return found


def _opt_kwargs(optimizer: type, given: dict | None) -> dict:
    """The optimizer's arguments: those given, else SGD's default here (lr 0.05, momentum 0.9), else none (the
    class's own defaults)."""
    if given:
        return dict(given)
    return {"lr": 0.05, "momentum": 0.9} if optimizer is torch.optim.SGD else {}


def train_single(model: torch.nn.Module, x: torch.Tensor, y, loss_fn: Callable, steps: int = 2,
                 optimizer: type = torch.optim.SGD, opt_kwargs: dict | None = None, seed: int = 0,
                 memory_format: torch.memory_format | None = None, mirrored: bool = False) -> Run:
    """The single-process run, in the distributed run's order: forward, gradients, ``steps`` steps.

    Both sides run a training forward first, so buffers such as running statistics advance alike.
    Random draws in the forward (dropout, stochastic depth) are those of a model parallelized with
    ``seed`` (``bigconv.ops.random``), forward by forward. ``memory_format``: the model and input in
    that layout (a noise run: the same values, other kernels); ``mirrored``: ``mirror_sums`` applied to it (a
    noise run: the same values, sums over positions in mirrored order).
    """
    opt_kwargs = _opt_kwargs(optimizer, opt_kwargs)
    _one_process_sync_batchnorm(model)
    if memory_format is not None:
        model = model.to(memory_format=memory_format)
        x = x.contiguous(memory_format=memory_format)
    draws = RandomDraws(seed)
    drew = False
    plain = unwrap_compiled(model)[0]  # torch.compile(model): the names are the module's own
    if mirrored:
        mirror_sums(plain)
    spreads: dict = {}
    hooks = [m.register_forward_pre_hook(_spread_hook(name, spreads)) for name, m in plain.named_modules()
             if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]

    def forward(inp):
        nonlocal drew
        context = draws.forward()
        with context:
            out = model(inp)
        drew = drew or context.draws.count > 0
        return out

    output, xr, param_grads, losses, opt = _run_steps(model, plain, forward, x, y, loss_fn, steps, optimizer,
                                                      opt_kwargs)
    for hook in hooks:
        hook.remove()
    names = [n for n, _ in plain.named_parameters()]
    return Run(output, xr.grad, param_grads, losses, plain.state_dict(), drew, spreads,
               optimizer_tensors(opt.state_dict(), names))


def _run_steps(model, plain, forward, x, y, loss_fn, steps, optimizer, opt_kwargs):
    """``train_single``'s sequence: a forward, the gradients of a second, ``steps`` optimizer steps."""
    with torch.no_grad():
        output = forward(x)
    xr = x.detach().clone().requires_grad_(True)
    loss_fn(forward(xr), y).backward()
    param_grads = {n: p.grad.clone() for n, p in plain.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    opt = optimizer(model.parameters(), **opt_kwargs)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_fn(forward(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return output, xr, param_grads, losses, opt


def _spread_hook(name: str, spreads: dict) -> Callable:
    def hook(module, args):
        x = args[0] if args else None
        if module.training and isinstance(x, torch.Tensor) and x.dim() >= 2 and x.numel() > x.shape[1]:
            dims = [0, *range(2, x.dim())]
            std = x.detach().double().std(dim=dims, unbiased=False).max().item()
            spreads[name] = max(spreads.get(name, 0.0), std)
    return hook


class _OneProcessSyncBatchNorm(torch.nn.SyncBatchNorm):
    """SyncBatchNorm in one process is BatchNorm over the whole batch; its own forward would use the process
    group an SPMD rank holds (and refuse CPU tensors)."""

    forward = torch.nn.modules.batchnorm._BatchNorm.forward


def _one_process_sync_batchnorm(model: torch.nn.Module) -> None:
    """Every SyncBatchNorm of ``model`` (a copy) computed as one process computes it; keys and values unchanged."""
    for m in model.modules():
        if isinstance(m, torch.nn.SyncBatchNorm) and type(m) is not _OneProcessSyncBatchNorm:
            m.__class__ = _OneProcessSyncBatchNorm


@dataclass
class Reference:
    """One process's run and what rounding alone moves each of its tensors by.

    ``noise``: (category, name) -> the largest max-norm difference from ``run`` over the noise runs
    (``reorderings`` names them); ``rounding_only``: whether every noise run moved the tensors only as rounding
    does (``_rounding``; else no tensor counts as a residue)."""

    run: Run
    noise: dict
    reorderings: list
    rounding_only: bool


def reordered_runs(model: torch.nn.Module, x: torch.Tensor, y, loss_fn: Callable, ref: Run, steps: int = 2,
                   optimizer: type = torch.optim.SGD, opt_kwargs: dict | None = None,
                   seed: int = 0) -> Iterator[tuple[str, Run]]:
    """The noise runs, one at a time (a large model's copies and runs are not all held at once): ``model``'s
    training run, each from its own fresh copy, with only the order of floating-point sums changed (see the
    module docstring). An error in one is raised, naming it."""
    runs = {}
    layout = _CHANNELS_LAST.get(x.dim())
    if layout is not None:
        runs["channels-last"] = lambda: train_single(copy_model(model), x, y, loss_fn, steps, optimizer,
                                                     opt_kwargs, seed, memory_format=layout)
    if _reversible(x, y, ref):
        def reversed_batch() -> Run:
            r = train_single(copy_model(model), x.flip(0), y.flip(0), loss_fn, steps, optimizer, opt_kwargs, seed)
            return replace(r, output=map_output(r.output, lambda t: t.flip(0)), input_grad=r.input_grad.flip(0))
        runs["reversed batch"] = reversed_batch
    for name, run in runs.items():
        done = _noise_run(name, run)
        yield name, done
        del done


def _noise_run(name: str, run: Callable[[], Run]) -> Run:
    try:
        return run()
    except Exception as exc:
        raise RuntimeError(f"the exactness verdict's noise run ({name}) failed: {type(exc).__name__}: {exc}. "
                           "Without it rounding's effect is unknown and no verdict is given") from exc


def _unmeasured(named: dict, noise: dict, tol: float) -> list:
    """Parameter gradients, weights and optimizer states that no noise run has moved (bit-identical in every one,
    or none ran) and that are small enough to be a residue (at most ``tol`` of the largest of their kind): whether
    they are a remainder of a sum that cancels, or determined, is not measured yet."""
    largest: dict[str, float] = {}
    for (category, _), t in named.items():
        if t.is_floating_point():
            largest[category] = max(largest.get(category, 0.0), _scale(t))
    return [key for key, t in named.items() if key[0] not in NEVER_FLOORED and t.is_floating_point()
            and noise.get(key, 0.0) == 0.0 and 0 < _scale(t) <= tol * largest[key[0]]]


def _reversible(x: torch.Tensor, y, ref: Run) -> bool:
    """The batch can be reversed: two or more images, targets and output per image, and no random draws
    (they follow the batch index, so a reversed batch would draw other masks: not rounding)."""
    n = x.shape[0] if x.dim() else 0
    return (n >= 2 and not ref.drew and isinstance(y, torch.Tensor) and y.dim() > 0 and y.shape[0] == n
            and all(t.dim() > 0 and t.shape[0] == n for t in output_leaves(ref.output).values()))


def reference(model: torch.nn.Module, x: torch.Tensor, y, loss_fn: Callable, steps: int = 2,
              optimizer: type = torch.optim.SGD, opt_kwargs: dict | None = None, seed: int = 0,
              tol: float | None = None) -> Reference:
    """The single-process run of ``model`` (a copy: ``model`` stays untouched) and its noise."""
    tol = _tol(model, x) if tol is None else tol
    run = train_single(copy_model(model), x, y, loss_fn, steps, optimizer, opt_kwargs, seed)
    named = named_tensors(run)
    noise = {key: 0.0 for key in named}
    rounding_only = True
    names = []

    def mirrored() -> Iterator[tuple[str, Run]]:
        if _unmeasured(named, noise, tol):
            yield MIRRORED, _noise_run(MIRRORED, lambda: train_single(copy_model(model), x, y, loss_fn, steps,
                                                                      optimizer, opt_kwargs, seed, mirrored=True))

    largest_grad = max((_scale(g) for g in run.param_grads.values() if g.is_floating_point()), default=0.0)
    for name, other in itertools.chain(reordered_runs(model, x, y, loss_fn, run, steps, optimizer, opt_kwargs, seed),
                                       mirrored()):
        names.append(name)
        theirs = named_tensors(other)
        for key, want in named.items():
            if not want.is_floating_point():
                continue
            moved = abs_err(theirs[key], want) if key in theirs else math.inf  # a gradient only one order has
            noise[key] = max(noise[key], moved)
            if not _rounding(key, moved, want, tol, largest_grad):
                rounding_only = False
        del other, theirs
    return Reference(run, noise, names, rounding_only)


def _rounding(key: tuple[str, str], moved: float, want: torch.Tensor, tol: float, largest_grad: float) -> bool:
    """Whether a noise run's movement of one tensor is what rounding does to a run: the output and each loss
    within ``tol`` of their size, every parameter gradient within ``tol`` of the largest (a backward that went
    another way moves them further). The input gradient is left out: rounding alone sends it to another of
    tied maxima (a global max pool), which says nothing about the sums a residue is the remainder of."""
    if key[0] in ("forward", "loss"):
        return moved <= tol * _scale(want)
    if key[0] == "param_grads":
        return moved <= tol * largest_grad
    return True


def _tol(model: torch.nn.Module, x: torch.Tensor) -> float:
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), x.dtype)
    return DEFAULT_TOL.get(dtype, 1e-2)


@dataclass(frozen=True)
class TensorError:
    """How far one tensor of the distributed run is from the single process's.

    ``error`` and ``scale`` are max-norms (of the difference, of the reference); ``noise`` what rounding
    alone moves the reference by (``Reference.noise``); ``rel`` = ``error / scale`` (0 where both are 0);
    ``allowed`` the error this tensor may have; ``status``: ``ok`` (within ``tol`` of its size, which rounding
    alone respects), ``residue``, ``ill-conditioned`` (within its allowance but past ``tol``, or rounding alone
    moves it past ``tol``), ``wrong`` or ``missing`` (one side has no such tensor).
    """

    category: str
    name: str
    rel: float
    error: float
    scale: float
    noise: float
    allowed: float
    status: str

    def as_dict(self) -> dict:
        return {"category": self.category, "tensor": self.name, "rel": self.rel, "error": self.error,
                "scale": self.scale, "noise": self.noise, "allowed": self.allowed, "status": self.status}


def well_conditioned(noise: float, scale: float, tol: float) -> bool:
    """Whether any error past ``tol`` of a tensor's size reads wrong, not ill-conditioned: the decomposition's
    rounding may move it by up to ``NOISE_FACTOR`` times its measured noise, which stays within ``tol`` of it
    (what a planted error must be placed on to be caught whatever its size)."""
    return NOISE_FACTOR * noise <= tol * scale


def tensor_error(category: str, name: str, got: torch.Tensor | None, ref: torch.Tensor, noise: float, tol: float,
                 residue_scale: float | None = None, spread: float = 0.0) -> TensorError:
    """Judge ``got`` against ``ref`` (see the module docstring). ``residue_scale``: the largest size among
    tensors of this kind where residues (tensors the noise runs leave undetermined) may be recognised, None
    where they may not; ``spread``: for a running mean, the spread of what it averages (``Run.spreads``), its
    size where larger."""
    scale = max(_scale(ref), spread)
    if got is None:  # the distributed run produced nothing where one process has a tensor (a lost gradient)
        return TensorError(category, name, math.inf, math.inf, scale, noise, 0.0, "missing")
    if tuple(got.shape) != tuple(ref.shape):
        return TensorError(category, name, math.inf, math.inf, scale, noise, 0.0, "wrong")
    if not ref.is_floating_point():
        same = torch.equal(got.cpu(), ref.cpu())
        return TensorError(category, name, 0.0 if same else math.inf, 0.0 if same else abs_err(got, ref), scale,
                           0.0, 0.0, "ok" if same else "wrong")
    error = abs_err(got, ref)
    if math.isnan(error):  # nan compares false with everything: it must read as the worst, not be skipped
        error = math.inf
    rel = error / scale if scale > 0 else (0.0 if error == 0 else math.inf)
    quiet = noise <= tol * scale  # rounding alone stays within tol of the tensor's size: determined
    if category in NEVER_FLOORED or not math.isfinite(noise):
        # Never exact past tol. Where rounding alone moves it past tol in one process (a max over tied values
        # sends the gradient to another position), within NOISE_FACTOR times that: ill-conditioned, not exact.
        allowed = tol * scale if quiet or not math.isfinite(noise) else max(tol * scale, NOISE_FACTOR * noise)
        status = ("ok" if quiet else "ill-conditioned") if error <= allowed else "wrong"
    elif quiet:
        # Within tol: exact. Past tol but within what the decomposition's rounding may do (NOISE_FACTOR times
        # the noise runs'): ill-conditioned, not wrong, and never exact. However small the tensor is beside the
        # largest of its kind: the noise runs determined it, so a sign flip or a zeroing reads wrong.
        allowed = max(tol * scale, NOISE_FACTOR * noise)
        status = "ok" if error <= tol * scale else "ill-conditioned" if error <= allowed else "wrong"
    elif residue_scale is not None and noise >= RESIDUE_NOISE * scale and scale <= tol * residue_scale:
        # Undetermined (no significant digit survives the noise runs) and small: a sum that cancels exactly. Its
        # size is a remainder's as much as its noise is: another order of the sums leaves another of that size.
        allowed = NOISE_FACTOR * max(noise, scale)
        status = "residue" if error <= allowed else "wrong"
    else:
        allowed = max(tol * scale, NOISE_FACTOR * noise)
        status = "ill-conditioned" if error <= allowed else "wrong"
    return TensorError(category, name, rel, error, scale, noise, allowed, status)


def judge(got: Run, ref: Reference, tol: float) -> list[TensorError]:
    """Every tensor of ``got`` against the reference run, each with its allowance."""
    mine, reference_ = named_tensors(got), named_tensors(ref.run)
    if got.optimizer is None:  # not collected (a run made by hand): nothing to judge it on
        reference_ = {k: v for k, v in reference_.items() if k[0] != "optimizer"}
    largest: dict[str, float] = {}
    for (category, _), t in reference_.items():
        if t.is_floating_point():
            largest[category] = max(largest.get(category, 0.0), _scale(t))
    keys = list(reference_) + [k for k in mine if k not in reference_]
    errors = []
    for key in keys:
        want, got_t = reference_.get(key), mine.get(key)
        noise = ref.noise.get(key, 0.0)
        if want is None:  # one process leaves this gradient unset: the distributed one must be exactly zero
            want, noise = torch.zeros_like(got_t), 0.0
        if key[0] == "loss" and got_t is None:
            got_t = torch.tensor(float("nan"))
        floorable = key[0] not in NEVER_FLOORED
        residue_scale = largest.get(key[0]) if ref.rounding_only and floorable else None
        errors.append(tensor_error(*key, got_t, want, noise, tol, residue_scale, _spread(key, ref.run)))
    return errors


def _spread(key: tuple[str, str], run: Run) -> float:
    """A running mean acts on the model only through (x - mean) / std: its size is the larger of its own and
    the spread of the values it averages (measured in the reference run, not read from the running variance,
    which starts at 1 whatever the data). A mean of cancelling values (a depthwise convolution after
    BatchNorm) is determined only to rounding of that spread, at any input size."""
    category, name = key
    if category != "weights" or not name.endswith(".running_mean"):
        return 0.0
    return run.spreads.get(name[: -len(".running_mean")], 0.0)


class TensorList(list):
    """Per-tensor dicts; printed short, so a failed assertion that shows a whole result stays readable."""

    def __repr__(self) -> str:
        return f"<{len(self)} tensors; see the list's items>"


def summarize(errors: Sequence[TensorError], tol: float) -> dict:
    """The verdict, the worst relative error of each category (residues left out: they have no size of their
    own) and the tensor behind it, the ill-conditioned tensors, the residues, and every tensor."""
    result: dict = {"worst": {}}
    for key in ERROR_KEYS:
        judged = [e for e in errors if e.category == key and e.status != "residue"]
        worst = max(judged, key=lambda e: (e.status in ("wrong", "missing"), e.rel), default=None)
        result[key] = worst.rel if worst else 0.0
        result["worst"][key] = worst.as_dict() if worst else None
    result["tol"] = tol
    result["ill_conditioned"] = TensorList(e.as_dict() for e in errors if e.status == "ill-conditioned"
                                           or (e.status == "wrong" and e.noise > tol * e.scale))
    result["residues"] = TensorList(e.as_dict() for e in errors if e.status == "residue")
    result["wrong"] = TensorList(e.as_dict() for e in errors if e.status in ("wrong", "missing"))
    result["verdict"] = NOT_EXACT if result["wrong"] else ILL_CONDITIONED if result["ill_conditioned"] else EXACT
    result["exact"] = result["verdict"] == EXACT
    result["tensors"] = TensorList(e.as_dict() for e in errors)
    return result


def distributed_run(model: torch.nn.Module, world: World, x, y, loss_fn: Callable, grid: Sequence[int] | None = None,
                    steps: int = 2, optimizer: type = torch.optim.SGD, opt_kwargs: dict | None = None,
                    replicas: int = 1, transport: str = "p2p", seed: int = 0):
    """The same run as ``train_single`` on ``world``: a forward, the gradients, ``steps`` steps. Returns the
    ``Run`` (the first worker's state and optimizer state, every worker's optimizer state), every worker's
    state dict and the parallel model."""
    opt_kwargs = _opt_kwargs(optimizer, opt_kwargs)
    yt = read_targets(y, loss_fn) if is_source_batch(y) else y  # gradients() takes targets as a tensor
    names = [n for n, _ in unwrap_compiled(model)[0].named_parameters()]  # before the workers take ``model``
    net = parallelize(model, world, grid=grid, replicas=replicas, transport=transport, seed=seed)
    out = net.full(x)
    _, input_grad, param_grads = net.gradients(x, yt, loss_fn)
    net.optimizer(optimizer, **opt_kwargs)
    losses = [net.train_step(x, y, loss_fn) for _ in range(steps)]
    states = net.replica_state_dicts()
    optimizers = [optimizer_tensors(o, names) for o in net.replica_optimizer_states()]
    return Run(out, input_grad, param_grads, losses, states[0], optimizer=optimizers[0],
               replica_optimizers=optimizers), states, net


def disagreements(copies: Sequence[dict], category: str) -> list[dict]:
    """Where the workers' (replicas') copies of a state differ from the first's: per tensor, the workers that
    hold another value (or none) and the largest difference; they must be equal bit for bit (every worker
    applies the same summed gradients to the same weights)."""
    found = []
    first = copies[0] if copies else {}
    for key in dict.fromkeys(k for c in copies for k in c):
        want = first.get(key)
        off, error = [], 0.0
        for worker, copy in enumerate(copies[1:], start=1):
            got = copy.get(key)
            if want is None or got is None or got.shape != want.shape:
                off.append(worker)
                error = math.inf
            elif not torch.equal(got, want):
                off.append(worker)
                diff = abs_err(got, want) if got.is_floating_point() or got.is_complex() else math.inf
                error = max(error, math.inf if math.isnan(diff) else diff)
        if off:
            scale = _scale(want) if want is not None and want.is_floating_point() else 0.0
            found.append({"category": "replicas", "tensor": f"{category} {key}", "workers": off, "error": error,
                          "scale": scale, "rel": error / scale if scale else math.inf, "noise": 0.0, "allowed": 0.0,
                          "status": "wrong"})
    return found


def verdict(got: Run, ref: Reference, tol: float, replica_states: Sequence[dict] | None = None) -> dict:
    """``summarize(judge(...))`` plus the workers' agreement (each disagreeing tensor named in ``wrong`` with the
    workers and the size: category ``replicas``) and the state dict's keys."""
    result = summarize(judge(got, ref, tol), tol)
    states = list(replica_states or [got.state])
    apart = disagreements(states, "weights") + disagreements(got.replica_optimizers, "optimizer")
    result["replicas_equal"] = not apart
    result["replicas_disagree"] = TensorList(apart)
    result["wrong"] = TensorList([*result["wrong"], *apart])
    result["keys_match"] = set(states[0]) == set(ref.run.state)
    if not (result["replicas_equal"] and result["keys_match"]):
        result["verdict"], result["exact"] = NOT_EXACT, False
    result["reorderings"] = list(ref.reorderings)
    result["rounding_only"] = ref.rounding_only
    return result


def compare_training(model: torch.nn.Module, world: World, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable,
                     grid: Sequence[int] | None = None, steps: int = 2, optimizer: type = torch.optim.SGD,
                     replicas: int = 1, tol: float | None = None, transport: str = "p2p", seed: int = 0,
                     **opt_kwargs) -> dict:
    """Train ``model`` on ``world`` and in one process; the verdict and every tensor's error.

    ``verdict`` is ``exact``, ``not exact`` or ``ill-conditioned at this size`` (module docstring);
    ``exact`` is ``verdict == "exact"``. Each of ``forward``, ``input_grad``, ``param_grads``, ``loss``,
    ``weights`` and ``optimizer`` (its state after the steps) is the worst relative error of its category
    (error over the tensor's own size; residues left out), ``worst`` names the tensor behind each, ``wrong``,
    ``ill_conditioned`` and ``residues`` list those tensors (``wrong`` also each tensor whose workers' copies
    disagree, with the workers), and ``tensors`` every one. ``tol``: 1e-9 for float64, 1e-4 for float32 by
    default.

    ``x`` may be a list of image sources (``bigconv.data``): the workers read their boxes, and the
    single process gets the same pixels read whole. On an SPMD world every rank calls this with the
    same arguments (``replicas`` as in ``parallelize``) and gets the same answer. ``transport``: the
    driver mode's, as in ``parallelize``. ``seed``: of the model's random draws, on both sides.
    """
    opt_kwargs = _opt_kwargs(optimizer, opt_kwargs)
    xt = x if isinstance(x, torch.Tensor) else SourceBatch(x).read()
    yt = read_targets(y, loss_fn) if is_source_batch(y) else y
    tol = _tol(model, xt) if tol is None else tol
    # The single-process runs first, on copies: parallelize leaves ``model`` to the workers.
    ref = reference(model, xt, yt, loss_fn, steps, optimizer, opt_kwargs, seed, tol)
    got, states, net = distributed_run(model, world, x, y, loss_fn, grid, steps, optimizer, opt_kwargs, replicas,
                                       transport, seed)
    result = verdict(got, ref, tol, states)
    result["net"] = net
    return result


def conditioned_size(model: torch.nn.Module, x: torch.Tensor, y, loss_fn: Callable, steps: int = 2,
                     optimizer: type = torch.optim.SGD, opt_kwargs: dict | None = None, seed: int = 0,
                     tol: float | None = None, doublings: int = 3) -> tuple[int, ...] | None:
    """The smallest input shape, doubling every spatial dim of ``x`` up to ``doublings`` times, at which one
    process's run has no ill-conditioned tensor: a suggestion from one random input of that shape.

    ``y``: targets without spatial dims (kept as they are), or a function from an input to its targets;
    for other targets (a dense map of ``x``'s size) there is no suggestion: None, as where no size helps.
    """
    if not callable(y) and (not isinstance(y, torch.Tensor) or y.dim() > 1):
        return None
    tol = _tol(model, x) if tol is None else tol
    generator = torch.Generator().manual_seed(seed)
    for k in range(1, doublings + 1):
        shape = (*x.shape[:2], *(s * 2 ** k for s in x.shape[2:]))
        xk = torch.randn(shape, generator=generator, dtype=x.dtype)
        ref = reference(model, xk, y(xk) if callable(y) else y, loss_fn, steps, optimizer, opt_kwargs, seed, tol)
        if not summarize(judge(ref.run, ref, tol), tol)["ill_conditioned"]:
            return tuple(shape)
    return None
