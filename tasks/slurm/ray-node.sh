#!/usr/bin/env bash
# One node of tasks/slurm/ray-cluster.sbatch: turns Slurm's environment into the DSTACK_* inputs that
# tasks/ray-bootstrap.sh reads under dstack, then runs that bootstrap (its path is the one argument).
#
#   srun ... bash tasks/slurm/ray-node.sh /path/to/tasks/ray-bootstrap.sh      (the sbatch script does)
#
# The node order is Slurm's (`scontrol show hostnames`), so the job's first node is the head; each name
# becomes the address Slurm itself reaches the node on (its NodeAddr, resolved when it is a host name).
# A batch script whose nodes lack scontrol (inside a container) resolves the nodes and passes
# DSTACK_NODES_IPS in; tasks/slurm/ray-cluster.sbatch does. GPUs: what Slurm allocated
# (--gpus-per-node/--gres: SLURM_GPUS_ON_NODE), else the devices the site makes visible.
set -euo pipefail

log() { echo "[cloudrl rank ${DSTACK_NODE_RANK:-?}] $*"; }
die() {
    echo "[cloudrl rank ${DSTACK_NODE_RANK:-?}] error: $*" >&2
    exit 1
}

bootstrap="${1:-}"
[[ -n "$bootstrap" && -f "$bootstrap" ]] || die "no bootstrap at '${bootstrap}': pass the path of" \
    "tasks/ray-bootstrap.sh (sbatch tasks/slurm/ray-cluster.sbatch does)."
[[ -n "${SLURM_JOB_ID:-}" ]] || die "SLURM_JOB_ID is not set: this script runs inside a Slurm job" \
    "(sbatch tasks/slurm/ray-cluster.sbatch); under dstack the task runs tasks/ray-bootstrap.sh itself."
slurm_nodelist="${SLURM_STEP_NODELIST:-${SLURM_JOB_NODELIST:-}}"
[[ -n "$slurm_nodelist" ]] || die "SLURM_JOB_NODELIST is not set: start this script with srun inside" \
    "an allocation (sbatch tasks/slurm/ray-cluster.sbatch), not by hand."
[[ -n "${DSTACK_NODES_IPS:-}" ]] || command -v scontrol >/dev/null || die "scontrol is not on PATH on" \
    "$(hostname): put Slurm's client tools on the PATH, or export DSTACK_NODES_IPS (one address per node)."

[[ -n "${DSTACK_NODES_IPS:-}" ]] || for slurm_host in $(scontrol show hostnames "$slurm_nodelist"); do
    addr="$(scontrol show node -o "$slurm_host" | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2 || true)"
    [[ "$addr" =~ ^[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+$ ]] ||
        addr="$(getent ahostsv4 "${addr:-$slurm_host}" | awk 'NR == 1 {print $1}' || true)"
    [[ -n "$addr" ]] || die "Slurm node $slurm_host has no IPv4 address (scontrol show node" \
        "$slurm_host; getent ahostsv4 $slurm_host): fix the node's NodeAddr or name resolution."
    DSTACK_NODES_IPS+="$addr"$'\n'
done
DSTACK_MASTER_NODE_IP="$(awk '{print $1; exit}' <<<"$DSTACK_NODES_IPS")"
DSTACK_NODE_RANK="${SLURM_NODEID:-${SLURM_PROCID:-}}"
DSTACK_NODES_NUM="${SLURM_STEP_NUM_NODES:-${SLURM_JOB_NUM_NODES:-}}"
if [[ -n "${SLURM_GPUS_ON_NODE:-}" ]]; then
    DSTACK_GPUS_PER_NODE="$SLURM_GPUS_ON_NODE"
else
    visible="${CUDA_VISIBLE_DEVICES:-${ROCR_VISIBLE_DEVICES:-${HIP_VISIBLE_DEVICES:-}}}"
    if [[ -n "$visible" ]]; then
        IFS=, read -r -a visible <<<"$visible"
        DSTACK_GPUS_PER_NODE="${#visible[@]}"
    elif command -v nvidia-smi >/dev/null; then
        DSTACK_GPUS_PER_NODE="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"
    else
        DSTACK_GPUS_PER_NODE=0
    fi
fi
export DSTACK_NODE_RANK DSTACK_NODES_NUM DSTACK_MASTER_NODE_IP DSTACK_NODES_IPS DSTACK_GPUS_PER_NODE
log "Slurm job $SLURM_JOB_ID on $(hostname): node $DSTACK_NODE_RANK of $DSTACK_NODES_NUM," \
    "$DSTACK_GPUS_PER_NODE GPU(s), head $DSTACK_MASTER_NODE_IP"
exec bash "$bootstrap"
