"""What this session selected, for fixtures that run many cases in one spawn.

A module-scoped fixture that spawns ranks once and runs every case of its module in them runs only the cases
the session selected (the README's fast tier, ``-m slow``, ``-k``, one node id): each case a test of the
module names in its ``name`` parameter. Without this, the fast tier would pay for the slow cases' runs and
``-m slow`` for the fast ones'."""

from __future__ import annotations


def selected(request, argname: str = "name") -> list:
    """The values of ``argname`` among the session's selected tests of the requesting fixture's module, in
    collection order, each once."""
    seen: dict = {}
    for item in request.session.items:
        spec = getattr(item, "callspec", None)
        if getattr(item, "module", None) is request.module and spec is not None and argname in spec.params:
            seen.setdefault(spec.params[argname], None)
    return list(seen)
