//! Frames from either side of the lwAFTR (first byte: 0 internet, 1 B4s; the rest: the frame)
//! and configuration texts: every bad input is counted or refused, never a panic.
use std::cell::RefCell;
use std::path::Path;
use stitch_core::app::{Counters, DynApp};
use stitch_core::link::{link, Consumer, Producer};
use stitch_core::{pool, AppContext, Io, Registry};

const CONF: &str = include_str!("../../crates/apps/tests/data/icmp_on_fail.conf");

struct Rig {
    app: Box<dyn DynApp>,
    io: Io,
    inputs: [Producer; 2],
    outputs: [Consumer; 2],
}

thread_local! {
    static RIG: RefCell<Rig> = RefCell::new({
        let path = std::env::temp_dir().join("stitch-fuzz-lwaftr.conf");
        std::fs::write(&path, CONF).unwrap();
        let mut r = Registry::new();
        stitch_apps::register(&mut r);
        let t = r.get("lwaftr").unwrap();
        let parsed = t.parse(&serde_json::json!({ "conf": path })).map_err(|e| e.message).unwrap();
        let mut ctx = AppContext::new("aftr", Path::new("."), Counters::default());
        let app = t.build(parsed, &mut ctx).unwrap();
        let (p4, c4) = link(64);
        let (p6, c6) = link(64);
        let (o4, r4) = link(256);
        let (o6, r6) = link(256);
        let io = Io::new(
            vec![("v4".into(), c4), ("v6".into(), c6)],
            vec![("v4".into(), o4), ("v6".into(), o6)],
        );
        Rig { app, io, inputs: [p4, p6], outputs: [r4, r6] }
    });
}

/// One input: a panic, a hang or a fault is a finding.
pub fn run(data: &[u8]) {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = stitch_apps::lwaftr::config::parse(text);
    }
    let Some((&side, frame)) = data.split_first() else {
        return;
    };
    RIG.with(|rig| {
        let mut rig = rig.borrow_mut();
        let Some(mut p) = pool::alloc() else { return };
        if p.set_data(frame).is_err() {
            return;
        }
        rig.inputs[(side & 1) as usize].transmit(p);
        let Rig {
            app, io, outputs, ..
        } = &mut *rig;
        app.push(io);
        for o in outputs.iter_mut() {
            o.drain().for_each(drop);
        }
    });
}
