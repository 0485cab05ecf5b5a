//! A live change is all or nothing: when one app refuses its new config, apps already
//! reconfigured get their old config back, removed apps keep running and new apps never start.

use serde::Deserialize;
use std::path::Path;
use std::sync::Arc;
use stitch_core::app::Reconfigured;
use stitch_core::{App, AppContext, AppError, AppType, Engine, Graph, PortSpec, Registry};

/// Holds a number; refuses to be reconfigured to a negative one. Reports its number by `query`.
struct Knob {
    value: i64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct KnobConfig {
    value: i64,
}

impl App for Knob {
    type Config = KnobConfig;
    fn declare(_: &KnobConfig) -> Result<PortSpec, AppError> {
        Ok(PortSpec::filter())
    }
    fn new(c: KnobConfig, _: &mut AppContext) -> Result<Self, AppError> {
        Ok(Knob { value: c.value })
    }
    fn reconfigure(&mut self, c: KnobConfig, _: &mut AppContext) -> Result<Reconfigured, AppError> {
        if c.value < 0 {
            return Err(format!("value {} is negative", c.value).into());
        }
        self.value = c.value;
        Ok(Reconfigured::Done)
    }
    fn query(&mut self, _: &serde_json::Value) -> serde_json::Value {
        serde_json::json!(self.value)
    }
}

fn graph(text: &str, registry: &Registry) -> Graph {
    Graph::parse(text, "test.yaml", Path::new("."), registry).expect("valid graph")
}

#[test]
fn failed_reconfigure_leaves_the_running_graph_untouched() {
    let mut r = Registry::new();
    r.register(AppType::of::<Knob>("knob", "test knob"));
    let r = Arc::new(r);
    let engine = Engine::new(r.clone());
    engine
        .apply(graph(
            "apps:\n  a: {type: knob, value: 1}\n  b: {type: knob, value: 2}\n  gone: {type: knob, value: 3}\nlinks: [\"a.output -> b.input\"]\n",
            &r,
        ))
        .unwrap();

    // `a` is reconfigured first and succeeds, `b` refuses: `a` must get 1 back, `gone` must stay,
    // `new` must not start, the link must stay.
    let err = engine
        .apply(graph(
            "apps:\n  a: {type: knob, value: 10}\n  b: {type: knob, value: -1}\n  new: {type: knob, value: 5}\nlinks: [\"a.output -> new.input\"]\n",
            &r,
        ))
        .unwrap_err()
        .to_string();
    assert!(err.contains("negative"), "{err}");
    assert!(err.contains("nothing was changed"), "{err}");

    assert_eq!(engine.query("a", serde_json::Value::Null).unwrap(), 1);
    assert_eq!(engine.query("b", serde_json::Value::Null).unwrap(), 2);
    assert_eq!(engine.query("gone", serde_json::Value::Null).unwrap(), 3);
    assert!(engine.query("new", serde_json::Value::Null).is_err());
    let stats = engine.stats();
    let links: Vec<&str> = stats.links.iter().map(|l| l.link.as_str()).collect();
    assert_eq!(links, ["a.output -> b.input"]);
    assert_eq!(engine.graph().unwrap().apps.len(), 3);

    // A valid change afterwards applies normally.
    let report = engine
        .apply(graph(
            "apps:\n  a: {type: knob, value: 10}\n  b: {type: knob, value: 2}\n",
            &r,
        ))
        .unwrap();
    assert_eq!(report.reconfigured, ["a"]);
    assert_eq!(report.stopped, ["gone"]);
    assert_eq!(engine.query("a", serde_json::Value::Null).unwrap(), 10);
    engine.stop();
}
