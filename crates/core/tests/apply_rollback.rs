//! A live change is all or nothing: when one app refuses its new config — or panics, in its
//! `reconfigure` or a new app's `new` — apps already reconfigured get their old config back,
//! removed apps keep running, new apps never start and the old graph forwards on.

use serde::Deserialize;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};
use stitch_core::app::{Io, Reconfigured};
use stitch_core::{pool, App, AppContext, AppError, AppType, Engine, Graph, PortSpec, Registry};

/// Holds a number and forwards what it receives; refuses to be reconfigured to a negative
/// number, panics when reconfigured to `PANICS_IN_RECONFIGURE` or built with `PANICS_IN_NEW`.
/// Reports its number by `query`.
struct Knob {
    value: i64,
}

const PANICS_IN_RECONFIGURE: i64 = 666;
const PANICS_IN_NEW: i64 = 777;

#[derive(schemars::JsonSchema, serde::Serialize, Deserialize)]
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
        assert_ne!(
            c.value, PANICS_IN_NEW,
            "a knob cannot be built at {PANICS_IN_NEW}"
        );
        Ok(Knob { value: c.value })
    }
    fn reconfigure(&mut self, c: KnobConfig, _: &mut AppContext) -> Result<Reconfigured, AppError> {
        if c.value < 0 {
            return Err(format!("value {} is negative", c.value).into());
        }
        // Half-way through the change when it panics: its state is not what it was.
        self.value = c.value;
        assert_ne!(
            c.value, PANICS_IN_RECONFIGURE,
            "a knob cannot be turned to {PANICS_IN_RECONFIGURE}"
        );
        Ok(Reconfigured::Done)
    }
    fn push(&mut self, io: &mut Io) {
        if let (Some(input), Some(output)) = io.pair(0, 0) {
            input.forward_to(output);
        }
    }
    fn query(&mut self, _: &serde_json::Value) -> serde_json::Value {
        serde_json::json!(self.value)
    }
}

/// Sends a packet a breath.
struct Pump;

impl App for Pump {
    type Config = serde_json::Value;
    fn declare(_: &serde_json::Value) -> Result<PortSpec, AppError> {
        Ok(PortSpec::source())
    }
    fn new(_: serde_json::Value, _: &mut AppContext) -> Result<Self, AppError> {
        Ok(Pump)
    }
    fn pull(&mut self, io: &mut Io) {
        if let (Some(out), Some(p)) = (io.output(0), pool::alloc()) {
            out.transmit(p);
        }
    }
}

/// Counts what it receives; reports the count by `query`.
struct Tally(u64);

impl App for Tally {
    type Config = serde_json::Value;
    fn declare(_: &serde_json::Value) -> Result<PortSpec, AppError> {
        Ok(PortSpec::sink())
    }
    fn new(_: serde_json::Value, _: &mut AppContext) -> Result<Self, AppError> {
        Ok(Tally(0))
    }
    fn push(&mut self, io: &mut Io) {
        if let Some(input) = io.input(0) {
            self.0 += input.free_available().0;
        }
    }
    fn query(&mut self, _: &serde_json::Value) -> serde_json::Value {
        serde_json::json!(self.0)
    }
}

fn registry() -> Arc<Registry> {
    let mut r = Registry::new();
    r.register(AppType::of::<Knob>("knob", "test knob"));
    r.register(AppType::of::<Pump>("pump", "a packet a breath"));
    r.register(AppType::of::<Tally>("tally", "counts what it receives"));
    Arc::new(r)
}

/// pump → a → b → out, with the knobs at `a` and `b`.
const PUMPED: &str = "apps:\n  pump: {type: pump}\n  a: {type: knob, value: 1}\n  b: {type: knob, value: 2}\n  out: {type: tally}\nlinks: [\"pump.output -> a.input\", \"a.output -> b.input\", \"b.output -> out.input\"]\n";

/// Waits until `out` has counted more than it had: the graph forwards.
fn forwards(engine: &Engine) {
    let count = || {
        engine
            .query("out", serde_json::Value::Null)
            .unwrap()
            .as_u64()
            .unwrap()
    };
    let before = count();
    let t = Instant::now();
    while count() <= before {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the graph stopped forwarding"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The running graph's apps and links, to compare before and after a failed change.
fn shape(engine: &Engine) -> (Vec<String>, Vec<String>) {
    let stats = engine.stats();
    (
        stats.apps.iter().map(|a| a.name.clone()).collect(),
        stats.links.iter().map(|l| l.link.clone()).collect(),
    )
}

#[test]
fn a_reconfigure_that_panics_fails_the_change_and_the_old_graph_forwards_on() {
    let r = registry();
    let engine = Engine::new(r.clone());
    engine.apply(graph(PUMPED, &r)).unwrap();
    forwards(&engine);
    let before = shape(&engine);
    // `a` takes 10 first, then `b` panics half-way: both get their old config back, `new`
    // never starts.
    let change = PUMPED
        .replace("value: 1", "value: 10")
        .replace("value: 2", &format!("value: {PANICS_IN_RECONFIGURE}"))
        .replace("  out:", "  new: {type: knob, value: 5}\n  out:");
    let err = engine.apply(graph(&change, &r)).unwrap_err().to_string();
    assert!(err.contains("app `b`"), "{err}");
    assert!(err.contains("panicked in reconfigure"), "{err}");
    assert!(err.contains("nothing was changed"), "{err}");
    assert_eq!(engine.query("a", serde_json::Value::Null).unwrap(), 1);
    assert_eq!(engine.query("b", serde_json::Value::Null).unwrap(), 2);
    assert_eq!(shape(&engine), before);
    let stats = engine.stats();
    let b = stats.apps.iter().find(|a| a.name == "b").unwrap();
    assert_eq!(b.counters.get("panics"), Some(&1), "{:?}", b.counters);
    forwards(&engine);
    // The engine takes the next change as any other.
    let report = engine
        .apply(graph(&PUMPED.replace("value: 2", "value: 3"), &r))
        .unwrap();
    assert_eq!(report.reconfigured, ["b"]);
    forwards(&engine);
    engine.stop();
}

#[test]
fn a_new_app_that_panics_fails_the_change_and_the_old_graph_forwards_on() {
    let r = registry();
    let engine = Engine::new(r.clone());
    engine.apply(graph(PUMPED, &r)).unwrap();
    let before = shape(&engine);
    let change = PUMPED.replace("value: 1", "value: 10").replace(
        "  out:",
        &format!("  c: {{type: knob, value: {PANICS_IN_NEW}}}\n  out:"),
    );
    let err = engine.apply(graph(&change, &r)).unwrap_err().to_string();
    assert!(err.contains("app `c`"), "{err}");
    assert!(err.contains("panicked in new"), "{err}");
    assert_eq!(engine.query("a", serde_json::Value::Null).unwrap(), 1);
    assert_eq!(shape(&engine), before);
    forwards(&engine);
    engine
        .apply(graph(&change.replace(&PANICS_IN_NEW.to_string(), "7"), &r))
        .unwrap();
    assert_eq!(engine.query("c", serde_json::Value::Null).unwrap(), 7);
    forwards(&engine);
    engine.stop();
}

fn graph(text: &str, registry: &Registry) -> Graph {
    Graph::parse(text, "test.yaml", Path::new("."), registry).expect("valid graph")
}

#[test]
fn failed_reconfigure_leaves_the_running_graph_untouched() {
    let r = registry();
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
