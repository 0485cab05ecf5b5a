//! What a cluster graph may run on a host: a host's agent starts function processes and VMs
//! as root's children, so whoever writes its graph would choose the program. The host's
//! operator says what may run (`stitch agent --allow-commands FILE`); without the file a
//! cluster graph runs no process and no VM there.
//!
//! The file, one entry a line (`#` starts a comment):
//! - `/usr/local/bin/stitch-nf-firewall` — this program (a process's `command`, a VM's `qemu`)
//!   or file (a VM's `kernel`, `initrd`, `disk`, `console`);
//! - `/opt/functions/` — anything under this folder;
//! - `qemu-args` — VM apps may pass `qemu_args` (QEMU's options reach any file: allow them
//!   only where the graphs' writers are trusted with root).
//!
//! The agent publishes its list in its host record; the controller places a process or VM app
//! only on a host whose list allows it (else `unplaced`, with the reason), and the agent checks
//! every host graph it is given again, with the programs resolved as it would start them — a
//! graph written into etcd by hand gets the same refusal.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::path::{Component, Path, PathBuf};

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Allowed {
    /// Absolute files, and folders ending with `/`.
    #[serde(default)]
    pub paths: Vec<String>,
    #[serde(default)]
    pub qemu_args: bool,
}

impl Allowed {
    /// Reads the allow file: Stitch's rules for files it trusts (nobody but root or this user
    /// can have written it), every entry absolute and without `..`.
    pub fn read(path: &Path) -> Result<Allowed, String> {
        let bytes = stitch_core::files::read_trusted(path, "allow file", false)?
            .ok_or_else(|| format!("--allow-commands {}: no such file", path.display()))?;
        Allowed::parse(&String::from_utf8_lossy(&bytes))
            .map_err(|(line, why)| format!("{}:{line}: {why}", path.display()))
    }

    pub fn parse(text: &str) -> Result<Allowed, (usize, String)> {
        let mut allowed = Allowed::default();
        for (i, line) in text.lines().enumerate() {
            let entry = line.split('#').next().unwrap_or_default().trim();
            if entry.is_empty() {
                continue;
            }
            if entry == "qemu-args" {
                allowed.qemu_args = true;
                continue;
            }
            let p = Path::new(entry);
            if !p.is_absolute() || p.components().any(|c| c == Component::ParentDir) {
                return Err((
                    i + 1,
                    format!("`{entry}`: give an absolute path without `..` (a file, or a folder ending with /), or `qemu-args`"),
                ));
            }
            allowed.paths.push(entry.to_string());
        }
        Ok(allowed)
    }

    /// Whether absolute `path` is an entry or lies under a folder entry.
    fn allows(&self, path: &Path) -> bool {
        if !path.is_absolute() || path.components().any(|c| c == Component::ParentDir) {
            return false;
        }
        self.paths.iter().any(|e| match e.strip_suffix('/') {
            Some(folder) => path.starts_with(folder),
            None => path == Path::new(e),
        })
    }

    /// Whether a program named `name` in a command might be allowed before it is resolved
    /// (the controller's view: a bare name is found on the host): an allowed path, a bare name
    /// that an entry ends with, or any folder entry.
    fn may_allow_program(&self, name: &str) -> bool {
        if name.contains('/') {
            return self.allows(Path::new(name));
        }
        self.paths
            .iter()
            .any(|e| e.ends_with('/') || Path::new(e).file_name().is_some_and(|f| f == name))
    }

    /// Why app `app` (its `placement` and entry) may not run here, as the controller can tell.
    pub fn refusal_for_placement(&self, placement: &str, config: &Value) -> Option<String> {
        let (files, programs) = match needs(placement, config) {
            Ok(n) => n,
            Err(why) => return Some(why),
        };
        programs
            .iter()
            .find(|p| !self.may_allow_program(p))
            .map(|p| {
                format!("the host does not allow the program `{p}` (stitch agent --allow-commands)")
            })
            .or_else(|| self.files_refusal(&files))
            .or_else(|| self.qemu_args_refusal(placement, config))
    }

    fn files_refusal(&self, files: &[String]) -> Option<String> {
        files
            .iter()
            .find(|f| !self.allows(Path::new(f)))
            .map(|f| format!("the host does not allow the file `{f}` (stitch agent --allow-commands; give absolute paths)"))
    }

    fn qemu_args_refusal(&self, placement: &str, config: &Value) -> Option<String> {
        let has_args = config["qemu_args"]
            .as_array()
            .is_some_and(|a| !a.is_empty());
        (placement == "vm" && has_args && !self.qemu_args).then(|| {
            "the host does not allow `qemu_args` (its allow file has no `qemu-args` line)"
                .to_string()
        })
    }

    /// Refuses host graph `document` if it runs a process or VM this host does not allow, with
    /// each program resolved by `resolve` as the host would start it.
    pub fn check_document(
        &self,
        document: &Value,
        resolve: impl Fn(&str) -> Result<PathBuf, String>,
    ) -> Result<(), String> {
        let Some(apps) = document["apps"].as_object() else {
            return Ok(());
        };
        let default = document["placement"].as_str().unwrap_or("engine");
        for (name, entry) in apps {
            let placement = entry["placement"].as_str().unwrap_or(default);
            let (files, programs) =
                needs(placement, entry).map_err(|why| format!("app `{name}`: {why}"))?;
            for p in programs {
                let resolved = resolve(&p).map_err(|why| format!("app `{name}`: {why}"))?;
                if !self.allows(&resolved) {
                    return Err(format!(
                        "app `{name}`: this host does not allow the program {} (stitch agent --allow-commands)",
                        resolved.display()
                    ));
                }
            }
            let refusal = self
                .files_refusal(&files)
                .or_else(|| self.qemu_args_refusal(placement, entry));
            if let Some(why) = refusal {
                return Err(format!("app `{name}`: {why}"));
            }
        }
        Ok(())
    }
}

/// The files and the programs an app of `placement` with entry `config` makes the host use.
fn needs(placement: &str, config: &Value) -> Result<(Vec<String>, Vec<String>), String> {
    let text = |k: &str| config[k].as_str().map(str::to_string);
    match placement {
        "process" => {
            let program = config["command"][0]
                .as_str()
                .ok_or("a process app names its program first in `command`")?;
            Ok((Vec::new(), vec![program.to_string()]))
        }
        "vm" => {
            let files = ["kernel", "initrd", "disk", "console"]
                .into_iter()
                .filter_map(text)
                .collect();
            let qemu = text("qemu").unwrap_or_else(|| "qemu-system-x86_64".into());
            Ok((files, vec![qemu]))
        }
        _ => Ok((Vec::new(), Vec::new())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn allowed() -> Allowed {
        Allowed::parse(
            "# functions\n/usr/local/bin/stitch-nf-firewall\n/opt/functions/  # all of them\n/var/lib/stitch/images/\n/usr/bin/qemu-system-x86_64\n",
        )
        .unwrap()
    }

    #[test]
    fn the_allow_file_takes_absolute_paths_and_the_word_qemu_args() {
        let a = allowed();
        assert_eq!(a.paths.len(), 4);
        assert!(!a.qemu_args);
        assert!(Allowed::parse("qemu-args\n").unwrap().qemu_args);
        assert_eq!(Allowed::parse("/ok\nbin/sh\n").unwrap_err().0, 2);
        assert!(Allowed::parse("/opt/../bin/sh").is_err());
    }

    #[test]
    fn processes_and_vms_run_only_from_what_the_host_allows() {
        let a = allowed();
        let process = |cmd: &str| json!({ "placement": "process", "command": [cmd, "-x"] });
        assert_eq!(
            a.refusal_for_placement("process", &process("stitch-nf-firewall")),
            None
        );
        assert_eq!(
            a.refusal_for_placement("process", &process("/opt/functions/nat")),
            None
        );
        assert!(a
            .refusal_for_placement("process", &process("/bin/sh"))
            .is_some());
        assert!(a
            .refusal_for_placement("process", &process("/opt/functions/../../bin/sh"))
            .is_some());
        assert_eq!(
            Allowed::default().refusal_for_placement("engine", &json!({})),
            None
        );
        assert!(Allowed::default()
            .refusal_for_placement("process", &process("stitch-nf-firewall"))
            .is_some());
        let vm = json!({ "kernel": "/var/lib/stitch/images/vmlinux", "qemu": "/usr/bin/qemu-system-x86_64" });
        assert_eq!(a.refusal_for_placement("vm", &vm), None);
        let mut console = vm.clone();
        console["console"] = json!("/etc/shadow");
        assert!(a
            .refusal_for_placement("vm", &console)
            .unwrap()
            .contains("/etc/shadow"));
        let mut args = vm.clone();
        args["qemu_args"] = json!(["-drive", "file=/dev/sda"]);
        assert!(a
            .refusal_for_placement("vm", &args)
            .unwrap()
            .contains("qemu-args"));
        // The agent's check, with programs resolved as the host would.
        let doc = json!({ "apps": { "fw": process("stitch-nf-firewall"), "sh": process("sh") } });
        let resolve = |p: &str| -> Result<PathBuf, String> {
            Ok(if p.contains('/') {
                PathBuf::from(p)
            } else if p == "sh" {
                PathBuf::from("/bin/sh")
            } else {
                Path::new("/usr/local/bin").join(p)
            })
        };
        let e = a.check_document(&doc, resolve).unwrap_err();
        assert!(e.contains("app `sh`") && e.contains("/bin/sh"), "{e}");
        let doc = json!({ "apps": { "fw": process("stitch-nf-firewall") } });
        a.check_document(&doc, resolve).unwrap();
    }
}
