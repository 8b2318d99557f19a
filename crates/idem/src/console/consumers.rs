//! The consumers a console runs beside (`idem run`'s, or a Rust binary's own engines): their state, counters and
//! stalled partitions, and the kill switch's resume. A console started alone (`idem console`) has none.

use std::sync::Arc;

use crate::engine::{Engine, Health, StatsSnapshot};
use crate::store::Backend;

/// What the console reads of a consumer, and the one thing it does to it.
pub trait ConsumerView: Send + Sync + 'static {
    /// The consumer group.
    fn group(&self) -> String;
    /// Running, draining, paused, partitions, stalled partitions.
    fn health(&self) -> Health;
    /// The counters since start.
    fn stats(&self) -> StatsSnapshot;
    /// Closes a tripped kill switch on `actor`'s request (written to the audit trail); whether it was paused.
    fn resume_as(&self, actor: &str) -> bool;
    /// How far behind it is, where its source tells ([`crate::lag`]).
    fn lag(&self) -> Vec<crate::lag::Lag> {
        crate::lag::of(&self.group())
    }
}

impl<DB: Backend> ConsumerView for Engine<DB> {
    fn group(&self) -> String {
        self.config().group.clone()
    }

    fn health(&self) -> Health {
        Engine::health(self)
    }

    fn stats(&self) -> StatsSnapshot {
        Engine::stats(self)
    }

    fn resume_as(&self, actor: &str) -> bool {
        Engine::resume_as(self, actor)
    }
}

/// The consumers a console shows.
#[derive(Clone, Default)]
pub struct Consumers(pub Vec<Arc<dyn ConsumerView>>);

impl std::fmt::Debug for Consumers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.0.iter().map(|c| c.group())).finish()
    }
}

impl Consumers {
    /// The consumers of these engines.
    pub fn of<DB: Backend>(engines: &[Engine<DB>]) -> Consumers {
        Consumers(engines.iter().map(|e| Arc::new(e.clone()) as Arc<dyn ConsumerView>).collect())
    }

    /// The consumer of `group`.
    pub fn find(&self, group: &str) -> Option<&Arc<dyn ConsumerView>> {
        self.0.iter().find(|c| c.group() == group)
    }

    /// Each consumer as the API shows it.
    pub fn json(&self) -> serde_json::Value {
        let consumers: Vec<serde_json::Value> = self
            .0
            .iter()
            .map(|c| {
                let health = c.health();
                serde_json::json!({
                    "group": c.group(), "ready": health.ready(), "running": health.running,
                    "draining": health.draining, "paused": health.paused, "partitions": health.partitions,
                    "stalled": health.stalled, "stats": c.stats(), "lag": c.lag(),
                })
            })
            .collect();
        consumers.into()
    }
}
