#!/usr/bin/env python3
"""Payment events for the configuration examples, as JSON lines on stdout, some sent twice (as a producer's
retries would). Into the embedded log:

    python3 examples/config/payments.py 1000 | idem log produce --log-dir events --topic payments \
        --partitions 4 --key-pointer /account

or into Kafka, with confluent-kafka (pip install confluent-kafka):

    python3 examples/config/payments.py 1000 --kafka 127.0.0.1:9092
"""
import json
import sys


def payments(count):
    for i in range(count):
        event = {"idempotencyKey": f"pay-{i}", "account": i % 10 + 1, "amount": i % 97 + 1,
                 "paidAt": "2026-12-02T10:00:00Z"}
        yield event
        if i % 10 == 0:
            yield event  # a producer retry: the same event again


def main():
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    if "--kafka" in sys.argv:
        from confluent_kafka import Producer
        producer = Producer({"bootstrap.servers": sys.argv[sys.argv.index("--kafka") + 1]})
        for event in payments(count):
            producer.produce("payments", key=str(event["account"]), value=json.dumps(event))
        producer.flush()
        return
    for event in payments(count):
        print(json.dumps(event))


if __name__ == "__main__":
    main()
