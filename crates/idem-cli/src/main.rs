//! The `idem` command. Everything it does is in the library ([`idem_cli::cli`]).

fn main() -> std::process::ExitCode {
    idem_cli::cli::main()
}
