#!/usr/bin/env bash
# One node, torchrun: a memory sweep of one model over sizes, WORKERS workers plus a driver process.
#
#   WORKERS=4 MODEL=cnn2d SIZES="1024 2048 4096" DEVICE=cuda bash experiments/cluster/torchrun_node.sh
#
# Knobs (environment variables):
#   WORKERS   worker processes (default: GPUs on the node, else 2); torchrun starts WORKERS+1 processes,
#             rank 0 is the driver and holds no shard. Workers share GPUs round-robin by local rank.
#   MODEL     cnn1d | cnn2d | cnn3d | ... (python -m experiments.sweep --help lists them)   [cnn2d]
#   SIZES     input edges (1D: lengths, suffixes K/M allowed)                              [1024 2048]
#   DEVICE    cuda | cpu                                                                     [cuda if a GPU]
#   BUDGET    per-process memory cap, e.g. 16GiB (GPU: memory fraction), empty for none     []
#   OUT       results file (appended, resumable)                    [results/<MODEL>_torchrun.jsonl]
#   PLAIN     1: also run the plain single-process baseline at each size                    [1]
#   PORT      torchrun's rendezvous port; the world's one port is PORT+2 (torchrun's agent holds
#             PORT); BIGCONV_PORT overrides it                                             [29500]
# Each configuration is a fresh launch (fresh processes); rerunning skips recorded ones.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python}
# The workers' runtime settings (bigconv.runtime.world.WORKER_ENV: allocator, huge pages, MKL buffers), as a
# local World sets them; variables already set win. The plain baseline runs under them too.
eval "$($PY -m experiments.cluster.env)"
GPUS=$($PY -c "import torch; print(torch.cuda.device_count())")
WORKERS=${WORKERS:-$(( GPUS > 0 ? GPUS : 2 ))}
MODEL=${MODEL:-cnn2d}
SIZES=${SIZES:-"1024 2048"}
DEVICE=${DEVICE:-$([ "$GPUS" -gt 0 ] && echo cuda || echo cpu)}
OUT=${OUT:-results/${MODEL}_torchrun.jsonl}
PLAIN=${PLAIN:-1}
PORT=${PORT:-29500}
EXTRA=()
[ -n "${BUDGET:-}" ] && EXTRA+=(--budget "$BUDGET")
TORCHRUN=${TORCHRUN:-"$PY -m torch.distributed.run"}
for SIZE in $SIZES; do
  if [ "$PLAIN" = 1 ]; then
    $PY -m experiments.cluster.run --plain --model "$MODEL" --size "$SIZE" --device "$DEVICE" --out "$OUT" "${EXTRA[@]}" || true
  fi
  $TORCHRUN --standalone --master-port "$PORT" --nproc-per-node $(( WORKERS + 1 )) \
    -m experiments.cluster.run --model "$MODEL" --size "$SIZE" --device "$DEVICE" --out "$OUT" "${EXTRA[@]}" || true
done
echo "results in $OUT; draw them with: $PY -m plots $OUT --out figures/"
