#!/usr/bin/env bash
# Runs both configuration examples end to end on a fresh SQLite file and checks the results: the ledger exact
# (each payment once, duplicates absorbed), and one PaymentCredited message delivered per payment.
# Usage: examples/config/run.sh [path/to/idem]   (default: target/debug/idem)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
idem="$(realpath "${1:-target/debug/idem}")"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cd "$work"
export LEDGER_DATABASE_URL="sqlite://$work/ledger.db" LEDGER_LOG_DIR="$work/events"
unset IDEM_DATABASE_URL

"$idem" migrate --database-url "$LEDGER_DATABASE_URL" > /dev/null
sql() { python3 -c 'import sqlite3, sys
db = sqlite3.connect(sys.argv[1])
rows = db.execute(sys.argv[2]).fetchall() if sys.argv[2].startswith("SELECT") else db.executescript(sys.argv[2])
db.commit()
print(*(rows[0] if isinstance(rows, list) else ()))' ledger.db "$1"; }
sql "$(cat "$here/ledger.sql")" > /dev/null
python3 "$here/payments.py" 1000 | "$idem" log produce --log-dir events --topic payments --partitions 4 --key-pointer /account
sed 's/^listen = .*/listen = "127.0.0.1:0"/' "$here/payments.toml" > payments.toml
"$idem" check --config payments.toml
"$idem" run --config payments.toml --exit-at-end
expected=$(python3 -c "print(sum(i % 97 + 1 for i in range(1000)))")
read -r entries total < <(sql "SELECT COUNT(*), (SELECT SUM(balance) FROM accounts) FROM ledger")
[ "$entries" = 1000 ] && [ "$total" = "$expected" ] || { echo "payments: $entries entries, $total != $expected" >&2; exit 1; }
echo "payments.toml: 1000 entries, total $total: exact"

# The outbox example, on the same events under a group of its own: the credits again (a second ledger would be
# the real case; here the balances double) and one message per payment, delivered by the relay.
sql "DELETE FROM ledger" > /dev/null
"$idem" run --config "$here/notify.toml" --exit-at-end
"$idem" relay --database-url "$LEDGER_DATABASE_URL" --log-dir events --until-empty > /dev/null
delivered=$("$idem" log inspect --log-dir events --topic payment-credited --json | python3 -c \
  "import json,sys; print(sum(p['records'] for p in json.load(sys.stdin)['partitions']))")
[ "$delivered" = 1000 ] || { echo "notify: $delivered messages delivered, not 1000" >&2; exit 1; }
echo "notify.toml: 1000 PaymentCredited messages delivered"
