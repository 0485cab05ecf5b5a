//! `stitch`: run, check and inspect Stitch graphs.

mod capture_cmd;
mod cluster_cmd;
mod kernel_cmd;
mod lwaftr_cmd;
mod nfv_cmd;
mod state_keeper;
mod supervise;
mod table;
mod top;
mod upgrade;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use state_keeper::{StateArgs, StateKeeper};
use std::io::IsTerminal;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use stitch_api::client::Method;
use stitch_core::{Engine, Registry};
use stitch_place::PlacedGraph;

#[derive(Parser)]
#[command(
    name = "stitch",
    version,
    about = "Stitch: network functions composed into graphs, at line rate"
)]
struct Cli {
    /// Log lines as text or as JSON objects (one per line, for log collectors).
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(clap::ValueEnum, Clone, Copy, PartialEq, Eq)]
enum LogFormat {
    Text,
    Json,
}

#[derive(clap::Args, Clone)]
struct Instance {
    /// Name of the instance (one API socket per name).
    #[arg(long, default_value = "stitch")]
    name: String,
    /// API Unix socket path (overrides --name).
    #[arg(long)]
    control: Option<PathBuf>,
}

impl Instance {
    fn socket(&self) -> PathBuf {
        self.control
            .clone()
            .unwrap_or_else(|| stitch_api::socket_path(&self.name))
    }

    /// What the instance's resources on the host (function cgroups) are named after: its name,
    /// or with `--control`, the socket's path (which only one live instance can hold).
    fn key(&self) -> String {
        match &self.control {
            None => self.name.clone(),
            Some(p) => stitch_place::leftovers::key_of_socket(p),
        }
    }

    fn get(&self, path: &str) -> Result<serde_json::Value> {
        stitch_api::client::json(&self.socket(), Method::GET, path, None)
    }
}

/// `stitch run`'s arguments (also what a process taking an instance over reads from the old
/// one's command line).
#[derive(clap::Args)]
struct RunArgs {
    file: PathBuf,
    /// Stop after this many seconds.
    #[arg(long)]
    duration: Option<f64>,
    /// Print counters as JSON instead of tables.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    instance: Instance,
    #[command(flatten)]
    listen: Listen,
    /// Keep running when the graph's finite sources are done (a service); stop on
    /// SIGINT/SIGTERM or --duration only.
    #[arg(long)]
    keep_running: bool,
    #[command(flatten)]
    state: StateArgs,
    /// Start again (with backoff) when killed or crashed, from a small parent process: the
    /// new process reads the state file and adopts the function processes the old one left
    /// running. Under systemd, use the unit's `Restart=` instead.
    #[arg(long)]
    supervise: bool,
}

/// How `stitch run` offers its API: who reaches the Unix socket, and the API on TCP.
#[derive(clap::Args, Clone)]
struct Listen {
    /// Also serve the API, /metrics and the graph view on this TCP address (e.g.
    /// 127.0.0.1:9440). Every request needs a role's token (--token-dir), loopback included.
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// The folder of the tokens TCP requests carry, one file per role (read, capture,
    /// admin; 0600), made at the first start; default NAME.tokens beside the API socket.
    /// `stitch token new --role ROLE` replaces one.
    #[arg(long)]
    token_dir: Option<PathBuf>,
    /// (Gone: tokens are per role in --token-dir.)
    #[arg(long, hide = true)]
    token_file: Option<PathBuf>,
    /// A name the API on TCP answers as (the Host a browser sends), besides IP addresses and
    /// localhost; may be given again.
    #[arg(long = "api-host")]
    api_hosts: Vec<String>,
    /// Serve /metrics on TCP without a token (an explicit choice: counters name every app).
    #[arg(long)]
    metrics_without_token: bool,
    /// The group whose members may use the API socket (mode 0660; the runtime folder 0750).
    /// Default for root: `stitch` when that group exists (scripts/install-deps makes it);
    /// without a group the socket is 0600, root's alone.
    #[arg(long)]
    group: Option<String>,
    /// TLS certificate chain (PEM) for --listen (required beyond localhost).
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// TLS private key (PEM).
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
}

impl Listen {
    /// Nothing but the Unix socket, with the default group.
    fn socket_only() -> Listen {
        Listen {
            listen: None,
            token_dir: None,
            token_file: None,
            api_hosts: Vec::new(),
            metrics_without_token: false,
            group: None,
            tls_cert: None,
            tls_key: None,
        }
    }

    /// The group given the API socket: the one named, or `stitch` for root when it exists.
    fn gid(&self) -> Result<Option<u32>> {
        use nix::unistd::Group;
        match &self.group {
            Some(name) => match Group::from_name(name).context("cannot look up groups")? {
                Some(g) => Ok(Some(g.gid.as_raw())),
                None => anyhow::bail!("--group {name}: no such group (`groupadd --system {name}`)"),
            },
            // SAFETY: geteuid has no preconditions and cannot fail.
            None if unsafe { libc::geteuid() } == 0 => Ok(Group::from_name("stitch")
                .ok()
                .flatten()
                .map(|g| g.gid.as_raw())),
            None => Ok(None),
        }
    }
}

#[derive(Subcommand)]
enum Cmd {
    /// Run a graph until it finishes, --duration passes, or SIGINT/SIGTERM; then print counters.
    Run(RunArgs),
    /// Validate a graph file; errors name the line.
    Check {
        file: PathBuf,
        /// A cluster graph (apps may name `host:` / `hosts:`), checked without the cluster:
        /// `stitch cluster apply` checks pins and labels against the hosts.
        #[arg(long)]
        cluster: bool,
    },
    /// Print a graph file as Graphviz DOT.
    Graph { file: PathBuf },
    /// Print the live counters of a running instance.
    Stats {
        #[command(flatten)]
        instance: Instance,
        /// JSON instead of tables.
        #[arg(long)]
        json: bool,
        /// Refresh every second until interrupted.
        #[arg(long)]
        watch: bool,
    },
    /// Apply a new graph to a running instance, live, by diff.
    Apply {
        file: PathBuf,
        #[command(flatten)]
        instance: Instance,
    },
    /// Show an app's own tables and state (bridge MAC table, routes and neighbours, NAT
    /// mappings, firewall connections) from a running instance; without an app, the instance:
    /// where its graph comes from (a file, or etcd for an agent) and what Stitch made on the
    /// host for its placements (kernel data plane, veth pairs, processes, VMs).
    Show {
        app: Option<String>,
        /// Request as JSON, e.g. '{"limit": 100}'.
        #[arg(long, default_value = "{}")]
        request: String,
        #[command(flatten)]
        instance: Instance,
    },
    /// A live terminal view of the busiest links and apps of a running instance.
    Top(top::TopArgs),
    /// List the app types this build knows.
    Apps {
        /// Print the reference of every app type's ports and settings (docs/apps.md) instead.
        #[arg(long)]
        doc: bool,
    },
    /// Remove what a crashed instance left (its API socket, function processes and cgroups,
    /// kernel data plane, veth pairs, VM sockets): the one named by --name/--control, or every
    /// dead instance of this user's runtime folder. A running instance is never touched.
    Cleanup {
        /// Only this instance's leftovers.
        #[arg(long)]
        name: Option<String>,
        /// Only the leftovers of the instance with this API socket path.
        #[arg(long)]
        control: Option<PathBuf>,
    },
    /// The lwAFTR (RFC 7596) offline on PCAP files or between two interfaces.
    #[command(subcommand)]
    Lwaftr(lwaftr_cmd::LwaftrCmd),
    /// Capture an interface to PCAP/PCAPNG files, with tcpdump's options.
    Capture(capture_cmd::CaptureArgs),
    /// snabbnfv's front end: the graph joining a physical interface to VM ports (vhost-user)
    /// from a ports list with MAC, VLAN, filters and rate limits.
    Nfv(nfv_cmd::NfvArgs),
    /// The in-kernel data plane: graphs of `placement: kernel` apps as eBPF programs.
    #[command(subcommand)]
    Kernel(kernel_cmd::KernelCmd),
    /// Run this host's part of the cluster's graphs: register with etcd, follow the host's
    /// graph, and run the placement controller when elected.
    Agent(cluster_cmd::AgentArgs),
    /// Graphs across hosts: store, inspect and remove cluster graphs in etcd.
    #[command(subcommand)]
    Cluster(cluster_cmd::ClusterCmd),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(stitch_bench::BenchCmd),
    /// Replace a running instance's process with a new one (a new version) without closing
    /// its interfaces or forgetting its state: queued packets leave first, the new process
    /// adopts the sockets, rings, devices, counters and app state. Refused, and the instance
    /// carries on, when the new binary cannot start the graph.
    Upgrade(upgrade::UpgradeArgs),
    /// The API's tokens, one per role (`docs/security.md`).
    #[command(subcommand)]
    Token(TokenCmd),
    /// Write the man pages — stitch(1) and one per command, stitch-run(1) … — into a folder.
    Man {
        /// The folder (made if missing); `man -l DIR/stitch.1` reads a page.
        #[arg(long, default_value = "target/man")]
        out: PathBuf,
    },
    /// Print a shell's completion script: `stitch completions bash >
    /// /etc/bash_completion.d/stitch`, zsh, fish, elvish or powershell.
    Completions {
        #[arg(value_enum)]
        shell: stitch_doc::Shell,
    },
    /// (What `stitch upgrade` starts: receive a running instance and run it.)
    #[command(hide = true)]
    TakeOver {
        #[arg(long)]
        control: PathBuf,
        #[arg(long)]
        ready_fd: i32,
    },
}

#[derive(Subcommand)]
enum TokenCmd {
    /// Write a new token for a role into the instance's token folder (0600); the old token of
    /// that role stops working at the instance's next request. Prints the file's path.
    New {
        /// read (counters, graph, /metrics), capture (and link captures) or admin (and changes).
        #[arg(long, value_parser = ["read", "capture", "admin"])]
        role: String,
        /// The token folder (default: NAME.tokens beside the instance's API socket).
        #[arg(long)]
        token_dir: Option<PathBuf>,
        #[command(flatten)]
        instance: Instance,
    },
}

fn registry() -> Registry {
    let mut r = Registry::new();
    stitch_apps::register(&mut r);
    stitch_io::register(&mut r);
    stitch_nf::register(&mut r);
    stitch_switch::register(&mut r);
    stitch_vhost::register(&mut r);
    r
}

fn load(file: &Path, registry: &Registry) -> Result<PlacedGraph> {
    PlacedGraph::load(file, registry).map_err(|e| anyhow::anyhow!("{e}"))
}

fn main() {
    // What Stitch creates is its own unless it says otherwise (a socket for a group, a folder
    // for a function's user): the caller's umask decides nothing.
    // SAFETY: umask only sets the process's file mode mask; it cannot fail.
    unsafe { libc::umask(0o077) };
    let cli = Cli::parse();
    // RUST_LOG filters as usual (e.g. `RUST_LOG=stitch_io=debug`); info by default — but a
    // benchmark that starts thousands of functions would print a line for each attach and
    // detach between its results.
    let default = if matches!(cli.cmd, Cmd::Bench(_)) {
        "info,stitch_nf=warn"
    } else {
        "info"
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_target(false);
    match cli.log_format {
        LogFormat::Text => logs.init(),
        LogFormat::Json => logs.json().flatten_event(true).init(),
    }
    // A process `stitch upgrade` started runs under the operator's own command line (what
    // `ps` shows), and is told by its environment to take the instance over instead.
    let result = match upgrade::taking_over() {
        Some((socket, ready_fd)) => upgrade::take_over(&socket, ready_fd),
        None => run_cli(cli),
    };
    if let Err(e) = result {
        eprintln!("stitch: {e:#}");
        std::process::exit(1);
    }
}

/// `stitch check`: the graph file's checks, a cluster graph's without the cluster.
fn check(file: &Path, cluster: bool) -> Result<()> {
    let registry = registry();
    let g = load(file, &registry)?;
    let checked = if cluster {
        let errors = stitch_cluster::admin::check_offline(&g.graph);
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors)
        }
    } else {
        stitch_place::check(&g, &registry)
    };
    checked.map_err(|errors| {
        anyhow::anyhow!("{}", stitch_core::graph::GraphErrors::in_file(file, errors))
    })?;
    let warnings = g.graph.host_warnings(&registry);
    let warned = warnings.len();
    if warned > 0 {
        eprintln!(
            "{}",
            stitch_core::graph::GraphErrors::in_file(file, warnings)
        );
    }
    let plural = |n: usize, what: &str| format!("{n} {what}{}", if n == 1 { "" } else { "s" });
    println!(
        "{}: ok ({}; {}, {}){}",
        file.display(),
        g.summary(),
        plural(g.graph.links.len(), "link"),
        plural(g.graph.workers.len(), "worker"),
        match warned {
            0 => String::new(),
            n => format!(
                "; {} about this host (fine if the graph is meant for another)",
                plural(n, "warning")
            ),
        }
    );
    if cluster {
        // Offline, the hosts are unknown: a pin to a host that does not exist passes here.
        println!(
            "hosts, labels and app names are checked against the cluster by `stitch cluster \
             apply`; `stitch cluster apply --dry-run FILE` shows where each app would run"
        );
    }
    Ok(())
}

/// `stitch apply`: the file checked here first (its errors then name its lines), then sent.
fn apply(file: &Path, instance: &Instance) -> Result<()> {
    load(file, &registry())?;
    let text = std::fs::read_to_string(file)?;
    let dir = std::fs::canonicalize(file)?
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default();
    let r = stitch_api::client::json(
        &instance.socket(),
        Method::PUT,
        &format!(
            "/api/v1/graph?dir={}&file={}",
            encode(&dir.display().to_string()),
            encode(&file.display().to_string())
        ),
        Some(text.into_bytes()),
    )?;
    print_report(&r);
    Ok(())
}

/// `stitch stats`: once, or every second with `watch`.
fn stats(instance: &Instance, json: bool, watch: bool) -> Result<()> {
    loop {
        let v = instance.get("/api/v1/stats")?;
        if json {
            println!("{}", serde_json::to_string_pretty(&v)?);
        } else {
            if watch {
                print!("\x1b[H\x1b[2J");
            }
            print!("{}", table::render(&v));
        }
        if !watch {
            return Ok(());
        }
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// `stitch cleanup`: prints what it removed, instance by instance.
fn cleanup(name: Option<String>, control: Option<PathBuf>) -> Result<()> {
    let cleaned = if name.is_none() && control.is_none() {
        stitch_place::leftovers::sweep(&stitch_core::runtime_dir(), None)
    } else {
        let instance = Instance {
            name: name.unwrap_or_else(|| "stitch".into()),
            control,
        };
        let removed = stitch_place::leftovers::clean_dead(&instance.socket(), &instance.key())
            .map_err(|e| anyhow::anyhow!(e))?;
        // An instance given a socket is known by it.
        let label = match &instance.control {
            Some(socket) => socket.display().to_string(),
            None => instance.name.clone(),
        };
        vec![(label, removed)]
            .into_iter()
            .filter(|(_, r)| !r.is_empty())
            .collect()
    };
    if cleaned.is_empty() {
        println!("nothing left by a dead instance");
    }
    for (name, removed) in cleaned {
        println!("{name}: removed {}", removed.join("; "));
    }
    Ok(())
}

/// `stitch apps`: the types, or with `--doc` the reference of their settings (docs/apps.md).
fn apps(doc: bool) -> Result<()> {
    if !doc {
        for t in registry().types() {
            println!("{:<14} {}", t.name, t.summary);
        }
        return Ok(());
    }
    let (reference, problems) = stitch_doc::apps_reference(&registry());
    if !problems.is_empty() {
        anyhow::bail!(
            "the apps' reference is incomplete:\n  {}",
            problems.join("\n  ")
        );
    }
    print!("{reference}");
    Ok(())
}

fn man(out: &Path) -> Result<()> {
    let pages = stitch_doc::write_man_pages(<Cli as clap::CommandFactory>::command(), out)
        .with_context(|| format!("cannot write the man pages into {}", out.display()))?;
    println!("{} man pages in {}", pages.len(), out.display());
    Ok(())
}

fn completions(shell: stitch_doc::Shell) -> Result<()> {
    use std::io::Write;
    let script = stitch_doc::completion(<Cli as clap::CommandFactory>::command(), shell);
    match std::io::stdout().write_all(&script) {
        // `| head`: the reader has what it wanted.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        r => Ok(r?),
    }
}

fn run_cli(cli: Cli) -> Result<()> {
    match cli.cmd {
        Cmd::Cleanup { name, control } => cleanup(name, control)?,
        Cmd::Check { file, cluster } => check(&file, cluster)?,
        Cmd::Graph { file } => print!("{}", load(&file, &registry())?.graph.to_dot()),
        Cmd::Show {
            app: None,
            instance,
            ..
        } => {
            let v = instance.get("/api/v1/status")?;
            println!("{}", serde_json::to_string_pretty(&v)?);
        }
        Cmd::Show {
            app: Some(app),
            request,
            instance,
        } => {
            let request: serde_json::Value =
                serde_json::from_str(&request).context("--request must be JSON")?;
            let v = stitch_api::client::json(
                &instance.socket(),
                Method::POST,
                &format!("/api/v1/apps/{}/query", encode(&app)),
                Some(request.to_string().into_bytes()),
            )?;
            println!("{}", serde_json::to_string_pretty(&v)?);
        }
        Cmd::Apps { doc } => apps(doc)?,
        Cmd::Run(args) if args.supervise => {
            let argv = std::env::args().filter(|a| a != "--supervise").collect();
            supervise::run(argv, args.instance.socket())?
        }
        Cmd::Run(args) => run(&args)?,
        Cmd::Top(args) => top::run(&args.instance.socket(), &args)?,
        Cmd::Kernel(cmd) => kernel_cmd::run(cmd)?,
        Cmd::Nfv(args) => nfv_cmd::run(args)?,
        Cmd::Stats {
            instance,
            json,
            watch,
        } => stats(&instance, json, watch)?,
        Cmd::Apply { file, instance } => apply(&file, &instance)?,
        Cmd::Bench(b) => stitch_bench::run(b, registry)?,
        Cmd::Agent(args) => cluster_cmd::run_agent(args)?,
        Cmd::Cluster(cmd) => cluster_cmd::run_cluster(cmd)?,
        Cmd::Lwaftr(lwaftr_cmd::LwaftrCmd::Run {
            conf,
            v4,
            v6,
            duration,
            name,
        }) => {
            let (_dir, file) = lwaftr_cmd::run_graph(&conf, &v4, &v6)?;
            let instance = Instance {
                name,
                control: None,
            };
            let listen = Listen::socket_only();
            let state = StateArgs {
                state: None,
                state_interval: 1.0,
            };
            run(&RunArgs {
                file,
                duration,
                json: false,
                instance,
                listen,
                keep_running: false,
                state,
                supervise: false,
            })?
        }
        Cmd::Lwaftr(c) => lwaftr_cmd::run(c)?,
        Cmd::Capture(c) => capture_cmd::run(c, Arc::new(registry()))?,
        Cmd::Upgrade(args) => upgrade::upgrade(args)?,
        Cmd::Man { out } => man(&out)?,
        Cmd::Completions { shell } => completions(shell)?,
        Cmd::Token(TokenCmd::New {
            role,
            token_dir,
            instance,
        }) => {
            let dir = token_dir.unwrap_or_else(|| default_token_dir(&instance.socket()));
            let role = stitch_api::access::Role::parse(&role).expect("clap checked the role");
            let path = stitch_api::access::new_token(&dir, role).map_err(anyhow::Error::msg)?;
            println!("{}", path.display());
        }
        Cmd::TakeOver { control, ready_fd } => upgrade::take_over(&control, ready_fd)?,
    }
    Ok(())
}

/// Prints what a live change did.
fn print_report(r: &serde_json::Value) {
    for (key, what) in [
        ("started", "started"),
        ("stopped", "stopped"),
        ("reconfigured", "reconfigured"),
        ("restarted", "restarted"),
        ("links_added", "links added"),
        ("links_removed", "links removed"),
    ] {
        let items: Vec<&str> = r[key]
            .as_array()
            .map(|a| a.iter().filter_map(|x| x.as_str()).collect())
            .unwrap_or_default();
        if !items.is_empty() {
            println!("{what}: {}", items.join(", "));
        }
    }
    for m in r["moved"].as_array().into_iter().flatten() {
        println!(
            "moved: {} from {} to {} (its traffic paused {:.1} ms){}",
            m["app"].as_str().unwrap_or_default(),
            m["from"].as_str().unwrap_or_default(),
            m["to"].as_str().unwrap_or_default(),
            m["pause_ms"].as_f64().unwrap_or_default(),
            m["state_left_behind"]
                .as_str()
                .map(|s| format!("; {s}"))
                .unwrap_or_default()
        );
    }
    for m in r["worker_moves"].as_array().into_iter().flatten() {
        println!(
            "moved: {} from worker {} to worker {} (state and queued packets kept)",
            m["app"].as_str().unwrap_or_default(),
            m["from"].as_str().unwrap_or_default(),
            m["to"].as_str().unwrap_or_default(),
        );
    }
    let kept = r["kept"].as_array().map(Vec::len).unwrap_or(0);
    let links_kept = r["links_kept"].as_array().map(Vec::len).unwrap_or(0);
    println!("unchanged: {kept} apps, {links_kept} links (state and queued packets kept)");
}

/// Percent-encodes one path segment or query value.
fn encode(s: &str) -> String {
    percent_encoding::utf8_percent_encode(s, percent_encoding::NON_ALPHANUMERIC).to_string()
}

/// A running instance: its engine and API, and the flags its signals set.
struct Running {
    engine: Arc<Engine>,
    api: Arc<stitch_api::Api>,
    server: stitch_api::Server,
    config: stitch_api::ApiConfig,
    stop: Arc<AtomicBool>,
    reload: Arc<AtomicBool>,
    /// This process runs the instance while it holds this.
    owner: stitch_place::leftovers::Owner,
    /// The `stitch run` command line the instance was started with (a process that took it
    /// over runs as `stitch take-over`, and offers this one to its own successor).
    command_line: Vec<String>,
}

impl Running {
    /// Stops the API (its socket goes), everything placed and the engine, and gives the
    /// instance up (its lock goes): the last counters.
    fn close(self) -> stitch_core::engine::Stats {
        self.server.shutdown();
        let _ = std::fs::remove_file(stitch_api::handover::socket_path(&self.config.unix));
        let stats = self.api.placements().stop();
        self.owner.release();
        stats
    }

    /// A start refused after the instance was taken (its graph did not apply): stops what
    /// started and leaves nothing of the instance behind.
    fn abandon(self) {
        let _ = self.close();
    }
}

/// Where an instance keeps its API tokens unless told: `NAME.tokens` beside its socket.
fn default_token_dir(socket: &Path) -> PathBuf {
    socket.with_extension("tokens")
}

/// Starts an instance's engine and API (nothing runs yet) and cleans up what a crashed
/// earlier run of the same instance left.
fn start_instance(
    registry: Arc<Registry>,
    instance: &Instance,
    listen: &Listen,
    graph_file: Option<PathBuf>,
) -> Result<Running> {
    new_instance(registry, instance, listen, graph_file)?.serve(None)
}

/// An instance's engine and API, not yet serving.
struct Parts {
    engine: Arc<Engine>,
    api: Arc<stitch_api::Api>,
    config: stitch_api::ApiConfig,
    stop: Arc<AtomicBool>,
    reload: Arc<AtomicBool>,
}

fn new_instance(
    registry: Arc<Registry>,
    instance: &Instance,
    listen: &Listen,
    graph_file: Option<PathBuf>,
) -> Result<Parts> {
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, stop.clone()).context("cannot install signal handler")?;
    }
    let reload = Arc::new(AtomicBool::new(false));
    signal_hook::flag::register(signal_hook::consts::SIGHUP, reload.clone())
        .context("cannot install signal handler")?;
    if let Some(f) = &listen.token_file {
        anyhow::bail!(
            "--token-file {} is gone: the API's tokens are one per role (read, capture, admin) in a folder, --token-dir DIR; `stitch token new --role admin --token-dir DIR` writes one",
            f.display()
        );
    }
    let unix = instance.socket();
    let config = stitch_api::ApiConfig {
        token_dir: listen.listen.map(|_| {
            listen
                .token_dir
                .clone()
                .unwrap_or_else(|| default_token_dir(&unix))
        }),
        unix,
        group: listen.gid()?,
        listen: listen.listen,
        api_hosts: listen.api_hosts.clone(),
        open_metrics: listen.metrics_without_token,
        tls: listen.tls_cert.clone().zip(listen.tls_key.clone()),
        graph_file,
    };
    let engine = Arc::new(Engine::new(registry));
    let api = Arc::new(stitch_api::Api::for_instance(
        engine.clone(),
        config.graph_file.clone(),
        &instance.name,
        &instance.key(),
    ));
    Ok(Parts {
        engine,
        api,
        config,
        stop,
        reload,
    })
}

impl Parts {
    /// Takes the instance (its lock) and serves its API: on listeners of its own, or on those
    /// a predecessor handed over (`stitch upgrade`), with its lock.
    fn serve(self, inherited: Option<upgrade::Inherited>) -> Result<Running> {
        let Parts {
            engine,
            api,
            config,
            stop,
            reload,
        } = self;
        let (owner, server) = match inherited {
            None => {
                stitch_api::prepare_socket_folder(&config.unix, config.group)?;
                let owner =
                    stitch_place::leftovers::own(&config.unix).map_err(|e| anyhow::anyhow!(e))?;
                // Listeners first: a busy port or a missing certificate is an error before
                // anything runs.
                let server = match stitch_api::Server::start(api.clone(), &config) {
                    Ok(server) => server,
                    Err(e) => {
                        // A refused start leaves nothing: the socket it bound and its lock go.
                        let _ = std::fs::remove_file(&config.unix);
                        owner.release();
                        return Err(e);
                    }
                };
                clean_up_crashes(&api, &config);
                (owner, server)
            }
            Some(inherited) => (
                stitch_place::leftovers::Owner::adopt(inherited.lock, &config.unix),
                stitch_api::Server::serve(api.clone(), &config, inherited.listeners)?,
            ),
        };
        Ok(Running {
            engine,
            api,
            server,
            config,
            stop,
            reload,
            owner,
            command_line: std::env::args().collect(),
        })
    }
}

/// Removes what a crashed earlier run of this instance, or another dead instance, left.
fn clean_up_crashes(api: &stitch_api::Api, config: &stitch_api::ApiConfig) {
    let mine = api.placements().clean_after_crash_adopting();
    if !mine.is_empty() {
        log::info!(
            "removed what a crashed run of this instance left: {}",
            mine.join("; ")
        );
    }
    for (name, removed) in
        stitch_place::leftovers::sweep(&stitch_core::runtime_dir(), Some(&config.unix))
    {
        log::info!(
            "removed what crashed instance `{name}` left: {}",
            removed.join("; ")
        );
    }
}

/// Stops the API, everything placed and the engine; prints the last counters.
fn finish(r: Running, as_json: bool) -> Result<()> {
    let api = r.api.clone();
    let v = api.final_stats_json(|| r.close());
    if as_json {
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        print!("{}", table::render(&v));
    }
    Ok(())
}

/// Runs an instance whose graph something beside it feeds (the cluster agent): `feed` starts
/// it and returns how to stop it; the instance runs until SIGINT/SIGTERM.
fn serve(
    instance: &Instance,
    listen: &Listen,
    feed: impl FnOnce(&Arc<stitch_api::Api>) -> Result<Box<dyn FnOnce()>>,
) -> Result<()> {
    let registry = Arc::new(registry());
    let empty = PlacedGraph::parse("apps: {}\n", "<empty>", Path::new("/"), &registry)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let running = start_instance(registry, instance, listen, None)?;
    running
        .api
        .placements()
        .apply(empty)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let stop_feed = feed(&running.api)?;
    upgrade::refuse_on_sigusr2()?;
    log::info!("running; API on {}", running.config.unix.display());
    while !running.stop.load(Ordering::Relaxed) {
        std::thread::sleep(Duration::from_millis(10));
    }
    log::info!("stopping (signal)");
    stop_feed();
    finish(running, false)
}

fn run(args: &RunArgs) -> Result<()> {
    let RunArgs {
        file,
        duration,
        json: as_json,
        instance,
        listen,
        keep_running,
        state,
        supervise: _,
    } = args;
    let (duration, as_json) = (*duration, *as_json);
    // Whoever can write the graph or the state decides what root runs and lets through.
    stitch_core::files::check_trusted_target(file, "graph file").map_err(anyhow::Error::msg)?;
    if let Some(path) = &state.state {
        stitch_core::files::check_trusted(path, "state file").map_err(anyhow::Error::msg)?;
    }
    let registry = Arc::new(registry());
    let graph = load(file, &registry)?;
    let summary = graph.summary();
    let graph_file = Some(std::path::absolute(file)?);
    let running = start_instance(registry, instance, listen, graph_file)?;
    let applied = running
        .api
        .placements()
        .apply(graph)
        .map_err(|e| {
            let errors = match e {
                stitch_place::PlaceError::Graph(errors) => errors,
                stitch_place::PlaceError::App { at, .. } => vec![at],
                e => return anyhow::anyhow!("{}: {e}", file.display()),
            };
            anyhow::anyhow!("{}", stitch_core::graph::GraphErrors::in_file(file, errors))
        })
        .and_then(|report| Ok((report, StateKeeper::start(state, &running.engine)?)));
    let (_, keeper) = match applied {
        Ok(started) => started,
        Err(e) => {
            running.abandon();
            return Err(e);
        }
    };
    log::info!(
        "running {} ({summary}); API on {}",
        file.display(),
        running.config.unix.display()
    );
    serve_until_stopped(running, keeper, file, duration, (as_json, *keep_running))
}

/// Runs a started instance until its graph finishes, `duration` passes or a signal comes;
/// reloads `file` on SIGHUP, keeps the state file, and lets a new process take over
/// (`stitch upgrade`).
fn serve_until_stopped(
    running: Running,
    mut keeper: Option<StateKeeper>,
    file: &Path,
    duration: Option<f64>,
    (as_json, keep_running): (bool, bool),
) -> Result<()> {
    let (engine, api) = (&running.engine, &running.api);
    if let Some(k) = &keeper {
        api.add_reporter("state", k.reporter());
    }
    upgrade::offer_hand_over(&running)?;
    let started = Instant::now();
    let limit = duration.map(Duration::from_secs_f64);
    // A graph is finished when its finite sources are done, its links are empty and nothing moved
    // for a few polls (an app may still hold packets between breaths).
    let mut quiet_polls = 0;
    let mut last_activity = u64::MAX;
    let why = loop {
        std::thread::sleep(Duration::from_millis(10));
        if running.stop.load(Ordering::Relaxed) {
            break "signal";
        }
        if limit.is_some_and(|l| started.elapsed() >= l) {
            break "duration";
        }
        if running.reload.swap(false, Ordering::Relaxed) {
            match api.reload() {
                Ok(r) => log::info!(
                    "reloaded {}: {} started, {} stopped, {} reconfigured, {} restarted, {} links added, {} removed",
                    file.display(),
                    r.engine.started.len(),
                    r.engine.stopped.len(),
                    r.engine.reconfigured.len(),
                    r.engine.restarted.len(),
                    r.engine.links_added.len(),
                    r.engine.links_removed.len()
                ),
                Err(e) => log::error!("reload of {} refused, the graph runs as before: {}", file.display(), e.message),
            }
        }
        if let Some(k) = keeper.as_mut() {
            k.save_when_due(engine);
        }
        let activity = engine.activity();
        if !keep_running && engine.finished() && activity == last_activity {
            quiet_polls += 1;
            if quiet_polls >= 3 {
                break "finished";
            }
        } else {
            quiet_polls = 0;
        }
        last_activity = activity;
    };
    log::info!(
        "stopping ({why}) after {:.3} s",
        started.elapsed().as_secs_f64()
    );
    if let Some(k) = keeper.as_mut() {
        k.save(engine);
    }
    finish(running, as_json)
}
