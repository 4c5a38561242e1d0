"""A clean run prints nothing but its own lines: no shutdown noise, no torch deprecation warnings.

A newcomer who sees `RPC agent ... encountered error` or a `UserWarning` after the demo reads that
it failed. A worker that really fails must still be reported (tests/test_failures.py).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = """
import torch, bigconv
from bigconv.models import CNN2D
for workers in (2, 1):  # a second World in the same process, after the first is closed
    with bigconv.World(workers=workers) as world:
        net = bigconv.parallelize(CNN2D(1, 2), world)
        net.optimizer(torch.optim.SGD, lr=0.1)
        net.train_step(torch.randn(1, 1, 16, 16), torch.tensor([1]), torch.nn.CrossEntropyLoss())
print("done")
"""


@pytest.mark.timeout(180)
def test_a_clean_run_prints_only_its_own_lines():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    env.pop("TORCH_CPP_LOG_LEVEL", None)  # as a user's shell has it
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=170, env=env)
    assert run.returncode == 0, run.stderr
    assert run.stdout == "done\n"
    assert run.stderr == "", f"unexpected console output:\n{run.stderr}"
