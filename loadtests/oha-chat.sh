#!/usr/bin/env bash
# A bounded HTTP load on a local Swarmgate: N non-streaming chat completions, C at a time.
#   loadtests/oha-chat.sh [N] [C] [URL]
# oha installs with `cargo install oha --locked`.
set -euo pipefail
n=${1:-200}
c=${2:-16}
url=${3:-http://127.0.0.1:8080}
case "$url" in
  http://127.0.0.1*|http://localhost*) ;;
  *) echo "refusing to load a non-local server: $url" >&2; exit 2 ;;
esac
body='{"model":"default","max_tokens":64,"temperature":0,"messages":[{"role":"user","content":"Give me three tips for sleeping better."}]}'
exec oha -n "$n" -c "$c" --no-tui -m POST \
  -H 'content-type: application/json' -d "$body" \
  "$url/v1/chat/completions"
