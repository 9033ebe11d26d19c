#!/usr/bin/env bash
# A two-node Ray cluster on this machine (on loopback, 127.0.0.2), for the launcher tests (`areal train` on Ray):
#   scripts/local_ray.sh start DIR   # head (node_a) + one more node (node_b); prints `export RAY_ADDRESS=127.0.0.2:PORT`
#   scripts/local_ray.sh stop DIR    # `ray stop --force`: ends every Ray process of this machine's user
# Each node has one CPU and a custom resource (`node_a` / `node_b`, 1 each). Ray is the one installed for
# $PYTHON (default: the `python` on PATH); its CLI is `$(dirname $PYTHON)/ray`. DIR keeps the address and the
# name of Ray's temp dir (a short /tmp/rayXXXXXX: Unix socket paths are limited to ~107 chars). On failure it
# exits non-zero with a one-line reason as the last line of stderr. `start` on a DIR whose cluster runs reuses it.
# Note: Ray replaces a node IP of exactly 127.0.0.1/localhost by the host's primary address (e.g. eth0's), so
# ray.nodes() would list both nodes under that address. The default LOCAL_RAY_NODE_IP=127.0.0.2 (any other
# loopback address, which Ray keeps) holds every Ray address on loopback; RAY_ADDRESS uses it.
set -euo pipefail

die() { echo "local_ray: $*" >&2; exit 1; }
log() { echo "local_ray: $*" >&2; }

usage() { echo "usage: $0 start|stop DIR" >&2; exit 2; }
[ $# -eq 2 ] || usage
cmd=$1
mkdir -p "$2"
DIR=$(cd "$2" && pwd)
WAIT_S=${LOCAL_RAY_WAIT_S:-60}
NODE_IP=${LOCAL_RAY_NODE_IP:-127.0.0.2}  # not 127.0.0.1, which Ray swaps for the machine's own address

PYTHON=${PYTHON:-$(command -v python || command -v python3 || true)}
[ -n "$PYTHON" ] || die "no python on PATH (set PYTHON)"
RAY=$(dirname "$PYTHON")/ray
unset RAY_ADDRESS
export RAY_USAGE_STATS_ENABLED=0

# wait (bounded) until the cluster at $1 has 2 alive nodes with node_a and node_b; prints why not on failure
wait_nodes() {
  timeout $((WAIT_S + 30)) "$PYTHON" - "$1" "$WAIT_S" <<'EOF' 2>"$DIR/wait.err"
import sys, time
import ray
address, wait_s = sys.argv[1], float(sys.argv[2])
ray.init(address=address, logging_level="ERROR", log_to_driver=False)
deadline = time.monotonic() + wait_s
while True:
    alive = [n for n in ray.nodes() if n["Alive"]]
    res = set().union(*(n["Resources"] for n in alive)) if alive else set()
    if len(alive) >= 2 and {"node_a", "node_b"} <= res:
        sys.exit(0)
    if time.monotonic() > deadline:
        print(f"{len(alive)} alive node(s) after {wait_s:.0f}s, resources {sorted(res)}", file=sys.stderr)
        sys.exit(1)
    time.sleep(0.5)
EOF
}

# a free TCP port in 20000-29999 (above Ray's default worker ports 10002-19999)
free_port() {
  "$PYTHON" - <<'EOF'
import random, socket
for port in random.sample(range(20000, 30000), 200):
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("0.0.0.0", port))
    except OSError:
        continue
    print(port)
    break
EOF
}

stop_cluster() {
  if [ -x "$RAY" ]; then timeout 60 "$RAY" stop --force >"$DIR/stop.out" 2>&1 || true; fi
  if [ -f "$DIR/temp_dir" ]; then rm -rf "$(cat "$DIR/temp_dir")"; fi
  rm -f "$DIR/temp_dir" "$DIR/address"
}

start_cluster() {
  [ -x "$RAY" ] || die "ray CLI not found at $RAY (pip install ray==2.60.0 into the venv of $PYTHON)"
  "$PYTHON" -c 'import ray' 2>/dev/null || die "ray not importable by $PYTHON (pip install ray==2.60.0)"

  # already running: reuse it
  if [ -f "$DIR/address" ] && (exec 3<>"/dev/tcp/$(tr : / <"$DIR/address")") 2>/dev/null \
    && WAIT_S=0 wait_nodes "$(cat "$DIR/address")"; then
    log "cluster $(cat "$DIR/address") already running; reusing it"
    echo "export RAY_ADDRESS=$(cat "$DIR/address")"
    return 0
  fi
  stop_cluster

  local port tmp address
  port=$(free_port)
  [ -n "$port" ] || die "no free port in 20000-29999"
  tmp=$(mktemp -d /tmp/rayXXXXXX)
  echo "$tmp" >"$DIR/temp_dir"
  address=$NODE_IP:$port

  "$RAY" start --head --node-ip-address="$NODE_IP" --port="$port" --num-cpus=1 \
    --resources='{"node_a": 1}' --include-dashboard=false --disable-usage-stats --temp-dir="$tmp" \
    >"$DIR/head.out" 2>&1 \
    || { stop_cluster; die "ray start --head failed: $(grep -iE 'error|exception' "$DIR/head.out" | tail -n1)"; }
  "$RAY" start --address="$address" --node-ip-address="$NODE_IP" --num-cpus=1 \
    --resources='{"node_b": 1}' --disable-usage-stats \
    >"$DIR/worker.out" 2>&1 \
    || { stop_cluster; die "ray start (second node) failed: $(grep -iE 'error|exception' "$DIR/worker.out" | tail -n1)"; }

  if ! wait_nodes "$address"; then
    local why
    why=$(grep -v '^\s*$' "$DIR/wait.err" | tail -n1)
    stop_cluster
    die "cluster not up: ${why:-no answer}"
  fi
  echo "$address" >"$DIR/address"
  echo "export RAY_ADDRESS=$address"
}

case "$cmd" in
  start) start_cluster ;;
  stop) stop_cluster ;;
  *) usage ;;
esac
