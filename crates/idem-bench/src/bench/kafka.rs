//! The Kafka leg: the topic preloaded once, then consumed end to end by `idem-bench consume` in a process of its
//! own, whose memory is sampled; and the broker's own read limit.

use super::*;
use consume::{Child, ChildRuns, consume_child};

/// Preloads the topic once, then consumes it `runs` times (a fresh group and fresh tables each time) in a child
/// process whose memory is sampled.
pub(super) async fn kafka_leg(
    pool: &PgPool,
    args: &BenchArgs,
    brokers: &str,
    name: String,
) -> anyhow::Result<(Leg, Leg)> {
    let work = workload(args.kafka_events, args.duplicates, args.accounts, args.seed ^ 0x006b_6166_6b61);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let topic = format!("bench-{nanos}");
    let records: Vec<(i64, String)> = work.deliveries.iter().map(|p| (p.account, payload(p))).collect();
    idem_cli::demo::write_kafka(brokers, &topic, 4, &records).await?;
    drop(records);
    let mut runs = ChildRuns::default();
    let mut reads = Vec::new();
    for run in 0..args.runs {
        let deliveries = work.deliveries.len();
        let report =
            consume_child(args, Child::Kafka(brokers), &topic, &format!("bench-read-{nanos}-{run}"), deliveries, true)
                .await?;
        reads.push(report["per_second"].as_f64().unwrap_or(0.0));

        fresh_tables(pool, args.accounts).await?;
        let group = format!("bench-{nanos}-{run}");
        runs.add(&consume_child(args, Child::Kafka(brokers), &topic, &group, deliveries, false).await?);
        check_ledger(pool, "Kafka", work.expected_total, work.unique as i64).await?;
    }
    if std::env::var_os("IDEM_BENCH_KEEP_TOPIC").is_some() {
        eprintln!("bench: topic {topic} kept");
    } else if let Err(error) = idem::kafka::delete_topic(brokers, &topic).await {
        tracing::warn!(%error, topic, "bench: could not delete the topic");
    }
    let leg = runs.leg(name);
    let read = Leg::new(super::brokers::read_limit_name("Kafka", args.kafka_events), reads);
    Ok((read, leg))
}
