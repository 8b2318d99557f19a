//! Which dead letters an operator command takes: ids, or every letter the filters take (consumer group, text in
//! the reason, failure group, age). One selection for the command line and the console, so that the two never
//! disagree; a selection that takes nothing says why.

use super::groups::{FailureGroup, Grouping, MessageType, SAMPLE_IDS, fingerprint_of, strip_reason};
use crate::error::Error;
use crate::store::letter_pages::LetterQuery;
use crate::store::{Backend, DeadLetter, Tables};

/// How many letters a scan reads at a time (where the database cannot apply the filter: see [`Filter::page`]).
const SCAN_BATCH: i64 = 1_000;

/// How many failure groups [`Filter::groups`] lists at most.
pub const MAX_GROUPS: i64 = 500;

/// The filters as the operator wrote them (flags or query parameters); [`Filter::parse`] checks them.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(default)]
pub struct FilterSpec {
    /// Only this consumer group.
    pub group: Option<String>,
    /// Only those whose reason contains this text.
    pub matching: Option<String>,
    /// Only those of this failure group: 12 hex digits (see [`super::groups`]).
    pub fingerprint: Option<String>,
    /// Only those that last failed longer ago than this (`30m`, `2h`, `7d`).
    pub older_than: Option<String>,
    /// Where messages say their type, part of the fingerprint: `header:NAME` or `json:/POINTER`.
    pub message_type: Option<String>,
}

/// A filter refused: which field, and why (with the fix).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FilterError {
    /// The field, as [`FilterSpec`] names it (`older_than`).
    pub field: &'static str,
    /// Why, and what to write instead.
    pub why: String,
}

impl std::fmt::Display for FilterError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.field, self.why)
    }
}

impl std::error::Error for FilterError {}

/// A [`FilterSpec`] checked: the age turned into a time, the message type parsed, the fingerprint's form checked.
#[derive(Debug, Clone)]
pub struct Filter {
    spec: FilterSpec,
    failed_before_ms: Option<i64>,
    typing: Option<MessageType>,
    fingerprint: Option<String>,
}

impl Filter {
    /// Checks `spec`, naming the field that is wrong.
    pub fn parse(spec: FilterSpec) -> Result<Filter, FilterError> {
        let set = |value: Option<String>| value.filter(|v| !v.trim().is_empty());
        let spec = FilterSpec {
            group: set(spec.group),
            matching: spec.matching.filter(|m| !m.is_empty()),
            fingerprint: set(spec.fingerprint),
            older_than: set(spec.older_than),
            message_type: set(spec.message_type),
        };
        let failed_before_ms = match &spec.older_than {
            Some(text) => {
                let age = crate::duration::parse(text).map_err(|e| FilterError {
                    field: "older_than",
                    why: match e {
                        Error::Config(why) => why,
                        other => other.to_string(),
                    },
                })?;
                let age_ms = i64::try_from(age.as_millis()).unwrap_or(i64::MAX);
                Some(crate::engine::now_ms().saturating_sub(age_ms))
            }
            None => None,
        };
        let typing = spec
            .message_type
            .as_deref()
            .map(MessageType::parse)
            .transpose()
            .map_err(|why| FilterError { field: "message_type", why })?;
        let fingerprint = match &spec.fingerprint {
            Some(text) => {
                let fingerprint = text.trim().to_ascii_lowercase();
                if fingerprint.len() != 12 || !fingerprint.bytes().all(|b| b.is_ascii_hexdigit()) {
                    return Err(FilterError {
                        field: "fingerprint",
                        why: format!(
                            "`{text}` is not a fingerprint: it is 12 hexadecimal digits, as the failure groups show it"
                        ),
                    });
                }
                Some(fingerprint)
            }
            None => None,
        };
        Ok(Filter { spec, failed_before_ms, typing, fingerprint })
    }

    /// The filters as written.
    pub fn spec(&self) -> &FilterSpec {
        &self.spec
    }

    /// Where messages say their type, when the operator said.
    pub fn typing(&self) -> Option<&MessageType> {
        self.typing.as_ref()
    }

    /// Whether `letter` passes every filter.
    pub fn takes(&self, letter: &DeadLetter) -> bool {
        self.spec.matching.as_deref().is_none_or(|text| letter.error.contains(text))
            && self.failed_before_ms.is_none_or(|before| letter.last_failed_at_ms < before)
            && self.fingerprint.as_deref().is_none_or(|f| fingerprint_of(letter, self.typing.as_ref()) == f)
    }

    /// Whether a filter beyond the consumer group is set.
    pub fn narrows(&self) -> bool {
        self.spec.matching.is_some() || self.fingerprint.is_some() || self.spec.older_than.is_some()
    }

    /// What the database applies of the filter: all of it, but for a fingerprint taken with a message type (the
    /// stored fingerprint has none), which is checked here.
    fn query(&self) -> LetterQuery<'_> {
        LetterQuery {
            group: self.spec.group.as_deref(),
            group_prefix: None,
            id: None,
            fingerprint: self.fingerprint.as_deref().filter(|_| self.typing.is_none()),
            matching: self.spec.matching.as_deref(),
            failed_before_ms: self.failed_before_ms,
            after_id: None,
        }
    }

    /// Whether letters must be read and checked here: a fingerprint with a message type.
    fn scans(&self) -> bool {
        self.typing.is_some() && self.fingerprint.is_some()
    }

    /// Fingerprints the rows written without one, before a statement that reads them.
    async fn ready<DB: Backend>(&self, pool: &sqlx::Pool<DB>, tables: &Tables) -> Result<(), Error> {
        if self.fingerprint.is_some() {
            DB::fill_fingerprints(pool, tables).await?;
        }
        Ok(())
    }

    /// One page of the letters taken, by id: those after `after`, at most `limit`, and the id the next page
    /// starts after (none on the last page). The database applies the filters and the page (keyset pagination
    /// on the id); a fingerprint with a message type reads the other filters' letters in batches instead.
    pub async fn page<DB: Backend>(
        &self,
        pool: &sqlx::Pool<DB>,
        tables: &Tables,
        after: Option<i64>,
        limit: i64,
    ) -> Result<(Vec<DeadLetter>, Option<i64>), Error> {
        self.ready(pool, tables).await?;
        let limit = limit.max(1);
        let query = LetterQuery { after_id: after, ..self.query() };
        if !self.scans() {
            let mut letters = DB::letter_page(pool, tables, &query, limit.saturating_add(1)).await?;
            let size = usize::try_from(limit).unwrap_or(usize::MAX);
            let next = (letters.len() > size).then(|| letters[size - 1].id);
            letters.truncate(size);
            return Ok((letters, next));
        }
        let size = usize::try_from(limit).unwrap_or(usize::MAX);
        let mut found: Vec<DeadLetter> = Vec::new();
        let mut next = None;
        scan(pool, tables, query, |letter| {
            if !self.takes(&letter) {
                return true;
            }
            if found.len() == size {
                next = found.last().map(|l| l.id);
                return false;
            }
            found.push(letter);
            true
        })
        .await?;
        Ok((found, next))
    }

    /// The dead letters taken, oldest first, at most `limit`.
    pub async fn letters<DB: Backend>(
        &self,
        pool: &sqlx::Pool<DB>,
        tables: &Tables,
        limit: i64,
    ) -> Result<Vec<DeadLetter>, Error> {
        Ok(self.page(pool, tables, None, limit).await?.0)
    }

    /// How many dead letters the filters take.
    pub async fn count<DB: Backend>(&self, pool: &sqlx::Pool<DB>, tables: &Tables) -> Result<i64, Error> {
        self.count_at_most(pool, tables, i64::MAX).await
    }

    /// How many dead letters the filters take, counting no further than `at_most` (a text searched for is
    /// checked row by row: a list page counts its matches only so far).
    pub async fn count_at_most<DB: Backend>(
        &self,
        pool: &sqlx::Pool<DB>,
        tables: &Tables,
        at_most: i64,
    ) -> Result<i64, Error> {
        self.ready(pool, tables).await?;
        if !self.scans() {
            let cap = (at_most < i64::MAX).then_some(at_most);
            return DB::count_letters(pool, tables, &self.query(), cap).await;
        }
        let mut count = 0;
        scan(pool, tables, self.query(), |letter| {
            count += i64::from(self.takes(&letter));
            count < at_most
        })
        .await?;
        Ok(count)
    }

    /// The failure groups of the letters taken, the largest first, at most [`MAX_GROUPS`]. The database counts
    /// them by their stored fingerprint; with a message type, each letter's type is read from its message, so the
    /// letters are read in batches and counted here.
    pub async fn groups<DB: Backend>(
        &self,
        pool: &sqlx::Pool<DB>,
        tables: &Tables,
    ) -> Result<Vec<FailureGroup>, Error> {
        DB::fill_fingerprints(pool, tables).await?;
        if let Some(typing) = self.typing.as_ref() {
            let mut grouping = Grouping::new(Some(typing));
            scan(pool, tables, self.query(), |letter| {
                if self.takes(&letter) {
                    grouping.add(&letter);
                }
                true
            })
            .await?;
            let mut groups = grouping.finish();
            groups.truncate(usize::try_from(MAX_GROUPS).unwrap_or(usize::MAX));
            return Ok(groups);
        }
        let query = self.query();
        let figures = DB::group_figures(pool, tables, &query, MAX_GROUPS).await?;
        let newest: Vec<i64> = figures.iter().map(|f| f.newest_id).collect();
        let reasons: std::collections::HashMap<i64, String> =
            DB::reasons(pool, tables, &newest).await?.into_iter().collect();
        // A group's oldest ids: one indexed read per group, several at once.
        let ids = futures_util::future::try_join_all(figures.iter().map(|f| {
            let of_group = LetterQuery { fingerprint: Some(&f.fingerprint), ..query };
            async move { DB::letter_ids(pool, tables, &of_group, SAMPLE_IDS as i64).await }
        }))
        .await?;
        let mut groups: Vec<FailureGroup> = figures
            .into_iter()
            .zip(ids)
            .map(|(figures, ids)| {
                let sample = reasons.get(&figures.newest_id).cloned().unwrap_or_default();
                FailureGroup {
                    fingerprint: figures.fingerprint,
                    consumer_group: figures.consumer_group,
                    message_type: None,
                    pattern: strip_reason(&sample),
                    count: usize::try_from(figures.count).unwrap_or(0),
                    first_failed_at_ms: figures.first_failed_at_ms,
                    last_failed_at_ms: figures.last_failed_at_ms,
                    sample,
                    ids,
                }
            })
            .collect();
        super::groups::sort(&mut groups);
        Ok(groups)
    }

    /// This filter with only some of its fields (`keep` says which): to tell why a selection took nothing.
    fn only(&self, keep: impl Fn(&FilterSpec) -> FilterSpec) -> Filter {
        let mut narrower = self.clone();
        narrower.spec = keep(&self.spec);
        if narrower.spec.older_than.is_none() {
            narrower.failed_before_ms = None;
        }
        if narrower.spec.fingerprint.is_none() {
            narrower.fingerprint = None;
        }
        if narrower.spec.message_type.is_none() {
            narrower.typing = None;
        }
        narrower
    }

    /// The filters in words, as the audit trail records them (`all` without any).
    pub fn describe(&self) -> String {
        self.words(true)
    }

    fn words(&self, with_fingerprint: bool) -> String {
        let s = &self.spec;
        let parts: Vec<String> = [
            s.group.as_ref().map(|g| format!("group {g}")),
            s.matching.as_ref().map(|m| format!("matching {m:?}")),
            self.fingerprint.as_ref().filter(|_| with_fingerprint).map(|f| format!("fingerprint {f}")),
            s.older_than.as_ref().map(|o| format!("older than {o}")),
            s.message_type.as_ref().map(|t| format!("message type from {t}")),
        ]
        .into_iter()
        .flatten()
        .collect();
        if parts.is_empty() { "all".to_owned() } else { parts.join(", ") }
    }
}

/// The dead letters an acting command names: ids, or `all` of what the filter takes.
#[derive(Debug, Clone, Copy)]
pub struct Chosen<'a> {
    /// Dead-letter ids; empty: every letter the filter takes (then `all` or a narrowing filter is needed).
    pub ids: &'a [i64],
    /// Every letter the filter takes, all of them without filters.
    pub all: bool,
    /// The filter.
    pub filter: &'a Filter,
}

/// What a selection took: letters, or nothing, with why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Taken {
    /// The letters, oldest first, and the ids named that are gone (replayed meanwhile, or never there) while
    /// others were taken.
    Letters(Vec<DeadLetter>, Vec<i64>),
    /// Nothing: why, and what to do.
    Refused(String),
}

/// Why a named letter was not taken.
enum NotTaken {
    /// It is there, but the action must not take it: nothing is done.
    Refused(String),
    /// It is not there (replayed meanwhile): the others named go ahead.
    Gone(String),
}

impl Chosen<'_> {
    /// The letters, every id checked; [`Taken::Refused`], naming why, when nothing names them, an id is not there,
    /// or the selection takes nothing. `verb` names the action in the refusal (`replay`).
    pub async fn letters<DB: Backend>(
        &self,
        pool: &sqlx::Pool<DB>,
        tables: &Tables,
        verb: &str,
    ) -> Result<Taken, Error> {
        if self.ids.is_empty() && !self.all && !self.filter.narrows() {
            return Ok(Taken::Refused(format!(
                "name the dead letters to {verb} (ids from `idem dead-letters list`), or pass --all, --matching TEXT, \
                 --fingerprint F (from `idem dead-letters groups`) or --older-than DURATION"
            )));
        }
        let group = self.filter.spec.group.as_deref();
        let mut letters = Vec::new();
        let mut gone = Vec::new();
        let mut why_gone = None;
        for &id in self.ids {
            let query = LetterQuery { id: Some(id), ..self.filter.query() };
            match DB::letter_page(pool, tables, &query, 1).await?.pop().filter(|l| self.filter.takes(l)) {
                Some(letter) => letters.push(letter),
                None => match self.why_not_taken(pool, tables, id).await {
                    NotTaken::Gone(why) => {
                        gone.push(id);
                        why_gone.get_or_insert(why);
                    }
                    NotTaken::Refused(why) => return Ok(Taken::Refused(why)),
                },
            }
        }
        if let (true, Some(why)) = (letters.is_empty(), why_gone) {
            return Ok(Taken::Refused(why));
        }
        if self.ids.is_empty() {
            letters = self.filter.letters(pool, tables, i64::MAX).await?;
        }
        if letters.is_empty() {
            let of_group = self.filter.only(|s| FilterSpec { group: s.group.clone(), ..FilterSpec::default() });
            let among = of_group.count(pool, tables).await?;
            let why = match &self.filter.fingerprint {
                Some(fingerprint) => self.why_no_group(pool, tables, among, fingerprint).await?,
                None if among == 0 => format!(
                    "there is no dead letter{}: nothing to {verb}",
                    group.map(|g| format!(" of group {g}")).unwrap_or_default()
                ),
                None => format!(
                    "no dead letter passes the filters ({}), among {among} of {}: nothing to {verb}",
                    self.filter.describe(),
                    group.map(|g| format!("group {g}")).unwrap_or_else(|| "every group".to_owned())
                ),
            };
            return Ok(Taken::Refused(why));
        }
        Ok(Taken::Letters(letters, gone))
    }

    /// Why dead letter `id` is not among those taken: the filters leave it out or it was discarded (by whom,
    /// when, why), which refuses the action; or there is no such letter (replayed meanwhile), which another
    /// letter named with it does not refuse.
    async fn why_not_taken<DB: Backend>(&self, pool: &sqlx::Pool<DB>, tables: &Tables, id: i64) -> NotTaken {
        let group = self.filter.spec.group.as_deref();
        let in_group = LetterQuery { group, id: Some(id), ..LetterQuery::ALL };
        if DB::count_letters(pool, tables, &in_group, None).await.is_ok_and(|n| n > 0) {
            return NotTaken::Refused(format!(
                "dead letter {id} is not among those the filters take ({}); drop the filters to name it by id",
                self.filter.describe()
            ));
        }
        if let Ok(Some(a)) = super::archived_letter(pool, tables, id).await {
            return NotTaken::Refused(format!(
                "dead letter {id} was discarded by {} at {} ({}); see `idem dead-letters archived`",
                a.discarded_by,
                crate::store::rfc3339_from_ms(a.discarded_at_ms),
                a.reason
            ));
        }
        NotTaken::Gone(match group {
            Some(group) => format!("no dead letter of group {group} has id {id}; see `idem dead-letters list`"),
            None => format!("no dead letter has id {id} (replayed since?); see `idem dead-letters list`"),
        })
    }

    /// Why failure group `fingerprint` selects nothing: the other filters leave its letters out, it belongs to
    /// another consumer group than `--group`, its letters were all discarded, or the fingerprint was taken with
    /// another message-type setting (or is gone).
    async fn why_no_group<DB: Backend>(
        &self,
        pool: &sqlx::Pool<DB>,
        tables: &Tables,
        among: i64,
        fingerprint: &str,
    ) -> Result<String, Error> {
        let typing = self.filter.typing.as_ref();
        let group = self.filter.spec.group.as_deref();
        let ours = self
            .filter
            .only(|s| FilterSpec {
                group: s.group.clone(),
                fingerprint: s.fingerprint.clone(),
                message_type: s.message_type.clone(),
                ..FilterSpec::default()
            })
            .count(pool, tables)
            .await?;
        if ours > 0 {
            return Ok(format!(
                "failure group {fingerprint} has {ours} dead letter(s), but the other filters ({}) take none of them",
                self.filter.words(false)
            ));
        }
        if let Some(group) = group {
            let anywhere = self.filter.only(|s| FilterSpec {
                fingerprint: s.fingerprint.clone(),
                message_type: s.message_type.clone(),
                ..FilterSpec::default()
            });
            if let Some(other) = anywhere.letters(pool, tables, 1).await?.first() {
                return Ok(format!(
                    "failure group {fingerprint} is consumer group {}'s, not {group}'s: drop --group or name {}",
                    other.consumer_group, other.consumer_group
                ));
            }
            if among == 0 {
                return Ok(format!("consumer group {group} has no dead letter: check --group"));
            }
        }
        let discarded: Vec<_> = super::archived(pool, tables, group, 10_000)
            .await
            .unwrap_or_default()
            .into_iter()
            .filter(|a| fingerprint_of(&a.letter, typing) == fingerprint)
            .collect();
        if let Some(last) = discarded.first() {
            return Ok(format!(
                "failure group {fingerprint} has no dead letter left: {} of its letters were discarded, the last by \
                 {} at {}; see `idem dead-letters archived`",
                discarded.len(),
                last.discarded_by,
                crate::store::rfc3339_from_ms(last.discarded_at_ms)
            ));
        }
        let setting = match &self.filter.spec.message_type {
            Some(t) => format!("with --message-type {t}"),
            None => "without --message-type".to_owned(),
        };
        Ok(format!(
            "no dead letter has fingerprint {fingerprint} {setting}: a fingerprint depends on the message-type \
             setting, so take it from `idem dead-letters groups` run with the same --message-type; or its letters \
             were replayed since"
        ))
    }

    /// What the audit trail records as the subjects: the ids named, or the filters and the ids they took.
    pub fn subjects(&self, taken: &[i64]) -> String {
        if !self.ids.is_empty() {
            return format!("ids {}", join(self.ids));
        }
        if !self.all && !self.filter.narrows() {
            return "nothing named".to_owned();
        }
        let filters = self.filter.describe();
        if taken.is_empty() { filters } else { format!("{filters}: ids {}", join(taken)) }
    }
}

/// Reads the letters `query` takes in batches, by id, handing each to `each` until it returns false.
async fn scan<DB: Backend>(
    pool: &sqlx::Pool<DB>,
    tables: &Tables,
    query: LetterQuery<'_>,
    mut each: impl FnMut(DeadLetter) -> bool,
) -> Result<(), Error> {
    let mut after = query.after_id;
    loop {
        let batch = DB::letter_page(pool, tables, &LetterQuery { after_id: after, ..query }, SCAN_BATCH).await?;
        let last_batch = (batch.len() as i64) < SCAN_BATCH;
        after = batch.last().map(|l| l.id);
        for letter in batch {
            if !each(letter) {
                return Ok(());
            }
        }
        if last_batch {
            return Ok(());
        }
    }
}

/// Ids as `1, 2, 3`.
pub fn join(ids: &[i64]) -> String {
    ids.iter().map(i64::to_string).collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spec_is_checked_field_by_field() {
        let parse = |spec: FilterSpec| Filter::parse(spec).map(|_| ()).map_err(|e| e.field);
        assert_eq!(parse(FilterSpec { older_than: Some("10".into()), ..FilterSpec::default() }), Err("older_than"));
        assert_eq!(
            parse(FilterSpec { message_type: Some("type".into()), ..FilterSpec::default() }),
            Err("message_type")
        );
        assert_eq!(
            parse(FilterSpec { fingerprint: Some("refunds".into()), ..FilterSpec::default() }),
            Err("fingerprint")
        );
        let upper = Filter::parse(FilterSpec { fingerprint: Some(" A1B2C3D4E5F6 ".into()), ..FilterSpec::default() });
        assert_eq!(upper.map(|f| f.fingerprint), Ok(Some("a1b2c3d4e5f6".to_owned())));
        let blank = Filter::parse(FilterSpec {
            group: Some(" ".into()),
            older_than: Some(String::new()),
            ..FilterSpec::default()
        });
        assert!(blank.is_ok_and(|f| !f.narrows() && f.describe() == "all"), "blank fields are no filter");
    }
}
