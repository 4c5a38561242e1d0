"""Activation checkpointing inside a sharded forward, exact, as users already write it.

``torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)`` keeps the forward's graph and,
in backward, runs ``block`` again to rebuild the tensors it saved. On a worker that recompute runs
on an autograd thread, outside the ``ShardMode`` of the forward, where a convolution would see a
bare shard with no halos, and every other shard is busy with its own backward: asking them for
halos again could deadlock.

So on bigconv's workers ``torch.utils.checkpoint.checkpoint`` is this module's ``checkpoint``
(``install`` runs before any model is unpickled, so ``from torch.utils.checkpoint import
checkpoint`` in timm or MONAI binds it too). Inside a sharded forward it runs PyTorch's own
non-reentrant checkpoint with a ``context_fn`` pair: the forward records every message the block
receives; the recompute runs the block under a ``ShardMode`` whose executor replays them and sends
nothing. The block is deterministic on the same inputs, so the recompute rebuilds exactly the
saved tensors of the first forward, and gradients flow through the first forward's graph,
messages included, as without checkpointing. Received halos are kept until the block's backward:
a small fraction of the activations the checkpoint frees.

``use_reentrant=True`` (PyTorch's default when unspecified) builds no graph in forward, so halo
gradients could not reach the other shards; it runs as the non-reentrant variant, which gives a
single process's gradients, except when no input requires grad, where reentrant checkpointing gives
the block's parameters no gradient: then the block runs without a graph, as it would there.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint

from .executor import ShardExecutor
from ..ops.shards import tree_flatten
from ..ops.mode import ShardMode, active_mode
from ..transport import WorkerFailure, numbered

_ORIGINAL = torch_checkpoint.checkpoint


class ReplayLink:
    """Answers a recompute's exchanges from what its forward received, and sends nothing."""

    def __init__(self, cache: dict) -> None:
        self.cache = cache

    def start(self, x: torch.Tensor, key: tuple, sends, recvs):
        return x, [key + peer for peer in numbered([src for src, _ in recvs])]

    def finish(self, keys: list, describe: str) -> list[torch.Tensor]:
        try:
            return [self.cache[k] for k in keys]
        except KeyError:
            raise WorkerFailure(
                f"recomputing a checkpointed block asked for {describe}, which its forward never received: the "
                "block is not deterministic; checkpoint only blocks that compute the same thing twice") from None


class ReplayExecutor(ShardExecutor):
    """A forward's executor that answers from what that forward received, and sends nothing."""

    def __init__(self, base: ShardExecutor, start: int, cache: dict) -> None:
        self.__dict__.update(base.__dict__)
        self.exchange, self.recorders, self.link = start, [], ReplayLink(cache)
        self.replica_link = self.link


@contextlib.contextmanager
def _recording(executor: ShardExecutor, cache: dict, inner):
    executor.recorders.append(cache)
    try:
        with inner:
            yield
    finally:
        executor.recorders.remove(cache)


@contextlib.contextmanager
def _replaying(mode: ShardMode, start: int, cache: dict, known: set, draws, inner):
    with ShardMode(ReplayExecutor(mode.executor, start, cache), mode.path, known, draws.fork()), inner:
        yield


def checkpoint(function, *args, use_reentrant: bool | None = None, context_fn=torch_checkpoint.noop_context_fn,
               determinism_check: str = torch_checkpoint._DEFAULT_DETERMINISM_MODE, debug: bool = False,
               **kwargs: Any):
    """``torch.utils.checkpoint.checkpoint``, exact on sharded tensors; PyTorch's own elsewhere."""
    mode = active_mode()
    if mode is None or not isinstance(mode.executor, ShardExecutor):
        return _ORIGINAL(function, *args, use_reentrant=use_reentrant, context_fn=context_fn,
                         determinism_check=determinism_check, debug=debug, **kwargs)
    if use_reentrant is not False and not any(isinstance(t, torch.Tensor) and t.requires_grad
                                              for t in tree_flatten(args)[0]):
        with torch.no_grad():
            return function(*args, **{k: v for k, v in kwargs.items() if k != "preserve_rng_state"})
    executor, cache, start, known = mode.executor, {}, mode.executor.exchange, set(mode.known)
    draws = mode.random.fork()  # the recompute draws the forward's dropout masks again

    def contexts():
        user_forward, user_recompute = context_fn()
        return _recording(executor, cache, user_forward), _replaying(mode, start, cache, known, draws, user_recompute)

    return _ORIGINAL(function, *args, use_reentrant=False, context_fn=contexts, determinism_check=determinism_check,
                     debug=debug, **kwargs)


def install() -> None:
    """Route ``torch.utils.checkpoint.checkpoint`` through ``checkpoint`` in this (worker) process."""
    torch_checkpoint.checkpoint = checkpoint
