//! The router's lookup (DXR ranges behind a direct table) against the prefix trie it replaced,
//! on a full table: 1M IPv4 prefixes /16–/28 and 200k IPv6 prefixes /20–/48, random hits.
//! Run: cargo bench -p stitch-apps --bench lpm

use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use ipnet::{Ipv4Net, Ipv6Net};
use prefix_trie::PrefixMap;
use stitch_apps::router::lpm::Lpm;

fn ipv4(c: &mut Criterion) {
    let mut rng = fastrand::Rng::with_seed(0x9e37_79b9_7f4a_7c15);
    let (mut routes, mut addrs) = (Vec::new(), Vec::new());
    for i in 0..1u32 << 20 {
        let len = 16 + (rng.u64(..) % 13) as u8;
        let net = (rng.u64(..) as u32 | 0x0100_0000) & (u32::MAX << (32 - len));
        routes.push((net, len, i % 64));
        if i % 256 == 0 {
            addrs.push(net | (rng.u64(..) as u32 & !(u32::MAX << (32 - len))));
        }
    }
    let lpm = Lpm::build(20, routes.iter().copied()).unwrap(); // the router's direct table at 1M routes
    let mut trie = PrefixMap::<Ipv4Net, u32>::new();
    for &(net, len, hop) in &routes {
        trie.insert(Ipv4Net::new(net.into(), len).unwrap(), hop);
    }
    let mut g = c.benchmark_group("lpm ipv4 1M");
    g.throughput(Throughput::Elements(addrs.len() as u64));
    g.bench_function("dxr", |b| {
        b.iter(|| {
            addrs
                .iter()
                .map(|&a| lpm.lookup(a).unwrap_or(0))
                .fold(0, u32::wrapping_add)
        })
    });
    g.bench_function("prefix trie", |b| {
        b.iter(|| {
            addrs
                .iter()
                .map(|&a| {
                    *trie
                        .get_lpm(&Ipv4Net::from(std::net::Ipv4Addr::from(a)))
                        .unwrap()
                        .1
                })
                .fold(0, u32::wrapping_add)
        })
    });
    g.finish();
    black_box(lpm.bytes());
}

fn ipv6(c: &mut Criterion) {
    let mut rng = fastrand::Rng::with_seed(0x2545_f491_4f6c_dd1d);
    let (mut routes, mut addrs) = (Vec::new(), Vec::new());
    for i in 0..200_000u32 {
        let len = 20 + (rng.u64(..) % 29) as u8;
        let addr = ((rng.u64(..) as u128) << 64 | rng.u64(..) as u128) >> 3 | 1 << 125;
        let net = addr & (u128::MAX << (128 - len));
        routes.push((net, len, i % 64));
        if i % 48 == 0 {
            addrs.push(net | (rng.u64(..) as u128 & !(u128::MAX << (128 - len))));
        }
    }
    let lpm = Lpm::build(20, routes.iter().copied()).unwrap();
    let mut trie = PrefixMap::<Ipv6Net, u32>::new();
    for &(net, len, hop) in &routes {
        trie.insert(Ipv6Net::new(net.into(), len).unwrap(), hop);
    }
    let mut g = c.benchmark_group("lpm ipv6 200k");
    g.throughput(Throughput::Elements(addrs.len() as u64));
    g.bench_function("dxr", |b| {
        b.iter(|| {
            addrs
                .iter()
                .map(|&a| lpm.lookup(a).unwrap_or(0))
                .fold(0, u32::wrapping_add)
        })
    });
    g.bench_function("prefix trie", |b| {
        b.iter(|| {
            addrs
                .iter()
                .map(|&a| {
                    *trie
                        .get_lpm(&Ipv6Net::from(std::net::Ipv6Addr::from(a)))
                        .unwrap()
                        .1
                })
                .fold(0, u32::wrapping_add)
        })
    });
    g.finish();
}

criterion_group!(benches, ipv4, ipv6);
criterion_main!(benches);
