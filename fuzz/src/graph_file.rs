//! Graph files typed by people, placements and all: any text must give a graph or
//! line-numbered errors.
use std::path::Path;

/// One input: a panic, a hang or a fault is a finding.
pub fn run(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let mut r = stitch_core::Registry::new();
    stitch_apps::register(&mut r);
    stitch_io::register(&mut r);
    stitch_nf::register(&mut r);
    stitch_vhost::register(&mut r);
    if let Err(e) = stitch_place::PlacedGraph::parse(text, "fuzz.yaml", Path::new("."), &r) {
        assert!(!e.errors.is_empty());
        let _ = e.to_string();
    }
}
