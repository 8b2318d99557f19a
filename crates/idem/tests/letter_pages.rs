//! Dead letters read a page at a time on every store: the filters applied by the database agree with the
//! operator's selection, pages follow one another without a gap or a repeat, the failure groups are counted by
//! their stored fingerprint, and rows written without one get it at the next migration.

mod common;

use common::{TestPool, payment};
use idem::dead_letter::selection::{Filter, FilterSpec};
use idem::store::NewDeadLetter;
use idem::{Backend, Tables};
use sqlx::Pool;

async fn write<DB: Backend>(pool: &Pool<DB>, group: &str, n: i64, reason: &str) {
    let mut conn = pool.acquire().await.unwrap();
    for i in 0..n {
        let id = format!("{group}-{}-{i}", reason.len());
        let message = payment(0, i, &id, i, "");
        let error = reason.replace('N', &(i * 7 + 3).to_string());
        let letter = NewDeadLetter { event_id: Some(&id), message: &message, error: &error, attempts: 1 };
        DB::dead_letter(&mut conn, &Tables::default(), group, &letter).await.unwrap();
    }
}

fn filter(spec: FilterSpec) -> Filter {
    Filter::parse(spec).unwrap()
}

async fn pages_filtered_by_the_database<DB: Backend>(pool: Pool<DB>)
where
    Pool<DB>: TestPool,
{
    idem::migrate(&pool, &Tables::default()).await.unwrap();
    let tables = Tables::default();
    write(&pool, "ledger", 10, "account N does not exist").await;
    write(&pool, "ledger", 7, "relation \"accounts_N\" is missing").await;
    write(&pool, "billing", 5, "account N does not exist").await;

    // Pages of three follow one another by id, the last one says there is none after it.
    let ledger = filter(FilterSpec { group: Some("ledger".into()), ..FilterSpec::default() });
    let (mut seen, mut after) = (Vec::new(), None);
    loop {
        let (page, next) = ledger.page(&pool, &tables, after, 3).await.unwrap();
        assert!(page.len() <= 3);
        seen.extend(page.iter().map(|l| l.id));
        match next {
            Some(id) => after = Some(id),
            None => break,
        }
    }
    let mut sorted = seen.clone();
    sorted.sort_unstable();
    sorted.dedup();
    assert_eq!((seen.len(), sorted), (17, seen.clone()), "every ledger letter once, in id order");
    assert_eq!(ledger.count(&pool, &tables).await.unwrap(), 17);

    // The reason filter is case-sensitive on every store, and combines with the group.
    let matching = |text: &str, group: Option<&str>| {
        filter(FilterSpec { matching: Some(text.into()), group: group.map(str::to_owned), ..FilterSpec::default() })
    };
    assert_eq!(matching("does not exist", None).count(&pool, &tables).await.unwrap(), 15);
    assert_eq!(matching("does not exist", Some("ledger")).count(&pool, &tables).await.unwrap(), 10);
    assert_eq!(matching("ACCOUNT", None).count(&pool, &tables).await.unwrap(), 0, "case matters");
    assert_eq!(matching("\"accounts_", None).count(&pool, &tables).await.unwrap(), 7);

    // The age filter: everything failed less than an hour ago.
    let older = filter(FilterSpec { older_than: Some("1h".into()), ..FilterSpec::default() });
    assert_eq!(older.count(&pool, &tables).await.unwrap(), 0);

    // Failure groups by the stored fingerprint: the same reason in two consumer groups is two failure groups.
    let groups = filter(FilterSpec::default()).groups(&pool, &tables).await.unwrap();
    let figures: Vec<(&str, usize, &str)> =
        groups.iter().map(|g| (g.consumer_group.as_str(), g.count, g.pattern.as_str())).collect();
    assert_eq!(
        figures,
        [
            ("ledger", 10, "account # does not exist"),
            ("ledger", 7, "relation '…' is missing"),
            ("billing", 5, "account # does not exist")
        ]
    );
    let frozen = &groups[0];
    assert_eq!(frozen.sample, "account 66 does not exist", "the newest letter's reason");
    assert_eq!(frozen.ids.len(), 10);
    let by_fingerprint = filter(FilterSpec { fingerprint: Some(frozen.fingerprint.clone()), ..FilterSpec::default() });
    let (letters, next) = by_fingerprint.page(&pool, &tables, None, 100).await.unwrap();
    assert_eq!((letters.iter().map(|l| l.id).collect::<Vec<_>>(), next), (frozen.ids.clone(), None));

    // Rows written by an idem older than the stored fingerprint get theirs at the next migration.
    pool.exec("UPDATE dead_letters SET fingerprint = NULL").await;
    assert_eq!(pool.scalar("SELECT COUNT(*) FROM dead_letters WHERE fingerprint IS NULL").await, 22);
    idem::migrate(&pool, &tables).await.unwrap();
    assert_eq!(pool.scalar("SELECT COUNT(*) FROM dead_letters WHERE fingerprint IS NULL").await, 0);
    assert_eq!(by_fingerprint.count(&pool, &tables).await.unwrap(), 10);
    // And a filter by failure group fingerprints them before it reads, without a migration.
    pool.exec("UPDATE dead_letters SET fingerprint = NULL").await;
    assert_eq!(by_fingerprint.count(&pool, &tables).await.unwrap(), 10);

    // A failure group taken with a message type reads the letters and checks each one.
    let typed = FilterSpec { message_type: Some("json:/id".into()), ..FilterSpec::default() };
    let typed_groups = filter(typed.clone()).groups(&pool, &tables).await.unwrap();
    assert_eq!(typed_groups.len(), 22, "every letter has its own id, so its own type here");
    let one = filter(FilterSpec { fingerprint: Some(typed_groups[0].fingerprint.clone()), ..typed });
    assert_eq!(one.count(&pool, &tables).await.unwrap(), 1);
    assert_eq!(one.letters(&pool, &tables, 10).await.unwrap().len(), 1);
}
on_every_store!(pages_filtered_by_the_database);

/// A broker that refuses every publish.
struct Refusing;

impl idem::source::Publisher for Refusing {
    async fn publish(&self, _: &idem::Message) -> Result<(), idem::source::SourceError> {
        Err(idem::source::SourceError::transient("publish", "the broker is down"))
    }
}

/// A replay whose publish fails leaves its letter dead at once, for the next replay to take without waiting for
/// the first one's lease.
async fn a_failed_publish_leaves_the_letter_dead<DB: Backend>(pool: Pool<DB>)
where
    Pool<DB>: TestPool,
{
    idem::migrate(&pool, &Tables::default()).await.unwrap();
    write(&pool, "ledger", 1, "account N does not exist").await;
    let letter = idem::dead_letter::list(&pool, &Tables::default(), None, 1).await.unwrap().remove(0);
    let forced = idem::dead_letter::Safety::Forced;
    let failed = idem::dead_letter::replay(&pool, &Tables::default(), &Refusing, &letter, forced).await;
    assert!(failed.is_err(), "the publish error is the replay's");
    assert_eq!(
        pool.scalar("SELECT COUNT(*) FROM dead_letters WHERE status = 'dead' AND replay_started_at_ms IS NULL").await,
        1
    );
    let again = idem::dead_letter::check_replay(&pool, &Tables::default(), &letter, forced).await.unwrap();
    assert_eq!(again, idem::dead_letter::Replayed::Published, "not busy: a second replay goes ahead");
}
on_every_store!(a_failed_publish_leaves_the_letter_dead);
