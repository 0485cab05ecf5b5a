//! Where each app of a graph file runs: `placement:` (per app, or once at the top of the file)
//! and, in a cluster graph, `host:`/`hosts:`. These keys sit beside the engine's in the same
//! file; the engine's parser hands them over ([`stitch_core::graph::KeyExtension`]) and the
//! engine's graph never holds them, so an app placed elsewhere cannot reach the engine except
//! through [`crate::plan`].

use indexmap::IndexMap;
use serde::Deserialize;
use serde_json::{json, Value};
use std::fmt;
use std::path::Path;
use stitch_core::graph::{ExtensionKeys, GraphError, GraphErrors, KeyExtension};
use stitch_core::{Graph, Registry};

/// Where an app runs: in Stitch's engine, as an eBPF program in the kernel's data plane, as a
/// function process Stitch starts and supervises, or in a VM.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Deserialize, serde::Serialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Placement {
    #[default]
    #[serde(alias = "userspace")]
    Engine,
    Kernel,
    Process,
    Vm,
}

impl Placement {
    pub const ALL: [Placement; 4] = [
        Placement::Engine,
        Placement::Kernel,
        Placement::Process,
        Placement::Vm,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Placement::Engine => "engine",
            Placement::Kernel => "kernel",
            Placement::Process => "process",
            Placement::Vm => "vm",
        }
    }

    fn of(v: &Value) -> Result<Placement, String> {
        match v.as_str() {
            // `userspace` is the engine's name before processes and VMs were placements.
            Some("userspace") => Ok(Placement::Engine),
            Some(s) => Placement::ALL.into_iter().find(|p| p.name() == s).ok_or(()),
            None => Err(()),
        }
        .map_err(|()| format!("placement: `{v}` is none of `engine`, `kernel`, `process`, `vm`"))
    }

    /// The app type an app of this placement has when its entry names none.
    fn default_type(self) -> Option<&'static str> {
        match self {
            Placement::Process => Some("function"),
            Placement::Vm => Some("vm"),
            _ => None,
        }
    }
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Where one app runs.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AppPlacement {
    pub placement: Placement,
    /// `host:` pins the app to one host of a cluster; `hosts:` (labels and the values they
    /// must have) makes it eligible on the hosts that match. Only a cluster graph may set them.
    pub host: Option<String>,
    pub hosts: IndexMap<String, String>,
    /// Line and column of the app's `host:` or `hosts:` key, if it has one.
    pub cluster_key_at: Option<(&'static str, usize, usize)>,
}

/// The placement keys as the graph parser takes them.
const PLACEMENT_KEYS: KeyExtension = KeyExtension {
    file_keys: &["placement"],
    app_keys: &["placement", "host", "hosts"],
    check,
    default_type,
};

fn check(key: &str, v: &Value) -> Result<(), String> {
    match key {
        "placement" => Placement::of(v).map(drop),
        "host" => match v.as_str() {
            Some(h) if is_host_name(h) => Ok(()),
            _ => Err("`host` must be a host name".into()),
        },
        _ => labels(v).map(drop).map_err(|m| format!("hosts: {m}")),
    }
}

fn default_type(app: &ExtensionKeys, file: &ExtensionKeys) -> Option<&'static str> {
    let p = app.get("placement").or_else(|| file.get("placement"))?;
    Placement::of(&p.value).ok()?.default_type()
}

fn is_host_name(s: &str) -> bool {
    !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

/// `hosts:`: a mapping of label names to the values a host must have (scalars taken as text).
fn labels(v: &Value) -> Result<IndexMap<String, String>, String> {
    let Value::Object(m) = v else {
        return Err("must map labels to values, e.g. `{ zone: east }`".into());
    };
    let mut labels = IndexMap::new();
    for (k, v) in m {
        let value = match v {
            Value::String(s) => s.clone(),
            Value::Number(n) => n.to_string(),
            Value::Bool(b) => b.to_string(),
            _ => return Err(format!("label `{k}` must have a text value")),
        };
        labels.insert(k.clone(), value);
    }
    if labels.is_empty() {
        return Err("name at least one label".into());
    }
    Ok(labels)
}

/// A graph file as Stitch runs it: the engine's graph of every app, and where each app runs.
#[derive(Debug, Clone)]
pub struct PlacedGraph {
    /// Every app as the engine would take it; [`crate::plan`] makes the engine's part.
    pub graph: Graph,
    /// By app name, one for each app of `graph`.
    pub apps: IndexMap<String, AppPlacement>,
}

/// Steering rules of `af_xdp` apps that send frames nowhere (their port has no link) or to a
/// function that cannot read the interface's rings (an isolated one): each at its app's
/// `steer` line.
fn steering_problems(g: &Graph) -> Vec<GraphError> {
    let mut errors = Vec::new();
    for a in g.apps.values().filter(|a| a.kind == "af_xdp") {
        let (line, column) = a.key_lines.get("steer").copied().unwrap_or((a.line, 1));
        let mut problem = |message: String| {
            errors.push(GraphError {
                line,
                column,
                message,
            })
        };
        for (i, rule) in stitch_io::af_xdp::steering_rules(&a.config)
            .iter()
            .enumerate()
        {
            let to = &rule.to;
            let Some(link) = (g.links.iter()).find(|l| l.from.app == a.name && l.from.port == *to)
            else {
                problem(format!(
                    "app `{}`: steer rule {} sends to port `{to}`, which no link leaves from \
                     (add \"{}.{to} -> FUNCTION.input\", or remove the rule)",
                    a.name,
                    i + 1,
                    a.name
                ));
                continue;
            };
            let Some(b) = g.apps.get(&link.to.app) else {
                continue;
            };
            let function = b.kind == "nf_port" || b.kind == "function";
            if function && b.config.get("mode").and_then(|m| m.as_str()) == Some("isolated") {
                problem(format!(
                    "app `{}`: steer rule {} leads to function `{}`, which is isolated and \
                     cannot read the interface's rings (give it `mode: zero_copy`)",
                    a.name,
                    i + 1,
                    b.name
                ));
            }
        }
    }
    errors
}

impl PlacedGraph {
    /// Parses and validates graph text; `file` names it in errors.
    pub fn parse(
        text: &str,
        file: &str,
        base_dir: &Path,
        registry: &Registry,
    ) -> Result<PlacedGraph, GraphErrors> {
        let g = Graph::parse_extended(text, file, base_dir, registry, &PLACEMENT_KEYS)?;
        let errors = steering_problems(&g.graph);
        if !errors.is_empty() {
            return Err(GraphErrors {
                file: file.to_string(),
                text: text.to_string(),
                errors,
            });
        }
        let file_default = g.file_keys.get("placement");
        let apps = (g.app_keys.iter())
            .map(|(name, keys)| {
                let placement = keys.get("placement").or(file_default);
                (name.clone(), app_placement(placement, keys))
            })
            .collect();
        Ok(PlacedGraph {
            graph: g.graph,
            apps,
        })
    }

    /// Reads and validates a graph file.
    pub fn load(path: &Path, registry: &Registry) -> Result<PlacedGraph, GraphErrors> {
        let file = stitch_core::graph::GraphFile::read(path)?;
        PlacedGraph::parse(&file.text, &file.name, &file.base, registry)
    }

    /// A graph whose apps all run in the engine.
    pub fn in_engine(graph: Graph) -> PlacedGraph {
        let apps = (graph.apps.keys())
            .map(|n| (n.clone(), AppPlacement::default()))
            .collect();
        PlacedGraph { graph, apps }
    }

    /// How many apps the file has and where they run: `5 apps: 3 in the engine, 1 in a
    /// process, 1 in the kernel` (only `3 apps` when all are in the engine). What `check`
    /// and `run` say; the engine also counts the ports it makes at a placement's boundary.
    pub fn summary(&self) -> String {
        let n = self.apps.len();
        let mut out = format!("{n} app{}", if n == 1 { "" } else { "s" });
        let counts: Vec<String> = Placement::ALL
            .into_iter()
            .filter_map(|p| {
                let k = self.apps.values().filter(|a| a.placement == p).count();
                let place = match p {
                    Placement::Engine => "in the engine",
                    Placement::Kernel => "in the kernel",
                    Placement::Process => "in a process",
                    Placement::Vm => "in a VM",
                };
                (k > 0).then(|| format!("{k} {place}"))
            })
            .collect();
        if self.apps.values().any(|a| a.placement != Placement::Engine) {
            out += &format!(": {}", counts.join(", "));
        }
        out
    }

    /// Where app `name` runs (the engine for an app the graph does not have).
    pub fn placement(&self, name: &str) -> Placement {
        self.apps.get(name).map(|a| a.placement).unwrap_or_default()
    }

    /// The graph in the graph file's shape with every app's placement keys, as JSON (which is
    /// YAML: [`PlacedGraph::parse`] of its text gives this graph back).
    pub fn to_document(&self) -> Value {
        let mut doc = self.graph.to_document();
        for (name, place) in &self.apps {
            let Some(Value::Object(entry)) = doc["apps"].get_mut(name) else {
                continue;
            };
            if place.placement != Placement::Engine {
                entry.insert("placement".into(), json!(place.placement));
            }
            if let Some(h) = &place.host {
                entry.insert("host".into(), json!(h));
            }
            if !place.hosts.is_empty() {
                entry.insert("hosts".into(), json!(place.hosts));
            }
        }
        doc
    }
}

/// One app's placement from its keys, which the parser has checked.
fn app_placement(
    placement: Option<&stitch_core::graph::KeyValue>,
    keys: &ExtensionKeys,
) -> AppPlacement {
    let cluster_key_at = ["host", "hosts"]
        .into_iter()
        .find_map(|k| keys.get(k).map(|v| (k, v.line, v.column)));
    AppPlacement {
        placement: placement
            .and_then(|p| Placement::of(&p.value).ok())
            .unwrap_or_default(),
        host: keys
            .get("host")
            .and_then(|h| h.value.as_str())
            .map(str::to_string),
        hosts: keys
            .get("hosts")
            .and_then(|h| labels(&h.value).ok())
            .unwrap_or_default(),
        cluster_key_at,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn registry() -> Registry {
        let mut r = Registry::new();
        stitch_nf::register(&mut r);
        stitch_vhost::register(&mut r);
        r
    }

    fn parse(text: &str) -> Result<PlacedGraph, Vec<(usize, String)>> {
        PlacedGraph::parse(text, "g.yaml", Path::new("."), &registry())
            .map_err(|e| e.errors.into_iter().map(|e| (e.line, e.message)).collect())
    }

    #[test]
    fn host_pins_and_label_selectors_are_kept_apart_from_the_config_and_written_back() {
        let text = "apps:\n  a: { type: nf_port, host: h1 }\n  b: { type: nf_port, hosts: { zone: east, rack: 4 } }\n";
        let g = parse(text).unwrap();
        assert_eq!(g.apps["a"].host.as_deref(), Some("h1"));
        assert_eq!(g.apps["a"].cluster_key_at, Some(("host", 2, 23)));
        assert_eq!(g.apps["b"].hosts["rack"], "4");
        assert_eq!(g.graph.apps["b"].config, json!({}));
        let doc = serde_json::to_string(&g.to_document()).unwrap();
        let back = parse(&doc).unwrap();
        assert_eq!(back.apps["b"].hosts, g.apps["b"].hosts);
        assert_eq!(back.apps["a"].host, g.apps["a"].host);
        assert_eq!(
            parse("apps:\n  a: { type: nf_port, host: [h1] }\n").unwrap_err(),
            [(2, "app `a`: `host` must be a host name".to_string())]
        );
        assert_eq!(
            parse("apps:\n  a: { type: nf_port, hosts: east }\n").unwrap_err(),
            [(
                2,
                "app `a`: hosts: must map labels to values, e.g. `{ zone: east }`".to_string()
            )]
        );
    }

    #[test]
    fn the_files_placement_is_every_apps_default_and_gives_a_type() {
        let g = parse(
            "placement: kernel\napps:\n  a: { type: nf_port }\n  f: { placement: process, command: [x] }\n  e: { type: nf_port, placement: userspace }\n",
        )
        .unwrap();
        assert_eq!(g.placement("a"), Placement::Kernel);
        assert_eq!(g.placement("f"), Placement::Process);
        assert_eq!(g.graph.apps["f"].kind, "function");
        assert_eq!(g.placement("e"), Placement::Engine);
        let doc = g.to_document();
        assert_eq!(doc["apps"]["a"]["placement"], "kernel");
        assert!(doc["apps"]["e"].get("placement").is_none());
        assert_eq!(
            parse("placement: moon\napps: {}\n").unwrap_err(),
            [(
                1,
                "placement: `\"moon\"` is none of `engine`, `kernel`, `process`, `vm`".to_string()
            )]
        );
    }
}
