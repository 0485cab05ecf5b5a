//! The test function of fine-grained NFs (docs/references.md): a signature (FNV-1a) over the first
//! 64 bytes of every packet, read-only, then forwarded.
//!
//! `stitch-nf-signature [--instance NAME | --socket PATH] PORT [PORT…]` serves all its ports from one
//! thread, woken by any of their doorbells (`client::run_all`), as that work's functions were
//! one process on one semaphore; `--thread-per-port` gives each port its own thread instead.

use stitch_nf::client::{run_all, Function, Verdict};

fn signature(bytes: &[u8]) -> u64 {
    bytes.iter().take(64).fold(0xcbf29ce484222325u64, |h, b| {
        (h ^ *b as u64).wrapping_mul(0x100000001b3)
    })
}

fn main() {
    let mut args = std::env::args().skip(1);
    // Started by Stitch (`placement: process`): its socket and port come from the environment.
    let from_env = stitch_nf::client::env_port();
    let mut socket = from_env
        .as_ref()
        .map_or_else(stitch_nf::port::default_socket, |(s, _)| s.clone());
    let mut ports: Vec<String> = from_env.map(|(_, p)| p).into_iter().collect();
    let mut thread_per_port = false;
    while let Some(a) = args.next() {
        match a.as_str() {
            "--socket" => socket = args.next().expect("--socket PATH").into(),
            // The ports of the instance started with `stitch run --name NAME`.
            "--instance" => {
                socket = stitch_nf::paths::socket_of(&args.next().expect("--instance NAME"))
            }
            "--thread-per-port" => thread_per_port = true,
            "-h" | "--help" => {
                println!("usage: stitch-nf-signature [--instance NAME | --socket PATH] [--thread-per-port] PORT...");
                return;
            }
            _ => ports.push(a),
        }
    }
    if ports.is_empty() {
        eprintln!("stitch-nf-signature: name at least one port");
        std::process::exit(2);
    }
    let attach = |port: &str| {
        Function::attach(&socket, port).unwrap_or_else(|e| {
            eprintln!("stitch-nf-signature: port {port}: {e}");
            std::process::exit(1);
        })
    };
    let serve = |functions: &mut [Function]| {
        let mut acc = 0u64;
        let r = run_all(functions, |frame| {
            acc ^= signature(frame);
            Verdict::Forward
        });
        if let Err(e) = r {
            eprintln!("stitch-nf-signature: {e}");
            std::process::exit(1);
        }
        std::hint::black_box(acc);
    };
    if !thread_per_port {
        let mut functions: Vec<Function> = ports.iter().map(|p| attach(p)).collect();
        serve(&mut functions);
        return;
    }
    let threads: Vec<_> = ports
        .into_iter()
        .map(|port| {
            let mut f = attach(&port);
            std::thread::spawn(move || serve(std::slice::from_mut(&mut f)))
        })
        .collect();
    for t in threads {
        let _ = t.join();
    }
}
