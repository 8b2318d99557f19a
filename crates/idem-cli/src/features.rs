//! The brokers (and OpenTelemetry) this build of idem holds, and the refusal that names the feature a broker
//! needs.
//!
//! The default build holds the embedded log, HTTP ingress, the console and the three databases; each broker's
//! client is a cargo feature (`kafka`, `nats`, `rabbitmq`, `sqs`, `pubsub`, and `otel` for OTLP tracing), `full`
//! holds them all. A command, flag or consumer table that names a broker this build lacks is refused before
//! anything is read, produced or migrated.

/// The optional parts of idem, as `(feature, built in)`, in the order `idem --version` lists them.
pub const OPTIONAL: [(&str, bool); 6] = [
    ("kafka", cfg!(feature = "kafka")),
    ("nats", cfg!(feature = "nats")),
    ("rabbitmq", cfg!(feature = "rabbitmq")),
    ("sqs", cfg!(feature = "sqs")),
    ("pubsub", cfg!(feature = "pubsub")),
    ("otel", cfg!(feature = "otel")),
];

/// Whether this idem is built with `feature` (one of [`OPTIONAL`]'s names).
pub fn built_with(feature: &str) -> bool {
    OPTIONAL.iter().any(|(name, on)| *name == feature && *on)
}

/// The refusal of `what` (a flag or a table, as the user wrote it) in a build without `feature`: names the
/// feature and the command that installs an idem with it.
pub fn missing(feature: &str, what: &str) -> anyhow::Error {
    anyhow::anyhow!(
        "{what} needs idem's `{feature}` feature, which this idem is built without: install idem with it \
         (`cargo install --locked --path crates/idem-cli --features {feature}`, or `--features full` for every broker)"
    )
}

/// Refuses `what` unless this idem is built with `feature`.
pub fn require(feature: &str, what: &str) -> anyhow::Result<()> {
    match built_with(feature) {
        true => Ok(()),
        false => Err(missing(feature, what)),
    }
}

/// Refuses the first of `flags` (a feature's name and whether its flag, `--<feature>`, was given) that names a
/// broker this idem is built without.
pub fn require_flags(flags: &[(&str, bool)]) -> anyhow::Result<()> {
    for (feature, given) in flags {
        if *given {
            require(feature, &format!("--{feature}"))?;
        }
    }
    Ok(())
}

/// `idem --version`'s text: the version, then the optional parts built in (`0.1.0 (features: kafka, otel)`).
pub static VERSION: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    let with: Vec<&str> = OPTIONAL.iter().filter(|(_, on)| *on).map(|(name, _)| *name).collect();
    let with = if with.is_empty() { "none".to_owned() } else { with.join(", ") };
    format!("{} (features: {with})", env!("CARGO_PKG_VERSION"))
});

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_feature_this_build_lacks_is_refused_by_name_and_one_it_has_is_not() {
        for (feature, on) in OPTIONAL {
            let required = require(feature, "--flag");
            assert_eq!(required.is_ok(), on, "{feature}");
            if let Err(e) = required {
                let text = e.to_string();
                assert!(text.contains(&format!("`{feature}` feature")) && text.contains("--features"), "{text}");
            }
        }
        assert!(!built_with("no-such-feature"));
    }
}
