//! The seed's test function: a signature (FNV-1a) over the first 64 bytes of every packet,
//! read-only, then forwarded.
//!
//! `stitch-nf-signature --socket /run/stitch/nf.sock PORT [PORT…]` serves each port on its own
//! thread.

use stitch_nf::client::{Function, Verdict};

fn signature(bytes: &[u8]) -> u64 {
    bytes.iter().take(64).fold(0xcbf29ce484222325u64, |h, b| {
        (h ^ *b as u64).wrapping_mul(0x100000001b3)
    })
}

fn main() {
    let mut args = std::env::args().skip(1);
    let mut socket = stitch_nf::port::default_socket();
    let mut ports = Vec::new();
    while let Some(a) = args.next() {
        match a.as_str() {
            "--socket" => socket = args.next().expect("--socket PATH").into(),
            "-h" | "--help" => {
                println!("usage: stitch-nf-signature [--socket PATH] PORT...");
                return;
            }
            _ => ports.push(a),
        }
    }
    if ports.is_empty() {
        eprintln!("stitch-nf-signature: name at least one port");
        std::process::exit(2);
    }
    let threads: Vec<_> = ports
        .into_iter()
        .map(|port| {
            let socket = socket.clone();
            std::thread::spawn(move || {
                let mut f = Function::attach(&socket, &port).unwrap_or_else(|e| {
                    eprintln!("stitch-nf-signature: port {port}: {e}");
                    std::process::exit(1);
                });
                let mut acc = 0u64;
                let r = f.run(|frame| {
                    acc ^= signature(frame);
                    Verdict::Forward
                });
                if let Err(e) = r {
                    eprintln!("stitch-nf-signature: port {port}: {e}");
                    std::process::exit(1);
                }
                std::hint::black_box(acc);
            })
        })
        .collect();
    for t in threads {
        let _ = t.join();
    }
}
