//! The references generated from the code are what the code says: `docs/apps.md` is what
//! `stitch apps --doc` prints, the README's tables name every command and app type, the man
//! pages render without a warning, and the completions complete in bash, zsh and fish.

mod common;

use common::{must, sh};
use std::process::Command;

fn stitch() -> &'static str {
    env!("CARGO_BIN_EXE_stitch")
}

fn repo_file(name: &str) -> String {
    let path = common::repo().join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The names a `--help` lists under "Commands:" (without `help`).
fn commands_of(args: &[&str]) -> Vec<String> {
    let out = Command::new(stitch())
        .args(args)
        .arg("--help")
        .output()
        .unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    text.lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .map(str::to_string)
        .collect()
}

#[test]
fn the_apps_reference_is_what_the_code_says() {
    let out = Command::new(stitch())
        .args(["apps", "--doc"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "stitch apps --doc: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let generated = String::from_utf8(out.stdout).unwrap();
    let checked_in = repo_file("docs/apps.md");
    if generated != checked_in {
        let first = generated
            .lines()
            .zip(checked_in.lines())
            .position(|(a, b)| a != b)
            .map_or("at the end".to_string(), |n| format!("from line {}", n + 1));
        panic!(
            "docs/apps.md is not what the code says ({first}): run `cargo run -q -p stitch -- apps --doc > docs/apps.md`"
        );
    }
    // Every type `stitch apps` lists has its section.
    let list = must(&format!("{} apps", stitch()));
    for t in list.lines().filter_map(|l| l.split_whitespace().next()) {
        assert!(
            generated.contains(&format!("\n## `{t}`\n")),
            "{t} has no section"
        );
    }
}

#[test]
fn the_readme_names_every_command_bench_and_app_type() {
    let readme = repo_file("README.md");
    let mut missing = Vec::new();
    for c in commands_of(&[]) {
        if !readme.contains(&format!("| `stitch {c}")) {
            missing.push(format!("command `stitch {c}`"));
        }
    }
    for b in commands_of(&["bench"]) {
        let named = readme.contains(&format!("`stitch bench {b} "))
            || readme.contains(&format!("`stitch bench {b}`"));
        if !named {
            missing.push(format!("benchmark `stitch bench {b}`"));
        }
    }
    let list = must(&format!("{} apps", stitch()));
    for t in list.lines().filter_map(|l| l.split_whitespace().next()) {
        if !readme.contains(&format!("\n| `{t}` |")) {
            missing.push(format!("app type `{t}`"));
        }
    }
    assert!(
        missing.is_empty(),
        "the README's tables leave out: {}",
        missing.join(", ")
    );
}

#[test]
fn every_command_has_a_man_page_that_renders_without_a_warning() {
    let dir = tempfile::tempdir().unwrap();
    let out = must(&format!("{} man --out {}", stitch(), dir.path().display()));
    assert!(out.contains("man pages in"), "{out}");
    let mut want = vec!["stitch.1".to_string()];
    want.extend(commands_of(&[]).iter().map(|c| format!("stitch-{c}.1")));
    want.extend(
        commands_of(&["bench"])
            .iter()
            .map(|c| format!("stitch-bench-{c}.1")),
    );
    for page in &want {
        let path = dir.path().join(page);
        assert!(path.exists(), "no man page {page}");
        // -k: preconv, as man(1) runs it (the pages hold UTF-8); -ww: every warning.
        let o = Command::new("groff")
            .args(["-k", "-man", "-Tutf8", "-ww", "-z"])
            .arg(&path)
            .output()
            .unwrap();
        assert!(
            o.status.success() && o.stderr.is_empty(),
            "{page}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
    let run = must(&format!(
        "MANWIDTH=100 man -l {} 2>&1",
        dir.path().join("stitch-run.1").display()
    ));
    assert!(run.contains("--duration"), "{run}");
}

#[test]
fn the_completions_complete_commands_and_options_in_bash_zsh_and_fish() {
    let dir = tempfile::tempdir().unwrap();
    let script = |shell: &str| {
        let path = dir.path().join(format!("stitch.{shell}"));
        let out = Command::new(stitch())
            .args(["completions", shell])
            .output()
            .unwrap();
        assert!(out.status.success(), "completions {shell}");
        std::fs::write(&path, out.stdout).unwrap();
        path
    };
    let bash = script("bash");
    let words = |line: &str| {
        // As bash calls a completion function: the words so far (the last one being typed,
        // perhaps empty), its index, then the command, that word and the one before it.
        let words: Vec<&str> = line.split(' ').collect();
        let last = words.len() - 1;
        let quoted: Vec<String> = words.iter().map(|w| format!("\"{w}\"")).collect();
        must(&format!(
            "bash -c 'source {}; COMP_WORDS=({}); COMP_CWORD={last}; _stitch stitch {} {}; echo \"${{COMPREPLY[@]}}\"'",
            bash.display(),
            quoted.join(" "),
            quoted[last],
            quoted[last - 1],
        ))
    };
    assert_eq!(words("stitch ru").trim(), "run");
    assert_eq!(words("stitch run --dur").trim(), "--duration");
    assert!(words("stitch bench ").contains("shards"));

    let fish = script("fish");
    let complete = |line: &str| {
        must(&format!(
            "fish -c 'source {}; complete -C \"{line}\"'",
            fish.display()
        ))
    };
    assert!(complete("stitch ru").starts_with("run\t"));
    assert!(complete("stitch run --dur").starts_with("--duration\t"));

    let zsh = script("zsh");
    let o = sh(&format!("zsh -n {}", zsh.display()));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    std::fs::rename(&zsh, dir.path().join("_stitch")).unwrap();
    let registered = must(&format!(
        "zsh -fc 'fpath=({} $fpath); autoload -U compinit; compinit -u -d {}/zcompdump; print -r -- ${{_comps[stitch]}}'",
        dir.path().display(),
        dir.path().display()
    ));
    assert_eq!(registered.trim(), "_stitch");
}
