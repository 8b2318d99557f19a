#!/usr/bin/env bash
# Runs `idem-bench` with everything it needs: a virtualenv with psycopg 3 for the reference handler (installed
# once, in ~/.cache/idem-tools/bench-venv), the Kafka-compatible broker (scripts/kafka.sh), Google's Pub/Sub
# emulator (scripts/pubsub.sh), a release build.
#
#   bench/run.sh            the full benchmark (about 25 minutes on 2 cores)
#   bench/run.sh --quick    a small version: checks that every leg runs and totals are right
#
# Extra arguments go to `idem-bench` (see `idem-bench --help`).
set -euo pipefail
cd "$(dirname "$0")/.."

venv="${IDEM_BENCH_VENV:-$HOME/.cache/idem-tools/bench-venv}"
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import psycopg" 2>/dev/null; then
    echo "bench: installing psycopg 3 into $venv" >&2
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet "psycopg[binary]>=3.1,<4"
fi

brokers="${IDEM_KAFKA_BROKERS:-}"
if [ -z "$brokers" ]; then
    scripts/kafka.sh up >&2
    brokers=127.0.0.1:9092
fi

cargo build --release -p idem-bench >&2
# NATS JetStream and RabbitMQ: the machine's servers unless IDEM_NATS_URL / IDEM_RABBITMQ_URL name others.
nats="${IDEM_NATS_URL:-nats://127.0.0.1:4222}"
rabbitmq="${IDEM_RABBITMQ_URL:-amqp://guest:guest@127.0.0.1:5672/%2f}"
# Google Pub/Sub: the emulator at IDEM_PUBSUB_EMULATOR_HOST, or the project's own (scripts/pubsub.sh); its legs
# measure the emulator.
if [ -z "${IDEM_PUBSUB_EMULATOR_HOST:-}" ]; then
    scripts/pubsub.sh up >&2
fi
export PUBSUB_EMULATOR_HOST="${IDEM_PUBSUB_EMULATOR_HOST:-127.0.0.1:8681}"
# MySQL/MariaDB: the machine's server unless IDEM_BENCH_MYSQL names another database.
mysql="${IDEM_BENCH_MYSQL:-mysql://root@127.0.0.1:3306/test}"
exec target/release/idem-bench --python "$venv/bin/python" --kafka "$brokers" --nats "$nats" --rabbitmq "$rabbitmq" \
    --pubsub idem-bench --mysql "$mysql" "$@"
