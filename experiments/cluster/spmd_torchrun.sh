#!/usr/bin/env bash
# torchrun, SPMD mode: run this on EVERY node; it starts NPROC ranks there, each running YOUR script.
#
#   NNODES=2 NPROC=8 HEAD=node001 bash experiments/cluster/spmd_torchrun.sh train.py --grid 4x4   # on each node
#   NPROC=4 bash experiments/cluster/spmd_torchrun.sh train.py --grid 2x2                          # one node
#
# - NNODES x NPROC = prod(grid) x replicas. NPROC: ranks on this node [the GPUs it has, else 2].
# - HEAD: the host every node reaches, where the rendezvous listens [localhost]; RDZV_ID names the job.
# - Ports on HEAD: PORT for torchrun's rendezvous store [29500], PORT+2 for bigconv's own store (torchrun's
#   agent holds PORT, so bigconv.World.from_env moves up by itself); BIGCONV_PORT sets bigconv's outright.
# - Every rank opens the same paths: keep slides and outputs on a filesystem every node mounts at one path.
set -euo pipefail
PY=${PYTHON:-python}
[ $# -ge 1 ] || { echo "usage: NNODES=.. NPROC=.. HEAD=.. bash $0 SCRIPT [ARGS...]" >&2; exit 2; }
eval "$($PY -c 'import os, shlex; from bigconv.runtime.world import WORKER_ENV as E; print("\n".join(f"export {k}={shlex.quote(v)}" for k, v in E.items() if k not in os.environ))')"
GPUS=$($PY -c "import torch; print(torch.cuda.device_count())")
NPROC=${NPROC:-$(( GPUS > 0 ? GPUS : 2 ))}
NNODES=${NNODES:-1}
PORT=${PORT:-29500}
HEAD=${HEAD:-localhost}
TORCHRUN=${TORCHRUN:-"$PY -m torch.distributed.run"}
if [ "$NNODES" = 1 ]; then
  exec $TORCHRUN --standalone --master-port "$PORT" --nproc-per-node "$NPROC" "$@"
fi
exec $TORCHRUN --nnodes "$NNODES" --nproc-per-node "$NPROC" --rdzv-backend c10d \
  --rdzv-endpoint "$HEAD:$PORT" --rdzv-id "${RDZV_ID:-bigconv}" "$@"
