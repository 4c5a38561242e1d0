#!/usr/bin/env bash
# LSF + jsrun (Summit style), driver mode: resource sets of 1 GPU, one process each; WORKERS workers plus
# a driver. (Your own training script: spmd_lsf.sh, the SPMD mode, has no driver.)
#
#   bsub -nnodes 2 -W 120 -P PROJECT -env "all,MODEL=cnn2d,SIZES=2048 4096 6144" experiments/cluster/summit_lsf.sh
#
# Knobs (bsub options and environment variables):
#   -nnodes N          nodes (NODES overrides); a Summit node has 6 GPUs, so up to 6N resource sets
#   WORKERS            worker processes; jsrun starts WORKERS+1 resource sets of 1 GPU, 7 cores, 1 task
#                      (rank 0 drives and holds no shard; its GPU stays idle)        [6 x nodes - 1]
#   GPUS_PER_NODE      resource sets per node                                         [6]
#   CORES_PER_RS       cores per resource set                                         [7]
#   MODEL, SIZES, DEVICE, BUDGET, OUT, PLAIN   as in slurm.sbatch          [OUT: results/<MODEL>_lsf.jsonl]
#   MASTER_PORT        the one port the world takes (its store; RPC and the gradient group meet
#                      through it); BIGCONV_PORT overrides it                        [29500]
# World.from_env() reads JSM_NAMESPACE_RANK/SIZE/LOCAL_RANK and takes the driver's host from the first
# compute host of LSB_DJOB_RANKFILE (its first line is the launch node, which runs no rank).
# RPC executes pickled Python from whoever connects: run on a trusted network only.
#BSUB -J bigconv-sweep
#BSUB -o bigconv-%J.out
set -euo pipefail
cd "${LS_SUBCWD:-.}"
PY=${PYTHON:-python}
# The workers' runtime settings (bigconv.runtime.world.WORKER_ENV: allocator, huge pages, MKL buffers), as a
# local World sets them; variables already set win. The plain baseline runs under them too.
eval "$($PY -m experiments.cluster.env)"
# compute hosts: the host file's lines after the first (the launch node), without repeats
NODES=${NODES:-$(awk 'NR > 1' "${LSB_DJOB_HOSTFILE:-/dev/null}" 2>/dev/null | sort -u | wc -l)}
NODES=$(( NODES > 0 ? NODES : 1 ))
GPUS_PER_NODE=${GPUS_PER_NODE:-6}
CORES_PER_RS=${CORES_PER_RS:-7}
WORKERS=${WORKERS:-$(( NODES * GPUS_PER_NODE - 1 ))}
MODEL=${MODEL:-cnn2d}
SIZES=${SIZES:-"2048 4096"}
DEVICE=${DEVICE:-cuda}
OUT=${OUT:-results/${MODEL}_lsf.jsonl}
PLAIN=${PLAIN:-1}
export MASTER_PORT=${MASTER_PORT:-29500}
EXTRA=()
[ -n "${BUDGET:-}" ] && EXTRA+=(--budget "$BUDGET")
RS=(--tasks_per_rs 1 --cpu_per_rs "$CORES_PER_RS" --gpu_per_rs 1 --rs_per_host "$GPUS_PER_NODE" --bind packed:"$CORES_PER_RS")
for SIZE in $SIZES; do
  if [ "$PLAIN" = 1 ]; then
    jsrun --nrs 1 "${RS[@]}" $PY -m experiments.cluster.run --plain --model "$MODEL" --size "$SIZE" \
      --device "$DEVICE" --out "$OUT" "${EXTRA[@]}" || true
  fi
  jsrun --nrs $(( WORKERS + 1 )) "${RS[@]}" $PY -m experiments.cluster.run --model "$MODEL" --size "$SIZE" \
    --device "$DEVICE" --out "$OUT" "${EXTRA[@]}" || true
done
