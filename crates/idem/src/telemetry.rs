//! The metric catalogue: every metric idem writes, with its unit and `# HELP` text, described to the installed
//! `metrics` recorder when a consumer starts. Names are those of docs/METRICS.md.

use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};

/// Describes every metric to the recorder installed now (call again after installing another).
pub fn describe() {
    describe_counter!(
        "events_handled_total",
        Unit::Count,
        "Messages handled, by consumer_group, topic and outcome (processed, duplicate, dead_lettered, id_reused, \
         stale, rejected; retried counts rolled-back attempts)"
    );
    describe_histogram!(
        "event_handle_duration_seconds",
        Unit::Seconds,
        "Time of one committed transaction (a batch), from BEGIN to COMMIT"
    );
    describe_gauge!(
        "consumer_offset_commit_lag_seconds",
        Unit::Seconds,
        "Time from a batch's COMMIT to its acknowledgement to the broker, per partition"
    );
    describe_gauge!("processed_events_row_count", Unit::Count, "Markers stored for the consumer group");
    describe_gauge!("processed_events_oldest_age_seconds", Unit::Seconds, "Age of the group's oldest marker");
    describe_gauge!("dead_letters_stored", Unit::Count, "Dead letters stored for the consumer group");
    describe_gauge!(
        "partition_stalled_seconds",
        Unit::Seconds,
        "Seconds a partition has held work without a commit, once past stall_after (0 otherwise)"
    );
    describe_gauge!(
        "partition_waiting_messages",
        Unit::Count,
        "Messages a partition's worker holds (queued and in hand)"
    );
    describe_counter!("processed_events_pruned_total", Unit::Count, "Markers deleted by pruning");
    describe_gauge!(
        "processed_events_prune_longest_statement_seconds",
        Unit::Seconds,
        "Longest DELETE statement of the last pruning pass"
    );
    describe_counter!(
        "events_lost_total",
        Unit::Count,
        "Events never delivered, from holes in producer sequence numbers (idem-producer-id / idem-seq)"
    );
    describe_gauge!(
        "consumer_paused",
        Unit::Count,
        "1 while the kill switch holds the consumer (many messages in a row failed the same way), else 0"
    );
    describe_counter!("kill_switch_trips_total", Unit::Count, "Times the kill switch tripped");
    describe_gauge!("parked_messages", Unit::Count, "Messages parked for a delayed retry (and behind them, per key)");
    describe_gauge!(
        "parked_oldest_age_seconds",
        Unit::Seconds,
        "How long the group's oldest parked message has waited"
    );
    describe_counter!(
        "http_ingress_responses_total",
        Unit::Count,
        "Requests the HTTP ingress answered after reaching its transaction, by status"
    );
    describe_counter!(
        "http_ingress_refused_total",
        Unit::Count,
        "Requests the HTTP ingress refused before any transaction, by reason: signature, key"
    );
    describe_counter!(
        "immediate_retries_total",
        Unit::Count,
        "Immediate retries while the partition waits, by cause: handler (retryable error), database (unavailable)"
    );
    describe_counter!(
        "delayed_retries_total",
        Unit::Count,
        "Delayed retries by result: released (applied), failed (parked again), dead_lettered (schedule used up)"
    );
    describe_gauge!(
        "kafka_topic_retention_seconds",
        Unit::Seconds,
        "A consumed topic's retention.ms, read at start-up"
    );
    describe_gauge!("consumer_lag_messages", Unit::Count, "Messages behind the end of each owned Kafka partition");
    for (name, help) in [
        ("inbox_consumed_total", "Sequenced messages delivered to the Sequential Inbox"),
        ("inbox_processed_total", "Sequenced messages handled on arrival"),
        ("inbox_released_total", "Buffered messages handled once their release condition held"),
        ("inbox_buffered_total", "Sequenced messages stored WAITING for their predecessors"),
        ("inbox_duplicates_skipped_total", "Sequenced messages skipped as duplicates of a claim"),
        ("inbox_failed_total", "Released messages that failed and were marked FAILED"),
        ("inbox_dead_lettered_total", "Sequenced messages dead-lettered"),
    ] {
        describe_counter!(name, Unit::Count, help);
    }
    describe_gauge!("inbox_waiting_messages", Unit::Count, "Messages WAITING in the Sequential Inbox, per sequence");
    describe_gauge!(
        "inbox_oldest_waiting_age_seconds",
        Unit::Seconds,
        "Age of the oldest WAITING message, per sequence"
    );
    describe_gauge!(
        "inbox_instances_expiring_soon",
        Unit::Count,
        "Open sequence instances whose retention ends within housekeeping.expiring_soon"
    );
    describe_gauge!("inbox_instances_expired", Unit::Count, "Sequence instances past their retention, not yet deleted");
    describe_gauge!(
        "nats_stream_max_age_seconds",
        Unit::Seconds,
        "A consumed JetStream stream's max_age, read at start-up"
    );
    describe_counter!("nats_redelivered_total", Unit::Count, "JetStream messages delivered more than once, per stream");
    describe_counter!("rabbitmq_redelivered_total", Unit::Count, "RabbitMQ deliveries flagged redelivered, per queue");
    describe_gauge!(
        "sqs_queue_retention_seconds",
        Unit::Seconds,
        "A consumed SQS queue's MessageRetentionPeriod, read at start-up"
    );
    describe_counter!("sqs_redelivered_total", Unit::Count, "SQS messages received more than once, per queue");
    describe_counter!(
        "sqs_visibility_extended_total",
        Unit::Count,
        "SQS messages in hand whose visibility timeout was extended while their batch ran"
    );
    describe_gauge!("outbox_pending_messages", Unit::Count, "Messages waiting in the outbox, as a relay last counted");
    describe_gauge!(
        "outbox_oldest_pending_age_seconds",
        Unit::Seconds,
        "Age of the oldest message waiting in the outbox, as a relay last read it"
    );
    describe_counter!(
        "outbox_published_total",
        Unit::Count,
        "Outbox delivery attempts, by destination and outcome (delivered, failed, dead_lettered)"
    );
    describe_histogram!(
        "outbox_publish_duration_seconds",
        Unit::Seconds,
        "Time a relay's round took to deliver its batch"
    );
    describe_histogram!(
        "outbox_delivery_age_seconds",
        Unit::Seconds,
        "Time from enqueue to delivery of each outbox message, per destination"
    );
    describe_gauge!("outbox_relay_slots", Unit::Count, "Slots (key groups) a relay owns");
}
