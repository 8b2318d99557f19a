//! The `idem` command's pieces, shared by the `idem` binary and the benchmark (`idem-bench`): the operator
//! commands, the demo, the operations endpoint, opening a database by URL.

pub mod commands;
pub mod db;
pub mod demo;
pub mod embedded_log;
pub mod http;
pub mod inbox;

/// Where the markers live: the database URL and the table names.
#[derive(clap::Args, Clone, Debug)]
pub struct DbArgs {
    /// Database URL: postgres://user@host/db or sqlite://path.db.
    #[arg(long, env = "IDEM_DATABASE_URL")]
    pub database_url: String,
    /// PostgreSQL schema of idem's tables (`idem migrate` creates it if missing).
    #[arg(long)]
    pub schema: Option<String>,
    /// Prefix of idem's table names, so several services can share one database.
    #[arg(long, default_value = "")]
    pub table_prefix: String,
}
