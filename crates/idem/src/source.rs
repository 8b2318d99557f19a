//! The broker seam: [`Source`] delivers messages, [`Publisher`] puts them back (dead-letter replay, producers).
//!
//! Implementations: the embedded log ([`crate::embedded`]) in this crate; Kafka and other brokers in their own
//! modules. Every implementation must keep the contract written on [`Source`]; the engine relies on nothing else.

use std::future::Future;

use tokio::sync::oneshot;

use crate::error::Retry;
use crate::message::{AckHandle, Message};

/// A failure of the broker or the embedded log.
#[derive(Debug, thiserror::Error)]
#[error("{context}: {message}")]
pub struct SourceError {
    context: &'static str,
    message: String,
    retry: Retry,
}

impl SourceError {
    /// A failure that may pass (a broker briefly away, a rebalance in progress).
    pub fn transient(context: &'static str, message: impl std::fmt::Display) -> Self {
        SourceError { context, message: message.to_string(), retry: Retry::Helps }
    }

    /// A failure that will not pass by retrying (a corrupt log, a fenced consumer, a bad configuration).
    pub fn permanent(context: &'static str, message: impl std::fmt::Display) -> Self {
        SourceError { context, message: message.to_string(), retry: Retry::Useless }
    }

    /// Whether a retry can help.
    pub fn retry(&self) -> Retry {
        self.retry
    }
}

impl From<std::io::Error> for SourceError {
    fn from(e: std::io::Error) -> Self {
        SourceError::permanent("io", e)
    }
}

/// A topic and partition.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Partition {
    /// The topic.
    pub topic: String,
    /// The partition number.
    pub partition: i32,
}

/// Tells the source that the engine has drained revoked partitions: in-flight work committed or abandoned, and
/// every committed batch acknowledged. Dropping it without [`Drained::done`] means the same.
#[derive(Debug)]
pub struct Drained(Option<oneshot::Sender<()>>);

impl Drained {
    /// A drain notice and the receiver the source waits on before it lets the partitions go.
    pub fn channel() -> (Self, oneshot::Receiver<()>) {
        let (tx, rx) = oneshot::channel();
        (Drained(Some(tx)), rx)
    }

    /// Signals that the partitions are drained.
    pub fn done(mut self) {
        if let Some(tx) = self.0.take() {
            let _ = tx.send(());
        }
    }
}

/// What the engine acknowledges after a commit: messages of one partition, in order, every one of them committed
/// (or dead-lettered) in the database.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Acknowledgement {
    /// The partition (on a broker without partitions, what idem treats as one: a queue, a message group).
    pub partition: Partition,
    /// The offset of the last message. An offset broker acknowledges every message up to it.
    pub last_offset: i64,
    /// The [`AckHandle`] of every message that has one, in order. A per-message broker acknowledges exactly
    /// these.
    pub handles: Vec<AckHandle>,
    /// Those of `handles` whose message idem dead-lettered instead of handling it (its dead-letter row
    /// committed). A broker with a dead-letter path of its own may settle them that way (RabbitMQ rejects them
    /// to the queue's dead-letter exchange, JetStream terminates them); to every other it is an acknowledgement.
    pub dead_lettered: Vec<AckHandle>,
}

impl Acknowledgement {
    /// The acknowledgement of `messages`, all of one partition, in order, none of them dead-lettered; `None`
    /// when there are none.
    pub fn of(messages: &[Message]) -> Option<Self> {
        let last = messages.last()?;
        Some(Acknowledgement {
            partition: Partition { topic: last.topic.clone(), partition: last.partition },
            last_offset: last.offset,
            handles: messages.iter().filter_map(|m| m.ack_handle.clone()).collect(),
            dead_lettered: Vec::new(),
        })
    }

    /// Everything of `topic`/`partition` up to and including `offset` (an offset broker's acknowledgement).
    pub fn up_to(topic: impl Into<String>, partition: i32, offset: i64) -> Self {
        Acknowledgement {
            partition: Partition { topic: topic.into(), partition },
            last_offset: offset,
            handles: Vec::new(),
            dead_lettered: Vec::new(),
        }
    }
}

/// What [`Source::recv`] yields.
#[derive(Debug)]
pub enum Received {
    /// The next message of one of the assigned partitions.
    Message(Message),
    /// These partitions are being taken away (rebalance, shutdown). The engine stops handing out their messages,
    /// finishes or abandons the in-flight batch, acknowledges what committed, then signals `drained`.
    Revoked {
        /// The partitions going away.
        partitions: Vec<Partition>,
        /// Signalled when the engine has drained them.
        drained: Drained,
    },
}

/// A source of messages: the consumer side of a broker.
///
/// # Contract
/// * **Order.** Messages of one partition are yielded in offset order (on SQS, which has no offsets, in the order
///   the queue delivers them). Different partitions may interleave.
/// * **Acknowledgement after commit.** The engine calls [`Source::ack`] for a partition only after the database
///   transactions holding the messages' markers have committed, with an [`Acknowledgement`] of exactly those
///   messages, in order. Acknowledgements of one partition arrive in delivery order. Two kinds of broker fit:
///   an **offset broker** (Kafka, the embedded log) commits `last_offset + 1`, which covers every earlier
///   message of the partition; a **per-message broker** (RabbitMQ, NATS JetStream, SQS) sets an [`AckHandle`]
///   on each message it yields and acknowledges exactly the handles it is given, keeping no side map. A source
///   must never acknowledge on its own (no auto-commit, no auto-ack).
/// * **Redelivery.** Messages that were not acknowledged when the consumer stopped, crashed or lost the
///   partition are delivered again, to this consumer after a restart or to whichever member of the group gets
///   the partition. Duplicates are expected; the markers absorb them.
/// * **Revocation.** Before giving a partition to another consumer, the source yields [`Received::Revoked`] and
///   waits for [`Drained`], so the new owner starts after the last acknowledgement.
/// * **End.** `Ok(None)` means the source is finished (a bounded source that reached its end, or a shutdown);
///   the engine drains and returns.
pub trait Source: Send + Sync + 'static {
    /// The broker's name in traces (`messaging.system`): `kafka`, `rabbitmq`, `nats`, `idem` for the embedded log.
    const SYSTEM: &'static str = "idem";

    /// The next message or revocation; waits until there is one.
    fn recv(&self) -> impl Future<Output = Result<Option<Received>, SourceError>> + Send;

    /// Acknowledges the committed messages `ack` names (see the contract above).
    fn ack(&self, ack: &Acknowledgement) -> impl Future<Output = Result<(), SourceError>> + Send;

    /// The source's per-partition pause, where it has one (Kafka, the embedded log). The engine pauses a
    /// partition whose worker falls behind (a failing key retrying, a slow handler) so that the others go on
    /// being read; without one, what a partition holds is bounded by the broker's own in-flight limit (RabbitMQ's
    /// prefetch per queue, JetStream's `max_ack_pending`) and by the engine's cap over all partitions.
    fn pausing(&self) -> Option<&dyn PausePartitions> {
        None
    }

    /// The broker's name in traces: [`Source::SYSTEM`], unless the source stands for another (a
    /// [`BoxedSource`] gives its inner source's).
    fn system(&self) -> &'static str {
        Self::SYSTEM
    }
}

/// Any [`Source`] behind one type. A program that chooses its broker at run time (from a configuration file)
/// hands the engine a `BoxedSource`, so the engine's run loop is compiled once, not once per broker; each
/// `recv` and `ack` costs one allocation more, nothing else changes (the contract is the inner source's).
pub struct BoxedSource(Box<dyn ErasedSource>);

impl BoxedSource {
    /// Boxes `source`.
    pub fn new(source: impl Source) -> Self {
        BoxedSource(Box::new(source))
    }
}

impl std::fmt::Debug for BoxedSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("BoxedSource").field(&self.0.system()).finish()
    }
}

type BoxFuture<'a, T> = std::pin::Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// [`Source`] as an object: its futures boxed.
trait ErasedSource: Send + Sync + 'static {
    fn recv(&self) -> BoxFuture<'_, Result<Option<Received>, SourceError>>;
    fn ack<'a>(&'a self, ack: &'a Acknowledgement) -> BoxFuture<'a, Result<(), SourceError>>;
    fn pausing(&self) -> Option<&dyn PausePartitions>;
    fn system(&self) -> &'static str;
}

impl<S: Source> ErasedSource for S {
    fn recv(&self) -> BoxFuture<'_, Result<Option<Received>, SourceError>> {
        Box::pin(Source::recv(self))
    }

    fn ack<'a>(&'a self, ack: &'a Acknowledgement) -> BoxFuture<'a, Result<(), SourceError>> {
        Box::pin(Source::ack(self, ack))
    }

    fn pausing(&self) -> Option<&dyn PausePartitions> {
        Source::pausing(self)
    }

    fn system(&self) -> &'static str {
        Source::system(self)
    }
}

impl Source for BoxedSource {
    async fn recv(&self) -> Result<Option<Received>, SourceError> {
        self.0.recv().await
    }

    async fn ack(&self, ack: &Acknowledgement) -> Result<(), SourceError> {
        self.0.ack(ack).await
    }

    fn pausing(&self) -> Option<&dyn PausePartitions> {
        self.0.pausing()
    }

    fn system(&self) -> &'static str {
        self.0.system()
    }
}

/// A source that can stop fetching some of its partitions while the rest flow (Kafka's pause and resume). Both
/// calls return quickly (Kafka's wait for the client's own thread, not for the broker); a message fetched before
/// the pause may still be yielded after it, in order.
pub trait PausePartitions: Send + Sync {
    /// Stops fetching `partitions` until [`PausePartitions::resume`].
    fn pause(&self, partitions: &[Partition]) -> Result<(), SourceError>;

    /// Fetches `partitions` again, from the message after the last one yielded.
    fn resume(&self, partitions: &[Partition]) -> Result<(), SourceError>;
}

/// The producer side of a broker: used to replay dead letters and by the producer helpers.
pub trait Publisher: Send + Sync {
    /// Publishes `message` to `message.topic` (its partition, offset and timestamp are chosen by the broker) and
    /// returns once the broker has it durably.
    fn publish(&self, message: &Message) -> impl Future<Output = Result<(), SourceError>> + Send;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_acknowledgement_names_the_last_offset_and_every_handle_in_order() {
        let (a, b) = (AckHandle::new(7u64), AckHandle::new(9u64));
        let mut first = Message::new("q", 2, 10, "x");
        first.ack_handle = Some(a.clone());
        let plain = Message::new("q", 2, 11, "y");
        let mut last = Message::new("q", 2, 12, "z");
        last.ack_handle = Some(b.clone());
        let ack = Acknowledgement::of(&[first, plain, last]).unwrap();
        assert_eq!(ack.partition, Partition { topic: "q".into(), partition: 2 });
        assert_eq!(ack.last_offset, 12);
        assert_eq!(ack.handles, vec![a, b]);
        assert_eq!(ack.handles[1].get::<u64>(), Some(&9));
        assert!(Acknowledgement::of(&[]).is_none());
        assert!(Acknowledgement::up_to("q", 0, 5).handles.is_empty());
    }
}
