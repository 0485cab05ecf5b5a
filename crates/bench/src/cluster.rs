//! `stitch bench cluster`: the control plane at scale. N agents in this process (each with
//! its own connections, lease, election campaign and watch, applying its host graph to a dry
//! run: parsed and checked as the engine would, not run) against one etcd cluster — by
//! default three members on loopback started for the run. For each size: the time from
//! `cluster apply` of M apps (chains of forwarders) to every host reporting the revision, the
//! etcd writes that took, the same for a one-app change, and the agents' memory.

use anyhow::{bail, Context, Result};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use stitch_cluster::agent::{Agent, AgentConfig};
use stitch_cluster::keys::{self, HostRecord};
use stitch_cluster::{admin, etcd};
use stitch_core::Registry;

#[derive(clap::Args)]
pub struct ClusterBenchArgs {
    /// Simulated hosts; a list runs each size.
    #[arg(long, value_delimiter = ',', default_value = "10,100")]
    hosts: Vec<usize>,
    /// Apps in the graph; a list runs each size.
    #[arg(long, value_delimiter = ',', default_value = "1000,10000")]
    apps: Vec<usize>,
    /// Apps per chain (linked one to the next).
    #[arg(long, default_value_t = 10)]
    chain: usize,
    /// An etcd cluster to use (its `/stitch/` keys are replaced); default: three members on
    /// loopback, started for the run.
    #[arg(long)]
    etcd: Option<String>,
}

/// Local etcd members, stopped when dropped.
struct LocalEtcd {
    children: Vec<Child>,
    endpoints: Vec<String>,
    _dir: tempfile::TempDir,
}

impl Drop for LocalEtcd {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn start_etcd() -> Result<LocalEtcd> {
    let dir = tempfile::tempdir()?;
    let ports: Vec<(u16, u16)> = (0..3)
        .map(|_| Ok((crate::free_port()?, crate::free_port()?)))
        .collect::<Result<_>>()?;
    let cluster: Vec<String> = ports
        .iter()
        .enumerate()
        .map(|(i, (_, peer))| format!("b{i}=http://127.0.0.1:{peer}"))
        .collect();
    let mut children = Vec::new();
    for (i, (client, peer)) in ports.iter().enumerate() {
        let log = std::fs::File::create(dir.path().join(format!("etcd{i}.log")))?;
        children.push(
            Command::new("etcd")
                .arg(format!("--name=b{i}"))
                .arg(format!(
                    "--data-dir={}",
                    dir.path().join(format!("d{i}")).display()
                ))
                .arg(format!("--listen-client-urls=http://127.0.0.1:{client}"))
                .arg(format!("--advertise-client-urls=http://127.0.0.1:{client}"))
                .arg(format!("--listen-peer-urls=http://127.0.0.1:{peer}"))
                .arg(format!(
                    "--initial-advertise-peer-urls=http://127.0.0.1:{peer}"
                ))
                .arg(format!("--initial-cluster={}", cluster.join(",")))
                .arg("--initial-cluster-token=stitch-bench")
                .stdout(Stdio::null())
                .stderr(Stdio::from(log))
                .spawn()
                .context("cannot start etcd (apt install etcd-server)")?,
        );
    }
    let endpoints = ports
        .iter()
        .map(|(c, _)| format!("http://127.0.0.1:{c}"))
        .collect();
    Ok(LocalEtcd {
        children,
        endpoints,
        _dir: dir,
    })
}

/// Resident memory of this process, KiB.
fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

/// M forwarders in chains of `chain`, unpinned (the controller places them).
fn graph_text(apps: usize, chain: usize, extra: bool) -> String {
    let mut text = String::from("apps:\n");
    for i in 0..apps {
        text += &format!("  f{i}: {{ type: forwarder }}\n");
    }
    if extra {
        text += "  extra: { type: forwarder }\n";
    }
    text += "links:\n";
    for i in 0..apps {
        if (i + 1) % chain != 0 && i + 1 < apps {
            text += &format!("  - \"f{i}.output -> f{}.input\"\n", i + 1);
        }
    }
    text
}

/// Counts the keys written under `/stitch/` until stopped: (all, host graphs, statuses,
/// liveness and host records).
struct WriteCounter {
    counts: Arc<[AtomicU64; 4]>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl WriteCounter {
    fn start(endpoints: Vec<String>, from: i64) -> WriteCounter {
        let counts: Arc<[AtomicU64; 4]> = Arc::new(Default::default());
        let (stop, mut stopped) = tokio::sync::oneshot::channel();
        let c = counts.clone();
        let thread = std::thread::spawn(move || {
            let _ = etcd::block_on(async move {
                let mut client = etcd::connect_patient(&endpoints).await?;
                let mut stream = client
                    .watch(
                        keys::PREFIX,
                        Some(
                            etcd_client::WatchOptions::new()
                                .with_prefix()
                                .with_start_revision(from),
                        ),
                    )
                    .await?;
                loop {
                    tokio::select! {
                        m = stream.message() => {
                            let Some(m) = m? else { return Ok(()) };
                            for e in m.events() {
                                let key = e.kv().map(|kv| kv.key()).unwrap_or_default();
                                c[0].fetch_add(1, Ordering::Relaxed);
                                if keys::name_in(key, keys::ASSIGN).is_some() {
                                    c[1].fetch_add(1, Ordering::Relaxed);
                                }
                                if keys::name_in(key, keys::STATUS).is_some() {
                                    c[2].fetch_add(1, Ordering::Relaxed);
                                }
                                if keys::name_in(key, keys::ALIVE).is_some()
                                    || keys::name_in(key, keys::HOSTS).is_some()
                                {
                                    c[3].fetch_add(1, Ordering::Relaxed);
                                }
                            }
                        }
                        _ = &mut stopped => return Ok(()),
                    }
                }
            });
        });
        WriteCounter {
            counts,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    fn finish(mut self) -> [u64; 4] {
        // Writes still in flight when the hosts reported reach the watch within moments.
        std::thread::sleep(Duration::from_millis(300));
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        [0, 1, 2, 3].map(|i| self.counts[i].load(Ordering::Relaxed))
    }
}

async fn revision(endpoints: &[String]) -> Result<i64> {
    let mut client = etcd::connect(endpoints).await?;
    Ok(etcd::read_prefix(&mut client, "/stitch-none/").await?.0)
}

async fn clear(endpoints: &[String]) -> Result<()> {
    let mut client = etcd::connect(endpoints).await?;
    client
        .delete(
            keys::PREFIX,
            Some(etcd_client::DeleteOptions::new().with_prefix()),
        )
        .await?;
    Ok(())
}

/// One size: returns the line of the results table.
fn one_size(
    endpoints: &[String],
    registry: &Arc<Registry>,
    hosts: usize,
    apps: usize,
    chain: usize,
) -> Result<String> {
    etcd::block_on(clear(endpoints))?;
    let before = rss_kib();
    let mut agents = Vec::new();
    for i in 0..hosts {
        let config = AgentConfig {
            endpoints: endpoints.to_vec(),
            host: format!("sim{i}"),
            underlay: format!("198.18.{}.{}", i / 250, i % 250 + 1).parse()?,
            labels: [("zone".to_string(), format!("z{}", i % 4))].into(),
            lease_ttl: 5,
            probe_port: 0,
            allowed: Default::default(),
        };
        let record = HostRecord {
            underlay: config.underlay,
            interface: "sim0".into(),
            mac: format!("02:00:00:00:{:02x}:{:02x}", i / 256, i % 256),
            labels: config.labels.clone(),
            placements: vec!["engine".into(), "process".into()],
            probe_port: 0,
            mtu: 1500,
            allowed: Default::default(),
        };
        let reg = registry.clone();
        let dry_run = Arc::new(move |doc: &serde_json::Value| {
            let text = serde_json::to_string(doc).expect("a document serializes");
            stitch_place::PlacedGraph::parse(&text, "<host graph>", std::path::Path::new("/"), &reg)
                .map(|g| g.apps.len())
                .map_err(|e| e.to_string())
        });
        agents.push(Agent::start_as(config, record, registry.clone(), dry_run)?);
    }
    // Every agent registered and reported its (empty) graph.
    let start = Instant::now();
    loop {
        let s = etcd::block_on(admin::status(endpoints))?;
        let ready = s["hosts"]
            .as_array()
            .map(|h| {
                h.iter()
                    .filter(|h| h["live"] == true && h["applied_revision"].as_i64().is_some())
                    .count()
            })
            .unwrap_or(0);
        if ready == hosts && s["leader"].is_string() {
            break;
        }
        if start.elapsed() > Duration::from_secs(120) {
            bail!("only {ready} of {hosts} agents registered in 120 s");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let idle = rss_kib();
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("bench.yaml");
    let mut results = Vec::new();
    for extra in [false, true] {
        std::fs::write(&file, graph_text(apps, chain, extra))?;
        let from = etcd::block_on(revision(endpoints))? + 1;
        let counter = WriteCounter::start(endpoints.to_vec(), from);
        let t = Instant::now();
        let applied = etcd::block_on(admin::apply(endpoints, &file, "bench", None, registry))?;
        etcd::block_on(admin::wait_applied(
            endpoints,
            "bench",
            applied.revision,
            Duration::from_secs(600),
        ))?;
        let took = t.elapsed();
        let txns = etcd::block_on(revision(endpoints))? - from + 1;
        let [keys, graphs, statuses, liveness] = counter.finish();
        if liveness > 0 {
            eprintln!("({liveness} of the {keys} keys were agents registering again: sessions lost under load)");
        }
        results.push((took, keys, graphs, statuses, txns));
    }
    let loaded = rss_kib();
    for a in agents {
        a.stop();
    }
    let per_agent = |kib: u64| kib.saturating_sub(before) as f64 / hosts as f64;
    let (full, change) = (results[0], results[1]);
    Ok(format!(
        "{hosts:>6} {apps:>7} {:>10.0} {:>8} {:>8} {:>6} {:>10.0} {:>8} {:>8} {:>10.0} {:>10.0}",
        full.0.as_secs_f64() * 1e3,
        full.1,
        full.2,
        full.4,
        change.0.as_secs_f64() * 1e3,
        change.1,
        change.2,
        per_agent(idle),
        per_agent(loaded),
    ))
}

pub fn run(args: ClusterBenchArgs, registry: Registry) -> Result<()> {
    anyhow::ensure!(args.chain >= 1, "--chain must be at least 1");
    let registry = Arc::new(registry);
    let local;
    let endpoints = match &args.etcd {
        Some(e) => etcd::endpoints(e),
        None => {
            local = start_etcd()?;
            local.endpoints.clone()
        }
    };
    let t = Instant::now();
    while etcd::block_on(revision(&endpoints)).is_err() {
        if t.elapsed() > Duration::from_secs(30) {
            bail!("etcd at {} did not answer", endpoints.join(","));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    println!(
        "agents applying to a dry run, against etcd at {} (load average {})",
        endpoints.join(","),
        crate::load_average()
    );
    println!(
        "{:>6} {:>7} {:>10} {:>8} {:>8} {:>6} {:>10} {:>8} {:>8} {:>10} {:>10}",
        "hosts",
        "apps",
        "apply ms",
        "keys",
        "graphs",
        "txns",
        "change ms",
        "keys",
        "graphs",
        "KiB/agent",
        "loaded"
    );
    for &hosts in &args.hosts {
        for &apps in &args.apps {
            println!(
                "{}",
                one_size(&endpoints, &registry, hosts, apps, args.chain)?
            );
        }
    }
    println!(
        "apply/change ms: `cluster apply` until every host reports the revision; keys: keys \
         written under /stitch/ (placements, host graphs, statuses); graphs: host graphs \
         written; txns: etcd revisions used; KiB/agent: resident memory per agent idle and \
         with its host graph"
    );
    etcd::block_on(clear(&endpoints))?;
    Ok(())
}
