//! What `idem demo` reports, as a table or one JSON object.

use serde::Serialize;

use super::chain::ChainSummary;
use super::events::Plan;
use super::held::HeldBack;
use super::http::HttpFigures;

/// What the demo reports.
#[derive(Debug, Default, Serialize)]
pub(super) struct Summary {
    pub(super) ok: bool,
    pub(super) database: &'static str,
    /// What consumed: the demo's Rust handler or `idem run --config`.
    pub(super) consumer: &'static str,
    pub(super) events_produced: u64,
    pub(super) producer_duplicates: u64,
    pub(super) log_records: u64,
    pub(super) deliveries: u64,
    pub(super) processed: u64,
    pub(super) duplicates_absorbed: u64,
    pub(super) dead_lettered: u64,
    pub(super) crashes_survived: u32,
    pub(super) crashes_after_commit: u32,
    pub(super) crashes_before_commit: u32,
    pub(super) consumer_runs: u32,
    pub(super) expected_total_cents: i64,
    pub(super) actual_total_cents: i64,
    pub(super) expected_ledger_entries: i64,
    pub(super) ledger_entries: i64,
    pub(super) distinct_ledger_events: i64,
    pub(super) markers: i64,
    pub(super) dead_letter_rows: i64,
    pub(super) consume_seconds: f64,
    pub(super) throughput_per_second: f64,
    pub(super) mismatches: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) chain: Option<ChainSummary>,
    /// On Pub/Sub's emulator: what it held back after the crashes (the expected figures are then those of the
    /// events it delivered).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) held_back: Option<HeldBack>,
    /// With `--http`: what the clients and the server went through.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) http: Option<HttpFigures>,
}

impl Summary {
    /// The summary of a run of `plan`'s events on `database`, consumed by `consumer`, before it starts.
    pub(super) fn planned(database: &'static str, consumer: &'static str, plan: &Plan) -> Summary {
        Summary {
            database,
            consumer,
            events_produced: plan.events,
            producer_duplicates: plan.producer_duplicates,
            log_records: plan.records,
            expected_total_cents: plan.expected_total,
            expected_ledger_entries: plan.expected_entries,
            ..Summary::default()
        }
    }
}

/// Prints the summary as a table, or as one JSON object with `json`.
pub(super) fn print_summary(s: &Summary, json: bool) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string(s)?);
        return Ok(());
    }
    println!("idem demo: payments ledger on {}, consumed by the {}", s.database, s.consumer);
    println!(
        "  events produced        {:>12}  ({} sent twice by the producer)",
        s.events_produced, s.producer_duplicates
    );
    println!("  deliveries             {:>12}  (log records: {})", s.deliveries, s.log_records);
    println!("  processed              {:>12}", s.processed);
    println!("  duplicates absorbed    {:>12}", s.duplicates_absorbed);
    println!("  dead-lettered          {:>12}  (poison messages)", s.dead_lettered);
    println!(
        "  crashes survived       {:>12}  ({} between commit and ack, {} before commit; {} consumer runs)",
        s.crashes_survived, s.crashes_after_commit, s.crashes_before_commit, s.consumer_runs
    );
    println!("  expected ledger total  {:>12}  cents in {} entries", s.expected_total_cents, s.expected_ledger_entries);
    println!("  actual ledger total    {:>12}  cents in {} entries", s.actual_total_cents, s.ledger_entries);
    println!("  throughput             {:>12.0}  deliveries/s ({:.1} s)", s.throughput_per_second, s.consume_seconds);
    if let Some(held) = &s.held_back {
        println!("{}", held.line());
    }
    for line in s.http.iter().flat_map(HttpFigures::lines) {
        println!("{line}");
    }
    for line in s.chain.iter().flat_map(ChainSummary::lines) {
        println!("{line}");
    }
    if s.ok && s.held_back.is_some() {
        println!("OK: every event delivered applied exactly once, none after a gap in its key's order");
    } else if s.ok {
        println!("OK: every event applied exactly once");
    } else {
        for m in &s.mismatches {
            println!("MISMATCH: {m}");
        }
    }
    Ok(())
}
