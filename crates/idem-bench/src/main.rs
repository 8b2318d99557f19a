//! `idem-bench`: the benchmark, kept out of the `idem` binary so that a user who installs idem carries no
//! pgbench or Python drivers. `bench/run.sh` runs it with everything it needs; see bench/README.md.

mod bench;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// idem beside PostgreSQL's own limit and a reference handler in Python (see bench/README.md).
#[derive(Parser)]
#[command(name = "idem-bench", version, about, long_about = None, args_conflicts_with_subcommands = true)]
struct Cli {
    #[command(flatten)]
    bench: bench::BenchArgs,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Hidden: the Kafka leg's consumer, in a process of its own so that its memory can be sampled.
    #[command(hide = true)]
    Consume(bench::ConsumeArgs),
}

fn main() -> ExitCode {
    tracing_subscriber::fmt().with_max_level(tracing::Level::WARN).with_writer(std::io::stderr).init();
    let cli = Cli::parse();
    idem_cli::run_to_exit(
        async {
            match cli.command {
                Some(Command::Consume(args)) => bench::consume(args).await,
                None => bench::run(cli.bench).await,
            }
        },
        |_| None,
        false,
    )
}
