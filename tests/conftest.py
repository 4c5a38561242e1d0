"""Shared fixtures: one live World at a time, reused across tests.

A process can hold only one RPC agent, and starting workers costs seconds on 2 cores, so tests
declare the world size they need with ``@pytest.mark.world(n)``; tests are ordered by that size
and the manager restarts the World only when the size changes.

Worlds run on the CPU whatever the host has (a GPU host would otherwise turn the suite into NCCL runs).
``BIGCONV_COMM_CHECKS`` (``order``, ``tag_free`` or both, see ``bigconv.transport.comm_checks``) runs the
suite under NCCL's rules: the worlds read it when they are made; under ``order`` every test that used the
shared World then checks that its workers issued their collectives and batches in one order.
"""

from __future__ import annotations

import os

import pytest
import torch

import bigconv
from bigconv.transport.comm_checks import CommChecks

from tiers import FAST, fast_match

WORLD_TIMEOUT_S = 60.0
CHECKS = CommChecks.from_env()


class WorldManager:
    def __init__(self) -> None:
        self.world: bigconv.World | None = None

    def get(self, workers: int) -> bigconv.World:
        w = self.world
        if w is not None and (w.workers != workers or w.broken):
            self.close()
        if self.world is None:
            self.world = bigconv.World(workers=workers, timeout=WORLD_TIMEOUT_S, device="cpu", comm_checks=CHECKS)
        return self.world

    def close(self) -> None:
        if self.world is not None:
            self.world.close()
            self.world = None


def pytest_addoption(parser):
    parser.addoption("--capability", default=None, metavar="WORDS",
                     help="run only the fast tier's tests of the capabilities (tests/tiers.py) whose title holds "
                          "WORDS, e.g. --capability attention")


def pytest_configure(config):
    config.addinivalue_line("markers", "world(n): the test needs a shared World of n workers")
    config.addinivalue_line("markers", "own_world: the test starts its own World (the shared one is closed first)")
    config.addinivalue_line("markers", "soak: repeated end-to-end runs that catch rare failures (minutes; .ci/run runs them)")
    config.addinivalue_line("markers", "slow: beyond the README's ten-minute tier (.ci/run runs it after the README's test command)")
    config.addinivalue_line("markers", "zoo: the full model zoo beyond the fast subset (pytest -m zoo; .ci/run runs it after the README's test command)")


def _order(item) -> tuple:
    marker = item.get_closest_marker("world")
    if item.get_closest_marker("own_world"):
        return (2, 0)
    return (1, marker.args[0]) if marker else (0, 0)


def _tier_entry(item) -> str | None:
    nodeid = item.nodeid.split("tests/", 1)[-1] if item.nodeid.startswith("tests/") else item.nodeid
    return fast_match(nodeid)


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects: the tier is a marker like any other
def pytest_collection_modifyitems(session, config, items):
    """Every test not in ``tiers.FAST`` is ``slow``; a FAST entry that names no test fails the session (a
    renamed test would otherwise leave its capability out of the fast tier unseen)."""
    unused = set(p for group in FAST.values() for p in group)
    both = []
    for item in items:
        hit = _tier_entry(item)
        if hit is None:
            item.add_marker(pytest.mark.slow)
        else:
            unused.discard(hit)
            if not hit.endswith(".py") and any(item.get_closest_marker(m) for m in ("slow", "zoo", "soak")):
                both.append(item.nodeid)
    wanted = config.getoption("capability")
    if wanted:
        groups = [title for title in FAST if wanted.lower() in title.lower()]
        if not groups:
            raise pytest.UsageError(f"--capability {wanted!r} names none of tests/tiers.py's capabilities: "
                                    + "; ".join(FAST))
        keep = {entry for title in groups for entry in FAST[title]}
        fast = [item for item in items if _tier_entry(item) in keep
                and not any(item.get_closest_marker(m) for m in ("slow", "zoo", "soak"))]
        config.hook.pytest_deselected(items=[item for item in items if item not in fast])
        items[:] = fast
    if both:
        raise pytest.UsageError(f"tests/tiers.py's FAST names tests marked slow, zoo or soak: {both[:5]}")
    whole = not config.args or [os.path.normpath(a) for a in config.args] == ["tests"]
    if whole and unused and not any(config.getoption(o) for o in ("keyword", "deselect", "ignore")):
        raise pytest.UsageError(f"tests/tiers.py's FAST names tests that do not exist: {sorted(unused)}")
    items.sort(key=_order)  # stable: keeps file order within a world size


@pytest.fixture(scope="session")
def world_manager():
    manager = WorldManager()
    yield manager
    manager.close()


@pytest.fixture
def world(request, world_manager) -> bigconv.World:
    marker = request.node.get_closest_marker("world")
    if marker is None:
        raise RuntimeError("a test using the `world` fixture needs @pytest.mark.world(n)")
    world = world_manager.get(marker.args[0])
    if CHECKS.order:
        world.comm_order_mismatches()  # start from this test's own traffic
    yield world
    if CHECKS.order and not world.broken and not world.closed:
        problems = world.comm_order_mismatches()
        assert not problems, "the workers issued their communication in orders NCCL cannot run:\n" + \
            "\n".join(problems)


@pytest.fixture
def exclusive(world_manager):
    """For tests that start their own World: close the shared one first."""
    world_manager.close()
    yield


@pytest.fixture
def rpc_calls(monkeypatch) -> list:
    """Every ``rpc.rpc_async`` the test makes from here on: a check that claims to run before any
    remote work asserts this stays empty."""
    import torch.distributed.rpc as rpc

    calls = []
    real = rpc.rpc_async

    def counting(*args, **kwargs):
        calls.append(args[:2])
        return real(*args, **kwargs)

    monkeypatch.setattr(rpc, "rpc_async", counting)
    return calls


@pytest.fixture
def refused_before_remote_work(world, monkeypatch):
    """``check(model, words)``: the first call of ``model`` parallelized on a (2, 2) grid raises a
    ValueError naming each of ``words``, and no remote work starts."""

    def check(model: torch.nn.Module, words, shape=(2, 1, 16, 16)) -> None:
        net = bigconv.parallelize(model.double(), world, grid=(2, 2))
        monkeypatch.setattr(net, "_launch", lambda *_: pytest.fail("remote work started"))
        with pytest.raises(ValueError) as info:
            net(torch.randn(shape, dtype=torch.float64))
        for word in words:
            assert word in str(info.value), info.value

    return check


@pytest.fixture(params=["p2p", "rpc"])
def transport(request) -> str:
    """The driver mode's two transports: a test that takes this runs on both."""
    return request.param


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
