//! The NATS JetStream, RabbitMQ and Google Pub/Sub legs: the events loaded into the broker, then per run read and
//! acknowledged as idem does but with no database (the broker's read limit, `read_limit`) and consumed end to end
//! by idem with the batch handler (batch 1000), each from the first message to the last commit.

use super::*;

/// Runs the legs of every broker that has a server (`--nats`, `--rabbitmq`, `--pubsub`) and is `wanted`; a
/// broker without one gets a note.
pub(super) async fn run(
    pool: &PgPool,
    args: &BenchArgs,
    wanted: &dyn Fn(&str) -> bool,
    progress: &dyn Fn(&str),
    notes: &mut Vec<String>,
) -> anyhow::Result<Vec<Leg>> {
    let mut legs = Vec::new();
    let brokers = [
        ("NATS JetStream", "--nats", &args.nats),
        ("RabbitMQ", "--rabbitmq", &args.rabbitmq),
        (pubsub_name(), "--pubsub", &args.pubsub),
    ];
    for (broker, flag, url) in brokers {
        let events = args.broker_events;
        if !wanted(&read_limit_name(broker, events)) && !wanted(&end_to_end_name(broker, events)) {
            continue;
        }
        let Some(url) = url else {
            notes.push(format!("{broker} legs skipped: no {flag}"));
            continue;
        };
        progress(&format!("{broker} read limit and idem end to end"));
        let (read, consume) = match flag {
            "--rabbitmq" => broker_legs(pool, args, RabbitLeg::new(url), args.broker_events).await?,
            "--pubsub" => broker_legs(pool, args, PubSubLeg::new(url), args.broker_events).await?,
            _ => broker_legs(pool, args, NatsLeg::new(url), args.broker_events).await?,
        };
        legs.extend([read, consume]);
    }
    Ok(legs)
}

/// A broker the legs run on: how to load the events and open a source over them.
trait BrokerLeg {
    type Source: idem::Source;
    /// The broker's name in the legs' names.
    fn name(&self) -> &'static str;
    /// Loads `records` (account, payload) under a name of the run's own.
    async fn load(&mut self, records: &[(i64, String)]) -> anyhow::Result<()>;
    /// A source over what was loaded, ending once it is all delivered; `group` is fresh per run.
    async fn source(&self, config: &Config) -> anyhow::Result<Self::Source>;
    /// Whether reading consumes the events (a queue), so they are loaded again before each read.
    fn reading_consumes(&self) -> bool;
    /// Removes what `load` created.
    async fn remove(&self);
}

/// Runs the read-limit and end-to-end legs on `broker` and returns them.
async fn broker_legs<B: BrokerLeg>(
    pool: &PgPool,
    args: &BenchArgs,
    mut broker: B,
    events: usize,
) -> anyhow::Result<(Leg, Leg)> {
    let work = workload(events, args.duplicates, args.accounts, args.seed ^ 0x6272_6f6b);
    let records: Vec<(i64, String)> = work.deliveries.iter().map(|p| (p.account, payload(p))).collect();
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let (mut reads, mut runs) = (Vec::new(), Vec::new());
    broker.load(&records).await?;
    let tables = Tables::new(None, PREFIX)?;
    let config = |group: String| {
        Config::new(group, KeyExtractor::JsonPointer("/id".into())).batch_size(1000).tables(tables.clone())
    };
    for run in 0..args.runs {
        let read_config = config(format!("bench-read-{nanos}-{run}"));
        reads.push(read_limit::read_as_idem_does(broker.source(&read_config).await?, 1000).await?.per_second);
        if broker.reading_consumes() {
            broker.load(&records).await?;
        }
        fresh_tables(pool, args.accounts).await?;
        let engine_config = config(format!("bench-{nanos}-{run}"));
        let engine_pool = idem::postgres::connect(&args.database_url, 6).await?;
        let source = broker.source(&engine_config).await?;
        runs.push(end_to_end(engine_pool, engine_config, source).await?);
        check_ledger(pool, broker.name(), work.expected_total, work.unique as i64).await?;
        if broker.reading_consumes() && run + 1 < args.runs {
            broker.load(&records).await?;
        }
    }
    broker.remove().await;
    let read = Leg::new(read_limit_name(broker.name(), events), reads);
    let idem = Leg::new(end_to_end_name(broker.name(), events), runs);
    Ok((read, idem))
}

/// Pub/Sub's name in the legs' names: the emulator's figures are named as such.
pub(super) fn pubsub_name() -> &'static str {
    if idem_cli::pubsub::emulator().is_some() { "Pub/Sub emulator" } else { "Pub/Sub" }
}

/// The name of a broker's read-limit leg, which `--only` matches before the leg runs.
pub(super) fn read_limit_name(broker: &str, events: usize) -> String {
    format!("{broker} read limit: read and acknowledged as idem does, no database ({events} events)")
}

/// The name of a broker's end-to-end leg, which `--only` matches before the leg runs.
pub(super) fn end_to_end_name(broker: &str, events: usize) -> String {
    format!("idem end to end from {broker}, batched 1000, 4 partitions ({events} events)")
}

/// Consumes the source to its end with the batch handler; the rate from the first commit to the last.
async fn end_to_end<S: idem::Source>(pool: PgPool, config: Config, source: S) -> anyhow::Result<f64> {
    let span = Arc::new(Mutex::new((None::<Instant>, 0u64, 0u64, Instant::now())));
    let observer = {
        let span = Arc::clone(&span);
        move |c: &idem::Committed| {
            if let Ok(mut s) = span.lock() {
                let n = c.processed + c.duplicate + c.dead_lettered + c.id_reused;
                if s.0.is_none() {
                    *s = (Some(Instant::now()), n, 0, Instant::now());
                }
                s.2 += n;
                s.3 = Instant::now();
            }
        }
    };
    let engine = Engine::new(pool.clone(), config)?.on_commit(observer);
    engine.run_batched(source, CreditAll, std::future::pending::<()>()).await?;
    pool.close().await;
    let (first, first_batch, count, last) = *span.lock().map_err(|_| anyhow::anyhow!("progress lock poisoned"))?;
    let first = first.context("nothing was committed")?;
    Ok((count - first_batch) as f64 / last.duration_since(first).as_secs_f64().max(1e-3))
}

/// NATS JetStream: one stream, read by a fresh durable consumer per run, its subjects spread over 4 partitions.
struct NatsLeg {
    url: String,
    stream: String,
}

impl NatsLeg {
    fn new(url: &str) -> Self {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        NatsLeg { url: url.to_owned(), stream: format!("bench-{nanos}") }
    }
}

impl BrokerLeg for NatsLeg {
    type Source = idem::nats::NatsSource;

    fn name(&self) -> &'static str {
        "NATS JetStream"
    }

    async fn load(&mut self, records: &[(i64, String)]) -> anyhow::Result<()> {
        idem_cli::demo::write_nats(&self.url, &self.stream, records).await
    }

    async fn source(&self, config: &Config) -> anyhow::Result<Self::Source> {
        let nats = idem::nats::NatsConfig {
            stop_at_end: true,
            partitions: 4,
            ..idem::nats::NatsConfig::new(&self.url, &self.stream)
        };
        Ok(idem::nats::NatsSource::connect(&nats, config).await?)
    }

    fn reading_consumes(&self) -> bool {
        false
    }

    async fn remove(&self) {
        let _ = idem::nats::delete_stream(&self.url, &self.stream).await;
    }
}

/// RabbitMQ: four classic queues (four partitions), loaded again before each read.
struct RabbitLeg {
    url: String,
    queues: Vec<String>,
}

impl RabbitLeg {
    fn new(url: &str) -> Self {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        RabbitLeg { url: url.to_owned(), queues: (0..4).map(|p| format!("bench-{nanos}-{p}")).collect() }
    }
}

impl BrokerLeg for RabbitLeg {
    type Source = idem::rabbitmq::RabbitSource;

    fn name(&self) -> &'static str {
        "RabbitMQ"
    }

    async fn load(&mut self, records: &[(i64, String)]) -> anyhow::Result<()> {
        idem_cli::demo::write_rabbitmq(&self.url, &self.queues, records).await
    }

    async fn source(&self, config: &Config) -> anyhow::Result<Self::Source> {
        let queues: Vec<&str> = self.queues.iter().map(String::as_str).collect();
        let rabbit =
            idem::rabbitmq::RabbitConfig { stop_at_end: true, ..idem::rabbitmq::RabbitConfig::new(&self.url, &queues) };
        Ok(idem::rabbitmq::RabbitSource::connect(&rabbit, config).await?)
    }

    fn reading_consumes(&self) -> bool {
        true
    }

    async fn remove(&self) {
        for queue in &self.queues {
            let _ = idem::rabbitmq::delete_queue(&self.url, queue).await;
        }
    }
}

/// Google Pub/Sub: one topic with message ordering, 64 ordering keys; a fresh subscription before each
/// load (a subscription receives only what is published after it exists), the previous one removed. On the
/// emulator the legs measure the emulator.
struct PubSubLeg {
    project: String,
    topic: String,
    subscription: Option<String>,
    loads: u32,
}

impl PubSubLeg {
    fn new(project: &str) -> Self {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        PubSubLeg { project: project.to_owned(), topic: format!("bench-{nanos}"), subscription: None, loads: 0 }
    }
}

impl BrokerLeg for PubSubLeg {
    type Source = idem::pubsub::PubSubSource;

    fn name(&self) -> &'static str {
        pubsub_name()
    }

    async fn load(&mut self, records: &[(i64, String)]) -> anyhow::Result<()> {
        let emulator = idem_cli::pubsub::emulator();
        if self.loads == 0 {
            idem::pubsub::create_topic(emulator.as_deref(), &self.project, &self.topic).await?;
        }
        if let Some(old) = self.subscription.take() {
            let _ = idem::pubsub::delete_subscription(emulator.as_deref(), &self.project, &old).await;
        }
        let subscription = format!("{}-{}", self.topic, self.loads);
        self.loads += 1;
        let options = idem::pubsub::SubscriptionOptions { ordering: true, ..Default::default() };
        idem::pubsub::create_subscription(emulator.as_deref(), &self.project, &self.topic, &subscription, &options)
            .await?;
        self.subscription = Some(subscription);
        // 64 ordering keys (an account's payments stay in order under its key): the emulator keeps threads per
        // ordering key, and with the workload's 10,000 it ran 17,000 threads that kept both cores busy.
        let keyed: Vec<(i64, String)> = records.iter().map(|(account, p)| (account % 64, p.clone())).collect();
        idem_cli::pubsub::publish(&self.project, &self.topic, &keyed).await
    }

    async fn source(&self, config: &Config) -> anyhow::Result<Self::Source> {
        let subscription = self.subscription.as_deref().context("nothing was loaded")?;
        let pubsub = idem::pubsub::PubSubConfig {
            project: Some(self.project.clone()),
            partitions: 4,
            max_outstanding_messages: Some(4000),
            require_ordering: true,
            stop_at_end: true,
            ..idem::pubsub::PubSubConfig::new(subscription)
        };
        Ok(idem::pubsub::PubSubSource::connect(&pubsub, config).await?)
    }

    fn reading_consumes(&self) -> bool {
        true
    }

    async fn remove(&self) {
        let emulator = idem_cli::pubsub::emulator();
        if let Some(subscription) = &self.subscription {
            let _ = idem::pubsub::delete_subscription(emulator.as_deref(), &self.project, subscription).await;
        }
        let _ = idem::pubsub::delete_topic(emulator.as_deref(), &self.project, &self.topic).await;
    }
}
