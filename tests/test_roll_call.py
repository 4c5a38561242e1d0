"""The roll call that names a rank lost in a collective (``bigconv.transport.roll_call``), on a store faked in
process: who is named when a rank never answers, and when the store's host (rank 0) ends while others wait."""

from __future__ import annotations

import torch.distributed as dist

from bigconv.transport.roll_call import RollCall


class FakeStore(dist.Store):
    """A key-value store whose ``check`` raises once ``alive()`` turns false (rank 0's process has ended)."""

    def __init__(self, alive=lambda: True) -> None:
        super().__init__()
        self.keys: dict = {}
        self.alive = alive

    def set(self, key, value):
        if not self.alive():
            raise RuntimeError("Connection closed by peer")
        self.keys[key] = value

    def check(self, keys):
        if not self.alive():
            raise RuntimeError("Failed to recv, got 0 bytes")
        return all(k in self.keys for k in keys)


def test_the_rank_that_never_answers_is_named():
    store = FakeStore()
    RollCall(store, 0, 3).missing(0.0)  # rank 0 answers its first roll call and moves on
    assert RollCall(store, 2, 3).missing(0.2) == [1]


def test_rank_0_ending_after_it_answered_is_not_named():
    """Rank 0 hosts the store: once its own roll call is over it may exit before rank 2's wait ends. Rank 2
    saw its answer, so rank 1 (never seen) is the one gone, not rank 0 (seen failing before the fix: [0])."""
    checks = {"n": 0}

    def alive() -> bool:
        checks["n"] += 1
        return checks["n"] <= 3  # rank 0's answer and rank 2's first poll, then the store is gone

    store = FakeStore(alive)
    store.keys["bigconv-roll-call/1/0"] = "here"  # rank 0's answer to this failure's roll call
    assert RollCall(store, 2, 3).missing(5.0) == [1]


def test_an_unreachable_store_before_rank_0_answered_names_rank_0():
    store = FakeStore(lambda: False)
    assert RollCall(store, 2, 3).missing(1.0) == [0]
