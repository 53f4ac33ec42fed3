#!/usr/bin/env bash
# Runs the real-client suite (tests/python): the official OpenAI Python SDK against a
# `swarmgate serve` started by the suite's fixtures.
#
# Installs the pinned requirements into .venv (once: later runs skip pip when nothing changed),
# builds the dev binary exactly as `cargo test --workspace --all-targets` does (a plain `cargo
# build` would resolve features without the dev-dependencies and rebuild half the workspace), so
# after `make test`'s cargo run this is a no-op, then runs pytest. Each request has a 60 s
# client timeout and the whole run at most 15 minutes, so a stuck server fails the run instead
# of hanging it. Extra arguments go to pytest (e.g. `scripts/sdk-tests.sh -k embeddings`).
set -euo pipefail
cd "$(dirname "$0")/.."

CARGO=${CARGO:-cargo}
VENV=.venv
REQUIREMENTS=tests/python/requirements.txt
STAMP=$VENV/.sdk-requirements

if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
if ! cmp -s "$REQUIREMENTS" "$STAMP"; then
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -r "$REQUIREMENTS"
  cp "$REQUIREMENTS" "$STAMP"
fi

$CARGO test --workspace --all-targets --no-run --quiet
export SWARMGATE_BIN="${CARGO_TARGET_DIR:-target}/debug/swarmgate"
case $SWARMGATE_BIN in /*) ;; *) SWARMGATE_BIN="$PWD/$SWARMGATE_BIN" ;; esac

export PYTHONDONTWRITEBYTECODE=1
exec timeout --kill-after=30 900 "$VENV/bin/python" -m pytest -q tests/python "$@"
