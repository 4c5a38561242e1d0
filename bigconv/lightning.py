"""``BigconvStrategy``: a Lightning ``Trainer`` trains an unchanged ``LightningModule`` on a spatial grid.

Built on the SPMD mode's native loop (``bigconv.spmd``; ``lightning`` is an optional extra:
``pip install bigconv[lightning]``). Every process of the ``Trainer`` is an SPMD rank; the strategy
opens the ranks' ``SpmdWorld`` (the process group) and replaces the LightningModule's network
(the attribute ``module``, ``"model"`` by default) with ``bigconv.parallelize`` of it. From then on:

- the sampler splits the data over **replicas** only: the ranks of one replica's spatial grid get the
  same batch, and the network returns the replica's whole output (its shards gathered, this rank's
  part carrying gradient), so ``training_step`` computes its loss as it would on one process;
- backward sums every rank's part in buckets (the native loop); the strategy divides the loss by the
  number of replicas first, so the gradient is the average over replicas of their batches' gradients,
  as DDP gives: with equal batches, one process's gradient on all of them;
- ``reduce``, ``all_gather`` and ``barrier`` run over every rank (a value logged with
  ``sync_dist=True`` is the same on the ranks of a replica, so the mean over ranks is the mean over
  replicas); checkpoints hold the plain model's keys (the parallel module shares the network's
  parameter tables); precision plugins run the forward under autocast as on one process;
- checkpoints also hold the random draws' seed and forward count (``checkpoint["bigconv"]["draws"]``,
  ``SpmdModel.draws_state``), and a resumed ``fit(ckpt_path=)`` restores it on every rank, so dropout and
  drop path draw the masks the run that never stopped draws; the sanity check's forwards leave the count
  as they found it, as Lightning's ``isolate_rng`` leaves torch's generator.
"""

from __future__ import annotations

import os
import warnings
from contextlib import contextmanager
from typing import Any, Generator, Mapping

import torch

try:
    import lightning.pytorch as pl
    from lightning.fabric.utilities.seed import reset_seed
    from lightning.pytorch.strategies import DDPStrategy
    from lightning.pytorch.trainer.states import TrainerFn
except ImportError as exc:  # pragma: no cover - the extra is missing
    raise ImportError("bigconv.lightning needs Lightning: pip install 'bigconv[lightning]' (or lightning>=2.2)") from exc

from .ops.random import drawing_modules, draws_problem
from .parallel import parallelize
from .runtime.spmd_world import SpmdWorld


class BigconvStrategy(DDPStrategy):
    """``Trainer(strategy=BigconvStrategy(grid=(2, 2), replicas=R), devices=N)`` with ``N = prod(grid) * R``
    (see the module doc). ``module``: the LightningModule's attribute holding the network to decompose.
    ``timeout``: of every wait between ranks, in seconds (``World.from_env``'s)."""

    strategy_name = "bigconv"

    def __init__(self, grid: tuple[int, ...], replicas: int = 1, module: str = "model", timeout: float = 300.0,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not isinstance(module, str):
            raise ValueError(f"module must name the LightningModule's attribute holding the network, got {module!r}")
        self.grid, self.replicas, self.module_name, self.bigconv_timeout = tuple(grid), replicas, module, timeout
        self.world: SpmdWorld | None = None
        self.net = None
        self._draws_to_restore: dict | None = None  # a checkpoint's, read before the network is decomposed
        self._draws_before_sanity: dict | None = None

    # -- ranks and data ---------------------------------------------------------------------------------
    @property
    def spatial(self) -> int:
        return max(1, self.world_size // self.replicas)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """The data is split over replicas only: the ranks of one grid see the same batch."""
        return {"num_replicas": self.replicas, "rank": self.global_rank // self.spatial}

    def process_dataloader(self, dataloader: object) -> object:
        """A loader the ranks of one grid iterate each on its own (``Trainer(use_distributed_sampler=False)``, or a
        loader Lightning leaves alone) must give them the same batches: a ``RandomSampler`` drawing from each
        rank's own global generator is refused, before any step, with the fix."""
        sampler = getattr(dataloader, "sampler", None)
        if isinstance(sampler, torch.utils.data.RandomSampler) and sampler.generator is None and self.spatial > 1:
            raise ValueError(
                "a DataLoader with shuffle=True and no generator reaches BigconvStrategy's ranks unchanged "
                "(use_distributed_sampler=False): each of the grid's ranks would draw its own order from its own "
                "global generator, and ranks that must see one batch could see different ones. Give the loader a "
                "generator seeded alike on every rank (DataLoader(..., shuffle=True, "
                "generator=torch.Generator().manual_seed(0))), or leave use_distributed_sampler on (Lightning's "
                "DistributedSampler, seeded alike on every rank)")
        return super().process_dataloader(dataloader)

    def setup_distributed(self) -> None:
        """The ranks' ``SpmdWorld`` is the process group (bigconv's groups, ports and timeouts)."""
        reset_seed()
        self.set_world_ranks()
        if self.world_size % self.replicas:
            raise ValueError(f"replicas={self.replicas} does not divide the Trainer's {self.world_size} processes "
                             "(devices × num_nodes); prod(grid) * replicas must equal it")
        env = self.cluster_environment
        info = {"RANK": str(self.global_rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(self.local_rank),
                "LOCAL_WORLD_SIZE": str(self.num_processes), "MASTER_ADDR": env.main_address,
                "MASTER_PORT": str(env.main_port)}
        device = "cuda" if self.root_device.type == "cuda" else "cpu"
        self.world = SpmdWorld.from_env(device=device, timeout=self.bigconv_timeout, env={**os.environ, **info})

    # -- the model --------------------------------------------------------------------------------------
    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._decompose()
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self.setup_optimizers(trainer)  # after the swap: the optimizer holds the network's own parameters
        self.setup_precision_plugin()

    def _decompose(self) -> None:
        lm = self.lightning_module
        inner = getattr(lm, self.module_name, None)
        if not isinstance(inner, torch.nn.Module):
            raise ValueError(f"BigconvStrategy decomposes the LightningModule's network at .{self.module_name}, but "
                             f"{type(lm).__name__} has no module there; pass module='<attribute name>'")
        if self.net is None or inner is not self.net:
            self.net = parallelize(inner, self.world, grid=self.grid, replicas=self.replicas)
            self.net.replica_batches = True
            setattr(lm, self.module_name, self.net)
        if self._draws_to_restore is not None:
            self.net.load_draws_state(self._draws_to_restore)
            self._draws_to_restore = None

    # -- checkpoints: the random draws' state -------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        """Lightning's checkpoint and ``"bigconv": {"draws": net.draws_state()}``: the forward count a resumed
        run needs to draw the masks the run that never stopped draws (equal on every rank; rank 0 writes)."""
        if self.net is not None:
            checkpoint = {**checkpoint, "bigconv": {"draws": self.net.draws_state()}}
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """The weights (Lightning's), then the random draws' state: on the parallel network when it exists, else
        (``fit(ckpt_path=)`` restores before ``setup``) once ``setup`` has decomposed it. A checkpoint without
        the entry (written without this strategy, or by an older bigconv) loads as before, with a warning when
        the network holds dropout-like modules; a malformed entry is a ``ValueError`` before anything loads."""
        draws = (checkpoint.get("bigconv") or {}).get("draws")
        path = getattr(self.lightning_module.trainer, "ckpt_path", None)
        if draws is not None and draws_problem(draws) is not None:
            raise ValueError(f"the Lightning checkpoint {path!r} has a malformed ['bigconv']['draws'] entry "
                             f"{draws!r}: {draws_problem(draws)}; use a checkpoint BigconvStrategy wrote")
        super().load_model_state_dict(checkpoint, strict=strict)
        if draws is None:
            drawing = drawing_modules(getattr(self.lightning_module, self.module_name, self.lightning_module))
            if drawing:
                warnings.warn(f"the Lightning checkpoint {path!r} holds no bigconv random draws' state (written without "
                              f"BigconvStrategy or by an older bigconv): the network's random draws "
                              f"({', '.join(drawing[:3])}{', ...' if len(drawing) > 3 else ''}) go on from this run's "
                              "own forward count (a new Trainer's: forward 1), not from where the saved run stopped",
                              stacklevel=2)
            return
        if self.net is not None:
            self.net.load_draws_state(dict(draws))
        else:
            self._draws_to_restore = dict(draws)

    def on_validation_start(self) -> None:
        """The sanity check's forwards count no draws (Lightning runs it under ``isolate_rng``): a resumed
        fit, which runs it again, draws as the run that never stopped."""
        super().on_validation_start()
        if self.net is not None and self.lightning_module.trainer.sanity_checking:
            self._draws_before_sanity = self.net.draws_state()

    def on_validation_end(self) -> None:
        if self._draws_before_sanity is not None:
            self.net.load_draws_state(self._draws_before_sanity)
            self._draws_before_sanity = None
        super().on_validation_end()

    def configure_ddp(self) -> None:  # no DDP wrapper: the parallel network sums the gradients itself
        pass

    @contextmanager
    def block_backward_sync(self) -> Generator:
        """Lightning's gradient accumulation: the micro-batches but the last accumulate unsummed."""
        if self.net is None:
            yield
            return
        with self.net.no_sync():
            yield

    def backward(self, closure_loss: torch.Tensor, optimizer, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The replicas' average, as DDP (the network sums every rank's part)."""
        return super().backward(closure_loss / self.replicas, optimizer, *args, **kwargs)

    def teardown(self) -> None:
        super().teardown()
        if self.world is not None:
            self.world.close()
            self.world = None
