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
# Ray stays in the foreground (`ray start --block`), so the dstack job lives exactly as long as the
# Ray node, and dstack's stop signal reaches Ray directly.
#
# Knobs, all optional (the task's `env` or `dstack apply -e NAME=VALUE`):
#   CLOUDRL_READY_TIMEOUT=900   head: seconds to wait for all DSTACK_NODES_NUM nodes
#   CLOUDRL_JOIN_TIMEOUT=600    worker: seconds to wait for the head's GCS to answer
#   CLOUDRL_RAY_PORT=6379       GCS port;  CLOUDRL_DASHBOARD_PORT=8265  dashboard port
#   CLOUDRL_NUM_CPUS            CPUs Ray may schedule on this node (default: all it detects)
#   CLOUDRL_RAY_START_ARGS      extra `ray start` flags, e.g. "--object-store-memory=200000000"
#   CLOUDRL_PYTHON=python3      interpreter that gets Ray and the trainer's packages
#   NCCL_SOCKET_IFNAME=auto     auto: the interface that holds this node's dstack IP (GLOO_SOCKET_IFNAME too)
#   NCCL_IB_DISABLE=auto        auto: 0 when /sys/class/infiniband has devices, else 1
#   RAY_AUTH_TOKEN              required: Ray token authentication, the same token on every node and
#                               where you run `cloudrl` (`export RAY_AUTH_TOKEN=$(openssl rand -hex 32)`)
#   CLOUDRL_RAY_AUTH=off        start without token authentication (a trusted network only)
#   CLOUDRL_FABRIC_CHECK=1      head: after all nodes join, an all-reduce across them reports transport,
#                               bandwidth and latency, and fails on TCP when IB/EFA devices exist; 0 skips it
#   CLOUDRL_PHASE_PORT=6380     head: where workers report their bring-up phases (closed once ready)
#   CLOUDRL_GPU_VENDOR=auto     amd: HIP/ROCR_VISIBLE_DEVICES = this node's GPUs (auto: amd when /dev/kfd exists)
#   HF_HOME, CLOUDRL_RUNS_DIR   default to /checkpoints/hf-cache and /checkpoints when /checkpoints exists
# This script knows nothing of the trainer: `cloudrl submit` ships it through Ray's runtime env.
set -euo pipefail
BOOT_START="$(date +%s.%N)"

# Must equal cloudrl's own pin (cli/pins.py RAY_VERSION) so the client on your machine matches the
# cluster; `cloudrl validate` checks it. Not an env knob on purpose.
CLOUDRL_RAY_VERSION="2.60.0"
# import-name=pip-requirement pairs the trainer imports beyond a CUDA torch + vLLM image.
TRAINER_PACKAGES="yaml=pyyaml pyarrow=pyarrow tensorboard=tensorboard datasets=datasets"
# W&B logging only when the run has a key for it.
[[ -z "${WANDB_API_KEY:-}" ]] || TRAINER_PACKAGES+=" wandb=wandb"

log() { echo "[cloudrl rank ${DSTACK_NODE_RANK:-?}] $*"; }
REPORTERS=() # background phase reports (report_phase): a node that fails stops them
die() {
    echo "[cloudrl rank ${DSTACK_NODE_RANK:-?}] error: $*" >&2
    if ((${#REPORTERS[@]})); then kill "${REPORTERS[@]}" 2>/dev/null || true; fi
    exit 1
}

# --- 1. dstack's environment -------------------------------------------------------------------
# >>> Slurm: the same DSTACK_* inputs, from Slurm's environment --------------------------------------
# tasks/slurm/ray-cluster.sbatch runs this script once per node with `srun`. Under dstack (which sets
# DSTACK_NODE_RANK itself) this block does nothing. The node order is Slurm's (`scontrol show hostnames`),
# so the job's first node is the head; each name becomes the address Slurm itself reaches the node on
# (its NodeAddr, resolved when it is a host name).
if [[ -z "${DSTACK_NODE_RANK:-}" && -n "${SLURM_JOB_ID:-}" ]]; then
    slurm_nodelist="${SLURM_STEP_NODELIST:-${SLURM_JOB_NODELIST:-}}"
    [[ -n "$slurm_nodelist" ]] || die "SLURM_JOB_NODELIST is not set: start this script with srun inside" \
        "an allocation (sbatch tasks/slurm/ray-cluster.sbatch), not by hand."
    # A batch script whose nodes lack scontrol (inside a container) resolves the nodes and passes
    # DSTACK_NODES_IPS in; tasks/slurm/ray-cluster.sbatch does.
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
    # GPUs: what Slurm allocated (--gpus-per-node/--gres), else the devices the site makes visible.
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
fi
# <<< Slurm ----------------------------------------------------------------------------------------
for name in DSTACK_NODE_RANK DSTACK_MASTER_NODE_IP DSTACK_NODES_NUM DSTACK_GPUS_PER_NODE DSTACK_NODES_IPS; do
    [[ -n "${!name:-}" ]] || die "$name is not set. dstack sets it for every task; run this script as a" \
        "dstack task command (dstack apply -f tasks/ray-cluster.dstack.yml), not by hand."
done
is_uint() { [[ "$1" =~ ^[0-9]+$ ]]; }
for name in DSTACK_NODE_RANK DSTACK_NODES_NUM DSTACK_GPUS_PER_NODE; do
    is_uint "${!name}" || die "$name=${!name} is not a non-negative integer."
done

READY_TIMEOUT="${CLOUDRL_READY_TIMEOUT:-900}"
JOIN_TIMEOUT="${CLOUDRL_JOIN_TIMEOUT:-600}"
RAY_PORT="${CLOUDRL_RAY_PORT:-6379}"
DASHBOARD_PORT="${CLOUDRL_DASHBOARD_PORT:-8265}"
PYTHON="${CLOUDRL_PYTHON:-python3}"
for name in READY_TIMEOUT JOIN_TIMEOUT RAY_PORT DASHBOARD_PORT; do
    is_uint "${!name}" || die "CLOUDRL_$name=${!name} is not a non-negative integer."
done

# Ray token authentication, required: every Ray node, the dashboard's Jobs API and `cloudrl` check the
# same RAY_AUTH_TOKEN. Without it anyone on the cluster's network could run code on every node.
# CLOUDRL_RAY_AUTH=off is the explicit opt-out. Never left to Ray's default, which turns auth on when a
# stray ~/.ray/auth_token exists, on one node but not the others. The same rule under Slurm.
if [[ -n "${RAY_AUTH_TOKEN:-}" ]]; then
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
[[ "${NODE_IPS[0]}" == "$HEAD_IP" ]] ||
    die "DSTACK_MASTER_NODE_IP=$HEAD_IP is not the first of DSTACK_NODES_IPS (${NODE_IPS[*]})."
PHASE_PORT="${CLOUDRL_PHASE_PORT:-6380}"
is_uint "$PHASE_PORT" || die "CLOUDRL_PHASE_PORT=$PHASE_PORT is not a non-negative integer."

report_phase() {
    # Worker: tell the head's watcher (tasks/ray_bringup.py) this node reached phase $1, so the head can
    # tell "installing Ray" from "never came". Best effort, in the background: the head may not listen
    # yet (it installs Ray first), and a report that never arrives only costs a less precise log line.
    ((RANK > 0)) || return 0
    local line="$RANK $1 $(date +%s.%N)"
    (for _ in $(seq 1 $((JOIN_TIMEOUT / 2 + 1))); do
        timeout 2 bash -c "echo '$line' >/dev/tcp/$HEAD_IP/$PHASE_PORT" 2>/dev/null && exit 0
        sleep 2
    done) </dev/null >/dev/null 2>&1 &
    REPORTERS+=("$!")
}
report_phase started

# >>> Debugger and custom resources (docs/debugging.md, docs/slurm.md) -------------------------------
# CLOUDRL_DEBUGGER, unset: off. Set on every node, it reaches every Ray worker process:
#   post-mortem  Ray's distributed debugger: debugpy installed; a breakpoint() in a task or actor, or an
#                uncaught exception (RAY_DEBUG_POST_MORTEM=1), pauses it until VS Code's "Ray
#                Distributed Debugger" attaches. debugpy listens on the node's cluster address, not 0.0.0.0.
#   legacy       Ray's pdb for `ray debug` (RAY_DEBUG=legacy), listening on the node's cluster address
#                (--ray-debugger-external) so `ray debug` on the head reaches breakpoints on every node.
case "${CLOUDRL_DEBUGGER:-}" in
    "") ;;
    post-mortem)
        export RAY_DEBUG=1 RAY_DEBUG_POST_MORTEM=1
        TRAINER_PACKAGES+=" debugpy=debugpy>=1.8.0"
        ;;
    legacy)
        export RAY_DEBUG=legacy
        unset RAY_DEBUG_POST_MORTEM
        CLOUDRL_RAY_START_ARGS="${CLOUDRL_RAY_START_ARGS:-} --ray-debugger-external"
        ;;
    *) die "CLOUDRL_DEBUGGER=$CLOUDRL_DEBUGGER is not a debugger: use post-mortem or legacy, or leave it unset." ;;
esac
# CLOUDRL_RAY_RESOURCES: custom Ray resources for role pinning (`<role>.resources` in the job's config).
# Either this node's own, a JSON object of amounts: '{"rollout_node": 1}'; or one per node, an object
# of such objects keyed by node rank or host name: '{"0": {"trainer_node": 1}, "gpu-07": {...}}'
# (a node not named gets none).
if [[ -n "${CLOUDRL_RAY_RESOURCES:-}" ]]; then
    resources="$("$PYTHON" - "$CLOUDRL_RAY_RESOURCES" "$RANK" "$(hostname -s)" "${SLURMD_NODENAME:-}" <<'PY'
import json, sys
raw, keys = sys.argv[1], [k for k in sys.argv[2:] if k]
try:
    given = json.loads(raw)
    if not isinstance(given, dict):
        raise ValueError("not an object")
    if given and all(isinstance(v, dict) for v in given.values()):
        given = next((given[k] for k in keys if k in given), {})
    if not all(isinstance(v, (int, float)) and v >= 0 and " " not in k for k, v in given.items()):
        raise ValueError("amounts must be numbers >= 0, names without spaces")
except ValueError as e:
    print(f"CLOUDRL_RAY_RESOURCES={raw} is not a JSON object of resource amounts ({e}): write e.g. "
          """'{"rollout_node": 1}', or '{"0": {"trainer_node": 1}, "1": {"rollout_node": 1}}' per node.""")
    sys.exit(1)
print(json.dumps(given, separators=(",", ":")) if given else "")
PY
)" || die "$resources"
    [[ -z "$resources" ]] || CLOUDRL_RAY_START_ARGS="${CLOUDRL_RAY_START_ARGS:-} --resources=$resources"
    log "custom Ray resources on this node: ${resources:-none}"
fi
# <<< Debugger and custom resources -----------------------------------------------------------------

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
INSTALLED="$(date +%s.%N)"
report_phase installed

# --- 3. Network settings for NCCL/RCCL and Gloo, inherited by every Ray worker process ----------
interface_of() {
    # Name of the interface that holds IPv4 address $1 (empty if none). Python, not `ip`: many
    # images do not ship iproute2.
    "$PYTHON" - "$1" <<'PY'
import fcntl, socket, struct, sys
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for _, name in socket.if_nameindex():
    try:  # SIOCGIFADDR
        addr = fcntl.ioctl(sock.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))[20:24]
    except OSError:
        continue
    if socket.inet_ntoa(addr) == sys.argv[1]:
        print(name)
        break
PY
}
if [[ "${NCCL_SOCKET_IFNAME:-auto}" == auto || "${GLOO_SOCKET_IFNAME:-auto}" == auto ]]; then
    iface="$(interface_of "$NODE_IP")"
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

# >>> Search-R1 retriever, one per node (docs/search-r1.md) ---------------------------------------
# CLOUDRL_RETRIEVER_INDEX, unset: off. Set to an index directory (built with `python retriever_server.py
# build-index`, e.g. on the task's volume): every node serves it on 127.0.0.1:CLOUDRL_RETRIEVER_PORT
# (8000), where that node's rollout workers query it, and joins Ray only once its /health answers, with
# the Ray resource `retriever: 1`. So the head's ready line, which waits for every node, also means every
# node's retriever is up. CLOUDRL_RETRIEVER_SCRIPT (trainer/search/retriever_server.py, shipped by the task's
# `files:`), CLOUDRL_RETRIEVER_TIMEOUT=600 (seconds to load the index).
if [[ -n "${CLOUDRL_RETRIEVER_INDEX:-}" ]]; then
    retriever_port="${CLOUDRL_RETRIEVER_PORT:-8000}"
    retriever_script="${CLOUDRL_RETRIEVER_SCRIPT:-trainer/search/retriever_server.py}"
    retriever_timeout="${CLOUDRL_RETRIEVER_TIMEOUT:-600}"
    is_uint "$retriever_port" || die "CLOUDRL_RETRIEVER_PORT=$retriever_port is not a port number."
    is_uint "$retriever_timeout" || die "CLOUDRL_RETRIEVER_TIMEOUT=$retriever_timeout is not a number of seconds."
    [[ -f "$retriever_script" ]] || die "CLOUDRL_RETRIEVER_SCRIPT=$retriever_script is not a file: ship" \
        "trainer/search/retriever_server.py with the task's files: (see tasks/ray-cluster-search.dstack.yml)."
    [[ -f "$CLOUDRL_RETRIEVER_INDEX/meta.json" ]] || die "CLOUDRL_RETRIEVER_INDEX=$CLOUDRL_RETRIEVER_INDEX holds" \
        "no index on this node: build one with 'python trainer/search/retriever_server.py build-index --corpus" \
        "CORPUS.jsonl --out DIR' onto the volume every node mounts."
    "$PYTHON" -c "import bm25s" 2>/dev/null || "$PYTHON" -m pip install --quiet --disable-pip-version-check \
        --no-input "bm25s>=0.2" || die "pip could not install bm25s for the retriever."
    "$PYTHON" "$retriever_script" serve --index "$CLOUDRL_RETRIEVER_INDEX" --host 127.0.0.1 \
        --port "$retriever_port" &
    retriever_pid=$!
    start_s=$SECONDS
    until timeout 3 bash -c "exec 3<>/dev/tcp/127.0.0.1/$retriever_port && printf 'GET /health HTTP/1.0\r\n\r\n' >&3 &&
        grep -q '\"status\": \"ok\"' <&3" 2>/dev/null; do
        kill -0 "$retriever_pid" 2>/dev/null || die "the retriever exited before answering (its output is above)."
        ((SECONDS - start_s < retriever_timeout)) || die "the retriever on 127.0.0.1:$retriever_port did not" \
            "answer /health within ${retriever_timeout}s: raise CLOUDRL_RETRIEVER_TIMEOUT for a large index."
        sleep 1
    done
    log "retriever on 127.0.0.1:$retriever_port answers ($CLOUDRL_RETRIEVER_INDEX, $((SECONDS - start_s))s)"
    # `retriever: 1` joins the node's other custom resources (CLOUDRL_RAY_RESOURCES) in one --resources.
    CLOUDRL_RAY_START_ARGS="$("$PYTHON" - "${CLOUDRL_RAY_START_ARGS:-}" <<'PY'
import json, shlex, sys
resources, kept = {}, []
for arg in shlex.split(sys.argv[1]):
    if arg.startswith("--resources="):
        resources.update(json.loads(arg.split("=", 1)[1]))
    else:
        kept.append(arg)
resources["retriever"] = 1
print(" ".join(kept + ["--resources=" + json.dumps(resources, separators=(",", ":"))]))
PY
)"
fi
# <<< Search-R1 retriever ---------------------------------------------------------------------------

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
    store="$("$PYTHON" -c 'import os
shm = os.statvfs("/dev/shm"); shm = shm.f_bavail * shm.f_frsize
ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
print(max(min(shm // 2, ram * 3 // 10), 78643200))' 2>/dev/null || true)"
    [[ -z "$store" ]] || start_args+=(--object-store-memory="$store")
    log "object store ${store:-Ray default} bytes (half of /dev/shm, at most 30% of RAM)"
fi
# Fixed ports between the nodes, so a firewall can name them (fleets/on-prem.dstack.yml lists them);
# first, so that CLOUDRL_RAY_START_ARGS can override them (the last value of a flag wins).
start_args=(--object-manager-port=8076 --node-manager-port=8077 --min-worker-port=10002 --max-worker-port=10999
    "${start_args[@]}")

BRINGUP="$(dirname "${BASH_SOURCE[0]}")/ray_bringup.py"
wait_for_nodes() {
    # Runs beside the head's `ray start --block` (PID $1): tasks/ray_bringup.py collects the workers'
    # phase reports, waits until every address in DSTACK_NODES_IPS has an alive Ray node, runs the
    # fabric check, then prints the ready line with each phase's duration. On timeout or a failed check
    # it names what is wrong and stops the head with SIGTERM, so the job fails.
    "$PYTHON" "$BRINGUP" watch "$1" "$DASHBOARD_PORT" "$READY_TIMEOUT" "$PHASE_PORT" \
        "$BOOT_START" "$INSTALLED" "$(date +%s.%N)" "${NODE_IPS[@]}"
}

if ((RANK == 0)); then
    [[ -f "$BRINGUP" ]] || die "$BRINGUP is missing: ship it beside this script (the task's files:" \
        "- ray_bringup.py:tasks/ray_bringup.py)."
    log "starting the Ray head: GCS $NODE_IP:$RAY_PORT, dashboard 127.0.0.1:$DASHBOARD_PORT," \
        "waiting up to ${READY_TIMEOUT}s for $DSTACK_NODES_NUM nodes"
    # The watcher gets this shell's PID, which `exec` hands over to `ray start`.
    wait_for_nodes "$$" &
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
log "Ray head $HEAD_IP:$RAY_PORT answers; joining as worker $NODE_IP"
exec "${ray_cli[@]}" start --address="$HEAD_IP:$RAY_PORT" "${start_args[@]}" --block
