//! Every TOML example of README.md and docs/*.md is read as idem reads it: a whole `idem run` file (one with a
//! `[database]`) passes `idem check --offline`; a fragment of one, added to the README's file, parses with every
//! key known and every value of its type; a Sequential Inbox file is a valid `InboxConfig`.

use std::path::{Path, PathBuf};
use std::process::Command;

use idem_cli::service::file::{Text, parse};

fn repository() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The ```toml blocks of a Markdown page, with the line each starts on.
fn toml_blocks(text: &str) -> Vec<(usize, String)> {
    let mut blocks = Vec::new();
    let mut open: Option<(usize, Vec<&str>)> = None;
    for (n, line) in text.lines().enumerate() {
        match &mut open {
            None if line.starts_with("```toml") => open = Some((n + 1, Vec::new())),
            Some((start, lines)) if line.starts_with("```") => {
                blocks.push((*start, lines.join("\n")));
                open = None;
            }
            Some((_, lines)) => lines.push(line),
            None => {}
        }
    }
    blocks
}

#[test]
fn every_toml_example_is_read_as_idem_reads_it() {
    let root = repository();
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let base =
        toml_blocks(&readme).into_iter().map(|(_, b)| b).find(|b| b.contains("[database]")).expect("README's file");
    let dir = std::env::temp_dir().join(format!("idem-doc-configs-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut pages = vec![root.join("README.md")];
    pages.extend(
        std::fs::read_dir(root.join("docs"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "md")),
    );
    let mut checked = 0;
    for page in &pages {
        for (line, block) in toml_blocks(&std::fs::read_to_string(page).unwrap()) {
            let at = format!("{}:{line}", page.display());
            checked += 1;
            if page.ends_with("docs/sequential-inbox.md") {
                idem::inbox::InboxConfig::from_toml(&block).unwrap_or_else(|e| panic!("{at}: {e}"));
            } else if block.contains("[database]") {
                let file = dir.join(format!("example-{checked}.toml"));
                std::fs::write(&file, &block).unwrap();
                let out = Command::new(env!("CARGO_BIN_EXE_idem"))
                    .args(["check", "--offline", "--config"])
                    .arg(&file)
                    .env_remove("IDEM_DATABASE_URL")
                    .output()
                    .unwrap();
                assert!(out.status.success(), "{at}: {}", String::from_utf8_lossy(&out.stderr));
            } else {
                let mut text = Text::new(format!("{base}\n\n{block}\n"), Vec::new());
                if let Err(problem) = parse(&mut text) {
                    panic!("{at}: {problem:?}\n{block}");
                }
            }
        }
    }
    assert!(checked >= 7, "only {checked} TOML examples found");
    let _ = std::fs::remove_dir_all(&dir);
}
