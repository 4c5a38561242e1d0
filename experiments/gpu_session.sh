#!/usr/bin/env bash
# One lent GPU machine (one GPU, 16 CPU cores), one call: every step under its own timeout, records under
# $OUT (default results/device) as they are measured. Run from the repository root:
#   OUT=/tmp/out bash experiments/gpu_session.sh
# 1. the GPU check (its 1-GPU equivalence case), 2. the planner's one-GPU step against the GPU,
# 3. the native loop's autocast/GradScaler on CUDA, 4. the planner's CPU step times at 1-16 ranks
# (the 16 cores this host lacks).
set -u
OUT=${OUT:-results/device}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PY:-python3}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; $PY -c 'import torch; print(torch.__version__, torch.version.cuda)'; } 2>&1 | tee "$OUT/machine.txt"
step() { local limit=$1; shift; echo "== $* (limit ${limit}s) $(date +%T)"; timeout "$limit" "$@"; echo "== rc $? $(date +%T)"; }
step 90 $PY -m experiments.gpu_check --quick --skip-bench --cases 'spmd/*' --out-dir "$OUT"
step 150 $PY -m experiments.gpu_planner --out "$OUT/gpu_planner.jsonl"
step 75 $PY -m experiments.gpu_loop --out "$OUT/gpu_loop.jsonl"
step 60 $PY -m experiments.planner host --rounds 3 --out "$OUT/planner_host16.jsonl"
step 150 $PY -m experiments.planner time --models cnn2d --sizes 2048 --ranks 1 2 4 8 16 --steps 3 \
    --host-file "$OUT/planner_host16.jsonl" --out "$OUT/planner_time16.jsonl"
