//! Every input kept in `fuzz/corpus/<target>/` (what the fuzzer found, minimised by `cargo fuzz
//! cmin`) and in `fuzz/regressions/<target>/` (inputs that once found a bug, named after it,
//! which no minimisation removes) replayed through its target, as libFuzzer would run them
//! (`cargo +nightly fuzz run T corpus/T -- -runs=0`), without nightly Rust.

use std::path::Path;

#[test]
fn every_target_has_a_corpus_and_every_input_passes() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus");
    let mut replayed = Vec::new();
    for (name, run) in stitch_fuzz::TARGETS {
        let dir = root.join(name);
        let mut inputs: Vec<_> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e} (every target keeps a corpus)", dir.display()))
            .map(|e| e.unwrap().path())
            .collect();
        assert!(!inputs.is_empty(), "{}: an empty corpus", dir.display());
        let regressions = root.join("../regressions").join(name);
        if let Ok(found) = std::fs::read_dir(&regressions) {
            inputs.extend(found.map(|e| e.unwrap().path()));
        }
        inputs.sort();
        for input in &inputs {
            let data = std::fs::read(input).unwrap();
            // A panic names the input: rerun it with `cargo +nightly fuzz run T that-file`.
            eprintln!("{}", input.display());
            run(&data);
        }
        replayed.push(format!("{name}: {}", inputs.len()));
    }
    eprintln!("replayed {}", replayed.join(", "));
}
