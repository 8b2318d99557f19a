#!/usr/bin/env bash
# idem's own CPU cost per event, in instructions (valgrind's callgrind): a count that does not move with the
# machine's load, so a change that adds work to the hot path shows as a number.
#
#   bench/instructions.sh [IDEM_BENCH]     (default target/release/idem-bench, built first)
#
# Each path runs in-process under callgrind twice, with SMALL and LARGE events (IDEM_INSTRUCTIONS_SMALL, _LARGE;
# 2,000 and 8,000): the difference of the two totals over the difference of the events is the cost of one more
# event, without what every run pays once (start-up, migrations, the workload's generation). The count is the
# bench process's alone (idem, sqlx, tokio), not PostgreSQL's. Prints one line per path; bench/instructions.md
# keeps the figures of each change.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v valgrind >/dev/null 2>&1; then
    echo "valgrind is not installed (Debian: apt-get install valgrind)" >&2
    exit 1
fi
bench="${1:-}"
if [ -z "$bench" ]; then
    cargo build --release -p idem-bench >&2
    bench=target/release/idem-bench
fi
small="${IDEM_INSTRUCTIONS_SMALL:-2000}"
large="${IDEM_INSTRUCTIONS_LARGE:-8000}"
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

# The total instructions of one run of the leg named $1 with $2 events.
total() {
    local file="$out/callgrind.$RANDOM"
    valgrind --tool=callgrind --callgrind-out-file="$file" "$bench" --only "$1" --events "$2" --runs 1 --json \
        >/dev/null 2>"$out/valgrind.log" || { tail -20 "$out/valgrind.log" >&2; exit 1; }
    awk '/^totals:/ { print $2 }' "$file"
}

printf '%-50s %14s\n' "path" "instr./event"
for leg in "idem per-event, 1 partition" "idem batched 100, per-message" "idem batched 1000, batch handler" \
    "idem Sequential Inbox, 4 partition"; do
    a=$(total "$leg" "$small")
    b=$(total "$leg" "$large")
    printf '%-50s %14d\n' "$leg" $(( (b - a) / (large - small) ))
done
