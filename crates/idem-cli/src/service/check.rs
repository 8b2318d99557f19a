//! The file against the real database: every statement prepared (none runs), every guard's
//! table and columns read. Each failure is a problem at the statement's or the consumer's line.

use super::effect::{Configured, ServiceDb};
use super::file::Problem;
use super::plan::Plan;

/// What `idem run` would find missing in the embedded logs the plan reads: the directory, a topic.
pub fn embedded_sources(plan: &super::plan::Plan) -> Vec<Problem> {
    let mut problems = Vec::new();
    for consumer in &plan.consumers {
        let super::plan::SourcePlan::Embedded { dir, topics } = &consumer.source else { continue };
        let problem = |message: String| Problem {
            line: Some(consumer.line),
            key: format!("consumer `{}`.embedded", consumer.name),
            message,
        };
        if !std::path::Path::new(dir).is_dir() {
            problems.push(problem(format!(
                "the directory `{dir}` does not exist: fix the path, or create the log by producing into it first \
                 (`idem log produce --log-dir {dir} --topic …`)"
            )));
            continue;
        }
        let Ok(log) = idem::embedded::EmbeddedLog::open(dir) else { continue };
        for topic in topics {
            if log.partitions(topic).is_err() {
                problems.push(problem(format!(
                    "the topic `{topic}` does not exist in `{dir}`: produce into it first (`idem log produce --log-dir \
                     {dir} --topic {topic}`), or fix its name"
                )));
            }
        }
    }
    problems
}

/// What each consumer's broker lacks for `idem run` (see [`super::broker::check`]), at the consumer's line.
pub async fn against_brokers(plan: &Plan) -> Vec<Problem> {
    let mut problems = Vec::new();
    for consumer in &plan.consumers {
        if let Err(e) = super::broker::check(&consumer.source, &consumer.config).await {
            problems.push(Problem {
                line: Some(consumer.line),
                key: format!("consumer `{}` source", consumer.name),
                message: format!("{e:#}"),
            });
        }
    }
    problems
}

/// Every problem the database finds in the plan; empty when it accepts all of it.
pub async fn against_database<DB: ServiceDb>(pool: &sqlx::Pool<DB>, plan: &Plan) -> Vec<Problem> {
    let mut problems = Vec::new();
    if !plan.database.migrate {
        problems.extend(migrations_missing(pool, plan).await);
    }
    for consumer in &plan.consumers {
        for sql in consumer.each.iter().chain(&consumer.bulk) {
            let prepared = crate::db::reconnecting(|| DB::prepare(pool, &sql.rendered.text)).await;
            if let Err(e) = prepared {
                let message = match e.as_database_error() {
                    Some(db) => db.message().to_owned(),
                    None => e.to_string(),
                };
                problems.push(Problem {
                    line: Some(sql.line),
                    key: sql.key.clone(),
                    message: format!(
                        "the database refuses it: {message} (the statement as sent, parameters numbered: {})",
                        sql.rendered.text
                    ),
                });
            }
        }
        if (consumer.version_guard.is_some() || consumer.state_machine.is_some())
            && let Err(e) = crate::db::reconnecting(|| Configured::new(pool, consumer)).await
        {
            problems.push(Problem {
                line: Some(consumer.guard_line),
                key: format!("consumer `{}` guard", consumer.name),
                message: format!("{e:#}"),
            });
        }
    }
    problems
}

/// With `migrate = false`, idem's own tables are someone else's to create: a migration not applied (or changed
/// after it was) is a problem, found before a consumer meets a missing table.
async fn migrations_missing<DB: ServiceDb>(pool: &sqlx::Pool<DB>, plan: &Plan) -> Option<Problem> {
    use idem::store::MigrationState::{Applied, Unknown};
    let problem = |message: String| Problem { line: None, key: "database.migrate".into(), message };
    let status = match crate::db::reconnecting(|| idem::store::migration_status(pool, &plan.database.tables)).await {
        Ok(status) => status,
        Err(e) => return Some(problem(format!("cannot read which of idem's migrations are applied: {e}"))),
    };
    let missing: Vec<String> = status
        .iter()
        .filter(|m| !matches!(m.state, Applied | Unknown))
        .map(|m| {
            let state = if m.applied_checksum.is_some() { "changed since it was applied" } else { "pending" };
            format!("{} ({}, {state})", m.version, m.name)
        })
        .collect();
    (!missing.is_empty()).then(|| {
        problem(format!(
            "is false, but idem's migrations {} are not applied in this database: apply them (`idem migrate`, or the \
             script of `idem migrate --print-sql` with your own tool, for the same schema and table_prefix), or set \
             migrate = true",
            missing.join(", ")
        ))
    })
}
