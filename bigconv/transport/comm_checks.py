"""NCCL's rules, enforced on gloo: test modes that make the CPU suite fail where NCCL would hang.

NCCL runs every operation of one communicator on one stream, in the order the rank issued it, and
matches point-to-point messages between a pair in posting order (it has no tags). Gloo runs
collectives on threads and matches messages by tag, so a program that issues its collectives and
point-to-point batches in a rank-dependent order passes on gloo and deadlocks on NCCL. Two modes,
chosen by ``BIGCONV_COMM_CHECKS`` (comma-separated), read where a world is created and handed down
as configuration:

- ``order``: every rank records, per process group, the sequence of collectives and point-to-point
  batches it issues; ``order_mismatches`` compares, for every pair of ranks of a group, what each
  issued that involves the other. Collectives involve every member; a batch involves the peers it
  sends to or receives from, and is described by the shapes going each way, so both sides of one
  batch describe it alike.
- ``tag_free``: every message goes with tag 0, so gloo matches messages per pair in posting order,
  as NCCL does; an exchange posted out of order then delivers the wrong tensor (a shape error or a
  wrong result), never a silent pass.
"""

from __future__ import annotations

import functools
import os
import threading
from dataclasses import dataclass
from typing import Mapping

import torch.distributed as dist

ENV = "BIGCONV_COMM_CHECKS"
MODES = ("order", "tag_free")


@dataclass(frozen=True)
class CommChecks:
    order: bool = False
    tag_free: bool = False

    @classmethod
    def parse(cls, text: str | None) -> "CommChecks":
        names = {n.strip() for n in (text or "").split(",") if n.strip()}
        unknown = names - set(MODES)
        if unknown:
            raise ValueError(f"{ENV} takes a comma-separated subset of {', '.join(MODES)}; got {sorted(unknown)}")
        return cls(order="order" in names, tag_free="tag_free" in names)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "CommChecks":
        return cls.parse((os.environ if env is None else env).get(ENV))

    def text(self) -> str:
        return ",".join(m for m in MODES if getattr(self, m))


COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "broadcast",
               "broadcast_object_list", "barrier", "reduce", "reduce_scatter", "reduce_scatter_tensor",
               "gather", "gather_object", "scatter", "scatter_object_list", "all_to_all")
"""Public ``torch.distributed`` collectives the recorder wraps (the ones torch calls inside these, through
its own module, are not seen twice)."""


def _group_key(group) -> tuple[str, tuple[int, ...]]:
    group = group if group is not None else dist.group.WORLD
    return group.group_name, tuple(dist.get_process_group_ranks(group))


def _describe(value) -> tuple:
    shape = getattr(value, "shape", None)
    if shape is not None:
        return (tuple(shape), str(value.dtype))
    if isinstance(value, (list, tuple)):
        return tuple(_describe(v) for v in value)
    return ()


def _described(name: str, value) -> tuple:
    """A collective's first argument as both sides of it see it. An object collective's list holds the
    source's objects on one rank and placeholders on the others (NCCL sends their pickled sizes, then
    the bytes): only its length is common to every rank."""
    if name.endswith(("_object", "_object_list")):
        return (len(value),) if isinstance(value, (list, tuple)) else ()
    return _describe(value)


class OrderRecorder:
    """Records this process's collectives and point-to-point batches, per group, in issue order.

    Entries: ``(group name, group ranks, kind, detail)``; for a batch, ``detail`` maps each peer to
    (shapes sent to it, shapes received from it), in posting order.
    """

    def __init__(self) -> None:
        self.entries: list[tuple] = []
        self._lock = threading.Lock()
        self._saved: dict[str, object] = {}

    def install(self) -> "OrderRecorder":
        for name in COLLECTIVES:
            real = getattr(dist, name)
            self._saved[name] = real
            setattr(dist, name, self._collective(name, real))
        self._saved["batch_isend_irecv"] = dist.batch_isend_irecv
        setattr(dist, "batch_isend_irecv", self._batch(dist.batch_isend_irecv))
        return self

    def uninstall(self) -> None:
        for name, real in self._saved.items():
            setattr(dist, name, real)
        self._saved.clear()

    def _collective(self, name, real):
        @functools.wraps(real)
        def recorded(*args, **kwargs):
            group = kwargs.get("group")
            detail = _described(name, args[0]) if args and name != "barrier" else ()
            with self._lock:
                self.entries.append((*_group_key(group), name, detail))
            return real(*args, **kwargs)
        return recorded

    def _batch(self, real):
        @functools.wraps(real)
        def recorded(ops):
            me = dist.get_rank()
            per_peer: dict[int, tuple[list, list]] = {}
            for op in ops:
                sent, received = per_peer.setdefault(op.peer, ([], []))
                (sent if op.op is dist.isend else received).append(tuple(op.tensor.shape))
            detail = {peer: (tuple(s), tuple(r)) for peer, (s, r) in per_peer.items() if peer != me}
            if ops:
                with self._lock:
                    self.entries.append((*_group_key(ops[0].group), "p2p", detail))
            return real(ops)
        return recorded

    def take(self) -> list[tuple]:
        """The entries so far, cleared."""
        with self._lock:
            out, self.entries = self.entries, []
        return out


def _projection(entries: list[tuple], me: int, peer: int, group: str) -> list[tuple]:
    """What ``me`` issued in ``group`` that involves ``peer``, described alike on both sides: a batch by
    (shapes lower rank → higher rank, shapes higher → lower)."""
    out = []
    for name, _ranks, kind, detail in entries:
        if name != group:
            continue
        if kind != "p2p":
            out.append((kind, detail))
        elif peer in detail:
            sent, received = detail[peer]
            out.append(("p2p", sent, received) if me < peer else ("p2p", received, sent))
    return out


def order_mismatches(logs: Mapping[int, list[tuple]]) -> list[str]:
    """For every group and every pair of its ranks (global ranks, keys of ``logs``), where the two issued
    what involves each other in different orders; empty when NCCL would run the sequence."""
    groups: dict[str, tuple[int, ...]] = {}
    for entries in logs.values():
        for name, ranks, _kind, _detail in entries:
            groups[name] = ranks
    problems = []
    for name, ranks in sorted(groups.items()):
        members = [r for r in ranks if r in logs]
        for i, a in enumerate(members):
            for b in members[i + 1:]:
                pa, pb = _projection(logs[a], a, b, name), _projection(logs[b], b, a, name)
                if pa != pb:
                    at = next((k for k, (x, y) in enumerate(zip(pa, pb)) if x != y), min(len(pa), len(pb)))
                    problems.append(
                        f"group {name} (ranks {list(ranks)}): ranks {a} and {b} differ at their operation {at}: "
                        f"rank {a} issued {pa[at:at + 3]}, rank {b} issued {pb[at:at + 3]}")
    return problems
