# Search-R1 retriever, one per node (docs/search-r1.md). Sourced by tasks/ray-bootstrap.sh, only when
# CLOUDRL_RETRIEVER_INDEX is set, after its node settings and before Ray starts; it uses the bootstrap's
# log, die, is_uint, PYTHON and BRINGUP.
#
# CLOUDRL_RETRIEVER_INDEX is an index directory (built with `python trainer/search/retriever_server.py
# build-index`, e.g. on the task's volume): this node serves it on 127.0.0.1:CLOUDRL_RETRIEVER_PORT, where
# this node's rollout workers query it, and joins Ray only once its /health answers, with the Ray resource
# `retriever: 1`. So the head's ready line, which waits for every node, also means every node's retriever
# is up. Defaults of CLOUDRL_RETRIEVER_PORT, CLOUDRL_RETRIEVER_SCRIPT and CLOUDRL_RETRIEVER_TIMEOUT: the
# knob table in docs/cluster.md.
[[ "${BASH_SOURCE[0]}" != "$0" ]] || {
    echo "tasks/retriever.sh is sourced by tasks/ray-bootstrap.sh: set CLOUDRL_RETRIEVER_INDEX and run that." >&2
    exit 1
}

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
CLOUDRL_RAY_START_ARGS="$("$PYTHON" "$BRINGUP" with-resource --start-args="${CLOUDRL_RAY_START_ARGS:-}" retriever=1)"
