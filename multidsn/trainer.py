"""One interface for training and inspecting a DSN in one process or across a World, so that the CLI and
the benchmark run both the same way: ``step(batch) -> LossTerms``, ``predict``, ``codes``, ``state_dict``."""

from __future__ import annotations

import torch

from bigconv import saving

from .batch import Batch
from .model import DSN, LossTerms
from .parallel import DistributedDSN, parallelize


class LocalDSN:
    """A DSN and its optimizer in this process, counting steps from 0 like ``DistributedDSN``.

    ``device``: where the model lives (``"cuda"`` trains a single-process DSN on a GPU). Batches and the
    images given to ``predict``/``codes`` may be on the host: they are moved there, and the answers come
    back on the host."""

    def __init__(self, dsn: DSN, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.dsn, self.cfg, self.steps = dsn.to(self.device), dsn.cfg, 0
        self.opt: torch.optim.Optimizer | None = None

    def optimizer(self, cls: type, **kwargs) -> None:
        self.opt = cls(self.dsn.parameters(), **kwargs)

    def train_step_terms(self, batch: Batch) -> LossTerms:
        if self.opt is None:
            raise ValueError("call optimizer(torch.optim.SGD, lr=...) before train_step")
        self.opt.zero_grad(set_to_none=True)
        terms = self.dsn.loss_terms(batch.to(self.device), self.steps)
        terms.total.backward()
        self.opt.step()
        self.steps += 1
        return terms.detached()

    def set_lr(self, lr: float) -> None:
        """Set the optimizer's learning rate (a schedule's step), as ``DistributedDSN.set_lr`` does on workers."""
        for group in self.opt.param_groups:
            group["lr"] = lr

    @torch.no_grad()
    def predict(self, x: torch.Tensor, domain: int = 0, batch_size: int = 256) -> torch.Tensor:
        dtype = next(self.dsn.parameters()).dtype
        return torch.cat([self.dsn(c.to(self.device, dtype)).cpu() for c in torch.split(x, batch_size)])

    @torch.no_grad()
    def codes(self, x: torch.Tensor, domain: int) -> tuple[torch.Tensor, torch.Tensor]:
        h_c, h_p = self.dsn.codes(x.to(self.device, next(self.dsn.parameters()).dtype), domain)
        return h_c.cpu(), h_p.cpu()

    def state_dict(self) -> dict:
        return self.dsn.state_dict()

    def save(self, path, extra: dict | None = None) -> str:
        """The same file ``DistributedDSN.save`` writes, so a run can move between placements."""
        ck = saving.checkpoint(self.dsn.state_dict(), self.opt.state_dict() if self.opt is not None else None,
                               saving.class_name(type(self.opt)) if self.opt is not None else None, self.steps,
                               extra=extra or {})
        return saving.atomic_save(ck, path)

    def load(self, path) -> dict:
        path = str(path)
        ck = saving.read(path)
        saving.check_model_state(ck["model"], self.dsn.state_dict(), path)
        saving.check_optimizer_state(ck.get("optimizer"), ck.get("optimizer_class"),
                                     [len(list(self.dsn.parameters()))],
                                     saving.class_name(type(self.opt)) if self.opt is not None else None, path)
        self.dsn.load_state_dict(ck["model"])
        if ck.get("optimizer") is not None:
            self.opt.load_state_dict(ck["optimizer"])
        self.steps = int(ck.get("step", 0))
        torch.set_rng_state(ck["rng"]["driver"])
        return ck.get("extra", {})

    def close(self) -> None:
        pass


def make_trainer(dsn: DSN, world=None, placement: str = "single", decoder: str = "domain",
                 head: str = "separate", device: str = "cpu") -> LocalDSN | DistributedDSN:
    """``placement="single"``: in this process, on ``device``; otherwise ``multidsn.parallelize`` on ``world``
    (whose workers hold the model: ``device`` must be ``"cpu"`` there)."""
    if placement == "single":
        return LocalDSN(dsn, device)
    if torch.device(device).type != "cpu":
        raise ValueError(f"device={device!r} is for placement='single'; a distributed placement's workers hold "
                         f"the model")
    if world is None:
        raise ValueError(f"placement={placement!r} needs a bigconv.World")
    return parallelize(dsn, world, placement=placement, decoder=decoder, head=head)
