//! A libpcap filter on 64-byte frames: the machine code over a batch in one call, the same code
//! called once per frame, and libpcap's interpreter.

use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use stitch_wire::ethertype;
use stitch_wire::filter::{FrameRef, PacketFilter};

/// 256 UDP-over-IPv4 frames of 60 bytes with varying ports.
fn frames() -> Vec<Vec<u8>> {
    (0..256u16)
        .map(|i| {
            let mut f = vec![0u8; 60];
            f[12..14].copy_from_slice(&ethertype::IPV4.to_be_bytes());
            f[14] = 0x45;
            f[16..18].copy_from_slice(&46u16.to_be_bytes());
            f[23] = 17;
            f[26..30].copy_from_slice(&[10, 0, 0, 1]);
            f[30..34].copy_from_slice(&[10, 0, (i >> 8) as u8, i as u8]);
            f[34..36].copy_from_slice(&(1000 + i).to_be_bytes());
            f[36..38].copy_from_slice(&53u16.to_be_bytes());
            f
        })
        .collect()
}

/// One way of running a compiled filter on a frame.
type Matcher = fn(&PacketFilter, &[u8]) -> bool;

fn bench(c: &mut Criterion) {
    let frames = frames();
    for expression in ["tcp", "udp and dst port 53 and not net 10.0.0.0/24"] {
        let filter = PacketFilter::compile(expression).expect("filter");
        let mut g = c.benchmark_group(format!("filter `{expression}`"));
        g.throughput(Throughput::Elements(frames.len() as u64));
        let runs: [(&str, Matcher); 2] = [
            ("machine code, a call per frame", PacketFilter::matches),
            ("libpcap interpreter", PacketFilter::matches_interpreted),
        ];
        for (name, run) in runs {
            g.bench_function(name, |b| {
                b.iter(|| frames.iter().filter(|f| run(&filter, black_box(f))).count())
            });
        }
        let refs: Vec<FrameRef> = frames.iter().map(|f| FrameRef::new(f)).collect();
        let mut matched = vec![0u32; refs.len()];
        g.bench_function("machine code, one call per batch", |b| {
            b.iter(|| filter.select_frames(black_box(&refs), &mut matched))
        });
        g.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
