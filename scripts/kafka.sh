#!/usr/bin/env bash
# A Kafka-compatible broker for development and tests, on 127.0.0.1:9092.
#
#   scripts/kafka.sh up      install the broker if it is missing, start it, wait until it answers
#   scripts/kafka.sh down    stop it (by PID)
#   scripts/kafka.sh status
#
# The broker is nisshi 0.7.0-pre.2 (a Kafka-compatible broker written in Rust). It is used from, in order:
# $NISSHI_BIN; the install directory $IDEM_TOOLS_DIR/nisshi-0.7.0-pre.2/bin/nisshi (default
# $HOME/.cache/idem-tools); or it is installed there with `cargo install` (about 20 minutes on 2 cores, once).
# Its data and PID file live in $IDEM_KAFKA_STATE (default $HOME/.cache/idem-kafka), outside the checkout.
# With IDEM_KAFKA_BROKERS set, the tests use that cluster instead and nothing is started here.
set -euo pipefail

VERSION=0.7.0-pre.2
TOOLS_DIR=${IDEM_TOOLS_DIR:-$HOME/.cache/idem-tools}
INSTALL_ROOT=$TOOLS_DIR/nisshi-$VERSION
STATE=${IDEM_KAFKA_STATE:-$HOME/.cache/idem-kafka}
PORT=9092
PIDFILE=$STATE/nisshi.pid

if [ -f "$HOME/.cargo/env" ]; then . "$HOME/.cargo/env"; fi

broker_binary() {
  if [ -n "${NISSHI_BIN:-}" ] && [ -x "$NISSHI_BIN" ]; then echo "$NISSHI_BIN"; return; fi
  if [ -x "$INSTALL_ROOT/bin/nisshi" ]; then echo "$INSTALL_ROOT/bin/nisshi"; return; fi
  echo "installing nisshi $VERSION into $INSTALL_ROOT (about 20 minutes, done once)…" >&2
  local started=$SECONDS
  cargo install nisshi --version "$VERSION" --locked --no-default-features --features dynostore,libsql \
    --root "$INSTALL_ROOT" >&2
  echo "nisshi installed in $((SECONDS - started)) s" >&2
  echo "$INSTALL_ROOT/bin/nisshi"
}

answering() {
  (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null
}

running_pid() {
  [ -f "$PIDFILE" ] || return 1
  local pid
  pid=$(cat "$PIDFILE")
  kill -0 "$pid" 2>/dev/null && echo "$pid"
}

up() {
  if running_pid >/dev/null && answering; then
    echo "broker already running on 127.0.0.1:$PORT (pid $(running_pid))"
    return
  fi
  if answering; then
    echo "something else already listens on 127.0.0.1:$PORT; using it as the broker"
    return
  fi
  local bin
  bin=$(broker_binary)
  mkdir -p "$STATE/data"
  cd "$STATE/data"
  : > .env
  nohup "$bin" broker \
    --listener-url "tcp://127.0.0.1:$PORT" \
    --advertised-listener-url "tcp://127.0.0.1:$PORT" \
    --storage-engine sqlite://nisshi.db > "$STATE/broker.log" 2>&1 &
  echo $! > "$PIDFILE"
  for _ in $(seq 1 60); do
    if answering; then
      echo "broker up on 127.0.0.1:$PORT (pid $(cat "$PIDFILE"), log $STATE/broker.log)"
      return
    fi
    if ! running_pid >/dev/null; then
      echo "the broker exited at start; its log:" >&2
      tail -n 30 "$STATE/broker.log" >&2
      exit 1
    fi
    sleep 0.5
  done
  echo "the broker did not answer on 127.0.0.1:$PORT within 30 s; see $STATE/broker.log" >&2
  exit 1
}

down() {
  local pid
  if ! pid=$(running_pid); then
    echo "broker not running"
    rm -f "$PIDFILE"
    return
  fi
  kill -TERM "$pid"
  for _ in $(seq 1 40); do
    kill -0 "$pid" 2>/dev/null || { rm -f "$PIDFILE"; echo "broker stopped"; return; }
    sleep 0.25
  done
  kill -KILL "$pid" 2>/dev/null || true
  rm -f "$PIDFILE"
  echo "broker killed after 10 s"
}

# Stops the broker and deletes its data: the next `up` starts empty (the broker slows down as its store grows).
reset() {
  down
  rm -rf "$STATE/data"
  echo "broker data removed"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  reset) reset ;;
  status) if running_pid >/dev/null && answering; then echo "running (pid $(running_pid))"; else echo "not running"; exit 1; fi ;;
  *) echo "usage: scripts/kafka.sh up|down|reset|status" >&2; exit 2 ;;
esac
