//! `idem-bench consume`: a consumer in a process of its own, so that its memory is measured alone. It reads a
//! Kafka topic (the Kafka leg) or an embedded log (the memory leg) to its end with the batch handler, and prints
//! its rate and its memory (peak RSS, and RSS at 25, 50, 75 and 100 % of the deliveries) as JSON.

use super::*;

/// Arguments of the hidden `idem-bench consume`.
#[derive(clap::Args, Debug)]
pub struct ConsumeArgs {
    #[arg(long)]
    database_url: String,
    /// Kafka brokers to read `--topic` from.
    #[arg(long, conflicts_with = "log", required_unless_present = "log")]
    kafka: Option<String>,
    /// An embedded log's directory to read `--topic` from.
    #[arg(long)]
    log: Option<PathBuf>,
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

/// Where the child reads from.
pub(super) enum Child<'a> {
    /// A Kafka topic on these brokers.
    Kafka(&'a str),
    /// A topic of the embedded log in this directory.
    Log(&'a std::path::Path),
}

/// Runs `idem-bench consume` (reading only, or into the database) and returns its JSON report.
pub(super) async fn consume_child(
    args: &BenchArgs,
    from: Child<'_>,
    topic: &str,
    group: &str,
    deliveries: usize,
    read_only: bool,
) -> anyhow::Result<serde_json::Value> {
    let mut command = tokio::process::Command::new(std::env::current_exe()?);
    command.args(["consume", "--database-url", &args.database_url, "--topic", topic]);
    match from {
        Child::Kafka(brokers) => {
            let settings = KAFKA_DEFAULTS.iter().copied().chain(args.kafka_settings.iter().map(String::as_str));
            command.args(["--kafka", brokers]).args(settings.flat_map(|s| ["--kafka-setting", s]));
        }
        Child::Log(dir) => {
            command.arg("--log").arg(dir);
        }
    }
    let output = command
        .args(["--group", group, "--batch-size", "1000", "--deliveries", &deliveries.to_string()])
        .args(read_only.then_some("--read-only"))
        .stderr(std::process::Stdio::inherit())
        .output()
        .await?;
    if !output.status.success() {
        bail!("the consumer process failed (exit {:?})", output.status.code());
    }
    serde_json::from_slice(&output.stdout).context("the consumer process's output")
}

/// The runs of a leg whose consumer is `idem-bench consume`: each report's rate, the highest peak RSS, and the
/// last run's RSS at each quarter.
#[derive(Default)]
pub(super) struct ChildRuns {
    rates: Vec<f64>,
    peak: f64,
    quarters: Vec<f64>,
}

impl ChildRuns {
    /// Adds one run's report.
    pub(super) fn add(&mut self, report: &serde_json::Value) {
        self.rates.push(report["per_second"].as_f64().unwrap_or(0.0));
        self.peak = self.peak.max(report["peak_rss_mib"].as_f64().unwrap_or(0.0));
        self.quarters = report["rss_mib_at_quarters"]
            .as_array()
            .map(|a| a.iter().filter_map(serde_json::Value::as_f64).collect())
            .unwrap_or_default();
    }

    /// The leg `name`, with its memory.
    pub(super) fn leg(self, name: String) -> Leg {
        let mut leg = Leg::new(name, self.rates);
        leg.peak_rss_mib = Some((self.peak * 10.0).round() / 10.0);
        leg.rss_mib_at_quarters = Some(self.quarters);
        leg
    }
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
    let config = Config::new(args.group.clone(), KeyExtractor::JsonPointer("/id".into()))
        .batch_size(args.batch_size)
        .tables(Tables::new(None, PREFIX)?);
    match (&args.kafka, &args.log) {
        (Some(brokers), _) => {
            let mut kafka = idem::kafka::KafkaConfig::new(brokers.clone(), &[args.topic.as_str()]);
            kafka.stop_at_end = true;
            for setting in &args.kafka_settings {
                let (key, value) =
                    setting.split_once('=').with_context(|| format!("--kafka-setting `{setting}`: use KEY=VALUE"))?;
                kafka = kafka.set(key, value);
            }
            let source = idem::kafka::KafkaSource::connect(&kafka, &config).await?;
            consume_from(&args, config, source).await
        }
        (None, Some(dir)) => {
            let log = idem::embedded::EmbeddedLog::open(dir)?;
            let options = idem::embedded::ConsumerOptions { stop_at_end: true, ..Default::default() };
            let source = log.consumer(&args.group, &[args.topic.as_str()], options)?;
            consume_from(&args, config, source).await
        }
        (None, None) => bail!("idem-bench consume: pass --kafka BROKERS or --log DIR"),
    }
}

async fn consume_from<S: Source>(args: &ConsumeArgs, config: Config, source: S) -> anyhow::Result<ExitCode> {
    if args.read_only {
        let read = super::read_limit::read_as_idem_does(source, args.batch_size).await?;
        println!("{}", serde_json::json!({ "read": read.count, "per_second": read.per_second }));
        return Ok(ExitCode::SUCCESS);
    }
    let pool = idem::postgres::connect(&args.database_url, 6).await?;
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
    let mut p = progress.lock().map_err(|_| anyhow::anyhow!("progress lock poisoned"))?;
    // The last sample is taken at the end, whatever the count (a delivery merged with its duplicate in one batch
    // is counted once).
    if p.quarters.len() < 4 {
        p.quarters.push(rss_mib("VmRSS:"));
    }
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
