//! Compiles the data plane's C programs (`bpf/*.bpf.c`) with clang into one BPF object that
//! `src/datapath.rs` embeds. Uses only UAPI headers (no vmlinux.h): the programs read
//! `struct __sk_buff` and packet bytes, which are stable ABI, so the object loads on any
//! kernel with the helpers it calls.

use libbpf_cargo::SkeletonBuilder;
use std::path::PathBuf;

fn main() {
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("OUT_DIR"));
    let arch = std::env::var("CARGO_CFG_TARGET_ARCH").expect("target arch");
    // <linux/types.h> includes <asm/types.h>, which Debian keeps under the multiarch folder.
    let multiarch = format!("-I/usr/include/{arch}-linux-gnu");
    let source = "bpf/stitch.bpf.c";
    let result = SkeletonBuilder::new()
        .source(source)
        .obj(out.join("stitch.bpf.o"))
        .clang_args([multiarch.as_str(), "-Wall", "-Werror"])
        .build();
    if let Err(e) = result {
        panic!(
            "compiling {source} failed: {e:#}\n(it needs clang and the kernel UAPI headers: \
             `apt install clang linux-libc-dev`, which scripts/install-deps does)"
        );
    }
    println!("cargo:rerun-if-changed=bpf");
}
