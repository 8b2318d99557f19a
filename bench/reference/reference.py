"""The reference handler, the marker pattern by hand: one connection, one transaction per event, the marker INSERT
first, a unique violation meaning "duplicate". `idem bench` runs it as its reference leg.

    python reference.py DATABASE_URL EVENTS_JSONL

EVENTS_JSONL holds one payment per line: {"id": ..., "account": ..., "amount": ...}. Prints one JSON object.
"""

import json
import sys
import time

import psycopg
from psycopg.errors import UniqueViolation

GROUP = "bench"
TOPIC = "payments"


def apply_effect(event, conn):
    conn.execute(
        "UPDATE bench_accounts SET balance = balance + %s WHERE id = %s",
        (event["amount"], event["account"]),
    )


def handle(event, offset, conn) -> str:
    try:
        with conn.transaction():
            conn.execute(
                """INSERT INTO bench_processed_events
                       (consumer_group, event_id, topic, partition, "offset")
                   VALUES (%s, %s, %s, %s, %s)""",
                (GROUP, event["id"], TOPIC, 0, offset),
            )
            apply_effect(event, conn)  # every write here shares the transaction
        return "processed"
    except UniqueViolation:
        return "duplicate"  # already applied: safe to acknowledge


def main():
    url, path = sys.argv[1], sys.argv[2]
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    outcomes = {"processed": 0, "duplicate": 0}
    with psycopg.connect(url, autocommit=True) as conn:
        started = time.perf_counter()
        for offset, line in enumerate(lines):
            outcomes[handle(json.loads(line), offset, conn)] += 1
        seconds = time.perf_counter() - started
    print(json.dumps({"seconds": seconds, **outcomes}))


if __name__ == "__main__":
    main()
