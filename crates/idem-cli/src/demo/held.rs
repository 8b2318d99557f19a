//! The demo's checks on a broker that holds messages back for good: Google's Pub/Sub emulator does not deliver
//! again what a killed streaming pull held on an ordered subscription, so each ordering key it held stalls at that
//! message (and the emulator does not apply a stream's flow control: one killed consumer with
//! `max_outstanding_messages` 10 had about 1,200 messages of 490 keys in hand). What must still hold, per key:
//! every event before its stall applied exactly once, nothing after it that was not also before it, nothing twice
//! anywhere; and no key stalled without a crash.

use std::collections::{HashMap, HashSet};

use idem::Tables;
use serde::Serialize;

use super::summary::Summary;
use crate::db::Db;

/// What the broker held back, counted over the ordering keys (the accounts).
#[derive(Debug, Default, Serialize)]
pub(super) struct HeldBack {
    /// Ordering keys whose messages stop at one that was not delivered again.
    pub(super) stalled_keys: u64,
    /// Records of those keys from their stall on: never delivered.
    pub(super) records: u64,
    /// Events none of whose records was delivered.
    pub(super) events: u64,
}

impl HeldBack {
    /// The summary's line.
    pub(super) fn line(&self) -> String {
        format!(
            "  held by the emulator   {:>12}  events ({} records) on {} ordering keys: what a killed streaming pull \
             held, the emulator does not deliver again (the service does, after the ack deadline)",
            self.events, self.records, self.stalled_keys
        )
    }
}

/// One record's event: a payment, or a poison message (dead-lettered under its key, or by position when keyless).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Event {
    Payment(String),
    Poison(Option<String>),
}

/// Checks the database against the records produced, allowing each key to stall at one record and everything
/// after it, when a consumer was killed (`summary.crashes_survived`). Records what fails in `summary.mismatches`
/// and the figures in `summary`.
pub(super) async fn verify(
    db: &Db,
    tables: &Tables,
    records: &[(i64, String)],
    summary: &mut Summary,
) -> anyhow::Result<HeldBack> {
    let ledger_sql = format!("SELECT event_id, account, amount FROM {}", tables.table("ledger"));
    let ledger: Vec<(String, i64, i64)> = crate::db::reconnecting(|| async {
        crate::with_pool!(db, pool => sqlx::query_as(&ledger_sql).fetch_all(pool).await)
    })
    .await?;
    let dead_sql = format!("SELECT event_id FROM {}", tables.table("dead_letters"));
    let dead: Vec<(Option<String>,)> = crate::db::reconnecting(|| async {
        crate::with_pool!(db, pool => sqlx::query_as(&dead_sql).fetch_all(pool).await)
    })
    .await?;
    Ok(compare(records, &ledger, &dead, summary))
}

/// [`verify`] on the rows read: the ledger's (event id, account, amount) and the dead letters' event ids.
fn compare(
    records: &[(i64, String)],
    ledger: &[(String, i64, i64)],
    dead: &[(Option<String>,)],
    summary: &mut Summary,
) -> HeldBack {
    // What was produced: each payment's account and amount, each key's records in order.
    let mut planned: HashMap<String, (i64, i64)> = HashMap::new();
    let mut keys: HashMap<i64, Vec<Event>> = HashMap::new();
    for (account, payload) in records {
        let value: serde_json::Value = serde_json::from_str(payload).unwrap_or_default();
        let id = value.get("idempotencyKey").and_then(serde_json::Value::as_str);
        let event = match id {
            Some(id) if id.starts_with("pay-") => {
                let amount = value.get("amount").and_then(serde_json::Value::as_i64).unwrap_or_default();
                planned.insert(id.to_owned(), (*account, amount));
                Event::Payment(id.to_owned())
            }
            other => Event::Poison(other.map(str::to_owned)),
        };
        keys.entry(*account).or_default().push(event);
    }

    let mut mismatches = Vec::new();
    let mut expected_total = 0;
    let mut applied_payments = HashSet::new();
    for (id, account, amount) in ledger {
        match planned.get(id) {
            Some(&(a, m)) if a == *account && m == *amount => {
                if applied_payments.insert(id.as_str()) {
                    expected_total += amount;
                }
            }
            _ => mismatches.push(format!("ledger entry {id} (account {account}, {amount} cents) was not produced")),
        }
    }
    let dead_keyed: HashSet<&str> = dead.iter().filter_map(|(id,)| id.as_deref()).collect();
    let dead_keyless = dead.iter().filter(|(id,)| id.is_none()).count();
    let applied = |event: &Event| match event {
        Event::Payment(id) => applied_payments.contains(id.as_str()),
        Event::Poison(Some(id)) => dead_keyed.contains(id.as_str()),
        Event::Poison(None) => dead_keyless > 0,
    };

    let mut held = HeldBack::default();
    let mut not_applied = HashSet::new();
    let mut after_gap = Vec::new();
    for (account, events) in &keys {
        let mut before_stall = HashSet::new();
        let mut stalled = false;
        for (n, event) in events.iter().enumerate() {
            if !applied(event) {
                not_applied.insert(event);
                if !stalled {
                    stalled = true;
                    held.stalled_keys += 1;
                    held.records += (events.len() - n) as u64;
                }
            } else if !stalled {
                before_stall.insert(event);
            } else if !before_stall.contains(event) {
                after_gap.push(format!("{event:?} of account {account}"));
            }
        }
    }
    held.events = not_applied.len() as u64;

    if let Some(first) = after_gap.first() {
        mismatches.push(format!(
            "{} event(s) applied although an earlier record of their ordering key never was (first: {first}): a \
             message lost",
            after_gap.len()
        ));
    }
    if summary.distinct_ledger_events != summary.ledger_entries {
        mismatches
            .push(format!("{} events applied more than once", summary.ledger_entries - summary.distinct_ledger_events));
    }
    if summary.actual_total_cents != expected_total {
        mismatches.push(format!(
            "ledger total {} != {expected_total}, the sum of the payments applied",
            summary.actual_total_cents
        ));
    }
    let keyed_poison = dead_keyed.len() as i64;
    let expected_markers = applied_payments.len() as i64 + keyed_poison;
    if summary.markers != expected_markers {
        mismatches.push(format!("{} markers != expected {expected_markers}", summary.markers));
    }
    if held.stalled_keys > 0 && summary.crashes_survived == 0 {
        mismatches.push(format!(
            "{} ordering keys stalled although no consumer was killed: messages lost",
            held.stalled_keys
        ));
    }
    summary.expected_total_cents = expected_total;
    summary.expected_ledger_entries = applied_payments.len() as i64;
    summary.mismatches.extend(mismatches);
    held
}

#[cfg(test)]
mod tests {
    use super::*;

    fn payment(n: u32, account: i64, amount: i64) -> (i64, String) {
        (account, format!(r#"{{"idempotencyKey":"pay-{n}","account":{account},"amount":{amount}}}"#))
    }

    /// The summary as `super::read_outcome` fills it from `ledger`, after one crash.
    fn summary_of(ledger: &[(String, i64, i64)]) -> Summary {
        let distinct: HashSet<&String> = ledger.iter().map(|(id, _, _)| id).collect();
        Summary {
            crashes_survived: 1,
            actual_total_cents: ledger.iter().map(|(_, _, amount)| amount).sum(),
            ledger_entries: ledger.len() as i64,
            distinct_ledger_events: distinct.len() as i64,
            markers: distinct.len() as i64,
            ..Summary::default()
        }
    }

    fn row(n: u32, account: i64, amount: i64) -> (String, i64, i64) {
        (format!("pay-{n}"), account, amount)
    }

    #[test]
    fn a_key_stalled_after_its_applied_prefix_is_held_back_not_lost() {
        let records = [payment(1, 7, 10), payment(2, 8, 20), payment(3, 7, 30), payment(1, 7, 10), payment(4, 7, 40)];
        let ledger = [row(1, 7, 10), row(2, 8, 20)];
        let mut summary = summary_of(&ledger);
        let held = compare(&records, &ledger, &[], &mut summary);
        assert!(summary.mismatches.is_empty(), "{:?}", summary.mismatches);
        assert_eq!((held.stalled_keys, held.records, held.events), (1, 3, 2));
        assert_eq!(summary.expected_total_cents, 30);
    }

    #[test]
    fn an_event_applied_after_a_gap_in_its_key_is_a_loss() {
        let records = [payment(1, 7, 10), payment(2, 7, 20), payment(3, 7, 30)];
        let ledger = [row(1, 7, 10), row(3, 7, 30)];
        let mut summary = summary_of(&ledger);
        compare(&records, &ledger, &[], &mut summary);
        assert!(summary.mismatches.iter().any(|m| m.contains("message lost")), "{:?}", summary.mismatches);
    }

    #[test]
    fn a_double_application_a_wrong_amount_and_a_stall_without_a_crash_are_mismatches() {
        let records = [payment(1, 7, 10), payment(2, 8, 20)];
        let ledger = [row(1, 7, 10), row(1, 7, 10), row(2, 8, 21)];
        let mut summary = summary_of(&ledger);
        compare(&records, &ledger, &[], &mut summary);
        let found = summary.mismatches.join("; ");
        assert!(found.contains("more than once") && found.contains("was not produced"), "{found}");

        let ledger = [row(1, 7, 10)];
        let mut summary = Summary { crashes_survived: 0, ..summary_of(&ledger) };
        compare(&records, &ledger, &[], &mut summary);
        assert!(summary.mismatches.iter().any(|m| m.contains("no consumer was killed")), "{:?}", summary.mismatches);
    }

    #[test]
    fn poison_messages_count_as_applied_through_their_dead_letters() {
        let keyed = (1, r#"{"idempotencyKey":"poison-5","account":1,"amount":"x"}"#.to_owned());
        let keyless = (1, r#"{"account":1,"amount":100}"#.to_owned());
        let records = [payment(1, 1, 10), keyed, keyless, payment(2, 1, 20)];
        let ledger = [row(1, 1, 10), row(2, 1, 20)];
        let mut summary = Summary { markers: 3, ..summary_of(&ledger) };
        let held = compare(&records, &ledger, &[(Some("poison-5".into()),), (None,)], &mut summary);
        assert!(summary.mismatches.is_empty(), "{:?}", summary.mismatches);
        assert_eq!(held.stalled_keys, 0);
        // Without the keyless one's dead letter, the payment after it is applied after a gap.
        let mut summary = Summary { markers: 3, ..summary_of(&ledger) };
        compare(&records, &ledger, &[(Some("poison-5".into()),)], &mut summary);
        assert!(summary.mismatches.iter().any(|m| m.contains("message lost")), "{:?}", summary.mismatches);
    }
}
