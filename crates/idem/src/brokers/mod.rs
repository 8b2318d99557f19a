//! The sources and producers, one module per broker, each implementing the seam of [`crate::source`]
//! ([`crate::Source`], [`crate::Publisher`]) and nothing of the engine's inside. Each is re-exported at the crate
//! root (`idem::kafka`, `idem::nats`, ...) behind its feature; the embedded log is always there.
//!
//! A new broker is one more module here, behind a feature of its own, that passes the source conformance suite
//! ([`crate::testing::conformance`], feature `testing`).

pub mod embedded;
#[cfg(feature = "kafka")]
pub mod kafka;
#[cfg(feature = "nats")]
pub mod nats;
#[cfg(feature = "pubsub")]
pub mod pubsub;
#[cfg(feature = "rabbitmq")]
pub mod rabbitmq;
#[cfg(feature = "sqs")]
pub mod sqs;
