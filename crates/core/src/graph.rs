//! The graph file: apps with their configs, links between their ports, engine and worker
//! settings. Parsing keeps the line of every app, key and link so that every error names one.
//!
//! ```yaml
//! engine: { busy_poll: false, link_size: 1024 }
//! workers: { rx: { core: 1 } }
//! apps:
//!   gen: { type: generator, size: 64, rate: 1000000 }
//!   out: { type: sink, worker: rx }
//! links:
//!   - "gen.output -> out.input"
//!   - { link: "a.x -> b.y", size: 4096 }
//!   - { link: "b.out -> c.in", latency: true }
//! ```
//!
//! An app with `shards: N` (or `shards: [w1, w2]`, the workers by name; `shards: 1` is the app
//! itself) runs as N instances,
//! `NAME:0` … `NAME:N-1`, shard `i` on worker `shard<i>` (or the `i`th named): each a full
//! instance with its own state, told which shard it is ([`crate::AppContext::shard`]). A link
//! between two sharded apps of as many shards joins shard `i` to shard `i` (a region of the
//! graph, from interfaces that spread packets by their own hashing to the apps between them);
//! an app type that hands packets to the shard that owns them ([`crate::App::HANDS_OFF`]) has
//! ports `shard0` … `shard<N-1>` more, linked from each shard to every other. A document of the
//! graph ([`Graph::to_document`]) shows the app once, with its `shards:`.

use crate::app::{PortNames, PortSpec, Registry};
use crate::link::DEFAULT_LINK_SIZE;
use indexmap::IndexMap;
use serde::de::{MapAccess, Visitor};
use serde::{Deserialize, Deserializer};
use serde_saphyr::Spanned;
use std::fmt;
use std::path::{Path, PathBuf};

/// Name of the worker that runs apps without a `worker:` key.
pub const MAIN_WORKER: &str = "main";

/// Engine settings (`engine:` in the graph file).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct EngineConfig {
    /// Poll without sleeping when idle (lowest latency, one full core per worker).
    pub busy_poll: bool,
    /// Longest idle sleep in microseconds; sleeps grow from 1 µs to this.
    pub max_sleep_us: u64,
    /// Default link size in packets.
    pub link_size: usize,
    /// Packets in the pool (read when the process creates its pool).
    pub pool_packets: usize,
    /// Large packets for whole GSO super-frames (offloaded TCP from veth/TAP).
    pub pool_large_packets: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            busy_poll: false,
            max_sleep_us: 100,
            link_size: DEFAULT_LINK_SIZE,
            pool_packets: crate::pool::DEFAULT_PACKETS,
            pool_large_packets: crate::pool::DEFAULT_LARGE_PACKETS,
        }
    }
}

/// Settings of one worker thread (`workers:` in the graph file).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerConfig {
    /// CPU to pin the worker to.
    pub core: Option<usize>,
}

/// Which shard of a sharded app an instance is (defined beside the app context that carries it).
pub use crate::app::Shard;

/// The name of shard `index` of app `app`: a `:` no name in a file can hold.
pub fn shard_name(app: &str, index: usize) -> String {
    format!("{app}:{index}")
}

/// The port of a sharded app that hands packets to (output) or takes them from (input)
/// shard `index` of the same app.
pub fn handoff_port(index: usize) -> String {
    format!("shard{index}")
}

/// Shards an app may run as at most.
pub const MAX_SHARDS: usize = 64;

/// The worker of shard `index` when `shards:` gives a count.
fn shard_worker(index: usize) -> String {
    format!("shard{index}")
}

/// One app of the graph.
#[derive(Debug, Clone)]
pub struct AppDecl {
    pub name: String,
    pub kind: String,
    /// The app's own keys (without `type`, `worker` and an extension's keys), as given.
    pub config: serde_json::Value,
    pub worker: String,
    pub ports: PortSpec,
    pub line: usize,
    /// Line and column of each top-level key of the entry, for error messages.
    pub key_lines: IndexMap<String, (usize, usize)>,
    /// The shard this instance is, for an app with `shards:`.
    pub shard: Option<Shard>,
}

impl AppDecl {
    /// Where in the file a problem of this app's entry is, `message` saying what: at the key
    /// it is about — the message starts with the key's name, quotes it, or quotes the key's
    /// value (`no interface named `eth9``) — else at the app's line (column 0: not where on it).
    pub fn locate(&self, message: &str) -> (usize, usize) {
        let about = |key: &str| {
            let value = self.config.get(key).and_then(serde_json::Value::as_str);
            message.starts_with(&format!("{key}:"))
                || message.starts_with(&format!("{key} "))
                || message.contains(&format!("`{key}`"))
                || value.is_some_and(|v| !v.is_empty() && message.contains(&format!("`{v}`")))
        };
        self.key_lines
            .iter()
            .find(|(key, _)| about(key))
            .map_or((self.line, 0), |(_, &at)| at)
    }
}

/// One end of a link.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub struct Endpoint {
    pub app: String,
    pub port: String,
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.app, self.port)
    }
}

/// One link of the graph.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct LinkDecl {
    pub from: Endpoint,
    pub to: Endpoint,
    pub size: usize,
    /// Whether the link counts its packets' latency ([`crate::latency`]).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub latency: bool,
    #[serde(skip)]
    pub line: usize,
}

impl LinkDecl {
    /// The link's name as written in graph files: `a.out -> b.in`.
    pub fn spec(&self) -> String {
        format!("{} -> {}", self.from, self.to)
    }
}

/// The value of a key that a [`KeyExtension`] reads, with the key's place in the file.
#[derive(Debug, Clone, PartialEq)]
pub struct KeyValue {
    pub value: serde_json::Value,
    pub line: usize,
    pub column: usize,
}

/// An extension's keys of one app entry or of the file, in the order written.
pub type ExtensionKeys = IndexMap<String, KeyValue>;

/// Keys that a layer beside the engine reads from the same graph file (where apps run, on
/// which hosts). The parser checks their values with `check`, keeps them out of the apps'
/// configs and hands them over beside the graph ([`Graph::parse_extended`]); the graph
/// itself never holds them.
pub struct KeyExtension {
    /// Top-level keys beside `engine`, `workers`, `apps` and `links`.
    pub file_keys: &'static [&'static str],
    /// Keys of an app entry beside `type` and `worker`.
    pub app_keys: &'static [&'static str],
    /// Why the value of `key` is refused; the message names the key.
    pub check: fn(key: &str, value: &serde_json::Value) -> Result<(), String>,
    /// The type of an app whose entry names none, from its keys and the file's.
    pub default_type: fn(app: &ExtensionKeys, file: &ExtensionKeys) -> Option<&'static str>,
}

/// The engine's graph alone: no key beside the engine's is allowed.
const NO_EXTENSION: KeyExtension = KeyExtension {
    file_keys: &[],
    app_keys: &[],
    check: |_, _| Ok(()),
    default_type: |_, _| None,
};

/// A graph with the keys an extension read beside it.
#[derive(Debug, Clone)]
pub struct ExtendedGraph {
    pub graph: Graph,
    pub file_keys: ExtensionKeys,
    /// By app name; an app without extension keys has an empty entry.
    pub app_keys: IndexMap<String, ExtensionKeys>,
}

/// A validated graph.
#[derive(Debug, Clone)]
pub struct Graph {
    pub engine: EngineConfig,
    pub workers: IndexMap<String, WorkerConfig>,
    pub apps: IndexMap<String, AppDecl>,
    pub links: Vec<LinkDecl>,
    /// Folder relative paths in app configs are resolved from.
    pub base_dir: PathBuf,
}

/// One problem in a graph file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GraphError {
    pub line: usize,
    pub column: usize,
    pub message: String,
}

/// All problems found in a graph file, printed as `FILE:LINE:COL: message` with the line quoted.
#[derive(Debug, Clone)]
pub struct GraphErrors {
    pub file: String,
    pub text: String,
    pub errors: Vec<GraphError>,
}

impl fmt::Display for GraphErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.errors.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            if e.line == 0 {
                write!(f, "{}: {}", self.file, e.message)?;
                continue;
            }
            // Column 0: the line is known, not where on it (as compilers write it).
            if e.column == 0 {
                write!(f, "{}:{}: {}", self.file, e.line, e.message)?;
            } else {
                write!(f, "{}:{}:{}: {}", self.file, e.line, e.column, e.message)?;
            }
            if let Some(src) = self.text.lines().nth(e.line - 1) {
                write!(f, "\n {:>4} | {}", e.line, src)?;
            }
        }
        Ok(())
    }
}

impl std::error::Error for GraphErrors {}

impl GraphErrors {
    /// The problems of the graph file at `path`, its lines read again to be quoted.
    pub fn in_file(path: &Path, errors: Vec<GraphError>) -> GraphErrors {
        GraphErrors {
            file: path.display().to_string(),
            text: std::fs::read_to_string(path).unwrap_or_default(),
            errors,
        }
    }
}

/// A map that keeps order and the location of each key.
struct SpannedMap<V>(Vec<(Spanned<String>, V)>);

impl<'de, V: Deserialize<'de>> Deserialize<'de> for SpannedMap<V> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V2<V>(std::marker::PhantomData<V>);
        impl<'de, V: Deserialize<'de>> Visitor<'de> for V2<V> {
            type Value = SpannedMap<V>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a mapping")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Self::Value, A::Error> {
                let mut out = Vec::new();
                while let Some(k) = m.next_key::<Spanned<String>>()? {
                    out.push((k, m.next_value()?));
                }
                Ok(SpannedMap(out))
            }
        }
        d.deserialize_map(V2(std::marker::PhantomData))
    }
}

type RawApps = SpannedMap<Spanned<SpannedMap<Spanned<serde_json::Value>>>>;

/// The file's top level, each part with its place; keys other than the engine's are kept
/// for an extension to claim.
#[derive(Default)]
struct RawGraph {
    engine: Option<Spanned<serde_json::Value>>,
    workers: Option<SpannedMap<Spanned<serde_json::Value>>>,
    apps: Option<RawApps>,
    links: Option<Vec<Spanned<serde_json::Value>>>,
    others: Vec<(Spanned<String>, Spanned<serde_json::Value>)>,
}

impl<'de> Deserialize<'de> for RawGraph {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct TopLevel;
        impl<'de> Visitor<'de> for TopLevel {
            type Value = RawGraph;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a mapping with `apps` and `links`")
            }
            fn visit_unit<E: serde::de::Error>(self) -> Result<RawGraph, E> {
                Ok(RawGraph::default())
            }
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<RawGraph, A::Error> {
                let mut raw = RawGraph::default();
                while let Some(k) = m.next_key::<Spanned<String>>()? {
                    match k.value.as_str() {
                        "engine" => raw.engine = Some(m.next_value()?),
                        "workers" => raw.workers = Some(m.next_value()?),
                        "apps" => raw.apps = Some(m.next_value()?),
                        "links" => raw.links = Some(m.next_value()?),
                        _ => raw.others.push((k, m.next_value()?)),
                    }
                }
                Ok(raw)
            }
        }
        d.deserialize_map(TopLevel)
    }
}

fn loc<T>(s: &Spanned<T>) -> (usize, usize) {
    (s.referenced.line() as usize, s.referenced.column() as usize)
}

fn is_identifier(s: &str) -> bool {
    !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

fn parse_endpoint(s: &str) -> Result<Endpoint, String> {
    let s = s.trim();
    let (app, port) = s
        .split_once('.')
        .ok_or_else(|| format!("`{s}` is not APP.PORT (for example `gen.output`)"))?;
    if !is_identifier(app) || !is_identifier(port) {
        return Err(format!(
            "`{s}`: app and port names use letters, digits, `_` and `-` (APP.PORT)"
        ));
    }
    Ok(Endpoint {
        app: app.into(),
        port: port.into(),
    })
}

fn parse_link_spec(s: &str) -> Result<(Endpoint, Endpoint), String> {
    let (a, b) = s
        .split_once("->")
        .ok_or_else(|| format!("link `{s}` must be written \"APP.PORT -> APP.PORT\""))?;
    Ok((parse_endpoint(a)?, parse_endpoint(b)?))
}

/// A graph file's text, read, with what its parse needs: its name for errors and the folder
/// its relative paths start from.
pub struct GraphFile {
    pub text: String,
    pub name: String,
    pub base: PathBuf,
}

impl GraphFile {
    /// Reads `path`; an unreadable file is an error naming it, as a parse error would.
    pub fn read(path: &Path) -> Result<GraphFile, GraphErrors> {
        let name = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| GraphErrors {
            file: name.clone(),
            text: String::new(),
            errors: vec![GraphError {
                line: 0,
                column: 0,
                message: format!("cannot read graph file: {e}"),
            }],
        })?;
        let base = path.parent().map(Path::to_path_buf).unwrap_or_default();
        Ok(GraphFile { text, name, base })
    }
}

impl Graph {
    /// What the apps would meet starting on this host (`App::check_host`): interfaces and
    /// files that are missing, each a warning at its entry — a graph may be meant for another
    /// host. A shard's app is checked once.
    pub fn host_warnings(&self, registry: &Registry) -> Vec<GraphError> {
        let mut out = Vec::new();
        for decl in self.apps.values() {
            if decl.shard.as_ref().is_some_and(|s| s.index != 0) {
                continue;
            }
            let Some(t) = registry.get(&decl.kind) else {
                continue;
            };
            let Ok(config) = t.parse(&decl.config) else {
                continue;
            };
            let app = decl.shard.as_ref().map_or(decl.name.as_str(), |s| &s.of);
            for problem in t.check_host(&config, &self.base_dir) {
                let (line, column) = decl.locate(&problem);
                out.push(GraphError {
                    line,
                    column,
                    message: format!("warning: app `{app}`: {problem}"),
                });
            }
        }
        out
    }

    /// Reads and validates a graph file.
    pub fn load(path: &Path, registry: &Registry) -> Result<Graph, GraphErrors> {
        let file = GraphFile::read(path)?;
        Graph::parse(&file.text, &file.name, &file.base, registry)
    }

    /// Parses and validates graph text; `file` names it in errors.
    pub fn parse(
        text: &str,
        file: &str,
        base_dir: &Path,
        registry: &Registry,
    ) -> Result<Graph, GraphErrors> {
        Graph::parse_extended(text, file, base_dir, registry, &NO_EXTENSION).map(|g| g.graph)
    }

    /// Parses and validates graph text that may also hold `extension`'s keys, which come
    /// back beside the graph; `file` names it in errors.
    pub fn parse_extended(
        text: &str,
        file: &str,
        base_dir: &Path,
        registry: &Registry,
        extension: &KeyExtension,
    ) -> Result<ExtendedGraph, GraphErrors> {
        let mut errors = Vec::new();
        let graph = parse_inner(text, base_dir, registry, extension, &mut errors);
        if errors.is_empty() {
            Ok(graph.expect("graph without errors"))
        } else {
            errors.sort_by_key(|e| (e.line, e.column));
            Err(GraphErrors {
                file: file.into(),
                text: text.into(),
                errors,
            })
        }
    }

    /// The graph in the graph file's own shape (`engine`, `workers`, `apps`, `links`), as
    /// JSON; since JSON is YAML, [`Graph::parse`] of its text gives this graph back. Used to read
    /// the running graph and to edit it one app or link at a time.
    pub fn to_document(&self) -> serde_json::Value {
        use serde_json::{json, Map, Value};
        let mut apps = Map::new();
        for a in self.apps.values() {
            let mut entry = Map::new();
            entry.insert("type".into(), json!(a.kind));
            match &a.shard {
                // A sharded app once, as written: its shards' workers, or their count when
                // they are the default ones.
                Some(s) if s.index != 0 => continue,
                Some(s) => {
                    let workers: Vec<&str> = (0..s.count)
                        .map(|i| self.apps[&shard_name(&s.of, i)].worker.as_str())
                        .collect();
                    let default = workers
                        .iter()
                        .enumerate()
                        .all(|(i, w)| *w == shard_worker(i));
                    let shards = if default {
                        json!(s.count)
                    } else {
                        json!(workers)
                    };
                    entry.insert("shards".into(), shards);
                }
                None if a.worker != MAIN_WORKER => {
                    entry.insert("worker".into(), json!(a.worker));
                }
                None => {}
            }
            if let Value::Object(c) = &a.config {
                entry.extend(c.clone());
            }
            let name = a.shard.as_ref().map_or(&a.name, |s| &s.of);
            apps.insert(name.clone(), Value::Object(entry));
        }
        // A sharded region's links once (shard 0's), by the apps' names; no hand-off link.
        let shard_of = |app: &str| self.apps.get(app).and_then(|a| a.shard.as_ref());
        let links: Vec<Value> = self
            .links
            .iter()
            .filter_map(|l| match (shard_of(&l.from.app), shard_of(&l.to.app)) {
                (Some(a), Some(b)) if a.of == b.of => None,
                (Some(a), _) if a.index != 0 => None,
                (a, b) => {
                    let end = |e: &Endpoint, s: Option<&Shard>| Endpoint {
                        app: s.map_or(e.app.clone(), |s| s.of.clone()),
                        port: e.port.clone(),
                    };
                    Some(LinkDecl {
                        from: end(&l.from, a),
                        to: end(&l.to, b),
                        ..l.clone()
                    })
                }
            })
            .map(|l| {
                let mut entry = Map::new();
                entry.insert("link".into(), json!(l.spec()));
                if l.size != self.engine.link_size {
                    entry.insert("size".into(), json!(l.size));
                }
                if l.latency {
                    entry.insert("latency".into(), json!(true));
                }
                match entry.len() {
                    1 => json!(l.spec()),
                    _ => Value::Object(entry),
                }
            })
            .collect();
        json!({
            "engine": self.engine,
            "workers": self.workers,
            "apps": apps,
            "links": links,
        })
    }

    /// Graphviz DOT of the graph: apps as boxes, links as edges labelled with their ports.
    pub fn to_dot(&self) -> String {
        let mut s = String::from("digraph stitch {\n  rankdir=LR;\n  node [shape=box];\n");
        for a in self.apps.values() {
            let worker = if a.worker == MAIN_WORKER {
                String::new()
            } else {
                format!("\\n@{}", a.worker)
            };
            s += &format!(
                "  \"{}\" [label=\"{}\\n({}){}\"];\n",
                a.name, a.name, a.kind, worker
            );
        }
        for l in &self.links {
            s += &format!(
                "  \"{}\" -> \"{}\" [taillabel=\"{}\", headlabel=\"{}\"];\n",
                l.from.app, l.to.app, l.from.port, l.to.port
            );
        }
        s + "}\n"
    }
}

fn err(errors: &mut Vec<GraphError>, (line, column): (usize, usize), message: String) {
    errors.push(GraphError {
        line,
        column,
        message,
    });
}

fn parse_inner(
    text: &str,
    base_dir: &Path,
    registry: &Registry,
    extension: &KeyExtension,
    errors: &mut Vec<GraphError>,
) -> Option<ExtendedGraph> {
    let raw = read_yaml(text, errors)?;
    let file_keys = read_file_keys(raw.others, extension, errors);
    let engine = match &raw.engine {
        None => EngineConfig::default(),
        Some(v) => serde_json::from_value(v.value.clone()).unwrap_or_else(|e| {
            err(errors, loc(v), format!("engine: {e}"));
            EngineConfig::default()
        }),
    };
    let mut workers = parse_workers(raw.workers, errors);
    let mut apps: IndexMap<String, AppDecl> = IndexMap::new();
    let mut app_keys = IndexMap::new();
    // Apps named in the file, valid or not: a link to an app whose settings were refused is
    // not an error of its own (the app's error says what to fix).
    let mut declared = std::collections::HashSet::new();
    let mut sharded: IndexMap<String, Vec<String>> = IndexMap::new();
    for (name, entry) in raw.apps.map(|m| m.0).unwrap_or_default() {
        declared.insert(name.value.clone());
        let context = AppContext {
            registry,
            extension,
            file_keys: &file_keys,
            text,
        };
        if let Some((app, keys, shards)) = parse_app(name, entry, &context, errors) {
            app_keys.insert(app.name.clone(), keys);
            let mut app = app;
            match shards {
                // One shard is the app itself, on the worker named.
                Some(workers) if workers.len() == 1 && workers[0] != shard_worker(0) => {
                    app.worker = workers[0].clone();
                }
                Some(workers) if workers.len() == 1 => {}
                Some(workers) => {
                    sharded.insert(app.name.clone(), workers);
                }
                None => {}
            }
            apps.insert(app.name.clone(), app);
        }
    }
    let mut links: Vec<LinkDecl> = Vec::new();
    for item in raw.links.unwrap_or_default() {
        let refused = |app: &str| declared.contains(app) && !apps.contains_key(app);
        if let Some(l) = parse_link(&item, &apps, &links, engine.link_size, errors, refused) {
            let count = |app: &str| sharded.get(app).map_or(1, Vec::len);
            let (a, b) = (count(&l.from.app), count(&l.to.app));
            if a != b {
                let msg = format!(
                    "link `{}`: `{}` runs as {a} shard(s) and `{}` as {b}: a link joins apps of as \
                     many shards, shard to shard (give both the same `shards:`)",
                    l.spec(),
                    l.from.app,
                    l.to.app
                );
                err(errors, loc(&item), msg);
                continue;
            }
            links.push(l);
        }
    }
    let (apps, links) = expand_shards(apps, links, &sharded, registry, engine.link_size);
    // A layer beside the engine reads each shard's keys as its app's.
    for (name, workers) in &sharded {
        if let Some(keys) = app_keys.shift_remove(name) {
            for i in 0..workers.len() {
                app_keys.insert(shard_name(name, i), keys.clone());
            }
        }
    }
    for a in apps.values() {
        if !workers.contains_key(&a.worker) {
            workers.insert(a.worker.clone(), WorkerConfig::default());
        }
    }
    let graph = Graph {
        engine,
        workers,
        apps,
        links,
        base_dir: base_dir.to_path_buf(),
    };
    Some(ExtendedGraph {
        graph,
        file_keys,
        app_keys,
    })
}

/// The top-level keys beside the engine's: the extension's, checked; any other is an error.
fn read_file_keys(
    others: Vec<(Spanned<String>, Spanned<serde_json::Value>)>,
    extension: &KeyExtension,
    errors: &mut Vec<GraphError>,
) -> ExtensionKeys {
    let mut keys = ExtensionKeys::new();
    for (k, v) in others {
        if !extension.file_keys.contains(&k.value.as_str()) {
            let known: Vec<String> = ["engine", "workers", "apps", "links"]
                .iter()
                .chain(extension.file_keys)
                .map(|k| format!("`{k}`"))
                .collect();
            let msg = format!(
                "unknown top-level key `{}` (a graph file has {})",
                k.value,
                known.join(", ")
            );
            err(errors, loc(&k), msg);
            continue;
        }
        match (extension.check)(&k.value, &v.value) {
            Ok(()) => {
                let (line, column) = loc(&k);
                let value = v.value;
                keys.insert(
                    k.value,
                    KeyValue {
                        value,
                        line,
                        column,
                    },
                );
            }
            Err(m) => err(errors, loc(&v), m),
        }
    }
    keys
}

/// What reading an app entry needs beside the entry.
struct AppContext<'a> {
    registry: &'a Registry,
    extension: &'a KeyExtension,
    file_keys: &'a ExtensionKeys,
    /// The file, for the place of a key inside a setting (`rules[1].colour`).
    text: &'a str,
}

/// The file's YAML, or its syntax error (the message alone: `GraphErrors` prints the place).
fn read_yaml(text: &str, errors: &mut Vec<GraphError>) -> Option<RawGraph> {
    match serde_saphyr::from_str(text) {
        Ok(r) => Some(r),
        Err(e) => {
            let (line, column) = e
                .location()
                .map(|l| (l.line() as usize, l.column() as usize))
                .unwrap_or((0, 0));
            let full = e.without_snippet().to_string();
            let msg = full.lines().next().unwrap_or_default();
            let msg = msg.trim_start_matches("error: ");
            let msg = match msg.split_once(": ") {
                Some((head, rest)) if head.starts_with("line ") => rest,
                _ => msg,
            };
            let msg = msg.replace(", set DuplicateKeyPolicy in Options if acceptable", "");
            err(errors, (line, column), msg);
            None
        }
    }
}

fn parse_workers(
    raw: Option<SpannedMap<Spanned<serde_json::Value>>>,
    errors: &mut Vec<GraphError>,
) -> IndexMap<String, WorkerConfig> {
    let mut workers = IndexMap::new();
    for (name, v) in raw.map(|m| m.0).unwrap_or_default() {
        match serde_json::from_value::<WorkerConfig>(v.value.clone()) {
            Ok(w) => {
                workers.insert(name.value, w);
            }
            Err(e) => err(errors, loc(&v), format!("worker `{}`: {e}", name.value)),
        }
    }
    workers
}

/// Where the key an "unknown field `NAME`" message names is written first at or after `from`
/// (line, column) in `text`: serde stops at the first unknown key, so its first occurrence
/// after the setting that holds it is the one.
fn unknown_key_after(text: &str, from: (usize, usize), message: &str) -> Option<(usize, usize)> {
    let name = message
        .strip_prefix("unknown field `")?
        .split('`')
        .next()
        .filter(|n| !n.is_empty())?;
    let (line, column) = from;
    for (i, l) in text.lines().enumerate().skip(line.checked_sub(1)?) {
        let start = if i + 1 == line {
            column.saturating_sub(1)
        } else {
            0
        };
        let Some(rest) = l.get(start..) else { continue };
        let mut at = 0;
        while let Some(found) = rest[at..].find(name) {
            let p = at + found;
            let before = rest[..p].chars().next_back();
            let after = rest[p + name.len()..].trim_start();
            let quoted = before.is_some_and(|c| c == '"' || c == '\'');
            let starts = before.is_none_or(|c| c.is_whitespace() || "{,[-".contains(c)) || quoted;
            let after = if quoted {
                &after[1.min(after.len())..]
            } else {
                after
            };
            if starts && after.trim_start().starts_with(':') {
                return Some((i + 1, start + p + 1 - usize::from(quoted)));
            }
            at = p + name.len();
        }
    }
    None
}

/// The keys of an app entry that the graph reads itself, the extension's keys, and the rest:
/// the app's config.
struct AppKeys {
    kind: Option<(String, (usize, usize))>,
    worker: String,
    /// The workers of the app's shards, for an app with `shards:`.
    shards: Option<Vec<String>>,
    extension: ExtensionKeys,
    config: serde_json::Map<String, serde_json::Value>,
    key_lines: IndexMap<String, (usize, usize)>,
}

/// One entry of `apps:`, checked against its type (its config parsed, its ports declared).
fn parse_app(
    name: Spanned<String>,
    entry: Spanned<SpannedMap<Spanned<serde_json::Value>>>,
    context: &AppContext,
    errors: &mut Vec<GraphError>,
) -> Option<(AppDecl, ExtensionKeys, Option<Vec<String>>)> {
    let registry = context.registry;
    let at = loc(&name);
    let name = name.value;
    if !is_identifier(&name) {
        let msg = format!("app name `{name}`: use letters, digits, `_` and `-`");
        err(errors, at, msg);
        return None;
    }
    let keys = read_app_keys(&name, entry.value, context.extension, errors);
    let kind = keys.kind.clone().or_else(|| {
        (context.extension.default_type)(&keys.extension, context.file_keys)
            .map(|t| (t.to_string(), at))
    });
    let Some((kind, kind_at)) = kind else {
        let msg = format!("app `{name}` has no `type` (for example `type: forwarder`)");
        err(errors, at, msg);
        return None;
    };
    let Some(app_type) = registry.get(&kind) else {
        let known: Vec<&str> = registry.types().map(|t| t.name).collect();
        let msg = format!(
            "app `{name}`: unknown app type `{kind}` (known: {})",
            known.join(", ")
        );
        err(errors, kind_at, msg);
        return None;
    };
    let config = serde_json::Value::Object(keys.config);
    let ports = match app_type.parse(&config) {
        Err(e) => {
            let key = e.path.split(['.', '[']).next().unwrap_or_default();
            let key_at = keys.key_lines.get(key).copied().unwrap_or(at);
            // An unknown key inside a setting (a rule's, an interface's) is at its own place.
            let key_at = (e.path != key)
                .then(|| unknown_key_after(context.text, key_at, &e.message))
                .flatten()
                .unwrap_or(key_at);
            let what = if e.path.is_empty() || e.path == "." {
                String::new()
            } else {
                format!(" key `{}`", e.path)
            };
            let msg = e
                .message
                .replace("unknown field", "unknown key")
                .replace(", there are no fields", " (this app takes no settings)");
            err(
                errors,
                key_at,
                format!("app `{name}` ({kind}){what}: {msg}"),
            );
            return None;
        }
        Ok(parsed) => match app_type.declare(&parsed) {
            Ok(p) => p,
            Err(e) => {
                // An error that names one of the app's keys first is that key's line.
                let message = e.to_string();
                let named = (keys.key_lines.iter())
                    .filter(|(k, _)| {
                        message
                            .strip_prefix(k.as_str())
                            .is_some_and(|rest| rest.starts_with([' ', ':']))
                    })
                    .map(|(_, at)| *at)
                    .next();
                err(
                    errors,
                    named.unwrap_or(at),
                    format!("app `{name}` ({kind}): {message}"),
                );
                return None;
            }
        },
    };
    if let (Some(_), Some(&w_at)) = (&keys.shards, keys.key_lines.get("worker")) {
        let msg = format!(
            "app `{name}`: name the workers of its shards in `shards: [..]`, not `worker:`"
        );
        err(errors, w_at, msg);
        return None;
    }
    let decl = AppDecl {
        name,
        kind,
        config,
        worker: keys.worker,
        ports,
        line: at.0,
        key_lines: keys.key_lines,
        shard: None,
    };
    Some((decl, keys.extension, keys.shards))
}

/// Sorts an app entry's keys into the graph's own (`type`, `worker`), the extension's and
/// the app's config.
fn read_app_keys(
    name: &str,
    entry: SpannedMap<Spanned<serde_json::Value>>,
    extension: &KeyExtension,
    errors: &mut Vec<GraphError>,
) -> AppKeys {
    let mut keys = AppKeys {
        kind: None,
        worker: MAIN_WORKER.to_string(),
        shards: None,
        extension: ExtensionKeys::new(),
        config: serde_json::Map::new(),
        key_lines: IndexMap::new(),
    };
    for (k, v) in entry.0 {
        keys.key_lines.insert(k.value.clone(), loc(&k));
        let at = loc(&v);
        match k.value.as_str() {
            "type" => match v.value.as_str() {
                Some(t) => keys.kind = Some((t.to_string(), at)),
                None => err(errors, at, format!("app `{name}`: `type` must be a string")),
            },
            "worker" => match v.value.as_str() {
                Some(w) if is_identifier(w) => keys.worker = w.to_string(),
                _ => err(errors, at, format!("app `{name}`: `worker` must be a name")),
            },
            "shards" => match read_shards(&v.value) {
                Ok(workers) => keys.shards = Some(workers),
                Err(m) => err(errors, at, format!("app `{name}`: {m}")),
            },
            k if extension.app_keys.contains(&k) => match (extension.check)(k, &v.value) {
                Ok(()) => {
                    let (line, column) = keys.key_lines[k];
                    let value = KeyValue {
                        value: v.value,
                        line,
                        column,
                    };
                    keys.extension.insert(k.to_string(), value);
                }
                Err(m) => err(errors, at, format!("app `{name}`: {m}")),
            },
            _ => {
                keys.config.insert(k.value, v.value);
            }
        }
    }
    keys
}

/// `shards: N` (workers `shard0` …) or `shards: [w1, w2, …]`: the workers of the shards.
fn read_shards(v: &serde_json::Value) -> Result<Vec<String>, String> {
    let workers: Vec<String> = match v {
        serde_json::Value::Number(n) => match n.as_u64() {
            Some(n) if (1..=MAX_SHARDS as u64).contains(&n) => {
                (0..n as usize).map(shard_worker).collect()
            }
            _ => {
                return Err(format!(
                    "`shards` is a count from 1 to {MAX_SHARDS} or a list of workers"
                ))
            }
        },
        serde_json::Value::Array(a) => {
            let names: Option<Vec<String>> = a
                .iter()
                .map(|w| w.as_str().filter(|w| is_identifier(w)).map(str::to_string))
                .collect();
            names.ok_or("`shards`: each worker is a name")?
        }
        _ => {
            return Err(format!(
                "`shards` is a count from 1 to {MAX_SHARDS} or a list of workers"
            ))
        }
    };
    if workers.is_empty() || workers.len() > MAX_SHARDS {
        return Err(format!("`shards`: from 1 to {MAX_SHARDS} workers"));
    }
    let mut seen = std::collections::HashSet::new();
    if let Some(w) = workers.iter().find(|w| !seen.insert(*w)) {
        return Err(format!(
            "`shards`: worker `{w}` is given twice (one shard per worker)"
        ));
    }
    Ok(workers)
}

/// Each sharded app as its shards, each link of a sharded region as one link per shard, and
/// the hand-off links between the shards of an app type that asks for them.
fn expand_shards(
    apps: IndexMap<String, AppDecl>,
    links: Vec<LinkDecl>,
    sharded: &IndexMap<String, Vec<String>>,
    registry: &Registry,
    link_size: usize,
) -> (IndexMap<String, AppDecl>, Vec<LinkDecl>) {
    if sharded.is_empty() {
        return (apps, links);
    }
    let count = |app: &str| sharded.get(app).map_or(1, Vec::len);
    let mut out_links = Vec::new();
    for l in links {
        let n = count(&l.from.app);
        if n == 1 && count(&l.to.app) == 1 {
            out_links.push(l);
            continue;
        }
        let end = |e: &Endpoint, i: usize| Endpoint {
            app: shard_name(&e.app, i),
            port: e.port.clone(),
        };
        for i in 0..n {
            out_links.push(LinkDecl {
                from: end(&l.from, i),
                to: end(&l.to, i),
                ..l.clone()
            });
        }
    }
    let mut out_apps = IndexMap::new();
    for (name, decl) in apps {
        let Some(workers) = sharded.get(&name) else {
            out_apps.insert(name, decl);
            continue;
        };
        let n = workers.len();
        let hands_off = registry.get(&decl.kind).is_some_and(|t| t.hands_off) && n > 1;
        let mut ports = decl.ports.clone();
        if hands_off {
            for names in [&mut ports.inputs, &mut ports.outputs] {
                if let PortNames::Fixed(v) = names {
                    v.extend((0..n).map(handoff_port));
                }
            }
            for i in 0..n {
                for j in (0..n).filter(|&j| j != i) {
                    out_links.push(LinkDecl {
                        from: Endpoint {
                            app: shard_name(&name, i),
                            port: handoff_port(j),
                        },
                        to: Endpoint {
                            app: shard_name(&name, j),
                            port: handoff_port(i),
                        },
                        size: link_size,
                        latency: false,
                        line: decl.line,
                    });
                }
            }
        }
        for (i, w) in workers.iter().enumerate() {
            let shard = AppDecl {
                name: shard_name(&name, i),
                worker: w.clone(),
                ports: ports.clone(),
                shard: Some(Shard {
                    of: name.clone(),
                    index: i,
                    count: n,
                }),
                ..decl.clone()
            };
            out_apps.insert(shard.name.clone(), shard);
        }
    }
    (out_apps, out_links)
}

/// One entry of `links:`, checked against the apps' ports and the links before it.
fn parse_link(
    item: &Spanned<serde_json::Value>,
    apps: &IndexMap<String, AppDecl>,
    links: &[LinkDecl],
    default_size: usize,
    errors: &mut Vec<GraphError>,
    refused: impl Fn(&str) -> bool,
) -> Option<LinkDecl> {
    let at = loc(item);
    let LinkEntry {
        spec,
        size,
        latency,
    } = match read_link_entry(&item.value) {
        Ok(x) => x,
        Err(e) => {
            err(errors, at, e);
            return None;
        }
    };
    let (from, to) = match parse_link_spec(&spec) {
        Ok(x) => x,
        Err(e) => {
            err(errors, at, e);
            return None;
        }
    };
    if refused(&from.app) || refused(&to.app) {
        return None;
    }
    let problems = link_problems(&spec, &from, &to, apps, links);
    let ok = problems.is_empty();
    for p in problems {
        err(errors, at, p);
    }
    ok.then(|| LinkDecl {
        from,
        to,
        size: size.unwrap_or(default_size),
        latency,
        line: at.0,
    })
}

/// One entry of `links:` as written.
struct LinkEntry {
    spec: String,
    size: Option<usize>,
    latency: bool,
}

/// `"A.P -> B.Q"` or `{ link: "A.P -> B.Q", size: N, latency: BOOL }`.
fn read_link_entry(v: &serde_json::Value) -> Result<LinkEntry, String> {
    let m = match v {
        serde_json::Value::String(s) => {
            return Ok(LinkEntry {
                spec: s.clone(),
                size: None,
                latency: false,
            })
        }
        serde_json::Value::Object(m) => m,
        _ => {
            return Err(
                "a link is \"APP.PORT -> APP.PORT\" or { link: ..., size: N, latency: true }"
                    .into(),
            )
        }
    };
    if let Some(k) = (m.keys()).find(|k| !["link", "size", "latency"].contains(&k.as_str())) {
        return Err(format!(
            "link: unknown key `{k}` (use `link`, `size` and `latency`)"
        ));
    }
    let Some(spec) = m.get("link").and_then(|v| v.as_str()) else {
        return Err("link: `link: \"APP.PORT -> APP.PORT\"` is missing".into());
    };
    let size = match m.get("size").map(|v| v.as_u64()) {
        None => None,
        Some(Some(n)) if (2..=1 << 20).contains(&n) => Some(n as usize),
        Some(_) => return Err(format!("link `{spec}`: size must be 2..=1048576 packets")),
    };
    let latency = match m.get("latency") {
        None => false,
        Some(serde_json::Value::Bool(b)) => *b,
        Some(_) => return Err(format!("link `{spec}`: latency is true or false")),
    };
    Ok(LinkEntry {
        spec: spec.to_string(),
        size,
        latency,
    })
}

/// What is wrong with linking `from` to `to`: an app or port that does not exist, an end
/// already linked by an earlier entry.
fn link_problems(
    spec: &str,
    from: &Endpoint,
    to: &Endpoint,
    apps: &IndexMap<String, AppDecl>,
    links: &[LinkDecl],
) -> Vec<String> {
    let mut problems = Vec::new();
    for (end, side) in [(from, "output"), (to, "input")] {
        let Some(a) = apps.get(&end.app) else {
            problems.push(format!("link `{spec}`: no app named `{}`", end.app));
            continue;
        };
        let names = if side == "output" {
            &a.ports.outputs
        } else {
            &a.ports.inputs
        };
        if !names.accepts(&end.port) {
            problems.push(format!(
                "link `{spec}`: app `{}` ({}) has no {side} port `{}` ({side}s: {})",
                end.app,
                a.kind,
                end.port,
                names.describe()
            ));
        }
    }
    if let Some(prev) = links.iter().find(|l| l.from == *from) {
        problems.push(format!(
            "link `{spec}`: output `{from}` is already linked on line {}",
            prev.line
        ));
    }
    if let Some(prev) = links.iter().find(|l| l.to == *to) {
        problems.push(format!(
            "link `{spec}`: input `{to}` is already linked on line {}",
            prev.line
        ));
    }
    problems
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unknown_key_inside_a_setting_is_found_where_it_is_written() {
        let text = "apps:\n  fw:\n    type: firewall\n    rules:\n      - { action: accept }\n      - { action: drop, colour: blue }\n      - { \"size\": 3 }\n";
        let message = "unknown field `colour`, expected one of `action`";
        assert_eq!(unknown_key_after(text, (4, 5), message), Some((6, 25)));
        // Not a word that only contains the name, and a quoted key at its quote.
        let text = "apps:\n  a:\n    rules: [{ xsize: 1 }, { \"size\": 2 }]\n";
        assert_eq!(
            unknown_key_after(text, (3, 5), "unknown field `size`, expected `x`"),
            Some((3, 29))
        );
        assert_eq!(
            unknown_key_after(text, (3, 5), "invalid type: string"),
            None
        );
    }
    use crate::app::{App, AppContext, AppError, AppType, PortSpec};

    #[derive(schemars::JsonSchema, serde::Serialize, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct ThingConfig {
        #[serde(default)]
        size: u32,
    }
    struct Thing;
    impl App for Thing {
        type Config = ThingConfig;
        fn declare(c: &ThingConfig) -> Result<PortSpec, AppError> {
            if c.size > 9216 {
                return Err("size must be at most 9216".into());
            }
            Ok(PortSpec::filter())
        }
        fn new(_: ThingConfig, _: &mut AppContext) -> Result<Self, AppError> {
            Ok(Thing)
        }
    }

    /// A thing whose shards hand packets to one another.
    struct Owner;
    impl App for Owner {
        type Config = ThingConfig;
        const HANDS_OFF: bool = true;
        fn declare(_: &ThingConfig) -> Result<PortSpec, AppError> {
            Ok(PortSpec::filter())
        }
        fn new(_: ThingConfig, _: &mut AppContext) -> Result<Self, AppError> {
            Ok(Owner)
        }
    }

    fn registry() -> Registry {
        let mut r = Registry::new();
        r.register(AppType::of::<Thing>("thing", "test app"));
        r
    }

    fn registry_with_owner() -> Registry {
        let mut r = registry();
        r.register(AppType::of::<Owner>("owner", "test app that hands off"));
        r
    }

    #[test]
    fn a_sharded_region_runs_shard_to_shard_and_reads_back_as_written() {
        let text = "apps:\n  a: { type: thing, shards: 2 }\n  b: { type: owner, shards: 2, size: 3 }\n  c: { type: thing, shards: [wx, wy] }\n  d: { type: thing }\nlinks:\n  - \"a.output -> b.input\"\n  - { link: \"b.output -> c.input\", size: 64 }\n";
        let g = Graph::parse(text, "g.yaml", Path::new("."), &registry_with_owner()).unwrap();
        let names: Vec<&str> = g.apps.keys().map(String::as_str).collect();
        assert_eq!(names, ["a:0", "a:1", "b:0", "b:1", "c:0", "c:1", "d"]);
        assert_eq!(
            g.apps["b:1"].shard,
            Some(Shard {
                of: "b".into(),
                index: 1,
                count: 2
            })
        );
        assert_eq!(
            (g.apps["a:1"].worker.as_str(), g.apps["c:1"].worker.as_str()),
            ("shard1", "wy")
        );
        assert_eq!(g.apps["b:0"].config, serde_json::json!({ "size": 3 }));
        let specs: Vec<String> = g.links.iter().map(|l| l.spec()).collect();
        assert_eq!(
            specs,
            [
                "a:0.output -> b:0.input",
                "a:1.output -> b:1.input",
                "b:0.output -> c:0.input",
                "b:1.output -> c:1.input",
                "b:0.shard1 -> b:1.shard0",
                "b:1.shard0 -> b:0.shard1",
            ]
        );
        assert_eq!(g.links[3].size, 64);
        // Read back: each app once with its shards, each link once, no hand-off link.
        let doc = g.to_document();
        assert_eq!(
            doc["apps"]["b"],
            serde_json::json!({ "type": "owner", "shards": 2, "size": 3 })
        );
        assert_eq!(doc["apps"]["c"]["shards"], serde_json::json!(["wx", "wy"]));
        assert_eq!(
            doc["links"],
            serde_json::json!(["a.output -> b.input", { "link": "b.output -> c.input", "size": 64 }])
        );
        let again = Graph::parse(
            &doc.to_string(),
            "g.yaml",
            Path::new("."),
            &registry_with_owner(),
        )
        .unwrap();
        let specs_again: Vec<String> = again.links.iter().map(|l| l.spec()).collect();
        assert_eq!(specs_again, specs);
        assert_eq!(
            again.apps.keys().collect::<Vec<_>>(),
            g.apps.keys().collect::<Vec<_>>()
        );
    }

    #[test]
    fn shards_that_do_not_fit_are_refused_at_their_line() {
        let two_and_one = "apps:\n  a: { type: thing, shards: 2 }\n  d: { type: thing }\nlinks:\n  - \"a.output -> d.input\"\n";
        let (line, msg) = first_error(two_and_one);
        assert_eq!(line, 5);
        assert!(msg.contains("`a` runs as 2 shard(s) and `d` as 1"), "{msg}");
        for (text, want) in [
            (
                "apps:\n  a: { type: thing, shards: 0 }\n",
                "a count from 1 to 64",
            ),
            (
                "apps:\n  a: { type: thing, shards: [x, x] }\n",
                "`x` is given twice",
            ),
            (
                "apps:\n  a: { type: thing, shards: 2, worker: w }\n",
                "not `worker:`",
            ),
        ] {
            let (line, msg) = first_error(text);
            assert_eq!(line, 2, "{msg}");
            assert!(msg.contains(want), "{msg}");
        }
    }

    fn errors(text: &str) -> Vec<(usize, String)> {
        match Graph::parse(text, "g.yaml", Path::new("."), &registry()) {
            Ok(_) => vec![],
            Err(e) => e.errors.into_iter().map(|e| (e.line, e.message)).collect(),
        }
    }

    fn first_error(text: &str) -> (usize, String) {
        errors(text).into_iter().next().expect("an error")
    }

    /// An extension as a layer beside the engine would declare it: a file-wide default and a key per
    /// app, one value of which gives apps without a type one.
    const PINS: KeyExtension = KeyExtension {
        file_keys: &["zone"],
        app_keys: &["zone", "pin"],
        check: |key, v| match v.as_str() {
            Some(_) => Ok(()),
            None => Err(format!("`{key}` must be a name")),
        },
        default_type: |app, file| {
            let zone = app.get("zone").or_else(|| file.get("zone"))?;
            (zone.value == "things").then_some("thing")
        },
    };

    fn parse_pinned(text: &str) -> Result<ExtendedGraph, Vec<(usize, String)>> {
        Graph::parse_extended(text, "g.yaml", Path::new("."), &registry(), &PINS)
            .map_err(|e| e.errors.into_iter().map(|e| (e.line, e.message)).collect())
    }

    #[test]
    fn an_extensions_keys_come_back_beside_the_graph_with_their_places() {
        let text = "zone: things\napps:\n  a: { size: 2, pin: h1 }\n  b:\n    type: thing\n    zone: west\n";
        let g = parse_pinned(text).unwrap();
        assert_eq!(
            g.graph.apps["a"].kind, "thing",
            "the file's zone gave its type"
        );
        assert_eq!(g.graph.apps["a"].config, serde_json::json!({ "size": 2 }));
        assert_eq!(g.app_keys["a"]["pin"].value, "h1");
        assert_eq!(
            (g.app_keys["b"]["zone"].line, g.app_keys["b"]["zone"].column),
            (6, 5)
        );
        assert_eq!(g.file_keys["zone"].line, 1);
        assert!(g.graph.to_document()["apps"]["a"].get("pin").is_none());
        assert_eq!(
            parse_pinned("apps:\n  a: { type: thing, pin: [h1] }\n").unwrap_err(),
            [(2, "app `a`: `pin` must be a name".to_string())]
        );
        assert_eq!(
            parse_pinned("zone: 3\napps: {}\n").unwrap_err(),
            [(1, "`zone` must be a name".to_string())]
        );
    }

    #[test]
    fn the_engines_graph_refuses_an_extensions_keys() {
        let (line, msg) = first_error("zone: things\napps:\n  a: { type: thing }\n");
        assert_eq!(line, 1);
        assert_eq!(
            msg,
            "unknown top-level key `zone` (a graph file has `engine`, `workers`, `apps`, `links`)"
        );
        let (line, msg) = first_error("apps:\n  a: { type: thing, pin: h1 }\n");
        assert_eq!(line, 2);
        assert!(msg.contains("unknown key `pin`"), "{msg}");
        let (_, msg) = first_error("apps:\n  a: { size: 1, zone: things }\n");
        assert!(msg.contains("has no `type`"), "{msg}");
    }

    #[test]
    fn valid_graph_parses_with_defaults_and_workers() {
        let g = Graph::parse(
            "engine: { link_size: 512 }\nworkers: { w1: { core: 1 } }\napps:\n  a: { type: thing, size: 3 }\n  b:\n    type: thing\n    worker: w2\nlinks:\n  - \"a.output -> b.input\"\n  - { link: \"b.output -> a.input\", size: 64 }\n",
            "g.yaml",
            Path::new("/x"),
            &registry(),
        )
        .unwrap();
        assert_eq!(g.apps["a"].config, serde_json::json!({"size": 3}));
        assert_eq!(g.apps["b"].worker, "w2");
        assert_eq!(g.apps["b"].line, 5);
        assert_eq!(g.links[0].size, 512);
        assert_eq!(g.links[1].size, 64);
        assert_eq!(
            g.workers.keys().collect::<Vec<_>>(),
            vec!["w1", "main", "w2"]
        );
        assert_eq!(g.workers["w1"].core, Some(1));
        assert!(g.to_dot().contains("\"a\" -> \"b\""));
    }

    #[test]
    fn a_link_latency_that_is_not_a_boolean_names_its_line() {
        let (line, msg) = first_error(
            "apps:\n  a: { type: thing }\n  b: { type: thing }\nlinks:\n  - { link: \"a.output -> b.input\", latency: yes please }\n",
        );
        assert_eq!(line, 5);
        assert!(msg.contains("latency is true or false"), "{msg}");
    }

    #[test]
    fn unknown_app_type_names_line_and_known_types() {
        let (line, msg) = first_error("apps:\n  a: { type: thing }\n  b: { type: rooter }\n");
        assert_eq!(line, 3);
        assert!(
            msg.contains("unknown app type `rooter`") && msg.contains("known: thing"),
            "{msg}"
        );
    }

    #[test]
    fn unknown_key_names_app_key_and_its_line() {
        let (line, msg) = first_error("apps:\n  a:\n    type: thing\n    sise: 3\n");
        assert_eq!(line, 4);
        assert!(
            msg.contains("app `a`") && msg.contains("unknown key `sise`"),
            "{msg}"
        );
    }

    #[test]
    fn wrong_type_names_app_key_and_line() {
        let (line, msg) = first_error("apps:\n  a:\n    type: thing\n\n    size: big\n");
        assert_eq!(line, 5);
        assert!(
            msg.contains("app `a`") && msg.contains("key `size`") && msg.contains("invalid type"),
            "{msg}"
        );
    }

    #[test]
    fn app_validation_error_names_app() {
        let (line, msg) = first_error("apps:\n  a: { type: thing, size: 10000 }\n");
        assert_eq!(line, 2);
        assert!(
            msg.contains("app `a` (thing): size must be at most 9216"),
            "{msg}"
        );
    }

    #[test]
    fn duplicate_app_name_is_refused_with_line() {
        let (line, msg) = first_error("apps:\n  a: { type: thing }\n  a: { type: thing }\n");
        assert_eq!(line, 3);
        assert!(msg.contains("duplicate") && msg.contains('a'), "{msg}");
        assert!(!msg.contains("DuplicateKeyPolicy"), "{msg}");
    }

    #[test]
    fn an_app_with_a_bad_setting_is_the_one_error_its_links_are_not_more() {
        let text = "apps:\n  a: { type: thing, size: 99999 }\n  b: { type: thing }\nlinks:\n  - \"a.output -> b.input\"\n";
        let errs = errors(text);
        assert_eq!(errs.len(), 1, "{errs:?}");
        assert_eq!(errs[0].0, 2);
        assert!(
            errs[0].1.contains("size must be at most 9216"),
            "{}",
            errs[0].1
        );
    }

    #[test]
    fn unknown_port_and_unknown_app_in_links() {
        let text = "apps:\n  a: { type: thing }\n  b: { type: thing }\nlinks:\n  - \"a.out -> b.input\"\n  - \"a.output -> c.input\"\n";
        let errs = errors(text);
        assert_eq!(errs.len(), 2, "{errs:?}");
        assert_eq!(errs[0].0, 5);
        assert!(
            errs[0]
                .1
                .contains("has no output port `out` (outputs: output)"),
            "{}",
            errs[0].1
        );
        assert_eq!(errs[1].0, 6);
        assert!(errs[1].1.contains("no app named `c`"), "{}", errs[1].1);
    }

    #[test]
    fn a_port_takes_one_link() {
        let text = "apps:\n  a: { type: thing }\n  b: { type: thing }\nlinks:\n  - \"a.output -> b.input\"\n  - \"a.output -> a.input\"\n";
        let (line, msg) = first_error(text);
        assert_eq!(line, 6);
        assert!(msg.contains("already linked on line 5"), "{msg}");
    }

    #[test]
    fn malformed_links_and_yaml() {
        let (line, msg) =
            first_error("apps:\n  a: { type: thing }\nlinks:\n  - \"a.output => a.input\"\n");
        assert_eq!(line, 4);
        assert!(msg.contains("APP.PORT -> APP.PORT"), "{msg}");
        let (line, _) = first_error("apps:\n  a: { type: thing\nlinks: []\n");
        assert!(line >= 2, "syntax errors have a line");
        let (line, msg) = first_error("apps:\n  a: { type: thing }\nlinkz: []\n");
        assert_eq!(line, 3);
        assert!(msg.contains("linkz"), "{msg}");
        let (line, msg) = first_error("apps:\n  a: { size: 1 }\n");
        assert_eq!(line, 2);
        assert!(msg.contains("has no `type`"), "{msg}");
    }

    #[test]
    fn missing_file_is_a_clear_error() {
        let e = Graph::load(Path::new("/nonexistent/g.yaml"), &registry()).unwrap_err();
        let s = e.to_string();
        assert!(
            s.starts_with("/nonexistent/g.yaml: cannot read graph file"),
            "{s}"
        );
    }

    #[test]
    fn errors_print_file_line_and_source() {
        let e = Graph::parse(
            "apps:\n  a: { type: nope }\n",
            "g.yaml",
            Path::new("."),
            &registry(),
        )
        .unwrap_err()
        .to_string();
        assert!(e.starts_with("g.yaml:2:"), "{e}");
        assert!(e.contains("   2 |   a: { type: nope }"), "{e}");
    }

    #[test]
    fn document_parses_back_to_the_same_graph() {
        let text = "engine: { link_size: 512 }\nworkers: { w1: { core: 1 } }\napps:\n  a: { type: thing, size: 60 }\n  b: { type: thing, worker: w1 }\nlinks:\n  - { link: \"a.output -> b.input\", latency: true }\n  - { link: \"b.output -> a.input\", size: 64 }\n";
        let g = Graph::parse(text, "g.yaml", Path::new("."), &registry()).unwrap();
        assert!(g.links[0].latency && !g.links[1].latency);
        let doc = serde_json::to_string_pretty(&g.to_document()).unwrap();
        let back = Graph::parse(&doc, "doc.json", Path::new("."), &registry()).unwrap();
        assert_eq!(back.to_document(), g.to_document());
        assert_eq!(back.engine, g.engine);
        assert_eq!(back.workers, g.workers);
        assert_eq!(
            back.links
                .iter()
                .map(|l| (l.size, l.latency))
                .collect::<Vec<_>>(),
            [(512, true), (64, false)]
        );
        assert_eq!(back.apps["b"].worker, "w1");
        assert_eq!(back.apps["a"].config, serde_json::json!({ "size": 60 }));
    }
}
