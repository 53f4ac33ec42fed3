#!/usr/bin/env bash
# The GPU check: the CUDA build against the CPU path and against llama.cpp's figures, on a GPU
# machine lent for a few minutes, which has no Rust toolchain and no network and takes at most
# 64 MiB per call. Everything is prepared here; the machine runs this same script.
#
#   scripts/gpu-check.sh prepare      here: the CUDA binary (make build-cuda) and the model split
#                                     into parts under 60 MiB, in gpu/ (git-ignored); prints the
#                                     calls to make, one per part, each carrying one file
#   scripts/gpu-check.sh receive      there: keeps what this call carried (gpu/*) in $GPU_CHECK_DIR
#                                     for the next calls (a warm machine keeps /tmp between calls)
#   scripts/gpu-check.sh run          there: joins the model, checks its SHA-256, then runs
#                                       - swarmgate device-check (GPU logits vs the CPU kernels,
#                                         greedy continuations, batch invariance on the GPU),
#                                       - swarmgate bench at 1,16,64,256 streams,
#                                       - swarmgate bench --scenario shared-prefix with a KV
#                                         budget small enough for the host tier to be used,
#                                     and writes $OUT/gpu-check.json (one summary) and the logs
#   scripts/gpu-check.sh dry-run      here: prepare, receive and run against a local directory,
#                                     up to the point where the GPU is needed
#
# GPU_CHECK_DEVICE (default cuda:0) and GPU_CHECK_BIN choose the device and binary; with
# GPU_CHECK_DEVICE=cpu and the CPU build the whole run works here, smaller (GPU_CHECK_SMALL=1).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${GPU_CHECK_DIR:-/tmp/gpu}
DEVICE=${GPU_CHECK_DEVICE:-cuda:0}
MODEL=SmolLM2-135M-Instruct.Q4_1.gguf
PART_SIZE=60M
# llama.cpp on the H200 with this GGUF (CUDA build for sm_90, -ngl 99), 2026-12-04: llama-bench
# tg128 single stream, and llama-batched-bench aggregate decode (128-token prompts, 128 generated).
PEER='{"single_stream_tg128": 958, "batched_decode": {"1": 746, "16": 4445, "64": 10724, "256": 19040}}'

prepare() {
  make build-cuda
  rm -rf gpu && mkdir -p gpu
  cp target/cuda/release/swarmgate gpu/swarmgate
  split -b "$PART_SIZE" -d "models/$MODEL" "gpu/$MODEL.part-"
  echo "prepared gpu/ ($(du -sh gpu | cut -f1)):"
  ls -l gpu
  echo
  echo "On the GPU machine, back to back (each carries one file; the last one runs the check):"
  local files=(gpu/swarmgate gpu/"$MODEL".part-*)
  local last=$(( ${#files[@]} - 1 ))
  for i in "${!files[@]}"; do
    if [ "$i" -lt "$last" ]; then
      echo "  carry [\"${files[$i]}\"]  command: scripts/gpu-check.sh receive"
    else
      echo "  carry [\"${files[$i]}\"]  command: scripts/gpu-check.sh receive && scripts/gpu-check.sh run"
    fi
  done
}

receive() {
  mkdir -p "$DIR"
  for f in gpu/*; do
    [ -f "$f" ] && cp "$f" "$DIR/" && echo "received $(basename "$f") ($(stat -c %s "$f") bytes)"
  done
  ls -l "$DIR"
}

# The CUDA 13 libraries the binary needs: the machine's driver, and cuBLAS/cudart/cuRAND from
# wherever a CUDA 13 install keeps them there.
cuda_libraries() {
  local dirs=() d
  for d in ${GPU_CHECK_LIBS:-} /usr/local/nvidia/lib64 /usr/local/nvidia/lib \
           /opt/torch/.venv/lib/python3*/site-packages/nvidia/cu13/lib \
           /usr/local/cuda/lib64 /usr/local/cuda-13*/lib64 /usr/lib/x86_64-linux-gnu; do
    [ -d "$d" ] && dirs+=("$d")
  done
  local IFS=:
  echo "${dirs[*]}"
}

run() {
  local out=${OUT:-$DIR/out} bin=${GPU_CHECK_BIN:-$DIR/swarmgate} model=$DIR/$MODEL
  mkdir -p "$out"
  if [ ! -f "$model" ]; then cat "$DIR/$MODEL".part-* > "$model"; fi
  (cd "$DIR" && grep " $MODEL\$" "$OLDPWD/models.sha256" | sha256sum --check --quiet) \
    || { echo "the joined model's SHA-256 does not match models.sha256"; exit 1; }
  chmod +x "$bin"
  export LD_LIBRARY_PATH=$(cuda_libraries)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export SWARMGATE_MODEL=$model SWARMGATE_LOG=warn
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv \
    > "$out/nvidia-smi.csv" 2>&1 || echo "no nvidia-smi" > "$out/nvidia-smi.csv"

  local levels=1,16,64,256 prompts=16 tokens=32 requests=() sp_requests=48
  if [ -n "${GPU_CHECK_SMALL:-}" ]; then
    levels=1,4; prompts=3; tokens=8; requests=(--requests 4); sp_requests=8
  fi
  local status=pass
  echo "== device-check on $DEVICE"
  timeout 120 "$bin" device-check --device "$DEVICE" --prompts "$prompts" --tokens "$tokens" \
    > "$out/device-check.json" 2> "$out/device-check.log" || status=fail
  tail -3 "$out/device-check.log"
  if [ ! -s "$out/device-check.json" ]; then
    echo "device-check gave no report: the device did not run (see $out/device-check.log)"
    echo '{}' > "$out/device-check.json"; status=fail
  fi

  # 256 streams of 128 tokens after ~40-token prompts: every stream runs at once, prefills in
  # steps of up to 4096 tokens, and the KV pool holds them all (4 GiB: ~90k tokens).
  local engine=(--device "$DEVICE" --max-running 256 --max-step-tokens 4096 --kv-cache-mb 4096)
  echo "== bench sweep at $levels"
  if [ "$status" = pass ]; then
    timeout 300 "$bin" bench --concurrency "$levels" --max-tokens 128 "${requests[@]}" --json \
      "${engine[@]}" > "$out/sweep.jsonl" 2> "$out/sweep.log" || status=fail
  fi
  touch "$out/sweep.jsonl"
  # 64 device blocks (1024 tokens) for 4 agents' prompts and conversations: evictions to the
  # host tier, hits there, and swaps.
  echo "== bench shared-prefix with a small device pool"
  if [ "$status" = pass ]; then
    timeout 120 "$bin" bench --scenario shared-prefix --requests "$sp_requests" --json \
      --device "$DEVICE" --device-kv-blocks 64 > "$out/shared-prefix.jsonl" \
      2> "$out/shared-prefix.log" || status=fail
  fi
  touch "$out/shared-prefix.jsonl"

  local smi
  smi=$(tail -n +2 "$out/nvidia-smi.csv" | head -1 | sed 's/"/\\"/g')
  {
    echo "{"
    echo "  \"date\": \"$(date -u +%Y-%m-%dT%H:%M:%SZ)\","
    echo "  \"device\": \"$DEVICE\", \"gpu\": \"$smi\", \"status\": \"$status\","
    echo "  \"device_check\": $(cat "$out/device-check.json"),"
    echo "  \"sweep\": [$(paste -sd, "$out/sweep.jsonl")],"
    echo "  \"shared_prefix\": [$(paste -sd, "$out/shared-prefix.jsonl")],"
    echo "  \"peer_llama_cpp\": $PEER"
    echo "}"
  } > "$out/gpu-check.json"
  echo "== summary: $out/gpu-check.json ($status)"
  cat "$out/gpu-check.json"
  [ "$status" = pass ]
}

dry_run() {
  prepare
  local dir toolkit=${CUDA_TOOLKIT:-$HOME/.cache/cuda13}/cuda13/lib
  dir=$(mktemp -d)
  DIR=$dir receive > /dev/null
  # Here the driver library is the toolkit's link-time stand-in, which answers "no device".
  mkdir -p "$dir/driver" && ln -s "$toolkit/stubs/libcuda.so" "$dir/driver/libcuda.so.1"
  echo "== the run, here, without a GPU: it must stop where the GPU is needed"
  if DIR=$dir OUT=$dir/out GPU_CHECK_LIBS="$toolkit $dir/driver" run; then
    echo "dry run: the check passed, so a GPU was here"
  else
    grep -h "cuda" "$dir/out/device-check.log" | tail -2
    echo "dry run: everything up to the GPU worked; the device did not open, as expected here"
  fi
  rm -rf "$dir"
}

case "${1:-}" in
  prepare) prepare ;;
  receive) receive ;;
  run) run ;;
  dry-run) dry_run ;;
  *) sed -n '2,24p' "$0"; exit 2 ;;
esac
