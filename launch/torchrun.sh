#!/usr/bin/env bash
# Start `dist-trainer train` under torchrun on this node; run it once per node for multi-node jobs.
set -euo pipefail

usage() {
    cat <<'EOF'
Usage: launch/torchrun.sh [--config FILE] [--section.field=value ...]

Runs `torchrun ... -m dist_trainer.cli train "$@"` on this node. Every argument is passed
to the trainer unchanged (the run config and its overrides).

Environment (all optional on one node):
  NPROC_PER_NODE  processes on this node: a number, or gpu/cpu/auto (torchrun's own values)
                  default: gpu when CUDA is visible, else 1
  NNODES          number of nodes, default 1 (a fixed count; elastic ranges are not used)
  NODE_RANK       this node's index 0..NNODES-1; required with NNODES>1 and MASTER_ADDR
  MASTER_ADDR     static rendezvous: address of node 0 (reachable from every node)
  MASTER_PORT     its port, default 29500
  RDZV_ENDPOINT   c10d rendezvous instead: host:port of the store (any one node); NODE_RANK
                  is then assigned by the rendezvous and may be left unset
  RDZV_ID         job id shared by all nodes of one run (c10d), default dist-trainer
  MAX_RESTARTS    torchrun --max-restarts, default 0 (restarts resume from the last checkpoint
                  only when the run sets --train.resume=true)
  TORCHRUN        the torchrun command, default dist-trainer-torchrun (torchrun itself, which also
                  forwards SIGUSR1 and ends a preemption with one line and status 75)

One node:     NPROC_PER_NODE=4 launch/torchrun.sh --config configs/runs/demo.yaml
Two nodes:    on each node  NNODES=2 NODE_RANK=<0|1> MASTER_ADDR=node0 NPROC_PER_NODE=8 \
                              launch/torchrun.sh --config run.yaml
  or c10d:    on each node  NNODES=2 RDZV_ENDPOINT=node0:29500 NPROC_PER_NODE=8 launch/torchrun.sh ...
EOF
}

LAUNCH_SCRIPT=launch/torchrun.sh
# shellcheck source=launch/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
check_common_args "$@"

nnodes="${NNODES:-1}"
is_uint "$nnodes" && [ "$nnodes" -ge 1 ] || die "NNODES=$nnodes must be a whole number >= 1"

if [ -n "${NPROC_PER_NODE:-}" ]; then
    nproc="$NPROC_PER_NODE"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    nproc="gpu"
else
    nproc="1"
fi
case "$nproc" in
    gpu|cpu|auto) ;;
    *) { is_uint "$nproc" && [ "$nproc" -ge 1 ]; } \
        || die "NPROC_PER_NODE=$nproc must be a whole number >= 1 or one of gpu, cpu, auto" ;;
esac

max_restarts="${MAX_RESTARTS:-0}"
is_uint "$max_restarts" || die "MAX_RESTARTS=$max_restarts must be a whole number >= 0"
if [ "$max_restarts" -gt 0 ]; then
    # Restarted workers must not reuse the dead generation's store entries (gloo then dials the dead
    # workers' addresses: pytorch/pytorch#135712); a fresh c10d rendezvous per restart avoids it.
    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}"
    [ -z "${MASTER_ADDR:-}" ] || die "MAX_RESTARTS=$max_restarts needs the c10d rendezvous (RDZV_ENDPOINT," \
                                    "or no address on one node): restarts over MASTER_ADDR reuse a stale store"
fi

cmd=("${TORCHRUN:-dist-trainer-torchrun}" --nproc-per-node "$nproc" --max-restarts "$max_restarts")

if [ -n "${RDZV_ENDPOINT:-}" ]; then
    [[ "$RDZV_ENDPOINT" =~ ^[^:]+:[0-9]+$ ]] || die "RDZV_ENDPOINT=$RDZV_ENDPOINT must be host:port"
    [ -z "${MASTER_ADDR:-}" ] || die "set RDZV_ENDPOINT (c10d) or MASTER_ADDR (static), not both"
    cmd+=(--nnodes "$nnodes" --rdzv-backend c10d --rdzv-endpoint "$RDZV_ENDPOINT"
          --rdzv-id "${RDZV_ID:-dist-trainer}")
    if [ -n "${NODE_RANK:-}" ]; then
        { is_uint "$NODE_RANK" && [ "$NODE_RANK" -lt "$nnodes" ]; } \
            || die "NODE_RANK=$NODE_RANK must be in 0..$((nnodes - 1)) for NNODES=$nnodes"
        cmd+=(--node-rank "$NODE_RANK")
    fi
elif [ -n "${MASTER_ADDR:-}" ]; then
    node_rank="${NODE_RANK:-}"
    if [ -z "$node_rank" ]; then
        [ "$nnodes" -eq 1 ] || die "NODE_RANK is not set: with NNODES=$nnodes and MASTER_ADDR, give each node" \
                                   "its index 0..$((nnodes - 1)) (or use RDZV_ENDPOINT)"
        node_rank=0
    fi
    { is_uint "$node_rank" && [ "$node_rank" -lt "$nnodes" ]; } \
        || die "NODE_RANK=$node_rank must be in 0..$((nnodes - 1)) for NNODES=$nnodes"
    port="${MASTER_PORT:-29500}"
    { is_uint "$port" && [ "$port" -ge 1 ] && [ "$port" -le 65535 ]; } \
        || die "MASTER_PORT=$port must be a port number 1..65535"
    cmd+=(--nnodes "$nnodes" --node-rank "$node_rank" --master-addr "$MASTER_ADDR" --master-port "$port")
else
    [ "$nnodes" -eq 1 ] || die "NNODES=$nnodes needs a rendezvous: set MASTER_ADDR (and NODE_RANK) or RDZV_ENDPOINT"
    # One node, no address given: torchrun picks a free local port itself.
    cmd+=(--standalone)
fi

cmd+=(-m dist_trainer.cli train "$@")
echo "launch/torchrun.sh: ${cmd[*]}" >&2
exec "${cmd[@]}"
