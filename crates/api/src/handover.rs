//! `stitch upgrade` between two processes of one instance. The running process listens on a
//! Unix socket beside its API socket (`NAME.upgrade`); a new process connects and asks to
//! take over. With every API change held off, the running process:
//!
//! 1. lends duplicates of what carries traffic and runs on: an offer — its command line, the
//!    running graph, each app's provisional position — then the descriptors in batches
//!    (`SCM_RIGHTS`): the instance's lock, the API's listeners, its standard output and error,
//!    each app's sockets and devices, each function process (a pidfd and its output pipes),
//!    which keeps running;
//! 2. waits (traffic flowing) until the new process has built the graph on them and says
//!    `ready`;
//! 3. parks its workers, lets queued packets leave, and sends the final word: each app's
//!    position, counters and state, each link's counters;
//! 4. exits without closing or stopping anything once the new process says `started`. Any
//!    other answer (or none within [`ANSWER_PATIENCE`]) and it carries on: in step 2 it never
//!    stopped, in step 3 its workers resume where they were.
//!
//! So traffic pauses only for step 3 and the new process's start of its workers, not for the
//! new process's start-up. Frames are a 4-byte little-endian length and a JSON document; a
//! descriptor batch is one byte carrying up to [`fdpass::MAX_FDS`] descriptors.

use crate::{Api, Listeners};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use stitch_core::engine::{HandOver, HandedApp, HandedLink};
use stitch_core::{fdpass, AppState, Descriptors};

/// The protocol's own format; a process reading another refuses it and the old one carries on.
/// 3: function processes. 4: `vhost_user` ports, VMs, kernel apps, `pcap_sink`, `capture` and
/// `af_xdp` apps — which a process reading only format 3 would open afresh under the old one,
/// so such a process (an older Stitch) is refused.
pub const HAND_OVER_FORMAT: u32 = 4;

/// The oldest format this process takes over from: a format 3 process lends what format 4
/// lends, less the apps it refuses to hand over.
const OLDEST_TAKEN_OVER: u32 = 3;

/// How long the old process waits for each answer of the new one.
pub const ANSWER_PATIENCE: Duration = Duration::from_secs(30);

/// The hand-over socket of the instance whose API socket is `api_socket`.
pub fn socket_path(api_socket: &Path) -> PathBuf {
    stitch_place::leftovers::upgrade_socket(api_socket)
}

/// What the running process lends first, before the descriptors.
#[derive(Debug, Serialize, Deserialize)]
pub struct Offer {
    pub hand_over_format: u32,
    pub pid: u32,
    /// The running process's command line (its `run` arguments are the successor's).
    pub args: Vec<String>,
    /// Its working folder, from which those arguments' paths are read.
    pub cwd: PathBuf,
    /// The running graph, as a document.
    pub graph: String,
    pub graph_name: String,
    pub base_dir: PathBuf,
    pub tcp_listener: bool,
    /// Apps whose descriptors follow, in this order.
    pub apps: BTreeMap<String, LentApp>,
    /// Then the function processes', in this order (`type` is `process`).
    pub processes: BTreeMap<String, LentApp>,
    /// The service manager's notify socket, which the successor tells about its own successor
    /// in turn (it was started by `stitch upgrade`, outside the service's environment).
    #[serde(default)]
    pub notify_socket: Option<PathBuf>,
}

/// An app's lent descriptors: how many follow in the batches, and its provisional position.
#[derive(Debug, Serialize, Deserialize)]
pub struct LentApp {
    #[serde(rename = "type")]
    pub kind: String,
    pub fds: usize,
    pub position: serde_json::Value,
}

/// The final word, with the old process's workers parked.
#[derive(Debug, Serialize, Deserialize)]
pub struct Final {
    pub apps: BTreeMap<String, FinalApp>,
    pub links: BTreeMap<String, HandedLink>,
    pub drained: u64,
    pub left_queued: u64,
    pub unsaved: Vec<(String, String)>,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct FinalApp {
    #[serde(rename = "type")]
    pub kind: String,
    pub counters: BTreeMap<String, u64>,
    pub state: Option<AppState>,
    pub position: Option<serde_json::Value>,
}

impl Final {
    /// Each app's final word as the engine takes it ([`stitch_core::Engine::commit_inheriting`]).
    pub fn apps(&mut self) -> BTreeMap<String, HandedApp> {
        (std::mem::take(&mut self.apps).into_iter())
            .map(|(name, a)| {
                let handed = HandedApp {
                    kind: a.kind,
                    counters: a.counters,
                    state: a.state,
                    descriptors: a.position.map(|position| Descriptors {
                        fds: Vec::new(),
                        position,
                    }),
                };
                (name, handed)
            })
            .collect()
    }
}

/// What the new process answers.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
enum Answer {
    /// The graph is built on the lent descriptors: send the final word.
    Ready,
    Started,
    Failed(String),
}

#[derive(Serialize, Deserialize)]
struct Request {
    /// The oldest format the new process reads (a process of format 3 compares it with its own).
    take_over: u32,
    pid: u32,
    /// The newest format it reads (absent: `take_over` alone).
    #[serde(default)]
    reads_up_to: Option<u32>,
}

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
enum Reply {
    Refused(String),
    Offer(Box<Offer>),
}

/// What the old process keeps for handing over: the instance's lock, the API's listeners and
/// the `stitch run` command line it was started with.
pub struct Holdings {
    pub lock: OwnedFd,
    pub listeners: Listeners,
    pub command_line: Vec<String>,
}

/// Listens for a successor on `path` for the life of the process; when one takes over, the
/// process exits (status 0) without stopping anything.
pub fn serve(api: Arc<Api>, path: PathBuf, holdings: Holdings) -> anyhow::Result<()> {
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path)
        .map_err(|e| anyhow::anyhow!("cannot listen on {}: {e}", path.display()))?;
    std::thread::Builder::new()
        .name("stitch-upgrade".into())
        .spawn(move || {
            for conn in listener.incoming().flatten() {
                match hand_over(&api, conn, &holdings) {
                    Ok(Some(successor)) => {
                        log::info!("process {successor} took over; this one leaves");
                        tell_service_manager(successor);
                        std::process::exit(0);
                    }
                    Ok(None) => {}
                    Err(e) => log::warn!("upgrade: {e:#}; this process carries on"),
                }
            }
        })?;
    Ok(())
}

/// The notify socket of the process this one took over from, if any.
static INHERITED_SERVICE_MANAGER: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();

/// A process that took over serves the service manager its predecessor served.
pub fn inherit_service_manager(notify_socket: Option<PathBuf>) {
    if let Some(path) = notify_socket {
        let _ = INHERITED_SERVICE_MANAGER.set(path);
    }
}

/// The service manager's notify socket: this process's own (`NOTIFY_SOCKET`, under systemd or
/// `stitch run --supervise`) or the one it inherited in a hand-over.
fn service_manager() -> Option<PathBuf> {
    (std::env::var_os("NOTIFY_SOCKET").map(PathBuf::from))
        .or_else(|| INHERITED_SERVICE_MANAGER.get().cloned())
}

/// Under a service manager, names the successor the service's main process, so that the
/// service lives on in it (the unit says `NotifyAccess=main`).
fn tell_service_manager(successor: u32) {
    let Some(path) = service_manager() else {
        return;
    };
    let sent = std::os::unix::net::UnixDatagram::unbound().and_then(|s| {
        let message = format!(
            "MAINPID={successor}\nSTATUS=upgraded: process {successor} runs the instance\n"
        );
        s.send_to(message.as_bytes(), &path)
    });
    if let Err(e) = sent {
        log::warn!(
            "could not tell the service manager ({}) about process {successor}: {e}",
            path.display()
        );
    }
}

/// One successor's attempt: its pid when it took over.
fn hand_over(api: &Api, mut conn: UnixStream, holdings: &Holdings) -> anyhow::Result<Option<u32>> {
    conn.set_read_timeout(Some(ANSWER_PATIENCE))?;
    let request: Request = read_frame(&mut conn)?;
    let newest = request.reads_up_to.unwrap_or(request.take_over);
    let refusal = (!(request.take_over..=newest).contains(&HAND_OVER_FORMAT)).then(|| {
        format!(
            "the new process reads hand-over formats {}..={newest}, this Stitch hands over in \
             format {HAND_OVER_FORMAT} (is the new binary older?)",
            request.take_over
        )
    });
    if let Some(why) = refusal {
        write_frame(&mut conn, &Reply::Refused(why.clone()))?;
        anyhow::bail!("refused process {}: {why}", request.pid);
    }
    api.while_unchanged(|| {
        let ready = lend(api, &mut conn, holdings)
            .map_err(|e| format!("{e:#}"))
            .and_then(|()| match read_frame::<Answer>(&mut conn) {
                Ok(Answer::Ready) => Ok(()),
                Ok(Answer::Failed(why)) => Err(format!("the new process failed: {why}")),
                Ok(Answer::Started) => Err("the new process started before its time".into()),
                Err(e) => Err(format!("no word from the new process: {e}")),
            });
        if let Err(why) = ready {
            // What the apps let go for the upgrade (direct channels), they take up again.
            if let Err(e) = api.engine().abandon_hand_over() {
                log::warn!("after an abandoned upgrade: {e}");
            }
            anyhow::bail!(why);
        }
        let parked = Instant::now();
        let mut failure = None;
        let taken = api.engine().hand_over(|h| match last_word(&mut conn, h) {
            Ok(()) => true,
            Err(e) => {
                failure = Some(e);
                false
            }
        })?;
        if let Some(e) = failure {
            anyhow::bail!("the new process failed to start: {e:#}");
        }
        log::info!(
            "handed over to process {}: traffic paused {:.1} ms",
            request.pid,
            parked.elapsed().as_secs_f64() * 1e3
        );
        Ok(taken.then_some(request.pid))
    })
}

/// Step 1: the offer and the lent descriptors.
fn lend(api: &Api, conn: &mut UnixStream, holdings: &Holdings) -> anyhow::Result<()> {
    let lent = api.placements().lend()?;
    let mut fds: Vec<BorrowedFd> = vec![holdings.lock.as_fd(), holdings.listeners.unix.as_fd()];
    if let Some(t) = &holdings.listeners.tcp {
        fds.push(t.as_fd());
    }
    let (stdout, stderr) = (std::io::stdout(), std::io::stderr());
    fds.push(stdout.as_fd());
    fds.push(stderr.as_fd());
    let mut app_fds = Vec::new();
    let apps = offered(lent.apps, &mut app_fds);
    let processes = (lent.processes.into_iter())
        .map(|(name, d)| (name, ("process".to_string(), d)))
        .collect();
    let processes = offered(processes, &mut app_fds);
    fds.extend(app_fds.iter().map(|f| f.as_fd()));
    let graph = api.placements().graph();
    let (doc, name, base) = match &graph {
        Some(g) => (
            g.to_document().to_string(),
            "<graph taken over>".to_string(),
            g.graph.base_dir.clone(),
        ),
        None => ("apps: {}\n".into(), "<empty>".into(), PathBuf::from("/")),
    };
    let offer = Offer {
        hand_over_format: HAND_OVER_FORMAT,
        pid: std::process::id(),
        args: holdings.command_line.clone(),
        cwd: std::env::current_dir().unwrap_or_else(|_| PathBuf::from("/")),
        graph: doc,
        graph_name: name,
        base_dir: base,
        tcp_listener: holdings.listeners.tcp.is_some(),
        apps,
        processes,
        notify_socket: service_manager(),
    };
    write_frame(conn, &Reply::Offer(Box::new(offer)))?;
    for batch in fds.chunks(fdpass::MAX_FDS) {
        let raw: Vec<i32> = batch.iter().map(|f| f.as_raw_fd()).collect();
        fdpass::send(conn.as_raw_fd(), &[raw.len() as u8], &raw)?;
    }
    Ok(())
}

/// Each lent item's entry in the offer; its descriptors go to `fds`, in the same order.
fn offered(
    lent: BTreeMap<String, (String, Descriptors)>,
    fds: &mut Vec<OwnedFd>,
) -> BTreeMap<String, LentApp> {
    (lent.into_iter())
        .map(|(name, (kind, d))| {
            let app = LentApp {
                kind,
                fds: d.fds.len(),
                position: d.position,
            };
            fds.extend(d.fds);
            (name, app)
        })
        .collect()
}

/// Step 3, workers parked: the final word, and the answer to it.
fn last_word(conn: &mut UnixStream, h: HandOver) -> anyhow::Result<()> {
    let apps = (h.apps.into_iter())
        .map(|(name, a)| {
            let app = FinalApp {
                kind: a.kind,
                counters: a.counters,
                state: a.state,
                position: a.descriptors.map(|d| d.position),
            };
            (name, app)
        })
        .collect();
    let last = Final {
        apps,
        links: h.links,
        drained: h.drained,
        left_queued: h.left_queued,
        unsaved: h.unsaved,
    };
    write_frame(conn, &last)?;
    match read_frame::<Answer>(conn) {
        Ok(Answer::Started) => Ok(()),
        Ok(Answer::Failed(why)) => Err(anyhow::anyhow!("{why}")),
        Ok(Answer::Ready) => Err(anyhow::anyhow!("said ready twice")),
        Err(e) => Err(anyhow::anyhow!("no answer: {e}")),
    }
}

/// What a new process received from the one it takes over from.
pub struct Inheritance {
    pub offer: Offer,
    pub lock: OwnedFd,
    pub listeners: Listeners,
    pub stdout: OwnedFd,
    pub stderr: OwnedFd,
    /// Each app's type and lent descriptors, and each function process's, for
    /// [`stitch_place::Placements::prepare_inheriting`].
    pub lent: stitch_place::handover::Lent,
}

/// The old process's end of the hand-over.
pub struct AnswerTo {
    conn: UnixStream,
}

/// Asks the instance whose API socket is `api_socket` for everything it runs on; the old
/// process hears from this one through the [`AnswerTo`].
pub fn take_over(api_socket: &Path) -> anyhow::Result<(Inheritance, AnswerTo)> {
    let path = socket_path(api_socket);
    let mut conn = UnixStream::connect(&path).map_err(|e| {
        anyhow::anyhow!(
            "no instance offers a hand-over on {}: {e} (is it running, and started by a Stitch \
             that can be upgraded?)",
            path.display()
        )
    })?;
    conn.set_read_timeout(Some(ANSWER_PATIENCE))?;
    write_frame(
        &mut conn,
        &Request {
            take_over: OLDEST_TAKEN_OVER,
            pid: std::process::id(),
            reads_up_to: Some(HAND_OVER_FORMAT),
        },
    )?;
    let mut offer = match read_frame::<Reply>(&mut conn)? {
        Reply::Refused(why) => anyhow::bail!("the running instance refused: {why}"),
        Reply::Offer(o) => *o,
    };
    let tcp = usize::from(offer.tcp_listener);
    let wanted = 4
        + tcp
        + (offer.apps.values().chain(offer.processes.values()))
            .map(|a| a.fds)
            .sum::<usize>();
    let mut fds = Vec::with_capacity(wanted);
    while fds.len() < wanted {
        let (_, batch) = fdpass::recv(conn.as_raw_fd(), 1).map_err(|e| {
            anyhow::anyhow!(
                "receiving the descriptors: {e} (after {} of {wanted}; is the open-files limit, \
                 ulimit -n, high enough?)",
                fds.len()
            )
        })?;
        anyhow::ensure!(
            !batch.is_empty(),
            "the hand-over stopped after {} descriptors of {wanted}",
            fds.len()
        );
        fds.extend(batch);
    }
    let mut fds = fds.into_iter();
    let mut next = || fds.next().expect("counted above");
    let lock = next();
    let listeners = Listeners {
        unix: UnixListener::from(next()),
        tcp: (tcp == 1).then(|| std::net::TcpListener::from(next())),
    };
    let (stdout, stderr) = (next(), next());
    let mut received =
        |lent: BTreeMap<String, LentApp>| -> BTreeMap<String, (String, Descriptors)> {
            (lent.into_iter())
                .map(|(name, a)| {
                    let d = Descriptors {
                        fds: (0..a.fds).map(|_| next()).collect(),
                        position: a.position,
                    };
                    (name, (a.kind, d))
                })
                .collect()
        };
    let apps = received(std::mem::take(&mut offer.apps));
    let processes = (received(std::mem::take(&mut offer.processes)).into_iter())
        .map(|(name, (_, d))| (name, d))
        .collect();
    let lent = stitch_place::handover::Lent { apps, processes };
    let inheritance = Inheritance {
        offer,
        lock,
        listeners,
        stdout,
        stderr,
        lent,
    };
    Ok((inheritance, AnswerTo { conn }))
}

impl AnswerTo {
    /// Tells the old process the graph is built: it parks and sends its final word.
    pub fn ready(&mut self) -> anyhow::Result<Final> {
        write_frame(&mut self.conn, &Answer::Ready)?;
        read_frame(&mut self.conn)
    }

    /// Tells the old process the graph runs here: it exits.
    pub fn started(mut self) -> anyhow::Result<()> {
        write_frame(&mut self.conn, &Answer::Started)
    }

    /// Tells the old process this one could not start: it carries on.
    pub fn failed(mut self, why: &str) {
        let _ = write_frame(&mut self.conn, &Answer::Failed(why.to_string()));
    }
}

fn write_frame<T: Serialize>(conn: &mut UnixStream, v: &T) -> anyhow::Result<()> {
    let bytes = serde_json::to_vec(v)?;
    conn.write_all(&(bytes.len() as u32).to_le_bytes())?;
    conn.write_all(&bytes)?;
    Ok(())
}

fn read_frame<T: for<'de> Deserialize<'de>>(conn: &mut UnixStream) -> anyhow::Result<T> {
    let mut len = [0u8; 4];
    conn.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    anyhow::ensure!(len <= 1 << 30, "a frame of {len} bytes");
    let mut bytes = vec![0; len];
    conn.read_exact(&mut bytes)?;
    Ok(serde_json::from_slice(&bytes)?)
}
