//! Fault injection: kill the process with SIGKILL at a chosen point of the transaction order.
//!
//! Only with the cargo feature `fault-injection` (the `idem` binary has it; a library user's program does not,
//! so no environment variable can make it kill itself), and then off unless the environment variable
//! `IDEM_FAULT` is set when the engine starts. Its value is
//! `<point>:<n>`: the process kills itself with SIGKILL the n-th time (counting from 1) it reaches `<point>`:
//!
//! * `before-commit`: after the handlers ran, before `COMMIT` (the work must be redone after a restart);
//! * `after-commit`: after `COMMIT`, before the broker acknowledgement (the redelivery must be a duplicate).
//!
//! `idem demo` and the crash tests use it; production processes never set it.

use std::sync::atomic::{AtomicU64, Ordering};

/// The points of the transaction order where a fault can be injected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultPoint {
    /// After the handlers ran, before `COMMIT`.
    BeforeCommit,
    /// After `COMMIT`, before the broker acknowledgement.
    AfterCommit,
}

impl FaultPoint {
    fn name(self) -> &'static str {
        match self {
            FaultPoint::BeforeCommit => "before-commit",
            FaultPoint::AfterCommit => "after-commit",
        }
    }
}

/// The environment variable that switches a fault on.
pub const FAULT_ENV: &str = "IDEM_FAULT";

/// A fault armed for one point: kills the process the n-th time that point is reached.
#[derive(Debug)]
pub struct Faults {
    armed: Option<(FaultPoint, u64)>,
    reached: AtomicU64,
}

impl Faults {
    /// No fault.
    pub fn none() -> Self {
        Faults { armed: None, reached: AtomicU64::new(0) }
    }

    /// Reads `IDEM_FAULT`; an unreadable value is refused so a test cannot silently run without its fault.
    /// Without the `fault-injection` feature, no fault: the variable is ignored (and a warning says so).
    pub fn from_env() -> Result<Self, crate::Error> {
        match std::env::var(FAULT_ENV) {
            Ok(spec) if cfg!(feature = "fault-injection") => Self::parse(&spec),
            Ok(_) => {
                tracing::warn!("{FAULT_ENV} is set but ignored: this program is built without fault injection");
                Ok(Self::none())
            }
            Err(_) => Ok(Self::none()),
        }
    }

    /// Parses `<point>:<n>`.
    pub fn parse(spec: &str) -> Result<Self, crate::Error> {
        let bad = || {
            crate::Error::Config(format!(
                "{FAULT_ENV}=`{spec}` is invalid: use before-commit:N or after-commit:N with N ≥ 1, or unset it"
            ))
        };
        let (point, n) = spec.split_once(':').ok_or_else(bad)?;
        let point = match point {
            "before-commit" => FaultPoint::BeforeCommit,
            "after-commit" => FaultPoint::AfterCommit,
            _ => return Err(bad()),
        };
        let n: u64 = n.parse().map_err(|_| bad())?;
        if n == 0 {
            return Err(bad());
        }
        Ok(Faults { armed: Some((point, n)), reached: AtomicU64::new(0) })
    }

    /// Called by the engine at `point`; kills the process when the armed fault fires.
    pub fn reached(&self, point: FaultPoint) {
        let Some((armed, n)) = self.armed else { return };
        if armed != point {
            return;
        }
        if self.reached.fetch_add(1, Ordering::SeqCst) + 1 == n {
            tracing::warn!(point = point.name(), "fault injection: killing this process with SIGKILL");
            kill_self();
        }
    }
}

fn kill_self() -> ! {
    // SAFETY: kill(2) on our own pid has no memory-safety preconditions.
    unsafe {
        libc::kill(libc::getpid(), libc::SIGKILL);
    }
    // SIGKILL cannot be caught; should delivery somehow be delayed, do not go on past the fault point.
    std::process::abort()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_points() {
        assert!(Faults::parse("after-commit:3").is_ok());
        assert!(Faults::parse("before-commit:1").is_ok());
        for bad in ["after-commit", "after-commit:0", "middle:1", "after-commit:x"] {
            assert!(Faults::parse(bad).unwrap_err().to_string().contains("IDEM_FAULT"), "{bad}");
        }
    }

    #[test]
    fn none_never_fires() {
        let f = Faults::none();
        for _ in 0..10 {
            f.reached(FaultPoint::AfterCommit);
        }
        let armed = Faults::parse("before-commit:2").unwrap();
        armed.reached(FaultPoint::AfterCommit);
        armed.reached(FaultPoint::BeforeCommit);
    }
}
