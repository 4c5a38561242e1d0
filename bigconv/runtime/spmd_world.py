"""An SPMD world: one ``torch.distributed`` process group over every rank, and the rank mesh.

Ranks are laid out replica-major: rank ``r * S + s`` holds shard ``s`` of replica ``r``, so each
spatial group is a block of consecutive ranks (the ranks that exchange halos sit on one node when
the launcher fills nodes in order) and each data-parallel group takes one shard position from every
replica.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from . import launch_env, netbind
from .agent import WorldClosedError, pick_device
from ..transport import process_group_timeout
from ..transport.mesh import Mesh
from ..transport.roll_call import RollCall
from ..transport.comm_checks import CommChecks, OrderRecorder, order_mismatches

log = logging.getLogger(__name__)
STORE_PREFIX = "bigconv-spmd"


class SpmdWorld:
    """Every rank of a launched job, each calling the same code. Use as a context manager: leaving it
    destroys the process group, also after an exception (the other ranks then fail fast instead of
    waiting out their timeouts).

    ``checks`` (default: ``BIGCONV_COMM_CHECKS``) turns on the test modes of ``transport.comm_checks``."""

    mode = "spmd"

    def __init__(self, rank: int, size: int, local_rank: int, local_size: int, addr: str, port: int, *,
                 device: str = "auto", timeout: float = 300.0, ifname: str | None = None,
                 checks: CommChecks | str | None = None) -> None:
        if dist.is_initialized():
            raise ValueError("torch.distributed is already initialised in this process; bigconv's SPMD world "
                             "creates its own process group: call World.from_env(mode='spmd') before any "
                             "init_process_group, or destroy that group first")
        from ..engine.checkpointing import install

        install()  # torch.utils.checkpoint.checkpoint replays halos in its recompute (bigconv.engine.checkpointing)
        self.rank, self.size, self.local_rank = rank, size, local_rank
        self.timeout = float(timeout)
        self.checks = checks if isinstance(checks, CommChecks) else \
            CommChecks.from_env() if checks is None else CommChecks.parse(checks)
        self.device = pick_device(device, local_rank, local_size)  # before any process group
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.threads = max(1, (os.cpu_count() or 1) // max(1, local_size))
        self._closed = False
        self._meshes: dict[int, Mesh] = {}
        # Rank 0 hosts the store on the launch address only (never a wildcard); gloo binds where told.
        if rank == 0:
            self._store = netbind.host_store(addr, port, timeout)
        else:
            self._store = dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=timeout))
        # Gloo reads its interface at every group's creation: the mesh's groups, made later, bind there too.
        self.ifname = ifname or netbind.cluster_interface(addr)
        with netbind.bound_to(self.ifname):
            # NCCL for CUDA tensors, gloo for CPU ones: halos and gradients take the tensor's own path.
            backend = "cpu:gloo,cuda:nccl" if self.device.type == "cuda" else "gloo"
            dist.init_process_group(backend, store=dist.PrefixStore(STORE_PREFIX, self._store), rank=rank,
                                    world_size=size, timeout=process_group_timeout(self.device, timeout))
        self.recorder = OrderRecorder().install() if self.checks.order else None
        # The gradient sums get a communicator of their own: on the halos' one, a rank that only sends in a
        # one-sided exchange posts its gradient batch after a weight's allreduce and its peer before,
        # which NCCL (one stream per communicator) cannot run (transport.comm_checks records it).
        with netbind.bound_to(self.ifname):
            self.grad_group = dist.new_group(list(range(size)))
        self.roll_call = RollCall(dist.PrefixStore(STORE_PREFIX, self._store), rank, size)

    @classmethod
    def from_env(cls, *, device: str = "auto", timeout: float = 300.0, env=None) -> "SpmdWorld":
        info = launch_env.detect(env, min_size=1)
        netbind.check_launch_address(info.master_addr, env)
        return cls(info.rank, info.world_size, info.local_rank, info.local_world_size, info.master_addr, info.port,
                   device=device, timeout=timeout, ifname=netbind.cluster_interface(info.master_addr, env),
                   checks=CommChecks.from_env(env))

    @property
    def workers(self) -> int:
        return self.size

    @property
    def closed(self) -> bool:
        return self._closed

    def check_usable(self) -> None:
        if self._closed:
            raise WorldClosedError("this SPMD world is closed; open a new one with World.from_env(mode='spmd')")

    def mesh(self, replicas: int) -> Mesh:
        """The (replicas × size/replicas) mesh; every rank must ask for the same meshes in the same order
        (group creation is collective)."""
        if replicas not in self._meshes:
            spatial = self.size // replicas
            mine = None
            for r in range(replicas):  # every rank creates every group, in one order
                ranks = list(range(r * spatial, (r + 1) * spatial))
                group = self._new_group(ranks) if replicas > 1 else dist.group.WORLD
                if self.rank in ranks:
                    mine = (r, ranks, group)
            replica_group, replica_ranks = None, None
            for s in range(spatial):
                ranks = list(range(s, self.size, spatial))
                group = self._new_group(ranks) if spatial > 1 else dist.group.WORLD
                if self.rank % spatial == s:
                    replica_group, replica_ranks = group, tuple(ranks)
            r, ranks, group = mine
            self._warm_up(group)
            self._warm_up(replica_group)
            self._meshes[replicas] = Mesh(replicas, spatial, r, self.rank % spatial, tuple(ranks), group,
                                          replica_group, replica_ranks, self.roll_call)
        return self._meshes[replicas]

    def _new_group(self, ranks: list[int]):
        with netbind.bound_to(self.ifname):
            return dist.new_group(ranks)

    def _warm_up(self, group) -> None:
        # NCCL creates a communicator lazily, and its first batched point-to-point call must involve every
        # rank of the group; a collective first creates it with everyone present.
        t = torch.zeros(1, device=self.device)
        dist.all_reduce(t, group=group)

    def barrier(self) -> None:
        dist.barrier()

    def comm_order_mismatches(self) -> list[str]:
        """Under the ``order`` check: where the ranks issued their collectives and batches since the last
        call in orders NCCL could not run (empty when they agree); collective, so every rank calls it."""
        if self.recorder is None:
            raise ValueError("this world records no order; create it with checks='order' "
                             "(or BIGCONV_COMM_CHECKS=order)")
        mine = self.recorder.take()
        logs: list = [None] * self.size
        dist.all_gather_object(logs, mine)
        self.recorder.take()  # the gather itself
        return order_mismatches(dict(enumerate(logs)))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.recorder is not None:
            self.recorder.uninstall()
        try:
            dist.destroy_process_group()
        except Exception as exc:  # a failed teardown must not hide the error that led here
            log.warning("destroying the process group failed: %s", exc)

    def __enter__(self) -> "SpmdWorld":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SpmdWorld(rank={self.rank}, size={self.size}, device={self.device})"
