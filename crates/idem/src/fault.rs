//! Fault injection: kill the process with SIGKILL at a chosen point of the transaction order.
//!
//! Only with the cargo feature `fault-injection`, and then only where a program arms it explicitly
//! ([`crate::Engine::with_faults`]): no environment variable arms it, so neither `idem run`, `idem relay` nor a
//! library user's program can be made to kill itself from outside. The `idem` binary arms it only in the demo's
//! consumer processes (`idem demo-worker --fault`, `idem run --fault`, both hidden flags the demo and the crash
//! tests pass). A fault is `<point>:<n>`: the process kills itself with SIGKILL the n-th time (counting from 1)
//! it reaches `<point>`:
//!
//! * `before-commit`: after the handlers ran, before `COMMIT` (the work must be redone after a restart);
//! * `after-commit`: after `COMMIT`, before the broker acknowledgement (the redelivery must be a duplicate).
//!
//! `idem demo` and the crash tests use it; production processes never arm it.

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

    /// Parses `<point>:<n>`; an unreadable value is refused, so a test cannot silently run without its fault.
    pub fn parse(spec: &str) -> Result<Self, crate::Error> {
        let bad = || {
            crate::Error::Config(format!("fault `{spec}` is invalid: use before-commit:N or after-commit:N with N ≥ 1"))
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
            assert!(Faults::parse(bad).unwrap_err().to_string().contains("before-commit:N"), "{bad}");
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
