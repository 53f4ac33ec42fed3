#!/usr/bin/env bash
# Makes sure the services the tests talk to are up on loopback: NATS with JetStream on 4222,
# Redis on 6379 and PostgreSQL on 5432 (trust authentication for local connections, user
# `postgres`). A service already listening is left alone; a missing one is installed from
# Debian's packages when needed and started in the background, keeping nothing on disk beyond a
# scratch directory.
set -euo pipefail

listening() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

wait_for() {
  local port=$1 name=$2
  for _ in $(seq 100); do
    listening "$port" && return 0
    sleep 0.1
  done
  echo "services: $name did not come up on 127.0.0.1:$port" >&2
  exit 1
}

apt() {
  if [ "$(id -u)" -eq 0 ]; then apt-get "$@"; else sudo apt-get "$@"; fi
}

install() {
  if ! command -v "$1" >/dev/null 2>&1 && [ ! -x "/usr/sbin/$1" ]; then
    echo "services: installing $2"
    apt install -y -q "$2" >/dev/null || { apt update -q >/dev/null && apt install -y -q "$2" >/dev/null; }
  fi
}

scratch=${TMPDIR:-/tmp}/swarmgate-services
mkdir -p "$scratch"

if listening 4222; then
  echo "services: nats up"
else
  install nats-server nats-server
  PATH=$PATH:/usr/sbin nats-server -a 127.0.0.1 -p 4222 -js -sd "$scratch/nats" >"$scratch/nats.log" 2>&1 &
  wait_for 4222 nats-server
  echo "services: nats started"
fi

if listening 6379; then
  echo "services: redis up"
else
  install redis-server redis-server
  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no \
    --dir "$scratch" --logfile "$scratch/redis.log"
  wait_for 6379 redis-server
  echo "services: redis started"
fi

if listening 5432; then
  echo "services: postgresql up"
else
  pg_bin() { ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1; }
  if [ -z "$(pg_bin)" ]; then
    echo "services: installing postgresql"
    apt install -y -q postgresql >/dev/null || { apt update -q >/dev/null && apt install -y -q postgresql >/dev/null; }
  fi
  bin=$(pg_bin)
  # Installing the package may start Debian's own cluster on 5432, which asks for passwords;
  # the tests' cluster trusts loopback, so it takes the port instead.
  if listening 5432 && command -v pg_ctlcluster >/dev/null 2>&1; then
    pg_ctlcluster "$(basename "$(dirname "$bin")")" main stop || true
  fi
  # PostgreSQL refuses to run as root; the package's `postgres` user runs it then.
  as_owner() { if [ "$(id -u)" -eq 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }
  data="$scratch/postgres"
  if [ ! -s "$data/PG_VERSION" ]; then
    mkdir -p "$data"
    [ "$(id -u)" -ne 0 ] || chown postgres "$data"
    as_owner "$bin/initdb" -D "$data" -U postgres -A trust >"$scratch/postgres-init.log" 2>&1
  fi
  as_owner "$bin/pg_ctl" -D "$data" -l "$data/server.log" -w \
    -o "-h 127.0.0.1 -p 5432 -k $data" start >/dev/null
  wait_for 5432 postgresql
  echo "services: postgresql started"
fi
