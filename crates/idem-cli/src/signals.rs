//! SIGINT and SIGTERM, registered when a command starts. A signal that arrives while the command is still
//! connecting is kept, and ends the run as soon as it begins: the engine drains nothing and the process exits 0,
//! instead of dying of the signal's default action.

use tokio::signal::unix::{Signal, SignalKind, signal};

/// The registered SIGINT and SIGTERM handlers of a long-running command.
pub struct Signals {
    interrupt: Signal,
    terminate: Signal,
}

impl Signals {
    /// Registers the handlers now; from here on neither signal kills the process.
    pub fn install() -> anyhow::Result<Self> {
        let interrupt =
            signal(SignalKind::interrupt()).map_err(|e| anyhow::anyhow!("cannot register a SIGINT handler: {e}"))?;
        let terminate =
            signal(SignalKind::terminate()).map_err(|e| anyhow::anyhow!("cannot register a SIGTERM handler: {e}"))?;
        Ok(Signals { interrupt, terminate })
    }

    /// Completes on the first SIGINT or SIGTERM received since [`Signals::install`].
    pub async fn received(mut self) {
        tokio::select! {
            _ = self.interrupt.recv() => {}
            _ = self.terminate.recv() => {}
        }
    }
}
