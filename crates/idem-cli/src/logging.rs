//! The process's logs and traces: logs on stderr at the chosen level (text or JSON lines), and, when the
//! environment asks for them (`OTEL_EXPORTER_OTLP_ENDPOINT`), OpenTelemetry traces exported over OTLP.

use tracing_subscriber::Layer;
use tracing_subscriber::filter::{LevelFilter, Targets};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// What must be flushed before the process exits.
pub struct Tracing {
    #[cfg(feature = "otel")]
    otel: Option<idem::otel::OtlpTracing>,
}

impl Tracing {
    /// Exports the spans still buffered.
    pub fn shutdown(self) {
        #[cfg(feature = "otel")]
        if let Some(otel) = self.otel {
            otel.shutdown();
        }
    }
}

/// Installs the global subscriber: logs at `level` (JSON lines with `json`), and spans at INFO and above to OTLP
/// when the `OTEL_*` environment asks for it, whatever the log level.
pub fn init(level: tracing::Level, json: bool) -> anyhow::Result<Tracing> {
    let filter = filter(level);
    let colours = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let logs = tracing_subscriber::fmt::layer().with_writer(std::io::stderr).with_ansi(colours);
    let logs = match json {
        true => logs.json().flatten_event(true).with_filter(filter).boxed(),
        false => logs.with_filter(filter).boxed(),
    };
    #[cfg(feature = "otel")]
    {
        let otel = match idem::otel::requested_by_env() {
            true => Some(idem::otel::OtlpTracing::from_env()?),
            false => None,
        };
        let layer = otel.as_ref().map(|o| o.layer().with_filter(LevelFilter::INFO));
        tracing_subscriber::registry().with(logs).with(layer).try_init()?;
        Ok(Tracing { otel })
    }
    #[cfg(not(feature = "otel"))]
    {
        tracing_subscriber::registry().with(logs).try_init()?;
        let set = |name: &str| std::env::var(name).is_ok_and(|v| !v.trim().is_empty());
        if set("OTEL_EXPORTER_OTLP_ENDPOINT") || set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") {
            tracing::warn!(
                "{}: no traces are exported",
                crate::features::missing("otel", "OTEL_EXPORTER_OTLP_ENDPOINT")
            );
        }
        Ok(Tracing {})
    }
}

/// Everything at `level`, except the AMQP client's own lines (`lapin`, `amq_protocol`), which only `debug` and
/// `trace` show: they print its errors as Rust structures, and idem logs each of those errors itself, with the
/// queue and what it does about it.
fn filter(level: tracing::Level) -> Targets {
    let client = if level >= tracing::Level::DEBUG { LevelFilter::from_level(level) } else { LevelFilter::OFF };
    Targets::new()
        .with_default(LevelFilter::from_level(level))
        .with_target("lapin", client)
        .with_target("amq_protocol", client)
}

#[cfg(test)]
mod tests {
    use tracing::Level;

    fn shown(level: Level, target: &str, at: Level) -> bool {
        super::filter(level).would_enable(target, &at)
    }

    #[test]
    fn the_amqp_clients_own_lines_show_only_when_debugging() {
        assert!(shown(Level::WARN, "idem::engine", Level::ERROR));
        assert!(!shown(Level::WARN, "idem::engine", Level::INFO));
        assert!(!shown(Level::WARN, "lapin::channels", Level::ERROR));
        assert!(!shown(Level::INFO, "amq_protocol", Level::ERROR));
        assert!(shown(Level::DEBUG, "lapin::channels", Level::ERROR));
        assert!(shown(Level::TRACE, "lapin", Level::TRACE));
    }
}
