//! The apps' state in a file, to carry across a restart of Stitch: written whole and
//! atomically, mode 0600 (`files::write_atomically`: a temporary name of its own, fsync,
//! rename), so that a crash at any moment leaves the last complete snapshot; read back into the
//! apps of the same name and type after a start, if nobody else can have written it.

use super::*;
use crate::app::AppState;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;

/// The file's own format; its apps' states carry their own versions.
pub const STATE_FILE_FORMAT: u32 = 1;

#[derive(Serialize, Deserialize)]
struct StateFile {
    stitch_state_format: u32,
    apps: BTreeMap<String, SavedApp>,
}

#[derive(Serialize, Deserialize)]
struct SavedApp {
    #[serde(rename = "type")]
    kind: String,
    #[serde(flatten)]
    state: AppState,
}

/// What a restore did, app by app.
#[derive(Debug, Default, Clone, Serialize)]
pub struct RestoreReport {
    /// Apps that took their state back.
    pub restored: Vec<String>,
    /// Apps whose saved state was refused, with the reason: they start fresh.
    pub refused: Vec<(String, String)>,
    /// Saved apps that are not in the running graph (or are of another type now).
    pub gone: Vec<String>,
}

impl Engine {
    /// Writes every app's state ([`crate::App::snapshot`]) to `path`; returns how many apps
    /// had state. An app that fails to answer is left out of this snapshot, not the file.
    pub fn save_state(&self, path: &Path) -> Result<usize, EngineError> {
        let mut apps = BTreeMap::new();
        for (name, kind) in self.app_kinds() {
            let state = match self.snapshot_app(&name) {
                Ok(Some(snapshot)) => snapshot.into_state().map_err(EngineError::Other),
                Ok(None) => continue,
                Err(e) => Err(e),
            };
            match state {
                Ok(state) => {
                    apps.insert(name, SavedApp { kind, state });
                }
                Err(e) => log::warn!("state of app `{name}` left out of this snapshot: {e}"),
            }
        }
        let n = apps.len();
        let file = StateFile {
            stitch_state_format: STATE_FILE_FORMAT,
            apps,
        };
        crate::files::write_atomically(
            path,
            &serde_json::to_vec(&file).expect("state is JSON"),
            0o600,
        )
        .map_err(|e| EngineError::Other(format!("state file {}: {e}", path.display())))?;
        Ok(n)
    }

    /// Gives each running app the state `path` saved for an app of its name and type. A file
    /// of another format is refused whole, with the reason; a missing file restores nothing.
    pub fn restore_state(&self, path: &Path) -> Result<RestoreReport, EngineError> {
        let bad = |why: String| EngineError::Other(format!("state file {}: {why}", path.display()));
        // Another user's file, or one in a folder others can write, could hold connections
        // a firewall would then let through: refused, as sshd refuses such keys.
        let bytes = match crate::files::read_trusted(path, "state file", false) {
            Ok(Some(b)) => b,
            Ok(None) => return Ok(RestoreReport::default()),
            Err(why) => return Err(EngineError::Other(why)),
        };
        let format = serde_json::from_slice::<serde_json::Value>(&bytes)
            .map_err(|e| bad(e.to_string()))?["stitch_state_format"]
            .as_u64();
        if format != Some(STATE_FILE_FORMAT as u64) {
            return Err(bad(format!(
                "format {} (this Stitch reads format {STATE_FILE_FORMAT})",
                format.map_or("missing".to_string(), |f| f.to_string())
            )));
        }
        let file: StateFile = serde_json::from_slice(&bytes).map_err(|e| bad(e.to_string()))?;
        let running = self.app_kinds();
        let mut report = RestoreReport::default();
        for (name, saved) in file.apps {
            if running.get(&name) != Some(&saved.kind) {
                report.gone.push(name);
                continue;
            }
            match self.restore_app(&name, saved.state) {
                Ok(()) => report.restored.push(name),
                Err(e) => report.refused.push((name, e.to_string())),
            }
        }
        Ok(report)
    }
}

impl Engine {
    /// Each running app's name and type.
    fn app_kinds(&self) -> HashMap<String, String> {
        let st = self.state();
        st.apps
            .iter()
            .map(|(name, info)| (name.clone(), info.kind.clone()))
            .collect()
    }
}
