"""One configuration of any model in the harness's registry, the DSN included, measured in fresh processes.

    python -m experiments.runs '{"model": "dsn", "size": 64, "targets": 2, "workers": 3}'   # prints RECORD {...}

``bigconv.harness.runner`` runs bigconv's models; the DSN's run is ``multidsn.bench.run_config``, a layer
above the harness. This module, above both, hands it to the runner: sweeps, size searches and cluster
runs call ``run_fresh`` and ``run_here`` here.
"""

from __future__ import annotations

from bigconv.harness import runner
from bigconv.harness.runner import RunConfig
from multidsn.bench import run_config

TASKS = {"dsn": run_config}
"""The registry's tasks whose runs live above the harness."""
ENTRY = "experiments.runs"


def run_here(cfg: RunConfig, world=None) -> dict:
    """``bigconv.harness.runner.run_here`` with the DSN's run."""
    return runner.run_here(cfg, world, TASKS)


def run_fresh(cfg: RunConfig, extra_env: dict | None = None) -> dict:
    """``bigconv.harness.runner.run_fresh``, in a process that runs this module (so the DSN's run too)."""
    return runner.run_fresh(cfg, extra_env, entry=ENTRY)


if __name__ == "__main__":
    runner.main(TASKS)
