//! The control socket of a running instance: a Unix socket speaking one JSON object per line.
//!
//! Requests: `{"cmd":"stats"}`, `{"cmd":"graph"}`, `{"cmd":"apply","text":YAML,"dir":FOLDER,"file":NAME}`.
//! Replies: `{"ok":true,...}` or `{"ok":false,"error":REASON}`.

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use stitch_core::{Engine, Graph, Stats};

/// Where the socket of instance `name` lives.
pub fn socket_path(name: &str) -> PathBuf {
    let dir = if unsafe { libc::geteuid() } == 0 {
        PathBuf::from("/run/stitch")
    } else if let Some(d) = std::env::var_os("XDG_RUNTIME_DIR") {
        Path::new(&d).join("stitch")
    } else {
        std::env::temp_dir().join(format!("stitch-{}", unsafe { libc::geteuid() }))
    };
    dir.join(format!("{name}.sock"))
}

/// Per-second rates, computed by the instance from two snapshots.
#[derive(Default, Clone)]
pub struct Rates {
    pub links: HashMap<String, (f64, f64)>,
    pub apps: HashMap<String, (f64, f64)>,
    last: Option<(Instant, Stats)>,
}

impl Rates {
    /// Takes a snapshot and updates the rates if at least `min` passed since the last one.
    pub fn sample(&mut self, stats: Stats, min: Duration) {
        let now = Instant::now();
        if let Some((t, prev)) = &self.last {
            let dt = now.duration_since(*t);
            if dt < min {
                return;
            }
            let dt = dt.as_secs_f64();
            self.links.clear();
            for l in &stats.links {
                if let Some(p) = prev.links.iter().find(|p| p.link == l.link) {
                    let pps = l.stats.tx_packets.saturating_sub(p.stats.tx_packets) as f64 / dt;
                    let bps = l.stats.tx_bytes.saturating_sub(p.stats.tx_bytes) as f64 * 8.0 / dt;
                    self.links.insert(l.link.clone(), (pps, bps));
                }
            }
            self.apps.clear();
            for a in &stats.apps {
                if let Some(p) = prev.apps.iter().find(|p| p.name == a.name) {
                    let rx = a.rx_packets.saturating_sub(p.rx_packets) as f64 / dt;
                    let tx = a.tx_packets.saturating_sub(p.tx_packets) as f64 / dt;
                    self.apps.insert(a.name.clone(), (rx, tx));
                }
            }
        }
        self.last = Some((now, stats));
    }
}

/// Stats plus rates, as sent to `stitch stats`.
pub fn stats_json(stats: &Stats, rates: &Rates) -> Value {
    let mut v = serde_json::to_value(stats).expect("stats serialize");
    if let Some(links) = v["links"].as_array_mut() {
        for l in links {
            let name = l["link"].as_str().unwrap_or_default().to_string();
            let (pps, bps) = rates.links.get(&name).copied().unwrap_or_default();
            l["rate_pps"] = json!(pps);
            l["rate_bps"] = json!(bps);
        }
    }
    if let Some(apps) = v["apps"].as_array_mut() {
        for a in apps {
            let name = a["name"].as_str().unwrap_or_default().to_string();
            let (rx, tx) = rates.apps.get(&name).copied().unwrap_or_default();
            a["rx_rate_pps"] = json!(rx);
            a["tx_rate_pps"] = json!(tx);
        }
    }
    v
}

/// Serves the control socket on a background thread until the process exits.
pub fn serve(path: &Path, engine: Arc<Engine>, rates: Arc<Mutex<Rates>>) -> Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    if path.exists() {
        if UnixStream::connect(path).is_ok() {
            bail!(
                "another stitch instance answers on {}; give this one another --name",
                path.display()
            );
        }
        let _ = std::fs::remove_file(path);
    }
    let listener = UnixListener::bind(path)
        .with_context(|| format!("cannot listen on control socket {}", path.display()))?;
    std::thread::Builder::new()
        .name("stitch-control".into())
        .spawn(move || {
            for conn in listener.incoming().flatten() {
                let (engine, rates) = (engine.clone(), rates.clone());
                std::thread::spawn(move || {
                    if let Err(e) = handle(conn, &engine, &rates) {
                        log::debug!("control connection: {e}");
                    }
                });
            }
        })?;
    Ok(())
}

fn handle(conn: UnixStream, engine: &Engine, rates: &Mutex<Rates>) -> Result<()> {
    let mut out = conn.try_clone()?;
    for line in BufReader::new(conn).lines() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        let reply = match serde_json::from_str::<Value>(&line) {
            Err(e) => json!({"ok": false, "error": format!("request is not JSON: {e}")}),
            Ok(req) => answer(&req, engine, rates),
        };
        writeln!(out, "{reply}")?;
    }
    Ok(())
}

fn answer(req: &Value, engine: &Engine, rates: &Mutex<Rates>) -> Value {
    match req["cmd"].as_str() {
        Some("stats") => {
            let stats = engine.stats();
            json!({"ok": true, "stats": stats_json(&stats, &rates.lock().unwrap())})
        }
        Some("graph") => match engine.graph() {
            Some(g) => json!({"ok": true, "dot": g.to_dot()}),
            None => json!({"ok": false, "error": "no graph is running"}),
        },
        Some("apply") => {
            let (Some(text), Some(dir)) = (req["text"].as_str(), req["dir"].as_str()) else {
                return json!({"ok": false, "error": "apply needs `text` (the graph) and `dir`"});
            };
            let file = req["file"].as_str().unwrap_or("<graph>");
            match Graph::parse(text, file, Path::new(dir), engine.registry()) {
                Err(e) => json!({"ok": false, "error": e.to_string()}),
                Ok(g) => match engine.apply(g) {
                    Ok(report) => json!({"ok": true, "report": report}),
                    Err(e) => json!({"ok": false, "error": e.to_string()}),
                },
            }
        }
        Some("query") => {
            let Some(app) = req["app"].as_str() else {
                return json!({"ok": false, "error": "query needs `app`"});
            };
            match engine.query(app, req["request"].clone()) {
                Ok(answer) => json!({"ok": true, "answer": answer}),
                Err(e) => json!({"ok": false, "error": e.to_string()}),
            }
        }
        Some(other) => {
            json!({"ok": false, "error": format!("unknown cmd `{other}` (stats, graph, apply, query)")})
        }
        None => json!({"ok": false, "error": "request needs a `cmd`"}),
    }
}

/// Sends one request to a running instance and returns its reply.
pub fn request(path: &Path, req: &Value) -> Result<Value> {
    let conn = UnixStream::connect(path).with_context(|| {
        format!(
            "no stitch instance answers on {} (is `stitch run` running? --name?)",
            path.display()
        )
    })?;
    conn.set_read_timeout(Some(Duration::from_secs(30)))?;
    let mut w = conn.try_clone()?;
    writeln!(w, "{req}")?;
    let mut line = String::new();
    BufReader::new(conn).read_line(&mut line)?;
    let v: Value = serde_json::from_str(&line).context("bad reply from instance")?;
    if v["ok"] != json!(true) {
        bail!("{}", v["error"].as_str().unwrap_or("request failed"));
    }
    Ok(v)
}
