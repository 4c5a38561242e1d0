"""Random draws in a model's forward that every shard makes consistently, as one process would.

A shard drawing from its own generator would keep and drop different stochastic-depth branches
for the shards of one image (timm's ``DropPath`` draws an (N, 1, 1, 1) mask on each shard) and
draw dropout masks that no single process could draw. So every draw of a forward under
``ShardMode`` comes from a counter-based generator: the value at a position is a hash of the
seed, the forward's number, the draw's number within the forward and the position's *global*
linear index (computed with integer torch ops, on the tensor's device). Every shard of an image
therefore computes exactly the values a single process computes for its part, whatever the grid:
per-image draws are equal on every shard, per-position masks agree across shard borders.

The law is the one torch's own draws follow (uniform with 53 bits in float64 and full mantissa
otherwise, Bernoulli by comparison, normal by Box-Muller); the values are not torch's. To get the
*same values* in one process, run its forwards under ``RandomDraws(seed).forward()`` (the
reference ``bigconv.verify`` uses): forward number k there draws what forward number k of a
parallelized model built with ``seed`` draws.

Covered: ``F.dropout`` / ``dropout1d/2d/3d`` / ``alpha_dropout`` / ``feature_alpha_dropout`` (and
their modules), ``bernoulli``/``bernoulli_``, ``uniform_``, ``normal_``, ``rand``/``randn`` and
``rand_like``/``randn_like``. Other draws (``randint``, ``randperm``, ``multinomial``,
``exponential_``...) are refused under the mode: each worker would draw its own.
"""

from __future__ import annotations

import math
import warnings
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..geometry.boxes import shard_box
from .context import KeySource, RuleContext
from .layout import pointwise
from .shards import bind, global_shape, global_size, mark, trailing

RULES: dict = {}
"""This module's rules for calls with a sharded argument (merged by ``bigconv.ops.table``)."""
WHOLE_RULES: dict = {}
"""Its rules for calls without one (per-image draws, the replicated head's dropout)."""
LAYOUT_AWARE: set = set()
"""The functions among them whose rules handle spatial dims wherever they are."""
PROPERTY_RULES: dict = {}

_M32 = 0xFFFFFFFF


def _mix(h):
    """A 32-bit avalanche hash (lowbias32) of a Python int or an int64 tensor holding values < 2**32.

    Products are masked to 32 bits; an int64 product that wraps keeps its low bits exact."""
    h = h ^ (h >> 16)
    h = (h * 0x7FEB352D) & _M32
    h = h ^ (h >> 15)
    h = (h * 0x846CA68B) & _M32
    return h ^ (h >> 16)


class ForwardDraws:
    """The draws of one forward: each call takes the next key."""

    def __init__(self, seed: int, forward: int, stream: int = 0) -> None:
        self.base = _mix(_mix(_mix(seed & _M32) ^ (seed >> 32 & _M32)) ^ _mix(forward & _M32) ^ _mix(stream + 0x9E37))
        self.count = 0

    def fork(self) -> "ForwardDraws":
        """These draws from here on, again: a checkpointed block's recompute draws what its forward drew."""
        other = ForwardDraws.__new__(ForwardDraws)
        other.base, other.count = self.base, self.count
        return other

    def next_key(self) -> int:
        self.count += 1
        return _mix(self.base ^ _mix(self.count * 0x68E31DA4 & _M32))


class RandomDraws:
    """A model's random stream: a seed and the number of forwards run so far.

    ``with draws.forward(): model(x)`` in one process draws what the parallelized model's forward of
    the same number draws (the workers hold one each, advanced once per forward)."""

    def __init__(self, seed: int = 0, stream: int = 0) -> None:
        self.seed = int(seed)
        self.stream = stream
        """Mixed into every key: a data-parallel replica's number (its images are other images)."""
        self.forwards = 0

    def next_forward(self) -> ForwardDraws:
        self.forwards += 1
        return ForwardDraws(self.seed, self.forwards, self.stream)

    def forward(self) -> "ConsistentRandom":
        """A context for one forward in one process, drawing as the shards do."""
        return ConsistentRandom(self.next_forward())

    def state(self) -> dict:
        """What a checkpoint keeps of this stream: the seed and the forwards run so far (every forward of
        the model counts: training, inference, ``predict``, ``capture``; a checkpointed block's recompute
        does not). The stream number is not kept: it is the replica's own."""
        return {"seed": self.seed, "forwards": self.forwards}

    def restore(self, state: dict) -> None:
        """Continue where ``state`` (``state()``'s) stopped: the next forward draws what forward
        ``state["forwards"] + 1`` of a model seeded ``state["seed"]`` draws."""
        self.seed, self.forwards = int(state["seed"]), int(state["forwards"])


def random_seed(seed: int | None) -> int:
    """The seed of a model's random draws (dropout, stochastic depth): ``seed``, or torch's initial seed
    (what ``torch.manual_seed`` set), read without advancing torch's generator."""
    if seed is None:
        return torch.initial_seed() & (2 ** 62 - 1)
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    return seed


# -- checkpoints ------------------------------------------------------------------------------------------
def saved_draws(states: Sequence[dict]) -> dict:
    """A checkpoint's ``"draws"`` entry from every worker's (rank's) ``RandomDraws.state()``. Every forward
    runs on every shard, so they agree; if they do not, the shards' draws already disagree, and the
    file keeps worker 0's (with a warning) rather than refusing to save."""
    first = dict(states[0])
    differing = [i for i, s in enumerate(states) if dict(s) != first]
    if differing:
        warnings.warn(f"the random draws' counters differ between workers (worker 0: {first}, worker "
                      f"{differing[0]}: {dict(states[differing[0]])}); the checkpoint keeps worker 0's", stacklevel=3)
    return first


def drawing_modules(model) -> list[str]:
    """The modules of ``model`` known to draw in training (dropout, timm's ``DropPath``/``DropBlock``,
    torchvision's ``StochasticDepth``, each with a positive rate), as "name (Class)": what a warning names.
    A forward that calls ``torch.rand`` itself is not seen."""
    found = []
    for name, m in model.named_modules():
        kind = type(m).__name__
        if "Drop" not in kind and "StochasticDepth" not in kind:
            continue
        rates = [getattr(m, a, None) for a in ("p", "drop_prob", "drop_rate")]
        if any(isinstance(r, (int, float)) and not isinstance(r, bool) and r > 0 for r in rates):
            found.append(f"{name or 'the model'} ({kind})")
    return found


def draws_problem(state) -> str | None:
    """What is wrong with ``state`` as the random draws' state of a model (``RandomDraws.state()``'s dict:
    exactly ``{"seed": int >= 0, "forwards": int >= 0}``), or None: what ``net.load_draws_state`` checks
    before anything changes."""
    if not isinstance(state, dict):
        return f"expected a dict, got {type(state).__name__} {str(state)[:80]}"
    unknown = sorted(str(k) for k in state if k not in ("seed", "forwards"))
    if unknown:
        return f"unexpected keys {unknown} (a whole checkpoint instead of its draws entry?)"
    for key in ("seed", "forwards"):
        if key not in state:
            return f"the key {key!r} is missing"
        v = state[key]
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            return f"{key!r} is {v!r} ({type(v).__name__}), expected an int >= 0"
    return None


def draws_to_load(saved, seed: int, seed_given: bool, path: str, model) -> dict | None:
    """The state a ``load`` of the checkpoint at ``path`` gives every worker's ``RandomDraws``, checked
    before any worker changes: the saved seed and counter, so the resumed run draws what the saved run
    would have drawn next, as ``load`` restores torch's generator states. The saved seed wins over this
    model's ``seed`` (a warning when that was given explicitly and differs). None for a file written
    before bigconv saved the counter: the draws go on from this model's own count (a new model's: forward
    1), with a warning naming the file when ``model`` holds modules that draw."""
    if saved is None:
        drawing = drawing_modules(model)
        if drawing:
            warnings.warn(f"the checkpoint {path!r} does not hold the random draws' counter (it was written by an "
                          f"older bigconv): the model's random draws ({', '.join(drawing[:3])}"
                          f"{', ...' if len(drawing) > 3 else ''}) go on from this model's own forward count (a new "
                          "model's: forward 1), not from where the saved run stopped; save again to keep it",
                          stacklevel=3)
        return None
    problem = draws_problem(saved)
    if problem is not None:
        raise ValueError(f"the checkpoint {path!r} has a malformed 'draws' entry {saved!r} ({problem}; expected "
                         "{'seed': int >= 0, 'forwards': int >= 0}); use the file net.save() wrote")
    if seed_given and saved["seed"] != seed:
        warnings.warn(f"the checkpoint {path!r} was saved by a model drawing with seed {saved['seed']}, this model "
                      f"was made with seed {seed}: load continues the saved run's draws (seed {saved['seed']}, "
                      f"after forward {saved['forwards']}), as it restores torch's generator states, so that the resumed "
                      "run trains to the weights of the run that never stopped",
                      stacklevel=3)
    return {"seed": saved["seed"], "forwards": saved["forwards"]}


# -- values from positions -------------------------------------------------------------------------
def _index(full: Sequence[int], offsets: Sequence[int], local: Sequence[int], device) -> tuple[torch.Tensor, bool]:
    """Global row-major linear indices of a local block at ``offsets`` of a tensor of size ``full``, and
    whether they may exceed 32 bits (then their high half is hashed too)."""
    idx = torch.zeros((), dtype=torch.int64, device=device)
    stride = 1
    for d in reversed(range(len(local))):
        view = [1] * len(local)
        view[d] = local[d]
        ar = torch.arange(offsets[d], offsets[d] + local[d], dtype=torch.int64, device=device) * stride
        idx = idx + ar.view(view)
        stride *= full[d]
    return idx.expand(tuple(local)), stride > _M32


def _mix_(h: torch.Tensor) -> torch.Tensor:
    """``_mix`` in place on an int64 tensor (the draws' cost is these few passes over the block)."""
    h.bitwise_xor_(h >> 16).mul_(0x7FEB352D).bitwise_and_(_M32)
    h.bitwise_xor_(h >> 15).mul_(0x846CA68B).bitwise_and_(_M32)
    return h.bitwise_xor_(h >> 16)


def _hash(index: tuple[torch.Tensor, bool], key: int) -> torch.Tensor:
    """32 random bits per position: a hash of the key and the position's global index."""
    idx, big = index
    if not big:
        return _mix_(idx ^ _mix(key))
    h = _mix_((idx & _M32) ^ _mix(key))
    return _mix_(h.bitwise_xor_((idx >> 32) ^ _mix(key ^ 0x5BD1E995)))


def _keep(index: tuple[torch.Tensor, bool], key: int, p: float) -> torch.Tensor:
    """Bernoulli(1 - p) in integers: 32 bits against p's threshold (p resolved to 2**-32)."""
    return _hash(index, key) >= math.ceil(p * 2.0 ** 32)


_SIGNIFICAND = {torch.float64: 53, torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}


def _uniform(index: tuple[torch.Tensor, bool], key: int, dtype: torch.dtype) -> torch.Tensor:
    """U[0, 1) with as many bits as ``dtype``'s significand holds (53 in float64), never 1."""
    a = _hash(index, key)
    mant = _SIGNIFICAND.get(dtype, 53)
    if mant > 32:
        b = _mix_(a ^ 0x27D4EB2F)
        bits = (a << (mant - 32)).bitwise_or_(b >> (64 - mant))
        return bits.to(torch.float64) * 2.0 ** -mant
    return ((a >> (32 - mant)).to(torch.float64) * 2.0 ** -mant).to(dtype)


def _normal(idx: tuple[torch.Tensor, bool], key: int, dtype: torch.dtype) -> torch.Tensor:
    u1 = _uniform(idx, key, torch.float64)
    u2 = _uniform(idx, _mix(key ^ 0x3C6EF372), torch.float64)
    return (torch.sqrt(-2.0 * torch.log1p(-u1)) * torch.cos(2.0 * math.pi * u2)).to(dtype)


# -- where a tensor sits in the image ----------------------------------------------------------------
Locate = Callable[[torch.Tensor], tuple[Sequence[int], Sequence[int]]]
"""A tensor's size as one process sees it, and the offset of this shard's block in it."""


def _whole(t: torch.Tensor) -> tuple[Sequence[int], Sequence[int]]:
    return tuple(t.shape), (0,) * t.dim()


def shard_locator(mode: RuleContext) -> Locate:
    def locate(t: torch.Tensor):
        shape = global_shape(t)
        if shape is None:
            return _whole(t)
        full = tuple(global_size(t, mode.dims))
        offsets = [0] * t.dim()
        box = shard_box(shape, mode.executor.grid, mode.executor.coord)
        for d, (a, _) in zip(mode.layout(t), box):
            offsets[d % t.dim()] = a
        return full, offsets

    return locate


def _draw_like(t: torch.Tensor, locate: Locate, key: int, law: Callable, dtype=None) -> torch.Tensor:
    full, offsets = locate(t)
    return law(_index(full, offsets, t.shape, t.device), key, dtype or t.dtype)


# -- the draws ----------------------------------------------------------------------------------------
_FEATURE_DIMS = {"dropout1d": 1, "dropout2d": 2, "dropout3d": 3}


def _keep_mask(x: torch.Tensor, p: float, name: str, locate: Locate, key: int) -> torch.Tensor:
    """Bernoulli(1 - p) per element, or for feature dropout per (batch, channel), broadcast over positions."""
    spatial = _FEATURE_DIMS.get(name, x.dim() - 2) if name in _FEATURE_DIMS or name == "feature_alpha_dropout" else 0
    if not spatial:
        full, offsets = locate(x)
        return _keep(_index(full, offsets, x.shape, x.device), key, p)
    # The mask covers the leading (batch, channel) dims, which are never split over the grid.
    lead = tuple(x.shape[: x.dim() - spatial])
    keep = _keep(_index(lead, (0,) * len(lead), lead, x.device), key, p)
    return keep.reshape(*lead, *([1] * spatial))


def dropout(func, args, kwargs, locate: Locate, key_source: KeySource) -> torch.Tensor:
    name = func.__name__
    b = bind(("input", "p", "training", "inplace"), args, kwargs)
    x, p, training, inplace = b["input"], float(b.get("p", 0.5)), b.get("training", True), b.get("inplace", False)
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if not training or p == 0.0:
        return x if inplace else x.view_as(x)
    keep = _keep_mask(x, p, name, locate, key_source.next_key()).to(x.dtype)
    if name in ("alpha_dropout", "feature_alpha_dropout"):
        # torch's formula: (x * keep + alpha' * (1 - keep)) * a + b, with SELU's alpha' = -lambda * alpha
        alpha = -1.7580993408473766
        a = ((1 - p) * (1 + p * alpha ** 2)) ** -0.5
        drop = alpha * (1 - keep)
        if inplace:
            return x.mul_(keep).add_(drop).mul_(a).add_(-a * alpha * p)
        return (x * keep + drop) * a + (-a * alpha * p)
    scale = keep / (1.0 - p) if p < 1.0 else keep
    return x.mul_(scale) if inplace else x * scale


def draw(func, args, kwargs, locate: Locate, draws: KeySource) -> torch.Tensor:
    """``bernoulli(_)``, ``uniform_``, ``normal_``, ``rand(n)_like``: the values at this block's positions."""
    name = func.__name__
    key = draws.next_key()
    x = args[0] if args else kwargs["input"]
    if name == "bernoulli":  # torch.bernoulli(probs) / probs.bernoulli(p=None)
        b = bind(("input", "p"), args, kwargs)
        p = b.get("p")
        probs = x if p is None or isinstance(p, torch.Generator) else p
        u = _draw_like(x, locate, key, _uniform, torch.float64)
        probs = probs.to(torch.float64) if isinstance(probs, torch.Tensor) else probs
        return (u < probs).to(x.dtype)
    if name == "bernoulli_":
        b = bind(("input", "p"), args, kwargs)
        p = b.get("p", 0.5)
        p = p.to(torch.float64) if isinstance(p, torch.Tensor) else float(p)
        with torch.no_grad():
            return x.copy_(_draw_like(x, locate, key, _uniform, torch.float64) < p)
    if name == "uniform_":
        b = bind(("input", "from", "to"), args, kwargs)
        lo, hi = float(b.get("from", 0.0)), float(b.get("to", 1.0))
        with torch.no_grad():
            return x.copy_(_draw_like(x, locate, key, _uniform, torch.float64) * (hi - lo) + lo)
    if name == "normal_":
        b = bind(("input", "mean", "std"), args, kwargs)
        mean, std = float(b.get("mean", 0.0)), float(b.get("std", 1.0))
        with torch.no_grad():
            return x.copy_(_draw_like(x, locate, key, _normal, torch.float64) * std + mean)
    law = _normal if name == "randn_like" else _uniform
    dtype = kwargs.get("dtype") or x.dtype
    device = kwargs.get("device") or x.device
    template = torch.empty(x.shape, dtype=dtype, device=device)
    full, offsets = locate(x)
    out = law(_index(full, offsets, x.shape, template.device), key, dtype)
    if kwargs.get("requires_grad"):
        out.requires_grad_(True)
    return out


def factory(func, args, kwargs, size: Sequence[int], full: Sequence[int], offsets: Sequence[int],
            draws: KeySource) -> torch.Tensor:
    """``torch.rand(size)`` / ``torch.randn(size)``: ``size`` is this block's, ``full`` the whole draw's."""
    dtype = kwargs.get("dtype") or torch.get_default_dtype()
    device = kwargs.get("device")
    device = torch.empty(0, device=device).device if device is not None else torch.empty(0).device
    law = _normal if func.__name__ == "randn" else _uniform
    out = law(_index(full, offsets, size, device), draws.next_key(), dtype)
    return out.requires_grad_(True) if kwargs.get("requires_grad") else out


def _sizes(args, kwargs) -> list[int]:
    rest = [a for a in args if not isinstance(a, torch.Generator)]
    if len(rest) == 1 and isinstance(rest[0], (list, tuple, torch.Size)):
        return list(rest[0])
    return list(rest) if rest else list(kwargs.get("size", ()))


_REFUSED = """randint randint_like randperm multinomial normal poisson exponential_ geometric_ cauchy_ log_normal_
random_""".split()

DROPOUTS = (F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout)
DRAWS = (torch.bernoulli, torch.Tensor.bernoulli, torch.Tensor.bernoulli_, torch.Tensor.uniform_,
         torch.Tensor.normal_, torch.rand_like, torch.randn_like)
FACTORIES = (torch.rand, torch.randn)
REFUSED = tuple(f for o in (torch, torch.Tensor, F) for n in _REFUSED if (f := getattr(o, n, None)) is not None)
_ALL = frozenset(DROPOUTS + DRAWS + FACTORIES)
DRAWING = _ALL
"""Every function drawn through bigconv's consistent generator."""


# -- under ShardMode -----------------------------------------------------------------------------------
def _dropout_rule(mode: RuleContext, func, args, kwargs, replicated: bool = False):
    x = bind(("input",), args, kwargs)["input"]
    if func.__name__ != "dropout" and global_shape(x) is not None and mode.layout(x) != trailing(mode.dims):
        raise mode.unsupported(func, "its per-channel mask needs the spatial dims last",
                               "Permute back to (N, C, *spatial) first")
    out = dropout(func, args, kwargs, shard_locator(mode), mode.random)
    if global_shape(x) is not None:
        return mark(out, global_shape(x), mode.layout(x))
    return mode.after_replicated(out) if replicated else out


def _draw_rule(mode: RuleContext, func, args, kwargs, replicated: bool = False):
    out = draw(func, args, kwargs, shard_locator(mode), mode.random)
    x = args[0] if args else kwargs["input"]
    if global_shape(x) is not None and global_shape(out) is None:
        mark(out, global_shape(x), mode.layout(x))
    return out


def _factory_rule(mode: RuleContext, func, args, kwargs, replicated: bool = False):
    size = _sizes(args, kwargs)
    d = mode.dims
    kwargs = {k: v for k, v in kwargs.items() if k not in ("size", "generator")}
    if len(size) > d and tuple(size[-d:]) in mode.known:
        shape = tuple(size[-d:])
        box = shard_box(shape, mode.executor.grid, mode.executor.coord)
        local = [*size[:-d], *(b - a for a, b in box)]
        offsets = [0] * (len(size) - d) + [a for a, _ in box]
        return mark(factory(func, args, kwargs, local, size, offsets, mode.random), shape)
    return factory(func, args, kwargs, size, size, [0] * len(size), mode.random)


def _refused(mode: RuleContext, func, args, kwargs, replicated: bool = False):
    raise mode.unsupported(func, "each worker would draw its own values, unlike a single process's one draw",
                           "Draw with torch.rand/randn/bernoulli/dropout (bigconv draws those consistently on "
                           "every shard), or draw outside the model and pass the values in")


RRELUS = tuple(f for f in (F.rrelu, getattr(F, "rrelu_", None), torch.rrelu, getattr(torch, "rrelu_", None)) if f)


def _rrelu_rule(mode: RuleContext, func, args, kwargs, replicated: bool = False):
    """RReLU: in eval mode a fixed slope (pointwise); in training mode a slope drawn per element with
    torch's generator, which each worker would draw for itself."""
    b = bind(("input", "lower", "upper", "training"), args, kwargs)
    if b.get("training", False):
        raise mode.unsupported(func, "in training mode it draws a slope per element, which each worker would draw "
                               "for itself", "Use nn.LeakyReLU, or RReLU in eval mode (its mean slope)")
    if global_shape(b["input"]) is not None:
        return pointwise(mode, func, args, kwargs)
    out = func(*args, **kwargs)
    return mode.after_replicated(out) if replicated else out


def _register() -> None:
    for f in DROPOUTS:
        RULES[f] = WHOLE_RULES[f] = _dropout_rule
    for f in DRAWS:
        RULES[f] = WHOLE_RULES[f] = _draw_rule
    for f in FACTORIES:
        WHOLE_RULES[f] = _factory_rule
    for f in REFUSED:
        RULES[f] = WHOLE_RULES[f] = _refused
    for f in RRELUS:
        RULES[f] = WHOLE_RULES[f] = _rrelu_rule
    LAYOUT_AWARE.update(RULES)


_register()


# -- one process ----------------------------------------------------------------------------------------
class ConsistentRandom(TorchFunctionMode):
    """One forward in one process, drawing what the shards of a parallelized model draw."""

    def __init__(self, draws: ForwardDraws) -> None:
        super().__init__()
        self.draws = draws

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _ALL:
            return func(*args, **kwargs)
        if func in DROPOUTS:
            return dropout(func, args, kwargs, _whole, self.draws)
        if func in DRAWS:
            return draw(func, args, kwargs, _whole, self.draws)
        if func in FACTORIES:
            size = _sizes(args, kwargs)
            kwargs = {k: v for k, v in kwargs.items() if k not in ("size", "generator")}
            return factory(func, args, kwargs, size, size, [0] * len(size), self.draws)
        return func(*args, **kwargs)  # randint, randperm...: torch's generator (refused on shards)
