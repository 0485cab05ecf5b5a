//! The Debian package: `scripts/deb` builds it from this build's binaries, `dpkg -i` installs
//! it, the default example runs from the installed paths with the installed man pages and
//! completions, and `dpkg -r` then `dpkg --purge` leave none of its files.

mod common;

use common::{must, require_root_and_tools, sh};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Purges the package when the test ends, however it ends.
struct Installed;

impl Drop for Installed {
    fn drop(&mut self) {
        let _ = sh("dpkg --purge stitch >/dev/null 2>&1");
    }
}

fn installed() -> bool {
    sh("dpkg-query -W -f='${Status}' stitch 2>/dev/null")
        .stdout
        .starts_with(b"install ok installed")
}

#[test]
fn the_package_installs_runs_the_default_example_and_removes_every_file() {
    require_root_and_tools(&["dpkg", "dpkg-deb", "dpkg-shlibdeps", "man"]);
    assert!(
        !installed(),
        "a `stitch` package is installed on this machine: this test installs and removes its own, so remove that one first (dpkg -r stitch)"
    );
    let bin_dir = Path::new(env!("CARGO_BIN_EXE_stitch")).parent().unwrap();
    let repo = common::repo();
    let out = tempfile::tempdir().unwrap();
    let built = Command::new(repo.join("scripts/deb"))
        .arg("--bin-dir")
        .arg(bin_dir)
        .arg("--out")
        .arg(out.path())
        // Debug binaries are large: xz would take minutes.
        .args(["--compress", "none"])
        .output()
        .unwrap();
    assert!(
        built.status.success(),
        "scripts/deb: {}",
        String::from_utf8_lossy(&built.stderr)
    );
    let deb = PathBuf::from(String::from_utf8(built.stdout).unwrap().trim());
    let info = must(&format!(
        "dpkg-deb --field {} Package Version Depends",
        deb.display()
    ));
    assert!(
        info.contains("libpcap0.8") && info.contains("libc6"),
        "{info}"
    );
    let contents = must(&format!("dpkg-deb --contents {}", deb.display()));
    for path in [
        "./usr/bin/stitch",
        "./usr/bin/stitch-nf-firewall",
        "./usr/lib/cni/stitch-cni",
        "./usr/include/stitch_nf.h",
        "./lib/systemd/system/stitch@.service",
        "./usr/share/man/man1/stitch-run.1.gz",
        "./usr/share/bash-completion/completions/stitch",
        "./usr/share/stitch/examples/hello.yaml",
    ] {
        assert!(
            contents.contains(path),
            "{path} is not in the package:\n{contents}"
        );
    }

    let _purge = Installed;
    must(&format!("dpkg -i {}", deb.display()));
    assert!(installed());
    let files: Vec<String> = must("dpkg-query -L stitch")
        .lines()
        .map(str::to_string)
        .filter(|f| Path::new(f).is_file())
        .collect();
    assert!(files.len() > 50, "{files:?}");
    // postinst: the group of the API's users and the functions' user.
    assert!(sh("getent group stitch").status.success());
    assert!(sh("id stitch-fn").status.success());
    let unit = std::fs::read_to_string("/lib/systemd/system/stitch@.service").unwrap();
    assert!(unit.contains("ExecStart=/usr/bin/stitch run"), "{unit}");

    // The default example from the installed paths, by the installed binary.
    let name = format!("t-pkg-{}", std::process::id());
    let run = must(&format!(
        "cd / && /usr/bin/stitch run /usr/share/stitch/examples/hello.yaml --duration 1 --json --name {name}"
    ));
    let stats: serde_json::Value = serde_json::from_str(&run).unwrap();
    let sunk = stats["apps"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["name"] == "out")
        .and_then(|a| a["counters"]["packets"].as_u64())
        .unwrap_or(0);
    assert!(sunk > 0, "{run}");
    // Functions are found beside the installed stitch.
    let check = must("cd / && printf 'apps:\\n  fw: { placement: process, command: [stitch-nf-firewall] }\\n' > /tmp/t-pkg-fn.yaml && /usr/bin/stitch check /tmp/t-pkg-fn.yaml; rm -f /tmp/t-pkg-fn.yaml");
    assert!(check.contains("ok"), "{check}");
    assert_eq!(
        must("man -w stitch-run").trim(),
        "/usr/share/man/man1/stitch-run.1.gz"
    );
    let completes = must(
        "bash -c 'source /usr/share/bash-completion/completions/stitch; COMP_WORDS=(stitch upg); COMP_CWORD=1; _stitch stitch upg stitch; echo ${COMPREPLY[@]}'",
    );
    assert_eq!(completes.trim(), "upgrade");

    must("dpkg -r stitch");
    let left: Vec<&String> = files.iter().filter(|f| Path::new(f).exists()).collect();
    assert!(left.is_empty(), "left after dpkg -r: {left:?}");
    must("dpkg --purge stitch");
    let status = sh("dpkg-query -W -f='${Status}' stitch 2>/dev/null").stdout;
    let status = String::from_utf8_lossy(&status);
    assert!(
        status.is_empty() || status.ends_with("not-installed"),
        "dpkg still knows the package: {status}"
    );
}
