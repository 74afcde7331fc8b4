#!/usr/bin/env bash
# Start `dist-trainer train` under the `deepspeed` launcher: one node, many nodes over ssh/pdsh,
# or one call per node without ssh (--no_ssh --node_rank).
set -euo pipefail

usage() {
    cat <<'USAGE'
Usage: launch/deepspeed.sh [--config FILE] [--section.field=value ...]

Runs `deepspeed ... --module dist_trainer.cli train "$@"`. Every argument is passed to the
trainer unchanged. The trainer reads RANK/WORLD_SIZE/LOCAL_RANK from the launcher.

Environment:
  NUM_GPUS     processes per node (deepspeed --num_gpus). Default: HOSTFILE slots, else every
               accelerator of the node. On CPU (DS_ACCELERATOR=cpu) without HOSTFILE: required.
  HOSTFILE     multi-node: a deepspeed hostfile (see launch/hostfile.example)
  NUM_NODES    use only the first N hosts of HOSTFILE
  LAUNCHER     how node 0 reaches the others: pdsh (default), openmpi, mvapich, mpich, impi, slurm
  NO_SSH=1     per-node mode: run this script on every node (same HOSTFILE, MASTER_ADDR,
               MASTER_PORT), each with its own NODE_RANK; no ssh or pdsh is needed
  NODE_RANK    this node's index 0..N-1 in HOSTFILE (NO_SSH=1 only)
  MASTER_ADDR  address of node 0; required with NO_SSH=1 (otherwise the launcher asks
               the first host with `ssh HOST hostname -I`)
  MASTER_PORT  rendezvous port, default 29500
  DEEPSPEED    the launcher command, default deepspeed
  PYTHON       the Python that runs dist_trainer.forward_signals around it (SIGTERM, SIGUSR1,
               Ctrl-C and SIGHUP go to the ranks, which save and exit 75), default python3

One node, 8 GPUs:       launch/deepspeed.sh --config run.yaml
One CPU node, 2 procs:  DS_ACCELERATOR=cpu NUM_GPUS=2 launch/deepspeed.sh --config run.yaml
Cluster over pdsh:      HOSTFILE=hosts launch/deepspeed.sh --config run.yaml        (on node 0)
Cluster without ssh:    HOSTFILE=hosts NO_SSH=1 NODE_RANK=<i> MASTER_ADDR=node0 \
                          launch/deepspeed.sh --config run.yaml                      (on node i)
USAGE
}

LAUNCH_SCRIPT=launch/deepspeed.sh
# shellcheck source=launch/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
check_common_args "$@"

# --module: run `python -m dist_trainer.cli`; --no_local_rank: the launcher would otherwise
# append --local_rank=N, which the trainer's CLI rejects (it reads LOCAL_RANK from the environment).
cmd=("${DEEPSPEED:-deepspeed}" --module --no_local_rank)

port="${MASTER_PORT:-29500}"
{ is_uint "$port" && [ "$port" -ge 1 ] && [ "$port" -le 65535 ]; } || die "MASTER_PORT=$port must be a port 1..65535"
cmd+=(--master_port "$port")

if [ -n "${NUM_GPUS:-}" ]; then
    { is_uint "$NUM_GPUS" && [ "$NUM_GPUS" -ge 1 ]; } || die "NUM_GPUS=$NUM_GPUS must be a whole number >= 1"
    cmd+=(--num_gpus "$NUM_GPUS")
elif [ "${DS_ACCELERATOR:-}" = "cpu" ] && [ -z "${HOSTFILE:-}" ]; then
    # The CPU accelerator counts NUMA nodes, not the processes the user wants.
    die "NUM_GPUS is not set: with DS_ACCELERATOR=cpu and no HOSTFILE it is the number of processes"
fi

hosts=0
if [ -n "${HOSTFILE:-}" ]; then
    [ -f "$HOSTFILE" ] || die "HOSTFILE=$HOSTFILE: no such file"
    hosts="$(grep -cE '^[[:space:]]*[^#[:space:]]+[[:space:]]+slots=[0-9]+' "$HOSTFILE" || true)"
    [ "$hosts" -ge 1 ] || die "HOSTFILE=$HOSTFILE has no 'HOST slots=N' line"
    cmd+=(--hostfile "$HOSTFILE" --launcher "${LAUNCHER:-pdsh}")
    if [ -n "${NUM_NODES:-}" ]; then
        { is_uint "$NUM_NODES" && [ "$NUM_NODES" -ge 1 ] && [ "$NUM_NODES" -le "$hosts" ]; } \
            || die "NUM_NODES=$NUM_NODES must be in 1..$hosts (the hosts in $HOSTFILE)"
        cmd+=(--num_nodes "$NUM_NODES")
        hosts="$NUM_NODES"
    fi
elif [ -n "${NUM_NODES:-}" ] && [ "$NUM_NODES" != "1" ]; then
    die "NUM_NODES=$NUM_NODES needs HOSTFILE naming the nodes"
fi

if [ "${NO_SSH:-0}" = "1" ]; then
    [ "$hosts" -ge 1 ] || die "NO_SSH=1 needs HOSTFILE (every node reads the same one to size the world)"
    [ -n "${NODE_RANK:-}" ] || die "NO_SSH=1 needs NODE_RANK, this node's index 0..$((hosts - 1)) in $HOSTFILE"
    { is_uint "$NODE_RANK" && [ "$NODE_RANK" -lt "$hosts" ]; } \
        || die "NODE_RANK=$NODE_RANK must be in 0..$((hosts - 1)) ($hosts hosts in $HOSTFILE)"
    [ -n "${MASTER_ADDR:-}" ] || die "NO_SSH=1 needs MASTER_ADDR, the address of node 0 (without ssh the" \
                                     "launcher cannot ask it)"
    cmd+=(--no_ssh --node_rank "$NODE_RANK" --master_addr "$MASTER_ADDR")
elif [ "${NO_SSH:-0}" != "0" ]; then
    die "NO_SSH=$NO_SSH must be 0 or 1"
else
    [ -z "${NODE_RANK:-}" ] || die "NODE_RANK is only read with NO_SSH=1 (over ssh/pdsh node 0 starts every node)"
    if [ -n "${MASTER_ADDR:-}" ]; then cmd+=(--master_addr "$MASTER_ADDR"); fi
fi

cmd+=(dist_trainer.cli train "$@")
echo "launch/deepspeed.sh: ${cmd[*]}" >&2
# deepspeed on one node neither forwards SIGTERM/SIGUSR1 nor survives them: the wrapper sends them to the ranks
exec "${PYTHON:-python3}" -m dist_trainer.forward_signals "${cmd[@]}"
