//! The README's quick start, run as the README writes it (its command read from the README),
//! on this build's binaries, twice in a row on the same machine: host A pings host B through
//! the engine, a function process and the kernel, the counters and the graph view's address
//! are printed, and nothing it made is left.

mod common;

use common::{free_port, must, require_root_and_tools, sh};
use std::path::Path;
use std::process::Command;

/// The quick start's command of the README's first code block, without `sudo` (the test is
/// root) and without its comment.
fn readme_quickstart() -> Vec<String> {
    let readme = std::fs::read_to_string(common::repo().join("README.md")).unwrap();
    let line = readme
        .lines()
        .find(|l| l.trim_start().starts_with("sudo scripts/quickstart"))
        .expect("the README's quick start runs scripts/quickstart");
    let command = line.split('#').next().unwrap();
    command
        .split_whitespace()
        .skip(1)
        .map(str::to_string)
        .collect()
}

#[test]
fn the_readme_quick_start_runs_as_written_twice_and_leaves_nothing() {
    require_root_and_tools(&["ip", "ping"]);
    let argv = readme_quickstart();
    assert_eq!(argv[0], "scripts/quickstart", "{argv:?}");
    let repo = common::repo();
    let bin_dir = Path::new(env!("CARGO_BIN_EXE_stitch")).parent().unwrap();
    let prefix = format!("q{}-", std::process::id() % 100_000);
    for round in 0..2 {
        let view = format!("127.0.0.1:{}", free_port());
        let out = Command::new(repo.join(&argv[0]))
            .args(&argv[1..])
            .args(["--no-build", "--prefix", &prefix, "--view", &view, "1"])
            .arg("--bin-dir")
            .arg(bin_dir)
            .current_dir(&repo)
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "round {round}: {text}");
        assert!(
            text.contains("5 packets transmitted, 5 received"),
            "round {round}: host A does not reach host B: {text}"
        );
        for app in ["fw ", "nf ", "r "] {
            assert!(
                text.lines().any(|l| l.starts_with(app)),
                "round {round}: no counters of `{app}`: {text}"
            );
        }
        assert!(
            text.contains(&format!("Graph view: http://{view}/#token=")),
            "{text}"
        );
        let left = must(&format!(
            "ip netns list | grep '^{prefix}' || true; ip link show | grep ' {prefix}' || true; ls /run/stitch | grep '^{prefix}' || true"
        ));
        assert!(left.trim().is_empty(), "round {round} left: {left}");
    }
    assert!(
        sh(&format!("ip netns list | grep -q '^{prefix}'"))
            .status
            .code()
            == Some(1)
    );
}
