//! The operator interface of a running instance: an HTTP API (on a Unix socket always, on TCP
//! when asked, with a bearer token and TLS beyond localhost), `/metrics` for Prometheus, and a
//! live picture of the graph in the browser at `/`.
//!
//! The API reads and changes the running graph in the graph file's own shape: a whole new graph
//! is applied by diff (`PUT /api/v1/graph`), and so is a change to one app or link — the API
//! edits the running graph's document and applies the result, so that unchanged apps keep their
//! state and queued packets and a refused change leaves everything as it was. The routes and
//! their answers are described in `openapi.yaml`, served at `/api/v1/openapi.json`.
//!
//! # Map
//!
//! The modules, in short: the HTTP API of a running instance (axum, on the Unix socket and
//! optionally TCP with TLS), `access` (who may do what: roles and their token files, the TCP guard
//! — host, origin, body type, token), graph edits applied by diff, `/metrics`, live link captures
//! streamed (`capture`), the graph view page (`web/`), the small client the CLI and the extcap use;
//! `openapi.yaml`; graphs go through `stitch-place`; `attached` (ports attached from outside the
//! graph, recorded beside the socket so that a restarted agent attaches them again); `handover`
//! (`stitch upgrade`'s protocol between the old and the new process).

pub mod access;
pub mod attached;
mod capture;
pub mod client;
pub mod handover;
pub mod metrics;
mod rates;
mod routes;
mod web;

use anyhow::{bail, Context, Result};
use serde_json::{json, Map, Value};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use stitch_core::engine::EngineError;
use stitch_core::graph::GraphErrors;
use stitch_core::{Engine, Stats};
use stitch_place::{PlaceReport, PlacedGraph};

pub use capture::CAPTURE_ID_HEADER;
pub use rates::Rates;

/// Where the Unix socket of instance `name` lives.
pub fn socket_path(name: &str) -> PathBuf {
    stitch_core::runtime_dir().join(format!("{name}.sock"))
}

/// A refused request: its HTTP status and the reason, plus structured details (the lines of a
/// bad graph file).
#[derive(Debug)]
pub struct ApiError {
    pub status: u16,
    pub message: String,
    pub details: Option<Value>,
}

impl ApiError {
    pub fn new(status: u16, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            details: None,
        }
    }

    fn bad_graph(e: GraphErrors, quote_lines: bool) -> ApiError {
        let errors: Vec<Value> = e
            .errors
            .iter()
            .map(|x| json!({ "line": x.line, "column": x.column, "message": x.message }))
            .collect();
        if !quote_lines {
            // The text was the API's own rendering of the running graph: its line numbers
            // mean nothing to the caller.
            let m: Vec<String> = e.errors.iter().map(|x| without_line(&x.message)).collect();
            return ApiError::new(400, m.join("; "));
        }
        ApiError {
            status: 400,
            message: e.to_string(),
            details: Some(json!({ "errors": errors })),
        }
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> ApiError {
        let status = match &e {
            EngineError::NoSuchApp(_) => 404,
            EngineError::RolledBack(_) | EngineError::Config { .. } | EngineError::Build { .. } => {
                422
            }
            EngineError::WorkerLost(_) | EngineError::Other(_) => 503,
        };
        ApiError::new(status, e.to_string())
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.message, self.status)
    }
}

impl std::error::Error for ApiError {}

/// How the API is reached.
#[derive(Debug, Clone, Default)]
pub struct ApiConfig {
    /// Unix socket, always served: the admin door (its mode and group decide who connects).
    pub unix: PathBuf,
    /// The group given the socket (mode 0660) and the runtime folder (0750); without one
    /// they are 0600 and 0700.
    pub group: Option<u32>,
    /// TCP address, when asked for.
    pub listen: Option<SocketAddr>,
    /// The folder of the role tokens TCP requests must carry (`access::Tokens`).
    pub token_dir: Option<PathBuf>,
    /// Names the API answers as on TCP besides IP addresses and `localhost`.
    pub api_hosts: Vec<String>,
    /// `/metrics` on TCP without a token.
    pub open_metrics: bool,
    /// Certificate chain and key (PEM) for TLS on TCP.
    pub tls: Option<(PathBuf, PathBuf)>,
    /// The graph file, re-read by reload (SIGHUP or `POST /api/v1/graph/reload`).
    pub graph_file: Option<PathBuf>,
}

/// Something beside the engine that feeds the instance its graph (the cluster agent) and says
/// how that goes: its state in `GET /api/v1/status` and `stitch show`, its gauges in `/metrics`.
pub trait Reporter: Send + Sync {
    /// A JSON object.
    fn status(&self) -> Value;
    /// `(metric name, help, value)`.
    fn gauges(&self) -> Vec<(&'static str, &'static str, i64)>;
}

/// The state behind the API: the engine, rates between two snapshots, and a lock that makes
/// each read-modify-apply of the graph one step.
pub struct Api {
    engine: Arc<Engine>,
    /// The graph as given, and what runs beside the engine (function processes).
    placements: stitch_place::Placements,
    rates: Mutex<Rates>,
    changes: Mutex<()>,
    graph_file: Option<PathBuf>,
    /// The instance's name, written into captures.
    instance: String,
    captures: capture::Captures,
    reporters: Mutex<Vec<(String, Arc<dyn Reporter>)>>,
}

impl Api {
    pub fn new(engine: Arc<Engine>, graph_file: Option<PathBuf>) -> Api {
        Api::for_instance(engine, graph_file, "stitch", "")
    }

    /// The API of instance `name` (as `--name` gives it, what it writes into captures), whose
    /// function processes' cgroups are named after `key` (empty: it places no processes).
    pub fn for_instance(
        engine: Arc<Engine>,
        graph_file: Option<PathBuf>,
        name: &str,
        key: &str,
    ) -> Api {
        Api {
            placements: stitch_place::Placements::new(engine.clone(), key),
            engine,
            rates: Mutex::new(Rates::default()),
            changes: Mutex::new(()),
            graph_file,
            instance: name.into(),
            captures: Default::default(),
            reporters: Mutex::new(Vec::new()),
        }
    }

    /// The engine and what is placed beside it.
    pub fn placements(&self) -> &stitch_place::Placements {
        &self.placements
    }

    /// Applies `graph` by diff through the placements; an entry the placements refuse is an
    /// error at its line of `text` (`None`: the API's own rendering, whose lines mean nothing).
    fn place(
        &self,
        graph: PlacedGraph,
        file: &str,
        text: Option<&str>,
    ) -> Result<PlaceReport, ApiError> {
        self.placements.apply(graph).map_err(|e| match e {
            stitch_place::PlaceError::Engine(e) => e.into(),
            stitch_place::PlaceError::App { error, at } => {
                let status = ApiError::from(error).status;
                ApiError {
                    status,
                    ..ApiError::bad_graph(
                        stitch_core::graph::GraphErrors {
                            file: file.to_string(),
                            text: text.unwrap_or_default().to_string(),
                            errors: vec![at],
                        },
                        text.is_some(),
                    )
                }
            }
            stitch_place::PlaceError::Kernel(why) => {
                ApiError::new(409, format!("kernel placement: {why}"))
            }
            stitch_place::PlaceError::Graph(errors) => ApiError::bad_graph(
                stitch_core::graph::GraphErrors {
                    file: file.to_string(),
                    text: text.unwrap_or_default().to_string(),
                    errors,
                },
                text.is_some(),
            ),
        })
    }

    /// Adds `reporter`'s state to the instance's status under `section`.
    pub fn add_reporter(&self, section: &str, reporter: Arc<dyn Reporter>) {
        self.reporters
            .lock()
            .unwrap()
            .push((section.to_string(), reporter));
    }

    /// The instance: its name, where its graph comes from, what Stitch made on the host for
    /// its placements, and each reporter's section.
    pub fn status(&self) -> Value {
        let mut v = json!({
            "instance": self.instance,
            "pid": std::process::id(),
            "graph_file": self.graph_file,
            "placements": self.placements.created(),
        });
        for (section, r) in self.reporters.lock().unwrap().iter() {
            v[section.as_str()] = r.status();
        }
        v
    }

    /// What `/metrics` shows: the engine's counters with the kernel apps' among them (worker
    /// `kernel`), the function processes and VMs, and the reporters' gauges.
    pub fn metrics_snapshot(&self) -> metrics::Snapshot {
        let mut stats = self.engine.stats();
        let graph = self.placements.graph();
        stats.apps.extend(self.kernel_app_stats(graph.as_ref()));
        let processes = graph
            .iter()
            .flat_map(|g| g.apps.keys())
            .filter_map(|name| {
                let p = self.placements.process(name)?;
                Some(metrics::ProcessGauge {
                    app: name.clone(),
                    running: p["state"] == "running",
                    restarts: p["restarts"].as_u64().unwrap_or(0),
                })
            })
            .collect();
        metrics::Snapshot {
            stats,
            processes,
            extra: self.gauges(),
        }
    }

    /// The reporters' gauges.
    pub fn gauges(&self) -> Vec<(&'static str, &'static str, i64)> {
        let reporters: Vec<Arc<dyn Reporter>> = self
            .reporters
            .lock()
            .unwrap()
            .iter()
            .map(|(_, r)| r.clone())
            .collect();
        reporters.iter().flat_map(|r| r.gauges()).collect()
    }

    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// Takes a counter snapshot for the rates (called about once a second).
    pub fn sample(&self) {
        let stats = self.engine.stats();
        self.rates
            .lock()
            .unwrap()
            .sample(stats, Duration::from_millis(900));
    }

    /// Counters with per-second rates, as the API and `stitch stats` show them.
    /// Counters and rates, every app with its placement (and a process app's supervision
    /// state: running, restarts, last exit).
    pub fn stats_json(&self, stats: &Stats) -> Value {
        let graph = self.placements.graph();
        let kernel = self.kernel_apps_json(graph.as_ref());
        self.stats_json_of(
            stats,
            graph.as_ref(),
            |name| self.placements.process(name),
            kernel,
        )
    }

    /// The last counters of an instance that `stop` stops: what is placed beside the engine
    /// (kernel apps' counters, processes' supervision) read before it goes, the engine's
    /// after its last breath.
    pub fn final_stats_json(&self, stop: impl FnOnce() -> Stats) -> Value {
        let graph = self.placements.graph();
        let kernel = self.kernel_apps_json(graph.as_ref());
        let processes: std::collections::HashMap<String, Value> = (graph.iter())
            .flat_map(|g| g.apps.keys())
            .filter_map(|name| Some((name.clone(), self.placements.process(name)?)))
            .collect();
        let stats = stop();
        self.stats_json_of(
            &stats,
            graph.as_ref(),
            |name| processes.get(name).cloned(),
            kernel,
        )
    }

    fn stats_json_of(
        &self,
        stats: &Stats,
        graph: Option<&PlacedGraph>,
        process: impl Fn(&str) -> Option<Value>,
        kernel: Vec<Value>,
    ) -> Value {
        let mut v = rates::stats_json(stats, &self.rates.lock().unwrap());
        if let Some(apps) = v["apps"].as_array_mut() {
            for a in apps.iter_mut() {
                let name = a["name"].as_str().unwrap_or_default().to_string();
                let placement = graph.map(|g| g.placement(&name)).unwrap_or_default();
                a["placement"] = json!(placement.name());
                if let Some(p) = process(&name) {
                    a["process"] = p;
                }
            }
            apps.extend(kernel);
        }
        v
    }

    /// The graph's kernel apps with the data plane's counters, as engine apps are counted
    /// (`worker: kernel`; per-port packets summed).
    fn kernel_app_stats(&self, graph: Option<&PlacedGraph>) -> Vec<stitch_core::engine::AppStats> {
        let (Some(graph), Some(status)) = (graph, self.placements.kernel_status()) else {
            return Vec::new();
        };
        status
            .apps
            .iter()
            .filter(|a| graph.apps.contains_key(&a.name))
            .map(|a| {
                let sum = |f: fn(&stitch_kernel::maps::ViStats) -> u64| {
                    a.ports.iter().map(|p| f(&p.stats)).sum::<u64>()
                };
                stitch_core::engine::AppStats {
                    name: a.name.clone(),
                    kind: a.kind.clone(),
                    worker: "kernel".into(),
                    rx_packets: sum(|s| s.rx_packets),
                    rx_bytes: sum(|s| s.rx_bytes),
                    tx_packets: sum(|s| s.tx_packets),
                    tx_bytes: sum(|s| s.tx_bytes),
                    drops: sum(|s| s.drops),
                    failed: false,
                    counters: a.counters.iter().map(|(k, v)| (k.clone(), *v)).collect(),
                    shard_of: None,
                    shards: Vec::new(),
                }
            })
            .collect()
    }

    /// The kernel apps in the shape of engine apps in `stats_json` (no rates).
    fn kernel_apps_json(&self, graph: Option<&PlacedGraph>) -> Vec<Value> {
        self.kernel_app_stats(graph)
            .into_iter()
            .map(|a| {
                let mut v = serde_json::to_value(a).expect("app stats serialize");
                v["rx_rate_pps"] = json!(0.0);
                v["tx_rate_pps"] = json!(0.0);
                v["placement"] = json!("kernel");
                v
            })
            .collect()
    }

    fn running_graph(&self) -> Result<PlacedGraph, ApiError> {
        self.placements
            .graph()
            .ok_or_else(|| {
                ApiError::new(
                    409,
                    "no graph is running (yet: an instance answers while it starts its graph; try again)",
                )
            })
    }

    /// The running graph in the graph file's shape.
    pub fn graph_document(&self) -> Result<Value, ApiError> {
        Ok(self.running_graph()?.to_document())
    }

    pub fn graph_dot(&self) -> Result<String, ApiError> {
        Ok(self.running_graph()?.graph.to_dot())
    }

    /// Applies graph text (YAML or JSON) by diff. Relative paths in it are resolved from
    /// `base_dir`, or from the running graph's folder.
    pub fn apply_text(
        &self,
        text: &str,
        file: &str,
        base_dir: Option<&Path>,
    ) -> Result<PlaceReport, ApiError> {
        let _one_change = self.changes.lock().unwrap();
        let base = match base_dir {
            Some(d) => d.to_path_buf(),
            None => self
                .placements
                .graph()
                .map(|g| g.graph.base_dir)
                .unwrap_or_default(),
        };
        let g = PlacedGraph::parse(text, file, &base, self.engine.registry())
            .map_err(|e| ApiError::bad_graph(e, true))?;
        self.place(g, file, Some(text))
    }

    /// Applies the graph document `derive` makes from the running one (if any), in one step
    /// with respect to every other change (what the cluster agent uses, so that an app
    /// `stitch-cni` attached between its read and its apply is not lost).
    pub fn apply_derived(
        &self,
        what: &str,
        derive: impl FnOnce(Option<Value>) -> Value,
    ) -> Result<PlaceReport, ApiError> {
        let _one_change = self.changes.lock().unwrap();
        let running = self.placements.graph();
        let base = running
            .as_ref()
            .map(|g| g.graph.base_dir.clone())
            .unwrap_or_default();
        let doc = derive(running.map(|g| g.to_document()));
        let text = serde_json::to_string_pretty(&doc).expect("a document serializes");
        let g = PlacedGraph::parse(&text, what, &base, self.engine.registry())
            .map_err(|e| ApiError::bad_graph(e, true))?;
        self.place(g, what, Some(&text))
    }

    /// Re-reads the graph file the instance was started with and applies it by diff.
    pub fn reload(&self) -> Result<PlaceReport, ApiError> {
        let Some(file) = &self.graph_file else {
            return Err(ApiError::new(
                409,
                "this instance was not started from a graph file",
            ));
        };
        stitch_core::files::check_trusted_target(file, "graph file")
            .map_err(|why| ApiError::new(409, why))?;
        let text = std::fs::read_to_string(file).map_err(|e| {
            ApiError::new(
                409,
                format!("cannot read graph file {}: {e}", file.display()),
            )
        })?;
        let dir = file.parent().map(Path::to_path_buf).unwrap_or_default();
        self.apply_text(&text, &file.display().to_string(), Some(&dir))
    }

    /// Edits the running graph's document with `f` and applies the result by diff.
    fn edit(
        &self,
        what: &str,
        f: impl FnOnce(&mut Map<String, Value>) -> Result<(), ApiError>,
    ) -> Result<PlaceReport, ApiError> {
        let _one_change = self.changes.lock().unwrap();
        let graph = self.running_graph()?;
        let mut doc = graph.to_document();
        f(doc.as_object_mut().expect("a graph document is an object"))?;
        let text = serde_json::to_string_pretty(&doc).expect("a document serializes");
        let g = PlacedGraph::parse(&text, what, &graph.graph.base_dir, self.engine.registry())
            .map_err(|e| ApiError::bad_graph(e, false))?;
        self.place(g, what, None)
    }

    /// Runs `f` with every change through the API held off (an upgrade's hand-over).
    pub fn while_unchanged<T>(&self, f: impl FnOnce() -> T) -> T {
        let _no_change = self.changes.lock().unwrap();
        f()
    }

    /// Adds app `name` or replaces its entry; true when it is new.
    pub fn put_app(&self, name: &str, entry: Value) -> Result<(bool, PlaceReport), ApiError> {
        let Value::Object(entry) = entry else {
            return Err(ApiError::new(
                400,
                "the body must be an app entry: an object with `type` and the app's keys",
            ));
        };
        // Without `type` the graph's rules decide, as in a graph file (an app placed in a
        // process or VM may go without one).
        if entry.get("type").is_some_and(|t| !t.is_string()) {
            return Err(ApiError::new(400, "field `type`: give a type name"));
        }
        let mut created = false;
        let report = self.edit(&format!("<app {name}>"), |doc| {
            let apps = doc["apps"].as_object_mut().expect("apps");
            created = apps
                .insert(name.to_string(), Value::Object(entry))
                .is_none();
            Ok(())
        })?;
        Ok((created, report))
    }

    /// Removes app `name` and every link to or from it.
    pub fn delete_app(&self, name: &str) -> Result<PlaceReport, ApiError> {
        self.edit(&format!("<app {name}>"), |doc| {
            let apps = doc["apps"].as_object_mut().expect("apps");
            if apps.shift_remove(name).is_none() {
                return Err(ApiError::new(404, format!("no app named `{name}`")));
            }
            let links = doc["links"].as_array_mut().expect("links");
            links.retain(|l| {
                let (from, to) = split_spec(link_spec(l));
                endpoint_app(from) != name && endpoint_app(to) != name
            });
            Ok(())
        })
    }

    /// Adds a link given as in a graph file: `"a.x -> b.y"` or `{link: "a.x -> b.y", size: N}`.
    pub fn add_link(&self, link: Value) -> Result<PlaceReport, ApiError> {
        let spec = match &link {
            Value::String(s) => s.clone(),
            Value::Object(m) => match m.get("link") {
                Some(Value::String(s)) => s.clone(),
                _ => {
                    return Err(ApiError::new(
                        400,
                        "field `link`: give the link as \"APP.PORT -> APP.PORT\"",
                    ))
                }
            },
            _ => {
                return Err(ApiError::new(
                    400,
                    "the body must be {\"link\": \"APP.PORT -> APP.PORT\", \"size\": N}",
                ))
            }
        };
        let wanted = normalize(&spec);
        self.edit(&format!("<link {spec}>"), |doc| {
            let links = doc["links"].as_array_mut().expect("links");
            if links.iter().any(|l| normalize(link_spec(l)) == wanted) {
                return Err(ApiError::new(409, format!("link `{spec}` exists already")));
            }
            links.push(link);
            Ok(())
        })
    }

    /// Removes the link `a.x -> b.y`.
    pub fn delete_link(&self, spec: &str) -> Result<PlaceReport, ApiError> {
        let wanted = normalize(spec);
        self.edit(&format!("<link {spec}>"), |doc| {
            let links = doc["links"].as_array_mut().expect("links");
            let before = links.len();
            links.retain(|l| normalize(link_spec(l)) != wanted);
            if links.len() == before {
                return Err(ApiError::new(404, format!("no link `{spec}`")));
            }
            Ok(())
        })
    }

    /// One app's counters and its entry in the graph.
    pub fn app(&self, name: &str) -> Result<Value, ApiError> {
        let doc = self.graph_document()?;
        let Some(entry) = doc["apps"].get(name) else {
            return Err(ApiError::new(404, format!("no app named `{name}`")));
        };
        let stats = self.stats_json(&self.engine.stats());
        let counters = stats["apps"]
            .as_array()
            .and_then(|a| a.iter().find(|x| x["name"] == name))
            .cloned()
            .unwrap_or(Value::Null);
        let placed = self.placements.status(name);
        Ok(json!({
            "name": name,
            "entry": entry,
            "stats": counters,
            "placement": placed["placement"],
            "process": placed["process"],
        }))
    }

    /// An app's own tables and commands (bridge MAC table, routes, NAT mappings, ...).
    pub fn query(&self, name: &str, request: Value) -> Result<Value, ApiError> {
        let placed = self.placements.status(name);
        if placed["placement"] == "kernel" {
            // Not in the engine: its counters, as the kernel data plane keeps them.
            let stats = self.stats_json(&self.engine.stats());
            let app = (stats["apps"].as_array().into_iter().flatten())
                .find(|a| a["name"] == name)
                .cloned()
                .unwrap_or(Value::Null);
            return Ok(json!({ "placement": "kernel", "stats": app }));
        }
        let answer = match self.engine.query(name, request.clone()) {
            Err(EngineError::NoSuchApp(_)) => return self.query_shards(name, request),
            answer => answer?,
        };
        // Apps refuse a request by answering `{"error": REASON}` alone.
        let refusal = answer
            .as_object()
            .filter(|o| o.len() == 1)
            .and_then(|o| o.get("error"))
            .and_then(Value::as_str);
        if let Some(reason) = refusal {
            return Err(ApiError::new(400, reason));
        }
        if let (false, Some(o)) = (placed["process"].is_null(), answer.as_object()) {
            let mut o = o.clone();
            o.insert("placement".into(), placed["placement"].clone());
            o.insert("process".into(), placed["process"].clone());
            return Ok(Value::Object(o));
        }
        if answer.is_null() {
            let kind = self
                .engine
                .graph()
                .and_then(|g| g.apps.get(name).map(|a| a.kind.clone()))
                .unwrap_or_default();
            return Err(ApiError::new(
                409,
                format!("app `{name}` ({kind}) has no tables or commands to query"),
            ));
        }
        Ok(answer)
    }

    /// A sharded app is one app: each shard's tables under its name (no such app: the
    /// engine's answer).
    fn query_shards(&self, name: &str, request: Value) -> Result<Value, ApiError> {
        let shards: Vec<String> = (self.engine.graph().into_iter())
            .flat_map(|g| {
                g.apps
                    .into_values()
                    .filter(|a| a.shard.as_ref().is_some_and(|s| s.of == name))
                    .map(|a| a.name)
                    .collect::<Vec<_>>()
            })
            .collect();
        if shards.is_empty() {
            return Err(EngineError::NoSuchApp(name.to_string()).into());
        }
        let mut answers = Vec::new();
        for shard in &shards {
            let mut answer = self.query(shard, request.clone())?;
            if let Some(o) = answer.as_object_mut() {
                o.insert("shard".into(), json!(shard));
            }
            answers.push(answer);
        }
        Ok(json!({ "name": name, "shards": answers }))
    }

    /// The app types this build knows.
    pub fn types(&self) -> Value {
        let types: Vec<Value> = self
            .engine
            .registry()
            .types()
            .map(|t| json!({ "name": t.name, "summary": t.summary }))
            .collect();
        json!(types)
    }
}

/// Drops " on line N" from a graph error message.
fn without_line(message: &str) -> String {
    match message.find(" on line ") {
        Some(i) => {
            let rest = &message[i + " on line ".len()..];
            let digits = rest.chars().take_while(char::is_ascii_digit).count();
            format!("{}{}", &message[..i], &rest[digits..])
        }
        None => message.to_string(),
    }
}

fn link_spec(l: &Value) -> &str {
    match l {
        Value::String(s) => s,
        _ => l["link"].as_str().unwrap_or_default(),
    }
}

fn split_spec(s: &str) -> (&str, &str) {
    s.split_once("->").unwrap_or((s, ""))
}

fn endpoint_app(e: &str) -> &str {
    e.trim().split('.').next().unwrap_or_default()
}

/// `a.x->b.y`, `a.x -> b.y` and ` a.x  ->  b.y` name the same link.
fn normalize(spec: &str) -> String {
    let (a, b) = split_spec(spec);
    format!("{} -> {}", a.trim(), b.trim())
}

/// The running API: its threads serve until [`Server::shutdown`].
pub struct Server {
    api: Arc<Api>,
    unix: PathBuf,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
    listeners: Listeners,
}

/// The API's listening sockets: bound by [`Listeners::bind`], or handed over by the process
/// an upgrade replaces (clients never find the socket gone).
pub struct Listeners {
    pub unix: std::os::unix::net::UnixListener,
    pub tcp: Option<std::net::TcpListener>,
}

impl Listeners {
    /// Binds every listener `config` asks for.
    pub fn bind(config: &ApiConfig) -> Result<Listeners> {
        let unix = bind_unix(&config.unix, config.group)?;
        let tcp = match config.listen {
            None => None,
            Some(addr) => {
                if !addr.ip().is_loopback() && config.tls.is_none() {
                    bail!(
                        "--listen {addr} is reachable from other hosts, and its tokens would cross the network in clear: give --tls-cert and --tls-key, or listen on 127.0.0.1"
                    );
                }
                let l = std::net::TcpListener::bind(addr)
                    .with_context(|| format!("cannot listen on {addr}"))?;
                l.set_nonblocking(true)?;
                Some(l)
            }
        };
        Ok(Listeners { unix, tcp })
    }

    /// Duplicates of the listeners, to hand over.
    pub fn try_clone(&self) -> std::io::Result<Listeners> {
        Ok(Listeners {
            unix: self.unix.try_clone()?,
            tcp: self.tcp.as_ref().map(|t| t.try_clone()).transpose()?,
        })
    }
}

impl Server {
    /// Binds every listener (so that errors come before the instance runs) and serves on a
    /// thread of its own.
    pub fn start(api: Arc<Api>, config: &ApiConfig) -> Result<Server> {
        Server::serve(api, config, Listeners::bind(config)?)
    }

    /// Serves on `listeners` (bound by [`Listeners::bind`] or handed over).
    pub fn serve(api: Arc<Api>, config: &ApiConfig, listeners: Listeners) -> Result<Server> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("stitch-api")
            .enable_all()
            .build()
            .context("cannot start the API runtime")?;
        let kept = listeners.try_clone()?;
        let Listeners { unix, tcp } = listeners;
        unix.set_nonblocking(true)?;
        if let Some(t) = &tcp {
            t.set_nonblocking(true)?;
        }
        let tls = match &config.tls {
            None => None,
            Some((cert, key)) => {
                let _ = rustls::crypto::ring::default_provider().install_default();
                Some(
                    runtime
                        .block_on(axum_server::tls_rustls::RustlsConfig::from_pem_file(
                            cert, key,
                        ))
                        .with_context(|| {
                            format!(
                                "cannot load TLS certificate {} and key {}",
                                cert.display(),
                                key.display()
                            )
                        })?,
                )
            }
        };
        let (tx, rx) = tokio::sync::oneshot::channel();
        let local = routes::router(api.clone(), None);
        let remote = tcp_router(&api, config, tcp.is_some())?;
        let sampler = api.clone();
        let thread = std::thread::Builder::new()
            .name("stitch-api".into())
            .spawn(move || {
                runtime.block_on(async move {
                    tokio::spawn(async move {
                        let mut tick = tokio::time::interval(Duration::from_secs(1));
                        loop {
                            tick.tick().await;
                            let s = sampler.clone();
                            let _ = tokio::task::spawn_blocking(move || s.sample()).await;
                        }
                    });
                    let unix = tokio::net::UnixListener::from_std(unix).expect("unix listener");
                    tokio::spawn(async move {
                        if let Err(e) = axum::serve(unix, local).await {
                            log::error!("API on the Unix socket stopped: {e}");
                        }
                    });
                    if let Some(l) = tcp {
                        let app = remote.into_make_service();
                        tokio::spawn(async move {
                            let r = match tls {
                                Some(tls) => axum_server::from_tcp_rustls(l, tls).serve(app).await,
                                None => axum_server::from_tcp(l).serve(app).await,
                            };
                            if let Err(e) = r {
                                log::error!("API on TCP stopped: {e}");
                            }
                        });
                    }
                    let _ = rx.await;
                });
            })?;
        if let Some(addr) = config.listen {
            let scheme = if config.tls.is_some() {
                "https"
            } else {
                "http"
            };
            log::info!(
                "API and graph view at {scheme}://{addr}/ (every request with a role's token: {})",
                config
                    .token_dir
                    .as_deref()
                    .unwrap_or(Path::new(""))
                    .display()
            );
        }
        Ok(Server {
            api,
            unix: config.unix.clone(),
            shutdown: Some(tx),
            thread: Some(thread),
            listeners: kept,
        })
    }

    pub fn api(&self) -> &Arc<Api> {
        &self.api
    }

    /// The listeners this server serves on, for a successor process to serve on too.
    pub fn listeners(&self) -> &Listeners {
        &self.listeners
    }

    /// Stops serving and removes the Unix socket.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.unix);
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Makes the folder of the admin socket at `path` fit to hold it (before anything is put there,
/// its lock first): the runtime folder, or a folder that does not exist yet, is made this
/// user's with mode 0750 and `group` (0700 without one), whatever it had; a folder given with
/// `--control` that exists must be one only this user or root can write.
pub fn prepare_socket_folder(path: &Path, group: Option<u32>) -> Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    if dir == stitch_core::runtime_dir() || !dir.exists() {
        let mode = if group.is_some() { 0o750 } else { 0o700 };
        stitch_core::files::private_dir(&dir, mode, group).map_err(anyhow::Error::msg)
    } else {
        stitch_core::files::check_trusted_folder(&dir, "the folder of the API socket")
            .map_err(anyhow::Error::msg)
    }
}

/// The router of the API on TCP, behind its guard (the token folder's roles, hosts, origins),
/// and the access report `stitch show` gives.
fn tcp_router(api: &Arc<Api>, config: &ApiConfig, serves_tcp: bool) -> Result<axum::Router> {
    let guard = match (serves_tcp, &config.token_dir) {
        (false, _) => None,
        (true, None) => bail!("the API on TCP needs a token folder (--token-dir)"),
        (true, Some(dir)) => Some(Arc::new(access::Guard {
            tokens: access::Tokens::open(dir).map_err(anyhow::Error::msg)?,
            hosts: config.api_hosts.clone(),
            open_metrics: config.open_metrics,
        })),
    };
    let remote = routes::router(api.clone(), guard);
    api.add_reporter(
        "access",
        Arc::new(access::Report {
            unix: config.unix.clone(),
            group: config.group,
            listen: config.listen,
            tls: config.tls.is_some(),
            token_dir: config.token_dir.clone(),
            open_metrics: config.open_metrics,
        }),
    );
    Ok(remote)
}

/// Binds the admin socket at `path` in a folder [`prepare_socket_folder`] made fit: 0660 with
/// `group`, else 0600 — set here, whatever the umask.
fn bind_unix(path: &Path, group: Option<u32>) -> Result<std::os::unix::net::UnixListener> {
    use std::os::unix::fs::PermissionsExt;
    prepare_socket_folder(path, group)?;
    if path.exists() {
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            bail!(
                "another stitch instance answers on {}; give this one another --name",
                path.display()
            );
        }
        let _ = std::fs::remove_file(path);
    }
    let l = std::os::unix::net::UnixListener::bind(path)
        .with_context(|| format!("cannot listen on {}", path.display()))?;
    // The folder is this user's alone: nobody can swap the name between bind and here.
    if let Some(gid) = group {
        std::os::unix::fs::lchown(path, None, Some(gid))
            .with_context(|| format!("cannot give {} to group {gid}", path.display()))?;
    }
    let mode = if group.is_some() { 0o660 } else { 0o600 };
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .with_context(|| format!("cannot set the mode of {}", path.display()))?;
    l.set_nonblocking(true)?;
    Ok(l)
}
