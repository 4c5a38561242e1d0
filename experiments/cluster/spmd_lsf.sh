#!/usr/bin/env bash
# LSF + jsrun (Summit style), SPMD mode: every resource set (1 GPU, 1 task) runs YOUR script; no driver.
#
#   RANKS=12 bsub -nnodes 2 -W 120 -P PROJECT experiments/cluster/spmd_lsf.sh train.py --grid 3x4
#
# - RANKS = prod(grid) x replicas (default: every GPU of the allocation, GPUS_PER_NODE per compute node).
# - GPUS_PER_NODE resource sets per node [6]; CORES_PER_RS cores each [7].
# - Every rank opens the same paths: keep slides and outputs on a filesystem every node mounts (GPFS, Lustre).
# - One port: the world's store listens on MASTER_PORT (default 29500) on the first compute host (the rank
#   file's second line; its first is the launch node, which runs no rank); BIGCONV_PORT moves it.
#BSUB -J bigconv-spmd
#BSUB -o bigconv-spmd-%J.out
set -euo pipefail
cd "${LS_SUBCWD:-.}"
PY=${PYTHON:-python}
[ $# -ge 1 ] || { echo "usage: bsub ... $0 SCRIPT [ARGS...]" >&2; exit 2; }
eval "$($PY -c 'import os, shlex; from bigconv.runtime.world import WORKER_ENV as E; print("\n".join(f"export {k}={shlex.quote(v)}" for k, v in E.items() if k not in os.environ))')"
NODES=${NODES:-$(awk 'NR > 1' "${LSB_DJOB_HOSTFILE:-/dev/null}" 2>/dev/null | sort -u | wc -l)}
NODES=$(( NODES > 0 ? NODES : 1 ))
GPUS_PER_NODE=${GPUS_PER_NODE:-6}
CORES_PER_RS=${CORES_PER_RS:-7}
RANKS=${RANKS:-$(( NODES * GPUS_PER_NODE ))}
export MASTER_PORT=${MASTER_PORT:-29500}
jsrun --nrs "$RANKS" --tasks_per_rs 1 --cpu_per_rs "$CORES_PER_RS" --gpu_per_rs 1 --rs_per_host "$GPUS_PER_NODE" \
  --bind packed:"$CORES_PER_RS" "$PY" "$@"
