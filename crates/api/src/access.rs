//! Who may do what through the API (`docs/security.md`, "Who may do what").
//!
//! The Unix socket is the admin door: whoever the socket's mode and group let connect is
//! admin. On TCP every request names its role with a bearer token — loopback included, since
//! every local user reaches loopback — and the tokens live one per role in a folder of files
//! (mode 0600, checked as sshd checks keys), generated at the first start or by
//! `stitch token new`, re-read when a file changes. A browser on the same machine is kept out
//! too: the `Host` must be a name the API listens as (DNS rebinding), a foreign `Origin` is
//! refused (cross-site requests) and a body must be JSON (or YAML for a graph), which no HTML
//! form can send.

use crate::ApiError;
use axum::extract::Request;
use axum::http::{header, Method};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use subtle::ConstantTimeEq;

/// What a token lets its holder do; each role may do what the ones before it may.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Role {
    /// Counters, the graph, the instance's status, `/metrics`.
    Read,
    /// And the traffic itself: live captures of links.
    Capture,
    /// And every change: the graph, apps, links, app commands.
    Admin,
}

impl Role {
    pub const ALL: [Role; 3] = [Role::Read, Role::Capture, Role::Admin];

    pub fn name(self) -> &'static str {
        match self {
            Role::Read => "read",
            Role::Capture => "capture",
            Role::Admin => "admin",
        }
    }

    pub fn parse(s: &str) -> Option<Role> {
        Role::ALL.into_iter().find(|r| r.name() == s)
    }

    /// What the role may do, in words (for `stitch show` and errors).
    pub fn may(self) -> &'static str {
        match self {
            Role::Read => "read counters, the graph, the status and /metrics",
            Role::Capture => "read, and capture the traffic of links",
            Role::Admin => "read, capture, and change the graph (which runs commands as root)",
        }
    }
}

/// The role a request needs: `None` for the graph view's page and scripts and the API's
/// description (they hold no data).
pub fn required_role(method: &Method, path: &str) -> Option<Role> {
    if path == "/" || path.starts_with("/ui/") || path == "/api/v1/openapi.json" {
        return None;
    }
    let link_capture = path
        .strip_prefix("/api/v1/links/")
        .and_then(|rest| rest.strip_suffix("/capture"))
        .is_some_and(|link| !link.is_empty());
    let capture = match *method {
        Method::GET => link_capture || path == "/api/v1/captures",
        Method::DELETE => path.starts_with("/api/v1/captures/"),
        _ => false,
    };
    Some(if capture {
        Role::Capture
    } else if *method == Method::GET || *method == Method::HEAD {
        Role::Read
    } else {
        // Every change, and app queries, which may be commands (a bridge's flush).
        Role::Admin
    })
}

/// A new token: 32 bytes from the OS's random source, as 64 hex digits.
pub fn generate() -> Result<String, String> {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).map_err(|e| format!("no random bytes for a token: {e}"))?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// The file of `role`'s token in `dir`.
pub fn token_path(dir: &Path, role: Role) -> PathBuf {
    dir.join(role.name())
}

/// Writes a new token for `role` into `dir` (replacing the old one, which stops working at the
/// instance's next request); returns the file.
pub fn new_token(dir: &Path, role: Role) -> Result<PathBuf, String> {
    stitch_core::files::private_dir(dir, 0o700, None)?;
    let path = token_path(dir, role);
    stitch_core::files::write_atomically(&path, &token_file_text()?, 0o600)
        .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    Ok(path)
}

/// What a token file holds: a new token and a newline.
fn token_file_text() -> Result<Vec<u8>, String> {
    Ok(format!("{}\n", generate()?).into_bytes())
}

/// The tokens of one instance: a file per role in one folder, read again when a file changes.
pub struct Tokens {
    dir: PathBuf,
    loaded: Mutex<Vec<Loaded>>,
}

/// One role's token as last read, and the file's identity then.
struct Loaded {
    role: Role,
    stamp: Option<(u64, i64, i64)>,
    token: Option<Vec<u8>>,
}

fn stamp_of(path: &Path) -> Option<(u64, i64, i64)> {
    let m = std::fs::symlink_metadata(path).ok()?;
    Some((m.ino(), m.mtime(), m.mtime_nsec()))
}

fn read_token(path: &Path) -> Result<Vec<u8>, String> {
    let bytes = stitch_core::files::read_trusted(path, "token file", true)?
        .ok_or_else(|| format!("token file {} is missing", path.display()))?;
    let token = String::from_utf8_lossy(&bytes).trim().to_string();
    if token.len() < 16 {
        return Err(format!(
            "token file {} holds {} characters; a token has at least 16 (`stitch token new` makes one)",
            path.display(),
            token.len()
        ));
    }
    Ok(token.into_bytes())
}

impl Tokens {
    /// The tokens in `dir`, a folder of this user's (made 0700 if missing); a role without a
    /// file gets a new token. A file another user could have written or may read is refused.
    pub fn open(dir: &Path) -> Result<Tokens, String> {
        stitch_core::files::private_dir(dir, 0o700, None)?;
        stitch_core::files::check_trusted_folder(dir, "token folder")?;
        let mut loaded = Vec::new();
        for role in Role::ALL {
            let path = token_path(dir, role);
            if stamp_of(&path).is_none() {
                match stitch_core::files::write_new(&path, &token_file_text()?, 0o600) {
                    Ok(()) => log::info!("new {} token in {}", role.name(), path.display()),
                    // Made by another instance sharing the folder meanwhile: read it.
                    Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                    Err(e) => return Err(format!("cannot create {}: {e}", path.display())),
                }
            }
            loaded.push(Loaded {
                role,
                stamp: stamp_of(&path),
                token: Some(read_token(&path)?),
            });
        }
        Ok(Tokens {
            dir: dir.to_path_buf(),
            loaded: Mutex::new(loaded),
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The highest role whose token is `presented`, compared in constant time with every
    /// role's; a file changed since it was read is read again first (a file that became
    /// unreadable or untrusted lets nobody in for its role, and says why in the log).
    pub fn role_of(&self, presented: &[u8]) -> Option<Role> {
        let mut loaded = self.loaded.lock().unwrap_or_else(|p| p.into_inner());
        let mut found = None;
        for l in loaded.iter_mut() {
            let path = token_path(&self.dir, l.role);
            let stamp = stamp_of(&path);
            if stamp != l.stamp {
                l.stamp = stamp;
                l.token = match read_token(&path) {
                    Ok(t) => Some(t),
                    Err(why) => {
                        log::error!(
                            "the {} token is refused until it is mended: {why}",
                            l.role.name()
                        );
                        None
                    }
                };
            }
            if let Some(t) = &l.token {
                if bool::from(t.as_slice().ct_eq(presented)) {
                    found = Some(l.role);
                }
            }
        }
        found
    }
}

/// How TCP requests are let in.
pub struct Guard {
    pub tokens: Tokens,
    /// Names the API answers as besides IP addresses and `localhost` (`--api-host`).
    pub hosts: Vec<String>,
    /// `/metrics` without a token (`--metrics-without-token`).
    pub open_metrics: bool,
}

fn refuse(status: u16, why: impl Into<String>) -> Response {
    ApiError::new(status, why).into_response()
}

/// The name part of a `Host` value or an origin's authority: `name`, `name:port`, `[v6]:port`.
fn host_name(authority: &str) -> &str {
    if let Some(rest) = authority.strip_prefix('[') {
        return rest.split(']').next().unwrap_or_default();
    }
    match authority.rsplit_once(':') {
        Some((name, port)) if port.chars().all(|c| c.is_ascii_digit()) => name,
        _ => authority,
    }
}

impl Guard {
    /// Whether `authority` (a `Host` value) names this API: an IP address (a browser sends one
    /// only when it was sent to one, so no foreign site can rebind it), `localhost`, or a name
    /// the operator gave.
    fn known_host(&self, authority: &str) -> bool {
        let name = host_name(authority);
        name.parse::<std::net::IpAddr>().is_ok()
            || name.eq_ignore_ascii_case("localhost")
            || self.hosts.iter().any(|h| h.eq_ignore_ascii_case(name))
    }

    /// The checks in order: the host, the origin, the body's type, the token's role.
    pub async fn check(self: Arc<Guard>, req: Request, next: Next) -> Response {
        match self.refusal(&req) {
            Some(r) => r,
            None => next.run(req).await,
        }
    }

    fn refusal(&self, req: &Request) -> Option<Response> {
        let headers = req.headers();
        let host = headers
            .get(header::HOST)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
            .or_else(|| req.uri().authority().map(|a| a.to_string()));
        let Some(host) = host else {
            return Some(refuse(400, "the request names no Host"));
        };
        if !self.known_host(&host) {
            return Some(refuse(
                403,
                format!(
                    "Host `{host}` is not a name this API answers as (an IP address, localhost{}): a page of another site may not reach it; give --api-host NAME to add a name",
                    self.hosts.iter().map(|h| format!(", {h}")).collect::<String>()
                ),
            ));
        }
        if let Some(origin) = headers.get(header::ORIGIN) {
            let origin = origin.to_str().unwrap_or_default();
            let authority = origin.split_once("://").map(|(_, a)| a);
            if authority.is_none_or(|a| !a.eq_ignore_ascii_case(&host)) {
                return Some(refuse(
                    403,
                    format!("requests from pages of another origin (`{origin}`) are refused: the API serves its own page only"),
                ));
            }
        }
        if let Some(r) = self.body_type_refusal(req) {
            return Some(r);
        }
        let path = req.uri().path();
        let needed = required_role(req.method(), path)?;
        if needed == Role::Read && path == "/metrics" && self.open_metrics {
            return None;
        }
        let presented = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim);
        let role = presented.and_then(|t| self.tokens.role_of(t.as_bytes()));
        match role {
            None => Some(refuse(
                401,
                format!(
                    "missing or wrong bearer token: send `Authorization: Bearer TOKEN` with the token of a role that may do this ({} or above; the files are in {})",
                    needed.name(),
                    self.tokens.dir().display()
                ),
            )),
            Some(role) if role < needed => Some(refuse(
                403,
                format!(
                    "the {} token may {}; this needs the {} token",
                    role.name(),
                    role.may(),
                    needed.name()
                ),
            )),
            Some(_) => None,
        }
    }

    /// A request with a body must say it is JSON (a graph may be YAML): an HTML form or a
    /// cross-site `fetch` without a preflight can send only other types.
    fn body_type_refusal(&self, req: &Request) -> Option<Response> {
        let headers = req.headers();
        let has_body = headers.contains_key(header::TRANSFER_ENCODING)
            || headers
                .get(header::CONTENT_LENGTH)
                .and_then(|v| v.to_str().ok())
                .is_some_and(|n| n.trim() != "0");
        if !has_body {
            return None;
        }
        let kind = headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default();
        let essence = kind
            .split(';')
            .next()
            .unwrap_or_default()
            .trim()
            .to_ascii_lowercase();
        let graph = req.uri().path() == "/api/v1/graph";
        let yaml = essence == "application/yaml" || essence == "application/x-yaml";
        if essence == "application/json" || (graph && yaml) {
            return None;
        }
        Some(refuse(
            415,
            format!(
                "a request body must be sent as `Content-Type: application/json`{} (this one says `{kind}`)",
                if graph { " or application/yaml" } else { "" }
            ),
        ))
    }
}

/// Who may do what on this instance, as `stitch show` and `GET /api/v1/status` say it.
pub struct Report {
    pub unix: PathBuf,
    pub group: Option<u32>,
    pub listen: Option<std::net::SocketAddr>,
    pub tls: bool,
    pub token_dir: Option<PathBuf>,
    pub open_metrics: bool,
}

impl crate::Reporter for Report {
    fn status(&self) -> serde_json::Value {
        use serde_json::json;
        let group = self.group.map(|gid| {
            nix::unistd::Group::from_gid(nix::unistd::Gid::from_raw(gid))
                .ok()
                .flatten()
                .map_or(gid.to_string(), |g| g.name)
        });
        let mode = std::fs::symlink_metadata(&self.unix)
            .map(|m| format!("{:04o}", m.mode() & 0o7777))
            .unwrap_or_default();
        let who = match &group {
            Some(g) => format!("root and the members of group {g}"),
            None => "root only".to_string(),
        };
        let tcp = self.listen.map(|addr| {
            let roles: serde_json::Map<String, serde_json::Value> = Role::ALL
                .iter()
                .map(|r| (r.name().to_string(), json!(r.may())))
                .collect();
            json!({
                "listen": addr.to_string(),
                "tls": self.tls,
                "token_dir": self.token_dir,
                "roles": roles,
                "metrics_without_token": self.open_metrics,
            })
        });
        json!({
            "unix_socket": {
                "path": self.unix,
                "mode": mode,
                "group": group,
                "role": "admin",
                "who": who,
            },
            "tcp": tcp,
        })
    }

    fn gauges(&self) -> Vec<(&'static str, &'static str, i64)> {
        Vec::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_route_needs_the_role_its_doing_needs() {
        let r = |m: Method, p: &str| required_role(&m, p);
        assert_eq!(r(Method::GET, "/"), None);
        assert_eq!(r(Method::GET, "/ui/app.js"), None);
        assert_eq!(r(Method::GET, "/api/v1/openapi.json"), None);
        assert_eq!(r(Method::GET, "/metrics"), Some(Role::Read));
        assert_eq!(r(Method::GET, "/api/v1/graph"), Some(Role::Read));
        assert_eq!(r(Method::GET, "/api/v1/apps/fw"), Some(Role::Read));
        assert_eq!(
            r(Method::GET, "/api/v1/links/fw.output/capture"),
            Some(Role::Capture)
        );
        assert_eq!(r(Method::GET, "/api/v1/captures"), Some(Role::Capture));
        assert_eq!(r(Method::DELETE, "/api/v1/captures/3"), Some(Role::Capture));
        assert_eq!(r(Method::PUT, "/api/v1/graph"), Some(Role::Admin));
        assert_eq!(r(Method::PUT, "/api/v1/apps/pw"), Some(Role::Admin));
        assert_eq!(r(Method::POST, "/api/v1/links"), Some(Role::Admin));
        assert_eq!(r(Method::POST, "/api/v1/apps/br/query"), Some(Role::Admin));
        assert_eq!(r(Method::POST, "/api/v1/graph/reload"), Some(Role::Admin));
        // A capture route with another method, or an app named like one, is no capture.
        assert_eq!(r(Method::POST, "/api/v1/captures"), Some(Role::Admin));
        assert_eq!(
            r(Method::DELETE, "/api/v1/links/capture"),
            Some(Role::Admin)
        );
    }

    #[test]
    fn tokens_are_made_private_compared_whole_and_read_again_when_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let folder = dir.path().join("tokens");
        let tokens = Tokens::open(&folder).unwrap();
        let read = std::fs::read_to_string(token_path(&folder, Role::Read)).unwrap();
        let admin = std::fs::read_to_string(token_path(&folder, Role::Admin)).unwrap();
        assert_eq!(read.trim().len(), 64);
        assert_ne!(read, admin);
        for role in Role::ALL {
            let m = std::fs::metadata(token_path(&folder, role)).unwrap();
            assert_eq!(m.mode() & 0o777, 0o600, "{role:?}");
        }
        assert_eq!(tokens.role_of(read.trim().as_bytes()), Some(Role::Read));
        assert_eq!(tokens.role_of(admin.trim().as_bytes()), Some(Role::Admin));
        assert_eq!(tokens.role_of(&admin.trim().as_bytes()[..63]), None);
        assert_eq!(tokens.role_of(b""), None);
        // A new admin token: the old one stops working at once.
        new_token(&folder, Role::Admin).unwrap();
        assert_eq!(tokens.role_of(admin.trim().as_bytes()), None);
        let admin2 = std::fs::read_to_string(token_path(&folder, Role::Admin)).unwrap();
        assert_eq!(tokens.role_of(admin2.trim().as_bytes()), Some(Role::Admin));
        // A token file others may read lets nobody in for its role.
        use std::os::unix::fs::PermissionsExt;
        let p = token_path(&folder, Role::Read);
        std::fs::write(&p, &read).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert_eq!(tokens.role_of(read.trim().as_bytes()), None);
        // Opening the folder again refuses it with the reason.
        let e = Tokens::open(&folder).err().unwrap();
        assert!(e.contains("may be read by other users"), "{e}");
    }

    #[test]
    fn host_names_are_split_from_their_ports() {
        assert_eq!(host_name("127.0.0.1:9440"), "127.0.0.1");
        assert_eq!(host_name("[::1]:9440"), "::1");
        assert_eq!(host_name("localhost"), "localhost");
        assert_eq!(host_name("evil.example:80"), "evil.example");
    }
}
