//! The Kafka leg: the topic preloaded once, then consumed end to end by `idem-bench consume` in a process of its
//! own, whose memory is sampled; and the broker's own read limit.

use super::*;

/// Arguments of the hidden `idem-bench consume`: the Kafka leg's consumer, in a process of its own so that its
/// memory is measured alone.
#[derive(clap::Args, Debug)]
pub struct ConsumeArgs {
    #[arg(long)]
    database_url: String,
    #[arg(long)]
    kafka: String,
    #[arg(long)]
    topic: String,
    #[arg(long)]
    group: String,
    #[arg(long)]
    batch_size: usize,
    /// Deliveries expected (for the memory samples at 25, 50, 75 and 100 %).
    #[arg(long)]
    deliveries: u64,
    /// librdkafka consumer settings, KEY=VALUE.
    #[arg(long = "kafka-setting")]
    kafka_settings: Vec<String>,
    /// Read and acknowledge as idem does, no database: the broker's own delivery rate.
    #[arg(long)]
    read_only: bool,
}

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
    let mut runs = Vec::new();
    let mut peak: f64 = 0.0;
    let mut quarters = Vec::new();
    let mut reads = Vec::new();
    for run in 0..args.runs {
        let deliveries = work.deliveries.len();
        let report =
            consume_child(args, brokers, &topic, &format!("bench-read-{nanos}-{run}"), deliveries, true).await?;
        reads.push(report["per_second"].as_f64().unwrap_or(0.0));

        fresh_tables(pool, args.accounts).await?;
        let report = consume_child(args, brokers, &topic, &format!("bench-{nanos}-{run}"), deliveries, false).await?;
        check_ledger(pool, "Kafka", work.expected_total, work.unique as i64).await?;
        runs.push(report["per_second"].as_f64().unwrap_or(0.0));
        peak = peak.max(report["peak_rss_mib"].as_f64().unwrap_or(0.0));
        quarters = report["rss_mib_at_quarters"]
            .as_array()
            .map(|a| a.iter().filter_map(serde_json::Value::as_f64).collect())
            .unwrap_or_default();
    }
    if std::env::var_os("IDEM_BENCH_KEEP_TOPIC").is_some() {
        eprintln!("bench: topic {topic} kept");
    } else if let Err(error) = idem::kafka::delete_topic(brokers, &topic).await {
        tracing::warn!(%error, topic, "bench: could not delete the topic");
    }
    let mut leg = Leg::new(name, runs);
    leg.peak_rss_mib = Some((peak * 10.0).round() / 10.0);
    leg.rss_mib_at_quarters = Some(quarters);
    let read = Leg::new(
        format!("Kafka read limit: read and acknowledged as idem does, no database ({} events)", args.kafka_events),
        reads,
    );
    Ok((read, leg))
}

/// Runs `idem-bench consume` (reading only, or into the database) and returns its JSON report.
async fn consume_child(
    args: &BenchArgs,
    brokers: &str,
    topic: &str,
    group: &str,
    deliveries: usize,
    read_only: bool,
) -> anyhow::Result<serde_json::Value> {
    let settings = KAFKA_DEFAULTS.iter().copied().chain(args.kafka_settings.iter().map(String::as_str));
    let output = tokio::process::Command::new(std::env::current_exe()?)
        .args(["consume", "--database-url", &args.database_url, "--kafka", brokers, "--topic", topic])
        .args(["--group", group, "--batch-size", "1000", "--deliveries", &deliveries.to_string()])
        .args(read_only.then_some("--read-only"))
        .args(settings.flat_map(|s| ["--kafka-setting", s]))
        .stderr(std::process::Stdio::inherit())
        .output()
        .await?;
    if !output.status.success() {
        bail!("the Kafka consumer process failed (exit {:?})", output.status.code());
    }
    serde_json::from_slice(&output.stdout).context("the consumer process's output")
}

fn rss_mib(field: &str) -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with(field)).and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .map_or(0.0, |kib| (kib / 1024.0 * 10.0).round() / 10.0)
}

/// `idem-bench consume`: consumes the topic to its end with the batch handler; prints its rate (from the first
/// commit to the last, so the group join is not counted) and its memory.
pub async fn consume(args: ConsumeArgs) -> anyhow::Result<ExitCode> {
    let pool = idem::postgres::connect(&args.database_url, 6).await?;
    let config = Config::new(args.group.clone(), KeyExtractor::JsonPointer("/id".into()))
        .batch_size(args.batch_size)
        .tables(Tables::new(None, PREFIX)?);
    let mut kafka = idem::kafka::KafkaConfig::new(args.kafka.clone(), &[args.topic.as_str()]);
    kafka.stop_at_end = true;
    for setting in &args.kafka_settings {
        let (key, value) =
            setting.split_once('=').with_context(|| format!("--kafka-setting `{setting}`: use KEY=VALUE"))?;
        kafka = kafka.set(key, value);
    }
    let source = idem::kafka::KafkaSource::connect(&kafka, &config).await?;
    if args.read_only {
        return read_only(source, args.batch_size).await;
    }
    let progress = Arc::new(Mutex::new(Progress::default()));
    let observer = {
        let (progress, deliveries) = (Arc::clone(&progress), args.deliveries);
        move |c: &idem::Committed| {
            if let Ok(mut p) = progress.lock() {
                p.record(c.processed + c.duplicate + c.dead_lettered + c.id_reused, deliveries);
            }
        }
    };
    let engine = Engine::new(pool, config)?.on_commit(observer);
    let stats = engine.run_batched(source, CreditAll, std::future::pending::<()>()).await?;
    let p = progress.lock().map_err(|_| anyhow::anyhow!("progress lock poisoned"))?;
    let (first, last) = (p.first.context("nothing was consumed")?, p.last.context("nothing was consumed")?);
    let span = last.duration_since(first).max(Duration::from_millis(1));
    println!(
        "{}",
        serde_json::json!({
            "processed": stats.processed,
            "duplicate": stats.duplicate,
            "per_second": (p.count - p.first_batch) as f64 / span.as_secs_f64(),
            "peak_rss_mib": rss_mib("VmHWM:"),
            "rss_mib_at_quarters": p.quarters,
        })
    );
    Ok(ExitCode::SUCCESS)
}

/// Reads the topic to its end as idem does (`read_limit`), batches of `batch_size`, and prints its rate.
async fn read_only(source: idem::kafka::KafkaSource, batch_size: usize) -> anyhow::Result<ExitCode> {
    let read = super::read_limit::read_as_idem_does(source, batch_size).await?;
    println!("{}", serde_json::json!({ "read": read.count, "per_second": read.per_second }));
    Ok(ExitCode::SUCCESS)
}

#[derive(Default)]
struct Progress {
    first: Option<Instant>,
    first_batch: u64,
    last: Option<Instant>,
    count: u64,
    quarters: Vec<f64>,
}

impl Progress {
    fn record(&mut self, n: u64, deliveries: u64) {
        let now = Instant::now();
        if self.first.is_none() {
            self.first = Some(now);
            self.first_batch = n;
        }
        self.last = Some(now);
        self.count += n;
        let quarter = (self.quarters.len() as u64 + 1) * deliveries / 4;
        if self.quarters.len() < 4 && self.count >= quarter {
            self.quarters.push(rss_mib("VmRSS:"));
        }
    }
}
