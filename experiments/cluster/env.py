"""Shell ``export`` lines for the workers' runtime settings, for launch scripts to ``eval``.

    eval "$(python -m experiments.cluster.env)"

A local ``World`` gives its workers ``bigconv.runtime.world.WORKER_ENV`` itself; processes started by
torchrun, srun or jsrun get only the environment of the script, and glibc and MKL read these
variables when the process starts. Variables already set are left alone, as a local World does.
"""

from __future__ import annotations

import os
import shlex

from bigconv.runtime.world import WORKER_ENV


def export_lines(env: dict[str, str] | None = None) -> list[str]:
    env = os.environ if env is None else env
    return [f"export {key}={shlex.quote(value)}" for key, value in WORKER_ENV.items() if key not in env]


if __name__ == "__main__":
    print("\n".join(export_lines()))
