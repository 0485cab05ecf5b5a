//! The forwarding table of a router that follows a kernel table, compiled on a thread of its
//! own: the worker hands it the netlink messages of its `kernel` input and keeps forwarding by
//! the table it has; the thread keeps the kernel table, gathers changes for a moment, compiles
//! a new forwarding table from it and the configured routes, and hands that back for the
//! worker to swap in at its next tick. A full table (a million routes) takes a compile of a few
//! hundred milliseconds — off the worker, forwarding never waits for it.

use super::kernel::KernelTable;
use super::{compile, Fib, KernelRoutes, Route, Route6};
use ipnet::{Ipv4Net, Ipv6Net};
use prefix_trie::PrefixMap;
use std::net::IpAddr;
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

/// The configured side of the table: connected and static routes, the interfaces' names.
#[derive(Clone)]
pub(super) struct Configured {
    pub(super) routes: PrefixMap<Ipv4Net, Route>,
    pub(super) routes6: PrefixMap<Ipv6Net, Route6>,
    pub(super) names: Vec<String>,
}

enum Job {
    /// The bytes of one or more netlink messages, back to back.
    Messages(Vec<u8>),
    Configured(Box<Configured>),
    /// A table the worker no longer uses: freed here, not on the worker.
    Retired(Box<Fib>),
    /// The kernel table, for a successor: written to this file ([`write_handed`]).
    Export(std::fs::File),
}

/// What the kernel table holds, for `stitch show`.
#[derive(Clone, Default, serde::Serialize)]
pub(super) struct View {
    pub(super) routes: usize,
    pub(super) synced: bool,
    pub(super) unusable: usize,
    pub(super) messages: u64,
    pub(super) malformed: u64,
    pub(super) refused_dumps: u64,
    /// Changes not yet in the forwarding table.
    pub(super) pending: bool,
    /// How long the last compile took, in milliseconds.
    pub(super) compile_ms: f64,
}

pub(super) struct Built {
    pub(super) fib: Box<Fib>,
    /// Each interface's host side (`None`: the kernel told of no link of its name).
    pub(super) links: Vec<Option<HostLink>>,
}

/// An interface's host side as the kernel tells of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct HostLink {
    pub(super) up: bool,
    pub(super) mtu: Option<usize>,
}

/// Changes are gathered until this long passes without one, or [`GATHER_MOST`] after the first.
const QUIET: Duration = Duration::from_millis(10);
const GATHER_MOST: Duration = Duration::from_millis(100);
/// While a dump is under way, changes are gathered until its end, or this long: the dump is
/// the whole table coming, and compiling the part that came would only delay the whole (each
/// compile costs as much as the table is long). A dump the kernel cut short still compiles.
const DUMP_MOST: Duration = Duration::from_secs(10);

/// The worker's end.
pub(super) struct Builder {
    jobs: mpsc::Sender<Job>,
    built: mpsc::Receiver<Built>,
    view: Arc<Mutex<View>>,
}

impl Builder {
    pub(super) fn start(table: u32, configured: Configured, app: &str) -> Result<Builder, String> {
        let (jobs, job_rx) = mpsc::channel();
        let (built_tx, built) = mpsc::channel();
        let view = Arc::new(Mutex::new(View::default()));
        let shared = view.clone();
        std::thread::Builder::new()
            .name(format!("{app}-fib"))
            .spawn(move || {
                run(
                    KernelTable::new(table),
                    configured,
                    &job_rx,
                    &built_tx,
                    &shared,
                )
            })
            .map_err(|e| format!("cannot start the forwarding-table thread: {e}"))?;
        Ok(Builder { jobs, built, view })
    }

    /// Netlink messages for the kernel table.
    pub(super) fn messages(&self, bytes: Vec<u8>) {
        let _ = self.jobs.send(Job::Messages(bytes));
    }

    pub(super) fn configured(&self, c: Configured) {
        let _ = self.jobs.send(Job::Configured(Box::new(c)));
    }

    pub(super) fn retire(&self, fib: Box<Fib>) {
        let _ = self.jobs.send(Job::Retired(fib));
    }

    /// Writes the kernel table to `file` for a successor, on the thread (forwarding goes on).
    pub(super) fn export(&self, file: std::fs::File) {
        let _ = self.jobs.send(Job::Export(file));
    }

    /// The first table compiled, waiting up to `patience` for it.
    pub(super) fn wait_built(&self, patience: Duration) -> Option<Built> {
        self.built.recv_timeout(patience).ok()
    }

    /// The newest table compiled since the last call (older ones are retired unused).
    pub(super) fn take_built(&self) -> Option<Built> {
        let mut newest = None;
        while let Ok(b) = self.built.try_recv() {
            if let Some(old) = newest.replace(b) {
                self.retire(old.fib);
            }
        }
        newest
    }

    /// What the kernel table holds now (a lock, taken by a query, never per packet).
    pub(super) fn view(&self) -> View {
        self.view.lock().map(|v| v.clone()).unwrap_or_default()
    }
}

fn run(
    mut table: KernelTable,
    mut configured: Configured,
    jobs: &mpsc::Receiver<Job>,
    built: &mpsc::Sender<Built>,
    shared: &Mutex<View>,
) {
    // Since when changes wait, and when the last came.
    let mut waiting: Option<(Instant, Instant)> = None;
    let mut compile_ms = 0.0;
    let view = |t: &KernelTable, pending: bool, unusable: usize, compile_ms: f64| View {
        routes: t.len(),
        synced: t.synced(),
        unusable,
        messages: t.messages,
        malformed: t.malformed,
        refused_dumps: t.refused_dumps,
        pending,
        compile_ms,
    };
    let mut unusable = 0;
    loop {
        let job = match waiting {
            None => jobs
                .recv()
                .map_err(|_| mpsc::RecvTimeoutError::Disconnected),
            Some((first, last)) => {
                let most = if table.dumping() {
                    DUMP_MOST
                } else {
                    GATHER_MOST
                };
                let due = (last + QUIET).min(first + most);
                jobs.recv_timeout(due.saturating_duration_since(Instant::now()))
            }
        };
        let changed = match job {
            Ok(Job::Messages(bytes)) => {
                table.apply(&bytes);
                table.take_dirty()
            }
            Ok(Job::Configured(c)) => {
                configured = *c;
                true
            }
            Ok(Job::Retired(fib)) => {
                drop(fib);
                false
            }
            Ok(Job::Export(file)) => {
                let started = Instant::now();
                match write_handed(&file, &table) {
                    Ok(n) => log::info!(
                        "router: {n} kernel objects written for a successor in {:.0} ms",
                        started.elapsed().as_secs_f64() * 1e3
                    ),
                    Err(e) => log::warn!(
                        "router: the kernel table cannot be written for a successor ({e}); it follows the kernel from its own dump"
                    ),
                }
                false
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                if let Some((first, _)) = waiting {
                    if table.dumping() && first.elapsed() < DUMP_MOST {
                        // A pause in a dump: wait for its end.
                        waiting = Some((first, Instant::now()));
                        continue;
                    }
                }
                let started = Instant::now();
                let kernel = resolved(&table, &configured, &mut unusable);
                match compile(&configured.routes, &configured.routes6, &kernel) {
                    Ok(fib) => {
                        compile_ms = started.elapsed().as_secs_f64() * 1e3;
                        if let Ok(mut s) = shared.lock() {
                            *s = view(&table, false, unusable, compile_ms);
                        }
                        let links = (configured.names.iter())
                            .map(|n| {
                                table.link_named(n).map(|l| HostLink {
                                    up: l.up,
                                    mtu: l.mtu.map(|m| m as usize),
                                })
                            })
                            .collect();
                        let fib = Box::new(fib);
                        if built.send(Built { fib, links }).is_err() {
                            return;
                        }
                    }
                    Err(e) => log::warn!("router: the kernel's routes cannot be compiled: {e}"),
                }
                waiting = None;
                continue;
            }
            // The router is gone.
            Err(mpsc::RecvTimeoutError::Disconnected) => return,
        };
        let now = Instant::now();
        if changed {
            waiting = Some(waiting.map_or((now, now), |(first, _)| (first, now)));
        }
        if let Ok(mut v) = shared.lock() {
            *v = view(&table, waiting.is_some(), unusable, compile_ms);
        }
    }
}

/// The kernel table's routes as ways out of the router's interfaces: out of the interface
/// whose name the route's interface has, or else the one on whose connected subnet the gateway
/// is. `unusable` is set to the number left out.
fn resolved(table: &KernelTable, c: &Configured, unusable: &mut usize) -> KernelRoutes {
    let port_named = |n: &str| c.names.iter().position(|x| x == n);
    let on_link = |a: IpAddr| match a {
        IpAddr::V4(a) => (c.routes.get_lpm(&Ipv4Net::from(a)))
            .filter(|(_, r)| r.via.is_none())
            .map(|(_, r)| r.port),
        IpAddr::V6(a) => (c.routes6.get_lpm(&Ipv6Net::from(a)))
            .filter(|(_, r)| r.via.is_none())
            .map(|(_, r)| r.port),
    };
    let (list, left_out) = table.resolved(port_named, on_link);
    *unusable = left_out;
    let mut out = KernelRoutes::default();
    for ((dst, len), ways) in list {
        match dst {
            IpAddr::V4(a) => {
                let Ok(net) = Ipv4Net::new(a, len) else {
                    continue;
                };
                let ways = ways.iter().filter_map(|&(port, via, w)| match via {
                    Some(IpAddr::V4(v)) => Some((Route { port, via: Some(v) }, w)),
                    None => Some((Route { port, via: None }, w)),
                    Some(IpAddr::V6(_)) => None,
                });
                out.0.push((net.trunc(), ways.collect()));
            }
            IpAddr::V6(a) => {
                let Ok(net) = Ipv6Net::new(a, len) else {
                    continue;
                };
                let ways = ways.iter().filter_map(|&(port, via, w)| match via {
                    Some(IpAddr::V6(v)) => Some((Route6 { port, via: Some(v) }, w)),
                    None => Some((Route6 { port, via: None }, w)),
                    Some(IpAddr::V4(_)) => None,
                });
                out.1.push((net.trunc(), ways.collect()));
            }
        }
    }
    out
}

/// The kernel table as a successor takes it at an upgrade, in a memfd the router lends: the
/// kernel's own messages ([`KernelTable::export`]) from byte 8, and at byte 0 their length
/// plus one, written last (little-endian, 8 bytes) — while it is 0 the file is not whole.
fn write_handed(file: &std::fs::File, table: &KernelTable) -> std::io::Result<u64> {
    use std::io::{Seek, SeekFrom, Write};
    use std::os::unix::fs::FileExt;
    let mut f = file;
    f.seek(SeekFrom::Start(8))?;
    let mut out = std::io::BufWriter::with_capacity(1 << 20, f);
    let n = table.export(&mut out)?;
    out.flush()?;
    drop(out);
    let len = file.metadata()?.len() - 8;
    file.write_all_at(&(len + 1).to_le_bytes(), 0)?;
    Ok(n)
}

/// The messages of a table a predecessor lent ([`write_handed`]), once it has written them
/// all: `None` if it had not within `patience`, or the file is not one.
pub(super) fn read_handed(file: &std::fs::File, patience: Duration) -> Option<Vec<u8>> {
    use std::os::unix::fs::FileExt;
    let since = Instant::now();
    loop {
        let mut header = [0u8; 8];
        let whole = file.read_exact_at(&mut header, 0).is_ok();
        let len = u64::from_le_bytes(header).saturating_sub(1);
        let size = file.metadata().ok()?.len();
        if whole && header != [0; 8] && size >= 8 + len {
            let mut bytes = vec![0u8; usize::try_from(len).ok()?];
            file.read_exact_at(&mut bytes, 8).ok()?;
            return Some(bytes);
        }
        if since.elapsed() > patience {
            log::warn!(
                "router: the predecessor's kernel table did not come within {patience:?}; following the kernel from its own dump"
            );
            return None;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}
