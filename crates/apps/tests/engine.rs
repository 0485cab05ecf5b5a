//! The engine running real apps: live apply by diff, workers, cycles, failing apps.

use serde::Deserialize;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};
use stitch_core::{
    App, AppContext, AppError, AppType, Engine, Graph, Io, PortSpec, Reconfigured, Registry,
};

/// Holds packets in its input until opened: lets a test keep packets queued on a link.
#[derive(schemars::JsonSchema, serde::Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct GateConfig {
    open: bool,
}
struct Gate {
    open: bool,
}
impl App for Gate {
    type Config = GateConfig;
    fn declare(_: &GateConfig) -> Result<PortSpec, AppError> {
        Ok(PortSpec::filter())
    }
    fn new(c: GateConfig, _: &mut AppContext) -> Result<Self, AppError> {
        Ok(Gate { open: c.open })
    }
    fn push(&mut self, io: &mut Io) {
        if self.open {
            if let (Some(i), Some(o)) = io.pair(0, 0) {
                i.forward_to(o);
            }
        }
    }
    fn reconfigure(&mut self, c: GateConfig, _: &mut AppContext) -> Result<Reconfigured, AppError> {
        self.open = c.open;
        Ok(Reconfigured::Done)
    }
}

/// Panics on its first packet.
#[derive(schemars::JsonSchema, serde::Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct PanickerConfig {}
struct Panicker;
impl App for Panicker {
    type Config = PanickerConfig;
    fn declare(_: &PanickerConfig) -> Result<PortSpec, AppError> {
        Ok(PortSpec::sink())
    }
    fn new(_: PanickerConfig, _: &mut AppContext) -> Result<Self, AppError> {
        Ok(Panicker)
    }
    fn push(&mut self, io: &mut Io) {
        if io.input(0).is_some_and(|i| i.receive().is_some()) {
            panic!("test app fails on purpose");
        }
    }
}

/// Valid config, but building fails.
#[derive(schemars::JsonSchema, serde::Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct BrokenConfig {}
struct Broken;
impl App for Broken {
    type Config = BrokenConfig;
    fn declare(_: &BrokenConfig) -> Result<PortSpec, AppError> {
        Ok(PortSpec::sink())
    }
    fn new(_: BrokenConfig, _: &mut AppContext) -> Result<Self, AppError> {
        Err("cannot build on purpose".into())
    }
}

fn registry() -> Arc<Registry> {
    let mut r = Registry::new();
    stitch_apps::register(&mut r);
    r.register(AppType::of::<Gate>("gate", "test gate"));
    r.register(AppType::of::<Panicker>("panicker", "test panic"));
    r.register(AppType::of::<Broken>("broken", "test build failure"));
    Arc::new(r)
}

fn graph(r: &Registry, text: &str) -> Graph {
    Graph::parse(text, "test.yaml", Path::new("."), r).unwrap_or_else(|e| panic!("{e}"))
}

fn wait(what: &str, secs: u64, mut cond: impl FnMut() -> bool) {
    let t = Instant::now();
    while !cond() {
        assert!(
            t.elapsed() < Duration::from_secs(secs),
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn counter(e: &Engine, app: &str, name: &str) -> u64 {
    e.stats()
        .apps
        .iter()
        .find(|a| a.name == app)
        .and_then(|a| a.counters.get(name).copied())
        .unwrap_or(0)
}

fn link_stats(e: &Engine, spec: &str) -> stitch_core::link::LinkStats {
    e.stats()
        .links
        .iter()
        .find(|l| l.link == spec)
        .unwrap_or_else(|| panic!("no link {spec}"))
        .stats
}

#[test]
fn live_apply_keeps_queued_packets_and_app_state() {
    let r = registry();
    let e = Engine::new(r.clone());
    let links = "links:\n  - \"gen.output -> gate.input\"\n  - \"gate.output -> out.input\"\n";
    e.apply(graph(
        &r,
        &format!("apps:\n  gen: {{ type: generator, count: 300 }}\n  gate: {{ type: gate, open: true }}\n  out: {{ type: sink }}\n{links}"),
    ))
    .unwrap();
    wait("300 packets at the sink", 10, || {
        counter(&e, "out", "packets") == 300
    });

    // Close the gate and send 500 more: they queue on gen -> gate.
    let rep = e
        .apply(graph(
            &r,
            &format!("apps:\n  gen: {{ type: generator, count: 500, size: 100 }}\n  gate: {{ type: gate, open: false }}\n  out: {{ type: sink }}\n{links}"),
        ))
        .unwrap();
    assert_eq!(
        rep.restarted,
        vec!["gen"],
        "generator has no in-place reconfigure"
    );
    assert_eq!(rep.reconfigured, vec!["gate"]);
    assert_eq!(rep.kept, vec!["out"]);
    wait("500 packets queued", 10, || {
        link_stats(&e, "gen.output -> gate.input").queued == 500
    });

    // Open the gate and add an app: the queued packets must arrive and the sink keep counting.
    let rep = e
        .apply(graph(
            &r,
            &format!("apps:\n  gen: {{ type: generator, count: 500, size: 100 }}\n  gate: {{ type: gate, open: true }}\n  out: {{ type: sink }}\n  idle: {{ type: sink }}\n{links}"),
        ))
        .unwrap();
    assert_eq!(rep.started, vec!["idle"]);
    assert_eq!(rep.links_kept.len(), 2);
    assert_eq!(rep.reconfigured, vec!["gate"]);
    wait("800 packets at the sink", 10, || {
        counter(&e, "out", "packets") == 800
    });
    assert_eq!(counter(&e, "out", "bytes"), 300 * 64 + 500 * 100);
    let s = link_stats(&e, "gen.output -> gate.input");
    assert_eq!((s.tx_drops, s.queued), (0, 0));

    // Removing an app and its links stops it; the rest goes on.
    let rep = e
        .apply(graph(
            &r,
            "apps:\n  out: { type: sink }\n  idle: { type: sink }\n",
        ))
        .unwrap();
    assert_eq!(rep.stopped, vec!["gate", "gen"]);
    assert_eq!(rep.links_removed.len(), 2);
    assert_eq!(counter(&e, "out", "packets"), 800);
    e.stop();
}

#[test]
fn two_workers_lose_nothing_below_capacity() {
    let r = registry();
    let e = Engine::new(r.clone());
    let n = 200_000;
    e.apply(graph(
        &r,
        &format!(
            "apps:\n  gen: {{ type: generator, count: {n}, rate: 1000000, flows: 8, worker: a }}\n  fwd: {{ type: forwarder, worker: b }}\n  out: {{ type: sink, worker: a }}\nlinks:\n  - {{ link: \"gen.output -> fwd.input\", size: 65536 }}\n  - {{ link: \"fwd.output -> out.input\", size: 65536 }}\n"
        ),
    ))
    .unwrap();
    wait("all packets through two workers", 30, || {
        counter(&e, "out", "packets") == n
    });
    let stats = e.stop();
    assert_eq!(stats.workers.len(), 2, "workers exist where apps run");
    for l in &stats.links {
        assert_eq!(l.stats.tx_drops, 0, "{}", l.link);
        assert_eq!(l.stats.rx_packets, n, "{}", l.link);
    }
}

#[test]
fn moving_an_app_to_another_worker_live_keeps_packets() {
    let r = registry();
    let e = Engine::new(r.clone());
    let text = |worker: &str, open: bool| {
        format!(
            "apps:\n  gen: {{ type: generator, count: 1000 }}\n  gate: {{ type: gate, open: {open}, worker: {worker} }}\n  out: {{ type: sink }}\nlinks:\n  - \"gen.output -> gate.input\"\n  - \"gate.output -> out.input\"\n"
        )
    };
    e.apply(graph(&r, &text("main", false))).unwrap();
    wait("packets queued", 10, || {
        link_stats(&e, "gen.output -> gate.input").queued == 1000
    });
    e.apply(graph(&r, &text("other", false))).unwrap();
    assert_eq!(
        e.stats()
            .apps
            .iter()
            .find(|a| a.name == "gate")
            .unwrap()
            .worker,
        "other"
    );
    e.apply(graph(&r, &text("other", true))).unwrap();
    wait("all packets at the sink", 10, || {
        counter(&e, "out", "packets") == 1000
    });
    e.stop();
}

#[test]
fn cycles_do_not_hang_the_breath_loop() {
    let r = registry();
    // Half of the packets go round the join -> rr -> join cycle each time: all end at the sink.
    let e = Engine::new(r.clone());
    e.apply(graph(
        &r,
        "apps:\n  gen: { type: generator, count: 10000 }\n  j: { type: join }\n  rr: { type: round_robin }\n  out: { type: sink }\nlinks:\n  - \"gen.output -> j.a\"\n  - \"j.output -> rr.input\"\n  - \"rr.back -> j.b\"\n  - \"rr.out -> out.input\"\n",
    ))
    .unwrap();
    wait("packets through the cycle", 10, || {
        counter(&e, "out", "packets") == 10000
    });
    assert!(
        e.finished() || {
            std::thread::sleep(Duration::from_millis(20));
            e.finished()
        }
    );
    e.stop();

    // Packets that circle forever, and a self-link: breaths go on and stop() returns.
    let e = Engine::new(r.clone());
    e.apply(graph(
        &r,
        "apps:\n  gen: { type: generator, count: 100 }\n  j: { type: join }\n  f: { type: forwarder }\n  self: { type: forwarder }\nlinks:\n  - \"gen.output -> j.a\"\n  - \"j.output -> f.input\"\n  - \"f.output -> j.b\"\n  - \"self.output -> self.input\"\n",
    ))
    .unwrap();
    let breaths = |e: &Engine| e.stats().workers[0].breaths;
    let b0 = breaths(&e);
    wait("breaths continue while packets circle", 10, || {
        breaths(&e) > b0 + 100
    });
    assert!(
        link_stats(&e, "f.output -> j.b").tx_packets > 1000,
        "packets circulate"
    );
    let t = Instant::now();
    e.stop();
    assert!(t.elapsed() < Duration::from_secs(2));
}

#[test]
fn a_panicking_app_is_stopped_and_the_rest_keeps_running() {
    let r = registry();
    let e = Engine::new(r.clone());
    e.apply(graph(
        &r,
        "apps:\n  gen: { type: generator, count: 10 }\n  bad: { type: panicker }\n  gen2: { type: generator, count: 1000 }\n  out: { type: sink }\nlinks:\n  - \"gen.output -> bad.input\"\n  - \"gen2.output -> out.input\"\n",
    ))
    .unwrap();
    wait("good path delivers", 10, || {
        counter(&e, "out", "packets") == 1000
    });
    let stats = e.stop();
    let bad = stats.apps.iter().find(|a| a.name == "bad").unwrap();
    assert!(bad.failed);
    assert_eq!(bad.counters["panics"], 1);
}

#[test]
fn failed_build_changes_nothing() {
    let r = registry();
    let e = Engine::new(r.clone());
    e.apply(graph(&r, "apps:\n  gen: { type: generator, rate: 1000 }\n  out: { type: sink }\nlinks:\n  - \"gen.output -> out.input\"\n")).unwrap();
    // Valid at check time, fails to build: the whole change is refused before anything stops.
    let bad = graph(
        &r,
        "apps:\n  gen: { type: generator, rate: 1000 }\n  b: { type: broken }\n",
    );
    let err = e.apply(bad).unwrap_err().to_string();
    assert!(
        err.contains("app `b`") && err.contains("cannot build on purpose"),
        "{err}"
    );
    let stats = e.stats();
    let names: Vec<&str> = stats.apps.iter().map(|a| a.name.as_str()).collect();
    assert_eq!(names, vec!["gen", "out"]);
    assert_eq!(stats.links.len(), 1);
    let before = counter(&e, "out", "packets");
    wait("traffic still flows", 10, || {
        counter(&e, "out", "packets") > before
    });
    // An in-place change of a rate_meter is a reconfiguration, not a restart.
    let rep = e
        .apply(graph(&r, "apps:\n  m: { type: rate_meter }\n"))
        .unwrap();
    assert_eq!(rep.started, vec!["m"]);
    let rep = e
        .apply(graph(&r, "apps:\n  m: { type: rate_meter, log: true }\n"))
        .unwrap();
    assert_eq!(rep.reconfigured, vec!["m"]);
    e.stop();
}
