//! `idem run --config idem.toml` and `idem check --config idem.toml`: exactly-once consumers declared in a file,
//! their effects written as SQL, for teams that do not write Rust.
//!
//! * [`file`]: the file's shape, environment variables, problems by line.
//! * [`plan`]: the file checked and turned into what runs, without connecting.
//! * [`sql`] and [`value`]: named parameters, their types and conversion.
//! * [`effect`]: the handler that applies a consumer's statements, guards and outbox emits.
//! * [`check`]: the statements and guards checked against the real database.
//!
//! A consumer here is the same engine a Rust program builds: the marker in the effect's transaction, the
//! acknowledgement after the commit, the retries, dead letters and the kill switch.

pub mod broker;
pub mod check;
pub mod effect;
pub mod file;
pub mod overrides;
pub mod plan;
pub mod sql;
pub mod value;

use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use idem::embedded::{ConsumerOptions, EmbeddedLog};
use idem::{BoxedSource, Engine};
use tokio::sync::watch;

use crate::commands::BrokerTarget;
use crate::db::Db;
use crate::signals::Signals;
use crate::with_pool;
use effect::{Configured, Running, ServiceDb};
use plan::{ConsumerPlan, Plan, SourcePlan};

/// Arguments of `idem run`.
#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// The configuration file.
    #[arg(long, short = 'c', env = "IDEM_CONFIG", default_value = "idem.toml")]
    pub config: PathBuf,
    /// Stop once every partition is read to its end (tests, batch jobs) instead of waiting for more.
    #[arg(long)]
    pub exit_at_end: bool,
    /// Print one JSON line per committed transaction on stdout (what the demo counts).
    #[arg(long, hide = true)]
    pub report_commits: bool,
    /// Kill this process with SIGKILL at a point of the transaction order (`before-commit:N`,
    /// `after-commit:N`): the demo's planned crashes and the crash tests. No environment variable arms it.
    #[arg(long, hide = true)]
    pub fault: Option<String>,
}

/// Arguments of `idem check`.
#[derive(clap::Args, Debug)]
pub struct CheckArgs {
    /// The configuration file.
    #[arg(long, short = 'c', env = "IDEM_CONFIG", default_value = "idem.toml")]
    pub config: PathBuf,
    /// Check the file alone, without connecting to the database or the brokers (or opening an embedded log).
    #[arg(long)]
    pub offline: bool,
}

/// Reads and plans the file; the problems, each with its line, as one error.
pub fn load(path: &Path) -> anyhow::Result<Plan> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read the configuration {}", path.display()))?;
    let mut text = file::Text::new(text, overrides::Override::from_env());
    let problems = match file::parse(&mut text) {
        Ok(parsed) => match plan::plan(&text, parsed) {
            Ok(plan) => return Ok(plan),
            Err(problems) => problems,
        },
        Err(problem) => vec![problem],
    };
    Err(refused(path, text.origins(), &problems))
}

/// Where the database URL was set, for the message when it cannot be reached.
fn url_setting(plan: &Plan) -> String {
    if std::env::var_os("IDEM_DATABASE_URL").is_some() {
        return "IDEM_DATABASE_URL".to_owned();
    }
    plan.origins.var_of("database.url").unwrap_or("[database] url").to_owned()
}

fn refused(path: &Path, origins: &overrides::Origins, problems: &[file::Problem]) -> anyhow::Error {
    let mut message = format!(
        "{} is refused ({} problem{}); nothing was consumed:",
        path.display(),
        problems.len(),
        if problems.len() == 1 { "" } else { "s" }
    );
    for p in problems {
        let what = file::Problem { line: None, ..p.clone() };
        message.push_str(&format!("\n  {}: {what}", origins.place(path, p)));
    }
    anyhow::anyhow!(message)
}

/// `idem check`: the file, then (unless `--offline`) its statements and guards against the database and what each
/// consumer needs from its broker.
pub async fn check(args: CheckArgs) -> anyhow::Result<ExitCode> {
    let plan = load(&args.config)?;
    if !args.offline {
        let problems = check::embedded_sources(&plan);
        if !problems.is_empty() {
            return Err(refused(&args.config, &plan.origins, &problems));
        }
        let db = Db::open_as(&plan.database.url, 2, &url_setting(&plan)).await?;
        let mut problems = with_pool!(db, pool => check::against_database(&pool, &plan).await);
        problems.extend(check::against_brokers(&plan).await);
        if !problems.is_empty() {
            return Err(refused(&args.config, &plan.origins, &problems));
        }
    }
    let names: Vec<&str> = plan.consumers.iter().map(|c| c.name.as_str()).collect();
    let mut vars: Vec<&str> = plan.origins.vars.iter().map(String::as_str).collect();
    if std::env::var_os("IDEM_DATABASE_URL").is_some() {
        vars.insert(0, "IDEM_DATABASE_URL");
    }
    let from_env = match vars.as_slice() {
        [] => String::new(),
        vars => format!("; from the environment: {}", vars.join(", ")),
    };
    println!(
        "{}: ok ({} consumer{}: {}){from_env}{}",
        args.config.display(),
        names.len(),
        if names.len() == 1 { "" } else { "s" },
        names.join(", "),
        if args.offline { "; the database and the sources were not consulted (--offline)" } else { "" }
    );
    Ok(ExitCode::SUCCESS)
}

/// `idem run`: every consumer of the file until SIGINT or SIGTERM (which drain: what committed is acknowledged)
/// or, with `--exit-at-end`, until each has read its source to the end.
pub async fn run(args: RunArgs) -> anyhow::Result<ExitCode> {
    let signals = Signals::install()?;
    let plan = load(&args.config)?;
    // What is missing from an embedded log is refused before anything, the database included, is touched.
    let problems = check::embedded_sources(&plan);
    if !problems.is_empty() {
        return Err(refused(&args.config, &plan.origins, &problems));
    }
    let db = Db::open_as(&plan.database.url, plan.database.connections, &url_setting(&plan)).await?;
    let (stop, _) = watch::channel(false);
    let on_signal = stop.clone();
    tokio::spawn(async move {
        signals.received().await;
        tracing::info!("signal received: draining (what committed is acknowledged), then exiting");
        // `send_replace` stores the flag even before any consumer subscribed (a signal during start-up).
        on_signal.send_replace(true);
    });
    with_pool!(db, pool => serve(pool, &args, &args.config, plan, stop).await)?;
    Ok(ExitCode::SUCCESS)
}

async fn serve<DB: ServiceDb>(
    pool: sqlx::Pool<DB>,
    args: &RunArgs,
    path: &Path,
    plan: Plan,
    stop: watch::Sender<bool>,
) -> anyhow::Result<()> {
    if plan.database.migrate {
        crate::db::reconnecting(|| idem::migrate(&pool, &plan.database.tables))
            .await
            .context("migrating idem's tables")?;
    }
    let problems = check::against_database(&pool, &plan).await;
    if !problems.is_empty() {
        return Err(refused(path, &plan.origins, &problems));
    }
    let mut engines = Vec::new();
    let mut running: Vec<(String, Running)> = Vec::new();
    for consumer in &plan.consumers {
        let handler =
            crate::db::reconnecting(|| Configured::new(&pool, consumer)).await.with_context(|| whose(consumer))?;
        let mut engine = Engine::new(pool.clone(), consumer.config.clone()).with_context(|| whose(consumer))?;
        if args.report_commits {
            engine = engine.on_commit(crate::demo::report_commit);
        }
        if let Some(faults) = crate::demo::faults(args.fault.as_deref())? {
            engine = engine.with_faults(faults);
        }
        let future = start(engine.clone(), consumer, handler, args.exit_at_end, until(stop.subscribe()))
            .await
            .with_context(|| whose(consumer))?;
        // A consumer that fails stops the others (they drain), so the process exits with its error and a
        // supervisor restarts it, instead of running on with one consumer dead.
        let stop = stop.clone();
        let future: Running = Box::pin(async move {
            let result = future.await;
            if result.is_err() {
                stop.send_replace(true);
            }
            result
        });
        engines.push(engine);
        running.push((consumer.name.clone(), future));
    }
    if let Some(console) = &plan.console {
        serve_console(&pool, &plan, console, &engines).await?;
    }
    if let Some(addr) = plan.listen {
        let recorder = idem::http::install_recorder()?;
        let bound = idem::http::serve(addr, recorder, engines).await?;
        tracing::info!(%bound, "serving /metrics, /healthz, /readyz");
    }
    tracing::info!(consumers = running.len(), database = %plan.database.shown, "consuming");
    let (names, futures): (Vec<String>, Vec<Running>) = running.into_iter().unzip();
    let results = futures_util::future::join_all(futures).await;
    let mut failed = None;
    for (name, result) in names.iter().zip(results) {
        match result {
            Ok(stats) => tracing::info!(
                consumer = %name,
                processed = stats.processed,
                duplicates = stats.duplicate,
                stale = stats.stale,
                rejected = stats.rejected,
                dead_lettered = stats.dead_lettered,
                "stopped"
            ),
            Err(e) => failed = Some(anyhow::Error::from(e).context(format!("consumer `{name}`"))),
        }
    }
    failed.map_or(Ok(()), Err)
}

/// Serves `[console]` with this process's consumers; replays go to the broker the consumers share (none when they
/// use different brokers: the console says so when asked to replay).
async fn serve_console<DB: ServiceDb>(
    pool: &sqlx::Pool<DB>,
    plan: &Plan,
    console: &plan::ConsolePlan,
    engines: &[Engine<DB>],
) -> anyhow::Result<()> {
    let mut trials = Vec::new();
    for consumer in &plan.consumers {
        let handler = Configured::new(pool, consumer).await.with_context(|| whose(consumer))?;
        let trial = effect::ConfiguredTrial { pool: pool.clone(), group: consumer.config.group.clone(), handler };
        trials.push(std::sync::Arc::new(trial) as std::sync::Arc<dyn idem::console::Trial>);
    }
    let targets: Vec<Option<BrokerTarget>> = plan.consumers.iter().map(|c| broker_of(&c.source)).collect();
    let shared =
        targets.first().and_then(Option::as_ref).filter(|first| targets.iter().all(|t| t.as_ref() == Some(*first)));
    let publisher = match shared {
        Some(target) => Some(target.publisher().await.context("[console]: the broker replays go to")?),
        None => {
            tracing::warn!(
                "[console]: the consumers use different brokers (or HTTP, which has none), so the console cannot replay; use `idem console` with the broker's flags"
            );
            None
        }
    };
    let config = idem::console::ConsoleConfig {
        users: console.users.clone(),
        show_payloads: console.show_payloads,
        behind_proxy: console.behind_proxy,
        message_type: console.message_type.clone(),
        consumers: idem::console::Consumers::of(engines),
        trials: idem::console::Trials(trials),
    };
    let tables = plan.database.tables.clone();
    let bound =
        idem::console::serve(console.listen, pool.clone(), tables, publisher, config).await.context("[console]")?;
    tracing::info!(%bound, "serving the operator console");
    Ok(())
}

/// The broker a consumer reads from, as the replays' target; none for HTTP (its requests come from clients).
fn broker_of(source: &SourcePlan) -> Option<BrokerTarget> {
    Some(match source {
        SourcePlan::Embedded { dir, .. } => BrokerTarget::Log(PathBuf::from(dir)),
        SourcePlan::Kafka { brokers, .. } => BrokerTarget::Kafka(brokers.clone()),
        SourcePlan::Nats { url, .. } => BrokerTarget::Nats(url.clone()),
        SourcePlan::Rabbit { url, .. } => BrokerTarget::Rabbitmq(url.clone()),
        SourcePlan::Sqs { endpoint, .. } => BrokerTarget::Sqs(endpoint.clone().unwrap_or_else(|| "aws".to_owned())),
        SourcePlan::PubSub { project, .. } => BrokerTarget::PubSub(project.clone().unwrap_or_default()),
        SourcePlan::Http { .. } => return None,
    })
}

fn whose(consumer: &ConsumerPlan) -> String {
    format!("consumer `{}` (line {})", consumer.name, consumer.line)
}

/// Completes once the stop flag is raised.
async fn until(mut stopped: watch::Receiver<bool>) {
    let _ = stopped.wait_for(|stop| *stop).await;
}

/// Connects the consumer's source and returns its run, not yet polled.
async fn start<DB: ServiceDb>(
    engine: Engine<DB>,
    consumer: &ConsumerPlan,
    handler: Configured<DB>,
    exit_at_end: bool,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<Running> {
    let config = &consumer.config;
    match &consumer.source {
        SourcePlan::Embedded { dir, topics } => {
            if !Path::new(dir).is_dir() {
                anyhow::bail!(
                    "embedded.dir `{dir}` does not exist: fix the path, or create the log by producing into it first \
                     (`idem log produce --log-dir {dir} --topic …`)"
                );
            }
            let log = EmbeddedLog::open(dir).with_context(|| format!("embedded log {dir}"))?;
            let topics: Vec<&str> = topics.iter().map(String::as_str).collect();
            let options = ConsumerOptions { stop_at_end: exit_at_end, ..ConsumerOptions::default() };
            let source = log.consumer(&config.group, &topics, options)?;
            Ok(launch(engine, consumer, BoxedSource::new(source), handler, shutdown))
        }
        #[cfg(feature = "kafka")]
        SourcePlan::Kafka { .. } => {
            let kafka = broker::kafka(&consumer.source, exit_at_end)?;
            let source = idem::kafka::KafkaSource::connect(&kafka, config).await?;
            Ok(launch(engine, consumer, BoxedSource::new(source), handler, shutdown))
        }
        #[cfg(feature = "nats")]
        SourcePlan::Nats { .. } => {
            let nats = broker::nats(&consumer.source, exit_at_end)?;
            let source = idem::nats::NatsSource::connect(&nats, config).await?;
            Ok(launch(engine, consumer, BoxedSource::new(source), handler, shutdown))
        }
        #[cfg(feature = "rabbitmq")]
        SourcePlan::Rabbit { .. } => {
            let rabbit = broker::rabbitmq(&consumer.source, exit_at_end)?;
            let source = idem::rabbitmq::RabbitSource::connect(&rabbit, config).await?;
            Ok(launch(engine, consumer, BoxedSource::new(source), handler, shutdown))
        }
        #[cfg(feature = "sqs")]
        SourcePlan::Sqs { .. } => {
            let sqs = broker::sqs(&consumer.source, exit_at_end)?;
            let source = idem::sqs::SqsSource::connect(&sqs, config).await?;
            Ok(launch(engine, consumer, BoxedSource::new(source), handler, shutdown))
        }
        #[cfg(feature = "pubsub")]
        SourcePlan::PubSub { .. } => {
            let pubsub = broker::pubsub(&consumer.source, exit_at_end)?;
            let source = idem::pubsub::PubSubSource::connect(&pubsub, config).await?;
            Ok(launch(engine, consumer, BoxedSource::new(source), handler, shutdown))
        }
        SourcePlan::Http { listen, path, limits, signature } => {
            if exit_at_end {
                tracing::warn!(consumer = %consumer.name, "--exit-at-end does not apply to [consumer.http]: it serves until stopped");
            }
            let listener = tokio::net::TcpListener::bind(listen).await.with_context(|| {
                format!("[consumer.http] listen = \"{listen}\" cannot be bound: another process holds it, or the address is not this machine's")
            })?;
            let options = idem::ingress::Options { signature: signature.clone(), limits: *limits };
            let ingress = idem::ingress::Ingress::on_engine(engine, idem::ingress::Acknowledge(handler), options)?;
            let bound = listener.local_addr().map_or_else(|_| listen.to_string(), |a| a.to_string());
            tracing::info!(consumer = %consumer.name, listen = %bound, path = %path, "serving HTTP requests");
            let path = path.clone();
            Ok(Box::pin(async move { ingress.serve(listener, &path, shutdown).await }))
        }
        #[allow(unreachable_patterns)]
        _ => anyhow::bail!("this idem is built without this consumer's source (see `idem check`)"),
    }
}

/// The consumer's run on `source`: per event, per batch (the bulk form) or through the Sequential Inbox. The
/// source is boxed, so that each run is compiled once per database rather than once per broker and database.
fn launch<DB: ServiceDb>(
    engine: Engine<DB>,
    consumer: &ConsumerPlan,
    source: BoxedSource,
    handler: Configured<DB>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Running {
    if let Some(inbox) = consumer.inbox.clone() {
        return DB::inbox(engine, inbox, source, handler, Box::pin(shutdown));
    }
    if handler.is_bulk() {
        Box::pin(async move { engine.run_batched(source, handler, shutdown).await })
    } else {
        Box::pin(async move { engine.run(source, handler, shutdown).await })
    }
}
