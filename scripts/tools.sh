#!/usr/bin/env bash
# Installs the tools the tests use that this machine lacks, each skipped when it is already there:
# - Debian's packages: promtool (prometheus, for the alert rules), chromium (the console's browser test), wrk (the
#   benchmark's HTTP legs), in one apt-get run;
# - playwright-core and schemathesis (scripts/browser.sh --install), the SQS-compatible server (scripts/sqs.sh),
#   Google's Pub/Sub emulator (scripts/pubsub.sh), and psycopg 3 for the benchmark's reference leg, each into a
#   directory outside the checkout ($IDEM_TOOLS, default ~/.cache/idem-tools).
# Nothing here builds or starts anything: `.ci/run` runs it in the background while the first build compiles, and
# scripts/test.sh runs it again (then in seconds) before the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
tools="${IDEM_TOOLS:-$HOME/.cache/idem-tools}"
started=$SECONDS

packages=()
command -v promtool >/dev/null 2>&1 || packages+=(prometheus)
command -v chromium >/dev/null 2>&1 || packages+=(chromium)
command -v wrk >/dev/null 2>&1 || packages+=(wrk)
if [ "${#packages[@]}" -gt 0 ]; then
  echo "installing Debian's ${packages[*]}…"
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${packages[@]}" >/dev/null
fi

scripts/browser.sh --install
scripts/sqs.sh bin >/dev/null
scripts/pubsub.sh bin >/dev/null

# The benchmark's reference leg: psycopg 3 in a virtual environment of its own.
venv="${IDEM_BENCH_VENV:-$tools/bench-venv}"
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import psycopg" 2>/dev/null; then
  echo "installing psycopg 3 into $venv…"
  { python3 -m venv "$venv" && "$venv/bin/pip" install --quiet --disable-pip-version-check "psycopg[binary]>=3.1,<4"; } \
    || echo "bench: psycopg 3 could not be installed; the reference leg will be skipped" >&2
fi
echo "tools ready in $((SECONDS - started)) s"
