#!/usr/bin/env bash
# Runs the real-client suites (tests/python) against a `swarmgate serve` that each suite's
# fixtures start: the official OpenAI Python SDK (the `main` suite: everything but
# tests/python/frameworks/), then each agent framework, unmodified (openai-agents, pydantic-ai,
# instructor, langchain: tests/python/frameworks/test_*.py).
#
# Each suite has its own virtual environment, because the frameworks' pins conflict (instructor
# needs an older openai than the others) and pip's resolver stalls on all of them together:
# `main` in .venv from tests/python/requirements.txt, each framework in .venv/frameworks/NAME
# from tests/python/frameworks/NAME.txt, which pins every package so that pip has nothing to
# resolve. An environment is installed once; later runs skip pip while its pins are unchanged.
# A framework's tests would be skipped in an environment without it; here each suite's runs
# must import it (SDK_TESTS_FRAMEWORKS), so none is skipped silently.
#
# Builds the dev binary exactly as `cargo test --workspace --all-targets` does (a plain `cargo
# build` would resolve features without the dev-dependencies and rebuild half the workspace), so
# after `make test`'s cargo run this is a no-op. Each request has a 60 s client timeout, the
# `main` suite at most 15 minutes and each framework's at most 5, so a stuck server fails the
# run instead of hanging it. Every selected suite runs even when one before it failed; the
# script fails if any did.
#
# SDK_SUITES picks suites (default: all of them), e.g. `SDK_SUITES="main langchain"`. Extra
# arguments go to pytest in every suite (e.g. `scripts/sdk-tests.sh -k stream`); a suite that
# they leave without tests passes.
set -euo pipefail
cd "$(dirname "$0")/.."

CARGO=${CARGO:-cargo}
SUITES=${SDK_SUITES:-main openai-agents pydantic-ai instructor langchain}
FRAMEWORKS=tests/python/frameworks

# Each framework suite: its test file, and the module it must import.
declare -A TESTS=(
  [openai-agents]=test_openai_agents.py
  [pydantic-ai]=test_pydantic_ai.py
  [instructor]=test_instructor.py
  [langchain]=test_langchain.py
)
declare -A MODULES=(
  [openai-agents]=agents
  [pydantic-ai]=pydantic_ai
  [instructor]=instructor
  [langchain]=langchain_openai
)

venv_of() {
  if [ "$1" = main ]; then echo .venv; else echo ".venv/frameworks/$1"; fi
}

requirements_of() {
  if [ "$1" = main ]; then echo tests/python/requirements.txt; else echo "$FRAMEWORKS/$1.txt"; fi
}

install() {
  local venv requirements stamp
  venv=$(venv_of "$1")
  requirements=$(requirements_of "$1")
  stamp=$venv/.sdk-requirements
  if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
  fi
  if ! cmp -s "$requirements" "$stamp"; then
    echo "sdk-tests: installing $requirements into $venv" >&2
    "$venv/bin/python" -m pip install -q --disable-pip-version-check -r "$requirements"
    cp "$requirements" "$stamp"
  fi
}

for suite in $SUITES; do
  if [ "$suite" != main ] && [ -z "${TESTS[$suite]:-}" ]; then
    echo "sdk-tests: unknown suite '$suite' (known: main ${!TESTS[*]})" >&2
    exit 2
  fi
  install "$suite"
done

$CARGO test --workspace --all-targets --no-run --quiet
export SWARMGATE_BIN="${CARGO_TARGET_DIR:-target}/debug/swarmgate"
case $SWARMGATE_BIN in /*) ;; *) SWARMGATE_BIN="$PWD/$SWARMGATE_BIN" ;; esac
export PYTHONDONTWRITEBYTECODE=1

failed=()
for suite in $SUITES; do
  python=$(venv_of "$suite")/bin/python
  if [ "$suite" = main ]; then
    limit=900
    targets=(tests/python --ignore="$FRAMEWORKS")
    required=
  else
    limit=300
    targets=("$FRAMEWORKS/${TESTS[$suite]}")
    required=${MODULES[$suite]}
  fi
  echo "sdk-tests: suite $suite" >&2
  status=0
  SDK_TESTS_FRAMEWORKS=$required timeout --kill-after=30 "$limit" \
    "$python" -m pytest -q "${targets[@]}" "$@" || status=$?
  # 5: no tests collected, which only arguments that deselect a whole suite may cause.
  if [ "$status" -ne 0 ] && ! { [ "$status" -eq 5 ] && [ "$#" -gt 0 ]; }; then
    failed+=("$suite")
  fi
done

if [ "${#failed[@]}" -gt 0 ]; then
  echo "sdk-tests: failed suites: ${failed[*]}" >&2
  exit 1
fi
