//! The ratios of the targets, from the legs' medians.

use super::Leg;

/// The ratios of the targets, from the medians.
pub(super) fn ratios(legs: &[Leg], grown_markers: u64, open_instances: u64) -> Vec<(String, f64)> {
    let median = |name: &str| legs.iter().find(|l| l.name == name).map(|l| l.median).filter(|m| *m > 0.0);
    let mut out = Vec::new();
    let mut ratio = |label: String, a: Option<f64>, b: Option<f64>| {
        if let (Some(a), Some(b)) = (a, b) {
            out.push((label, (a / b * 100.0).round() / 100.0));
        }
    };
    for n in [1, 2, 4] {
        ratio(
            format!("idem per-event ÷ pgbench, {n}"),
            median(&format!("idem per-event, {n} partition(s)")),
            median(&format!("pgbench per-event, {n} client(s)")),
        );
    }
    let inbox = median(&super::idem_legs::inbox_name(0));
    ratio("idem Sequential Inbox ÷ idem per-event, 4".into(), inbox, median("idem per-event, 4 partition(s)"));
    if open_instances > 0 {
        let grown = super::idem_legs::inbox_name(open_instances);
        ratio(format!("{grown} ÷ on empty tables"), median(&grown), inbox);
    }
    ratio(
        "idem configured per-event ÷ idem per-event (Rust handler), 1".into(),
        median("idem configured per-event (idem run), 1 partition(s)"),
        median("idem per-event, 1 partition(s)"),
    );
    ratio(
        "other partitions with one key failing ÷ without the failure".into(),
        median(super::failing_key::FAILING),
        median(super::failing_key::CONTROL),
    );
    ratio(
        "other keys with one key failing, delayed retries ÷ without the failure".into(),
        median(super::failing_key::PARKED),
        median(super::failing_key::PARKED_CONTROL),
    );
    ratio(
        "HTTP: idem ingress ÷ the handler's transaction alone".into(),
        median(super::http::INGRESS),
        median(super::http::RAW),
    );
    let reference = median("reference handler (Python, psycopg 3)");
    for batch in [100, 1_000] {
        let per_message = median(&format!("idem batched {batch}, per-message handler"));
        let batch_handler = median(&format!("idem batched {batch}, batch handler"));
        ratio(format!("idem batched {batch} (batch handler) ÷ reference"), batch_handler, reference);
        ratio(format!("idem batched {batch} (per-message handler) ÷ reference"), per_message, reference);
        ratio(
            format!("idem configured bulk {batch} ÷ idem batched {batch} (batch handler)"),
            median(&format!("idem configured bulk (idem run), batched {batch}")),
            batch_handler,
        );
        ratio(
            format!("idem batched {batch} (batch handler) ÷ batched SQL limit"),
            batch_handler,
            median(&format!("batched SQL limit {batch}")),
        );
    }
    for (label, grown, empty) in super::grown::pairs(grown_markers) {
        ratio(label, median(&grown), median(&empty));
    }
    ratio(
        "MySQL: idem per-event ÷ raw SQL loop per-event".into(),
        median(super::mysql::PER_EVENT),
        median(super::mysql::RAW_PER_EVENT),
    );
    for batch in [100, 1_000] {
        ratio(
            format!("MySQL: idem batched {batch} (batch handler) ÷ batched SQL limit"),
            median(&super::mysql::batched(batch)),
            median(&super::mysql::raw_batched_name(batch)),
        );
    }
    ratio(
        "outbox: batched 1000 with an enqueue per event ÷ without".into(),
        median("idem batched 1000, batch handler, with an outbox enqueue per event"),
        median("idem batched 1000, batch handler"),
    );
    ratio(
        "idem relay ÷ embedded log produce limit".into(),
        median("idem relay to the embedded log"),
        median("embedded log produce limit (1,000 per fsync)"),
    );
    ratio(
        "idem relay ÷ Kafka produce limit".into(),
        median("idem relay to Kafka"),
        median("Kafka produce limit (1,000 awaited at a time)"),
    );
    // Memory that stays flat: the consumer's RSS once all its deliveries are committed ÷ once a quarter are.
    if let Some(leg) = legs.iter().find(|l| l.name.starts_with(super::memory::NAME)) {
        let quarters = leg.rss_mib_at_quarters.as_deref().unwrap_or_default();
        let (last, first) = (quarters.last().copied(), quarters.first().copied());
        ratio("memory: RSS at 100% ÷ at 25% of the deliveries".into(), last, first);
    }
    // A broker leg's ceiling is the lower of the broker's read limit (read as idem reads, no database) and the
    // database's batched limit: idem end to end can reach neither alone.
    let database = median("batched SQL limit 1000");
    for broker in ["Kafka", "NATS JetStream", "RabbitMQ", super::brokers::pubsub_name()] {
        let idem =
            legs.iter().find(|l| l.name.starts_with(&format!("idem end to end from {broker},"))).map(|l| l.median);
        let read = legs.iter().find(|l| l.name.starts_with(&format!("{broker} read limit"))).map(|l| l.median);
        ratio(format!("idem from {broker} ÷ {broker} read limit"), idem, read);
        // Where the broker, the database and idem share the machine's cores, the broker's delivery work and the
        // database's work add up rather than overlap: `shared` is the rate both could sustain together.
        let (ceiling, shared) = match (read, database) {
            (Some(read), Some(database)) => (Some(read.min(database)), Some(1.0 / (1.0 / read + 1.0 / database))),
            _ => (None, None),
        };
        ratio(
            format!("idem from {broker} ÷ its ceiling (the lower of its read limit and the batched SQL limit 1000)"),
            idem,
            ceiling,
        );
        ratio(
            format!("idem from {broker} ÷ both limits' work added (1 / (1/read limit + 1/batched SQL limit))"),
            idem,
            shared,
        );
    }
    out
}
