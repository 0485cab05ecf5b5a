//! Ports attached from outside the graph — a container's interface that `stitch-cni` put in
//! place of an `attachment` app — recorded on the host beside the instance's API socket, so
//! that they outlive the instance: an agent that restarts (or is killed) attaches them again
//! when it applies its host's graph, and the containers keep their addresses and traffic.

use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The folder of the records of the instance whose API socket is `socket`.
pub fn dir(socket: &Path) -> PathBuf {
    socket.with_extension("attached")
}

fn file(socket: &Path, port: &str) -> PathBuf {
    dir(socket).join(format!("{port}.json"))
}

/// Records that graph port `port` is `entry` (an app entry, e.g. an `af_packet` app on the
/// host end of a container's veth pair); written whole or not at all.
pub fn record(socket: &Path, port: &str, entry: &Value) -> std::io::Result<()> {
    std::fs::create_dir_all(dir(socket))?;
    stitch_core::files::write_atomically(&file(socket, port), entry.to_string().as_bytes(), 0o600)
}

/// Forgets port `port`'s record (none is not an error).
pub fn forget(socket: &Path, port: &str) {
    let _ = std::fs::remove_file(file(socket, port));
}

/// The recorded ports whose interface still exists on this host: port → app entry. A record
/// whose interface is gone (its container was deleted while nothing ran) is removed.
pub fn recorded(socket: &Path) -> BTreeMap<String, Value> {
    let mut out = BTreeMap::new();
    let Ok(files) = std::fs::read_dir(dir(socket)) else {
        return out;
    };
    for f in files.flatten() {
        let path = f.path();
        let Some(port) = path
            .extension()
            .filter(|e| *e == "json")
            .and(path.file_stem())
            .and_then(|s| s.to_str())
        else {
            continue;
        };
        let entry: Option<Value> = std::fs::read(&path)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok());
        let interface = entry
            .as_ref()
            .and_then(|e| e["interface"].as_str())
            .map(|i| Path::new("/sys/class/net").join(i));
        match (entry, interface) {
            (Some(e), Some(i)) if i.exists() => {
                out.insert(port.to_string(), e);
            }
            _ => {
                let _ = std::fs::remove_file(&path);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_of_existing_interfaces_are_kept_others_removed() {
        let d = tempfile::tempdir().unwrap();
        let socket = d.path().join("h1.sock");
        record(
            &socket,
            "a",
            &serde_json::json!({ "type": "af_packet", "interface": "lo" }),
        )
        .unwrap();
        record(
            &socket,
            "b",
            &serde_json::json!({ "type": "af_packet", "interface": "gone0" }),
        )
        .unwrap();
        let r = recorded(&socket);
        assert_eq!(r.keys().collect::<Vec<_>>(), ["a"]);
        assert!(
            !file(&socket, "b").exists(),
            "a record of a gone interface is removed"
        );
        forget(&socket, "a");
        assert!(recorded(&socket).is_empty());
    }
}
