#!/usr/bin/env bash
# Runs idem's whole test suite: makes sure the services the tests use are up, then the tests (cargo-nextest, or
# `cargo test` where it is not installed).
# Kafka: the cluster at $IDEM_KAFKA_BROKERS, or scripts/kafka.sh starts a Kafka-compatible broker on 127.0.0.1:9092.
# SQS: the server at $IDEM_SQS_ENDPOINT (`aws` for the standard AWS configuration's), or scripts/sqs.sh starts an
# SQS-compatible server on 127.0.0.1:9324.
# Google Pub/Sub: the emulator at $IDEM_PUBSUB_EMULATOR_HOST, or scripts/pubsub.sh starts Google's emulator on
# 127.0.0.1:8681.
# NATS JetStream: the server at $IDEM_NATS_URL, or 127.0.0.1:4222 (started if it is stopped); RabbitMQ: the server
# at $IDEM_RABBITMQ_URL, or 127.0.0.1:5672 (started if it is stopped).
# PostgreSQL must be installed (127.0.0.1:5432, trust auth for user postgres); it is started if it is stopped.
# MySQL/MariaDB: the server at $IDEM_TEST_MYSQL, or 127.0.0.1:3306 (user root, no password; started if it is
# installed and stopped): the store conformance suite runs on it too.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -f "$HOME/.cargo/env" ]; then . "$HOME/.cargo/env"; fi

ensure_postgres() {
  if pg_isready -h 127.0.0.1 -p 5432 -q 2>/dev/null; then return 0; fi
  echo "starting PostgreSQL…"
  local version
  version=$(ls /etc/postgresql 2>/dev/null | sort -V | tail -n 1)
  if [ -z "$version" ]; then
    echo "PostgreSQL is not installed and not running on 127.0.0.1:5432; the tests need it" >&2
    exit 1
  fi
  pg_ctlcluster --skip-systemctl-redirect "$version" main start
  for _ in $(seq 1 30); do
    pg_isready -h 127.0.0.1 -p 5432 -q && return 0
    sleep 1
  done
  echo "PostgreSQL did not come up on 127.0.0.1:5432" >&2
  exit 1
}

# NATS with JetStream: the server at $IDEM_NATS_URL, or the machine's nats-server on 127.0.0.1:4222, started if it
# is installed and stopped.
ensure_nats() {
  if [ -n "${IDEM_NATS_URL:-}" ] || (exec 3<>/dev/tcp/127.0.0.1/4222) 2>/dev/null; then return 0; fi
  if [ ! -x /usr/sbin/nats-server ]; then
    echo "NATS is not running on 127.0.0.1:4222 and nats-server is not installed; the NATS tests need it" >&2
    exit 1
  fi
  echo "starting nats-server with JetStream…"
  start-stop-daemon --start --oknodo --background --exec /usr/sbin/nats-server -- \
    -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server -l /var/log/nats-server.log
  for _ in $(seq 1 30); do
    (exec 3<>/dev/tcp/127.0.0.1/4222) 2>/dev/null && return 0
    sleep 1
  done
  echo "nats-server did not come up on 127.0.0.1:4222" >&2
  exit 1
}

# RabbitMQ: the server at $IDEM_RABBITMQ_URL, or the machine's on 127.0.0.1:5672, started if it is stopped.
ensure_rabbitmq() {
  if [ -n "${IDEM_RABBITMQ_URL:-}" ] || (exec 3<>/dev/tcp/127.0.0.1/5672) 2>/dev/null; then return 0; fi
  if ! command -v rabbitmq-server >/dev/null 2>&1; then
    echo "RabbitMQ is not running on 127.0.0.1:5672 and rabbitmq-server is not installed; the RabbitMQ tests need it" >&2
    exit 1
  fi
  echo "starting rabbitmq-server…"
  rabbitmq-server -detached
  for _ in $(seq 1 60); do
    (exec 3<>/dev/tcp/127.0.0.1/5672) 2>/dev/null && return 0
    sleep 1
  done
  echo "rabbitmq-server did not come up on 127.0.0.1:5672" >&2
  exit 1
}

# MySQL or MariaDB: the server at $IDEM_TEST_MYSQL, or the machine's on 127.0.0.1:3306, started if it is stopped.
ensure_mysql() {
  if [ -n "${IDEM_TEST_MYSQL:-}" ] || (exec 3<>/dev/tcp/127.0.0.1/3306) 2>/dev/null; then return 0; fi
  if [ ! -x /etc/init.d/mariadb ] && [ ! -x /etc/init.d/mysql ]; then
    echo "MySQL/MariaDB is not running on 127.0.0.1:3306 and is not installed; the MySQL store tests need it" >&2
    exit 1
  fi
  echo "starting MariaDB…"
  if [ -x /etc/init.d/mariadb ]; then /etc/init.d/mariadb start; else /etc/init.d/mysql start; fi
  for _ in $(seq 1 30); do
    (exec 3<>/dev/tcp/127.0.0.1/3306) 2>/dev/null && return 0
    sleep 1
  done
  echo "MySQL/MariaDB did not come up on 127.0.0.1:3306" >&2
  exit 1
}

# The documentation first (seconds): the README stays short and every relative link resolves.
scripts/check-docs.sh
# What the tests use that the machine lacks (Debian's packages, Python and npm tools; skipped when there).
scripts/tools.sh
ensure_postgres
ensure_mysql
ensure_nats
ensure_rabbitmq
# Kafka: a cluster named by IDEM_KAFKA_BROKERS, or the project's broker on 127.0.0.1:9092 (scripts/kafka.sh).
if [ -z "${IDEM_KAFKA_BROKERS:-}" ]; then
  scripts/kafka.sh up
fi
# SQS: the server at $IDEM_SQS_ENDPOINT, or the project's local SQS-compatible server on 127.0.0.1:9324
# (scripts/sqs.sh installs it once outside the checkout).
if [ -z "${IDEM_SQS_ENDPOINT:-}" ]; then
  scripts/sqs.sh up
fi
# Google Pub/Sub: the emulator at $IDEM_PUBSUB_EMULATOR_HOST, or the project's own instance on 127.0.0.1:8681
# (scripts/pubsub.sh; Debian's google-cloud-cli-pubsub-emulator, installed if missing), started fresh and stopped
# at the end: the emulator keeps a core busy for every streaming pull a stopped consumer closed.
if [ -z "${IDEM_PUBSUB_EMULATOR_HOST:-}" ]; then
  scripts/pubsub.sh reset
  trap 'scripts/pubsub.sh down >/dev/null' EXIT
fi
# The property tests of the parsers of untrusted bytes run 1,024 cases each (PROPTEST_CASES raises it).
# cargo-nextest, where installed, runs the test binaries side by side (settings in .config/nextest.toml); else
# `cargo test`, one binary after the other. Arguments go to either (a filter, for example).
export PROPTEST_CASES="${PROPTEST_CASES:-1024}"
if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --all-targets --features idem-cli/full "$@"
else
  cargo test --workspace --all-targets --features idem-cli/full "$@"
fi
cargo test --workspace --doc --features idem-cli/full
# The examples run to their end and check their own results (order_sequence on PostgreSQL; orders_guarded
# exits non-zero on any order in a wrong final state). Built with the workspace's features, as the tests were
# (a no-op after them): `cargo run -p idem` would build idem again with its own.
cargo build --quiet --workspace --examples --features idem-cli/full
target/debug/examples/credit
target/debug/examples/orders_guarded
IDEM_DATABASE_URL="${IDEM_EXAMPLE_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/test}" \
  target/debug/examples/order_sequence
# The configuration examples (idem run, no Rust): the ledger exact, the outbox emits delivered by the relay.
bash examples/config/run.sh target/debug/idem
# The operator console in a real browser (Debian's Chromium and playwright-core, installed once if missing).
scripts/browser.sh target/debug/idem
# The systemd unit of deploy/, where systemd-analyze is installed (pointed at this build's binary).
if command -v systemd-analyze >/dev/null 2>&1; then
  unit_dir="$(mktemp -d)"
  sed "s|/usr/local/bin/idem|$PWD/target/debug/idem|g" deploy/systemd/idem@.service > "$unit_dir/idem@ledger.service"
  systemd-analyze verify "$unit_dir/idem@ledger.service" 2>&1 | grep -v "Unknown key 'Restart\(Steps\|MaxDelaySec\)'" || true
  systemd-analyze verify "$unit_dir/idem@ledger.service" >/dev/null 2>&1
  # Restarts are bounded and spaced: a unit failing fast stops instead of restarting every few seconds forever.
  for key in StartLimitBurst StartLimitIntervalSec RestartSteps RestartMaxDelaySec; do
    grep -q "^$key=" deploy/systemd/idem@.service || { echo "deploy/systemd/idem@.service lacks $key" >&2; exit 1; }
  done
  rm -rf "$unit_dir"
fi
# The benchmark's small version: every leg runs and every ledger total is right (speeds are not checked).
# The Kafka leg is left to the Kafka tests above: the loopback broker delivers a few hundred messages a second.
# wrk loads the HTTP ingress for a few seconds, bounded by its -d; psycopg 3 runs the reference leg (both from
# scripts/tools.sh).
venv="${IDEM_BENCH_VENV:-${IDEM_TOOLS:-$HOME/.cache/idem-tools}/bench-venv}"
python_arg=()
if "$venv/bin/python" -c "import psycopg" 2>/dev/null; then python_arg=(--python "$venv/bin/python"); fi
PUBSUB_EMULATOR_HOST="${IDEM_PUBSUB_EMULATOR_HOST:-127.0.0.1:8681}" \
  cargo run --quiet -p idem-bench -- --quick "${python_arg[@]}" --pubsub idem-bench \
  --nats "${IDEM_NATS_URL:-nats://127.0.0.1:4222}" --rabbitmq "${IDEM_RABBITMQ_URL:-amqp://guest:guest@127.0.0.1:5672/%2f}" \
  --database-url "${IDEM_BENCH_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/test}" \
  --mysql "${IDEM_BENCH_MYSQL:-${IDEM_TEST_MYSQL:-mysql://root@127.0.0.1:3306}/test}"
# The chaos harness at a small size: consumer processes killed at random times, backends terminated, the database
# refusing connections, the network to it cut; after each trial an independent SQL check of the ledger. On
# PostgreSQL, SQLite and MySQL/MariaDB (whose sessions it kills with KILL CONNECTION).
python3 scripts/chaos.py --idem target/debug/idem --trials "${IDEM_CHAOS_TRIALS:-8}" --seed "${IDEM_CHAOS_SEED:-1}" \
  --databases postgres,sqlite,mysql --postgres "${IDEM_TEST_POSTGRES:-postgres://postgres@127.0.0.1:5432}" \
  --mysql "${IDEM_TEST_MYSQL:-mysql://root@127.0.0.1:3306}"
# With delayed retries: some credits of random accounts fail for a while, so kills land on parking and releases;
# each account's order is checked too.
python3 scripts/chaos.py --idem target/debug/idem --trials 4 --seed "${IDEM_CHAOS_SEED:-1}" --flaky \
  --databases postgres,sqlite,mysql --postgres "${IDEM_TEST_POSTGRES:-postgres://postgres@127.0.0.1:5432}" \
  --mysql "${IDEM_TEST_MYSQL:-mysql://root@127.0.0.1:3306}"
# And over Kafka, on a broker of its own that it restarts as one more fault (the project's broker binary).
kafka_bin="${NISSHI_BIN:-${IDEM_TOOLS_DIR:-$HOME/.cache/idem-tools}/nisshi-0.7.0-pre.2/bin/nisshi}"
if [ -x "$kafka_bin" ]; then
  python3 scripts/chaos.py --idem target/debug/idem --trials 2 --seed "${IDEM_CHAOS_SEED:-1}" --transports kafka \
    --kafka-bin "$kafka_bin" --postgres "${IDEM_TEST_POSTGRES:-postgres://postgres@127.0.0.1:5432}"
else
  echo "chaos: no broker binary at $kafka_bin; the Kafka trials are skipped" >&2
fi
# The install path a user without a checkout takes, from this checkout: `cargo install` into a temporary root,
# then the installed command runs: the default build (no broker) runs the embedded example and refuses a Kafka
# consumer by naming the feature. Last: it rebuilds target/debug/idem with the command's default features.
install_root="$(mktemp -d)"
cargo install --quiet --locked --debug --path crates/idem-cli --root "$install_root" --target-dir target
"$install_root/bin/idem" --version
"$install_root/bin/idem" check --offline --config examples/config/payments.toml
kafka_file="$install_root/kafka.toml"
sed -e 's/^embedded = /# embedded = /' -e 's/^# kafka = /kafka = /' examples/config/payments.toml > "$kafka_file"
if refusal=$("$install_root/bin/idem" check --offline --config "$kafka_file" 2>&1); then
  echo "the default build accepted a [consumer.kafka] it cannot run" >&2; exit 1
fi
grep -q "needs idem's \`kafka\` feature" <<<"$refusal" || { echo "unexpected refusal: $refusal" >&2; exit 1; }
rm -rf "$install_root"
