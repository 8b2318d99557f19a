#!/usr/bin/env bash
# Why idem's batches are optimistic: the cost of a savepoint per message in a batch of 100, on PostgreSQL.
# Runs pgbench on two transactions that do the same work (a marker insert and an account update per message,
# 100 messages, one commit), one with SAVEPOINT/RELEASE around each message and one without, alternating.
#   bench/savepoint.sh [postgres://postgres@127.0.0.1:5432/test]
set -euo pipefail
url=${1:-postgres://postgres@127.0.0.1:5432/test}
dir=$(mktemp -d)
trap 'rm -rf "$dir"; psql -q "$url" -c "DROP TABLE IF EXISTS sp_markers, sp_accounts" 2>/dev/null || true' EXIT
psql -q "$url" -c "DROP TABLE IF EXISTS sp_markers, sp_accounts;
  CREATE TABLE sp_markers (id bigint PRIMARY KEY);
  CREATE TABLE sp_accounts (id int PRIMARY KEY, balance bigint NOT NULL);
  INSERT INTO sp_accounts SELECT g, 0 FROM generate_series(1, 10000) g;"
for kind in optimistic savepoint; do
  {
    echo "BEGIN;"
    for i in $(seq 0 99); do
      echo "\\set id$i random(1, 1000000000000)"
      echo "\\set a$i random(1, 10000)"
      [ "$kind" = savepoint ] && echo "SAVEPOINT m;"
      echo "INSERT INTO sp_markers VALUES (:id$i) ON CONFLICT DO NOTHING;"
      echo "UPDATE sp_accounts SET balance = balance + 1 WHERE id = :a$i;"
      [ "$kind" = savepoint ] && echo "RELEASE SAVEPOINT m;"
    done
    echo "COMMIT;"
  } > "$dir/$kind.sql"
done
for round in 1 2; do
  for kind in optimistic savepoint; do
    tps=$(pgbench -n -M prepared -c 1 -T 8 -f "$dir/$kind.sql" "$url" 2>/dev/null | awk '/^tps/ {print $3}')
    echo "round $round  $kind  $tps batches/s  ($(awk -v t="$tps" 'BEGIN {printf "%.0f", t * 100}') messages/s)"
  done
done
