"""The cluster scripts, run here with their launchers emulated on one host.

torchrun is real; ``srun`` and ``jsrun`` are shims that start the requested number of local
processes with the variables SLURM or jsrun would set (``SLURM_PROCID``..., ``JSM_NAMESPACE_*`` and
an LSF rank file whose first line is the launch node). Each script must bring up a world through
``World.from_env()`` and leave one record naming its launcher. A failure points at the script, the
entry point ``experiments.cluster.run`` or the launcher parsing of ``bigconv.runtime.launch_env``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from bigconv.harness import records

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SRUN = r'''#!/usr/bin/env bash
# srun shim: srun --ntasks=K [opts] CMD...
K=1; while [[ "$1" == --* ]]; do case "$1" in --ntasks=*) K=${1#--ntasks=};; esac; shift; done
pids=(); for ((i=0;i<K;i++)); do
  SLURM_PROCID=$i SLURM_NTASKS=$K SLURM_LOCALID=$i SLURM_NODELIST=localhost SLURM_TASKS_PER_NODE=$K "$@" & pids+=($!)
done; rc=0; for p in "${pids[@]}"; do wait $p || rc=$?; done; exit $rc
'''

JSRUN = r'''#!/usr/bin/env bash
# jsrun shim: jsrun --nrs K [resource-set opts] CMD...
K=1; while [[ "$1" == --* ]]; do case "$1" in --nrs) K=$2; shift 2;; *) shift 2;; esac; done
printf 'batch1\nlocalhost\n' > "$RANKFILE"
pids=(); for ((i=0;i<K;i++)); do
  JSM_NAMESPACE_RANK=$i JSM_NAMESPACE_SIZE=$K JSM_NAMESPACE_LOCAL_RANK=$i JSM_NAMESPACE_LOCAL_SIZE=$K \
  LSB_DJOB_RANKFILE=$RANKFILE "$@" & pids+=($!)
done; rc=0; for p in "${pids[@]}"; do wait $p || rc=$?; done; exit $rc
'''


@pytest.mark.own_world
@pytest.mark.timeout(240)
@pytest.mark.parametrize("script,launcher", [("torchrun_node.sh", "torchrun"), ("slurm.sbatch", "slurm"),
                                             ("summit_lsf.sh", "lsf")])
def test_cluster_script(exclusive, tmp_path, script, launcher):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", SRUN), ("jsrun", JSRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    out = tmp_path / "r.jsonl"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
           "PYTHON": sys.executable, "WORKERS": "1", "MODEL": "cnn2d", "SIZES": "32", "DEVICE": "cpu",
           "PLAIN": "1" if launcher == "slurm" else "0", "OUT": str(out), "RANKFILE": str(tmp_path / "ranks"),
           "SLURM_SUBMIT_DIR": ROOT, "LS_SUBCWD": ROOT, "SLURM_NTASKS": "2",
           "MASTER_PORT": str(29600 + 7 * ["torchrun", "slurm", "lsf"].index(launcher)), "PORT": "29650"}
    run = subprocess.run(["bash", os.path.join(ROOT, "experiments", "cluster", script)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=220)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    recs = records.load(str(out))
    world = [r for r in recs if r["workers"] == 1]
    assert len(world) == 1 and world[0]["status"] == "ok" and world[0]["launcher"] == launcher, recs
    assert world[0]["grid"] == [1, 1]
    if launcher == "slurm":
        assert [r["workers"] for r in recs] == [0, 1] and recs[0]["launcher"] == "none"


def test_launch_scripts_export_the_worker_env():
    """Launched workers get WORKER_ENV from the script (a local World sets it itself); set values win."""
    from bigconv.runtime.world import WORKER_ENV
    from experiments.cluster.env import export_lines

    assert export_lines({}) == [f"export {k}={v}" for k, v in WORKER_ENV.items()]
    assert not any(line.startswith("export MKL_DISABLE_FAST_MM=") for line in export_lines({"MKL_DISABLE_FAST_MM": ""}))
    for script in ("torchrun_node.sh", "slurm.sbatch", "summit_lsf.sh"):
        with open(os.path.join(ROOT, "experiments", "cluster", script)) as fh:
            assert 'eval "$($PY -m experiments.cluster.env)"' in fh.read(), script


@pytest.mark.timeout(300)
def test_spmd_example_runs_as_documented_with_local_ranks(tmp_path):
    """``python experiments/cluster/train_spmd.py --grid 2x1 --local 2``, the first command of the example that
    docs/clusters.md calls complete, as its docstring writes it (plus ``--out`` to read the record): it trains
    and records. It once failed on a deleted import path that no test ran."""
    out = tmp_path / "r.jsonl"
    run = subprocess.run([sys.executable, os.path.join("experiments", "cluster", "train_spmd.py"), "--grid", "2x1",
                          "--local", "2", "--out", str(out)], cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
                         capture_output=True, text=True, timeout=280)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    recs = records.load(str(out))
    assert len(recs) == 1 and recs[0]["ranks"] == 2 and len(recs[0]["steps"]) == 2, recs
