//! The state-machine guard: declared transitions, checked under a lock on the entity's row.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::marker::PhantomData;

use super::schema::{Bind, GuardStore, Table};
use super::{Decision, Field};
use crate::error::{Error, HandlerError};
use crate::message::{Event, Handled};

/// What to do with an event its entity's state does not allow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Disallowed {
    /// Commit it with its marker and apply nothing: counted `rejected`, logged at INFO with the state. (An event of
    /// a type the declaration does not name is dead-lettered under either policy.)
    #[default]
    Reject,
    /// Dead-letter it, with the state and the allowed types in the reason, for an operator to look at.
    DeadLetter,
}

/// One declared transition: in state `from`, an event of type `on` moves the entity to `to`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Transition {
    /// The state the entity is in (or the spec's `initial`, for an entity without a row).
    pub from: String,
    /// The event type.
    pub on: String,
    /// The state it moves to.
    pub to: String,
}

impl Transition {
    /// `from` --`on`--> `to`.
    pub fn new(from: &str, on: &str, to: &str) -> Self {
        Transition { from: from.to_owned(), on: on.to_owned(), to: to.to_owned() }
    }
}

fn default_id() -> String {
    "id".into()
}

fn default_initial() -> String {
    "none".into()
}

/// The declaration of a [`StateMachine`], in code or TOML:
///
/// ```toml
/// table = "orders"
/// id_column = "id"                 # default "id"
/// state_column = "status"
/// entity = "json:/orderId"
/// event_type = "header:type"
/// initial = "none"                 # the state of an entity without a row (default "none")
/// states = ["created", "paid", "cancelled"]
/// types = ["OrderCreated", "OrderPaid", "OrderCancelled"]
/// on_disallowed = "reject"         # or "dead-letter"
/// version_column = "version"       # optional: also skip stale events
/// version = "json:/version"
///
/// [[transition]]
/// from = "none"
/// on = "OrderCreated"
/// to = "created"
/// ```
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StateMachineSpec {
    /// The entities' table.
    pub table: String,
    /// Its unique id column.
    #[serde(default = "default_id")]
    pub id_column: String,
    /// The column holding each entity's state.
    pub state_column: String,
    /// Where the event says which entity it is about.
    pub entity: Field,
    /// Where the event says its type.
    pub event_type: Field,
    /// The state of an entity that has no row yet; never stored.
    #[serde(default = "default_initial")]
    pub initial: String,
    /// Every state an entity can be in.
    pub states: Vec<String>,
    /// Every event type the machine knows; an event of another type is disallowed.
    pub types: Vec<String>,
    /// What to do with an event the entity's state does not allow.
    #[serde(default)]
    pub on_disallowed: Disallowed,
    /// A version column: an event whose version is not newer than the row's is stale (skipped) before its
    /// transition is looked at, and an applied event moves the version too.
    #[serde(default)]
    pub version_column: Option<String>,
    /// Where the event says its version (with `version_column`).
    #[serde(default)]
    pub version: Option<Field>,
    /// The transitions.
    #[serde(rename = "transition")]
    pub transitions: Vec<Transition>,
}

impl StateMachineSpec {
    /// Parses a declaration; the error names the line and the key.
    pub fn from_toml(text: &str) -> Result<Self, Error> {
        toml::from_str(text).map_err(|e| Error::Config(format!("state machine: {e}")))
    }

    /// Checks the declaration on its own: every state and type it names is declared, every state is reachable
    /// from `initial`, every type has a transition, no (state, type) pair goes two ways.
    pub fn validate(&self) -> Result<(), Error> {
        let bad = |reason: String| Err(Error::Config(format!("state machine on `{}`: {reason}", self.table)));
        let states: BTreeSet<&str> = self.states.iter().map(String::as_str).collect();
        let types: BTreeSet<&str> = self.types.iter().map(String::as_str).collect();
        if states.is_empty() {
            return bad("`states` is empty: declare the states an entity can be in".into());
        }
        if states.len() != self.states.len() || types.len() != self.types.len() {
            return bad("`states` or `types` names one twice".into());
        }
        if states.contains(self.initial.as_str()) {
            return bad(format!(
                "`initial` = \"{}\" is also in `states`: the initial state is that of an entity without a row and is \
                 never stored; give it a name of its own (default \"none\")",
                self.initial
            ));
        }
        if self.version_column.is_some() != self.version.is_some() {
            return bad("`version_column` and `version` go together: set both or neither".into());
        }
        let mut next: HashMap<(&str, &str), &str> = HashMap::new();
        for (n, t) in self.transitions.iter().enumerate() {
            let at = format!("transition {} ({} --{}--> {})", n + 1, t.from, t.on, t.to);
            if t.from != self.initial && !states.contains(t.from.as_str()) {
                return bad(format!("{at}: unknown state `{}`: declare it in `states`", t.from));
            }
            if !states.contains(t.to.as_str()) {
                return bad(format!("{at}: unknown state `{}`: declare it in `states`", t.to));
            }
            if !types.contains(t.on.as_str()) {
                return bad(format!("{at}: unknown event type `{}`: declare it in `types`", t.on));
            }
            if let Some(other) = next.insert((&t.from, &t.on), &t.to)
                && other != t.to
            {
                return bad(format!("{at}: `{}` on `{}` already goes to `{other}`", t.from, t.on));
            }
        }
        let mut reached: BTreeSet<&str> = BTreeSet::from([self.initial.as_str()]);
        let mut queue = VecDeque::from([self.initial.as_str()]);
        while let Some(state) = queue.pop_front() {
            for t in self.transitions.iter().filter(|t| t.from == state) {
                if reached.insert(&t.to) {
                    queue.push_back(&t.to);
                }
            }
        }
        if let Some(lost) = states.iter().find(|s| !reached.contains(*s)) {
            return bad(format!(
                "state `{lost}` is unreachable from `{}`: add a transition into it, or remove it from `states`",
                self.initial
            ));
        }
        if let Some(idle) = types.iter().find(|ty| !self.transitions.iter().any(|t| t.on == **ty)) {
            return bad(format!("event type `{idle}` has no transition: add one, or remove it from `types`"));
        }
        Ok(())
    }
}

/// Declared transitions (state × event type → next state), checked inside idem's transaction under a lock on the
/// entity's row ("only accept OrderCancelled if the order is confirmed").
///
/// [`StateMachine::check`] moves the row to the next state and returns [`Decision::Apply`]; an event its state
/// does not allow is rejected ([`Handled::Rejected`], [`Decision::Skip`]) or dead-lettered, by
/// [`StateMachineSpec::on_disallowed`]. An entity without a row is in the `initial` state; a transition out of it
/// creates the row with the id and the state (and version) set, which the handler then fills.
pub struct StateMachine<DB> {
    spec: StateMachineSpec,
    next: HashMap<(String, String), String>,
    id_is_integer: bool,
    read: String,
    create: String,
    update: String,
    store: PhantomData<fn() -> DB>,
}

impl<DB> std::fmt::Debug for StateMachine<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StateMachine").field("spec", &self.spec).finish_non_exhaustive()
    }
}

impl<DB: GuardStore> StateMachine<DB> {
    /// Validates `spec` ([`StateMachineSpec::validate`]) and checks it against the database: the table, its
    /// unique id column, the state column (every declared state must be a value it can hold), the version
    /// column, and defaults for the table's other `NOT NULL` columns.
    pub async fn new(pool: &sqlx::Pool<DB>, spec: StateMachineSpec) -> Result<Self, Error> {
        spec.validate()?;
        let what = format!("state machine on `{}`", spec.table);
        let mut columns = vec![("id", spec.id_column.as_str()), ("state", spec.state_column.as_str())];
        columns.extend(spec.version_column.as_deref().map(|v| ("version", v)));
        let fields: Vec<&Field> =
            [Some(&spec.entity), Some(&spec.event_type), spec.version.as_ref()].into_iter().flatten().collect();
        Table::distinct(&what, &columns, &fields)?;
        let t = Table::read(pool, &what, &spec.table).await?;
        let id = t.column(&what, "id", &spec.id_column)?;
        let state = t.column(&what, "state", &spec.state_column)?;
        for s in &spec.states {
            if let Err(e) = DB::converts(pool, &state.sql_type, s).await {
                return Err(Error::Config(format!(
                    "{what}: state `{s}` is not a value the state column `{}` ({}) can hold: {e}",
                    spec.state_column, state.sql_type
                )));
            }
        }
        let mut filled = vec![spec.id_column.as_str(), spec.state_column.as_str()];
        if let Some(version) = &spec.version_column {
            let v = t.column(&what, "version", version)?;
            if !DB::is_integer(&v.sql_type) {
                return Err(Error::Config(format!(
                    "{what}: the version column `{version}` is {}, not an integer type: use bigint",
                    v.sql_type
                )));
            }
            filled.push(version);
        }
        t.unique(pool, &what, &spec.id_column).await?;
        t.creatable(&what, &filled)?;

        let (table, i, s) = (&spec.table, &spec.id_column, &spec.state_column);
        let id_param = DB::param_as(&id.sql_type, 1);
        let state_param = DB::param_as(&state.sql_type, 2);
        let mut values = vec![(s.as_str(), state_param)];
        values.extend(spec.version_column.as_deref().map(|v| (v, DB::param(3))));
        let version_read = DB::as_bigint(spec.version_column.as_deref().unwrap_or("NULL"));
        let create = DB::insert_absent(table, i, &id_param, &values);
        let update = DB::update_by_id(table, i, &id_param, &values);
        let read = DB::lock_row(table, i, &id_param, s, &format!("{}, {version_read}", DB::as_text(s)));
        let next =
            spec.transitions.iter().map(|t| ((t.from.clone(), t.on.clone()), t.to.clone())).collect::<HashMap<_, _>>();
        Ok(StateMachine {
            id_is_integer: DB::is_integer(&id.sql_type),
            next,
            read,
            create,
            update,
            spec,
            store: PhantomData,
        })
    }

    /// [`StateMachine::new`] from a TOML declaration ([`StateMachineSpec`]).
    pub async fn from_toml(pool: &sqlx::Pool<DB>, text: &str) -> Result<Self, Error> {
        Self::new(pool, StateMachineSpec::from_toml(text)?).await
    }

    /// The declaration.
    pub fn spec(&self) -> &StateMachineSpec {
        &self.spec
    }

    /// Moves the entity to the state the event's type leads to ([`Decision::Apply`]), or rejects the event
    /// ([`Decision::Skip`]) or fails it permanently (dead-lettered) when its state does not allow it; with a
    /// version column, an event that is not newer than the row is stale ([`Decision::Skip`]). Call it from the
    /// handler, on idem's transaction, before the effect.
    pub async fn check(&self, event: &Event, tx: &mut DB::Connection) -> Result<Decision, HandlerError> {
        let spec = &self.spec;
        let entity = spec.entity.text(event, "entity id")?;
        if self.id_is_integer && entity.parse::<i64>().is_err() {
            return Err(HandlerError::permanent(format!(
                "entity id ({}) is {entity:?}, not an integer as `{}`'s id column holds",
                spec.entity, spec.table
            )));
        }
        let event_type = spec.event_type.text(event, "event type")?;
        let version = match &spec.version {
            Some(field) => Some(field.integer(event, "version")?),
            None => None,
        };
        // A row created between our read and our insert by a concurrent transaction: read again (locked now).
        for _ in 0..3 {
            let row = DB::fetch_pair(&mut *tx, &self.read, &[Bind::Text(&entity)]).await?;
            if let (Some((_, Some(current))), Some(version)) = (&row, version)
                && version <= *current
            {
                event.mark(Handled::Stale);
                tracing::info!(event_id = %event.id, table = %spec.table, entity = %entity, version, current,
                    outcome = "stale", "stale event skipped: its version is not newer than the row's");
                return Ok(Decision::Skip);
            }
            let exists = row.is_some();
            let state = row.and_then(|(state, _)| state).unwrap_or_else(|| spec.initial.clone());
            let Some(to) = self.next.get(&(state.clone(), event_type.clone())) else {
                return self.disallowed(event, &entity, &state, &event_type);
            };
            let mut binds = vec![Bind::Text(&entity), Bind::Text(to)];
            binds.extend(version.map(Bind::Int));
            if exists {
                DB::execute(&mut *tx, &self.update, &binds).await?;
                return Ok(Decision::Apply);
            }
            if DB::execute(&mut *tx, &self.create, &binds).await? == 1 {
                return Ok(Decision::Apply);
            }
        }
        Err(HandlerError::retryable(format!(
            "state machine on `{}`: entity {entity}'s row kept appearing and disappearing; retrying",
            spec.table
        )))
    }

    fn disallowed(&self, event: &Event, entity: &str, state: &str, event_type: &str) -> Result<Decision, HandlerError> {
        let spec = &self.spec;
        let allowed: Vec<&str> = spec.transitions.iter().filter(|t| t.from == state).map(|t| t.on.as_str()).collect();
        let allowed = if allowed.is_empty() { "none".to_owned() } else { allowed.join(", ") };
        if !spec.types.iter().any(|t| t == event_type) {
            // Under either policy: a type the configuration does not know is a mistake to fix, not a business
            // refusal, so it stays findable and replayable (the engine logs the dead letter at WARN and counts it).
            return Err(HandlerError::permanent(format!(
                "state machine on `{}`: event type `{event_type}` is not declared (types: {}): declare it in                  `types` with its transitions, then replay this dead letter",
                spec.table,
                spec.types.join(", ")
            )));
        }
        match spec.on_disallowed {
            Disallowed::Reject => {
                event.mark(Handled::Rejected);
                tracing::info!(event_id = %event.id, table = %spec.table, entity, state, event_type, allowed,
                    outcome = "rejected", "event not allowed in the entity's state; rejected");
                Ok(Decision::Skip)
            }
            Disallowed::DeadLetter => Err(HandlerError::permanent(format!(
                "state machine on `{}`: `{event_type}` is not allowed in state `{state}` of entity {entity} \
                 (allowed there: {allowed})",
                spec.table
            ))),
        }
    }
}
