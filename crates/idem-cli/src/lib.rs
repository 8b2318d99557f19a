//! The `idem` command's pieces, shared by the `idem` binary and the benchmark (`idem-bench`): the operator
//! commands, the demo, the operations endpoint, opening a database by URL.

pub mod audit;
pub mod cli;
pub mod commands;
pub mod console;
pub mod db;
pub mod dead_letters;
pub mod demo;
pub mod embedded_log;
pub mod features;
pub mod inbox;
pub mod logging;
pub mod migrations;
pub mod outbox;
pub mod parked;
pub mod publishers;
pub mod pubsub;
pub mod service;
pub mod signals;
pub mod sqs;

use std::future::Future;
use std::process::ExitCode;

/// Runs a command on a multi-threaded runtime and turns its result into the process's exit: the error chain on
/// stderr (with `hint`'s advice, when it has some), exit status 1. With `json`, that error is one JSON line like
/// the logs of `--log-format json`.
pub fn run_to_exit(
    command: impl Future<Output = anyhow::Result<ExitCode>>,
    hint: fn(&anyhow::Error) -> Option<&'static str>,
    json: bool,
) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(e) => {
            fatal(json, &format!("cannot start the runtime: {e}"), None);
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(command) {
        Ok(code) => code,
        Err(e) => {
            fatal(json, &format!("{e:#}"), hint(&e));
            ExitCode::FAILURE
        }
    }
}

/// Writes the error that ends the process on stderr: `error: …` and `hint: …` lines, or with `json` one object
/// with the fields of the JSON logs (`timestamp`, `level`, `target`, `message`) and the `hint`.
pub fn fatal(json: bool, message: &str, hint: Option<&str>) {
    if json {
        let mut line = serde_json::json!({
            "timestamp": jiff::Timestamp::now().to_string(),
            "level": "ERROR",
            "target": "idem",
            "message": message,
        });
        if let Some(hint) = hint {
            line["hint"] = hint.into();
        }
        eprintln!("{line}");
    } else {
        eprintln!("error: {message}");
        if let Some(hint) = hint {
            eprintln!("hint: {hint}");
        }
    }
}

/// A message's payload in a command's JSON output: the JSON value itself when the payload is JSON (so that `jq`
/// reads into it), else its text (bytes that are not UTF-8 replaced by U+FFFD).
pub fn json_payload(payload: &[u8]) -> serde_json::Value {
    serde_json::from_slice(payload).unwrap_or_else(|_| String::from_utf8_lossy(payload).into_owned().into())
}

/// Where the markers live: the database URL and the table names.
#[derive(clap::Args, Clone, Debug)]
pub struct DbArgs {
    /// Database URL: postgres://user@host/db, mysql://user@host/db or sqlite://path.db.
    #[arg(long, env = "IDEM_DATABASE_URL")]
    pub database_url: String,
    /// PostgreSQL schema of idem's tables (`idem migrate` creates it if missing).
    #[arg(long)]
    pub schema: Option<String>,
    /// Prefix of idem's table names, so several services can share one database.
    #[arg(long, default_value = "")]
    pub table_prefix: String,
}

/// A flag's value refused by idem: the flag named, then why and the fix (without the "configuration:" prefix a
/// service file's errors carry).
pub fn flag_error(flag: &str, error: idem::Error) -> anyhow::Error {
    match error {
        idem::Error::Config(why) => anyhow::anyhow!("{flag}: {why}"),
        other => anyhow::anyhow!("{flag}: {other}"),
    }
}
