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
- a *residue*: a parameter gradient or weight whose noise is at least ``RESIDUE_NOISE`` of its own size
  (no significant digit: the remainder of a sum that cancels exactly, such as the gradient of a bias
  before a BatchNorm, zero in exact arithmetic) and whose size is at most ``tol`` of the largest tensor of
  its kind, may differ by ``NOISE_FACTOR`` times its noise and still reads exact; residues are listed.
  They are recognised only when every noise run left the output, input gradient and losses within ``tol``
  of their size, so a noise run that is not rounding (other random masks) can never make one. A parameter
  gradient or weight below ``NEGLIGIBLE_ULPS`` units of roundoff of the largest tensor of its kind on both
  sides (2.3e-13 of it in float64) is a residue too, whatever its measured noise: a sum over a batch of
  two in reverse order adds the same two partial sums, so the noise runs can leave such a remainder
  bit-identical where the decomposition's shard sums do not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, Sequence

import torch

from .data.sources import SourceBatch, is_source_batch, read_targets
from .engine.dry_run import copy_model
from .ops.random import RandomDraws
from .ops.support import unwrap_compiled
from .parallel import parallelize
from .runtime.world import World  # or an SPMD world

ERROR_KEYS = ("forward", "input_grad", "param_grads", "loss", "weights")
NEVER_FLOORED = ("forward", "input_grad", "loss")
"""Categories judged against their own size only, whatever their noise."""
EXACT, NOT_EXACT, ILL_CONDITIONED = "exact", "not exact", "ill-conditioned at this size"
# Differences of float64 runs are summation order alone (~1e-16 per operation); float32 gets more.
DEFAULT_TOL = {torch.float64: 1e-9, torch.float32: 1e-4}
NOISE_FACTOR = 10.0
"""How many times its measured noise an ill-conditioned tensor or a residue may differ by. The noise runs
and the decomposition change the order of the same sums, so their effects agree in order of magnitude,
not exactly (measured over the zoo: ``results/zoo.jsonl``, ``worst_error_over_noise``)."""
RESIDUE_NOISE = 0.1
"""A tensor that rounding moves by at least this fraction of its own size has no significant digit."""
NEGLIGIBLE_ULPS = 1024
"""A parameter gradient or weight whose size is at most this many units of roundoff of the largest tensor of its
kind (2.3e-13 of it in float64; the smallest genuine gradient of a ConvNeXt with layer scale 1e-6 is 5e-10 of
the largest), on both sides, is a residue whatever its measured noise."""
_CHANNELS_LAST = {4: torch.channels_last, 5: torch.channels_last_3d}


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
    return named


def train_single(model: torch.nn.Module, x: torch.Tensor, y, loss_fn: Callable, steps: int = 2,
                 optimizer: type = torch.optim.SGD, opt_kwargs: dict | None = None, seed: int = 0,
                 memory_format: torch.memory_format | None = None) -> Run:
    """The single-process run, in the distributed run's order: forward, gradients, ``steps`` steps.

    Both sides run a training forward first, so buffers such as running statistics advance alike.
    Random draws in the forward (dropout, stochastic depth) are those of a model parallelized with
    ``seed`` (``bigconv.ops.random``), forward by forward. ``memory_format``: the model and input in
    that layout (a noise run: the same values, other kernels).
    """
    opt_kwargs = opt_kwargs or {"lr": 0.05, "momentum": 0.9}
    _one_process_sync_batchnorm(model)
    if memory_format is not None:
        model = model.to(memory_format=memory_format)
        x = x.contiguous(memory_format=memory_format)
    draws = RandomDraws(seed)
    drew = False
    plain = unwrap_compiled(model)[0]  # torch.compile(model): the names are the module's own
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
    for hook in hooks:
        hook.remove()
    return Run(output, xr.grad, param_grads, losses, plain.state_dict(), drew, spreads)


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
    (``reorderings`` names them); ``rounding_only``: whether every noise run left the output, the input
    gradient and each loss within ``tol`` of its size (else no tensor counts as a residue)."""

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
        try:
            done = run()
        except Exception as exc:
            raise RuntimeError(f"the exactness verdict's noise run ({name}) failed: {type(exc).__name__}: {exc}. "
                               "Without it rounding's effect is unknown and no verdict is given") from exc
        yield name, done
        del done


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
    for name, other in reordered_runs(model, x, y, loss_fn, run, steps, optimizer, opt_kwargs, seed):
        names.append(name)
        theirs = named_tensors(other)
        for key, want in named.items():
            if not want.is_floating_point():
                continue
            moved = abs_err(theirs[key], want) if key in theirs else math.inf  # a gradient only one order has
            noise[key] = max(noise[key], moved)
            if key[0] in NEVER_FLOORED and not moved <= tol * _scale(want):
                rounding_only = False
        del other, theirs
    return Reference(run, noise, names, rounding_only)


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


def negligible(scale: float, largest: float, dtype: torch.dtype) -> bool:
    """Below ``NEGLIGIBLE_ULPS`` units of roundoff of the largest tensor of its kind: what a sum that cancels
    leaves even where no reordering in one process moves it (with a batch of two, a reversed batch adds the
    same two partial sums; channels-last in 3D runs the same kernels)."""
    return scale <= NEGLIGIBLE_ULPS * torch.finfo(dtype).eps * largest


def tensor_error(category: str, name: str, got: torch.Tensor | None, ref: torch.Tensor, noise: float, tol: float,
                 residue_scale: float | None = None, largest: float | None = None, spread: float = 0.0) -> TensorError:
    """Judge ``got`` against ``ref`` (see the module docstring). ``residue_scale``: the largest size among
    tensors of this kind where residues with measured noise may be recognised, None where they may not;
    ``largest``: the largest size among tensors of this kind where negligible ones may be (None: nowhere);
    ``spread``: for a running mean, the spread of what it averages (``Run.spreads``), its size where larger."""
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
    quiet = noise <= tol * scale  # rounding alone stays within tol of the tensor's size
    if largest is not None and negligible(scale, largest, ref.dtype) and negligible(_scale(got), largest, ref.dtype):
        allowed = 2 * NEGLIGIBLE_ULPS * torch.finfo(ref.dtype).eps * largest
        status = "residue" if error <= allowed else "wrong"
    elif category in NEVER_FLOORED or not math.isfinite(noise):
        # Never exact past tol. Where rounding alone moves it past tol in one process (a max over tied values
        # sends the gradient to another position), within NOISE_FACTOR times that: ill-conditioned, not exact.
        allowed = tol * scale if quiet or not math.isfinite(noise) else max(tol * scale, NOISE_FACTOR * noise)
        status = ("ok" if quiet else "ill-conditioned") if error <= allowed else "wrong"
    elif quiet:
        # Within tol: exact. Past tol but within what the decomposition's rounding may do (NOISE_FACTOR times
        # the noise runs'): ill-conditioned, not wrong, and never exact.
        allowed = max(tol * scale, NOISE_FACTOR * noise)
        status = "ok" if error <= tol * scale else "ill-conditioned" if error <= allowed else "wrong"
    elif residue_scale is not None and noise >= RESIDUE_NOISE * scale and scale <= tol * residue_scale:
        allowed = NOISE_FACTOR * noise
        status = "residue" if error <= allowed else "wrong"
    else:
        allowed = max(tol * scale, NOISE_FACTOR * noise)
        status = "ill-conditioned" if error <= allowed else "wrong"
    return TensorError(category, name, rel, error, scale, noise, allowed, status)


def judge(got: Run, ref: Reference, tol: float) -> list[TensorError]:
    """Every tensor of ``got`` against the reference run, each with its allowance."""
    mine, reference_ = named_tensors(got), named_tensors(ref.run)
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
        errors.append(tensor_error(*key, got_t, want, noise, tol, residue_scale, largest.get(key[0]) if floorable
                                   else None, _spread(key, ref.run)))
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
    ``Run`` (first replica's state), every replica's state dict and the parallel model."""
    opt_kwargs = opt_kwargs or {"lr": 0.05, "momentum": 0.9}
    yt = read_targets(y, loss_fn) if is_source_batch(y) else y  # gradients() takes targets as a tensor
    net = parallelize(model, world, grid=grid, replicas=replicas, transport=transport, seed=seed)
    out = net.full(x)
    _, input_grad, param_grads = net.gradients(x, yt, loss_fn)
    net.optimizer(optimizer, **opt_kwargs)
    losses = [net.train_step(x, y, loss_fn) for _ in range(steps)]
    states = net.replica_state_dicts()
    return Run(out, input_grad, param_grads, losses, states[0]), states, net


def verdict(got: Run, ref: Reference, tol: float, replica_states: Sequence[dict] | None = None) -> dict:
    """``summarize(judge(...))`` plus the replicas' agreement and the state dict's keys."""
    result = summarize(judge(got, ref, tol), tol)
    states = list(replica_states or [got.state])
    result["replicas_equal"] = all(torch.equal(s[k], states[0][k]) for s in states for k in ref.run.state)
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
    ``exact`` is ``verdict == "exact"``. Each of ``forward``, ``input_grad``, ``param_grads``, ``loss``
    and ``weights`` is the worst relative error of its category (error over the tensor's own size; residues
    left out), ``worst`` names the tensor behind each, ``wrong``, ``ill_conditioned`` and ``residues`` list
    those tensors, and ``tensors`` every one. ``tol``: 1e-9 for float64, 1e-4 for float32 by default.

    ``x`` may be a list of image sources (``bigconv.data``): the workers read their boxes, and the
    single process gets the same pixels read whole. On an SPMD world every rank calls this with the
    same arguments (``replicas`` as in ``parallelize``) and gets the same answer. ``transport``: the
    driver mode's, as in ``parallelize``. ``seed``: of the model's random draws, on both sides.
    """
    opt_kwargs = opt_kwargs or {"lr": 0.05, "momentum": 0.9}
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
