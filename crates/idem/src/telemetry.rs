//! The metric catalogue: every metric idem writes, with its unit and `# HELP` text, described to the installed
//! `metrics` recorder when a consumer starts. Names are those of docs/METRICS.md: each begins with `idem_`, and
//! every counter whose labels are known in advance is registered at 0 before it first counts ([`zero_counters`],
//! [`zero_outcomes`]), so that `rate()` and `absent()` see a series from the start.

use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};

/// Describes every metric to the recorder installed now (call again after installing another).
pub fn describe() {
    describe_counter!(
        "idem_events_handled_total",
        Unit::Count,
        "Messages handled, by consumer_group, topic and outcome (processed, duplicate, dead_lettered, id_reused, \
         stale, rejected; retried counts rolled-back attempts)"
    );
    describe_histogram!(
        "idem_event_handle_duration_seconds",
        Unit::Seconds,
        "Time of one committed transaction (a batch), from BEGIN to COMMIT"
    );
    describe_gauge!(
        "idem_consumer_offset_commit_lag_seconds",
        Unit::Seconds,
        "Time from a batch's COMMIT to its acknowledgement to the broker, per partition"
    );
    describe_gauge!("idem_processed_events_rows", Unit::Count, "Markers stored for the consumer group");
    describe_gauge!("idem_processed_events_oldest_age_seconds", Unit::Seconds, "Age of the group's oldest marker");
    describe_gauge!("idem_dead_letters_stored", Unit::Count, "Dead letters stored for the consumer group");
    describe_gauge!(
        "idem_partition_stalled_seconds",
        Unit::Seconds,
        "Seconds a partition has held work without a commit, once past stall_after (0 otherwise)"
    );
    describe_gauge!(
        "idem_partition_waiting_messages",
        Unit::Count,
        "Messages a partition's worker holds (queued and in hand)"
    );
    describe_counter!("idem_processed_events_pruned_total", Unit::Count, "Markers deleted by pruning");
    describe_gauge!(
        "idem_processed_events_prune_longest_statement_seconds",
        Unit::Seconds,
        "Longest DELETE statement of the last pruning pass"
    );
    describe_counter!(
        "idem_events_lost_total",
        Unit::Count,
        "Events never delivered, from holes in producer sequence numbers (idem-producer-id / idem-seq)"
    );
    describe_gauge!(
        "idem_consumer_paused",
        Unit::Count,
        "1 while the kill switch holds the consumer (many messages in a row failed the same way), else 0"
    );
    describe_counter!("idem_kill_switch_trips_total", Unit::Count, "Times the kill switch tripped");
    describe_gauge!(
        "idem_parked_messages",
        Unit::Count,
        "Messages parked for a delayed retry (and behind them, per key)"
    );
    describe_gauge!(
        "idem_parked_oldest_age_seconds",
        Unit::Seconds,
        "How long the group's oldest parked message has waited"
    );
    describe_counter!(
        "idem_http_ingress_responses_total",
        Unit::Count,
        "Requests the HTTP ingress answered after reaching its transaction, by status"
    );
    describe_counter!(
        "idem_http_ingress_refused_total",
        Unit::Count,
        "Requests the HTTP ingress refused before any transaction, by reason: signature, key"
    );
    describe_counter!(
        "idem_immediate_retries_total",
        Unit::Count,
        "Immediate retries while the partition waits, by cause: handler (retryable error), database (unavailable)"
    );
    describe_counter!(
        "idem_delayed_retries_total",
        Unit::Count,
        "Delayed retries by result: released (applied), failed (parked again), dead_lettered (schedule used up)"
    );
    describe_gauge!(
        "idem_kafka_topic_retention_seconds",
        Unit::Seconds,
        "A consumed topic's retention.ms, read at start-up"
    );
    describe_gauge!(
        "idem_consumer_lag_messages",
        Unit::Count,
        "The consumer's backlog where its broker tells it: per owned Kafka partition, per JetStream consumer, per \
         RabbitMQ or SQS queue"
    );
    for (name, help) in INBOX_COUNTERS {
        describe_counter!(name, Unit::Count, help);
    }
    describe_gauge!(
        "idem_inbox_waiting_messages",
        Unit::Count,
        "Messages WAITING in the Sequential Inbox, per sequence"
    );
    describe_gauge!(
        "idem_inbox_oldest_waiting_age_seconds",
        Unit::Seconds,
        "Age of the oldest WAITING message, per sequence"
    );
    describe_gauge!(
        "idem_inbox_instances_expiring_soon",
        Unit::Count,
        "Open sequence instances whose retention ends within housekeeping.expiring_soon"
    );
    describe_gauge!(
        "idem_inbox_instances_expired",
        Unit::Count,
        "Sequence instances past their retention, not yet deleted"
    );
    describe_gauge!(
        "idem_nats_stream_max_age_seconds",
        Unit::Seconds,
        "A consumed JetStream stream's max_age, read at start-up"
    );
    describe_counter!(
        "idem_nats_redelivered_total",
        Unit::Count,
        "JetStream messages delivered more than once, per stream"
    );
    describe_counter!(
        "idem_rabbitmq_redelivered_total",
        Unit::Count,
        "RabbitMQ deliveries flagged redelivered, per queue"
    );
    describe_gauge!(
        "idem_sqs_queue_retention_seconds",
        Unit::Seconds,
        "A consumed SQS queue's MessageRetentionPeriod, read at start-up"
    );
    describe_counter!("idem_sqs_redelivered_total", Unit::Count, "SQS messages received more than once, per queue");
    describe_counter!(
        "idem_sqs_visibility_extended_total",
        Unit::Count,
        "SQS messages in hand whose visibility timeout was extended while their batch ran"
    );
    describe_gauge!(
        "idem_outbox_pending_messages",
        Unit::Count,
        "Messages waiting in the outbox, as a relay last counted"
    );
    describe_gauge!(
        "idem_outbox_oldest_pending_age_seconds",
        Unit::Seconds,
        "Age of the oldest message waiting in the outbox, as a relay last read it"
    );
    describe_counter!(
        "idem_outbox_published_total",
        Unit::Count,
        "Outbox delivery attempts, by destination and outcome (delivered, failed, dead_lettered)"
    );
    describe_histogram!(
        "idem_outbox_publish_duration_seconds",
        Unit::Seconds,
        "Time a relay's round took to deliver its batch"
    );
    describe_histogram!(
        "idem_outbox_delivery_age_seconds",
        Unit::Seconds,
        "Time from enqueue to delivery of each outbox message, per destination"
    );
    describe_gauge!("idem_outbox_relay_slots", Unit::Count, "Slots (key groups) a relay owns");
    describe_gauge!(
        "idem_pubsub_subscription_retention_seconds",
        Unit::Seconds,
        "A consumed Pub/Sub subscription's message retention, read at start-up"
    );
    describe_counter!(
        "idem_pubsub_redelivered_total",
        Unit::Count,
        "Pub/Sub messages delivered more than once, per subscription"
    );
    describe_counter!(
        "idem_pubsub_ack_failed_total",
        Unit::Count,
        "Pub/Sub acknowledgements the service refused after the commit (the message comes again as a duplicate)"
    );
}

/// The Sequential Inbox's counters, each labelled `{consumer_group, sequence}`, with their help.
const INBOX_COUNTERS: [(&str, &str); 7] = [
    ("idem_inbox_consumed_total", "Sequenced messages delivered to the Sequential Inbox"),
    ("idem_inbox_processed_total", "Sequenced messages handled on arrival"),
    ("idem_inbox_released_total", "Buffered messages handled once their release condition held"),
    ("idem_inbox_buffered_total", "Sequenced messages stored WAITING for their predecessors"),
    ("idem_inbox_duplicates_skipped_total", "Sequenced messages skipped as duplicates of a claim"),
    ("idem_inbox_failed_total", "Released messages that failed and were marked FAILED"),
    ("idem_inbox_dead_lettered_total", "Sequenced messages dead-lettered"),
];

/// Registers at 0 every Sequential Inbox counter of each of `sequences`, when an inbox starts.
pub fn zero_inbox<'a>(group: &str, sequences: impl IntoIterator<Item = &'a str>) {
    for sequence in sequences {
        for (name, _) in INBOX_COUNTERS {
            metrics::counter!(name, "consumer_group" => group.to_owned(), "sequence" => sequence.to_owned())
                .increment(0);
        }
    }
}

/// The outcomes of `idem_events_handled_total`, `retried` included.
pub const OUTCOMES: [&str; 8] =
    ["processed", "duplicate", "dead_lettered", "id_reused", "stale", "rejected", "parked", "retried"];

/// Registers at 0 the counters of a consumer group whose labels are known when it starts: the kill switch's trips,
/// each cause of immediate retries, each result of delayed retries, the markers pruned.
pub fn zero_counters(group: &str) {
    let group = group.to_owned();
    metrics::counter!("idem_kill_switch_trips_total", "consumer_group" => group.clone()).increment(0);
    metrics::counter!("idem_processed_events_pruned_total", "consumer_group" => group.clone()).increment(0);
    for cause in ["handler", "database"] {
        metrics::counter!("idem_immediate_retries_total", "consumer_group" => group.clone(), "cause" => cause)
            .increment(0);
    }
    for result in ["released", "failed", "dead_lettered"] {
        metrics::counter!("idem_delayed_retries_total", "consumer_group" => group.clone(), "result" => result)
            .increment(0);
    }
}

/// Registers at 0 every outcome of `idem_events_handled_total`, and `idem_events_lost_total`, for a topic the
/// group has just met (a source names its topics as messages arrive).
pub fn zero_outcomes(group: &str, topic: &str) {
    for outcome in OUTCOMES {
        metrics::counter!("idem_events_handled_total", "consumer_group" => group.to_owned(),
            "topic" => topic.to_owned(), "outcome" => outcome)
        .increment(0);
    }
    metrics::counter!("idem_events_lost_total", "consumer_group" => group.to_owned(), "topic" => topic.to_owned())
        .increment(0);
}
