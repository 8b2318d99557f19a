//! Effects written as SQL with named parameters (`:amount`), rewritten to the database's numbered placeholders.
//!
//! Values are always bound, never spliced into the text: the rewrite only replaces each `:name` outside string
//! literals, quoted identifiers (`"…"` and MySQL's backticks), comments and dollar-quoted bodies with `$n`
//! (MySQL: `?`, one per use; wrapped in a `CAST` where the parameter's declared type needs one), and binds the
//! event's value as that argument.

use super::value::ParamType;

/// A piece of a statement: text kept as written, or a parameter by name.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Piece {
    Text(String),
    Param(String),
}

/// A statement split at its named parameters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamedSql {
    pieces: Vec<Piece>,
}

/// The database a statement is rendered for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    /// PostgreSQL: typed casts, arrays for the bulk form.
    Postgres,
    /// SQLite.
    Sqlite,
    /// MySQL and MariaDB: `?` placeholders, bound in order of appearance.
    Mysql,
}

impl Dialect {
    /// The database's name, for messages.
    pub fn name(self) -> &'static str {
        match self {
            Dialect::Postgres => "PostgreSQL",
            Dialect::Sqlite => "SQLite",
            Dialect::Mysql => "MySQL",
        }
    }
}

/// A statement ready to run: its text with numbered placeholders, and which declared parameter each binds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rendered {
    /// The SQL text with `$1`, `$2`, … (MySQL: `?`)
    pub text: String,
    /// For each placeholder, in order, the index of the parameter among those declared (on MySQL, one entry per
    /// use: a parameter used twice is bound twice).
    pub binds: Vec<usize>,
}

impl NamedSql {
    /// Splits `sql` at its `:name` parameters. `$1`-style placeholders are refused (their meaning would depend on
    /// an order the file does not show), as is a quote or comment left open.
    pub fn parse(sql: &str) -> Result<Self, String> {
        let chars: Vec<char> = sql.chars().collect();
        let mut pieces = Vec::new();
        let mut text = String::new();
        let mut i = 0;
        let until = |from: usize, end: &[char]| -> Option<usize> {
            (from..=chars.len().saturating_sub(end.len())).find(|&j| chars[j..].starts_with(end))
        };
        while i < chars.len() {
            let c = chars[i];
            let next = chars.get(i + 1).copied();
            let skip_to = match (c, next) {
                ('\'', _) | ('"', _) | ('`', _) => {
                    Some(until(i + 1, &[c]).ok_or_else(|| format!("a {c} quote is not closed"))? + 1)
                }
                ('-', Some('-')) => Some(until(i, &['\n']).unwrap_or(chars.len())),
                ('/', Some('*')) => Some(until(i + 2, &['*', '/']).ok_or("a /* comment is not closed")? + 2),
                ('$', Some(d)) if d.is_ascii_digit() => {
                    return Err(format!(
                        "`${d}`: write named parameters (`:amount`), declared under the consumer's params, not numbered ones"
                    ));
                }
                ('$', _) => dollar_quote(&chars, i)?,
                (':', Some(':')) => Some(i + 2),
                (':', Some(n)) if n.is_ascii_alphabetic() || n == '_' => {
                    let end = (i + 1..chars.len())
                        .find(|&j| !(chars[j].is_ascii_alphanumeric() || chars[j] == '_'))
                        .unwrap_or(chars.len());
                    if !text.is_empty() {
                        pieces.push(Piece::Text(std::mem::take(&mut text)));
                    }
                    pieces.push(Piece::Param(chars[i + 1..end].iter().collect()));
                    i = end;
                    continue;
                }
                _ => None,
            };
            let end = skip_to.unwrap_or(i + 1);
            text.extend(&chars[i..end]);
            i = end;
        }
        if !text.is_empty() {
            pieces.push(Piece::Text(text));
        }
        Ok(NamedSql { pieces })
    }

    /// The parameter names the statement uses, in order of first use.
    pub fn names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = Vec::new();
        for piece in &self.pieces {
            if let Piece::Param(name) = piece
                && !names.contains(&name.as_str())
            {
                names.push(name);
            }
        }
        names
    }

    /// Renders the statement for `dialect`: each name becomes the placeholder of its first use, cast to its
    /// declared type (`array`: the bulk form, each parameter an array). `declared` lists the parameters by name
    /// and type; a name that is not among them is an error naming it.
    pub fn render(&self, dialect: Dialect, declared: &[(&str, ParamType)], array: bool) -> Result<Rendered, String> {
        let mut text = String::new();
        let mut binds: Vec<usize> = Vec::new();
        for piece in &self.pieces {
            match piece {
                Piece::Text(t) => text.push_str(t),
                Piece::Param(name) => {
                    let Some(index) = declared.iter().position(|(n, _)| n == name) else {
                        let known: Vec<&str> = declared.iter().map(|(n, _)| *n).collect();
                        return Err(format!(
                            "`:{name}` names no parameter: declare it under the consumer's params (declared: {})",
                            if known.is_empty() { "none".to_owned() } else { known.join(", ") }
                        ));
                    };
                    let number = match binds.iter().position(|&b| b == index) {
                        Some(p) if dialect != Dialect::Mysql => p + 1,
                        _ => {
                            binds.push(index);
                            binds.len()
                        }
                    };
                    text.push_str(&placeholder(dialect, declared[index].1, array, number));
                }
            }
        }
        Ok(Rendered { text, binds })
    }
}

/// `$n`, cast to its declared type on PostgreSQL (so the statement prepares on its own, arrays in `UNNEST`
/// included), and on SQLite where the bound value (an integer, a boolean or text) is not already of that type.
fn placeholder(dialect: Dialect, ty: ParamType, array: bool, n: usize) -> String {
    let cast = match (dialect, ty) {
        (Dialect::Postgres, ParamType::Integer) => Some("bigint"),
        (Dialect::Postgres, ParamType::Text) => Some("text"),
        (Dialect::Postgres, ParamType::Boolean) => Some("boolean"),
        (Dialect::Postgres, ParamType::Numeric) => Some("numeric"),
        (Dialect::Postgres, ParamType::Timestamp) => Some("timestamptz"),
        (Dialect::Postgres, ParamType::Uuid) => Some("uuid"),
        (Dialect::Postgres, ParamType::Json) => Some("jsonb"),
        (Dialect::Sqlite, ParamType::Numeric) => Some("NUMERIC"),
        (Dialect::Mysql, ParamType::Numeric) => Some("DECIMAL(65, 30)"),
        (Dialect::Mysql, ParamType::Timestamp) => Some("DATETIME(6)"),
        _ => None,
    };
    if dialect == Dialect::Mysql {
        return cast.map_or_else(|| "?".to_owned(), |t| format!("CAST(? AS {t})"));
    }
    match (cast, array) {
        (Some(t), true) => format!("CAST(${n} AS {t}[])"),
        (Some(t), false) => format!("CAST(${n} AS {t})"),
        (None, _) => format!("${n}"),
    }
}

/// At a `$`: the end of a dollar-quoted body (`$$…$$`, `$tag$…$tag$`), or `None` when the `$` starts none.
fn dollar_quote(chars: &[char], start: usize) -> Result<Option<usize>, String> {
    let tag_end = (start + 1..chars.len()).find(|&j| !(chars[j].is_ascii_alphanumeric() || chars[j] == '_'));
    let Some(tag_end) = tag_end.filter(|&j| chars[j] == '$') else {
        return Ok(None);
    };
    let tag = &chars[start..=tag_end];
    let body = tag_end + 1;
    let close = (body..=chars.len().saturating_sub(tag.len()))
        .find(|&j| chars[j..].starts_with(tag))
        .ok_or_else(|| format!("the dollar quote {} is not closed", tag.iter().collect::<String>()))?;
    Ok(Some(close + tag.len()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pg(sql: &str, declared: &[(&str, ParamType)]) -> Rendered {
        NamedSql::parse(sql).and_then(|s| s.render(Dialect::Postgres, declared, false)).expect("renders")
    }

    #[test]
    fn names_become_numbered_placeholders_in_order_of_first_use() {
        let r = pg(
            "UPDATE accounts SET balance = balance + :amount WHERE id = :account AND :amount > 0",
            &[("account", ParamType::Integer), ("amount", ParamType::Numeric)],
        );
        assert_eq!(
            r.text,
            "UPDATE accounts SET balance = balance + CAST($1 AS numeric) WHERE id = CAST($2 AS bigint) AND CAST($1 AS numeric) > 0"
        );
        assert_eq!(r.binds, vec![1, 0]);
    }

    #[test]
    fn quotes_comments_casts_and_dollar_bodies_are_left_alone() {
        let sql = "SELECT ':a', \":a\", x::text, $f$ :a $f$, :a -- :a\n/* :a */";
        let r = pg(sql, &[("a", ParamType::Text)]);
        assert_eq!(r.text, "SELECT ':a', \":a\", x::text, $f$ :a $f$, CAST($1 AS text) -- :a\n/* :a */");
        assert_eq!(r.binds, vec![0]);
    }

    #[test]
    fn a_doubled_quote_stays_inside_its_literal() {
        let r = pg("SELECT 'it''s :a', :a", &[("a", ParamType::Integer)]);
        assert_eq!(r.text, "SELECT 'it''s :a', CAST($1 AS bigint)");
    }

    #[test]
    fn unknown_names_numbered_placeholders_and_open_quotes_are_refused() {
        let unknown = NamedSql::parse("SELECT :nope").and_then(|s| s.render(Dialect::Postgres, &[], false));
        assert!(unknown.expect_err("refused").contains("`:nope` names no parameter"));
        assert!(NamedSql::parse("SELECT $1").expect_err("refused").contains("named parameters"));
        assert!(NamedSql::parse("SELECT 'open").expect_err("refused").contains("not closed"));
        assert!(NamedSql::parse("SELECT $q$ open").expect_err("refused").contains("not closed"));
    }

    #[test]
    fn mysql_binds_each_use_in_order_and_leaves_backticks_alone() {
        let r = NamedSql::parse("UPDATE `a:b` SET balance = balance + :amount WHERE id = :account AND :amount > 0")
            .and_then(|s| {
                s.render(Dialect::Mysql, &[("account", ParamType::Integer), ("amount", ParamType::Numeric)], false)
            })
            .expect("renders");
        assert_eq!(
            r.text,
            "UPDATE `a:b` SET balance = balance + CAST(? AS DECIMAL(65, 30)) WHERE id = ? AND CAST(? AS DECIMAL(65, 30)) > 0"
        );
        assert_eq!(r.binds, vec![1, 0, 1]);
    }

    #[test]
    fn the_bulk_form_casts_to_arrays() {
        let r = NamedSql::parse("SELECT * FROM UNNEST(:id, :at)")
            .and_then(|s| s.render(Dialect::Postgres, &[("id", ParamType::Uuid), ("at", ParamType::Integer)], true))
            .expect("renders");
        assert_eq!(r.text, "SELECT * FROM UNNEST(CAST($1 AS uuid[]), CAST($2 AS bigint[]))");
    }
}
