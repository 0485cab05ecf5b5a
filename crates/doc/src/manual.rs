//! Man pages and shell completions from the command's clap definition: what `ovs-vsctl`, `ip`
//! and `tcpdump` users expect, and never out of step with `--help`.

use std::io;
use std::path::{Path, PathBuf};

/// Writes `stitch.1` and one page per command and subcommand (`stitch-run.1`,
/// `stitch-bench-nf.1`, …) into `dir`; returns the pages now in `dir`, sorted.
pub fn write_man_pages(cmd: clap::Command, dir: &Path) -> io::Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir)?;
    clap_mangen::generate_to(cmd, dir)?;
    let mut pages: Vec<PathBuf> = std::fs::read_dir(dir)?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "1"))
        .collect();
    pages.sort();
    Ok(pages)
}

/// The completion script of `shell` (`bash`, `zsh`, `fish`, `elvish`, `powershell`).
pub fn completion(mut cmd: clap::Command, shell: clap_complete::Shell) -> Vec<u8> {
    let name = cmd.get_name().to_string();
    let mut out = Vec::new();
    clap_complete::generate(shell, &mut cmd, name, &mut out);
    out
}
