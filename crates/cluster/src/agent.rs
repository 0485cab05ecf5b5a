//! `stitch agent`: one per host. It registers the host, keeps a lease alive (the host's
//! liveness), campaigns to run the placement controller, and applies its host's graph as etcd
//! holds it: read at revision R, applied by diff, then watched from R+1; when the watch is lost
//! or its revision compacted it reads the graph again (a full resync). When etcd cannot be
//! reached the data plane stays exactly as it is — the agent says so in its status and tries
//! again — because a lost control plane must never take traffic down with it.

use crate::etcd::{self, REQUEST_TIMEOUT};
use crate::keys::{self, Assignment, HostRecord, StatusRecord};
use anyhow::{anyhow, bail, Context, Result};
use etcd_client::{Client, EventType, KeyValue, PutOptions, WatchOptions};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};
use stitch_core::Registry;
use tokio::sync::watch;

/// What `stitch agent` was told.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    pub endpoints: Vec<String>,
    pub host: String,
    pub underlay: IpAddr,
    pub labels: BTreeMap<String, String>,
    /// Seconds the host stays live without a keep-alive.
    pub lease_ttl: i64,
    /// TCP port on the underlay address where the agent answers the controller's probe while
    /// it runs (0: no probe: a host cut off from etcd counts as dead).
    pub probe_port: u16,
    /// What cluster graphs may run here (`--allow-commands`).
    pub allowed: crate::allow::Allowed,
}

/// How the agent makes a graph document the host's running graph; returns the number of apps.
pub type ApplyFn = dyn Fn(&Value) -> Result<usize, String> + Send + Sync;

/// The host graph `doc` with each `attachment` app that something attached locally (an
/// `af_packet` app `stitch-cni` put in its place) kept as attached: as the `running` graph has
/// it, or, after a restart, as the host's records of attached ports (`recorded`, port → app
/// entry) have it.
pub fn keep_attached(
    mut doc: Value,
    running: Option<&Value>,
    recorded: &BTreeMap<String, Value>,
) -> Value {
    let running = running.and_then(|r| r["apps"].as_object());
    if let Some(apps) = doc["apps"].as_object_mut() {
        for (name, entry) in apps.iter_mut() {
            if entry["type"] != "attachment" {
                continue;
            }
            let local = running
                .and_then(|r| r.get(name))
                .filter(|l| l["type"] != "attachment")
                .or_else(|| recorded.get(name));
            if let Some(local) = local {
                *entry = local.clone();
            }
        }
    }
    doc
}

/// What the agent reports (`stitch show`, `/metrics`, its status key).
#[derive(Debug, Default)]
struct State {
    connected: bool,
    /// Since when the agent could not reach etcd (when it cannot).
    unreachable_since: Option<Instant>,
    last_error: Option<String>,
    lease: i64,
    leader: bool,
    /// etcd refused this host's campaign (its user has no role on the election).
    barred_from_election: bool,
    status: StatusRecord,
    /// Whether `status` is what etcd holds under the host's status key: a write that failed
    /// (etcd unreachable) is made again as soon as a session can, not only at the next change.
    status_published: bool,
    resyncs: u64,
    sessions: u64,
    /// What the controller says workloads can send across the cluster's tunnels.
    workload_mtu: Option<u32>,
}

/// A running agent.
pub struct Agent {
    state: Arc<Mutex<State>>,
    stop: watch::Sender<bool>,
    thread: Option<std::thread::JoinHandle<()>>,
    probe: Option<Probe>,
}

/// The answer to the controller's probe: a listening socket on the underlay that accepts and
/// closes connections while the agent's process runs.
struct Probe {
    stop: Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Probe {
    fn listen(addr: IpAddr, port: u16) -> Result<Probe> {
        let listener = std::net::TcpListener::bind((addr, port)).with_context(|| {
            format!("cannot listen for the controller's probe on {addr} port {port} (--probe-port)")
        })?;
        listener.set_nonblocking(true)?;
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("agent-probe".into())
            .spawn(move || {
                while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                    match listener.accept() {
                        Ok((conn, _)) => drop(conn),
                        Err(_) => std::thread::sleep(Duration::from_millis(50)),
                    }
                }
            })?;
        Ok(Probe {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for Probe {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Agent {
    /// Starts the agent on a thread of its own. `placements` are what this host can run.
    pub fn start(
        config: AgentConfig,
        placements: Vec<String>,
        registry: Arc<Registry>,
        apply: Arc<ApplyFn>,
    ) -> Result<Agent> {
        let mut record = host_record(&config, placements)?;
        let probe = match config.probe_port {
            0 => None,
            port => {
                let p = Probe::listen(config.underlay, port)?;
                record.probe_port = port;
                Some(p)
            }
        };
        let mut agent = Agent::start_as(config, record, registry, apply)?;
        agent.probe = probe;
        Ok(agent)
    }

    /// Starts an agent that registers `record` as it is (its underlay address need not be
    /// this machine's): `stitch bench cluster` runs many such agents against one etcd, each
    /// applying to a dry run.
    pub fn start_as(
        config: AgentConfig,
        record: HostRecord,
        registry: Arc<Registry>,
        apply: Arc<ApplyFn>,
    ) -> Result<Agent> {
        let state = Arc::new(Mutex::new(State::default()));
        let (stop, stopped) = watch::channel(false);
        let ctx = Ctx {
            config,
            record,
            state: state.clone(),
            registry,
            apply,
        };
        let thread = std::thread::Builder::new()
            .name("agent".into())
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("an async runtime");
                rt.block_on(run(ctx, stopped));
            })?;
        Ok(Agent {
            state,
            stop,
            thread: Some(thread),
            probe: None,
        })
    }

    /// Gives up the lease (the controller moves this host's apps at once) and ends the thread.
    pub fn stop(mut self) {
        self.probe = None;
        let _ = self.stop.send(true);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }

    /// A reporter for the instance's API.
    pub fn reporter(&self) -> Arc<dyn stitch_api::Reporter> {
        Arc::new(Report(self.state.clone()))
    }
}

struct Report(Arc<Mutex<State>>);

impl stitch_api::Reporter for Report {
    fn status(&self) -> Value {
        let s = self.0.lock().unwrap();
        json!({
            "etcd": if s.connected { "connected" } else { "unreachable" },
            "unreachable_seconds": s.unreachable_since.map(|t| t.elapsed().as_secs_f64()),
            "last_error": s.last_error,
            "data_plane": if s.connected { "following etcd" } else { "kept as last applied" },
            "lease": format!("{:x}", s.lease),
            "controller": s.leader,
            "may_run_controller": !s.barred_from_election,
            "assignment_revision": s.status.assignment_revision,
            "graphs": s.status.graphs,
            "apply_error": s.status.error,
            "apps": s.status.apps,
            "workload_mtu": s.workload_mtu,
            "resyncs": s.resyncs,
            "sessions": s.sessions,
        })
    }

    fn gauges(&self) -> Vec<(&'static str, &'static str, i64)> {
        let s = self.0.lock().unwrap();
        vec![
            (
                "stitch_agent_etcd_connected",
                "1 while the agent reaches etcd; 0 while it keeps the data plane as last applied",
                s.connected as i64,
            ),
            (
                "stitch_agent_controller",
                "1 while this agent leads and runs the placement controller",
                s.leader as i64,
            ),
            (
                "stitch_agent_assignment_revision",
                "etcd revision of the host graph applied last",
                s.status.assignment_revision,
            ),
            (
                "stitch_agent_resyncs",
                "Full reads of the host graph after a lost or compacted watch",
                s.resyncs as i64,
            ),
        ]
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}

/// The host's record: the underlay address must be this host's, and its interface and MAC
/// are read from the system.
fn host_record(config: &AgentConfig, placements: Vec<String>) -> Result<HostRecord> {
    let interface = interface_of(config.underlay).ok_or_else(|| {
        anyhow!(
            "--underlay {}: no interface of this host has that address (give the address \
             VXLAN tunnels should reach this host at)",
            config.underlay
        )
    })?;
    let mac = std::fs::read_to_string(format!("/sys/class/net/{interface}/address"))
        .with_context(|| format!("cannot read the MAC address of {interface}"))?
        .trim()
        .to_string();
    let mtu = std::fs::read_to_string(format!("/sys/class/net/{interface}/mtu"))
        .ok()
        .and_then(|m| m.trim().parse().ok())
        .with_context(|| format!("cannot read the MTU of {interface}"))?;
    Ok(HostRecord {
        underlay: config.underlay,
        interface,
        mac,
        labels: config.labels.clone(),
        placements,
        probe_port: 0,
        mtu,
        allowed: config.allowed.clone(),
    })
}

/// The interface that holds `addr`.
fn interface_of(addr: IpAddr) -> Option<String> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs writes a list it allocated into `head`; it is freed below.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return None;
    }
    let mut found = None;
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list getifaddrs returned, not yet freed.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_addr.is_null() {
            continue;
        }
        // SAFETY: ifa_addr is non-null and points at a sockaddr of the family it names.
        let family = unsafe { (*ifa.ifa_addr).sa_family } as i32;
        let a = match family {
            // SAFETY: AF_INET addresses are sockaddr_in.
            libc::AF_INET => IpAddr::from(
                unsafe {
                    (*(ifa.ifa_addr as *const libc::sockaddr_in))
                        .sin_addr
                        .s_addr
                }
                .to_ne_bytes(),
            ),
            // SAFETY: AF_INET6 addresses are sockaddr_in6.
            libc::AF_INET6 => IpAddr::from(unsafe {
                (*(ifa.ifa_addr as *const libc::sockaddr_in6))
                    .sin6_addr
                    .s6_addr
            }),
            _ => continue,
        };
        if a == addr {
            // SAFETY: ifa_name is a NUL-terminated name owned by the list.
            let name = unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) };
            found = Some(name.to_string_lossy().into_owned());
            break;
        }
    }
    // SAFETY: `head` came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(head) };
    found
}

struct Ctx {
    config: AgentConfig,
    record: HostRecord,
    state: Arc<Mutex<State>>,
    registry: Arc<Registry>,
    apply: Arc<ApplyFn>,
}

/// Sessions until stopped: each connects, takes a lease and follows etcd; one that fails
/// leaves the data plane as it is, and the next starts after a pause.
async fn run(ctx: Ctx, mut stopped: watch::Receiver<bool>) {
    let mut pause = Duration::from_millis(100);
    loop {
        let started = Instant::now();
        match session(&ctx, &mut stopped).await {
            Ok(()) => return,
            Err(e) => {
                let mut s = ctx.state.lock().unwrap();
                if s.connected || s.unreachable_since.is_none() {
                    log::warn!("agent: lost etcd ({e:#}); the data plane stays as last applied");
                    s.unreachable_since = Some(Instant::now());
                }
                s.connected = false;
                s.leader = false;
                s.last_error = Some(format!("{e:#}"));
            }
        }
        if started.elapsed() > Duration::from_secs(5) {
            pause = Duration::from_millis(100);
        }
        tokio::select! {
            _ = tokio::time::sleep(pause) => {}
            _ = stopped.changed() => return,
        }
        pause = (pause * 2).min(Duration::from_secs(2));
    }
}

/// One connection's life: register under a fresh lease, then keep it alive, campaign (and
/// lead when elected) and follow the host's graph, until one of them fails or the agent stops.
async fn session(ctx: &Ctx, stopped: &mut watch::Receiver<bool>) -> Result<()> {
    let mut client = etcd::connect(&ctx.config.endpoints).await?;
    let lease = client
        .lease_grant(ctx.config.lease_ttl, None)
        .await
        .context("cannot take a lease")?
        .id();
    let host = &ctx.config.host;
    client
        .put(keys::host(host), serde_json::to_vec(&ctx.record)?, None)
        .await
        .context("cannot register the host")?;
    client
        .put(
            keys::alive(host),
            std::process::id().to_string(),
            Some(PutOptions::new().with_lease(lease)),
        )
        .await
        .context("cannot mark the host live")?;
    {
        let mut s = ctx.state.lock().unwrap();
        if s.unreachable_since.take().is_some() {
            log::info!("agent: etcd reachable again");
        }
        s.connected = true;
        s.lease = lease;
        s.last_error = None;
        s.sessions += 1;
    }
    log::info!("agent: host `{host}` registered (lease {lease:x})");
    let result = tokio::select! {
        r = keep_alive(&ctx.config.endpoints, lease, ctx.config.lease_ttl) => r,
        r = campaign(lease, ctx) => r,
        r = follow(client.clone(), ctx) => r,
        _ = stopped.changed() => {
            let _ = tokio::time::timeout(Duration::from_secs(1), client.lease_revoke(lease)).await;
            log::info!("agent: stopped; lease given up");
            return Ok(());
        }
    };
    ctx.state.lock().unwrap().leader = false;
    result
}

/// Refreshes the lease three times per TTL. A keep-alive stream that breaks (its member went
/// away) is opened again, on a member that answers, for the same lease: the session — the
/// host's liveness key and its place in the election — outlives a member. A lease etcd let
/// expire, or one not refreshed for a whole TTL, ends the session.
async fn keep_alive(endpoints: &[String], lease: i64, ttl: i64) -> Result<()> {
    let lifetime = Duration::from_secs(ttl.max(1) as u64);
    let period = lifetime / 3;
    let mut refreshed = std::time::Instant::now();
    loop {
        // A connection of its own, made anew after a break: the old one may still route to
        // the member that died.
        let client = tokio::time::timeout(lifetime, etcd::connect(endpoints)).await;
        let opened = match client {
            Ok(Ok(mut c)) => c.lease_keep_alive(lease).await.map_err(|e| anyhow!(e)),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(anyhow!("no member answered")),
        };
        let broken = match opened {
            Ok((keeper, answers)) => refresh(keeper, answers, period, &mut refreshed).await?,
            Err(e) => e,
        };
        if refreshed.elapsed() >= lifetime {
            return Err(broken).context("lease keep-alive: not refreshed for a whole TTL");
        }
        log::info!("agent: lease keep-alive broke ({broken:#}); opening it again");
        tokio::time::sleep(period / 4).await;
    }
}

/// Refreshes the lease on one keep-alive stream until it breaks; returns why it broke.
/// `Err`: the lease is gone.
async fn refresh(
    mut keeper: etcd_client::LeaseKeeper,
    mut answers: etcd_client::LeaseKeepAliveStream,
    period: Duration,
    refreshed: &mut std::time::Instant,
) -> Result<anyhow::Error> {
    loop {
        if let Err(e) = keeper.keep_alive().await {
            return Ok(anyhow!(e));
        }
        match tokio::time::timeout(REQUEST_TIMEOUT, answers.message()).await {
            Ok(Ok(Some(a))) if a.ttl() > 0 => *refreshed = std::time::Instant::now(),
            Ok(Ok(Some(_))) => bail!("the lease expired"),
            Ok(Ok(None)) => return Ok(anyhow!("the stream ended")),
            Ok(Err(e)) => return Ok(anyhow!(e)),
            Err(_) => return Ok(anyhow!("no answer")),
        }
        tokio::time::sleep(period).await;
    }
}

/// Campaigns in the election and runs the placement controller while leading, again and
/// again: a campaign or a leadership lost to a broken connection is retried with the same
/// lease (etcd resumes a candidate's key); only the lease's end (the keep-alive) ends the
/// session.
async fn campaign(lease: i64, ctx: &Ctx) -> Result<()> {
    loop {
        if let Err(e) = campaign_once(lease, ctx).await {
            ctx.state.lock().unwrap().leader = false;
            // etcd's roles keep this host from the election: it follows its graph only.
            if format!("{e:#}").contains("permission denied") {
                let first =
                    !std::mem::replace(&mut ctx.state.lock().unwrap().barred_from_election, true);
                if first {
                    log::info!(
                        "agent: etcd does not let `{}` run the placement controller (its user has no role on {}): this host follows its graph only",
                        ctx.config.host,
                        keys::ELECTION
                    );
                }
                return std::future::pending().await;
            }
            log::warn!("agent: election: {e:#}; campaigning again");
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
}

/// Waits to be elected (on a connection without a request timeout: a campaign waits as long
/// as another agent leads), then runs the placement controller while leading.
async fn campaign_once(lease: i64, ctx: &Ctx) -> Result<()> {
    let host = ctx.config.host.clone();
    let mut patient = etcd::connect_patient(&ctx.config.endpoints).await?;
    let mut won = patient
        .campaign(keys::ELECTION, host.clone(), lease)
        .await
        .context("campaign")?;
    let mut client = etcd::connect(&ctx.config.endpoints).await?;
    let leader = won
        .take_leader()
        .ok_or_else(|| anyhow!("the election answered without a leader key"))?;
    log::info!("agent: `{host}` leads; running the placement controller");
    ctx.state.lock().unwrap().leader = true;
    crate::controller::lead(&mut client, &leader, &ctx.registry).await
}

/// Applies the host's graph as etcd holds it, then every change to it; reads it again whenever
/// the watch is lost or compacted.
async fn follow(mut client: Client, ctx: &Ctx) -> Result<()> {
    let key = keys::assign(&ctx.config.host);
    loop {
        let (revision, kv) = etcd::read_key(&mut client, &key).await?;
        apply_kv(&mut client, ctx, kv.as_ref()).await?;
        let mut stream = client
            .watch(
                key.as_str(),
                Some(WatchOptions::new().with_start_revision(revision + 1)),
            )
            .await
            .context("cannot watch the host's graph")?;
        loop {
            match stream.message().await {
                Ok(Some(w)) if w.canceled() => break,
                Ok(Some(w)) => {
                    for e in w.events() {
                        let kv = (e.event_type() == EventType::Put).then(|| e.kv()).flatten();
                        apply_kv(&mut client, ctx, kv).await?;
                    }
                }
                Ok(None) | Err(_) => break,
            }
        }
        ctx.state.lock().unwrap().resyncs += 1;
        log::info!("agent: the watch ended; reading the host's graph again");
    }
}

/// Applies one version of the host's graph (none: the host runs nothing) unless it runs it
/// already, and reports the outcome under the host's status key.
async fn apply_kv(client: &mut Client, ctx: &Ctx, kv: Option<&KeyValue>) -> Result<()> {
    let (assignment, revision) = match kv {
        None => (
            Assignment {
                graphs: BTreeMap::new(),
                document: json!({ "apps": {}, "links": [] }),
                workload_mtu: None,
            },
            0,
        ),
        Some(kv) => match serde_json::from_slice::<Assignment>(kv.value()) {
            Ok(a) => (a, kv.mod_revision()),
            Err(e) => {
                let why = format!(
                    "the host graph at revision {} is malformed: {e}",
                    kv.mod_revision()
                );
                return report(client, ctx, kv.mod_revision(), None, Some(why)).await;
            }
        },
    };
    let running = {
        let s = ctx.state.lock().unwrap();
        revision != 0 && s.status.assignment_revision == revision && s.status.error.is_none()
    };
    if running {
        return publish_status(client, ctx).await;
    }
    // Checked here too, whoever wrote the graph: the programs as this host would start them.
    let refusal = ctx
        .config
        .allowed
        .check_document(&assignment.document, |p| {
            stitch_place::find_program(p, std::path::Path::new("/"))
        });
    if let Err(why) = refusal {
        log::error!("agent: the host graph of revision {revision} was refused: {why}");
        return report(client, ctx, revision, None, Some(why)).await;
    }
    let apply = ctx.apply.clone();
    let document = assignment.document.clone();
    let outcome = tokio::task::spawn_blocking(move || apply(&document))
        .await
        .map_err(|e| anyhow!("the apply panicked: {e}"))?;
    match outcome {
        Ok(apps) => {
            log::info!(
                "agent: applied the host graph of revision {revision} ({apps} apps; graphs {:?})",
                assignment.graphs
            );
            {
                let mut s = ctx.state.lock().unwrap();
                s.status.apps = apps;
                s.workload_mtu = assignment.workload_mtu;
            }
            report(client, ctx, revision, Some(assignment.graphs), None).await
        }
        Err(why) => {
            log::error!("agent: the host graph of revision {revision} was refused: {why}");
            report(client, ctx, revision, None, Some(why)).await
        }
    }
}

/// Records what was applied (or why not) in the agent's state and under its status key.
async fn report(
    client: &mut Client,
    ctx: &Ctx,
    revision: i64,
    graphs: Option<BTreeMap<String, i64>>,
    error: Option<String>,
) -> Result<()> {
    {
        let mut s = ctx.state.lock().unwrap();
        if let Some(g) = graphs {
            s.status.graphs = g;
        }
        s.status.assignment_revision = revision;
        s.status.error = error;
        s.status.at = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        s.status_published = false;
    }
    publish_status(client, ctx).await
}

/// Writes the host's status record unless etcd holds it already; a failure ends the session,
/// and the next one writes it again.
async fn publish_status(client: &mut Client, ctx: &Ctx) -> Result<()> {
    let record = {
        let s = ctx.state.lock().unwrap();
        if s.status_published {
            return Ok(());
        }
        s.status.clone()
    };
    client
        .put(
            keys::status(&ctx.config.host),
            serde_json::to_vec(&record)?,
            None,
        )
        .await
        .context("cannot write the host's status")?;
    let mut s = ctx.state.lock().unwrap();
    if s.status == record {
        s.status_published = true;
    }
    Ok(())
}
