//! Micro-benchmarks of the two things every packet touches: links and the pool.
//! Run: cargo bench -p stitch-core --bench ring_pool

use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use stitch_core::link::link;
use stitch_core::pool;

fn ring(c: &mut Criterion) {
    let mut g = c.benchmark_group("link");
    g.throughput(Throughput::Elements(32));
    // One packet at a time: transmit then receive.
    let (mut tx, mut rx) = link(1024);
    let mut held: Vec<_> = (0..32).map(|_| pool::alloc().unwrap()).collect();
    g.bench_function("transmit+receive x32", |b| {
        b.iter(|| {
            for p in held.drain(..) {
                tx.transmit(p);
            }
            while let Some(p) = rx.receive() {
                held.push(black_box(p));
            }
        })
    });
    // Batch moves between two links: the forwarder's hot path.
    let (mut atx, mut arx) = link(1024);
    let (mut btx, mut brx) = link(1024);
    for p in held.drain(..) {
        atx.transmit(p);
    }
    // 32 packets each way: 64 ring moves per iteration.
    g.throughput(Throughput::Elements(64));
    g.bench_function("forward_to 32 packets a->b and back", |b| {
        b.iter(|| {
            black_box(arx.forward_to(&mut btx));
            black_box(brx.forward_to(&mut atx));
        })
    });
    g.finish();
}

fn pools(c: &mut Criterion) {
    let mut g = c.benchmark_group("pool");
    g.throughput(Throughput::Elements(1));
    g.bench_function("alloc+free", |b| b.iter(|| drop(black_box(pool::alloc()))));
    g.throughput(Throughput::Elements(32));
    let mut v = Vec::with_capacity(32);
    g.bench_function("alloc 32 then free 32", |b| {
        b.iter(|| {
            for _ in 0..32 {
                v.push(pool::alloc().unwrap());
            }
            v.clear();
        })
    });
    g.bench_function("alloc_batch 32 then free_batch 32", |b| {
        b.iter(|| {
            pool::alloc_batch(32, &mut v);
            pool::free_batch(v.drain(..));
        })
    });
    g.finish();
}

criterion_group!(benches, ring, pools);
criterion_main!(benches);
