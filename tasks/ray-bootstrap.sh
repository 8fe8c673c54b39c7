#!/usr/bin/env bash
# Bring up one node of a Ray cluster inside a dstack multi-node task.
#
# Every node of tasks/ray-cluster*.dstack.yml runs this same script; dstack's node rank picks the role:
#   rank 0     Ray head. GCS on :6379 for the other nodes; dashboard (and Jobs API) on 127.0.0.1:8265
#              only: `dstack apply` forwards it through its SSH tunnel, which ends inside this
#              container, so the Jobs API never faces the cluster network. Prints exactly one
#              "cluster ready: N nodes, G GPUs, dashboard on :8265" line once every node has joined,
#              or fails naming the nodes that did not join.
#   rank >= 1  Ray worker. Retries until the head's GCS answers (it may start first, or the head may
#              still be installing Ray), then joins.
# With CLOUDRL_JOIN_HEAD=<the head's address> every rank is a worker of a cluster another run brought up,
# which it joins at any time after that cluster's "cluster ready" (tasks/ray-rollout-spot.dstack.yml:
# rollout capacity added to a running cluster; docs/multinode.md).
# Ray stays in the foreground (`ray start --block`), so the dstack job lives exactly as long as the
# Ray node, and dstack's stop signal reaches Ray directly. Under Slurm, tasks/slurm/ray-node.sh turns
# Slurm's environment into the DSTACK_* inputs and runs this script.
#
# Knobs: environment variables (the task's `env`, `dstack apply -e NAME=VALUE`, or exported before
# `sbatch`). docs/cluster.md ("Knobs") lists every one this script and the files it uses read, with
# its default and meaning; RAY_AUTH_TOKEN is required.
#
# Files beside this script, which every task ships with it: ray_bringup.py (the Python steps: this
# node's `ray start` flags; on the head the wait for the nodes, the fabric check and the ready line)
# and retriever.sh (sourced only when CLOUDRL_RETRIEVER_INDEX is set).
#
# What it knows of the trainer: the packages the trainer imports beyond a CUDA torch + vLLM image
# (TRAINER_PACKAGES, installed below), and the Search-R1 retriever that retriever.sh starts on every
# node (trainer/search/retriever_server.py, shipped by the task). The trainer itself is not installed
# here: `cloudrl submit` ships it with each job through Ray's runtime env.
set -euo pipefail
BOOT_START="$(date +%s.%N)"

# Must equal cloudrl's own pin (cli/pins.py RAY_VERSION) so the client on your machine matches the
# cluster; `cloudrl validate` checks it. Not an env knob on purpose.
CLOUDRL_RAY_VERSION="2.60.0"
# import-name=pip-requirement pairs the trainer imports beyond a CUDA torch + vLLM image.
TRAINER_PACKAGES="yaml=pyyaml pyarrow=pyarrow tensorboard=tensorboard datasets=datasets peft=peft accelerate=accelerate"
# W&B logging only when the run has a key for it.
[[ -z "${WANDB_API_KEY:-}" ]] || TRAINER_PACKAGES+=" wandb=wandb"
# MLflow logging only when the run names a tracking server.
[[ -z "${MLFLOW_TRACKING_URI:-}" ]] || TRAINER_PACKAGES+=" mlflow=mlflow-skinny"

HERE="$(dirname "${BASH_SOURCE[0]}")"
BRINGUP="$HERE/ray_bringup.py"
log() { echo "[cloudrl rank ${DSTACK_NODE_RANK:-?}] $*"; }
REPORTERS=() # background phase reports (report_phase): a node that fails stops them
die() {
    echo "[cloudrl rank ${DSTACK_NODE_RANK:-?}] error: $*" >&2
    if ((${#REPORTERS[@]})); then kill "${REPORTERS[@]}" 2>/dev/null || true; fi
    exit 1
}
is_uint() { [[ "$1" =~ ^[0-9]+$ ]]; }

# --- 1. dstack's environment and the knobs -----------------------------------------------------
for name in DSTACK_NODE_RANK DSTACK_MASTER_NODE_IP DSTACK_NODES_NUM DSTACK_GPUS_PER_NODE DSTACK_NODES_IPS; do
    [[ -n "${!name:-}" ]] || die "$name is not set. dstack sets it for every task; run this script as a" \
        "dstack task command (dstack apply -f tasks/ray-cluster.dstack.yml), or under Slurm through" \
        "sbatch tasks/slurm/ray-cluster.sbatch, not by hand."
done
for name in DSTACK_NODE_RANK DSTACK_NODES_NUM DSTACK_GPUS_PER_NODE; do
    is_uint "${!name}" || die "$name=${!name} is not a non-negative integer."
done

READY_TIMEOUT="${CLOUDRL_READY_TIMEOUT:-900}"
JOIN_TIMEOUT="${CLOUDRL_JOIN_TIMEOUT:-600}"
RAY_PORT="${CLOUDRL_RAY_PORT:-6379}"
DASHBOARD_PORT="${CLOUDRL_DASHBOARD_PORT:-8265}"
PHASE_PORT="${CLOUDRL_PHASE_PORT:-6380}"
PYTHON="${CLOUDRL_PYTHON:-python3}"
for name in READY_TIMEOUT JOIN_TIMEOUT RAY_PORT DASHBOARD_PORT PHASE_PORT; do
    is_uint "${!name}" || die "CLOUDRL_$name=${!name} is not a non-negative integer."
done
[[ -f "$BRINGUP" ]] || die "$BRINGUP is missing: ship it beside this script (the task's files:" \
    "- ray_bringup.py:tasks/ray_bringup.py)."

# Ray token authentication, required: every Ray node, the dashboard's Jobs API and `cloudrl` check the
# same RAY_AUTH_TOKEN. Without it anyone on the cluster's network could run code on every node.
# CLOUDRL_RAY_AUTH=off is the explicit opt-out. Never left to Ray's default, which turns auth on when a
# stray ~/.ray/auth_token exists, on one node but not the others. The same rule under Slurm.
if [[ -n "${RAY_AUTH_TOKEN:-}" ]]; then
    # At most 4 random bits a hex character, 6 any other (base64's most): `changeme` is 48, not strong.
    token_chars="${RAY_AUTH_TOKEN//[[:space:]]/}"
    bits_per_char=6
    [[ "$token_chars" =~ ^[0-9a-fA-F]+$ ]] && bits_per_char=4
    token_bits=$((${#token_chars} * bits_per_char))
    ((token_bits >= 128)) ||
        die "RAY_AUTH_TOKEN holds at most $token_bits random bits, fewer than 128: anyone on the cluster's" \
            "network could guess it and run code on every node. Make one with" \
            "\`export RAY_AUTH_TOKEN=\$(openssl rand -hex 32)\` and pass the same to \`cloudrl submit\`."
    unset token_chars bits_per_char token_bits
    export RAY_AUTH_MODE=token
elif [[ "${CLOUDRL_RAY_AUTH:-on}" == off ]]; then
    export RAY_AUTH_MODE=disabled
else
    die "RAY_AUTH_TOKEN is not set: the Ray cluster would accept jobs from anyone on its network. Run" \
        "\`export RAY_AUTH_TOKEN=\$(openssl rand -hex 32)\` where you run \`dstack apply\` or \`sbatch\`" \
        "(keep it for \`cloudrl submit\`; a dstack task lists RAY_AUTH_TOKEN under its env), or set" \
        "CLOUDRL_RAY_AUTH=off."
fi

# One address a line (dstack's format); any whitespace works.
read -r -d '' -a NODE_IPS <<<"$DSTACK_NODES_IPS" || true
RANK="$DSTACK_NODE_RANK"
((${#NODE_IPS[@]} == DSTACK_NODES_NUM)) ||
    die "DSTACK_NODES_IPS lists ${#NODE_IPS[@]} addresses but DSTACK_NODES_NUM=$DSTACK_NODES_NUM."
((RANK < DSTACK_NODES_NUM)) || die "DSTACK_NODE_RANK=$RANK is not below DSTACK_NODES_NUM=$DSTACK_NODES_NUM."
NODE_IP="${NODE_IPS[$RANK]}"
HEAD_IP="$DSTACK_MASTER_NODE_IP"
JOIN_HEAD="${CLOUDRL_JOIN_HEAD:-}"
if [[ -n "$JOIN_HEAD" ]]; then
    [[ "$JOIN_HEAD" =~ ^[A-Za-z0-9][A-Za-z0-9.-]*$ ]] ||
        die "CLOUDRL_JOIN_HEAD=$JOIN_HEAD is not a host name or IPv4 address: give the running cluster's head" \
            "address, as its log says (\"starting the Ray head: GCS <address>:6379\")."
    [[ "$JOIN_HEAD" != "$NODE_IP" ]] ||
        die "CLOUDRL_JOIN_HEAD=$JOIN_HEAD is this node's own address: it names the head of a cluster that" \
            "runs already (another run's rank 0); to start a cluster, leave it unset."
    HEAD_IP="$JOIN_HEAD"
else
    [[ "${NODE_IPS[0]}" == "$HEAD_IP" ]] ||
        die "DSTACK_MASTER_NODE_IP=$HEAD_IP is not the first of DSTACK_NODES_IPS (${NODE_IPS[*]})."
fi

report_phase() {
    # Worker: tell the head's watcher (ray_bringup.py watch) this node reached phase $1, so the head can
    # tell "installing Ray" from "never came". Best effort, in the background: the head may not listen
    # yet (it installs Ray first), and a report that never arrives only costs a less precise log line.
    ((RANK > 0)) && [[ -z "$JOIN_HEAD" ]] || return 0 # a late joiner: the head's watcher has ended
    local line="$RANK $1 $(date +%s.%N)"
    (for _ in $(seq 1 $((JOIN_TIMEOUT / 2 + 1))); do
        timeout 2 bash -c "echo '$line' >/dev/tcp/$HEAD_IP/$PHASE_PORT" 2>/dev/null && exit 0
        sleep 2
    done) </dev/null >/dev/null 2>&1 &
    REPORTERS+=("$!")
}
report_phase started

# CLOUDRL_DEBUGGER (docs/debugging.md), set on every node, reaches every Ray worker process:
#   post-mortem  Ray's distributed debugger: debugpy installed; a breakpoint() in a task or actor, or an
#                uncaught exception (RAY_DEBUG_POST_MORTEM=1), pauses it until VS Code's "Ray
#                Distributed Debugger" attaches. Ray 2.60 has debugpy listen on the node's cluster address
#                (never 0.0.0.0), without a token: only the cluster's private network guards it.
#   legacy       Ray's pdb for `ray debug` (RAY_DEBUG=legacy), listening on 127.0.0.1 of the paused worker's
#                node: `ray debug` runs on that node (an SSH hop through the head). Never
#                --ray-debugger-external, which would open the pdb, code execution, on every interface.
# Either takes no token, so every node says so in its log.
case "${CLOUDRL_DEBUGGER:-}" in
    "") ;;
    post-mortem)
        export RAY_DEBUG=1 RAY_DEBUG_POST_MORTEM=1
        TRAINER_PACKAGES+=" debugpy=debugpy>=1.8.0"
        ;;
    legacy)
        export RAY_DEBUG=legacy REMOTE_PDB_HOST=127.0.0.1
        unset RAY_DEBUG_POST_MORTEM RAY_DEBUGGER_EXTERNAL
        ;;
    *) die "CLOUDRL_DEBUGGER=$CLOUDRL_DEBUGGER is not a debugger: use post-mortem or legacy, or leave it unset." ;;
esac
[[ -z "${CLOUDRL_DEBUGGER:-}" ]] ||
    log "warning: CLOUDRL_DEBUGGER=$CLOUDRL_DEBUGGER: a paused worker waits for a debugger that takes no token" \
        "(docs/debugging.md); restart the cluster without it when done"
# CLOUDRL_RAY_METRICS: each node's Prometheus exporter (Ray's metrics agent) listens on every interface of a
# node with a network address and takes no token; off unless asked for (on: Ray's default, for a Prometheus
# that scrapes the nodes over the private network).
case "${CLOUDRL_RAY_METRICS:-off}" in
    off) export RAY_enable_metrics_collection=0 ;;
    on) ;;
    *) die "CLOUDRL_RAY_METRICS=$CLOUDRL_RAY_METRICS: use on (each node exports Ray's metrics) or off." ;;
esac
# CLOUDRL_RAY_RESOURCES: custom Ray resources for role pinning (`<role>.resources` in the job's config;
# docs/slurm.md), for every node or per node by rank or host name. Checked before anything is installed.
if [[ -n "${CLOUDRL_RAY_RESOURCES:-}" ]]; then
    resources="$("$PYTHON" "$BRINGUP" resources "$CLOUDRL_RAY_RESOURCES" \
        "$RANK" "$(hostname -s)" "${SLURMD_NODENAME:-}")" || die "$resources"
    [[ -z "$resources" ]] || CLOUDRL_RAY_START_ARGS="${CLOUDRL_RAY_START_ARGS:-} --resources=$resources"
    log "custom Ray resources on this node: ${resources:-none}"
fi

# --- 2. Python packages: the pinned Ray, and what the trainer needs beyond the image ------------
wanted=()
have_ray="$("$PYTHON" -c 'import ray; print(ray.__version__)' 2>/dev/null || true)"
# pip is also run when Ray is already at the pin: it adds the [default] extras (dashboard, Jobs API)
# that images shipping Ray for vLLM often lack, and does nothing when they are there.
wanted+=("ray[default]==$CLOUDRL_RAY_VERSION")
for pair in $TRAINER_PACKAGES; do
    "$PYTHON" -c "import ${pair%%=*}" 2>/dev/null || wanted+=("${pair#*=}")
done
log "Ray ${have_ray:-not installed}, pinned $CLOUDRL_RAY_VERSION; ensuring: ${wanted[*]}"
if "$PYTHON" -m pip --version >/dev/null 2>&1; then
    "$PYTHON" -m pip install --quiet --disable-pip-version-check --no-input "${wanted[@]}" ||
        die "pip could not install ${wanted[*]} (see pip's output above)."
elif command -v uv >/dev/null 2>&1; then
    uv pip install --quiet --system --python "$PYTHON" "${wanted[@]}" ||
        die "uv could not install ${wanted[*]} (see uv's output above)."
else
    die "neither '$PYTHON -m pip' nor uv is available in the image; use an image with pip."
fi
have_ray="$("$PYTHON" -c 'import ray; print(ray.__version__)')"
[[ "$have_ray" == "$CLOUDRL_RAY_VERSION" ]] ||
    die "Ray $have_ray is installed but cloudrl needs $CLOUDRL_RAY_VERSION."
# Bubblewrap, which the trainer's code sandbox runs model-written programs with (without it, its own launcher).
if [[ "${CLOUDRL_INSTALL_BWRAP:-1}" == 1 ]] && ! command -v bwrap >/dev/null 2>&1; then
    if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null 2>&1 &&
        timeout 180 bash -c 'apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap' \
            >/dev/null 2>&1; then
        log "installed bubblewrap for the code sandbox"
    else
        log "warning: bubblewrap is not installed (apt-get as root failed or is missing): model-written code runs" \
            "under cloudrl's own sandbox launcher"
    fi
fi
INSTALLED="$(date +%s.%N)"
report_phase installed

# --- 3. Node settings, inherited by every Ray worker process: NCCL/RCCL and Gloo, GPUs, volume ---
if [[ "${NCCL_SOCKET_IFNAME:-auto}" == auto || "${GLOO_SOCKET_IFNAME:-auto}" == auto ]]; then
    iface="$("$PYTHON" "$BRINGUP" interface "$NODE_IP")"
    for name in NCCL_SOCKET_IFNAME GLOO_SOCKET_IFNAME; do
        [[ "${!name:-auto}" == auto ]] || continue
        if [[ -n "$iface" ]]; then
            export "$name=$iface"
        else
            unset "$name"
            log "warning: no interface holds $NODE_IP; $name left to the library's own choice"
        fi
    done
fi
if [[ "${NCCL_IB_DISABLE:-auto}" == auto ]]; then
    if compgen -G "/sys/class/infiniband/*" >/dev/null; then
        export NCCL_IB_DISABLE=0
    else
        export NCCL_IB_DISABLE=1
    fi
fi
# AMD GPUs: Ray schedules them through HIP_VISIBLE_DEVICES (and refuses to start when only
# ROCR_VISIBLE_DEVICES is set), so both list this node's DSTACK_GPUS_PER_NODE devices.
vendor="${CLOUDRL_GPU_VENDOR:-auto}"
[[ "$vendor" != auto ]] || { [[ -e /dev/kfd ]] && vendor=amd || vendor=nvidia; }
if [[ "$vendor" == amd && "$DSTACK_GPUS_PER_NODE" -gt 0 ]]; then
    devices="$(seq -s, 0 $((DSTACK_GPUS_PER_NODE - 1)))"
    export HIP_VISIBLE_DEVICES="${HIP_VISIBLE_DEVICES:-$devices}" ROCR_VISIBLE_DEVICES="${ROCR_VISIBLE_DEVICES:-$devices}"
    log "AMD GPUs: HIP_VISIBLE_DEVICES=$HIP_VISIBLE_DEVICES ROCR_VISIBLE_DEVICES=$ROCR_VISIBLE_DEVICES"
fi
log "node $NODE_IP; NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-<unset>} NCCL_IB_DISABLE=$NCCL_IB_DISABLE;" \
    "Ray token auth $([[ "$RAY_AUTH_MODE" == token ]] && echo on || echo off)"

# Runs and downloads go to the run volume when the task mounts one (tasks/*.dstack.yml: /checkpoints):
# a job's relative trainer.run_dir lands there instead of in the job's temporary working directory,
# and each node downloads a hub model once for all runs (nodes sharing the volume share the cache).
# Values set in the task's env win. Exported before `ray start`, so every job and worker inherits them.
if [[ -d /checkpoints && -w /checkpoints ]]; then
    export HF_HOME="${HF_HOME:-/checkpoints/hf-cache}" CLOUDRL_RUNS_DIR="${CLOUDRL_RUNS_DIR:-/checkpoints}"
fi

# Search-R1: this node's retriever answers before the node joins Ray (docs/search-r1.md).
if [[ -n "${CLOUDRL_RETRIEVER_INDEX:-}" ]]; then
    [[ -f "$HERE/retriever.sh" ]] || die "$HERE/retriever.sh is missing: ship it beside this script" \
        "(the task's files: - retriever.sh:tasks/retriever.sh)."
    # shellcheck source=retriever.sh
    source "$HERE/retriever.sh"
fi

# --- 4. Ray -------------------------------------------------------------------------------------
# Ray's CLI from the interpreter that just got the pinned Ray, whatever `ray` PATH finds first.
ray_cli=("$PYTHON" -m ray.scripts.scripts)
start_args=(--node-ip-address="$NODE_IP" --num-gpus="$DSTACK_GPUS_PER_NODE" --disable-usage-stats)
[[ -z "${CLOUDRL_NUM_CPUS:-}" ]] || start_args+=(--num-cpus="$CLOUDRL_NUM_CPUS")
read -r -a extra_args <<<"${CLOUDRL_RAY_START_ARGS:-}"
start_args+=("${extra_args[@]}")

# /dev/shm holds Ray's object store and NCCL's/vLLM's shared-memory buffers. Ray alone would take 95% of
# it, so unless CLOUDRL_RAY_START_ARGS sizes the store, Ray gets half of /dev/shm, at most 30% of RAM
# (Ray's own default share), and NCCL and vLLM keep the rest (the task's shm_size sets /dev/shm).
if [[ " ${extra_args[*]} " != *" --object-store-memory"* ]]; then
    store="$("$PYTHON" "$BRINGUP" object-store 2>/dev/null || true)"
    [[ -z "$store" ]] || start_args+=(--object-store-memory="$store")
    log "object store ${store:-Ray default} bytes (half of /dev/shm, at most 30% of RAM)"
fi
# Fixed ports between the nodes, so a firewall can name them (fleets/on-prem.dstack.yml lists them);
# first, so that CLOUDRL_RAY_START_ARGS can override them (the last value of a flag wins).
start_args=(--object-manager-port=8076 --node-manager-port=8077 --min-worker-port=10002 --max-worker-port=10999
    "${start_args[@]}")

# Preemption notices: beside Ray, a watcher polls the cloud's notice (AWS, GCP, Azure), or under Slurm the
# job's time limit, and drains this Ray node when one comes, so the trainer checkpoints its step and leaves the node (docs/recovery.md). It says
# on which cloud it watches, or that none answers (on premises). CLOUDRL_PREEMPTION_NOTICES picks the cloud
# or turns it off.
notices="${CLOUDRL_PREEMPTION_NOTICES:-auto}"
case "$notices" in
    auto | slurm | aws | gcp | azure | off) ;;
    *) die "CLOUDRL_PREEMPTION_NOTICES=$notices is not a choice: use auto, slurm, aws, gcp, azure or off." ;;
esac
notice_poll_s="${CLOUDRL_NOTICE_POLL_S:-5}"
is_uint "$notice_poll_s" && ((notice_poll_s > 0)) || die "CLOUDRL_NOTICE_POLL_S=$notice_poll_s is not a" \
    "whole number of seconds above 0."
is_uint "${CLOUDRL_SLURM_NOTICE_S:-300}" || die "CLOUDRL_SLURM_NOTICE_S=$CLOUDRL_SLURM_NOTICE_S is not a whole" \
    "number of seconds."
if [[ "$notices" != off ]]; then
    raylet_port=8077 # the last --node-manager-port wins, as in Ray's own parsing
    for arg in "${start_args[@]}"; do [[ "$arg" != --node-manager-port=* ]] || raylet_port="${arg#*=}"; done
    "$PYTHON" "$BRINGUP" notices --gcs "$HEAD_IP:$RAY_PORT" --node-ip "$NODE_IP" \
        --node-manager-port "$raylet_port" --source "$notices" \
        --poll-s "$notice_poll_s" </dev/null &
fi

if ((RANK == 0)) && [[ -z "$JOIN_HEAD" ]]; then
    log "starting the Ray head: GCS $NODE_IP:$RAY_PORT, dashboard 127.0.0.1:$DASHBOARD_PORT," \
        "waiting up to ${READY_TIMEOUT}s for $DSTACK_NODES_NUM nodes"
    # Beside the head's `ray start --block`, which `exec` hands this shell's PID: the watcher collects the
    # workers' phase reports, waits until every address in DSTACK_NODES_IPS has an alive Ray node, runs
    # the fabric check, then prints the ready line with each phase's duration. On timeout or a failed
    # check it names what is wrong and stops the head with SIGTERM, so the job fails (exit status 3). The
    # subshell waits on it: a watcher that ended any other way without the ready line (its Python did not
    # start, it was killed) stops the head too, since without it nothing bounds the wait.
    (
        status=0
        "$PYTHON" "$BRINGUP" watch --ray-pid "$$" --ray-port "$RAY_PORT" --dashboard-port "$DASHBOARD_PORT" \
            --phase-port "$PHASE_PORT" --timeout "$READY_TIMEOUT" --boot-start "$BOOT_START" \
            --installed "$INSTALLED" --ray-started "$(date +%s.%N)" "${NODE_IPS[@]}" || status=$?
        if ((status != 0 && status != 3)); then
            echo "[cloudrl rank 0] error: the bring-up watcher exited with status $status before the cluster" \
                "was ready (its output above says why); stopped the head: start the cluster again" >&2
            kill -TERM "$$" 2>/dev/null || true
        fi
    ) </dev/null &
    exec "${ray_cli[@]}" start --head --port="$RAY_PORT" --dashboard-host=127.0.0.1 \
        --dashboard-port="$DASHBOARD_PORT" --include-dashboard=true "${start_args[@]}" --block
fi

# A worker must not exit because it started before the head: dstack fails the whole run when any
# node exits non-zero. So it probes the GCS port (bash's /dev/tcp, no Python start-up per try)
# until it answers, with a bounded timeout and one line per attempt.
attempt=0
start_s=$SECONDS
until timeout 3 bash -c ": >/dev/tcp/$HEAD_IP/$RAY_PORT" 2>/dev/null; do
    attempt=$((attempt + 1))
    waited=$((SECONDS - start_s))
    if ((waited >= JOIN_TIMEOUT)); then
        die "the Ray head at $HEAD_IP:$RAY_PORT did not answer within ${JOIN_TIMEOUT}s ($attempt attempts)." \
            "Check the head's log (dstack logs <run>); raise CLOUDRL_JOIN_TIMEOUT if it is still installing."
    fi
    log "join attempt $attempt: Ray head $HEAD_IP:$RAY_PORT not answering yet (${waited}s of ${JOIN_TIMEOUT}s)"
    sleep 2
done
log "Ray head $HEAD_IP:$RAY_PORT answers; joining as worker $NODE_IP${JOIN_HEAD:+ (added to the running cluster)}"
exec "${ray_cli[@]}" start --address="$HEAD_IP:$RAY_PORT" "${start_args[@]}" --block
