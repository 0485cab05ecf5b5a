//! Apps: the network functions the engine runs, and the registry of app types.
//!
//! An app implements [`App`]: a typed serde config, the ports it offers, and the breath-loop
//! callbacks. The engine only ever sees apps through the object-safe [`DynApp`], and app types
//! through [`AppType`] entries of a [`Registry`], so the core knows nothing about any function.

use crate::link::{Consumer, Producer};
use serde::de::DeserializeOwned;
use smallvec::SmallVec;
use std::any::Any;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Error of building or configuring an app; its text is shown to the user as is.
pub type AppError = Box<dyn std::error::Error + Send + Sync>;

/// Port names an app offers on one side.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PortNames {
    /// Exactly these names, each optional to connect; slot `i` of [`Io`] is name `i`.
    Fixed(Vec<String>),
    /// Any names; slots are the connected ports in the order the graph lists their links.
    Any,
}

impl PortNames {
    pub fn none() -> PortNames {
        PortNames::Fixed(Vec::new())
    }

    pub fn one(name: &str) -> PortNames {
        PortNames::Fixed(vec![name.to_string()])
    }

    pub fn accepts(&self, name: &str) -> bool {
        match self {
            PortNames::Fixed(names) => names.iter().any(|n| n == name),
            PortNames::Any => true,
        }
    }

    pub fn describe(&self) -> String {
        match self {
            PortNames::Fixed(n) if n.is_empty() => "none".into(),
            PortNames::Fixed(n) => n.join(", "),
            PortNames::Any => "any name".into(),
        }
    }
}

/// The ports an app offers, declared from its config before it is built.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortSpec {
    pub inputs: PortNames,
    pub outputs: PortNames,
}

impl PortSpec {
    /// One input `input` and one output `output`.
    pub fn filter() -> PortSpec {
        PortSpec {
            inputs: PortNames::one("input"),
            outputs: PortNames::one("output"),
        }
    }

    /// Only an output `output`.
    pub fn source() -> PortSpec {
        PortSpec {
            inputs: PortNames::none(),
            outputs: PortNames::one("output"),
        }
    }

    /// Only an input `input`.
    pub fn sink() -> PortSpec {
        PortSpec {
            inputs: PortNames::one("input"),
            outputs: PortNames::none(),
        }
    }
}

/// Link ends of one side of an app, by port slot: the first two inline (most apps have one or
/// two ports a side), so that a breath finds them beside the app's slot.
pub(crate) type Ends<T> = SmallVec<[Option<T>; 2]>;

/// The link ends of one app, by port slot. The fields a breath reads come first (`repr(C)`).
#[derive(Default)]
#[repr(C)]
pub struct Io {
    pub(crate) inputs: Ends<Consumer>,
    pub(crate) outputs: Ends<Producer>,
    /// Which breath callbacks the app turned out not to have: the default bodies of
    /// [`App::pull`] and [`App::push`] say so here, and the engine stops calling them.
    pub(crate) lacks: Callbacks,
    pub(crate) input_names: Vec<String>,
    pub(crate) output_names: Vec<String>,
    /// Set by [`Io::moved_off_links`], taken by the worker after the callback.
    pub(crate) moved_off_links: bool,
}

/// The breath callbacks an app has shown it lacks.
#[derive(Default, Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Callbacks {
    pub(crate) pull: bool,
    pub(crate) push: bool,
}

impl Io {
    /// Builds port tables by hand (tests, benchmarks, embedding an app without an engine).
    pub fn new(inputs: Vec<(String, Consumer)>, outputs: Vec<(String, Producer)>) -> Io {
        let (input_names, inputs) = inputs.into_iter().map(|(n, c)| (n, Some(c))).unzip();
        let (output_names, outputs) = outputs.into_iter().map(|(n, p)| (n, Some(p))).unzip();
        Io {
            inputs,
            outputs,
            input_names,
            output_names,
            lacks: Callbacks::default(),
            moved_off_links: false,
        }
    }

    /// Says the app moved packets in this callback where no link of the engine sees them (a
    /// direct path from one guest's ring to another's): the worker judges whether a breath
    /// was idle, and sleeps, by its links alone otherwise.
    #[inline]
    pub fn moved_off_links(&mut self) {
        self.moved_off_links = true;
    }

    /// The link on input slot `i`, if connected.
    #[inline]
    pub fn input(&mut self, i: usize) -> Option<&mut Consumer> {
        self.inputs.get_mut(i).and_then(Option::as_mut)
    }

    /// The link on output slot `i`, if connected.
    #[inline]
    pub fn output(&mut self, i: usize) -> Option<&mut Producer> {
        self.outputs.get_mut(i).and_then(Option::as_mut)
    }

    /// Tags this app's end of its first output's link and of its first input's link with
    /// `ends`' tag (what it says it is, for the app at the other end:
    /// [`crate::link::EndTag`]), once per link.
    pub fn tag_ends(&mut self, ends: &mut crate::link::TaggedEnds) {
        if let Some(o) = self.output(0) {
            let r = std::sync::Arc::as_ptr(o.ring()) as usize;
            if ends.tagged[0] != r {
                o.ring().tag_producer_end(ends.tag.clone());
                ends.tagged[0] = r;
            }
        }
        if let Some(i) = self.input(0) {
            let r = std::sync::Arc::as_ptr(i.ring()) as usize;
            if ends.tagged[1] != r {
                i.ring().tag_consumer_end(ends.tag.clone());
                ends.tagged[1] = r;
            }
        }
    }

    /// Input slot `i` and output slot `o` at once.
    #[inline]
    pub fn pair(&mut self, i: usize, o: usize) -> (Option<&mut Consumer>, Option<&mut Producer>) {
        (
            self.inputs.get_mut(i).and_then(Option::as_mut),
            self.outputs.get_mut(o).and_then(Option::as_mut),
        )
    }

    /// All slots of both sides (slots of unconnected fixed ports are `None`).
    #[inline]
    pub fn split(&mut self) -> (&mut [Option<Consumer>], &mut [Option<Producer>]) {
        (&mut self.inputs, &mut self.outputs)
    }

    pub fn input_names(&self) -> &[String] {
        &self.input_names
    }

    pub fn output_names(&self) -> &[String] {
        &self.output_names
    }

    /// Output slot of a port name.
    pub fn output_slot(&self, name: &str) -> Option<usize> {
        self.output_names.iter().position(|n| n == name)
    }

    /// Input slot of a port name.
    pub fn input_slot(&self, name: &str) -> Option<usize> {
        self.input_names.iter().position(|n| n == name)
    }

    /// Number of connected output links.
    pub fn connected_outputs(&self) -> usize {
        self.outputs.iter().filter(|o| o.is_some()).count()
    }
}

/// A counter written by its app's thread and read by anyone (stats, API).
#[derive(Clone, Default)]
pub struct Counter(Arc<AtomicU64>);

impl Counter {
    /// Adds `n`. Only the owning app writes, so a plain load and store suffice.
    #[inline]
    pub fn add(&self, n: u64) {
        self.0.store(self.0.load(Relaxed).wrapping_add(n), Relaxed);
    }

    #[inline]
    pub fn set(&self, v: u64) {
        self.0.store(v, Relaxed);
    }

    #[inline]
    pub fn get(&self) -> u64 {
        self.0.load(Relaxed)
    }
}

impl std::fmt::Debug for Counter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Counter({})", self.get())
    }
}

/// The named counters of one app.
#[derive(Clone, Default)]
pub struct Counters(Arc<Mutex<Vec<(String, Counter)>>>);

impl Counters {
    /// The counter `name`, created at zero if new.
    pub fn get(&self, name: &str) -> Counter {
        let mut v = self.0.lock().unwrap();
        if let Some((_, c)) = v.iter().find(|(n, _)| n == name) {
            return c.clone();
        }
        let c = Counter::default();
        v.push((name.to_string(), c.clone()));
        c
    }

    /// Sets each counter of `values` (an app's counters as its predecessor left them).
    pub fn continue_from(&self, values: &BTreeMap<String, u64>) {
        for (name, v) in values {
            self.get(name).set(*v);
        }
    }

    pub fn snapshot(&self) -> BTreeMap<String, u64> {
        self.0
            .lock()
            .unwrap()
            .iter()
            .map(|(n, c)| (n.clone(), c.get()))
            .collect()
    }
}

/// Which shard of a sharded app (`shards:` in the graph file) an instance is.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Shard {
    /// The app's name in the file.
    pub of: String,
    pub index: usize,
    pub count: usize,
}

/// What an app gets when it is built or reconfigured.
pub struct AppContext {
    name: String,
    base_dir: PathBuf,
    counters: Counters,
    inherited: Option<Descriptors>,
    shard: Option<Shard>,
}

impl AppContext {
    pub fn new(name: &str, base_dir: &Path, counters: Counters) -> AppContext {
        AppContext {
            name: name.to_string(),
            base_dir: base_dir.to_path_buf(),
            counters,
            inherited: None,
            shard: None,
        }
    }

    /// Builds the app as shard `shard` of a sharded app.
    pub fn set_shard(&mut self, shard: Option<Shard>) {
        self.shard = shard;
    }

    /// Which shard of its app this instance is (`shards:` in the graph file); `None` for an
    /// app that is not sharded.
    pub fn shard(&self) -> Option<&Shard> {
        self.shard.as_ref()
    }

    /// Gives the app being built what its predecessor handed over (an upgrade).
    pub fn inherit(&mut self, descriptors: Descriptors) {
        self.inherited = Some(descriptors);
    }

    /// What the app of this name in the process Stitch is taking over from carried its traffic
    /// on ([`App::hand_over`]): the app adopts it instead of opening its own. `None` on an
    /// ordinary start.
    pub fn take_inherited(&mut self) -> Option<Descriptors> {
        self.inherited.take()
    }

    /// The app's name in the graph.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// A counter shown with the app's stats; survives reconfiguration.
    pub fn counter(&self, name: &str) -> Counter {
        self.counters.get(name)
    }

    /// Resolves a path from the config: relative paths are taken from the graph file's folder.
    pub fn path(&self, p: impl AsRef<Path>) -> PathBuf {
        let p = p.as_ref();
        if p.is_absolute() {
            p.to_path_buf()
        } else {
            self.base_dir.join(p)
        }
    }
}

/// Outcome of a live reconfiguration.
pub enum Reconfigured {
    /// The app took the new config and keeps its state.
    Done,
    /// The app cannot change in place: the engine stops it and builds a new one.
    Restart,
}

/// The most packets a source should bring into the graph in one breath (`pull`), as the
/// drivers' bursts do. A breath's packets then cross every link of the chain while their ring
/// slots and headers are still in the first two cache levels; a source that filled its whole
/// link (1024) each breath made every hop of an 8-forwarder chain several times dearer (Snabb
/// caps its sources the same way: `engine.pull_npackets`).
pub const PULL_BURST: usize = 256;

/// A network function. See the crate docs of `stitch-apps` for examples.
pub trait App: Send + 'static {
    /// The app's config, deserialized from its entry in the graph file (minus `type` and
    /// `worker`). Use `#[serde(deny_unknown_fields)]` so that typos are errors.
    /// Its schema (`schemars::JsonSchema`, derived beside `Deserialize`) carries every
    /// setting's type, default and doc comment into the apps' reference (`stitch apps --doc`).
    type Config: DeserializeOwned + schemars::JsonSchema + Send + 'static;

    /// A complete example of the settings (a YAML mapping, as under the app's name in a graph
    /// file, without `type`): shown in the apps' reference and checked to parse and declare.
    const EXAMPLE: &'static str = "";

    /// Whether the shards of a sharded app of this type hand packets to one another: each
    /// shard then has ports `shard0` … `shard<N-1>` after its own (input and output, the own
    /// index unlinked), linked to every other shard, to send a packet to the shard that owns
    /// its flow.
    const HANDS_OFF: bool = false;

    /// Checks the config beyond what serde checks and declares the ports. Runs at `stitch check`
    /// time, so it must not touch the outside world.
    fn declare(config: &Self::Config) -> Result<PortSpec, AppError>;

    /// What `stitch check` can see of the host the app needs, without changing anything:
    /// each problem a start here would meet (an interface or a file that is missing), for a
    /// warning — the graph may be meant for another host. `base_dir`: the graph file's folder,
    /// from which relative paths are taken.
    fn check_host(_config: &Self::Config, _base_dir: &std::path::Path) -> Vec<String> {
        Vec::new()
    }

    /// Builds the app (may open files and devices).
    fn new(config: Self::Config, ctx: &mut AppContext) -> Result<Self, AppError>
    where
        Self: Sized;

    /// Brings packets in from outside the graph (sources, drivers). An app without it is not
    /// called for it: the default tells the engine so on the first call.
    fn pull(&mut self, io: &mut Io) {
        io.lacks.pull = true;
    }

    /// Processes packets from input links to output links. An app without it is not called for
    /// it: the default tells the engine so on the first call.
    fn push(&mut self, io: &mut Io) {
        io.lacks.push = true;
    }

    /// Called about every millisecond, for timers and housekeeping.
    fn tick(&mut self, _io: &mut Io, _now: Instant) {}

    /// Takes a changed config while running; the default asks for a restart.
    fn reconfigure(
        &mut self,
        _config: Self::Config,
        _ctx: &mut AppContext,
    ) -> Result<Reconfigured, AppError> {
        Ok(Reconfigured::Restart)
    }

    /// Releases resources and flushes output; called once, before the app is dropped.
    fn stop(&mut self) {}

    /// A finite source says so once it has nothing more to send; when every app with `pull`
    /// that can finish has finished and all links are empty, `stitch run` ends.
    fn finished(&self) -> Option<bool> {
        None
    }

    /// Answers an app-specific request from the control socket (`stitch show APP`): tables,
    /// sessions, state. Runs on the app's worker between breaths, so keep it short.
    fn query(&mut self, _request: &serde_json::Value) -> serde_json::Value {
        serde_json::Value::Null
    }

    /// The state worth carrying across a restart of Stitch (mappings, learned tables,
    /// connections), in a format the app versions itself; `None` for an app that keeps none.
    /// Runs on the app's worker between breaths, so it only copies the entries out
    /// ([`AppSnapshot::new`]); they are serialized later, off the data path.
    fn snapshot(&self) -> Option<AppSnapshot> {
        None
    }

    /// Takes back state an earlier [`App::snapshot`] gave, right after `new` and before the
    /// first breath. A version the app cannot read is refused with the reason, and the app
    /// starts fresh: never misread.
    fn restore(&mut self, _state: AppState) -> Result<(), String> {
        Err("this app keeps no state across restarts".into())
    }

    /// Duplicates of the descriptors that carry the app's traffic (sockets, rings, devices)
    /// and where it is in them, for a new Stitch process taking over (`stitch upgrade`): its
    /// app of the same name and type adopts them in `new` ([`AppContext::take_inherited`]),
    /// so that nothing is closed and reopened. Called on a parked worker, with every link
    /// drained; the app keeps its own descriptors, in case the successor fails. `None`: the
    /// successor opens its own.
    fn hand_over(&mut self) -> Option<Descriptors> {
        None
    }

    /// An upgrade begins: its descriptors are lent to a successor next ([`App::hand_over`]),
    /// which takes over at the final hand-over unless the upgrade is abandoned
    /// ([`App::carry_on`]). Let go meanwhile of what no successor can take over (a switch
    /// hands its functions' direct channels back). Called on a parked worker; the workers run
    /// on after it.
    fn prepare_for_hand_over(&mut self) {}

    /// The final [`App::hand_over`] comes next: stop taking changes from outside that it would
    /// have to describe (a front-end's control messages) — for good if the successor takes
    /// over, until [`App::carry_on`] if not. Called on a parked worker.
    fn hold_for_hand_over(&mut self) {}

    /// The successor did not take over after [`App::prepare_for_hand_over`] or
    /// [`App::hold_for_hand_over`]: carry on as before.
    fn carry_on(&mut self) {}

    /// Where the predecessor stopped in the descriptors it lent (the `position` of its last
    /// [`App::hand_over`], taken with its workers parked), given after `new` and before the
    /// first breath; the position `new` was given was provisional. A position the app cannot
    /// take fails the take-over (and the predecessor carries on).
    fn take_position(&mut self, _position: serde_json::Value) -> Result<(), String> {
        Ok(())
    }

    /// Packets this app handed outside the process that are still to come back to it (a
    /// function process's ring): before an upgrade hands over, the engine pulls such an app
    /// until they are back.
    fn outstanding(&self) -> u64 {
        0
    }
}

/// What an app hands its successor at an upgrade ([`App::hand_over`]).
#[derive(Debug)]
pub struct Descriptors {
    pub fds: Vec<std::os::fd::OwnedFd>,
    /// The app's place in them (a ring's cursor), in a format of its own.
    pub position: serde_json::Value,
}

/// An app's state as it carries it across a restart: its own format `version` and the data.
/// Times are written as what is left of them (seconds), never as instants of one process.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct AppState {
    pub version: u32,
    pub state: serde_json::Value,
}

/// An app's state as its worker copied it out, serialized when [`AppSnapshot::into_state`] is
/// called (by the engine's caller, not on the worker: a table of 100 000 entries takes tens of
/// milliseconds to serialize, a breath must not).
pub struct AppSnapshot {
    version: u32,
    serialize: Box<dyn FnOnce() -> Result<serde_json::Value, String> + Send>,
}

impl AppSnapshot {
    pub fn new<T: serde::Serialize + Send + 'static>(version: u32, data: T) -> AppSnapshot {
        AppSnapshot {
            version,
            serialize: Box::new(move || serde_json::to_value(data).map_err(|e| e.to_string())),
        }
    }

    pub fn into_state(self) -> Result<AppState, String> {
        Ok(AppState {
            version: self.version,
            state: (self.serialize)()?,
        })
    }
}

impl AppState {
    /// The state of an app that reads format `version` only; the error names both versions.
    pub fn of_version(self, version: u32) -> Result<serde_json::Value, String> {
        if self.version == version {
            Ok(self.state)
        } else {
            Err(format!(
                "state format version {} (this Stitch reads version {version})",
                self.version
            ))
        }
    }
}

type AnyConfig = Box<dyn Any + Send>;

/// Object-safe view of an [`App`], used by the engine.
pub trait DynApp: Send {
    fn pull(&mut self, io: &mut Io);
    fn push(&mut self, io: &mut Io);
    fn tick(&mut self, io: &mut Io, now: Instant);
    fn reconfigure(
        &mut self,
        config: AnyConfig,
        ctx: &mut AppContext,
    ) -> Result<Reconfigured, AppError>;
    fn stop(&mut self);
    fn finished(&self) -> Option<bool>;
    fn query(&mut self, request: &serde_json::Value) -> serde_json::Value;
    fn snapshot(&self) -> Option<AppSnapshot>;
    fn restore(&mut self, state: AppState) -> Result<(), String>;
    fn hand_over(&mut self) -> Option<Descriptors>;
    fn prepare_for_hand_over(&mut self);
    fn hold_for_hand_over(&mut self);
    fn carry_on(&mut self);
    fn take_position(&mut self, position: serde_json::Value) -> Result<(), String>;
    fn outstanding(&self) -> u64;
}

impl<A: App> DynApp for A {
    #[inline]
    fn pull(&mut self, io: &mut Io) {
        App::pull(self, io)
    }
    #[inline]
    fn push(&mut self, io: &mut Io) {
        App::push(self, io)
    }
    fn tick(&mut self, io: &mut Io, now: Instant) {
        App::tick(self, io, now)
    }
    fn reconfigure(
        &mut self,
        config: AnyConfig,
        ctx: &mut AppContext,
    ) -> Result<Reconfigured, AppError> {
        match config.downcast::<A::Config>() {
            Ok(c) => App::reconfigure(self, *c, ctx),
            Err(_) => Ok(Reconfigured::Restart),
        }
    }
    fn stop(&mut self) {
        App::stop(self)
    }
    fn finished(&self) -> Option<bool> {
        App::finished(self)
    }
    fn query(&mut self, request: &serde_json::Value) -> serde_json::Value {
        App::query(self, request)
    }
    fn snapshot(&self) -> Option<AppSnapshot> {
        App::snapshot(self)
    }
    fn restore(&mut self, state: AppState) -> Result<(), String> {
        App::restore(self, state)
    }
    fn hand_over(&mut self) -> Option<Descriptors> {
        App::hand_over(self)
    }
    fn prepare_for_hand_over(&mut self) {
        App::prepare_for_hand_over(self)
    }
    fn hold_for_hand_over(&mut self) {
        App::hold_for_hand_over(self)
    }
    fn carry_on(&mut self) {
        App::carry_on(self)
    }
    fn take_position(&mut self, position: serde_json::Value) -> Result<(), String> {
        App::take_position(self, position)
    }
    fn outstanding(&self) -> u64 {
        App::outstanding(self)
    }
}

/// A config error inside one app's entry: the path of the bad key (`""` for the whole entry).
#[derive(Debug, Clone)]
pub struct ConfigError {
    pub path: String,
    pub message: String,
}

/// A parsed, type-erased app config.
pub struct ParsedConfig(AnyConfig);

/// One registered app type.
pub struct AppType {
    pub name: &'static str,
    /// One-line summary shown by `stitch apps`.
    pub summary: &'static str,
    /// Whether its shards hand packets to one another ([`App::HANDS_OFF`]).
    pub hands_off: bool,
    /// [`App::EXAMPLE`].
    pub example: &'static str,
    schema: fn() -> serde_json::Value,
    check_host: fn(&ParsedConfig, &std::path::Path) -> Vec<String>,
    parse: fn(&serde_json::Value) -> Result<ParsedConfig, ConfigError>,
    declare: fn(&ParsedConfig) -> Result<PortSpec, AppError>,
    build: BuildFn,
}

type BuildFn = fn(ParsedConfig, &mut AppContext) -> Result<Box<dyn DynApp>, AppError>;

fn parse_as<A: App>(v: &serde_json::Value) -> Result<ParsedConfig, ConfigError> {
    serde_path_to_error::deserialize::<_, A::Config>(v)
        .map(|c| ParsedConfig(Box::new(c)))
        .map_err(|e| ConfigError {
            path: e.path().to_string(),
            message: e.into_inner().to_string(),
        })
}

fn schema_of<A: App>() -> serde_json::Value {
    schemars::schema_for!(A::Config).to_value()
}

fn check_host_as<A: App>(c: &ParsedConfig, base_dir: &std::path::Path) -> Vec<String> {
    A::check_host(
        c.0.downcast_ref::<A::Config>()
            .expect("config of another app type"),
        base_dir,
    )
}

fn declare_as<A: App>(c: &ParsedConfig) -> Result<PortSpec, AppError> {
    A::declare(
        c.0.downcast_ref::<A::Config>()
            .expect("config of another app type"),
    )
}

fn build_as<A: App>(c: ParsedConfig, ctx: &mut AppContext) -> Result<Box<dyn DynApp>, AppError> {
    let c =
        c.0.downcast::<A::Config>()
            .expect("config of another app type");
    Ok(Box::new(A::new(*c, ctx)?))
}

impl AppType {
    pub fn of<A: App>(name: &'static str, summary: &'static str) -> AppType {
        AppType {
            name,
            summary,
            hands_off: A::HANDS_OFF,
            example: A::EXAMPLE,
            schema: schema_of::<A>,
            check_host: check_host_as::<A>,
            parse: parse_as::<A>,
            declare: declare_as::<A>,
            build: build_as::<A>,
        }
    }

    /// The JSON Schema (draft 2020-12) of its config, doc comments as descriptions.
    pub fn config_schema(&self) -> serde_json::Value {
        (self.schema)()
    }

    pub fn parse(&self, v: &serde_json::Value) -> Result<ParsedConfig, ConfigError> {
        (self.parse)(v)
    }

    /// [`App::check_host`].
    pub fn check_host(&self, c: &ParsedConfig, base_dir: &std::path::Path) -> Vec<String> {
        (self.check_host)(c, base_dir)
    }

    pub fn declare(&self, c: &ParsedConfig) -> Result<PortSpec, AppError> {
        (self.declare)(c)
    }

    pub fn build(
        &self,
        c: ParsedConfig,
        ctx: &mut AppContext,
    ) -> Result<Box<dyn DynApp>, AppError> {
        (self.build)(c, ctx)
    }
}

impl ParsedConfig {
    pub(crate) fn into_any(self) -> AnyConfig {
        self.0
    }
}

/// The app types an engine can instantiate, by name.
#[derive(Default)]
pub struct Registry {
    types: BTreeMap<&'static str, AppType>,
}

impl Registry {
    pub fn new() -> Registry {
        Registry::default()
    }

    pub fn register(&mut self, t: AppType) -> &mut Self {
        self.types.insert(t.name, t);
        self
    }

    pub fn get(&self, name: &str) -> Option<&AppType> {
        self.types.get(name)
    }

    pub fn types(&self) -> impl Iterator<Item = &AppType> {
        self.types.values()
    }
}
