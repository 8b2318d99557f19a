#!/usr/bin/env bash
# Google's Pub/Sub emulator for development and tests, on 127.0.0.1:8681 (the project's own instance, never a
# shared one).
#
#   scripts/pubsub.sh up        install the emulator if it is missing, start it, wait until it answers
#   scripts/pubsub.sh down      stop it (by PID)
#   scripts/pubsub.sh reset     stop it and start a fresh one (nothing kept; no closed streams left spinning)
#   scripts/pubsub.sh status
#   scripts/pubsub.sh bin       print the emulator's launcher (installing it if needed), for tests that start
#                               their own instance (the restart test kills it with SIGKILL)
#
# The emulator is Debian's `google-cloud-cli-pubsub-emulator` (Java 17) beside `gcloud`; it keeps everything in
# memory. idem reaches it through PUBSUB_EMULATOR_HOST=127.0.0.1:8681, as Google's clients do; without that
# variable idem talks to the real service with the standard Google credentials. Its PID file and log live in
# $IDEM_PUBSUB_STATE (default $HOME/.cache/idem-pubsub). With IDEM_PUBSUB_EMULATOR_HOST set, nothing is started.
set -euo pipefail

STATE=${IDEM_PUBSUB_STATE:-$HOME/.cache/idem-pubsub}
PORT=${IDEM_PUBSUB_PORT:-8681}
PIDFILE=$STATE/emulator.pid

launcher() {
  local sdk
  for sdk in /usr/lib/google-cloud-sdk /usr/share/google-cloud-sdk "$(dirname "$(readlink -f "$(command -v gcloud 2>/dev/null || echo /nonexistent)")")/.."; do
    if [ -x "$sdk/platform/pubsub-emulator/bin/cloud-pubsub-emulator" ]; then
      echo "$sdk/platform/pubsub-emulator/bin/cloud-pubsub-emulator"
      return
    fi
  done
  echo "installing google-cloud-cli-pubsub-emulator (Google's apt repository, done once)…" >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
    google-cloud-cli-pubsub-emulator openjdk-17-jre-headless >&2
  echo /usr/lib/google-cloud-sdk/platform/pubsub-emulator/bin/cloud-pubsub-emulator
}

answering() {
  curl -fsS -o /dev/null --max-time 2 "http://127.0.0.1:$PORT/" 2>/dev/null
}

running_pid() {
  [ -f "$PIDFILE" ] || return 1
  local pid
  pid=$(cat "$PIDFILE")
  kill -0 "$pid" 2>/dev/null && echo "$pid"
}

up() {
  if [ -n "${IDEM_PUBSUB_EMULATOR_HOST:-}" ]; then
    echo "using the Pub/Sub emulator at $IDEM_PUBSUB_EMULATOR_HOST"
    return
  fi
  if running_pid >/dev/null && answering; then
    echo "Pub/Sub emulator already running on 127.0.0.1:$PORT (pid $(running_pid))"
    return
  fi
  if answering; then
    echo "something else already answers on 127.0.0.1:$PORT; using it as the Pub/Sub emulator"
    return
  fi
  local bin
  bin=$(launcher)
  mkdir -p "$STATE"
  # setsid: the emulator (a shell launcher and its JVM) is its own process group, so `down` stops both. nice: the
  # emulator keeps a core busy for every streaming pull a client closed (it fails on the cancellation, see
  # docs/brokers.md), so it yields to the builds and tests around it.
  setsid nohup nice -n 19 "$bin" --host=127.0.0.1 --port="$PORT" > "$STATE/emulator.log" 2>&1 < /dev/null &
  echo $! > "$PIDFILE"
  for _ in $(seq 1 120); do
    if answering; then
      echo "Pub/Sub emulator up on 127.0.0.1:$PORT (pid $(cat "$PIDFILE"), log $STATE/emulator.log)"
      return
    fi
    if ! running_pid >/dev/null; then
      echo "the Pub/Sub emulator exited at start; its log:" >&2
      tail -n 30 "$STATE/emulator.log" >&2
      exit 1
    fi
    sleep 0.5
  done
  echo "the Pub/Sub emulator did not answer on 127.0.0.1:$PORT within 60 s; see $STATE/emulator.log" >&2
  exit 1
}

down() {
  local pid
  if ! pid=$(running_pid); then
    echo "Pub/Sub emulator not running"
    rm -f "$PIDFILE"
    return
  fi
  kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid"
  for _ in $(seq 1 40); do
    kill -0 "$pid" 2>/dev/null || { rm -f "$PIDFILE"; echo "Pub/Sub emulator stopped"; return; }
    sleep 0.25
  done
  kill -KILL -- "-$pid" 2>/dev/null || true
  rm -f "$PIDFILE"
  echo "Pub/Sub emulator killed after 10 s"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  reset) down; up ;;
  bin) launcher ;;
  status) if answering; then echo "running on 127.0.0.1:$PORT"; else echo "not running"; exit 1; fi ;;
  *) echo "usage: scripts/pubsub.sh up|down|reset|status|bin" >&2; exit 2 ;;
esac
