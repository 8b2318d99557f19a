#!/usr/bin/env bash
# An SQS-compatible server for development and tests, on 127.0.0.1:9324.
#
#   scripts/sqs.sh up        install the server if it is missing, start it, wait until it answers
#   scripts/sqs.sh down      stop it (by PID)
#   scripts/sqs.sh status
#   scripts/sqs.sh bin       print the server's executable (installing it if needed), for tests that start their own
#
# The server is moto's (PyPI `moto[server]`, pinned below), a stand-in for Amazon SQS: idem's SQS source reads its
# endpoint, region and credentials from the standard AWS configuration, so the same tests run against real SQS
# when IDEM_SQS_ENDPOINT or the AWS_* variables point there. It is installed once into a virtual environment in
# $IDEM_TOOLS_DIR/moto-$VERSION (default $HOME/.cache/idem-tools), outside the checkout; its PID file and log live
# in $IDEM_SQS_STATE (default $HOME/.cache/idem-sqs). With IDEM_SQS_ENDPOINT set, nothing is started here.
set -euo pipefail

VERSION=5.2.1
TOOLS_DIR=${IDEM_TOOLS_DIR:-$HOME/.cache/idem-tools}
VENV=$TOOLS_DIR/moto-$VERSION
STATE=${IDEM_SQS_STATE:-$HOME/.cache/idem-sqs}
PORT=${IDEM_SQS_PORT:-9324}
PIDFILE=$STATE/moto.pid

server_binary() {
  if [ -x "$VENV/bin/moto_server" ] && "$VENV/bin/python" -c "import moto, flask" 2>/dev/null; then
    echo "$VENV/bin/moto_server"
    return
  fi
  echo "installing moto[server] $VERSION into $VENV (about a minute, done once)…" >&2
  local started=$SECONDS
  rm -rf "$VENV"
  python3 -m venv "$VENV" >&2
  "$VENV/bin/pip" install --quiet --disable-pip-version-check "moto[server]==$VERSION" >&2
  echo "moto installed in $((SECONDS - started)) s" >&2
  echo "$VENV/bin/moto_server"
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
    echo "SQS server already running on 127.0.0.1:$PORT (pid $(running_pid))"
    return
  fi
  if answering; then
    echo "something else already listens on 127.0.0.1:$PORT; using it as the SQS server"
    return
  fi
  local bin
  bin=$(server_binary)
  mkdir -p "$STATE"
  nohup "$bin" -H 127.0.0.1 -p "$PORT" > "$STATE/server.log" 2>&1 &
  echo $! > "$PIDFILE"
  for _ in $(seq 1 60); do
    if answering; then
      echo "SQS server up on 127.0.0.1:$PORT (pid $(cat "$PIDFILE"), log $STATE/server.log)"
      return
    fi
    if ! running_pid >/dev/null; then
      echo "the SQS server exited at start; its log:" >&2
      tail -n 30 "$STATE/server.log" >&2
      exit 1
    fi
    sleep 0.5
  done
  echo "the SQS server did not answer on 127.0.0.1:$PORT within 30 s; see $STATE/server.log" >&2
  exit 1
}

down() {
  local pid
  if ! pid=$(running_pid); then
    echo "SQS server not running"
    rm -f "$PIDFILE"
    return
  fi
  kill -TERM "$pid"
  for _ in $(seq 1 40); do
    kill -0 "$pid" 2>/dev/null || { rm -f "$PIDFILE"; echo "SQS server stopped"; return; }
    sleep 0.25
  done
  kill -KILL "$pid" 2>/dev/null || true
  rm -f "$PIDFILE"
  echo "SQS server killed after 10 s"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  bin) server_binary ;;
  status) if running_pid >/dev/null && answering; then echo "running (pid $(running_pid))"; else echo "not running"; exit 1; fi ;;
  *) echo "usage: scripts/sqs.sh up|down|status|bin" >&2; exit 2 ;;
esac
