#!/usr/bin/env bash
# The tool-agents benchmark: the same agent workload (`swarmgate loadgen --scenario tool-agents`)
# against swarmgate with retention and run scheduling on, with both off, and against llama.cpp's
# llama-server on the same GGUF when LLAMA_SERVER names its binary; reports and a chart in OUT.
#
# The device pool is sized at half of what all runs' contexts need (POOL_BLOCKS, 16-token
# blocks; 24 runs of 6 turns end near 57,700 tokens, 3,600 blocks), so that they cannot all
# stay on the device at once. Everything listens on 127.0.0.1.
#
#   scripts/bench-tool-agents.sh                  # after `make build`
#   RUNS=8 TURNS=4 TOOL_WORDS=60 POOL_BLOCKS=160 scripts/bench-tool-agents.sh   # a smaller run
#   LLAMA_SERVER=/path/to/llama-server scripts/bench-tool-agents.sh
#   SPECULATIVE=1 scripts/bench-tool-agents.sh   # the "on" runs also send speculative_prefill
#   ACTIVE_RUNS=0 scripts/bench-tool-agents.sh    # "on" without a bound on runs in progress
#   HOST_MB=0 scripts/bench-tool-agents.sh        # both without the host tier: what is evicted
#                                                 # from the device is recomputed, as in engines
#                                                 # that keep no KV in CPU RAM
set -euo pipefail
cd "$(dirname "$0")/.."

BIN=${BIN:-./target/release/swarmgate}
MODEL=${MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
OUT=${OUT:-target/bench-tool-agents}
RUNS=${RUNS:-24}
TURNS=${TURNS:-6}
PAUSE=${PAUSE:-1}
MAX_TOKENS=${MAX_TOKENS:-48}
TOOL_WORDS=${TOOL_WORDS:-120}
POOL_BLOCKS=${POOL_BLOCKS:-1800}
PORT=${PORT:-8095}
# With run scheduling, runs in progress at once. On 2 cores each follow-up then waits behind
# fewer others; the whole job takes longer than with 12 (more, smaller steps), but the median run
# finishes about as soon or sooner (Xeon: 6: follow-up TTFT 0.41-0.46x of "off", JCT 0.60-0.65x;
# 12: 0.41-0.63x and 0.59-0.73x; EPYC: 6: 0.32-0.41x and 0.54-0.74x; 4: 0.25x, 0.67x; 8: 0.43x,
# 0.72x; 12: 0.40x, 0.73x; EPYC Zen 5: 6: 0.34-0.40x, 0.66-0.74x; and with --max-step-tokens
# 512, 5: 0.33x, 0.87x; 7: 0.35x, 0.68x; 8: 0.54x, 0.83x).
ACTIVE_RUNS=${ACTIVE_RUNS:-6}
# The host tier's size in MiB for both swarmgate runs (empty: the server's default, 2048, which
# holds every block the device evicts here, so that "off" reloads instead of recomputing).
HOST_MB=${HOST_MB:-}
mkdir -p "$OUT"
host_flags=()
[ -z "$HOST_MB" ] || host_flags=(--host-kv-cache-mb "$HOST_MB")

wait_ready() {
  for _ in $(seq 1 120); do
    curl -sf "http://127.0.0.1:$PORT/$1" >/dev/null 2>&1 && return 0
    sleep 0.5
  done
  echo "the server on :$PORT did not come up" >&2
  return 1
}

loadgen() { # label, report, extra flags
  local label=$1 report=$2
  shift 2
  "$BIN" loadgen --scenario tool-agents --url "http://127.0.0.1:$PORT" --runs "$RUNS" \
    --turns "$TURNS" --pause-median-secs "$PAUSE" --max-tokens "$MAX_TOKENS" --tool-result-words "$TOOL_WORDS" \
    --label "$label" --out "$OUT/$report" --timeout-secs 600 "$@"
}

swarmgate() { # label, report name, on|off (retention and run scheduling), loadgen flags
  local label=$1 report=$2 on=$3 ttl=30 runs=true active=$ACTIVE_RUNS
  shift 3
  [ "$on" = on ] || { ttl=0; runs=false; active=0; }
  "$BIN" serve --host 127.0.0.1 --port "$PORT" --grpc-port 0 --model "$MODEL" \
    --device-kv-blocks "$POOL_BLOCKS" --run-scheduling "$runs" --tool-kv-ttl-max-secs "$ttl" \
    --max-active-runs "$active" "${host_flags[@]}" \
    --first-token-timeout-secs 600 \
    >"$OUT/$report.log" 2>&1 &
  local pid=$!
  wait_ready ready
  loadgen "$label" "$report.json" "$@"
  kill "$pid" && wait "$pid" 2>/dev/null || true
}

swarmgate "swarmgate, both off" off off
on_flags=()
[ -z "${SPECULATIVE:-}" ] || on_flags=(--speculative-prefill)
swarmgate "swarmgate, both on" on on --baseline "$OUT/off.json" --png "$OUT/tool-agents.png" "${on_flags[@]}"
if [ -n "${LLAMA_SERVER:-}" ]; then
  # One slot per run, each with a context that holds a whole run (-c is split among the slots).
  "$LLAMA_SERVER" -m "$MODEL" --host 127.0.0.1 --port "$PORT" --jinja -t 2 --no-repack \
    -np "$RUNS" -c $((RUNS * 2048)) -cb >"$OUT/llama-server.log" 2>&1 &
  pid=$!
  wait_ready health
  loadgen "llama-server" llama-server.json --baseline "$OUT/off.json" --baseline "$OUT/on.json" \
    --png "$OUT/tool-agents.png"
  kill "$pid" && wait "$pid" 2>/dev/null || true
fi
