//! The process's logs and traces: logs on stderr at the chosen level (text or JSON lines), and, when the
//! environment asks for them (`OTEL_EXPORTER_OTLP_ENDPOINT`), OpenTelemetry traces exported over OTLP.

use tracing_subscriber::Layer;
use tracing_subscriber::filter::LevelFilter;
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
    let filter = LevelFilter::from_level(level);
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
        Ok(Tracing {})
    }
}
