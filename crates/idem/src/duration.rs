//! Durations as people write them, read the same way everywhere idem reads one (CLI flags, the inbox's TOML):
//! `8d`, `36h`, `90m`, `1h30m`, `600s`, `2 days`, and ISO 8601 (`P2D`, `PT90M`, `P1DT12H`, the form jEAP
//! configurations use). A day is 24 hours and a week 7 days; months and years, which have no fixed length, are
//! refused. Parsing is [`jiff`]'s (its friendly format and ISO 8601).

use std::time::Duration;

use crate::error::Error;

/// Parses `text` as a non-negative duration; the error quotes it and shows the accepted forms.
pub fn parse(text: &str) -> Result<Duration, Error> {
    let trimmed = text.trim();
    let bad = |why: &str| {
        Error::Config(format!(
            "`{trimmed}` is not a duration{why}: write it like 8d, 36h, 1h30m, 600s or ISO 8601 (P2D, PT90M)"
        ))
    };
    // A bare number has no unit: refused rather than guessed.
    if trimmed.is_empty() || trimmed.chars().all(|c| c.is_ascii_digit()) {
        return Err(bad(if trimmed.is_empty() { "" } else { " (a number without a unit)" }));
    }
    let span: jiff::Span = trimmed.parse().map_err(|_| bad(""))?;
    let exact = span
        .to_duration(jiff::SpanRelativeTo::days_are_24_hours())
        .map_err(|_| bad(" (months and years have no fixed length: use days)"))?;
    Duration::try_from(exact).map_err(|_| bad(" (it is negative)"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn friendly_and_iso_8601() {
        let h = 3_600;
        for (text, seconds) in [
            ("8d", 8 * 86_400),
            ("36h", 36 * h),
            ("90m", 5_400),
            ("1h30m", 5_400),
            ("1h 30m", 5_400),
            ("600s", 600),
            ("2 days", 2 * 86_400),
            ("1w", 7 * 86_400),
            ("P2D", 2 * 86_400),
            ("PT90M", 5_400),
            ("P1DT12H", 36 * h),
            ("pt36h", 36 * h),
        ] {
            assert_eq!(parse(text).unwrap_or_else(|e| panic!("{text}: {e}")), Duration::from_secs(seconds), "{text}");
        }
        assert_eq!(parse("250ms").ok(), Some(Duration::from_millis(250)));
    }

    #[test]
    fn one_error_for_all_bad_input() {
        for (text, why) in [
            ("8", "a number without a unit"),
            ("", "is not a duration:"),
            ("d", "is not a duration:"),
            ("8x", "is not a duration:"),
            ("-1d", "negative"),
            ("P1M", "months and years"),
            ("1y", "months and years"),
        ] {
            let message = parse(text).expect_err(text).to_string();
            assert!(message.contains(why), "{text}: {message}");
            assert!(message.contains("write it like 8d, 36h, 1h30m, 600s or ISO 8601 (P2D, PT90M)"), "{message}");
        }
    }
}
