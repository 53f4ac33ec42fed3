#!/usr/bin/env bash
# Runs the reliability probes (loadtests/reliability.py) against the dev binary, in two stages:
#
# 1. `swarmgate serve` on a free loopback port, with an API key and small admission bounds (2
#    running, 2 queued) so that overload's ten-times burst meets them at once: auth, fuzz,
#    disconnects, overload and slowloris.
# 2. two workers on the machine's NATS (scripts/services.sh starts it), in a cluster of their
#    own, behind two gateways: one with serve's bounds for the same five probes, then one with
#    the default bounds for worker-loss, SIGKILLing one worker under load (its 16 streams at a
#    time need more than 4 seats).
#
# `--quick` (the default; RELIABILITY_MODE=full for the long run) keeps the whole to a few
# minutes (the serve probes about a minute once nothing hangs); every probe and every request is bounded, and each stage has a hard time limit. Both
# stages run even when the first fails; the script fails when any probe failed. Each server's
# log is kept under ${TMPDIR:-/tmp}/swarmgate-reliability/ for a failure's post-mortem.
#
# Builds the dev binary exactly as `cargo test --workspace --all-targets` does (as
# scripts/sdk-tests.sh does), so after `make test`'s cargo run this is a no-op. Extra arguments go
# to every reliability.py run (e.g. `--seed 3`).
set -euo pipefail
cd "$(dirname "$0")/.."

CARGO=${CARGO:-cargo}
PYTHON=${PYTHON:-python3}
MODE=${RELIABILITY_MODE:-quick}
KEY=sk-reliability
LOGS=${TMPDIR:-/tmp}/swarmgate-reliability
NATS_URL=${NATS_URL:-nats://127.0.0.1:4222}
mkdir -p "$LOGS"

case $MODE in
  quick) SPEED=(--quick); LIMIT=300 ;;
  full) SPEED=(); LIMIT=1800 ;;
  *) echo "reliability: RELIABILITY_MODE is quick or full, not '$MODE'" >&2; exit 2 ;;
esac

$CARGO test --workspace --all-targets --no-run --quiet
BIN="${CARGO_TARGET_DIR:-target}/debug/swarmgate"

pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT

free_port() {
  "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# The bounds the probes of stage 1 meet, also on stage 2's first gateway: answers bounded as an
# operator bounds them (--default-max-tokens), and deadlines inside the probes' own 20 s wait,
# so that a request the bounds cannot serve in time gets its 504, not silence.
BOUNDED=(--api-key "$KEY" --max-concurrent-requests 2 --max-queued-requests 2
  --default-max-tokens 64 --first-token-timeout-secs 10 --request-timeout-secs 15)
PROBES=(auth fuzz disconnects overload slowloris)

# start NAME PORT ARGS...: a swarmgate process in the background, its pid in $started.
start() {
  local name=$1 port=$2
  shift 2
  SWARMGATE_LOG=info "$BIN" "$@" --port "$port" >"$LOGS/$name.log" 2>&1 &
  started=$!
  pids+=("$started")
}

# wait_for PID PORT PATH: until GET PATH answers 200 (2 minutes at most, while PID lives).
wait_for() {
  local pid=$1 port=$2 path=$3
  for _ in $(seq 1200); do
    kill -0 "$pid" 2>/dev/null || { echo "reliability: process $pid exited" >&2; return 1; }
    if "$PYTHON" - "$port" "$path" "$KEY" <<'EOF' 2>/dev/null; then return 0; fi
import sys, urllib.request
port, path, key = sys.argv[1:]
request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers={"Authorization": f"Bearer {key}"})
sys.exit(0 if urllib.request.urlopen(request, timeout=2).status == 200 else 1)
EOF
    sleep 0.1
  done
  echo "reliability: 127.0.0.1:$port$path not ready" >&2
  return 1
}

probe() {
  timeout --kill-after=10 "$LIMIT" "$PYTHON" loadtests/reliability.py "${SPEED[@]}" --api-key "$KEY" "$@"
}

failed=()

echo "reliability: swarmgate serve" >&2
port=$(free_port)
start serve "$port" serve --grpc-port 0 "${BOUNDED[@]}"
serve=$started
if wait_for "$serve" "$port" /health; then
  probe --base-url "http://127.0.0.1:$port" --pid "$serve" --admission-bound 4 \
    "${PROBES[@]}" "$@" || failed+=(serve)
  kill -0 "$serve" 2>/dev/null || { echo "reliability: serve died (log: $LOGS/serve.log)" >&2; failed+=(serve-died); }
else
  failed+=(serve-start)
fi
kill "$serve" 2>/dev/null || true

echo "reliability: gateways and two workers on $NATS_URL" >&2
cluster="reliability-$$-$RANDOM"
model=models/SmolLM2-135M-Instruct.Q4_1.gguf
workers=()
worker_ports=()
for id in w1 w2; do
  worker_ports+=("$(free_port)")
  start "worker-$id" "${worker_ports[-1]}" worker --nats "$NATS_URL" --cluster "$cluster" --worker-id "$id" \
    --model "$model" --kv-cache-mb 96 --threads 1 --heartbeat-ms 250 --registry-ttl-secs 2
  workers+=("$started")
done
# gateway NAME ARGS...: a gateway of the cluster in the background, its port in $port.
gateway() {
  local name=$1
  shift
  port=$(free_port)
  start "$name" "$port" gateway --nats "$NATS_URL" --cluster "$cluster" --model "$model" \
    --grpc-port 0 --registry-ttl-secs 2 --stream-timeout-secs 2 "$@"
}
gateway gateway-bounded "${BOUNDED[@]}"
bounded=$started bounded_port=$port
gateway gateway --api-key "$KEY"
default=$started default_port=$port
# Both workers serve, and the gateways see one (`/ready`); a heartbeat later they see both.
if wait_for "${workers[0]}" "${worker_ports[0]}" /health && wait_for "${workers[1]}" "${worker_ports[1]}" /health \
  && wait_for "$bounded" "$bounded_port" /ready && wait_for "$default" "$default_port" /ready && sleep 1; then
  probe --base-url "http://127.0.0.1:$bounded_port" --pid "$bounded" --admission-bound 4 \
    "${PROBES[@]}" "$@" || failed+=(gateway-bounded)
  kill -0 "$bounded" 2>/dev/null || { echo "reliability: the gateway died (log: $LOGS/gateway-bounded.log)" >&2; failed+=(gateway-died); }
  probe --base-url "http://127.0.0.1:$default_port" --pid "$default" --kill-pid "${workers[0]}" \
    worker-loss "$@" || failed+=(gateway)
else
  failed+=(gateway-start)
fi

if [ "${#failed[@]}" -gt 0 ]; then
  echo "reliability: failed: ${failed[*]} (logs: $LOGS)" >&2
  exit 1
fi
