"""``multidsn.parallelize``: a ``DSN`` trained across the workers of a ``bigconv.World``, exactly.

One step, as DESIGN.md prescribes: the driver opens one distributed-autograd context; every remote
forward runs inside it (codes travel worker -> driver -> worker, carrying their autograd edges); the
driver adds the loss parts with the reference's own ``combine``, calls backward once, and every worker
then sums replicated gradients over its group and steps its optimizer inside that context.
Which worker holds what is ``multidsn.placement``'s business.
"""

from __future__ import annotations

import itertools
import pickle
import weakref
from typing import Sequence

import torch

from bigconv import World, saving

from .remote import DsnPart
from .batch import Batch
from .model import DSN, LossTerms, combine
from .placement import Placement
from .waiting import launch, wait_named

try:
    import cloudpickle
except ImportError:  # classes must then be importable on the workers
    cloudpickle = None



class DistributedDSN:
    """A DSN whose parts live on workers; same training API as ``bigconv.parallelize``."""

    def __init__(self, dsn: DSN, world: World, placement: str = "domain", decoder: str = "domain",
                 head: str = "separate") -> None:
        if not isinstance(dsn, DSN):
            raise ValueError(f"parallelize expects a multidsn.DSN, got {type(dsn).__name__}")
        if not isinstance(world, World):
            raise ValueError(f"parallelize expects a bigconv.World, got {type(world).__name__}")
        cfg = dsn.cfg
        self.plan = Placement(placement, decoder, head, cfg.num_domains, dsn.domain_classifier is not None)
        need = self.plan.workers_needed
        if world.workers < need:
            raise ValueError(
                f"placement={placement!r} (head={head!r}) with {cfg.num_targets} target domain(s) needs {need} "
                f"workers but the World has {world.workers}; start bigconv.World(workers={need}) or use "
                f"placement='domain' / head='source', which need fewer")
        dtypes = {p.dtype for p in dsn.parameters()}
        if len(dtypes) != 1:
            raise ValueError(f"every DSN parameter must share one dtype, found {sorted(map(str, dtypes))}")
        world.check_usable()
        self.cfg, self.world, self.dtype = cfg, world, dtypes.pop()
        self.steps = 0
        self.has_optimizer = False
        self._calls = itertools.count(1)
        self._names = list(dsn.state_dict())
        self._meta_state = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in dsn.state_dict().items()}
        self._param_names = [n for n, _ in dsn.named_parameters()]
        self.optimizer_class: str | None = None
        modules = dict(dsn.named_modules())
        dumps = (cloudpickle or pickle).dumps
        args = []
        for w in range(world.workers):
            names = self.plan.modules(w) if w < need else []
            payload = dumps({n: modules[n] for n in names}) if names else None
            args.append((cfg, payload, self.plan.groups()))
        self.id = world.install(DsnPart.install, args, "installing the DSN parts")
        self._finalizer = weakref.finalize(self, world.retire, self.id)  # the parts go with this object

    @property
    def workers(self) -> list[int]:
        """The workers this model uses; the rest of the World stays idle."""
        return list(range(self.plan.workers_needed))

    # -- training API ------------------------------------------------------------------------------
    def optimizer(self, cls: type, **kwargs) -> None:
        """Create ``cls(params, **kwargs)`` on every worker over the parameters it holds (an elementwise
        optimizer such as SGD or Adam then steps exactly as one over all parameters would)."""
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            raise ValueError(f"optimizer expects a torch.optim.Optimizer class such as torch.optim.SGD, got {cls!r}")
        self._all("make_optimizer", lambda w: (cls, kwargs), "creating the optimizer")
        self.has_optimizer = True
        self.optimizer_class = saving.class_name(cls)

    def train_step(self, batch: Batch) -> float:
        """One forward, backward and optimizer step; returns the loss. Steps are counted from 0."""
        return float(self.train_step_terms(batch).total)

    def train_step_terms(self, batch: Batch) -> LossTerms:
        """``train_step`` returning the loss parts as well (detached)."""
        if not self.has_optimizer:
            raise ValueError("call net.optimizer(torch.optim.SGD, lr=...) before train_step")
        if not isinstance(batch, Batch):
            raise ValueError(f"train_step expects a multidsn.Batch, got {type(batch).__name__}")
        batch.check(self.cfg)
        images = [x.detach().to(self.dtype) for x in batch.images]
        labels = batch.labels.detach().long()
        step, call = self.steps, next(self._calls)
        what = f"step {step}"
        with self.world.autograd_context() as ctx:
            if self.cfg.adapting(step) and not self.cfg.separating:
                terms, took_part = self._similarity_forward(call, step, images, labels, what)
            elif self.cfg.adapting(step):
                terms, took_part = self._adapting_forward(call, step, images, labels, what)
            else:
                terms, took_part = self._warmup_forward(call, step, images[0], labels, what)
            self.world.backward(ctx, terms.total, f"backward of {what}")
            futures = [launch(self.world, w, self.id, "step", ctx, w in took_part) for w in self.workers]
            wait_named(self.world, futures, f"optimizer {what}")
        self.steps += 1
        return terms.detached()

    def _warmup_forward(self, call: int, step: int, x_s: torch.Tensor, labels: torch.Tensor, what: str):
        p = self.plan
        (h_c,) = wait_named(self.world, [launch(self.world, p.shared_worker(0), self.id, "encode", call, 0,
                                                "shared", x_s, False)], f"source encoder of {what}")
        (head, _), = wait_named(self.world, [launch(self.world, p.head_worker, self.id, "head", step, [h_c],
                                                     labels, None)], f"head of {what}")
        return combine(self.cfg, head, [], []), {p.shared_worker(0), p.head_worker}

    def _similarity_forward(self, call: int, step: int, images: list[torch.Tensor], labels: torch.Tensor, what: str):
        """alpha = beta = 0 (DANN or MMD alone): every domain's shared code, then the head; the private encoders
        and decoders sit out (their parameters get no gradient, as in one process)."""
        p, world = self.plan, self.world
        shared = wait_named(world, [launch(world, p.shared_worker(d), self.id, "encode", call, d, "shared",
                                           images[d], False) for d in range(self.cfg.num_domains)],
                            f"shared encoders of {what}")
        (head, _), = wait_named(world, [launch(world, p.head_worker, self.id, "head", step, shared, labels,
                                                None)], f"head of {what}")
        took_part = {p.shared_worker(d) for d in range(self.cfg.num_domains)} | {p.head_worker}
        return combine(self.cfg, head, [], []), took_part

    def set_lr(self, lr: float) -> None:
        """Set the learning rate of every worker's optimizer (a schedule's step)."""
        self._all("set_lr", lambda w: (lr,), "setting the learning rate")

    def _adapting_forward(self, call: int, step: int, images: list[torch.Tensor], labels: torch.Tensor, what: str):
        p, world, D = self.plan, self.world, self.cfg.num_domains
        local = p.decoder_local
        if p.kind == "domain":
            sep = wait_named(world, [launch(world, p.private_worker(d), self.id, "separate", call, d, images[d],
                                            None, local, True, not local) for d in range(D)],
                             f"domain forwards of {what}")
            shared = [s[0] for s in sep]
        else:
            # Private encoders start at once and keep their codes; shared codes come back to be routed.
            futures = [launch(world, p.shared_worker(d), self.id, "encode", call, d, "shared", images[d], False)
                       for d in range(D)]
            futures += [launch(world, p.private_worker(d), self.id, "encode", call, d, "private", images[d], True)
                        for d in range(D)]
            shared = wait_named(world, futures, f"encoders of {what}")[:D]
            futures = [launch(world, p.private_worker(d), self.id, "separate", call, d, images[d], shared[d],
                              local, False, not local) for d in range(D)]
            if local:  # the head needs nothing from the separation step: run it alongside
                futures.append(launch(world, p.head_worker, self.id, "head", step, shared, labels, None))
            results = wait_named(world, futures, f"separation losses of {what}")
            sep = results[:D]
            if local:
                return self._combine(sep, results[D]), set(self.workers)
        head_input = None if local else [(images[d], sep[d][1]) for d in range(D)]
        (head,) = wait_named(world, [launch(world, p.head_worker, self.id, "head", step, shared, labels,
                                            head_input)], f"head of {what}")
        return self._combine(sep, head), set(self.workers)

    def _combine(self, sep: Sequence[tuple], head: tuple) -> LossTerms:
        head_terms, head_recon = head
        if self.plan.decoder_local:
            recon = [s[2][0] for s in sep]
        else:
            recon = [head_recon[d] for d in range(len(sep))]
        difference = [s[2][-1] for s in sep]
        return combine(self.cfg, head_terms, recon, difference)

    # -- inference -----------------------------------------------------------------------------------
    def predict(self, x_NCHW: torch.Tensor, domain: int = 0, batch_size: int = 256) -> torch.Tensor:
        """Class logits G(E_c(x)) of images, no gradients. ``domain`` picks the shared replica that runs."""
        self._check_images(x_NCHW, domain)
        p, out = self.plan, []
        for chunk in torch.split(x_NCHW.detach().to(self.dtype), batch_size):
            (code,) = wait_named(self.world, [launch(self.world, p.shared_worker(domain), self.id, "encode", 0,
                                                     domain, "shared", chunk, False, False)], "inference")
            (logits,) = wait_named(self.world, [launch(self.world, p.head_worker, self.id, "classify", code)],
                                   "inference")
            out.append(logits)
        return torch.cat(out)

    def codes(self, x_NCHW: torch.Tensor, domain: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(shared, private) codes of a domain's images, no gradients (e.g. to detect collapse)."""
        self._check_images(x_NCHW, domain)
        p, x = self.plan, x_NCHW.detach().to(self.dtype)
        futures = [launch(self.world, p.shared_worker(domain), self.id, "encode", 0, domain, "shared", x,
                          False, False),
                   launch(self.world, p.private_worker(domain), self.id, "encode", 0, domain, "private", x,
                          False, False)]
        h_c, h_p = wait_named(self.world, futures, "computing codes")
        return h_c, h_p

    def _check_images(self, x: torch.Tensor, domain: int) -> None:
        if not (isinstance(domain, int) and 0 <= domain < self.cfg.num_domains):
            raise ValueError(f"domain must be 0 (source) .. {self.cfg.num_targets}, got {domain!r}")
        want = (self.cfg.channels, self.cfg.image_size, self.cfg.image_size)
        if not isinstance(x, torch.Tensor) or x.dim() != 4 or tuple(x.shape[1:]) != want:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"images have shape {shape}; the model expects (N, {want[0]}, {want[1]}, {want[2]})")

    # -- state -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer under the names of ``DSN.state_dict()``, from the first holder of each."""
        merged: dict[str, torch.Tensor] = {}
        for sd in self.replica_state_dicts():
            for k, v in sd.items():
                merged.setdefault(k, v)
        return {k: merged[k] for k in self._names}

    def replica_state_dicts(self) -> list[dict[str, torch.Tensor]]:
        """Each used worker's own weights (replicas included), in worker order, to check they agree."""
        futures = [launch(self.world, w, self.id, "state_dict") for w in self.workers]
        return wait_named(self.world, futures, "reading weights")

    def save(self, path, extra: dict | None = None) -> str:
        """One atomic file in the single-process layout: ``DSN.load_state_dict(ck["model"])`` and a plain
        optimizer over ``dsn.parameters()`` take ``ck["optimizer"]`` (see ``bigconv.saving``)."""
        parts = self._all("checkpoint_state", lambda w: (), "saving a checkpoint")
        model: dict = {}
        for part in parts:
            for k, v in part["model"].items():
                model.setdefault(k, v)
        optimizer = None
        if parts[0]["optimizer"] is not None:
            state: dict = {}
            for part in parts:  # the first holder of a replicated parameter; replicas are equal
                for name, st in part["optimizer"]["state"].items():
                    state.setdefault(self._param_names.index(name), st)
            optimizer = {"state": dict(sorted(state.items())),
                         "param_groups": [{**parts[0]["optimizer"]["group"],
                                           "params": list(range(len(self._param_names)))}]}
        ck = saving.checkpoint({k: model[k] for k in self._names}, optimizer, self.optimizer_class, self.steps,
                               workers=self.world.workers, extra=extra or {})
        return saving.atomic_save(ck, path)

    def load(self, path) -> dict:
        """Restore what ``save`` (or a single-process ``LocalDSN.save``) wrote; returns the file's
        ``extra``. Every check runs before any worker changes."""
        path = str(path)
        ck = saving.read(path)
        saving.check_model_state(ck["model"], self._meta_state, path)
        saving.check_optimizer_state(ck.get("optimizer"), ck.get("optimizer_class"), [len(self._param_names)],
                                     self.optimizer_class, path)
        self._all("load_checkpoint", lambda w: (ck["model"], ck.get("optimizer"), self._param_names),
                  "loading a checkpoint")
        self.steps = int(ck.get("step", 0))
        torch.set_rng_state(ck["rng"]["driver"])
        return ck.get("extra", {})

    def close(self) -> None:
        """Free this model's parts on the workers (the World stays up for other models)."""
        if self._finalizer.detach() and not self.world.broken and not self.world.closed:
            self.world.uninstall([self.id])

    def _all(self, method: str, args_of, what: str) -> list:
        return wait_named(self.world, [launch(self.world, w, self.id, method, *args_of(w)) for w in self.workers], what)


def parallelize(dsn: DSN, world: World, placement: str = "domain", decoder: str = "domain",
                head: str = "separate") -> DistributedDSN:
    """Spread ``dsn`` over ``world`` (see ``multidsn.placement`` for the layouts). Its weights are copied:
    ``dsn`` itself is untouched. A World larger than needed leaves its extra workers idle."""
    return DistributedDSN(dsn, world, placement, decoder, head)
