//! `stitch run --state`: the apps' state read back at start, written every interval and at a
//! clean stop (the engine does the writing, atomically), and what happened shown in the
//! instance's status (`stitch show`, `GET /api/v1/status`: section `state`) and `/metrics`.

use anyhow::Result;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use stitch_core::engine::RestoreReport;
use stitch_core::Engine;

/// Carrying the apps' state across a restart of `stitch run`.
#[derive(clap::Args, Clone)]
pub struct StateArgs {
    /// Keep the apps' state (NAT mappings, firewall connections, learned addresses) in this
    /// file: read back into the apps at start, written every --state-interval and at a clean
    /// stop, atomically, so a Stitch killed -9 comes back with the last snapshot.
    #[arg(long)]
    pub state: Option<PathBuf>,
    /// Seconds between two snapshots of the apps' state.
    #[arg(long, default_value_t = 1.0, requires = "state")]
    pub state_interval: f64,
}

/// Takes back the apps' state at start and writes it every interval and at the end.
pub struct StateKeeper {
    path: PathBuf,
    every: Duration,
    last: Instant,
    report: Arc<Mutex<Report>>,
}

/// What the state file did for this instance.
struct Report {
    file: PathBuf,
    restored: RestoreReport,
    saves: u64,
    save_failures: u64,
    last_error: Option<String>,
    last_save: Option<Instant>,
}

impl StateKeeper {
    /// Restores the apps' state from `--state`'s file (nothing without the option or file).
    pub fn start(args: &StateArgs, engine: &Engine) -> Result<Option<StateKeeper>> {
        let Some(path) = args.state.clone() else {
            return Ok(None);
        };
        let restored = engine
            .restore_state(&path)
            .map_err(|e| anyhow::anyhow!("{e} (move it away to start without it)"))?;
        log::info!(
            "state from {}: {} apps restored, {} refused, {} no longer in the graph",
            path.display(),
            restored.restored.len(),
            restored.refused.len(),
            restored.gone.len()
        );
        for (app, why) in &restored.refused {
            log::warn!("app `{app}` starts fresh: its saved state was refused: {why}");
        }
        StateKeeper::keeping(args, restored)
    }

    /// Keeps the state file of `args` for a process that took over from another (`stitch
    /// upgrade`): its apps took their state from the predecessor (`restored`), not the file.
    pub fn after_take_over(
        args: &StateArgs,
        restored: stitch_core::engine::RestoreReport,
    ) -> Result<Option<StateKeeper>> {
        StateKeeper::keeping(args, restored)
    }

    fn keeping(
        args: &StateArgs,
        restored: stitch_core::engine::RestoreReport,
    ) -> Result<Option<StateKeeper>> {
        let Some(path) = args.state.clone() else {
            return Ok(None);
        };
        anyhow::ensure!(
            args.state_interval > 0.0,
            "--state-interval: a number of seconds above 0"
        );
        let report = Report {
            file: path.clone(),
            restored,
            saves: 0,
            save_failures: 0,
            last_error: None,
            last_save: None,
        };
        Ok(Some(StateKeeper {
            path,
            every: Duration::from_secs_f64(args.state_interval),
            last: Instant::now(),
            report: Arc::new(Mutex::new(report)),
        }))
    }

    /// For the instance's status and `/metrics`.
    pub fn reporter(&self) -> Arc<dyn stitch_api::Reporter> {
        Arc::new(StateReporter(self.report.clone()))
    }

    pub fn save(&mut self, engine: &Engine) {
        self.last = Instant::now();
        let result = engine.save_state(&self.path);
        let mut r = self.report.lock().unwrap();
        match result {
            Ok(_) => {
                r.saves += 1;
                r.last_save = Some(self.last);
            }
            Err(e) => {
                log::warn!("{e}");
                r.save_failures += 1;
                r.last_error = Some(e.to_string());
            }
        }
    }

    pub fn save_when_due(&mut self, engine: &Engine) {
        if self.last.elapsed() >= self.every {
            self.save(engine);
        }
    }
}

struct StateReporter(Arc<Mutex<Report>>);

impl stitch_api::Reporter for StateReporter {
    fn status(&self) -> Value {
        let r = self.0.lock().unwrap();
        let refused: Vec<Value> = r
            .restored
            .refused
            .iter()
            .map(|(app, why)| json!({ "app": app, "why": why }))
            .collect();
        json!({
            "file": r.file,
            "restored": r.restored.restored,
            "refused": refused,
            "no_longer_in_graph": r.restored.gone,
            "saves": r.saves,
            "save_failures": r.save_failures,
            "last_error": r.last_error,
            "last_save_age_s": r.last_save.map(|t| t.elapsed().as_secs_f64()),
        })
    }

    fn gauges(&self) -> Vec<(&'static str, &'static str, i64)> {
        let r = self.0.lock().unwrap();
        vec![
            (
                "stitch_state_apps_restored",
                "Apps that took their state back from the state file at start",
                r.restored.restored.len() as i64,
            ),
            (
                "stitch_state_apps_refused",
                "Apps whose saved state was refused at start (they started fresh)",
                r.restored.refused.len() as i64,
            ),
            (
                "stitch_state_save_failures",
                "Snapshots of the apps' state that could not be written",
                r.save_failures as i64,
            ),
        ]
    }
}
