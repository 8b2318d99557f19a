//! `IDEM_…__…` environment variables: each replaces (or adds) one key of the configuration file, so one file
//! serves several environments (`IDEM_DATABASE__CONNECTIONS=40`, `IDEM_CONSUMER__LEDGER__BATCH_SIZE=500`).
//!
//! The name after `IDEM_` is the key path, its parts separated by `__` and written in any case; under `CONSUMER`
//! the next part is the consumer's name (a `-` in it written `_`). The value is read as a TOML value (`500`,
//! `true`, `["a", "b"]`, `"123"` for a string of digits) and taken as a plain string when it is none (`8d`,
//! `0.0.0.0:9464`). What each event does (`effect`, `bulk`, `emit`, `params`) stays in the file. An override goes
//! through every check a value in the file goes through; its problems name the variable.

use std::borrow::Cow;
use std::path::Path;

use toml::Spanned;
use toml::de::{DeTable, DeValue};

/// The sections a key path starts with.
const SECTIONS: [&str; 4] = ["database", "operations", "consumer", "console"];

/// Variables that start like a section's keys but are settings of their own, not overrides.
const NOT_OVERRIDES: [&str; 4] =
    ["IDEM_DATABASE_URL", "IDEM_CONSOLE_TOKEN", "IDEM_CONSOLE_VIEWER_TOKEN", "IDEM_CONSOLE_USERS"];

/// A consumer's keys that declare what each event does: the program, not its environment.
const PROGRAM: [&str; 4] = ["effect", "bulk", "emit", "params"];

/// One `IDEM_…__…` variable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Override {
    /// The variable's name.
    pub var: String,
    /// The key path it names, lower-cased (empty when the name is no key path).
    path: Vec<String>,
    /// Its value as set.
    raw: String,
}

impl Override {
    /// The overrides among `vars`, in name order: each `IDEM_` variable (any case) whose name holds `__`, and
    /// each that starts like one (`IDEM_DATABASE_…`) but is not, so that a misspelt separator is named rather
    /// than ignored. `IDEM_DATABASE_URL`, when set, takes the place of an override of `database.url`.
    pub fn from_vars(vars: impl IntoIterator<Item = (String, String)>) -> Vec<Override> {
        let vars: Vec<(String, String)> = vars.into_iter().collect();
        let whole_url = vars.iter().any(|(k, _)| k == "IDEM_DATABASE_URL");
        let mut found: Vec<Override> = vars
            .into_iter()
            .filter_map(|(var, raw)| {
                let rest = var.get(..5).filter(|p| p.eq_ignore_ascii_case("IDEM_")).and(var.get(5..))?;
                let lower = rest.to_ascii_lowercase();
                let path: Vec<String> = if lower.contains("__") {
                    lower.split("__").map(str::to_owned).collect()
                } else if !NOT_OVERRIDES.contains(&var.as_str())
                    && SECTIONS.iter().any(|s| lower == *s || lower.starts_with(&format!("{s}_")))
                {
                    Vec::new()
                } else {
                    return None;
                };
                Some(Override { path, var, raw })
            })
            .filter(|o| !(whole_url && o.path == ["database", "url"]))
            .collect();
        found.sort_by(|a, b| a.var.cmp(&b.var));
        found
    }

    /// The overrides in this process's environment.
    pub fn from_env() -> Vec<Override> {
        Override::from_vars(
            std::env::vars_os().filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?))),
        )
    }

    /// The line standing for this override in the configuration's text (its value on one line).
    pub fn line(&self) -> String {
        format!("{}={}", self.var, self.raw.replace(['\n', '\r'], " "))
    }

    /// Sets this override's key in `root`; `span` is where its line is in the configuration's text. Returns the
    /// key as problems name it (`database.connections`, ``consumer `ledger`.batch_size``).
    pub fn apply<'i>(&'i self, root: &mut DeTable<'i>, span: std::ops::Range<usize>) -> Result<String, String> {
        if self.raw.contains(['\n', '\r', '\0']) {
            return Err("holds a line break or a NUL: a value from the environment is one line".to_owned());
        }
        let mut value = DeValue::parse(&self.raw)
            .map(|v| v.into_inner())
            .unwrap_or_else(|_| DeValue::String(Cow::Borrowed(self.raw.as_str())));
        respan_inside(&mut value, &span);
        let (last, parents) = match self.path.split_last() {
            Some((last, parents)) if !parents.is_empty() => (last, parents),
            _ => return Err(self.malformed()),
        };
        let in_consumer = parents[0] == "consumer";
        // The parts that are keys (a consumer's name is not one).
        let keys: Vec<&String> = match in_consumer {
            true => parents.iter().skip(2).chain([last]).collect(),
            false => parents.iter().chain([last]).collect(),
        };
        if in_consumer && parents.len() < 2 {
            return Err("names a consumer but none of its keys: add one, e.g. IDEM_CONSUMER__LEDGER__BATCH_SIZE".into());
        }
        if keys.iter().any(|k| k.is_empty() || k.starts_with('_') || k.ends_with('_')) {
            return Err(self.malformed());
        }
        if in_consumer && let Some(program) = keys.iter().find(|k| PROGRAM.contains(&k.as_str())) {
            return Err(format!(
                "`{program}` declares what each event does: it stays in the file, so the file says what runs; \
                 override the values around it (a source, batch_size, marker_retention, …)"
            ));
        }
        let (mut table, parents, mut shown) = match parents {
            [_, name, rest @ ..] if in_consumer => {
                let (table, real) = self.consumer(root, name)?;
                (table, rest, format!("consumer `{real}`"))
            }
            _ => (root, parents, String::new()),
        };
        for part in parents {
            if !shown.is_empty() {
                shown.push('.');
            }
            shown.push_str(part);
            table = child_table(table, part, &span)
                .ok_or_else(|| format!("`{part}` is not a table in the file, so it has no keys to set"))?;
        }
        shown.push('.');
        shown.push_str(last);
        table.insert(Spanned::new(span.clone(), Cow::Borrowed(last.as_str())), Spanned::new(span, value));
        Ok(shown)
    }

    /// The table of the `[[consumer]]` whose name is `name` (compared lower-cased, `-` as `_`), and its name.
    fn consumer<'t, 'i>(
        &self,
        table: &'t mut DeTable<'i>,
        name: &str,
    ) -> Result<(&'t mut DeTable<'i>, String), String> {
        let consumers = match table.get_mut("consumer").map(Spanned::get_mut) {
            Some(DeValue::Array(consumers)) => consumers,
            _ => return Err("the file declares no [[consumer]] to set a key of".to_owned()),
        };
        let name_of = |c: &Spanned<DeValue<'_>>| -> Option<String> {
            Some(c.get_ref().as_table()?.get("name")?.get_ref().as_str()?.to_owned())
        };
        let normal = |n: &str| n.to_ascii_lowercase().replace('-', "_");
        let names: Vec<String> = consumers.iter().filter_map(name_of).collect();
        let matching: Vec<usize> = consumers
            .iter()
            .enumerate()
            .filter(|(_, c)| name_of(c).is_some_and(|n| normal(&n) == normal(name)))
            .map(|(i, _)| i)
            .collect();
        // Among names that differ only by `-` and `_`, the one written exactly is meant.
        let exact: Vec<usize> = matching
            .iter()
            .copied()
            .filter(|&i| name_of(&consumers[i]).is_some_and(|n| n.eq_ignore_ascii_case(name)))
            .collect();
        let matching = if matching.len() > 1 && exact.len() == 1 { exact } else { matching };
        match matching.as_slice() {
            [one] => {
                let real = name_of(&consumers[*one]).unwrap_or_default();
                match consumers.get_mut(*one).map(Spanned::get_mut) {
                    Some(DeValue::Table(consumer)) => Ok((consumer, real)),
                    _ => Err(format!("the consumer `{real}` is not a table")),
                }
            }
            [] => Err(format!(
                "no consumer is named `{name}` (the file's consumers: {}); after IDEM_CONSUMER__ comes a \
                 consumer's name, `-` written `_`",
                names.join(", ")
            )),
            _ => Err(format!(
                "`{name}` names {} consumers ({}), which differ only by `-` and `_`: rename one of them",
                matching.len(),
                matching.iter().filter_map(|&i| name_of(&consumers[i])).collect::<Vec<_>>().join(", ")
            )),
        }
    }

    fn malformed(&self) -> String {
        "is no key path: parts are joined by `__` (two underscores): IDEM_DATABASE__CONNECTIONS, \
         IDEM_CONSUMER__LEDGER__BATCH_SIZE"
            .to_owned()
    }
}

/// The table under `key` in `table`, made when missing; `None` when `key` holds something else.
fn child_table<'t, 'i>(
    table: &'t mut DeTable<'i>,
    key: &'i str,
    span: &std::ops::Range<usize>,
) -> Option<&'t mut DeTable<'i>> {
    if table.get(key).is_none() {
        let made = Spanned::new(span.clone(), DeValue::Table(DeTable::new()));
        table.insert(Spanned::new(span.clone(), Cow::Borrowed(key)), made);
    }
    match table.get_mut(key).map(Spanned::get_mut) {
        Some(DeValue::Table(child)) => Some(child),
        _ => None,
    }
}

/// Gives every value inside `value` the override's span, so a problem deep in an array names the variable.
fn respan_inside(value: &mut DeValue<'_>, span: &std::ops::Range<usize>) {
    let respan = |v: &mut Spanned<DeValue<'_>>| {
        let mut inner = std::mem::replace(v.get_mut(), DeValue::Boolean(false));
        respan_inside(&mut inner, span);
        *v = Spanned::new(span.clone(), inner);
    };
    match value {
        DeValue::Array(items) => items.iter_mut().for_each(respan),
        DeValue::Table(table) => table.iter_mut().for_each(|(_, v)| respan(v)),
        _ => {}
    }
}

/// Where each line of the configuration's text came from: the file, or (past the file's last line) an override;
/// and which key each override set, so that a problem found later at a file's line names the variable behind it.
#[derive(Debug, Clone, Default)]
pub struct Origins {
    /// Lines of the file.
    pub file_lines: usize,
    /// The overrides' variables, one line each after the file's.
    pub vars: Vec<String>,
    /// The key each override set, as problems name keys.
    pub keys: Vec<String>,
}

impl Origins {
    /// Where `problem` is: `idem.toml:17`, `environment IDEM_CONSUMER__LEDGER__BATCH_SIZE` for an override's line,
    /// or `idem.toml:8 (with IDEM_CONSUMER__LEDGER__EMBEDDED__TOPICS)` when an override set a key the problem is
    /// about.
    pub fn place(&self, path: &Path, problem: &super::file::Problem) -> String {
        if let Some(line) = problem.line
            && line > self.file_lines
            && let Some(var) = self.vars.get(line - self.file_lines - 1)
        {
            return format!("environment {var}");
        }
        let at = match problem.line {
            Some(line) => format!("{}:{line}", path.display()),
            None => path.display().to_string(),
        };
        let behind: Vec<&str> = self
            .vars
            .iter()
            .zip(&self.keys)
            .filter(|(_, key)| concerns(&problem.key, &problem.message, key))
            .map(|(var, _)| var.as_str())
            .collect();
        match behind.as_slice() {
            [] => at,
            vars => format!("{at} (with {} from the environment)", vars.join(", ")),
        }
    }

    /// The variable that set `key`, if one did.
    pub fn var_of(&self, key: &str) -> Option<&str> {
        self.vars.iter().zip(&self.keys).find(|(_, k)| *k == key).map(|(v, _)| v.as_str())
    }
}

/// Whether a problem (its key and message) may come from the override of `key`: both in one section (or one
/// consumer), and the problem is about the whole of it, about a table the override is in, or names its key.
fn concerns(problem_key: &str, message: &str, key: &str) -> bool {
    let split = |k: &str| -> (String, String) {
        match k.strip_prefix("consumer `").and_then(|r| r.split_once('`')) {
            Some((name, rest)) => (format!("consumer `{name}`"), rest.trim_start_matches('.').to_owned()),
            None => match k.split_once('.') {
                Some((head, rest)) => (head.to_owned(), rest.to_owned()),
                None => (k.to_owned(), String::new()),
            },
        }
    };
    let (head, rest) = split(problem_key);
    let (their_head, their_rest) = split(key);
    let last = their_rest.rsplit('.').next().unwrap_or_default();
    let names = |text: &str| text.split(|c: char| !(c.is_alphanumeric() || c == '_')).any(|w| w == last);
    head == their_head
        && (rest.is_empty()
            || their_rest == rest
            || their_rest.starts_with(&format!("{rest}."))
            || names(&rest)
            || names(message))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> Vec<Override> {
        Override::from_vars(pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())))
    }

    #[test]
    fn only_idem_variables_with_a_key_path_are_overrides() {
        let found = vars(&[
            ("IDEM_DATABASE_URL", "x"),
            ("IDEM_LOG", "debug"),
            ("PATH", "/bin"),
            ("IDEM_DATABASE__CONNECTIONS", "40"),
            ("IDEM_CONSUMER__LEDGER__BATCH_SIZE", "500"),
        ]);
        let names: Vec<&str> = found.iter().map(|o| o.var.as_str()).collect();
        assert_eq!(names, ["IDEM_CONSUMER__LEDGER__BATCH_SIZE", "IDEM_DATABASE__CONNECTIONS"]);
        assert_eq!(found[0].path, ["consumer", "ledger", "batch_size"]);
    }

    #[test]
    fn a_value_is_toml_when_it_parses_and_a_string_otherwise() {
        let text = "[[consumer]]\nname = \"my-ledger\"\nbatch_size = 100\n";
        let set = vars(&[
            ("IDEM_CONSUMER__MY_LEDGER__BATCH_SIZE", "500"),
            ("IDEM_CONSUMER__MY_LEDGER__MARKER_RETENTION", "8d"),
            ("IDEM_OPERATIONS__LISTEN", "0.0.0.0:9464"),
        ]);
        let mut root = DeTable::parse(text).expect("parses").into_inner();
        for (i, o) in set.iter().enumerate() {
            o.apply(&mut root, 100 + i..101 + i).expect("applies");
        }
        let consumer = root["consumer"].get_ref().as_array().expect("array")[0].get_ref().as_table().expect("table");
        assert!(matches!(consumer["batch_size"].get_ref(), DeValue::Integer(_)));
        assert_eq!(consumer["batch_size"].span(), 100..101);
        assert_eq!(consumer["marker_retention"].get_ref().as_str(), Some("8d"));
        let operations = root["operations"].get_ref().as_table().expect("made");
        assert_eq!(operations["listen"].get_ref().as_str(), Some("0.0.0.0:9464"));
    }

    #[test]
    fn an_unknown_consumer_and_a_path_through_a_value_are_refused_by_name() {
        let text = "[database]\nurl = \"sqlite://x\"\n[[consumer]]\nname = \"ledger\"\n";
        let mut root = DeTable::parse(text).expect("parses").into_inner();
        let set = vars(&[("IDEM_CONSUMER__LEGDER__BATCH_SIZE", "5")]);
        let err = set[0].apply(&mut root, 0..1).expect_err("refused");
        assert!(err.contains("no consumer is named `legder` (the file's consumers: ledger)"), "{err}");
        let set = vars(&[("IDEM_DATABASE__URL__HOST", "x")]);
        let err = set[0].apply(&mut root, 0..1).expect_err("refused");
        assert!(err.contains("`url` is not a table"), "{err}");
        let set = vars(&[("IDEM_DATABASE__", "x")]);
        assert!(set[0].apply(&mut root, 0..1).expect_err("refused").contains("is no key path"));
    }

    #[test]
    fn a_problem_is_placed_at_the_variable_behind_it() {
        use super::super::file::Problem;
        let origins = Origins {
            file_lines: 10,
            vars: vec!["IDEM_A__B".into(), "IDEM_CONSUMER__L__EMBEDDED__TOPICS".into()],
            keys: vec!["database.connections".into(), "consumer `l`.embedded.topics".into()],
        };
        let at = |line: Option<usize>, key: &str, message: &str| {
            origins.place(Path::new("idem.toml"), &Problem { line, key: key.into(), message: message.into() })
        };
        assert_eq!(at(Some(4), "database.url", "bad"), "idem.toml:4");
        assert_eq!(at(Some(11), "", "bad"), "environment IDEM_A__B");
        assert_eq!(at(Some(2), "database.connections", "0"), "idem.toml:2 (with IDEM_A__B from the environment)");
        assert_eq!(
            at(Some(8), "consumer `l`.embedded", "the topic `x` does not exist"),
            "idem.toml:8 (with IDEM_CONSUMER__L__EMBEDDED__TOPICS from the environment)"
        );
        assert_eq!(at(Some(8), "consumer `other`.embedded", "no topics"), "idem.toml:8");
    }

    #[test]
    fn line_breaks_the_program_and_ambiguous_names_are_refused() {
        let text = "[[consumer]]\nname = \"a-b\"\n[[consumer]]\nname = \"a_b\"\n[[consumer]]\nname = \"x-y_z\"\n\
                    [[consumer]]\nname = \"x_y-z\"\n";
        let cases = [
            ("IDEM_CONSUMER__A_B__GROUP", "x\ny", "line break"),
            ("IDEM_CONSUMER__A_B__EFFECT", "[]", "stays in the file"),
            ("IDEM_CONSUMER__X_Y_Z__BATCH_SIZE", "5", "names 2 consumers (x-y_z, x_y-z)"),
            ("IDEM__DATABASE__URL", "x", "is no key path"),
            ("IDEM_DATABASE_CONNECTIONS", "5", "is no key path"),
        ];
        let overrides: Vec<Override> =
            cases.iter().map(|(var, value, _)| vars(&[(var, value)]).pop().expect("an override")).collect();
        let mut root = DeTable::parse(text).expect("parses").into_inner();
        for (o, (_, _, expected)) in overrides.iter().zip(cases) {
            let err = o.apply(&mut root, 0..1).expect_err("refused");
            assert!(err.contains(expected), "{}: {err}", o.var);
        }
        // The name written exactly is meant.
        let exact = vars(&[("IDEM_CONSUMER__A_B__BATCH_SIZE", "5")]);
        let mut root = DeTable::parse(text).expect("parses").into_inner();
        assert_eq!(exact[0].apply(&mut root, 0..1).as_deref(), Ok("consumer `a_b`.batch_size"));
        assert!(vars(&[("IDEM_DATABASE_URL", "x"), ("IDEM_DATABASE__URL", "y")]).is_empty(), "the whole URL wins");
        assert_eq!(vars(&[("idem_database__connections", "5")]).len(), 1, "any case");
    }
}
