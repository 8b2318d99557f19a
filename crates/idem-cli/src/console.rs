//! `idem console`: the operator console (see `idem::console`) over a database, replaying through the broker the
//! flags name; `idem console token` makes a user's token and its users-file line.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, bail};
use clap::{Args, Subcommand};
use idem::console::{ConsoleConfig, Role, Users, auth};

use crate::DbArgs;
use crate::commands::OptionalBrokerFlags;
use crate::db::Db;
use crate::with_pool;

/// `idem console`.
#[derive(Args, Debug)]
pub struct ConsoleArgs {
    #[command(subcommand)]
    command: Option<ConsoleCommand>,
    #[command(flatten)]
    serve: ServeArgs,
}

/// `idem console token`.
#[derive(Subcommand, Debug)]
enum ConsoleCommand {
    /// Make a new random token for a user: prints the token (give it to the user) and the users-file line (put it
    /// in the file `--users` names; the console keeps only the token's SHA-256).
    Token {
        /// The user's name, as the audit trail will record it.
        name: String,
        /// `viewer` (reads) or `operator` (also acts).
        #[arg(long, default_value = "viewer")]
        role: String,
    },
}

/// What `idem console` serves, where, and to whom. The database flags are `DbArgs`' own, optional here so that
/// `idem console token` needs none.
#[derive(Args, Debug)]
struct ServeArgs {
    /// Database URL: postgres://user@host/db, mysql://user@host/db or sqlite://path.db.
    #[arg(long, env = "IDEM_DATABASE_URL")]
    database_url: Option<String>,
    /// PostgreSQL schema of idem's tables.
    #[arg(long)]
    schema: Option<String>,
    /// Prefix of idem's table names, as the consumers were configured.
    #[arg(long, default_value = "")]
    table_prefix: String,
    /// Where to listen. The default keeps the console on this machine; put it behind a TLS proxy to reach it
    /// from elsewhere.
    #[arg(long, default_value = "127.0.0.1:9500")]
    listen: SocketAddr,
    /// The users file: a line per user, `NAME ROLE sha256:HEX` (see `idem console token`). Without it, the token
    /// in IDEM_CONSOLE_TOKEN signs in an operator named `operator`, and IDEM_CONSOLE_VIEWER_TOKEN a viewer.
    #[arg(long, env = "IDEM_CONSOLE_USERS")]
    users: Option<PathBuf>,
    /// Show payloads (they may hold personal data).
    #[arg(long)]
    show_payloads: bool,
    /// The console is reached through a reverse proxy (TLS): believe its `X-Forwarded-Host` (a form's origin is
    /// checked against it) and `X-Forwarded-Proto` (over https, the session cookie is `Secure`).
    #[arg(long)]
    behind_proxy: bool,
    /// Where messages say their type, part of the failure groups: `header:NAME` or `json:/POINTER`.
    #[arg(long, env = "IDEM_MESSAGE_TYPE", value_name = "WHERE")]
    message_type: Option<String>,
    /// Where replays go (at most one broker; without one, replays are refused and everything else works).
    #[command(flatten)]
    to: OptionalBrokerFlags,
}

/// Runs `idem console`.
pub async fn run(args: ConsoleArgs) -> anyhow::Result<ExitCode> {
    if let Some(ConsoleCommand::Token { name, role }) = args.command {
        let role = Role::parse(&role).map_err(|e| anyhow::anyhow!("--{e}"))?;
        if name.split_whitespace().count() != 1 {
            bail!("NAME `{name}`: one word, without spaces (it is a field of the users file)");
        }
        let token = auth::new_token();
        println!("token: {token}");
        println!("users-file line: {name} {} {}", role.as_str(), auth::token_line_hash(&token));
        return Ok(ExitCode::SUCCESS);
    }
    let serve = args.serve;
    let Some(database_url) = serve.database_url else {
        bail!("--database-url: the console needs the database the consumers use (or IDEM_DATABASE_URL)");
    };
    let db_args = DbArgs { database_url, schema: serve.schema, table_prefix: serve.table_prefix };
    let users = users(serve.users.as_deref())?;
    let config = ConsoleConfig {
        show_payloads: serve.show_payloads,
        behind_proxy: serve.behind_proxy,
        message_type: serve.message_type,
        ..ConsoleConfig::new(users)
    };
    let target = serve.to.target()?;
    let (db, tables) = Db::open_with(&db_args, "dead_letters").await?;
    let publisher = match target {
        Some(target) => Some(target.publisher().await?),
        None => None,
    };
    let bound = with_pool!(&db, pool =>
        idem::console::serve(serve.listen, pool.clone(), tables.clone(), publisher, config).await?);
    eprintln!("idem console: http://{bound}/ (sign in with a token; Ctrl-C stops it)");
    crate::signals::Signals::install()?.received().await;
    Ok(ExitCode::SUCCESS)
}

/// The users: from the file, else from the environment's tokens; none is refused (`idem console` and `idem run`'s
/// `[console]`).
pub fn users(file: Option<&std::path::Path>) -> anyhow::Result<Users> {
    if let Some(path) = file {
        return Users::from_file(path).with_context(|| format!("--users {}", path.display()));
    }
    let mut users = Users::new();
    for (var, name, role) in
        [("IDEM_CONSOLE_TOKEN", "operator", Role::Operator), ("IDEM_CONSOLE_VIEWER_TOKEN", "viewer", Role::Viewer)]
    {
        if let Ok(token) = std::env::var(var) {
            if token.trim().len() < 16 {
                bail!("{var}: a token of at least 16 characters (idem console token NAME makes one)");
            }
            users = users.with_token(name, role, token.trim());
        }
    }
    if users.is_empty() {
        bail!(
            "the console needs users: --users FILE (lines `NAME ROLE sha256:HEX`; `idem console token NAME --role \
             operator` makes one), or a token in IDEM_CONSOLE_TOKEN"
        );
    }
    Ok(users)
}
