//! An engine hands its apps to another (what `stitch upgrade` does between two processes): the
//! queued packets go out first, the successor's apps adopt the same descriptors, continue the
//! counters and take the state back; a hand-over the successor refuses leaves the first running.
//! A link's latency histogram counts on across the hand-over and across live changes.

use serde::Deserialize;
use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};
use stitch_core::{
    pool, App, AppContext, AppError, AppSnapshot, AppState, AppType, Counter, Descriptors, Engine,
    Graph, Io, PortSpec, Registry,
};

/// Sends a burst of fresh packets each breath.
struct Burst {
    sent: Counter,
}

#[derive(schemars::JsonSchema, serde::Serialize, Deserialize)]
struct NoConfig {}

impl App for Burst {
    type Config = NoConfig;
    fn declare(_: &NoConfig) -> Result<PortSpec, AppError> {
        Ok(PortSpec::source())
    }
    fn new(_: NoConfig, ctx: &mut AppContext) -> Result<Self, AppError> {
        Ok(Burst {
            sent: ctx.counter("sent"),
        })
    }
    fn pull(&mut self, io: &mut Io) {
        let Some(out) = io.output(0) else { return };
        let now = stitch_core::packet::now_ns();
        for _ in 0..16 {
            let Some(mut p) = pool::alloc() else { return };
            p.set_timestamp_ns(now);
            if out.transmit(p) {
                self.sent.add(1);
            }
        }
    }
}

/// Counts what it receives (a counter and its state) and holds the write end of a pipe it
/// signs once each time it is built: an inherited pipe shows up as two signatures on one
/// read end.
struct Tally {
    received: Counter,
    total: u64,
    pipe: std::fs::File,
}

impl App for Tally {
    type Config = NoConfig;
    fn declare(_: &NoConfig) -> Result<PortSpec, AppError> {
        Ok(PortSpec::sink())
    }
    fn new(_: NoConfig, ctx: &mut AppContext) -> Result<Self, AppError> {
        let fd: OwnedFd = match ctx.take_inherited() {
            Some(mut d) => d.fds.pop().ok_or("no pipe handed over")?,
            None => PIPE.with(|p| p.1.try_clone()).map_err(|e| e.to_string())?,
        };
        let mut pipe = std::fs::File::from(fd);
        pipe.write_all(b"+").map_err(|e| e.to_string())?;
        Ok(Tally {
            received: ctx.counter("received"),
            total: 0,
            pipe,
        })
    }
    fn push(&mut self, io: &mut Io) {
        let Some(input) = io.input(0) else { return };
        let (n, _) = input.free_available();
        self.received.add(n);
        self.total += n;
    }
    fn snapshot(&self) -> Option<AppSnapshot> {
        Some(AppSnapshot::new(1, self.total))
    }
    fn restore(&mut self, state: AppState) -> Result<(), String> {
        self.total = serde_json::from_value(state.of_version(1)?).map_err(|e| e.to_string())?;
        Ok(())
    }
    fn query(&mut self, _: &serde_json::Value) -> serde_json::Value {
        serde_json::json!(self.total)
    }
    fn hand_over(&mut self) -> Option<Descriptors> {
        Some(Descriptors {
            fds: vec![self.pipe.try_clone().ok()?.into()],
            position: serde_json::Value::Null,
        })
    }
}

thread_local! {
    /// The pipe a first `Tally` signs: (read end, write end).
    static PIPE: (OwnedFd, OwnedFd) = {
        let (r, w) = std::io::pipe().expect("pipe");
        (r.into(), w.into())
    };
}

const GRAPH: &str = "apps:\n  burst: {type: burst}\n  tally: {type: tally}\nlinks: [{link: \"burst.output -> tally.input\", latency: true}]\n";

fn registry() -> Arc<Registry> {
    let mut r = Registry::new();
    r.register(AppType::of::<Burst>("burst", "sends bursts"));
    r.register(AppType::of::<Tally>("tally", "counts"));
    Arc::new(r)
}

fn running(r: &Arc<Registry>) -> Engine {
    let engine = Engine::new(r.clone());
    engine
        .apply(Graph::parse(GRAPH, "t.yaml", Path::new("."), r).unwrap())
        .unwrap();
    let started = Instant::now();
    while engine.query("tally", serde_json::Value::Null).unwrap() == 0 {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "no packet moved"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    engine
}

fn total(engine: &Engine) -> u64 {
    engine
        .query("tally", serde_json::Value::Null)
        .unwrap()
        .as_u64()
        .unwrap()
}

#[test]
fn the_successor_adopts_the_descriptors_and_continues_counters_and_state() {
    let r = registry();
    let first = running(&r);
    // The successor builds on lent descriptors while the first runs on.
    let lent = first.lend_descriptors().unwrap();
    let second = Engine::new(r.clone());
    let prepared = second
        .prepare_inheriting(
            Graph::parse(GRAPH, "t.yaml", Path::new("."), &r).unwrap(),
            lent,
        )
        .unwrap();
    let mut handed = None;
    let taken = first
        .hand_over(|h| {
            handed = Some(h);
            true
        })
        .unwrap();
    assert!(taken);
    let h = handed.unwrap();
    assert_eq!(
        h.left_queued, 0,
        "every queued packet went out before the hand-over"
    );
    let sent = h.apps["burst"].counters["sent"];
    let received = h.apps["tally"].counters["received"];
    assert_eq!(sent, received, "nothing stays behind in the links");
    assert_eq!(h.apps["tally"].state.as_ref().unwrap().state, received);

    let (_, restored) = second
        .commit_inheriting(prepared, h.apps, &h.links)
        .unwrap();
    assert_eq!(restored.restored, ["tally"]);
    assert!(total(&second) >= received, "the state came back");
    let stats = second.stats();
    let counter =
        |app: &str, name: &str| stats.apps.iter().find(|a| a.name == app).unwrap().counters[name];
    assert!(
        counter("tally", "received") >= received,
        "counters continue"
    );
    assert!(counter("burst", "sent") >= sent);
    let link = &stats.links[0];
    assert!(link.stats.tx_packets >= sent, "links count on: {link:?}");
    let measured = h.links["burst.output -> tally.input"].latency.as_ref();
    let measured = measured.expect("the histogram is handed over").count;
    assert!(measured > 0);
    let latency = link.latency.as_ref().expect("the link measures latency");
    assert!(latency.summary.count >= measured, "the histogram counts on");

    // One pipe, signed by both apps.
    let mut read = std::fs::File::from(PIPE.with(|p| p.0.try_clone().unwrap()));
    let mut signatures = [0u8; 2];
    read.read_exact(&mut signatures).unwrap();
    assert_eq!(&signatures, b"++");
}

/// Packets the link's latency histogram counted (None: the link measures none).
fn measured(engine: &Engine) -> Option<u64> {
    let stats = engine.stats();
    stats.links[0].latency.as_ref().map(|l| l.summary.count)
}

#[test]
fn a_links_latency_histogram_counts_on_across_live_changes() {
    let r = registry();
    let engine = running(&r);
    let apply = |links: &str| {
        let text = GRAPH.replace(
            "links: [{link: \"burst.output -> tally.input\", latency: true}]",
            links,
        );
        engine
            .apply(Graph::parse(&text, "t.yaml", Path::new("."), &r).unwrap())
            .unwrap()
    };
    let before = measured(&engine).unwrap();
    assert!(before > 0);
    let summary = engine.stats().links[0].latency.clone().unwrap().summary;
    assert!(summary.min_ns <= summary.p50_ns && summary.p50_ns <= summary.max_ns);
    assert_eq!(summary.unstamped, 0);
    // A new size moves the packets, and the histogram, to a new ring.
    let report =
        apply("links: [{link: \"burst.output -> tally.input\", latency: true, size: 4096}]");
    assert_eq!(report.links_added, ["burst.output -> tally.input"]);
    assert!(measured(&engine).unwrap() >= before, "counts never go back");
    apply("links: [\"burst.output -> tally.input\"]");
    assert_eq!(measured(&engine), None, "switched off");
    let text = engine.graph().unwrap().to_document().to_string();
    assert!(!text.contains("latency"), "{text}");
    apply("links: [{link: \"burst.output -> tally.input\", latency: true}]");
    let started = Instant::now();
    while measured(&engine) == Some(0) {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "nothing measured"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_refused_hand_over_leaves_the_engine_running() {
    let r = registry();
    let engine = running(&r);
    let taken = engine.hand_over(|_| false).unwrap();
    assert!(!taken);
    let before = total(&engine);
    let started = Instant::now();
    while total(&engine) == before {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the engine did not resume"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}
