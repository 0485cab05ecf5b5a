//! Snabb's own lwAFTR end-to-end cases (`../shared/lwaftr/snabb-e2e/`, read in place): every
//! case through `stitch lwaftr check`, each output compared record by record with the output
//! Snabb produced (timestamps, lengths, bytes). With `--compat snabb` every case must give
//! Snabb's packets; with the default (RFC behaviour) only the cases of the documented
//! differences (docs/lwaftr-snabb-differences.md) may differ.

use pcap_file::pcap::PcapReader;
use std::path::{Path, PathBuf};

/// Cases whose expected output depends on a point where Snabb departs from the RFCs, each
/// with the section of docs/lwaftr-snabb-differences.md that explains it.
const KNOWN_DIFFERENCES: &[(&str, &str)] = &[(
    "from-internet IPv4 fragmented packets found in the binding table, reversed.",
    "Reassembled IPv4 packets: identification and DF",
)];

/// The folder of the cases; `None`, said on stderr, where it is absent.
fn cases_folder() -> Option<PathBuf> {
    let dir = std::env::var_os("STITCH_SNABB_E2E")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/lwaftr/snabb-e2e")
        });
    if dir.join("cases.tsv").exists() {
        return Some(dir);
    }
    eprintln!("SKIPPED: Snabb's cases not found (set STITCH_SNABB_E2E to the snabb-e2e folder)");
    None
}

struct Case {
    name: String,
    conf: String,
    inputs: [String; 2],
    expected: [String; 2],
}

fn cases(dir: &Path) -> Vec<Case> {
    let text = std::fs::read_to_string(dir.join("cases.tsv")).unwrap();
    let file = |f: &str| {
        if f.is_empty() {
            "empty.pcap".to_string()
        } else {
            f.to_string()
        }
    };
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| {
            let f: Vec<&str> = l.split('\t').collect();
            assert_eq!(f.len(), 6, "cases.tsv: six fields a line: {l}");
            Case {
                name: f[0].to_string(),
                conf: f[1].to_string(),
                inputs: [file(f[2]), file(f[3])],
                expected: [file(f[4]), file(f[5])],
            }
        })
        .collect()
}

/// (seconds, sub-second, original length, bytes) of every record; either byte order.
fn records(path: &Path) -> Vec<(u64, u32, u32, Vec<u8>)> {
    let f = std::fs::File::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut r = PcapReader::new(f).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut out = Vec::new();
    while let Some(p) = r.next_packet() {
        let p = p.unwrap();
        out.push((
            p.timestamp.as_secs(),
            p.timestamp.subsec_nanos(),
            p.orig_len,
            p.data.to_vec(),
        ));
    }
    out
}

/// The names of the cases whose output differs from Snabb's, with what differs.
fn differing(dir: &Path, compat: &str) -> Vec<(String, String)> {
    let data = dir.join("data");
    let tmp = tempfile::tempdir().unwrap();
    let got = [tmp.path().join("o4.pcap"), tmp.path().join("o6.pcap")];
    let mut failed = Vec::new();
    let all = cases(dir);
    assert!(all.len() >= 42, "{} cases in cases.tsv", all.len());
    for c in all {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_stitch"))
            .args(["lwaftr", "check", "--compat", compat])
            .arg(data.join(&c.conf))
            .args(c.inputs.iter().map(|f| data.join(f)))
            .args(&got)
            .output()
            .unwrap();
        if !out.status.success() {
            failed.push((
                c.name,
                format!("exit: {}", String::from_utf8_lossy(&out.stderr)),
            ));
            continue;
        }
        for (side, (got, want)) in ["v4", "v6"].iter().zip(got.iter().zip(&c.expected)) {
            let (a, b) = (records(got), records(&data.join(want)));
            if a != b {
                failed.push((
                    c.name.clone(),
                    format!("{side}: {} packets, Snabb {}", a.len(), b.len()),
                ));
                break;
            }
        }
    }
    failed
}

#[test]
fn snabb_end_to_end_cases_give_snabbs_packets() {
    let Some(dir) = cases_folder() else {
        return;
    };
    let failed = differing(&dir, "snabb");
    assert!(
        failed.is_empty(),
        "cases that differ from Snabb: {failed:#?}"
    );
}

#[test]
fn by_default_only_the_documented_differences_differ() {
    let Some(dir) = cases_folder() else {
        return;
    };
    let failed: Vec<String> = differing(&dir, "rfc").into_iter().map(|(n, _)| n).collect();
    let known: Vec<String> = KNOWN_DIFFERENCES
        .iter()
        .map(|(n, _)| n.to_string())
        .collect();
    assert_eq!(failed, known);
    let doc = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/lwaftr-snabb-differences.md"),
    )
    .unwrap();
    for (_, section) in KNOWN_DIFFERENCES {
        assert!(
            doc.contains(section),
            "docs/lwaftr-snabb-differences.md lacks `{section}`"
        );
    }
}
