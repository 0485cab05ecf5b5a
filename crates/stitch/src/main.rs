//! `stitch`: run, check and inspect Stitch graphs.

mod bench;
mod bench_nf;
mod capture_cmd;
mod control;
mod table;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use serde_json::json;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use stitch_core::{Engine, Graph, Registry};

#[derive(Parser)]
#[command(
    name = "stitch",
    version,
    about = "Stitch: network functions composed into graphs, at line rate"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(clap::Args, Clone)]
struct Instance {
    /// Name of the instance (one control socket per name).
    #[arg(long, default_value = "stitch")]
    name: String,
    /// Control socket path (overrides --name).
    #[arg(long)]
    control: Option<PathBuf>,
}

impl Instance {
    fn socket(&self) -> PathBuf {
        self.control
            .clone()
            .unwrap_or_else(|| control::socket_path(&self.name))
    }
}

#[derive(Subcommand)]
enum Cmd {
    /// Run a graph until it finishes, --duration passes, or SIGINT/SIGTERM; then print counters.
    Run {
        file: PathBuf,
        /// Stop after this many seconds.
        #[arg(long)]
        duration: Option<f64>,
        /// Print counters as JSON instead of tables.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        instance: Instance,
    },
    /// Validate a graph file; errors name the line.
    Check { file: PathBuf },
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
    /// mappings, firewall connections) from a running instance.
    Show {
        app: String,
        /// Request as JSON, e.g. '{"limit": 100}'.
        #[arg(long, default_value = "{}")]
        request: String,
        #[command(flatten)]
        instance: Instance,
    },
    /// List the app types this build knows.
    Apps,
    /// Capture an interface to PCAP/PCAPNG files, with tcpdump's options.
    Capture(capture_cmd::CaptureArgs),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(bench::BenchCmd),
}

fn registry() -> Registry {
    let mut r = Registry::new();
    stitch_apps::register(&mut r);
    stitch_io::register(&mut r);
    r
}

fn load(file: &Path, registry: &Registry) -> Result<Graph> {
    Graph::load(file, registry).map_err(|e| anyhow::anyhow!("{e}"))
}

fn main() {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info"))
        .format_timestamp(None)
        .init();
    let cli = Cli::parse();
    if let Err(e) = run_cli(cli) {
        eprintln!("stitch: {e:#}");
        std::process::exit(1);
    }
}

fn run_cli(cli: Cli) -> Result<()> {
    match cli.cmd {
        Cmd::Check { file } => {
            let g = load(&file, &registry())?;
            println!(
                "{}: ok ({} apps, {} links, {} workers)",
                file.display(),
                g.apps.len(),
                g.links.len(),
                g.workers.len()
            );
        }
        Cmd::Graph { file } => print!("{}", load(&file, &registry())?.to_dot()),
        Cmd::Show {
            app,
            request,
            instance,
        } => {
            let request: serde_json::Value =
                serde_json::from_str(&request).context("--request must be JSON")?;
            let v = control::request(
                &instance.socket(),
                &json!({"cmd": "query", "app": app, "request": request}),
            )?;
            println!("{}", serde_json::to_string_pretty(&v["answer"])?);
        }
        Cmd::Apps => {
            for t in registry().types() {
                println!("{:<14} {}", t.name, t.summary);
            }
        }
        Cmd::Run {
            file,
            duration,
            json,
            instance,
        } => run(&file, duration, json, &instance)?,
        Cmd::Stats {
            instance,
            json,
            watch,
        } => loop {
            let v = control::request(&instance.socket(), &json!({"cmd": "stats"}))?;
            if json {
                println!("{}", serde_json::to_string_pretty(&v["stats"])?);
            } else {
                if watch {
                    print!("\x1b[H\x1b[2J");
                }
                print!("{}", table::render(&v["stats"]));
            }
            if !watch {
                break;
            }
            std::thread::sleep(Duration::from_secs(1));
        },
        Cmd::Apply { file, instance } => {
            // Validate locally first: the errors then name this file and its lines.
            load(&file, &registry())?;
            let text = std::fs::read_to_string(&file)?;
            let dir = std::fs::canonicalize(&file)?
                .parent()
                .map(Path::to_path_buf)
                .unwrap_or_default();
            let v = control::request(
                &instance.socket(),
                &json!({"cmd": "apply", "text": text, "dir": dir, "file": file.display().to_string()}),
            )?;
            let r = &v["report"];
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
            let kept = r["kept"].as_array().map(Vec::len).unwrap_or(0);
            let links_kept = r["links_kept"].as_array().map(Vec::len).unwrap_or(0);
            println!("unchanged: {kept} apps, {links_kept} links (state and queued packets kept)");
        }
        Cmd::Bench(b) => bench::run(b, Arc::new(registry()))?,
        Cmd::Capture(c) => capture_cmd::run(c, Arc::new(registry()))?,
    }
    Ok(())
}

fn run(file: &Path, duration: Option<f64>, as_json: bool, instance: &Instance) -> Result<()> {
    let registry = Arc::new(registry());
    let graph = load(file, &registry)?;
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, stop.clone()).context("cannot install signal handler")?;
    }
    let engine = Arc::new(Engine::new(registry));
    let report = engine
        .apply(graph)
        .map_err(|e| anyhow::anyhow!("{}: {e}", file.display()))?;
    log::info!("running {} ({} apps)", file.display(), report.started.len());
    let rates = Arc::new(Mutex::new(control::Rates::default()));
    let socket = instance.socket();
    let served = match control::serve(&socket, engine.clone(), rates.clone()) {
        Ok(()) => true,
        Err(e) => {
            log::warn!("{e:#}; running without control socket");
            false
        }
    };
    let started = Instant::now();
    let limit = duration.map(Duration::from_secs_f64);
    // A graph is finished when its finite sources are done, its links are empty and nothing moved
    // for a few polls (an app may still hold packets between breaths).
    let mut quiet_polls = 0;
    let mut last_activity = u64::MAX;
    let why = loop {
        std::thread::sleep(Duration::from_millis(10));
        if stop.load(Ordering::Relaxed) {
            break "signal";
        }
        if limit.is_some_and(|l| started.elapsed() >= l) {
            break "duration";
        }
        rates
            .lock()
            .unwrap()
            .sample(engine.stats(), Duration::from_secs(1));
        let activity = engine.activity();
        if engine.finished() && activity == last_activity {
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
    let stats = engine.stop();
    if served {
        let _ = std::fs::remove_file(&socket);
    }
    let v = control::stats_json(&stats, &rates.lock().unwrap());
    if as_json {
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        print!("{}", table::render(&v));
    }
    Ok(())
}
