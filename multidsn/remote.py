"""Worker side of ``multidsn.parallelize``: the part of one DSN a worker holds.

A ``DsnPart`` is installed on every worker's host (``bigconv.runtime.host``) by ``World.install``; the
driver calls its methods by name (``World.launch_part``). Gradients are read from the driver's
distributed-autograd context and **summed** over the holders of a replicated module (in one process,
the shared encoder's gradient is the sum of every domain's contribution).
"""

from __future__ import annotations

import pickle
import threading
import warnings

import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
import torch.nn as nn

from bigconv import saving
from bigconv.engine.buckets import GradBuckets

from .config import DSNConfig
from .model import head_terms, reconstruction_term, separation_terms


class DsnPart:
    """The modules of one DSN that this worker holds, by ``DSN.state_dict`` prefix."""

    def __init__(self, host, cfg: DSNConfig, modules: dict[str, nn.Module], groups: dict[str, object]) -> None:
        self.name, self.device = host.name, host.rt.device
        self.cfg = cfg
        self.modules = {name: m.to(self.device) for name, m in modules.items()}
        self.groups = groups
        # Replicated modules' gradients are summed by bigconv's own gradient buckets, as the shards' are.
        self.sums = {name: GradBuckets(list(self.modules[name].parameters()), group, host.rt.timeout)
                     for name, group in groups.items() if name in self.modules}
        self.optimizer: torch.optim.Optimizer | None = None
        self.stash: dict[tuple[int, int], torch.Tensor] = {}
        self.lock = threading.Lock()

    @classmethod
    def install(cls, host, cfg: DSNConfig, payload: bytes | None, group_ranks: dict[str, list[int]]):
        """This worker's part (None when it holds no module). Called on every worker: creating a process
        group is collective over the whole default group, so idle workers take part in it too (in the
        same order)."""
        mine = {}
        for name in sorted(group_ranks):
            with warnings.catch_warnings():  # torch's own deprecation notice about its internal gloo wrapper
                warnings.simplefilter("ignore", UserWarning)
                group = dist.new_group(group_ranks[name])
            if host.rt.index in group_ranks[name]:
                mine[name] = group
        return cls(host, cfg, pickle.loads(payload), mine) if payload is not None else None

    def module(self, name: str) -> nn.Module:
        if name not in self.modules:
            raise RuntimeError(f"{self.name} does not hold {name}; it holds {sorted(self.modules)}")
        return self.modules[name]

    def parameters(self) -> list[nn.Parameter]:
        return [p for name in sorted(self.modules) for p in self.modules[name].parameters()]

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """This part's parameters under their ``DSN`` names, in the order its optimizer holds them."""
        return [(f"{name}.{k}", v) for name in sorted(self.modules) for k, v in self.modules[name].named_parameters()]

    def keep(self, call: int, domain: int, code: torch.Tensor) -> None:
        with self.lock:
            for key in [k for k in self.stash if k[0] < call]:  # leftovers of a failed earlier step
                del self.stash[key]
            self.stash[(call, domain)] = code

    def take(self, call: int, domain: int) -> torch.Tensor | None:
        with self.lock:
            return self.stash.pop((call, domain), None)

    # -- what the driver calls ----------------------------------------------------------------------
    def encode(self, call: int, domain: int, which: str, x: torch.Tensor, keep: bool, grad: bool = True):
        """The shared or private code of ``x`` (a domain's batch). ``keep`` stores it here for a later
        ``separate`` of the same step instead of sending it (the private code never leaves its worker)."""
        name = "shared_encoder" if which == "shared" else f"private_encoders.{domain}"
        with torch.set_grad_enabled(grad):
            code = self.module(name)(x.to(self.device))
        if keep:
            self.keep(call, domain, code)
            return None
        return code.cpu()

    def separate(self, call: int, domain: int, x: torch.Tensor, shared_code: torch.Tensor | None,
                 decoder_here: bool, give_shared: bool, give_private: bool):
        """One domain's separation losses: (shared code or None, private code or None, terms).

        ``terms`` is [recon, difference] with the decoder here, else [difference]. The shared code is made
        here when not given; the private code comes from this step's ``encode(keep=True)`` or is made here.
        Codes are returned only when another worker consumes them (an unused send would stall FAST-mode
        distributed autograd).
        """
        x = x.to(self.device)
        h_c = self.module("shared_encoder")(x) if shared_code is None else shared_code.to(self.device)
        h_p = self.take(call, domain)
        if h_p is None:
            h_p = self.module(f"private_encoders.{domain}")(x)
        terms = separation_terms(self.cfg, x, h_c, h_p, self.module("decoder") if decoder_here else None)
        return (h_c.cpu() if give_shared else None, h_p.cpu() if give_private else None, terms.cpu())

    def head(self, step: int, shared_codes: list[torch.Tensor], labels: torch.Tensor,
             reconstruct: list[tuple[torch.Tensor, torch.Tensor]] | None):
        """(head terms [task] or [task, similarity], reconstruction losses per domain or None) at training
        ``step`` (it sets DANN's gradient reversal factor).

        ``reconstruct`` holds (images, private code) per domain when the decoder lives here."""
        codes = [c.to(self.device) for c in shared_codes]
        dc = self.modules.get("domain_classifier")
        out = head_terms(self.cfg, self.module("classifier"), dc, codes, labels.to(self.device), step)
        recon = None
        if reconstruct is not None:
            decoder = self.module("decoder")
            recon = torch.stack([reconstruction_term(x.to(self.device), h_c, h_p.to(self.device), decoder)
                                 for (x, h_p), h_c in zip(reconstruct, codes)]).cpu()
        return out.cpu(), recon

    def classify(self, shared_codes: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.module("classifier")(shared_codes.to(self.device)).cpu()

    def step(self, context_id: int, took_part: bool) -> None:
        if self.optimizer is None:
            raise RuntimeError("no optimizer: call net.optimizer(torch.optim.SGD, lr=...) before train_step")
        grads = dist_autograd.get_gradients(context_id) if took_part else {}
        for name in sorted(self.modules):
            params = list(self.modules[name].parameters())
            if name in self.sums:
                self.sums[name].reduce(grads)
            else:
                for p in params:
                    p.grad = grads[p].clone() if p in grads else None
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def make_optimizer(self, cls, kwargs: dict) -> None:
        self.optimizer = cls(self.parameters(), **kwargs)

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"{name}.{k}": v.detach().cpu().clone()
                for name in sorted(self.modules) for k, v in self.modules[name].state_dict().items()}

    def checkpoint_state(self) -> dict:
        """Weights, and optimizer state by parameter name (the driver renumbers it as one optimizer would)."""
        out = {"model": self.state_dict(), "optimizer": None}
        if self.optimizer is not None:
            sd = self.optimizer.state_dict()
            names = [n for n, _ in self.named_parameters()]
            hyper = {k: v for k, v in sd["param_groups"][0].items() if k != "params"}
            out["optimizer"] = {"state": {names[i]: saving.to_cpu(st) for i, st in sd["state"].items()},
                                "group": hyper}
        return out

    def load_checkpoint(self, model_state: dict, optimizer_state: dict | None, param_names: list[str]) -> None:
        """Take this part's weights and optimizer state out of a single-process checkpoint."""
        for name in sorted(self.modules):
            prefix = name + "."
            self.modules[name].load_state_dict({k[len(prefix):]: v for k, v in model_state.items()
                                                if k.startswith(prefix)})
        if optimizer_state is not None:
            index = {n: i for i, n in enumerate(param_names)}
            local = [index[n] for n, _ in self.named_parameters()]
            group = {k: v for k, v in optimizer_state["param_groups"][0].items() if k != "params"}
            state = {j: optimizer_state["state"][i] for j, i in enumerate(local) if i in optimizer_state["state"]}
            self.optimizer.load_state_dict({"state": state, "param_groups": [{**group, "params": list(range(len(local)))}]})
