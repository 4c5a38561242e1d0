"""After a collective failed: which ranks are still there. Names the dead or stalled rank for errors.

A collective (the gradient allreduce above all) involves every rank, so its failure says only that
*some* rank is gone: gloo reports a closed connection, NCCL a timeout. Each survivor then answers a
roll call in the job's store and waits a bounded time for the others; the ranks that never answer
died or are stuck outside the library (a stalled rank's thread is busy elsewhere, so it cannot
answer either). The store lives on rank 0: when it cannot be reached, rank 0 is the one gone.
"""

from __future__ import annotations

import time

import torch.distributed as dist

POLL_S = 0.05


class RollCall:
    """Roll calls of one job over ``store``, numbered: every survivor of a failure makes its n-th call
    for the n-th failure it saw, so the keys of one failure never meet an earlier one's."""

    def __init__(self, store, rank: int, size: int) -> None:
        self.store, self.rank, self.size = store, rank, size
        self.calls = 0

    def missing(self, wait_s: float) -> list[int]:
        """The ranks that did not answer within ``wait_s`` (this rank answers at once)."""
        self.calls += 1
        store = dist.PrefixStore(f"bigconv-roll-call/{self.calls}", self.store)
        seen = {self.rank}
        try:
            store.set(str(self.rank), "here")
            deadline = time.monotonic() + wait_s
            while True:
                seen |= {r for r in range(self.size) if r not in seen and store.check([str(r)])}
                gone = [r for r in range(self.size) if r not in seen]
                if not gone or time.monotonic() >= deadline:
                    return gone
                time.sleep(POLL_S)
        except Exception:  # noqa: BLE001 - the store's host (rank 0) is unreachable
            # Rank 0 answered and then ended (its own roll call over, its process exiting takes the store
            # with it): the ones gone are those not seen by then. Otherwise rank 0 is the one gone.
            return [r for r in range(self.size) if r not in seen] if 0 in seen else [0]

    def describe(self, wait_s: float) -> str:
        """A sentence for an error message: who did not answer."""
        gone = self.missing(wait_s)
        if not gone:
            return "every rank answered a roll call after it (a rank failed there and recovered?)"
        names = ", ".join(f"rank {r}" for r in gone)
        return (f"{names} did not answer a roll call within {wait_s:g}s after it: died, stalled, or still "
                "waiting in an earlier exchange")
