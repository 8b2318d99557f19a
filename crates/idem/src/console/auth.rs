//! Who may use the console, and how each request proves it.
//!
//! Users are names with a role and the SHA-256 of a secret token; the console never holds a token itself. The
//! JSON API takes `Authorization: Bearer TOKEN` and nothing else (no cookie), so a cross-site request carries no
//! credential. The page signs in with the token once and gets a session cookie (`HttpOnly`, `SameSite=Strict`);
//! every form it serves carries the session's CSRF token, and a form posted without it is refused.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use sha2::Digest;

use crate::error::Error;

/// What a user may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Reads everything the console shows.
    Viewer,
    /// Also acts: replay, discard, (later) edit, resume, requeue, release.
    Operator,
}

impl Role {
    /// `viewer` or `operator`.
    pub fn parse(text: &str) -> Result<Role, String> {
        match text.trim() {
            "viewer" => Ok(Role::Viewer),
            "operator" => Ok(Role::Operator),
            other => Err(format!("role `{other}`: write `viewer` or `operator`")),
        }
    }

    /// The role's name.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Viewer => "viewer",
            Role::Operator => "operator",
        }
    }
}

/// A signed-in user.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct User {
    /// The name the audit trail records.
    pub name: String,
    /// What the user may do.
    pub role: Role,
}

/// The console's users: each a name, a role and the SHA-256 of a token. Read from a file
/// ([`Users::from_file`]), they follow it: a change to the file is read at the next request, and a file that no
/// longer reads (or names no user) is refused with a logged error, the users read before staying.
#[derive(Debug, Clone, Default)]
pub struct Users {
    entries: Entries,
    file: Option<Arc<UsersFile>>,
}

/// Each user with the SHA-256 of their token.
type Entries = Vec<(User, [u8; 32])>;

/// The file users come from, and what was last read from it.
#[derive(Debug)]
struct UsersFile {
    path: PathBuf,
    read: Mutex<(Option<SystemTime>, Entries)>,
}

/// When the file at `path` was last changed.
fn modified(path: &Path) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

impl Users {
    /// No users (a console with none refuses to start).
    pub fn new() -> Users {
        Users::default()
    }

    /// Adds a user whose token is `token`.
    pub fn with_token(mut self, name: &str, role: Role, token: &str) -> Users {
        self.entries.push((User { name: name.to_owned(), role }, digest(token)));
        self
    }

    /// Reads users from the file at `path` (see [`Users::parse`]) and follows it: its changes are read at the next
    /// request. A file that does not read, or names no user, is refused, naming the line.
    pub fn from_file(path: &Path) -> Result<Users, Error> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::Config(format!("console users file {}: {e}", path.display())))?;
        let users = Users::parse(&text).map_err(|e| Error::Config(format!("{} ({})", e, path.display())))?;
        if users.is_empty() {
            return Err(Error::Config(format!(
                "console users file {}: it names no user; add `NAME ROLE sha256:HEX` lines (idem console token NAME)",
                path.display()
            )));
        }
        let read = Mutex::new((modified(path), users.entries.clone()));
        Ok(Users { entries: Vec::new(), file: Some(Arc::new(UsersFile { path: path.to_owned(), read })) })
    }

    /// The users now: the file's as last read (again, if it changed since), else those given.
    fn current(&self) -> Entries {
        let Some(file) = &self.file else { return self.entries.clone() };
        let mut read = file.read.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let now = modified(&file.path);
        if now != read.0 {
            read.0 = now;
            let fresh = std::fs::read_to_string(&file.path)
                .map_err(|e| e.to_string())
                .and_then(|text| Users::parse(&text).map_err(|e| e.to_string()))
                .and_then(
                    |users| {
                        if users.is_empty() { Err("it names no user".to_owned()) } else { Ok(users.entries) }
                    },
                );
            match fresh {
                Ok(entries) => {
                    tracing::info!(file = %file.path.display(), users = entries.len(), "console: users file read again");
                    read.1 = entries;
                }
                Err(why) => tracing::error!(
                    file = %file.path.display(),
                    "console: the users file changed but is refused ({why}); the users read before stay: fix the file"
                ),
            }
        }
        read.1.clone()
    }

    /// The role user `name` has now, if they are still a user.
    pub fn role_of(&self, name: &str) -> Option<Role> {
        self.current().iter().find(|(user, _)| user.name == name).map(|(user, _)| user.role)
    }

    /// Reads users from a file's text: a line per user, `NAME ROLE sha256:HEX` (the SHA-256 of the token in 64 hex
    /// digits, as `idem console token` prints it); blank lines and lines starting with `#` are skipped. A line
    /// that does not read is refused with its number.
    pub fn parse(text: &str) -> Result<Users, Error> {
        let mut users = Users::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let bad = |why: &str| Error::Config(format!("console users, line {}: {why}", n + 1));
            let fields: Vec<&str> = line.split_whitespace().collect();
            let [name, role, hash] = fields[..] else {
                return Err(bad("write `NAME ROLE sha256:HEX` (three fields)"));
            };
            let role = Role::parse(role).map_err(|why| bad(&why))?;
            let hex = hash.strip_prefix("sha256:").ok_or_else(|| bad("the hash starts with `sha256:`"))?;
            let hash = decode_hex(hex).ok_or_else(|| bad("the hash is 64 hexadecimal digits after `sha256:`"))?;
            if let Some((other, _)) = users.entries.iter().find(|(user, _)| user.name == name) {
                return Err(bad(&format!("`{}` is named twice: one line per user", other.name)));
            }
            if let Some((other, _)) = users.entries.iter().find(|(_, h)| *h == hash) {
                return Err(bad(&format!("the same token as `{}`: each user has a token of their own", other.name)));
            }
            users.entries.push((User { name: name.to_owned(), role }, hash));
        }
        Ok(users)
    }

    /// Whether there is no user.
    pub fn is_empty(&self) -> bool {
        self.current().is_empty()
    }

    /// The user whose token this is. Every entry is compared, in constant time each, whether one matches or not.
    pub fn authenticate(&self, token: &str) -> Option<User> {
        let presented = digest(token.trim());
        let mut found = None;
        for (user, hash) in &self.current() {
            if constant_time_eq(hash, &presented) && found.is_none() {
                found = Some(user.clone());
            }
        }
        found
    }
}

/// The SHA-256 of a token, as a users file writes it: `sha256:HEX`.
pub fn token_line_hash(token: &str) -> String {
    let hex: String = digest(token).iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256:{hex}")
}

/// A new random token: 32 bytes from the operating system, in hex.
pub fn new_token() -> String {
    let (a, b) = (uuid::Uuid::new_v4(), uuid::Uuid::new_v4());
    format!("{}{}", a.simple(), b.simple())
}

fn digest(token: &str) -> [u8; 32] {
    sha2::Sha256::digest(token.as_bytes()).into()
}

fn decode_hex(hex: &str) -> Option<[u8; 32]> {
    if hex.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// A signed-in browser: its user, its CSRF token and when it expires.
#[derive(Debug, Clone)]
pub struct Session {
    /// Who.
    pub user: User,
    /// The token every form of this session carries.
    pub csrf: String,
    expires: Instant,
}

/// The page's sessions, in memory: signing in again after a restart is the price of keeping no secret on disk.
#[derive(Debug, Default)]
pub struct Sessions {
    by_id: Mutex<HashMap<String, Session>>,
}

/// How long a session lasts without use.
const SESSION_IDLE: Duration = Duration::from_secs(8 * 3_600);

impl Sessions {
    /// Opens a session for `user`; its id (the cookie's value).
    pub fn open(&self, user: User) -> String {
        let id = new_token();
        let session = Session { user, csrf: new_token(), expires: Instant::now() + SESSION_IDLE };
        let mut sessions = self.by_id.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        sessions.retain(|_, s| s.expires > Instant::now());
        sessions.insert(id.clone(), session);
        id
    }

    /// The live session with this id, its expiry pushed back.
    pub fn get(&self, id: &str) -> Option<Session> {
        let mut sessions = self.by_id.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let session = sessions.get_mut(id)?;
        if session.expires <= Instant::now() {
            sessions.remove(id);
            return None;
        }
        session.expires = Instant::now() + SESSION_IDLE;
        Some(session.clone())
    }

    /// Ends a session.
    pub fn close(&self, id: &str) {
        self.by_id.lock().unwrap_or_else(std::sync::PoisonError::into_inner).remove(id);
    }
}

/// Whether a form's CSRF token is its session's.
pub fn csrf_ok(session: &Session, presented: &str) -> bool {
    constant_time_eq(session.csrf.as_bytes(), presented.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn users_read_from_a_file_and_tokens_authenticate() {
        let token = new_token();
        let file = format!(
            "# the on-call\nalice operator {}\n\nbob viewer {}\n",
            token_line_hash(&token),
            token_line_hash("b")
        );
        let users = Users::parse(&file).unwrap();
        assert_eq!(users.authenticate(&token), Some(User { name: "alice".into(), role: Role::Operator }));
        assert_eq!(users.authenticate("b").map(|u| u.role), Some(Role::Viewer));
        assert_eq!(users.authenticate("wrong"), None);
        assert_eq!(users.authenticate(""), None);
        let err = Users::parse("carol admin sha256:00").unwrap_err().to_string();
        assert!(err.contains("line 1") && err.contains("viewer"), "{err}");
        let err = Users::parse("carol viewer sha256:00").unwrap_err().to_string();
        assert!(err.contains("64 hexadecimal digits"), "{err}");
        assert!(Users::parse("carol viewer").unwrap_err().to_string().contains("three fields"));
        let twice = format!("a viewer {}\na operator {}", token_line_hash("x"), token_line_hash("y"));
        assert!(Users::parse(&twice).unwrap_err().to_string().contains("line 2"));
        let shared = format!("a viewer {}\nb operator {}", token_line_hash("x"), token_line_hash("x"));
        assert!(Users::parse(&shared).unwrap_err().to_string().contains("same token"));
    }

    #[test]
    fn a_users_file_is_followed_and_a_bad_change_keeps_the_users_before() {
        let path = std::env::temp_dir().join(format!("idem-users-{}-{}", std::process::id(), new_token()));
        let write = |text: String| {
            std::fs::write(&path, text).unwrap();
            // The change must show in the file's time even on a coarse clock.
            let later = SystemTime::now() + Duration::from_secs(2);
            let file = std::fs::File::options().append(true).open(&path).unwrap();
            file.set_modified(later).unwrap();
        };
        write(format!("alice operator {}\n", token_line_hash("a-token")));
        let users = Users::from_file(&path).unwrap();
        assert_eq!(users.authenticate("a-token").map(|u| u.role), Some(Role::Operator));
        write(format!("alice viewer {}\nbob viewer {}\n", token_line_hash("a-token"), token_line_hash("b-token")));
        assert_eq!(users.authenticate("b-token").map(|u| u.name), Some("bob".to_owned()), "a new user signs in");
        assert_eq!(users.role_of("alice"), Some(Role::Viewer), "a role changed");
        write("alice admin sha256:00\n".to_owned());
        assert_eq!(users.role_of("bob"), Some(Role::Viewer), "a broken file keeps the users before");
        write(format!("bob viewer {}\n", token_line_hash("b-token")));
        assert_eq!((users.role_of("alice"), users.authenticate("a-token")), (None, None), "a user removed");
        std::fs::write(&path, "").unwrap();
        assert!(Users::from_file(&path).unwrap_err().to_string().contains("names no user"));
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn sessions_carry_their_csrf_token() {
        let sessions = Sessions::default();
        let id = sessions.open(User { name: "a".into(), role: Role::Viewer });
        let session = sessions.get(&id).unwrap();
        assert!(csrf_ok(&session, &session.csrf));
        assert!(!csrf_ok(&session, "forged"));
        sessions.close(&id);
        assert!(sessions.get(&id).is_none());
        assert!(sessions.get("unknown").is_none());
    }
}
