#!/usr/bin/env bash
# The console's end-to-end test in a real browser: Debian's Chromium, driven by playwright-core (installed once
# into a directory outside the checkout, $IDEM_TOOLS, default ~/.cache/idem-tools). Events with a cause of failure
# go through `idem run`, which then serves the console beside its consumer; an operator signs in, finds the
# failure group, dry-runs an edit of one letter through the consumer's effects and retries it, sees what a replay
# of the rest would do, replays them once the cause is fixed, and the ledger becomes right and the audit trail
# names her; a viewer cannot act; a request without a token and a form without its CSRF token are refused.
# Then schemathesis (from PyPI, installed once beside playwright-core) runs the live console's JSON API against
# its OpenAPI document for a bounded number of examples: no server error, every status and body as documented.
# Usage: scripts/browser.sh [path/to/idem] [screenshot-dir], or scripts/browser.sh --install (only what it needs)
set -euo pipefail
cd "$(dirname "$0")/.."
tools="${IDEM_TOOLS:-$HOME/.cache/idem-tools}"

if ! command -v chromium >/dev/null 2>&1; then
  echo "installing Debian's chromium…"
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium >/dev/null
fi
if [ ! -d "$tools/browser/node_modules/playwright-core" ]; then
  echo "installing playwright-core into $tools/browser…"
  mkdir -p "$tools/browser"
  (cd "$tools/browser" && npm install --silent --no-audit --no-fund playwright-core@1.65.2 >/dev/null)
fi

if [ ! -x "$tools/schemathesis/bin/schemathesis" ]; then
  echo "installing schemathesis into $tools/schemathesis…"
  python3 -m venv "$tools/schemathesis"
  "$tools/schemathesis/bin/pip" install --quiet schemathesis==4.32.5
fi
if [ "${1:-}" = "--install" ]; then exit 0; fi
idem="$(realpath "${1:-target/debug/idem}")"
shots="${2:-}"

work="$(mktemp -d)"
console_pid=""
trap '[ -n "$console_pid" ] && kill "$console_pid" 2>/dev/null; rm -rf "$work"' EXIT
export LEDGER_DATABASE_URL="sqlite://$work/ledger.db" LEDGER_LOG_DIR="$work/events"
unset IDEM_DATABASE_URL IDEM_CONSOLE_TOKEN IDEM_CONSOLE_VIEWER_TOKEN IDEM_CONSOLE_USERS
(cd "$work" && "$idem" migrate --database-url "$LEDGER_DATABASE_URL" >/dev/null)
python3 - "$work/ledger.db" examples/config/ledger.sql <<'PY'
import sqlite3, sys
db = sqlite3.connect(sys.argv[1])
db.executescript(open(sys.argv[2]).read())
db.execute("DELETE FROM accounts WHERE id = 3")  # the cause of failure: account 3 is missing
db.commit()
PY
python3 examples/config/payments.py 100 \
  | "$idem" log produce --log-dir "$work/events" --topic payments --partitions 2 --key-pointer /account >/dev/null
sed 's/^listen = .*/listen = "127.0.0.1:0"/' examples/config/payments.toml > "$work/payments.toml"
(cd "$work" && "$idem" run --config payments.toml --exit-at-end >/dev/null 2>"$work/run.log")

alice=$("$idem" console token alice --role operator)
bob=$("$idem" console token bob --role viewer)
{ echo "$alice" | sed -n 's/^users-file line: //p'; echo "$bob" | sed -n 's/^users-file line: //p'; } > "$work/users.txt"
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
# The console served by `idem run` beside its consumer: the consumer applies what the console replays, and an
# edited letter's dry run goes through the consumer's own effects.
cat >> "$work/payments.toml" <<TOML

[console]
listen = "127.0.0.1:$port"
users = "$work/users.txt"
show_payloads = true
TOML
(cd "$work" && exec "$idem" run --config payments.toml) 2>"$work/console.log" &
console_pid=$!
up=""
for _ in $(seq 1 100); do
  if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then up=1; break; fi
  sleep 0.2
done
if [ -z "$up" ]; then echo "the console did not come up:" >&2; cat "$work/console.log" >&2; exit 1; fi

CONSOLE_URL="http://127.0.0.1:$port" \
OPERATOR_TOKEN=$(echo "$alice" | sed -n 's/^token: //p') \
VIEWER_TOKEN=$(echo "$bob" | sed -n 's/^token: //p') \
WORK="$work" IDEM="$idem" SHOTS="$shots" NODE_PATH="$tools/browser/node_modules" \
  node tests/browser/console.cjs || { echo "the console's log:" >&2; cat "$work/console.log" >&2; exit 1; }

# The API against its document, as the operator (actions included), deterministic and bounded.
operator=$(echo "$alice" | sed -n 's/^token: //p')
(cd "$work" && "$tools/schemathesis/bin/schemathesis" run "http://127.0.0.1:$port/api/v1/openapi.json" \
  -H "Authorization: Bearer $operator" --max-examples 25 --generation-deterministic \
  --exclude-checks positive_data_acceptance --no-color > schemathesis.log 2>&1) \
  || { tail -60 "$work/schemathesis.log" >&2; echo "schemathesis: the API does not hold to its document" >&2; exit 1; }
grep -E "^ *[0-9]+ generated" "$work/schemathesis.log" | sed 's/^ */schemathesis: /'
