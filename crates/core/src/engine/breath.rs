//! The breath: what each worker thread runs — `pull` on every app, `push` in topological
//! order (again for apps whose inputs are still non-empty, up to a bound), `tick` about every
//! millisecond — and how it sleeps when nothing moves.

use super::*;
use crate::graph::WorkerConfig;
use crate::link::Ring;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Most push passes in one breath (the first in topological order, the rest for leftovers).
pub(super) const MAX_PUSH_PASSES: usize = 8;

pub(super) const TICK_INTERVAL: Duration = Duration::from_millis(1);

thread_local! {
    static BREATH_STARTED: std::cell::Cell<Option<Instant>> = const { std::cell::Cell::new(None) };
}

/// When the current breath of this worker began: one clock read per breath that apps share
/// (thousands of apps reading the clock each breath cost more than their work). Outside a
/// worker (an app driven by a test) it is the current time.
pub fn breath_started() -> Instant {
    BREATH_STARTED
        .with(|b| b.get())
        .unwrap_or_else(Instant::now)
}

/// Per-worker counters.
#[derive(Default)]
pub struct WorkerCounters {
    pub breaths: AtomicU64,
    pub idle_sleeps: AtomicU64,
    /// Whether every finite source of this worker has finished (and it has at least one).
    pub(super) finite_done: AtomicBool,
    pub(super) has_finite: AtomicBool,
}

/// What a worker runs: its apps in topological order.
pub(super) struct Plan {
    pub(super) slots: Vec<AppSlot>,
    pub(super) order: BreathOrder,
    pub(super) rings: Vec<Arc<Ring>>,
    pub(super) busy_poll: bool,
    pub(super) max_sleep: Duration,
    pub(super) core: Option<usize>,
}

pub(super) enum Command {
    Run(Plan),
    Exit,
}

/// A request for one app, answered by its worker between breaths.
/// What a worker is asked about one of its apps, between breaths.
pub(super) enum Ask {
    Query(serde_json::Value),
    /// The app's state as JSON (`null` when it keeps none).
    Snapshot,
    Restore(AppState),
}

/// A worker's answer.
pub(super) enum Answer {
    Value(serde_json::Value),
    Snapshot(Option<AppSnapshot>),
}

pub(super) struct Query {
    pub(super) app: String,
    pub(super) ask: Ask,
    pub(super) reply: mpsc::Sender<Result<Answer, String>>,
}

pub(super) struct Worker {
    pub(super) park: Arc<AtomicBool>,
    pub(super) queries: mpsc::Sender<Query>,
    pub(super) query_flag: Arc<AtomicBool>,
    pub(super) to_worker: mpsc::Sender<Command>,
    pub(super) from_worker: mpsc::Receiver<Plan>,
    pub(super) thread: Option<JoinHandle<()>>,
    pub(super) counters: Arc<WorkerCounters>,
    pub(super) config: WorkerConfig,
}

/// Pins the calling thread to `core`; a failure is logged, and the thread runs where it is.
pub fn pin_to_core(core: usize) {
    // SAFETY: cpu_set_t is a bit array, valid when zeroed; CPU_SET stays inside it for any
    // core below CPU_SETSIZE (libc's CPU_SET checks); sched_setaffinity reads `set` only.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(core, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            log::warn!(
                "cannot pin worker to core {core}: {}",
                std::io::Error::last_os_error()
            );
        }
    }
}

/// The apps a breath calls, as indices into a plan's slots in topological order: those that
/// pull, and those that push and have an input. Snabb's engine keeps the same two lists
/// (`breathe_pull_order`, `breathe_push_order`) so that a breath walks only the apps with work
/// to do, without a test per app per pass.
#[derive(Default)]
pub(super) struct BreathOrder {
    pub(super) pull: Vec<usize>,
    pub(super) push: Vec<usize>,
}

impl BreathOrder {
    pub(super) fn of(slots: &[AppSlot]) -> BreathOrder {
        let live = |s: &AppSlot| !s.failed.load(Ordering::Relaxed);
        let indices = |keep: &dyn Fn(&AppSlot) -> bool| -> Vec<usize> {
            (slots.iter().enumerate())
                .filter(|(_, s)| live(s) && keep(s))
                .map(|(i, _)| i)
                .collect()
        };
        BreathOrder {
            pull: indices(&|s| !s.io.lacks.pull),
            push: indices(&|s| !s.io.lacks.push && s.has_inputs()),
        }
    }
}

/// One breath: every app that pulls brings packets in, then apps push, in topological order,
/// until no input holds packets (at most `MAX_PUSH_PASSES` passes, for links against the
/// order). An app that panics leaves the order at once (a later pass must not call it again);
/// one that lacks a callback, after the breath.
pub(super) fn breathe(plan: &mut Plan) -> bool {
    let pulled = pull_all(plan);
    let mut moved_off_links = pulled.moved_off_links;
    if pulled.panicked {
        plan.order = BreathOrder::of(&plan.slots);
    }
    let mut lacking = pulled.lacking;
    for pass in 0..MAX_PUSH_PASSES {
        let pushed = push_pass(plan, pass);
        lacking |= pushed.lacking;
        moved_off_links |= pushed.moved_off_links;
        if pushed.panicked {
            plan.order = BreathOrder::of(&plan.slots);
        }
        if !pushed.called {
            break;
        }
    }
    if lacking {
        plan.order = BreathOrder::of(&plan.slots);
    }
    moved_off_links
}

/// What a walk over one of a breath's lists saw.
#[derive(Default)]
pub(super) struct Walked {
    /// Whether it called any app.
    pub(super) called: bool,
    /// Whether an app panicked (it is marked failed).
    pub(super) panicked: bool,
    /// Whether an app turned out to lack the callback.
    pub(super) lacking: bool,
    /// Whether an app moved packets no link saw ([`crate::app::Io::moved_off_links`]).
    pub(super) moved_off_links: bool,
}

/// `pull` on every app of the pull list.
pub(super) fn pull_all(plan: &mut Plan) -> Walked {
    let mut walked = Walked::default();
    for &i in &plan.order.pull {
        let s = &mut plan.slots[i];
        walked.panicked |= s.guarded("pull", |a, io| a.pull(io));
        walked.lacking |= s.io.lacks.pull;
        walked.moved_off_links |= std::mem::take(&mut s.io.moved_off_links);
        walked.called = true;
    }
    walked
}

/// One pass of `push` over the push list; after the first, only apps whose inputs hold packets.
/// It stops at an app that panics, which must leave the list before anything is called again.
pub(super) fn push_pass(plan: &mut Plan, pass: usize) -> Walked {
    let mut walked = Walked::default();
    for &i in &plan.order.push {
        let s = &mut plan.slots[i];
        if pass > 0 && !s.io.inputs.iter_mut().flatten().any(|c| !c.is_empty()) {
            continue;
        }
        walked.called = true;
        if s.guarded("push", |a, io| a.push(io)) {
            walked.panicked = true;
            break;
        }
        walked.lacking |= s.io.lacks.push;
        walked.moved_off_links |= std::mem::take(&mut s.io.moved_off_links);
    }
    walked
}

/// Every app's `tick`, and whether the worker's finite sources have all finished.
pub(super) fn tick_apps(plan: &mut Plan, now: Instant, counters: &WorkerCounters) {
    let (mut has_finite, mut done, mut panicked) = (false, true, false);
    for s in plan.slots.iter_mut() {
        if s.failed.load(Ordering::Relaxed) {
            continue;
        }
        panicked |= s.guarded("tick", |a, io| a.tick(io, now));
        if let Some(f) = s.app.finished() {
            has_finite = true;
            done &= f;
        }
    }
    if panicked {
        plan.order = BreathOrder::of(&plan.slots);
    }
    counters.has_finite.store(has_finite, Ordering::Relaxed);
    counters
        .finite_done
        .store(has_finite && done, Ordering::Relaxed);
}

pub(super) fn answer_queries(plan: &mut Plan, queries: &mpsc::Receiver<Query>) {
    while let Ok(q) = queries.try_recv() {
        let answer = match plan.slots.iter_mut().find(|s| s.name == q.app) {
            None => Err(format!("app `{}` is not on this worker any more", q.app)),
            Some(s) => {
                let mut out = Err(format!("app `{}` failed", q.app));
                let panicked = match q.ask {
                    Ask::Query(request) => {
                        s.guarded("query", |a, _| out = Ok(Answer::Value(a.query(&request))))
                    }
                    Ask::Snapshot => {
                        s.guarded("snapshot", |a, _| out = Ok(Answer::Snapshot(a.snapshot())))
                    }
                    Ask::Restore(state) => s.guarded("restore", |a, _| {
                        out = a
                            .restore(state)
                            .map(|()| Answer::Value(serde_json::Value::Null))
                    }),
                };
                if panicked {
                    plan.order = BreathOrder::of(&plan.slots);
                }
                out
            }
        };
        let _ = q.reply.send(answer);
    }
}

pub(super) fn run_worker(
    park: Arc<AtomicBool>,
    from_ctl: mpsc::Receiver<Command>,
    to_ctl: mpsc::Sender<Plan>,
    counters: Arc<WorkerCounters>,
    query_flag: Arc<AtomicBool>,
    queries: mpsc::Receiver<Query>,
) {
    let mut plan = match from_ctl.recv() {
        Ok(Command::Run(p)) => p,
        _ => return,
    };
    let mut pinned = None;
    let mut last_tick = Instant::now();
    let mut sleep = Duration::from_micros(1);
    let mut breaths = 0u64;
    loop {
        if park.load(Ordering::Acquire) {
            counters.breaths.fetch_add(breaths, Ordering::Relaxed);
            breaths = 0;
            if to_ctl.send(plan).is_err() {
                return;
            }
            plan = match from_ctl.recv() {
                Ok(Command::Run(p)) => p,
                _ => return,
            };
            sleep = Duration::from_micros(1);
        }
        // A plain load first: the locked swap only when a query is waiting.
        if query_flag.load(Ordering::Relaxed) && query_flag.swap(false, Ordering::AcqRel) {
            answer_queries(&mut plan, &queries);
        }
        if plan.core != pinned {
            if let Some(c) = plan.core {
                pin_to_core(c);
            }
            pinned = plan.core;
        }
        // Whether a breath moved anything decides the sleep; a busy-polling worker never sleeps.
        let activity = |plan: &Plan| -> u64 {
            if plan.busy_poll {
                0
            } else {
                plan.rings.iter().map(|r| r.activity()).sum()
            }
        };
        let before = activity(&plan);
        let now = Instant::now();
        BREATH_STARTED.with(|b| b.set(Some(now)));
        let moved_off_links = breathe(&mut plan);
        breaths += 1;
        if now.duration_since(last_tick) >= TICK_INTERVAL {
            last_tick = now;
            // Published once per tick, not once per breath: no locked add on the hot loop.
            counters.breaths.fetch_add(breaths, Ordering::Relaxed);
            breaths = 0;
            tick_apps(&mut plan, now, &counters);
        }
        let after = activity(&plan);
        if after != before || moved_off_links || plan.busy_poll {
            sleep = Duration::from_micros(1);
            if plan.busy_poll {
                std::hint::spin_loop();
            }
        } else {
            counters.idle_sleeps.fetch_add(1, Ordering::Relaxed);
            std::thread::sleep(sleep);
            sleep = (sleep * 2).min(plan.max_sleep);
        }
    }
}

pub(super) fn spawn_worker(name: &str, config: WorkerConfig) -> Result<Worker, EngineError> {
    let (to_worker, from_ctl) = mpsc::channel();
    let (to_ctl, from_worker) = mpsc::channel();
    let park = Arc::new(AtomicBool::new(false));
    let counters = Arc::new(WorkerCounters::default());
    let (queries, queries_rx) = mpsc::channel();
    let query_flag = Arc::new(AtomicBool::new(false));
    let (p, c, f) = (park.clone(), counters.clone(), query_flag.clone());
    let thread = std::thread::Builder::new()
        .name(format!("stitch-{name}"))
        .spawn(move || run_worker(p, from_ctl, to_ctl, c, f, queries_rx))
        .map_err(|e| EngineError::Other(format!("cannot start worker `{name}`: {e}")))?;
    Ok(Worker {
        park,
        queries,
        query_flag,
        to_worker,
        from_worker,
        thread: Some(thread),
        counters,
        config,
    })
}
