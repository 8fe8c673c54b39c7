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
#   RAY_AUTH_TOKEN              set (as a secret): Ray token authentication on, with this token
#   HF_HOME, CLOUDRL_RUNS_DIR   default to /checkpoints/hf-cache and /checkpoints when /checkpoints exists
# This script knows nothing of the trainer: `cloudrl submit` ships it through Ray's runtime env.
set -euo pipefail

# Must equal cloudrl's own pin (cli/pins.py RAY_VERSION) so the client on your machine matches the
# cluster; `cloudrl validate` checks it. Not an env knob on purpose.
CLOUDRL_RAY_VERSION="2.60.0"
# import-name=pip-requirement pairs the trainer imports beyond a CUDA torch + vLLM image.
TRAINER_PACKAGES="yaml=pyyaml pyarrow=pyarrow tensorboard=tensorboard datasets=datasets"
# W&B logging only when the run has a key for it.
[[ -z "${WANDB_API_KEY:-}" ]] || TRAINER_PACKAGES+=" wandb=wandb"

log() { echo "[cloudrl rank ${DSTACK_NODE_RANK:-?}] $*"; }
die() {
    echo "[cloudrl rank ${DSTACK_NODE_RANK:-?}] error: $*" >&2
    exit 1
}

# --- 1. dstack's environment -------------------------------------------------------------------
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

# Ray token authentication: on when the task passes a RAY_AUTH_TOKEN secret (the same value on every
# node; export it where you run `cloudrl submit` too), otherwise explicitly off. Never left to Ray's
# default, which turns it on when a stray ~/.ray/auth_token exists, on one node but not the others.
if [[ -n "${RAY_AUTH_TOKEN:-}" ]]; then
    export RAY_AUTH_MODE=token
elif [[ "${RAY_AUTH_MODE:-disabled}" == token ]]; then
    die "RAY_AUTH_MODE=token needs RAY_AUTH_TOKEN: list it under the task's env (by name) and export" \
        "the same value on your machine."
else
    export RAY_AUTH_MODE=disabled
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
log "node $NODE_IP; NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-<unset>} NCCL_IB_DISABLE=$NCCL_IB_DISABLE;" \
    "Ray token auth ${RAY_AUTH_MODE/disabled/off}"

# Runs and downloads go to the run volume when the task mounts one (tasks/*.dstack.yml: /checkpoints):
# a job's relative trainer.run_dir lands there instead of in the job's temporary working directory,
# and each node downloads a hub model once for all runs (nodes sharing the volume share the cache).
# Values set in the task's env win. Exported before `ray start`, so every job and worker inherits them.
if [[ -d /checkpoints && -w /checkpoints ]]; then
    export HF_HOME="${HF_HOME:-/checkpoints/hf-cache}" CLOUDRL_RUNS_DIR="${CLOUDRL_RUNS_DIR:-/checkpoints}"
fi

# --- 4. Ray -------------------------------------------------------------------------------------
# Ray's CLI from the interpreter that just got the pinned Ray, whatever `ray` PATH finds first.
ray_cli=("$PYTHON" -m ray.scripts.scripts)
start_args=(--node-ip-address="$NODE_IP" --num-gpus="$DSTACK_GPUS_PER_NODE" --disable-usage-stats)
[[ -z "${CLOUDRL_NUM_CPUS:-}" ]] || start_args+=(--num-cpus="$CLOUDRL_NUM_CPUS")
read -r -a extra_args <<<"${CLOUDRL_RAY_START_ARGS:-}"
start_args+=("${extra_args[@]}")

wait_for_nodes() {
    # Runs beside the head's `ray start --block` (PID $1). Polls the dashboard's state API until
    # every address in DSTACK_NODES_IPS has an alive Ray node, then prints the ready line. On
    # timeout it names the missing nodes and stops the head with SIGTERM, so the job fails.
    "$PYTHON" - "$1" "$DASHBOARD_PORT" "$READY_TIMEOUT" "${NODE_IPS[@]}" <<'PY'
import os, signal, sys, time

ray_pid, port, timeout, expected = int(sys.argv[1]), sys.argv[2], float(sys.argv[3]), sys.argv[4:]
rank_log = f"[cloudrl rank {os.environ['DSTACK_NODE_RANK']}]"
start = time.monotonic()
from ray.util.state import list_nodes  # imported after `start`: the import counts against the timeout

alive, last_report, error = {}, -1.0, "dashboard not answering yet"
while True:
    elapsed = time.monotonic() - start
    try:
        os.kill(ray_pid, 0)
    except ProcessLookupError:
        print(f"{rank_log} error: the Ray head exited before the cluster was ready", flush=True)
        sys.exit(1)
    try:
        nodes = list_nodes(address=f"http://127.0.0.1:{port}", filters=[("state", "=", "ALIVE")],
                           timeout=10, raise_on_missing_output=False)
        alive = {n.node_ip: n for n in nodes}
        error = ""
    except Exception as e:  # the dashboard starts a few seconds after the GCS
        error = f"dashboard not answering yet ({type(e).__name__})"
    missing = [f"{ip} (rank {rank})" for rank, ip in enumerate(expected) if ip not in alive]
    if not missing:
        gpus = sum(int(n.resources_total.get("GPU", 0)) for n in alive.values())
        print(f"{rank_log} cluster ready: {len(alive)} nodes, {gpus} GPUs, dashboard on :{port}",
              flush=True)
        sys.exit(0)
    if elapsed >= timeout:
        print(f"{rank_log} error: cluster not ready after {timeout:.0f}s: "
              f"{len(missing)} of {len(expected)} nodes did not join: {', '.join(missing)}. "
              "Check those nodes' logs (dstack logs <run> --job <rank>); raise "
              "CLOUDRL_READY_TIMEOUT if they are still pulling the image.", flush=True)
        os.kill(ray_pid, signal.SIGTERM)
        sys.exit(1)
    if elapsed - last_report >= 10:
        last_report = elapsed
        print(f"{rank_log} waiting for nodes ({len(expected) - len(missing)}/{len(expected)} joined, "
              f"{elapsed:.0f}s of {timeout:.0f}s): missing {', '.join(missing)}"
              + (f"; {error}" if error else ""), flush=True)
    time.sleep(1)
PY
}

if ((RANK == 0)); then
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
