//! `stitch agent` and `stitch cluster apply|status|delete` (crate `stitch-cluster`): graphs
//! across hosts, with etcd holding the desired state.

use anyhow::{Context, Result};
use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use stitch_cluster::{admin, agent, etcd};

/// Where etcd is, and how this process proves who it is there.
#[derive(clap::Args, Clone)]
pub struct Etcd {
    /// etcd client URLs, comma-separated: https://HOST:2379,… (without it and STITCH_ETCD:
    /// https://127.0.0.1:2379, said on standard error).
    #[arg(long, env = "STITCH_ETCD")]
    pub etcd: Option<String>,
    /// The CA that signed etcd's certificates (PEM).
    #[arg(long, env = "STITCH_ETCD_CA")]
    pub etcd_ca: Option<PathBuf>,
    /// This client's certificate (PEM): etcd takes its common name as the user (a host's
    /// agent: the host's name; `stitch cluster`: the operator).
    #[arg(long, env = "STITCH_ETCD_CERT")]
    pub etcd_cert: Option<PathBuf>,
    /// Its private key (PEM, 0600).
    #[arg(long, env = "STITCH_ETCD_KEY")]
    pub etcd_key: Option<PathBuf>,
    /// An etcd user to authenticate as by password (instead of, or besides, the certificate).
    #[arg(long, env = "STITCH_ETCD_USER")]
    pub etcd_user: Option<String>,
    /// The file holding that user's password (0600).
    #[arg(long, env = "STITCH_ETCD_PASSWORD_FILE", requires = "etcd_user")]
    pub etcd_password_file: Option<PathBuf>,
    /// Allow plain http:// endpoints (no TLS, no check of who etcd is or who writes there).
    #[arg(long)]
    pub etcd_insecure: bool,
}

impl Etcd {
    /// The endpoints, checked against the credentials, which are set for this process.
    fn endpoints(&self) -> Result<Vec<String>> {
        const LOCAL: &str = "https://127.0.0.1:2379";
        let endpoints = match &self.etcd {
            Some(list) => etcd::endpoints(list),
            None => {
                eprintln!("stitch: no --etcd (or STITCH_ETCD) given: using etcd at {LOCAL}");
                etcd::endpoints(LOCAL)
            }
        };
        let user = match (&self.etcd_user, &self.etcd_password_file) {
            (None, _) => None,
            (Some(_), None) => anyhow::bail!("--etcd-user needs --etcd-password-file"),
            (Some(u), Some(f)) => {
                let bytes = stitch_core::files::read_trusted(f, "etcd password file", true)
                    .map_err(anyhow::Error::msg)?
                    .ok_or_else(|| {
                        anyhow::anyhow!("--etcd-password-file {}: no such file", f.display())
                    })?;
                Some((
                    u.clone(),
                    String::from_utf8_lossy(&bytes).trim().to_string(),
                ))
            }
        };
        let credentials = etcd::Credentials {
            ca: self.etcd_ca.clone(),
            cert: self.etcd_cert.clone(),
            key: self.etcd_key.clone(),
            user,
        };
        etcd::check_endpoints(&endpoints, &credentials, self.etcd_insecure)?;
        etcd::present(credentials)?;
        Ok(endpoints)
    }
}

#[derive(clap::Args)]
pub struct AgentArgs {
    #[command(flatten)]
    pub etcd: Etcd,
    /// This host's name in the cluster (letters, digits, `_` and `-`).
    #[arg(long)]
    pub host: String,
    /// This host's address on the underlay: VXLAN tunnels from other hosts reach it there.
    #[arg(long)]
    pub underlay: IpAddr,
    /// Labels graphs can select hosts by (`hosts: {zone: east}`), e.g. zone=east,disk=ssd.
    #[arg(long, value_delimiter = ',')]
    pub labels: Vec<String>,
    /// Seconds the host counts as live after its agent was last heard from.
    #[arg(long, default_value_t = 2)]
    pub lease_ttl: i64,
    /// TCP port on the underlay address where the agent answers the controller's probe: a
    /// host whose lease expired but which still answers is cut off from etcd, not dead, and
    /// keeps its apps (0: no probe).
    #[arg(long, default_value_t = 7471)]
    pub probe_port: u16,
    /// The programs and files cluster graphs may run on this host, one a line (a file, a
    /// folder ending with /, or `qemu-args`); without it, no process and no VM.
    #[arg(long)]
    pub allow_commands: Option<PathBuf>,
    #[command(flatten)]
    pub listen: super::Listen,
    /// API Unix socket path (default: the socket of instance NAME, the host's name).
    #[arg(long)]
    pub control: Option<PathBuf>,
}

#[derive(clap::Subcommand)]
pub enum ClusterCmd {
    /// Store a graph file as a cluster graph; apps may name a host (`host:`) or host labels
    /// (`hosts: {label: value}`). Checked against the cluster first; a compare-and-swap write.
    Apply {
        file: PathBuf,
        #[command(flatten)]
        etcd: Etcd,
        /// The graph's name (default: the file's stem).
        #[arg(long)]
        graph: Option<String>,
        /// Write only if the graph is still at this revision (0: only if it is new).
        #[arg(long)]
        if_revision: Option<i64>,
        /// Wait up to this many seconds for every live host to run the new revision.
        #[arg(long)]
        wait: Option<f64>,
        /// Check the file against the cluster and print what each host's part would become
        /// (apps added, changed, removed), as the controller would place it now; write nothing.
        #[arg(long, conflicts_with_all = ["wait", "if_revision"])]
        dry_run: bool,
    },
    /// Hosts (live, underlay, labels, the revision each applied), the controller, and each
    /// graph's apps with their hosts and tunnels.
    Status {
        #[command(flatten)]
        etcd: Etcd,
        #[arg(long)]
        json: bool,
        /// First wait (up to 30 s) until at least this many hosts are live.
        #[arg(long)]
        wait_live: Option<usize>,
    },
    /// Hosts of the cluster.
    #[command(subcommand)]
    Host(HostCmd),
    /// Remove a cluster graph: every host stops its apps.
    Delete {
        graph: String,
        #[command(flatten)]
        etcd: Etcd,
        #[arg(long)]
        if_revision: Option<i64>,
    },
}

#[derive(clap::Subcommand)]
pub enum HostCmd {
    /// Forget a host whose agent is gone for good: its record, host graph and status. Apps
    /// pinned to it become unplaced; tunnels toward it go. Refused while its agent is live.
    Remove {
        host: String,
        #[command(flatten)]
        etcd: Etcd,
    },
}

pub fn run_cluster(cmd: ClusterCmd) -> Result<()> {
    let registry = super::registry();
    match cmd {
        ClusterCmd::Apply {
            file,
            etcd,
            graph,
            if_revision,
            wait,
            dry_run,
        } => {
            let name = match graph {
                Some(g) => g,
                None => admin::graph_name(&file)?,
            };
            let endpoints = etcd.endpoints()?;
            if dry_run {
                let lines = etcd::block_on(admin::dry_run(&endpoints, &file, &name, &registry))?;
                println!("graph {name}: a dry run, nothing was written");
                for l in lines {
                    println!("  {l}");
                }
                return Ok(());
            }
            let applied = etcd::block_on(admin::apply(
                &endpoints,
                &file,
                &name,
                if_revision,
                &registry,
            ))?;
            println!(
                "graph {}: revision {} (was {})",
                applied.name,
                applied.revision,
                if applied.previous == 0 {
                    "new".to_string()
                } else {
                    applied.previous.to_string()
                }
            );
            for h in &applied.waiting_for {
                println!("host {h} is not live: its apps start when its agent returns");
            }
            if let Some(limit) = wait {
                let took = etcd::block_on(admin::wait_applied(
                    &endpoints,
                    &name,
                    applied.revision,
                    Duration::from_secs_f64(limit),
                ))?;
                println!(
                    "every live host runs it ({:.0} ms)",
                    took.as_secs_f64() * 1e3
                );
            }
        }
        ClusterCmd::Status {
            etcd,
            json,
            wait_live,
        } => {
            let endpoints = etcd.endpoints()?;
            let v = match wait_live {
                Some(n) => wait_live_hosts(&endpoints, n, Duration::from_secs(30))?,
                None => etcd::block_on(admin::status(&endpoints))?,
            };
            if json {
                println!("{}", serde_json::to_string_pretty(&v)?);
            } else {
                print!("{}", admin::render_status(&v));
            }
        }
        ClusterCmd::Host(HostCmd::Remove { host, etcd }) => {
            let r = etcd::block_on(admin::remove_host(&etcd.endpoints()?, &host))?;
            println!("host {host} removed at revision {r}");
        }
        ClusterCmd::Delete {
            graph,
            etcd,
            if_revision,
        } => {
            let r = etcd::block_on(admin::delete(&etcd.endpoints()?, &graph, if_revision))?;
            println!("graph {graph} deleted at revision {r}");
        }
    }
    Ok(())
}

/// The cluster's status once at least `n` hosts are live.
fn wait_live_hosts(endpoints: &[String], n: usize, limit: Duration) -> Result<serde_json::Value> {
    let start = std::time::Instant::now();
    loop {
        let v = etcd::block_on(admin::status(endpoints))?;
        let hosts = v["hosts"].as_array().cloned().unwrap_or_default();
        let live: Vec<&str> = hosts
            .iter()
            .filter(|h| h["live"] == true)
            .filter_map(|h| h["name"].as_str())
            .collect();
        if live.len() >= n {
            return Ok(v);
        }
        if start.elapsed() > limit {
            anyhow::bail!(
                "{} of {n} hosts are live after {} s ({}): is each host's `stitch agent` running \
                 and reaching etcd?",
                live.len(),
                limit.as_secs(),
                if live.is_empty() {
                    "none".to_string()
                } else {
                    live.join(", ")
                }
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// `stitch agent`: an instance named after the host whose graph comes from etcd.
pub fn run_agent(args: AgentArgs) -> Result<()> {
    let mut labels = BTreeMap::new();
    for l in &args.labels {
        let (k, v) = l
            .split_once('=')
            .with_context(|| format!("--labels: `{l}` is not LABEL=VALUE"))?;
        labels.insert(k.trim().to_string(), v.trim().to_string());
    }
    let instance = super::Instance {
        name: args.host.clone(),
        control: args.control.clone(),
    };
    let config = agent::AgentConfig {
        endpoints: args.etcd.endpoints()?,
        host: args.host.clone(),
        underlay: args.underlay,
        labels,
        lease_ttl: args.lease_ttl,
        probe_port: args.probe_port,
        allowed: match &args.allow_commands {
            Some(f) => stitch_cluster::allow::Allowed::read(f).map_err(anyhow::Error::msg)?,
            None => {
                log::info!(
                    "no --allow-commands: cluster graphs run no process and no VM on this host"
                );
                Default::default()
            }
        },
    };
    super::serve(&instance, &args.listen, |api| {
        let registry = Arc::new(super::registry());
        let apply_api = api.clone();
        let socket = instance.socket();
        let apply = Arc::new(move |doc: &serde_json::Value| {
            let recorded = stitch_api::attached::recorded(&socket);
            apply_api
                .apply_derived("<cluster host graph>", |running| {
                    agent::keep_attached(doc.clone(), running.as_ref(), &recorded)
                })
                .map(|_| doc["apps"].as_object().map(|a| a.len()).unwrap_or(0))
                .map_err(|e| e.message)
        });
        let agent = agent::Agent::start(config, stitch_place::available(), registry, apply)?;
        api.add_reporter("agent", agent.reporter());
        Ok(Box::new(move || agent.stop()) as Box<dyn FnOnce()>)
    })
}
