//! The configured consumer (`idem run --config`): the same credits declared as SQL in a configuration file, run
//! by the same engine over the same in-memory source as the Rust handler's legs, per event and in the bulk form.

use idem_cli::service::effect::Configured;
use idem_cli::service::{file, plan};

use super::idem_legs::{engine_over, finished};
use super::*;

/// The file: the bench's credit per event, or per batch over arrays (`bulk`).
fn config_text(database_url: &str, bulk: bool) -> String {
    let effect = if bulk {
        r#"[[consumer.bulk]]
sql = """
UPDATE bench_accounts a SET balance = a.balance + d.amount
  FROM (SELECT account, SUM(amount)::bigint AS amount FROM UNNEST(:account, :amount) AS t(account, amount)
        GROUP BY account) d
 WHERE a.id = d.account""""#
    } else {
        r#"[[consumer.effect]]
sql = "UPDATE bench_accounts SET balance = balance + :amount WHERE id = :account""#
    };
    format!(
        r#"[database]
url = "{database_url}"
migrate = false

[[consumer]]
name = "bench"
key = "json:/id"
embedded = {{ dir = "unused", topics = ["unused"] }}

[consumer.params]
account = {{ from = "json:/account", type = "integer" }}
amount  = {{ from = "json:/amount", type = "integer" }}

{effect}
"#
    )
}

/// One run of the configured consumer: `batch_size` messages per transaction over `partitions`.
pub(super) async fn configured_leg(
    pool: &PgPool,
    args: &BenchArgs,
    work: &Workload,
    batch_size: usize,
    partitions: i32,
    bulk: bool,
) -> anyhow::Result<f64> {
    let mut text = file::Text::new(config_text(&args.database_url, bulk), Vec::new());
    let parsed = file::parse(&mut text).map_err(|p| anyhow::anyhow!("bench configuration: {p}"))?;
    let plan = plan::plan(&text, parsed).map_err(|p| anyhow::anyhow!("bench configuration: {p:?}"))?;
    let (engine, engine_pool, source) = engine_over(pool, args, work, batch_size, partitions).await?;
    let handler = Configured::new(&engine_pool, &plan.consumers[0]).await?;
    let started = Instant::now();
    let stats = match bulk {
        true => engine.run_batched(source, handler, std::future::pending::<()>()).await?,
        false => engine.run(source, handler, std::future::pending::<()>()).await?,
    };
    finished(pool, &engine_pool, work, stats.processed, started).await
}
