//! `idem demo --chain`: after the payments are credited (each credit enqueuing a `PaymentCredited` event in the
//! outbox, in its transaction), relay processes deliver the events to a second topic while being killed with
//! SIGKILL at random points, and a second consumer group, killed at its fault points too, applies them to a
//! second ledger that counts every account's events arriving out of order. Both ledgers must match to the cent.

use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, bail};
use idem::Tables;
use serde::Serialize;

use super::events::{Plan, Rng};
use super::{DemoArgs, PREFIX, Summary, Transport};
use crate::db::Db;

/// The consumer group of the second stage.
const SECOND_GROUP: &str = "demo-second";

/// What the chain's second half did and found.
#[derive(Debug, Default, Serialize)]
pub(super) struct ChainSummary {
    relay_runs: u32,
    relays_killed: u32,
    relayed_by_the_last_run: u64,
    second_consumer_runs: u32,
    second_crashes_survived: u32,
    second_processed: u64,
    second_duplicates_absorbed: u64,
    expected_total_cents: i64,
    second_total_cents: i64,
    second_ledger_entries: i64,
    second_distinct_events: i64,
    out_of_order: i64,
    outbox_left: i64,
}

impl ChainSummary {
    /// The chain's lines of the demo's table.
    pub(super) fn lines(&self) -> Vec<String> {
        vec![
            format!("  chain: relay runs       {:>12}  ({} killed with SIGKILL)", self.relay_runs, self.relays_killed),
            format!(
                "  second consumer        {:>12}  processed, {} duplicates absorbed, {} crashes survived",
                self.second_processed, self.second_duplicates_absorbed, self.second_crashes_survived
            ),
            format!(
                "  second ledger total    {:>12}  cents in {} entries, {} out of order",
                self.second_total_cents, self.second_ledger_entries, self.out_of_order
            ),
        ]
    }
}

/// The topic the first stage announces to.
pub(super) fn topic(transport: &Transport) -> String {
    match transport {
        Transport::Kafka { topic, .. } => format!("{topic}-credited"),
        _ => "credited".to_owned(),
    }
}

/// Relays the outbox (killing relays at random) until it is empty, then consumes the announced events into the
/// second ledger (killing consumers at their fault points).
pub(super) async fn relay_and_apply(
    args: &DemoArgs,
    transport: &Transport,
    topic: &str,
    url: &str,
    plan: &Plan,
    seed: u64,
    summary: &mut Summary,
) -> anyhow::Result<()> {
    let mut chain = ChainSummary { expected_total_cents: plan.expected_total, ..ChainSummary::default() };
    let (target, second, extra) = match transport {
        Transport::Embedded(dir) => {
            idem::embedded::EmbeddedLog::open(dir)?.create_topic(topic, args.partitions)?;
            let target = vec!["--log-dir".to_owned(), dir.display().to_string()];
            let extra = ["--topic", topic, "--group", SECOND_GROUP, "--second-ledger"].map(String::from).to_vec();
            (target, Transport::Embedded(dir.clone()), extra)
        }
        Transport::Kafka { brokers, group, .. } => {
            super::events::create_kafka_topic(brokers, topic, args.partitions).await?;
            let second = Transport::Kafka {
                brokers: brokers.clone(),
                topic: topic.to_owned(),
                group: format!("{group}-second"),
            };
            (vec!["--kafka".to_owned(), brokers.clone()], second, vec!["--second-ledger".to_owned()])
        }
        _ => bail!("--chain runs on the embedded log or Kafka"),
    };
    if !args.json {
        eprintln!("relaying the outbox to {topic}, killing the relay {} time(s)…", args.crashes);
    }
    relay(args, url, &target, seed, &mut chain).await?;
    if !args.json {
        eprintln!("applying {topic} to the second ledger with {} crash(es)…", args.crashes);
    }
    let mut stage = Summary::default();
    super::consume(args, &second, url, plan.expected_entries as u64, seed ^ 0xc4a1, &extra, None, &mut stage).await?;
    chain.second_consumer_runs = stage.consumer_runs;
    chain.second_crashes_survived = stage.crashes_survived;
    chain.second_processed = stage.processed;
    chain.second_duplicates_absorbed = stage.duplicates_absorbed;
    summary.chain = Some(chain);
    Ok(())
}

/// Runs relay processes, each killed with SIGKILL after a random while, then one to the end of the outbox.
async fn relay(
    args: &DemoArgs,
    url: &str,
    target: &[String],
    seed: u64,
    chain: &mut ChainSummary,
) -> anyhow::Result<()> {
    let exe = std::env::current_exe().context("cannot find the idem executable to run relays")?;
    let mut rng = Rng(seed ^ 0x7e1a);
    let command = |last: bool| {
        let mut command = tokio::process::Command::new(&exe);
        command
            .args(["--log", "error", "relay", "--database-url", url, "--table-prefix", PREFIX, "--name", "demo"])
            .args(target)
            .args(["--batch-size", &args.batch_size.to_string(), "--poll-interval-ms", "100"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .kill_on_drop(true);
        if last {
            command.args(["--until-empty", "--json"]);
        }
        command
    };
    for _ in 0..args.crashes {
        let mut child = command(false).spawn().context("cannot start a relay process")?;
        chain.relay_runs += 1;
        tokio::time::sleep(Duration::from_millis(100 + rng.below(700))).await;
        child.start_kill().context("cannot kill the relay")?; // SIGKILL
        child.wait().await?;
        chain.relays_killed += 1;
    }
    let last = command(true).spawn().context("cannot start a relay process")?.wait_with_output().await?;
    chain.relay_runs += 1;
    if !last.status.success() {
        bail!("the last relay failed ({}); see its errors above", last.status);
    }
    let stats: serde_json::Value = serde_json::from_slice(&last.stdout).context("the relay's --json output")?;
    chain.relayed_by_the_last_run = stats["delivered"].as_u64().unwrap_or(0);
    Ok(())
}

/// Checks the second ledger against the plan and the outbox; every difference is a mismatch.
pub(super) async fn verify(db: &Db, plan: &Plan, summary: &mut Summary) -> anyhow::Result<()> {
    let tables = Tables::new(None, PREFIX)?;
    let (accounts2, ledger2) = (tables.table("accounts2"), tables.table("ledger2"));
    let Some(chain) = summary.chain.as_mut() else { bail!("the chain did not run") };
    chain.second_total_cents = db.scalar(&format!("SELECT {} FROM {accounts2}", db.integer_sum("balance"))).await?;
    chain.second_ledger_entries = db.scalar(&format!("SELECT COUNT(*) FROM {ledger2}")).await?;
    chain.second_distinct_events = db.scalar(&format!("SELECT COUNT(DISTINCT event_id) FROM {ledger2}")).await?;
    chain.out_of_order = db.scalar(&format!("SELECT {} FROM {accounts2}", db.integer_sum("out_of_order"))).await?;
    chain.outbox_left = db.scalar(&format!("SELECT COUNT(*) FROM {}", tables.table("outbox"))).await?;
    let mut mismatches = Vec::new();
    if chain.second_total_cents != plan.expected_total {
        mismatches
            .push(format!("second ledger total {} != expected {}", chain.second_total_cents, plan.expected_total));
    }
    if chain.second_ledger_entries != plan.expected_entries {
        mismatches.push(format!(
            "{} second-ledger entries != expected {}",
            chain.second_ledger_entries, plan.expected_entries
        ));
    }
    if chain.second_distinct_events != chain.second_ledger_entries {
        mismatches.push(format!(
            "{} events applied more than once to the second ledger",
            chain.second_ledger_entries - chain.second_distinct_events
        ));
    }
    if chain.out_of_order != 0 {
        mismatches.push(format!(
            "{} credited events reached the second ledger out of their account's order",
            chain.out_of_order
        ));
    }
    if chain.outbox_left != 0 {
        mismatches.push(format!("{} messages left in the outbox", chain.outbox_left));
    }
    summary.mismatches.extend(mismatches);
    summary.ok = summary.mismatches.is_empty();
    Ok(())
}
