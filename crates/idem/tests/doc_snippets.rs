//! Every Rust snippet of README.md and docs/*.md has its compiled copy in `src/doc_snippets.rs` (a doc test, with
//! the lines the page leaves out hidden): a page cannot show code that does not compile, or that no longer says
//! what its copy says.

use std::path::{Path, PathBuf};

fn repository() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The ```rust blocks of a Markdown page, in order.
fn page_snippets(text: &str) -> Vec<String> {
    let mut snippets = Vec::new();
    let mut open: Option<Vec<&str>> = None;
    for line in text.lines() {
        match &mut open {
            None if line.starts_with("```rust") => open = Some(Vec::new()),
            Some(lines) if line.starts_with("```") => {
                snippets.push(lines.join("\n"));
                open = None;
            }
            Some(lines) => lines.push(line),
            None => {}
        }
    }
    snippets
}

/// The code blocks of the doc comments of `src/doc_snippets.rs`, without their hidden lines: what a reader of
/// the rendered doc test would see.
fn compiled_snippets(source: &str) -> Vec<String> {
    let mut snippets = Vec::new();
    let mut open: Option<Vec<String>> = None;
    for line in source.lines() {
        let Some(doc) = line.strip_prefix("///") else { continue };
        let doc = doc.strip_prefix(' ').unwrap_or(doc);
        match &mut open {
            None if doc.starts_with("```") => open = Some(Vec::new()),
            Some(lines) if doc.starts_with("```") => {
                snippets.push(lines.join("\n"));
                open = None;
            }
            Some(_) if doc == "#" || doc.starts_with("# ") => {}
            Some(lines) => lines.push(doc.to_owned()),
            None => {}
        }
    }
    snippets
}

#[test]
fn every_snippet_of_the_pages_is_compiled() {
    let root = repository();
    let compiled = compiled_snippets(&std::fs::read_to_string(root.join("crates/idem/src/doc_snippets.rs")).unwrap());
    let mut pages = vec![root.join("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    pages.extend(docs);
    let mut seen = 0;
    for page in &pages {
        for (n, snippet) in page_snippets(&std::fs::read_to_string(page).unwrap()).iter().enumerate() {
            seen += 1;
            assert!(
                compiled.contains(snippet),
                "{} snippet {} has no compiled copy in crates/idem/src/doc_snippets.rs (or its copy differs):\n{snippet}",
                page.display(),
                n + 1
            );
        }
    }
    assert_eq!(seen, compiled.len(), "a compiled copy whose snippet left its page: remove it from doc_snippets.rs");
}
