//! `--compare OTHER`: this `idem-bench` and another one (built from the commit before a change) run the chosen
//! legs in turn, one run each per round, on the same machine and database. A leg's figure moves by a quarter
//! between two runs a minute apart on a busy machine; what moves both binaries alike cancels out of the ratio of
//! one round, so each leg is reported as this ÷ other per round: its median and its spread over the rounds.

use std::ffi::OsString;
use std::path::Path;
use std::process::ExitCode;

use anyhow::{Context, bail};
use serde_json::Value;

use super::{BenchArgs, Spread};

/// Arguments that `--compare` sets itself for each run, and so takes out of what it passes on: the flag's name and
/// whether it takes a value.
const OWN: [(&str, bool); 4] = [("--compare", true), ("--rounds", true), ("--runs", true), ("--json", false)];

/// One leg of both binaries over the rounds.
#[derive(serde::Serialize)]
struct Compared {
    name: String,
    /// This binary's figure in each round.
    this: Vec<f64>,
    /// The other binary's figure in each round.
    other: Vec<f64>,
    /// This ÷ other in each round.
    ratios: Vec<f64>,
    ratio_median: f64,
    ratio_min: f64,
    ratio_max: f64,
}

/// Runs `rounds` rounds of both binaries, then prints each leg's ratio this ÷ other.
pub(super) async fn run(args: &BenchArgs, other: &Path, rounds: usize) -> anyhow::Result<ExitCode> {
    if rounds == 0 {
        bail!("--rounds must be above zero");
    }
    if !other.is_file() {
        bail!("--compare {}: no such file; build the other commit's idem-bench and name its binary", other.display());
    }
    let this = std::env::current_exe().context("this binary's path")?;
    let passed = passed_on(std::env::args_os().skip(1));
    let (mut these, mut others) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        // The first of a round is alternated, so that a drift over the whole run (a checkpoint, the cache filling)
        // does not always fall on the same binary.
        let this_first = round % 2 == 0;
        for is_this in [this_first, !this_first] {
            let binary = if is_this { this.as_path() } else { other };
            if !args.json {
                eprintln!("compare: round {} of {rounds}, {}", round + 1, binary.display());
            }
            let report = once(binary, &passed).await?;
            if is_this { these.push(report) } else { others.push(report) }
        }
    }
    let legs = compared(&these, &others, "legs", "name", &["runs", "0"]);
    let ratios = compared(&these, &others, "ratios", "0", &["1"]);
    if args.json {
        println!("{}", serde_json::json!({ "rounds": rounds, "other": other, "legs": legs, "ratios": ratios }));
        return Ok(ExitCode::SUCCESS);
    }
    println!("this binary ÷ {} over {rounds} round(s), one run each\n", other.display());
    println!("{:<66} {:>10} {:>10} {:>8} {:>13}", "leg (events/s)", "this", "other", "÷", "min–max");
    print_rows(&legs, 0);
    println!("\n{:<66} {:>10} {:>10} {:>8} {:>13}", "the targets' ratios", "this", "other", "÷", "min–max");
    print_rows(&ratios, 2);
    Ok(ExitCode::SUCCESS)
}

/// The command line as given, without the arguments `--compare` sets itself.
fn passed_on(given: impl Iterator<Item = OsString>) -> Vec<OsString> {
    let mut passed = Vec::new();
    let mut skip_value = false;
    for argument in given {
        if std::mem::take(&mut skip_value) {
            continue;
        }
        let text = argument.to_string_lossy();
        let own = OWN.iter().find(|(name, _)| text == *name || text.starts_with(&format!("{name}=")));
        match own {
            Some((name, takes_value)) => skip_value = *takes_value && text == *name,
            None => passed.push(argument),
        }
    }
    passed.extend(["--runs", "1", "--json"].map(OsString::from));
    passed
}

/// One run of `binary` with `arguments`: its JSON report.
async fn once(binary: &Path, arguments: &[OsString]) -> anyhow::Result<Value> {
    let output = tokio::process::Command::new(binary)
        .args(arguments)
        .stderr(std::process::Stdio::inherit())
        .output()
        .await
        .with_context(|| format!("cannot run {}", binary.display()))?;
    if !output.status.success() {
        bail!("{} {}: {}", binary.display(), shown(arguments), output.status);
    }
    serde_json::from_slice(&output.stdout)
        .with_context(|| format!("{}: its output is not idem-bench's JSON report", binary.display()))
}

fn shown(arguments: &[OsString]) -> String {
    arguments.iter().map(|a| a.to_string_lossy()).collect::<Vec<_>>().join(" ")
}

/// The entries of `list` (an array of each report) found in both binaries' reports of every round, each entry
/// named by the member `name` and valued at the path `value`.
fn compared(these: &[Value], others: &[Value], list: &str, name: &str, value: &[&str]) -> Vec<Compared> {
    let at = |report: &Value, wanted: &str| -> Option<f64> {
        let entries = report.get(list)?.as_array()?;
        let entry = entries.iter().find(|e| member(e, name).and_then(Value::as_str) == Some(wanted))?;
        value.iter().try_fold(entry, |v, step| member(v, step))?.as_f64()
    };
    let names: Vec<String> = these
        .first()
        .and_then(|r| r.get(list))
        .and_then(Value::as_array)
        .map(|entries| {
            entries.iter().filter_map(|e| member(e, name).and_then(Value::as_str).map(str::to_owned)).collect()
        })
        .unwrap_or_default();
    names
        .into_iter()
        .filter_map(|leg| {
            let this: Option<Vec<f64>> = these.iter().map(|r| at(r, &leg)).collect();
            let other: Option<Vec<f64>> = others.iter().map(|r| at(r, &leg)).collect();
            let (this, other) = (this?, other?);
            let ratios: Vec<f64> = this.iter().zip(&other).filter(|(_, o)| **o > 0.0).map(|(t, o)| t / o).collect();
            if ratios.is_empty() {
                return None;
            }
            let Spread { median, min, max } = Spread::of(&ratios);
            Some(Compared { name: leg, ratio_median: median, ratio_min: min, ratio_max: max, this, other, ratios })
        })
        .collect()
}

/// A member of an object by name, or of an array by index.
fn member<'a>(value: &'a Value, step: &str) -> Option<&'a Value> {
    match step.parse::<usize>() {
        Ok(index) => value.get(index),
        Err(_) => value.get(step),
    }
}

/// The rows of a table: each side's median with `decimals`, then the ratio's median and spread.
fn print_rows(rows: &[Compared], decimals: usize) {
    for row in rows {
        println!(
            "{:<66} {:>10.decimals$} {:>10.decimals$} {:>8.3} {:>6.3}–{:<6.3}",
            row.name,
            Spread::of(&row.this).median,
            Spread::of(&row.other).median,
            row.ratio_median,
            row.ratio_min,
            row.ratio_max
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn given(line: &str) -> Vec<String> {
        passed_on(line.split(' ').map(OsString::from)).iter().map(|a| a.to_string_lossy().into_owned()).collect()
    }

    #[test]
    fn the_arguments_compare_sets_are_taken_out_and_the_rest_passed_on() {
        assert_eq!(
            given("--compare /tmp/old --only per-event --rounds=4 --runs 3 --json --events 5000"),
            ["--only", "per-event", "--events", "5000", "--runs", "1", "--json"]
        );
        assert_eq!(given("--compare=/tmp/old --rounds 2"), ["--runs", "1", "--json"]);
    }

    #[test]
    fn each_leg_is_the_ratio_of_its_rounds() {
        let report = |a: f64, b: f64| {
            serde_json::json!({
                "legs": [{"name": "x", "runs": [a]}, {"name": "only here", "runs": [1.0]}],
                "ratios": [["r", b]],
            })
        };
        let these = [report(100.0, 1.0), report(90.0, 1.2), report(120.0, 0.9)];
        let others = [
            report(100.0, 1.0),
            report(100.0, 1.0),
            serde_json::json!({"legs": [{"name": "x", "runs": [80.0]}], "ratios": [["r", 1.0]]}),
        ];
        let legs = compared(&these, &others, "legs", "name", &["runs", "0"]);
        assert_eq!(legs.len(), 1, "a leg missing from one report is left out");
        assert_eq!(legs[0].ratios, [1.0, 0.9, 1.5]);
        assert_eq!((legs[0].ratio_median, legs[0].ratio_min, legs[0].ratio_max), (1.0, 0.9, 1.5));
        let ratios = compared(&these, &others, "ratios", "0", &["1"]);
        assert_eq!(ratios[0].ratios, [1.0, 1.2, 0.9]);
        assert_eq!(ratios[0].ratio_median, 1.0);
    }
}
