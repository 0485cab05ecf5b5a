//! The lwAFTR, PCAP in → PCAP out through `stitch lwaftr check`, each output decoded by
//! tshark: encapsulation and decapsulation (RFC 7596/7597 port sets), every drop reason, ICMP
//! errors both ways, hairpinning, ARP/NDP/ping, VLAN tags.

mod common;
use common::frames::*;
use common::*;
use std::path::Path;
use std::time::Duration;

const EXT_MAC: [u8; 6] = [0x12; 6];
const EXT_HOP: [u8; 6] = [0x68; 6];
const INT_MAC: [u8; 6] = [0x22; 6];
const INT_HOP: [u8; 6] = [0x44; 6];
const BR: &str = "8:9:a:b:c:d:e:f";
const B4_A: &str = "127:2:3:4:5:6:7:128";
const B4_B: &str = "127:22:33:44:55:66:77:128";
const B4_C: &str = "127:10:20:30:40:50:60:128";
const B4_D: &str = "127:14:25:36:47:58:69:128";

/// The test's configuration in Snabb's format; `extra_ext`/`extra_int` go into the policy
/// blocks, `vlan` adds tags on both sides.
fn conf(extra_ext: &str, extra_int: &str, vlan: bool) -> String {
    let (v4tag, v6tag) = if vlan {
        ("vlan-tag 100;", "vlan-tag 200;")
    } else {
        ("", "")
    };
    format!(
        "// lwAFTR test configuration
softwire-config {{
  binding-table {{
    softwire {{ ipv4 178.79.150.233; psid 80; b4-ipv6 {B4_A}; br-address {BR}; port-set {{ psid-length 16; }} }}
    softwire {{ ipv4 178.79.150.15; psid 0; b4-ipv6 {B4_B}; br-address {BR}; port-set {{ psid-length 4; }} }}
    softwire {{ ipv4 178.79.150.15; psid 1; b4-ipv6 {B4_B}; br-address {BR}; port-set {{ psid-length 4; }} }}
    softwire {{ ipv4 178.79.150.1; psid 0; b4-ipv6 {B4_C}; br-address {BR}; port-set {{ psid-length 0; }} }}
    softwire {{ ipv4 178.79.150.50; psid 1; b4-ipv6 {B4_D}; br-address {BR};
                port-set {{ psid-length 4; reserved-ports-bit-count 6; }} }}
  }}
  external-interface {{ {extra_ext} }}
  internal-interface {{ {extra_int} }}
  instance {{
    device test;
    queue {{
      id 0;
      external-interface {{ ip 10.10.10.10; mac 12:12:12:12:12:12; {v4tag} next-hop {{ mac 68:68:68:68:68:68; }} }}
      internal-interface {{ ip {BR}; mac 22:22:22:22:22:22; {v6tag} next-hop {{ mac 44:44:44:44:44:44; }} }}
    }}
  }}
}}
"
    )
}

fn from_internet(ip: Vec<u8>) -> Vec<u8> {
    eth(EXT_MAC, EXT_HOP, 0x0800, None, &ip)
}
fn from_b4(src: &str, dst: &str, inner: Vec<u8>) -> Vec<u8> {
    eth(INT_MAC, INT_HOP, 0x86dd, None, &ip6(src, dst, 4, &inner))
}

/// Output of one `stitch lwaftr check` run.
struct Out {
    dir: tempfile::TempDir,
    counters: serde_json::Value,
}

impl Out {
    fn v4(&self, fields: &[&str]) -> Vec<String> {
        tshark_fields(&self.dir.path().join("out4.pcap"), fields)
    }
    fn v6(&self, fields: &[&str]) -> Vec<String> {
        tshark_fields(&self.dir.path().join("out6.pcap"), fields)
    }
    fn counter(&self, name: &str) -> u64 {
        self.counters[name].as_u64().unwrap_or(0)
    }
}

fn check(conf_text: &str, in4: &[Vec<u8>], in6: &[Vec<u8>]) -> Out {
    let dir = tempfile::tempdir().unwrap();
    let p = |n: &str| dir.path().join(n);
    std::fs::write(p("lwaftr.conf"), conf_text).unwrap();
    write(&p("in4.pcap"), in4);
    write(&p("in6.pcap"), in6);
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_stitch"))
        .args(["lwaftr", "check", "--counters"])
        .args([
            p("lwaftr.conf"),
            p("in4.pcap"),
            p("in6.pcap"),
            p("out4.pcap"),
            p("out6.pcap"),
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Out {
        counters: serde_json::from_slice(&out.stdout).unwrap(),
        dir,
    }
}

fn default_conf() -> String {
    conf("", "", false)
}

#[test]
fn the_snabb_benchmark_packets_cross_in_both_directions() {
    let d = Path::new(env!("CARGO_MANIFEST_DIR")).join("../apps/tests/data");
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_stitch"))
        .args(["lwaftr", "check", "--counters"])
        .arg(d.join("icmp_on_fail.conf"))
        .arg(d.join("ipv4-0550.pcap"))
        .arg(d.join("ipv6-0550.pcap"))
        .arg(dir.path().join("o4.pcap"))
        .arg(dir.path().join("o6.pcap"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v6 = tshark_fields(
        &dir.path().join("o6.pcap"),
        &["ipv6.dst", "ipv6.nxt", "udp.dstport"],
    );
    assert_eq!(v6, ["127:2:3:4:5:6:7:128\t4\t80"]);
    let v4 = tshark_fields(
        &dir.path().join("o4.pcap"),
        &["eth.dst", "ip.src", "udp.srcport"],
    );
    assert_eq!(v4, ["68:68:68:68:68:68\t178.79.150.233\t80"]);
    assert_eq!(capinfos_count(&dir.path().join("o4.pcap")), 1);
}

#[test]
fn encapsulation_follows_the_port_sets() {
    let i = |dst, port, proto: u8| {
        let l4 = if proto == 6 {
            tcp(40000, port)
        } else {
            udp(40000, port, 20)
        };
        from_internet(ip4(plain("1.2.3.4", dst, proto), &l4))
    };
    let out = check(
        &default_conf(),
        &[
            i("178.79.150.233", 80, 17), // psid-length 16: exactly port 80 → B4 A
            i("178.79.150.15", 5000, 6), // psid-length 4: 5000 >> 12 = PSID 1 → B4 B
            i("178.79.150.15", 100, 17), // PSID 0 → B4 B
            i("178.79.150.1", 9, 17),    // psid-length 0: every port → B4 C
            i("178.79.150.50", 64, 17),  // reserved bits 6, k 4: (64 >> 6) & 15 = 1 → B4 D
        ],
        &[],
    );
    assert_eq!(
        out.v6(&[
            "eth.src",
            "eth.dst",
            "ipv6.src",
            "ipv6.dst",
            "ipv6.nxt",
            "ipv6.hlim",
            "ip.ttl",
            "ip.checksum.status"
        ]),
        [
            format!("22:22:22:22:22:22\t44:44:44:44:44:44\t{BR}\t{B4_A}\t4\t255\t63\t2"),
            format!("22:22:22:22:22:22\t44:44:44:44:44:44\t{BR}\t{B4_B}\t4\t255\t63\t2"),
            format!("22:22:22:22:22:22\t44:44:44:44:44:44\t{BR}\t{B4_B}\t4\t255\t63\t2"),
            format!("22:22:22:22:22:22\t44:44:44:44:44:44\t{BR}\t{B4_C}\t4\t255\t63\t2"),
            format!("22:22:22:22:22:22\t44:44:44:44:44:44\t{BR}\t{B4_D}\t4\t255\t63\t2"),
        ]
    );
    assert_eq!(out.counter("encapsulated"), 5);
}

#[test]
fn traffic_class_comes_from_the_tos_and_payload_length_is_exact() {
    let ip = ip4(
        Ip4 {
            tos: 0xb8,
            ..plain("1.2.3.4", "178.79.150.233", 17)
        },
        &udp(53, 80, 3),
    );
    let out = check(&default_conf(), &[from_internet(ip)], &[]);
    assert_eq!(
        out.v6(&["ipv6.tclass", "ipv6.plen", "ip.dsfield", "frame.len"]),
        ["0x000000b8\t31\t0xb8\t85"]
    );
}

/// A table of `n` softwires, 16 to an IPv4 address (PSID length 4), each with its own B4; the
/// addresses and B4s are [`large_table_ipv4`] and [`large_table_b4`] of the softwire's number.
fn large_table_conf(n: usize) -> String {
    let mut softwires = String::new();
    for i in 0..n {
        softwires += &format!(
            "    softwire {{ ipv4 {}; psid {}; b4-ipv6 {}; br-address {BR}; port-set {{ psid-length 4; }} }}\n",
            large_table_ipv4(i),
            i % 16,
            large_table_b4(i)
        );
    }
    default_conf().replace(
        "  binding-table {\n",
        &format!("  binding-table {{\n{softwires}"),
    )
}
fn large_table_ipv4(i: usize) -> String {
    let a = i / 16;
    format!("100.{}.{}.{}", 64 + (a >> 16), (a >> 8) & 255, a & 255)
}
fn large_table_b4(i: usize) -> String {
    // No two zero groups in a row: tshark prints the address as written here.
    format!("127:1:2:3:4:{:x}:{:x}:1", (i >> 16) + 1, i & 0xffff)
}

#[test]
fn a_table_large_enough_to_be_fetched_ahead_gives_every_frame_its_own_softwire() {
    // 20 000 softwires (over 256 KiB: lookups are fetched a few frames ahead of the one handled)
    // and batches of 300 frames per side in a pseudo-random order, every 7th to an address the
    // table does not know, so that known and unknown keys interleave across the look-ahead.
    const SOFTWIRES: usize = 20_000;
    let leak = |s: String| -> &'static str { s.leak() };
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % SOFTWIRES as u64) as usize
    };
    let (mut in4, mut in6, mut want6, mut want4) = (vec![], vec![], vec![], vec![]);
    for k in 0..300 {
        let i = next();
        let port = (((i % 16) << 12) | (1000 + k)) as u16;
        if k % 7 == 3 {
            let unknown = leak(format!("100.200.{}.{}", k >> 8, k & 255));
            in4.push(from_internet(ip4(
                plain("1.2.3.4", unknown, 17),
                &udp(443, port, 20),
            )));
        } else {
            let dst = leak(large_table_ipv4(i));
            in4.push(from_internet(ip4(
                plain("1.2.3.4", dst, 17),
                &udp(443, port, 20),
            )));
            want6.push(format!("{}\t{port}", large_table_b4(i)));
        }
        let j = next();
        let sport = (((j % 16) << 12) | (2000 + k)) as u16;
        let src = leak(large_table_ipv4(j));
        let inner = ip4(plain(src, "1.2.3.4", 17), &udp(sport, 443, 20));
        // Every 5th comes from another softwire's B4: a source mismatch.
        let b4 = large_table_b4(if k % 5 == 1 { (j + 1) % SOFTWIRES } else { j });
        in6.push(from_b4(&b4, BR, inner));
        if k % 5 != 1 {
            want4.push(format!("{src}\t{sport}"));
        }
    }
    let out = check(&large_table_conf(SOFTWIRES), &in4, &in6);
    let got6: Vec<String> = out
        .v6(&["ipv6.dst", "udp.dstport", "icmpv6.type"])
        .into_iter()
        .filter(|l| !l.ends_with("\t1")) // the mismatches' ICMPv6 errors
        .map(|l| l.trim_end().to_string())
        .collect();
    assert_eq!(got6, want6);
    let got4: Vec<String> = out
        .v4(&["ip.src", "udp.srcport", "icmp.type"])
        .into_iter()
        .filter(|l| !l.ends_with("\t3")) // the unknown addresses' host unreachables
        .map(|l| l.trim_end().to_string())
        .collect();
    assert_eq!(got4, want4);
    assert_eq!(out.counter("encapsulated"), want6.len() as u64);
    assert_eq!(out.counter("decapsulated"), want4.len() as u64);
    assert_eq!(out.counter("source_mismatch_drops"), 60);
}

#[test]
fn unbound_destinations_are_dropped_with_icmp_host_unreachable() {
    let sent = ip4(plain("1.2.3.4", "178.79.150.233", 17), &udp(40000, 81, 20));
    let out = check(&default_conf(), &[from_internet(sent.clone())], &[]);
    assert_eq!(out.counter("no_softwire_drops"), 1);
    assert_eq!(
        out.v4(&[
            "eth.dst",
            "ip.src",
            "ip.dst",
            "icmp.type",
            "icmp.code",
            "icmp.checksum.status",
            "udp.dstport"
        ]),
        ["68:68:68:68:68:68\t10.10.10.10,1.2.3.4\t1.2.3.4,178.79.150.233\t3\t1\t1\t81"]
    );
    // Reserved ports of a port set belong to nobody.
    let out = check(
        &default_conf(),
        &[from_internet(ip4(
            plain("1.2.3.4", "178.79.150.50", 17),
            &udp(1, 63, 0),
        ))],
        &[],
    );
    assert_eq!(out.counter("no_softwire_drops"), 1);
    // Without generate-icmp-errors, silently.
    let out = check(
        &conf("generate-icmp-errors false;", "", false),
        &[from_internet(sent)],
        &[],
    );
    assert_eq!(out.counter("no_softwire_drops"), 1);
    assert!(out.v4(&["frame.len"]).is_empty());
}

#[test]
fn ttl_expiry_sends_time_exceeded() {
    let ip = ip4(
        Ip4 {
            ttl: 1,
            ..plain("1.2.3.4", "178.79.150.233", 17)
        },
        &udp(40000, 80, 10),
    );
    let out = check(&default_conf(), &[from_internet(ip)], &[]);
    assert_eq!(out.counter("ttl_expired_drops"), 1);
    assert_eq!(
        out.v4(&[
            "ip.src",
            "ip.dst",
            "icmp.type",
            "icmp.code",
            "icmp.checksum.status"
        ]),
        // The outer header, then the quoted one.
        ["10.10.10.10,1.2.3.4\t1.2.3.4,178.79.150.233\t11\t0\t1"]
    );
    assert!(out.v6(&["frame.len"]).is_empty());
}

#[test]
fn too_big_with_dont_fragment_gets_fragmentation_needed() {
    let ip = ip4(
        Ip4 {
            flags_frag: 0x4000,
            ..plain("1.2.3.4", "178.79.150.233", 17)
        },
        &udp(40000, 80, 1450),
    );
    let out = check(&default_conf(), &[from_internet(ip)], &[]);
    assert_eq!(out.counter("too_big_drops"), 1);
    let icmp = out.v4(&["icmp.type", "icmp.code", "icmp.mtu", "frame.len", "ip.ttl"]);
    assert_eq!(icmp.len(), 1);
    let f: Vec<&str> = icmp[0].split('\t').collect();
    // Snabb's default internal MTU is 1500: 1460 bytes of IPv4 fit behind the IPv6 header.
    assert_eq!(&f[..3], ["3", "4", "1460"]);
    // The error leaves with TTL 255; the quoted packet as it would have been forwarded.
    assert_eq!(f[4], "255,63");
    assert!(
        f[3].parse::<usize>().unwrap() <= 576 + 14,
        "ICMP error within 576 bytes"
    );
}

#[test]
fn lone_fragments_and_malformed_packets_go_nowhere() {
    let frag = ip4(
        Ip4 {
            flags_frag: 0x2000,
            ..plain("1.2.3.4", "178.79.150.233", 17)
        },
        &udp(40000, 80, 100),
    );
    let mut truncated = from_internet(ip4(
        plain("1.2.3.4", "178.79.150.233", 17),
        &udp(1, 80, 100),
    ));
    truncated.truncate(60);
    let mut bad_version = ip4(plain("1.2.3.4", "178.79.150.233", 17), &udp(1, 80, 10));
    bad_version[0] = 0x65;
    let ipv6_on_v4 = eth(EXT_MAC, EXT_HOP, 0x86dd, None, &ip6(B4_A, BR, 17, &[0; 8]));
    let out = check(
        &default_conf(),
        &[
            from_internet(frag),
            truncated,
            from_internet(bad_version),
            ipv6_on_v4,
        ],
        &[],
    );
    // A lone first fragment waits for the rest (and expires); nothing leaves.
    assert_eq!(out.counter("reassembled"), 0);
    assert_eq!(out.counter("malformed_drops"), 2);
    assert_eq!(out.counter("wrong_ethertype_drops"), 1);
    assert!(out.v4(&["frame.len"]).is_empty() && out.v6(&["frame.len"]).is_empty());
}

#[test]
fn icmp_from_the_internet_follows_policy_and_finds_its_softwire() {
    // Echo request: the identifier is the port.
    let echo = ip4(
        plain("1.2.3.4", "178.79.150.15", 1),
        &icmp(8, 0, [0x10, 0x00, 0, 1], b"ping"),
    );
    // An error about a packet the customer sent from 178.79.150.233:80.
    let quoted = ip4(plain("178.79.150.233", "1.2.3.4", 17), &udp(80, 5555, 8));
    let error = ip4(
        plain("9.9.9.9", "178.79.150.233", 1),
        &icmp(3, 3, [0; 4], &quoted),
    );
    let out = check(
        &default_conf(),
        &[from_internet(echo.clone()), from_internet(error.clone())],
        &[],
    );
    assert_eq!(
        out.v6(&["ipv6.dst", "icmp.type"]),
        [format!("{B4_B}\t8"), format!("{B4_A}\t3")]
    );
    // allow-incoming-icmp false: both dropped.
    let out = check(
        &conf("allow-incoming-icmp false;", "", false),
        &[from_internet(echo), from_internet(error)],
        &[],
    );
    assert_eq!(out.counter("icmp_policy_drops"), 2);
}

#[test]
fn ping_and_arp_for_the_external_address_are_answered() {
    let ping = ip4(
        plain("1.2.3.4", "10.10.10.10", 1),
        &icmp(8, 0, [0, 7, 0, 1], b"hello"),
    );
    let mut arp = vec![0, 1, 8, 0, 6, 4, 0, 1];
    arp.extend_from_slice(&EXT_HOP);
    arp.extend_from_slice(&v4("10.10.10.1"));
    arp.extend_from_slice(&[0; 6]);
    arp.extend_from_slice(&v4("10.10.10.10"));
    let out = check(
        &default_conf(),
        &[
            from_internet(ping),
            eth([0xff; 6], EXT_HOP, 0x0806, None, &arp),
        ],
        &[],
    );
    assert_eq!(
        out.v4(&[
            "ip.src",
            "ip.dst",
            "icmp.type",
            "icmp.checksum.status",
            "arp.opcode",
            "arp.src.hw_mac",
            "arp.src.proto_ipv4"
        ]),
        [
            "10.10.10.10\t1.2.3.4\t0\t1\t\t\t".to_string(),
            "\t\t\t\t2\t12:12:12:12:12:12\t10.10.10.10".to_string(),
        ]
    );
    assert_eq!(
        (out.counter("echo_replies"), out.counter("arp_replies")),
        (1, 1)
    );
}

#[test]
fn decapsulation_checks_the_softwire_of_the_source() {
    let inner = |src, sport| ip4(plain(src, "1.2.3.4", 17), &udp(sport, 443, 20));
    let out = check(
        &default_conf(),
        &[],
        &[
            from_b4(B4_A, BR, inner("178.79.150.233", 80)), // bound: out on v4
            from_b4(B4_B, BR, inner("178.79.150.15", 4097)), // PSID 1 of B4 B: out
            from_b4(B4_C, BR, inner("178.79.150.233", 80)), // wrong B4 for that port
            from_b4(B4_A, BR, inner("178.79.150.233", 81)), // port outside its set
            from_b4(B4_A, "1e:2:2:2:2:2:2:af", inner("178.79.150.233", 80)), // unknown BR
        ],
    );
    assert_eq!(
        out.v4(&["eth.src", "eth.dst", "ip.src", "udp.srcport", "ip.ttl"]),
        [
            "12:12:12:12:12:12\t68:68:68:68:68:68\t178.79.150.233\t80\t64",
            "12:12:12:12:12:12\t68:68:68:68:68:68\t178.79.150.15\t4097\t64",
        ]
    );
    assert_eq!(out.counter("decapsulated"), 2);
    assert_eq!(out.counter("source_mismatch_drops"), 2);
    assert_eq!(out.counter("not_for_us_drops"), 1);
    // Each mismatch gets ICMPv6 1/5 (source address failed policy) back to its B4.
    assert_eq!(
        out.v6(&[
            "ipv6.src",
            "ipv6.dst",
            "icmpv6.type",
            "icmpv6.code",
            "icmpv6.checksum.status"
        ]),
        // tshark lists the outer header, then the quoted packet's.
        [
            format!("{BR},{B4_C}\t{B4_C},{BR}\t1\t5\t1"),
            format!("{BR},{B4_A}\t{B4_A},{BR}\t1\t5\t1")
        ]
    );
}

#[test]
fn hairpinning_reencapsulates_toward_the_other_b4() {
    let inner = ip4(
        plain("178.79.150.233", "178.79.150.15", 17),
        &udp(80, 200, 20),
    );
    let out = check(&default_conf(), &[], &[from_b4(B4_A, BR, inner.clone())]);
    assert_eq!(
        out.v6(&["ipv6.src", "ipv6.dst", "ip.src", "ip.dst", "ip.ttl"]),
        [format!("{BR}\t{B4_B}\t178.79.150.233\t178.79.150.15\t63")]
    );
    assert_eq!(out.counter("hairpinned"), 1);
    assert!(out.v4(&["frame.len"]).is_empty());
    // Without hairpinning it leaves toward the internet.
    let out = check(
        &conf("", "hairpinning false;", false),
        &[],
        &[from_b4(B4_A, BR, inner)],
    );
    assert_eq!(out.v4(&["ip.dst"]), ["178.79.150.15"]);
    assert_eq!(out.counter("hairpinned"), 0);
}

#[test]
fn neighbour_discovery_and_ping_on_the_internal_side() {
    let mut ns = vec![135, 0, 0, 0, 0, 0, 0, 0];
    ns.extend_from_slice(&v6(BR));
    ns.extend_from_slice(&[1, 1]);
    ns.extend_from_slice(&INT_HOP);
    let mut solicitation = icmp6("fe80::44", "ff02::1:ff0e:f", &ns);
    // RFC 4861 §7.1.1: a solicitation that could have crossed a router (hop limit below
    // 255) is not answered.
    let forwarded = eth(
        [0x33, 0x33, 0xff, 0x0e, 0x00, 0x0f],
        INT_HOP,
        0x86dd,
        None,
        &solicitation,
    );
    solicitation[7] = 255;
    let ns = eth(
        [0x33, 0x33, 0xff, 0x0e, 0x00, 0x0f],
        INT_HOP,
        0x86dd,
        None,
        &solicitation,
    );
    let ping = eth(
        INT_MAC,
        INT_HOP,
        0x86dd,
        None,
        &icmp6(B4_A, BR, &[128, 0, 0, 0, 0, 9, 0, 1, 1, 2, 3]),
    );
    let err = eth(
        INT_MAC,
        INT_HOP,
        0x86dd,
        None,
        &icmp6(B4_A, BR, &[1, 4, 0, 0, 0, 0, 0, 0]),
    );
    let out = check(&default_conf(), &[], &[forwarded, ns, ping, err]);
    assert_eq!(
        out.v6(&[
            "ipv6.dst",
            "icmpv6.type",
            "icmpv6.checksum.status",
            "icmpv6.nd.na.target_address",
            "icmpv6.opt.linkaddr",
            "icmpv6.nd.na.flag.r",
            "icmpv6.nd.na.flag.s",
            "ipv6.hlim",
        ]),
        [
            format!("fe80::44\t136\t1\t{BR}\t22:22:22:22:22:22\t1\t1\t255"),
            format!("{B4_A}\t129\t1\t\t\t\t\t64"),
        ]
    );
    assert_eq!(out.counter("malformed_drops"), 1);
    assert_eq!(out.counter("icmpv6_error_drops"), 1);
}

#[test]
fn vlan_tags_are_required_and_written_on_both_sides() {
    let ip = ip4(plain("1.2.3.4", "178.79.150.233", 17), &udp(40000, 80, 10));
    let tagged = eth(EXT_MAC, EXT_HOP, 0x0800, Some(100), &ip);
    let wrong = eth(EXT_MAC, EXT_HOP, 0x0800, Some(101), &ip);
    let untagged = from_internet(ip);
    let back = eth(
        INT_MAC,
        INT_HOP,
        0x86dd,
        Some(200),
        &ip6(
            B4_A,
            BR,
            4,
            &ip4(plain("178.79.150.233", "1.2.3.4", 17), &udp(80, 443, 0)),
        ),
    );
    let out = check(&conf("", "", true), &[tagged, wrong, untagged], &[back]);
    assert_eq!(out.v6(&["vlan.id", "ipv6.dst"]), [format!("200\t{B4_A}")]);
    assert_eq!(out.v4(&["vlan.id", "ip.src"]), ["100\t178.79.150.233"]);
    assert_eq!(out.counter("vlan_drops"), 2);
}

#[test]
fn bad_configurations_name_their_line() {
    let err = refused(&default_conf().replace("psid 80;", "psid eighty;"));
    assert!(err.contains("bad.conf:line 4: `psid`"), "{err}");
}

/// `stitch lwaftr check` on configuration `text` (as `bad.conf`), which must fail: its stderr.
fn refused(text: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    let c = dir.path().join("bad.conf");
    std::fs::write(&c, text).unwrap();
    write(&dir.path().join("e.pcap"), &[]);
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_stitch"))
        .args(["lwaftr", "check"])
        .arg(&c)
        .args([dir.path().join("e.pcap"), dir.path().join("e.pcap")])
        .args([dir.path().join("o4"), dir.path().join("o6")])
        .output()
        .unwrap();
    assert!(!out.status.success());
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn a_next_hop_given_by_ip_is_resolved_by_neighbour_discovery() {
    // Snabb's own configuration with `next-hop { ip 8:9:a:b:4:3:2:1; }` inside.
    let c = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../apps/tests/data/tunnel_icmp_withoutmac.conf"),
    )
    .unwrap();
    let hop = "8:9:a:b:4:3:2:1";
    let hop_mac = [0x02, 0, 0, 0, 0, 0x99];
    let mut na = vec![136, 0, 0, 0, 0x60, 0, 0, 0];
    na.extend_from_slice(&v6(hop));
    na.extend_from_slice(&[2, 1]);
    na.extend_from_slice(&hop_mac);
    let na = eth(INT_MAC, hop_mac, 0x86dd, None, &icmp6(hop, BR, &na));
    // `lwaftr check` feeds 1024 packets a side per breath. Breath 1: 1024 packets wait for the
    // next hop (all a side keeps); breath 2: 1024 more find the queue full and are dropped,
    // then the advertisement (behind 1024 frames that are not IPv6) resolves the hop and the
    // waiting ones leave, in order; breath 3: the last packet leaves at once.
    let pkt = from_internet(ip4(plain("1.2.3.4", "178.79.150.233", 17), &udp(1, 80, 10)));
    let v4s: Vec<Vec<u8>> = std::iter::repeat_n(pkt, 2049).collect();
    let misplaced = eth(
        INT_MAC,
        hop_mac,
        0x0800,
        None,
        &ip4(plain("1.2.3.4", "5.6.7.8", 17), &udp(1, 2, 0)),
    );
    let mut v6s: Vec<Vec<u8>> = std::iter::repeat_n(misplaced, 1024).collect();
    v6s.push(na);
    let out = check(&c, &v4s, &v6s);
    assert_eq!(out.counter("next_hop_unresolved_drops"), 1024);
    let sent = out.v6(&["eth.dst", "ipv6.dst", "icmpv6.type"]);
    assert_eq!(sent.len(), 1 + 1025);
    // First, at start, the solicitation for the next hop (Snabb sends it as it starts).
    assert_eq!(sent[0], "33:33:ff:02:00:01\tff02::1:ff02:1\t135");
    assert!(sent[1..]
        .iter()
        .all(|l| *l == format!("02:00:00:00:00:99\t{B4_A}\t")));
}

#[test]
fn softwires_are_added_and_removed_at_run_time_through_the_api() {
    let dir = tempfile::tempdir().unwrap();
    let c = dir.path().join("lwaftr.conf");
    std::fs::write(&c, default_conf()).unwrap();
    let s = Stitch::run(&format!(
        "apps:\n  aftr: {{ type: lwaftr, conf: {} }}\n",
        c.display()
    ));
    let (st, t) = s.call("POST", "/api/v1/apps/aftr/query", Some("{}"));
    assert_eq!((st, &t["softwires"]), (200, &serde_json::json!(5)));
    let add = r#"{"command": "add_softwire", "ipv4": "192.0.2.7", "psid": 3, "psid_length": 8,
                  "b4": "2001:db8::7", "br": "8:9:a:b:c:d:e:f"}"#;
    let (st, r) = s.call("POST", "/api/v1/apps/aftr/query", Some(add));
    assert_eq!((st, &r["softwires"]), (200, &serde_json::json!(6)), "{r}");
    let (_, t) = s.call("POST", "/api/v1/apps/aftr/query", Some(r#"{"limit": 100}"#));
    assert!(
        t["list"]
            .as_array()
            .unwrap()
            .iter()
            .any(|x| x["b4"] == "2001:db8::7"),
        "{t}"
    );
    let (st, e) = s.call(
        "POST",
        "/api/v1/apps/aftr/query",
        Some(r#"{"command": "add_softwire", "ipv4": "x"}"#),
    );
    assert_eq!(st, 400);
    assert!(e["error"].as_str().unwrap().contains("ipv4"), "{e}");
    let del = r#"{"command": "remove_softwire", "ipv4": "192.0.2.7", "psid": 3}"#;
    let (st, r) = s.call("POST", "/api/v1/apps/aftr/query", Some(del));
    assert_eq!((st, &r["softwires"]), (200, &serde_json::json!(5)), "{r}");
    let (st, _) = s.call("POST", "/api/v1/apps/aftr/query", Some(del));
    assert_eq!(st, 400);
    s.stop();
}

/// IPv4 fragments of one packet, `chunk` payload bytes each (a multiple of 8).
fn fragments4(whole: &[u8], chunk: usize) -> Vec<Vec<u8>> {
    let body = &whole[20..];
    let mut out = Vec::new();
    let mut off = 0;
    while off < body.len() {
        let n = chunk.min(body.len() - off);
        let more = off + n < body.len();
        let mut h = whole[..20].to_vec();
        h[2..4].copy_from_slice(&((20 + n) as u16).to_be_bytes());
        let ff = (off / 8) as u16 | if more { 0x2000 } else { 0 };
        h[6..8].copy_from_slice(&ff.to_be_bytes());
        h[10..12].fill(0);
        let c = stitch_wire::checksum::checksum(&h);
        h[10..12].copy_from_slice(&c.to_be_bytes());
        h.extend_from_slice(&body[off..off + n]);
        out.push(h);
        off += n;
    }
    out
}

#[test]
fn ipv4_fragments_are_reassembled_before_encapsulation() {
    let whole = ip4(
        plain("1.2.3.4", "178.79.150.233", 17),
        &udp(40000, 80, 1000),
    );
    let mut frags: Vec<Vec<u8>> = fragments4(&whole, 400)
        .into_iter()
        .map(from_internet)
        .collect();
    frags.swap(0, 2); // out of order: the port arrives last
    let out = check(&default_conf(), &frags, &[]);
    assert_eq!(out.counter("reassembled"), 1);
    assert_eq!(
        out.v6(&[
            "ipv6.dst",
            "ipv6.plen",
            "ip.len",
            "ip.flags.mf",
            "ip.frag_offset",
            "udp.dstport",
            "ip.checksum.status"
        ]),
        [format!("{B4_A}\t1028\t1028\t0\t0\t80\t2")]
    );
}

#[test]
fn packets_above_the_internal_mtu_leave_in_ipv6_fragments() {
    // 2000 bytes of IPv4, DF clear; the tunnel MTU is 1460.
    let ip = ip4(
        plain("1.2.3.4", "178.79.150.233", 17),
        &udp(40000, 80, 1972),
    );
    let out = check(&conf("", "mtu 1460;", false), &[from_internet(ip)], &[]);
    assert_eq!(out.counter("fragmented"), 1);
    let dir = out.dir.path();
    let f = std::process::Command::new("tshark")
        .args(["-o", "ipv6.defragment:FALSE", "-r"])
        .arg(dir.join("out6.pcap"))
        .args([
            "-T",
            "fields",
            "-e",
            "ipv6.plen",
            "-e",
            "ipv6.fraghdr.nxt",
            "-e",
            "ipv6.fraghdr.offset",
            "-e",
            "ipv6.fraghdr.more",
            "-e",
            "ipv6.fraghdr.ident",
            "-e",
            "frame.len",
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&f.stdout);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(
        lines,
        // Offsets in 8-byte units: the second fragment starts at byte 1408.
        [
            "1416\t4\t0\t1\t0x42424243\t1470",
            "600\t4\t176\t0\t0x42424243\t654"
        ],
        "two fragments within the MTU"
    );
    // tshark puts them back together into the original datagram.
    assert_eq!(
        out.v6(&["udp.dstport", "ip.len"]).last().unwrap(),
        "80\t2000"
    );
}

#[test]
fn ipv6_fragments_from_a_b4_are_reassembled_and_big_packets_fragmented_toward_the_internet() {
    // A 2000-byte IPv4 packet from B4 A in two IPv6 fragments; the internet MTU is 1460, DF clear.
    let inner = ip4(plain("178.79.150.233", "1.2.3.4", 17), &udp(80, 443, 1972));
    let cut = 1200;
    let frag6 = |off: usize, more: bool, data: &[u8]| {
        let mut fh = vec![4, 0];
        fh.extend_from_slice(&(off as u16 | more as u16).to_be_bytes());
        fh.extend_from_slice(&0x1234u32.to_be_bytes());
        fh.extend_from_slice(data);
        eth(INT_MAC, INT_HOP, 0x86dd, None, &ip6(B4_A, BR, 44, &fh))
    };
    let out = check(
        &default_conf(),
        &[],
        &[
            frag6(cut, false, &inner[cut..]),
            frag6(0, true, &inner[..cut]),
        ],
    );
    assert_eq!(out.counter("reassembled"), 1);
    assert_eq!(out.counter("fragmented"), 1);
    let f = std::process::Command::new("tshark")
        .args(["-o", "ip.defragment:FALSE", "-r"])
        .arg(out.dir.path().join("out4.pcap"))
        .args([
            "-T",
            "fields",
            "-e",
            "ip.len",
            "-e",
            "ip.flags.mf",
            "-e",
            "ip.frag_offset",
            "-e",
            "ip.checksum.status",
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&f.stdout);
    assert_eq!(
        text.lines().collect::<Vec<_>>(),
        ["1460\t1\t0\t2", "560\t0\t180\t2"]
    );
}

#[test]
fn icmpv6_errors_about_tunnelled_packets_reach_the_ipv4_sender() {
    // What the function tunnelled toward B4 A: 1.2.3.4 → 178.79.150.233:80, DF set.
    let sent = ip4(
        Ip4 {
            flags_frag: 0x4000,
            ..plain("1.2.3.4", "178.79.150.233", 17)
        },
        &udp(40000, 80, 100),
    );
    let tunnelled = ip6(BR, B4_A, 4, &sent);
    let error = |kind: u8, code: u8, mtu: u32| {
        let mut body = vec![kind, code, 0, 0];
        body.extend_from_slice(&mtu.to_be_bytes());
        body.extend_from_slice(&tunnelled);
        eth(
            INT_MAC,
            INT_HOP,
            0x86dd,
            None,
            &icmp6("2001:db8::1", BR, &body),
        )
    };
    let out = check(
        &default_conf(),
        &[],
        &[error(2, 0, 1280), error(3, 0, 0), error(1, 3, 0)],
    );
    assert_eq!(out.counter("icmpv6_errors_relayed"), 3);
    assert_eq!(
        out.v4(&[
            "ip.src",
            "icmp.type",
            "icmp.code",
            "icmp.mtu",
            "icmp.checksum.status",
            "udp.dstport"
        ]),
        [
            "10.10.10.10,1.2.3.4\t3\t4\t1240\t1\t80",
            "10.10.10.10,1.2.3.4\t3\t1\t\t1\t80",
            "10.10.10.10,1.2.3.4\t3\t1\t\t1\t80",
        ]
    );
    // Not relayed when the internal side refuses incoming ICMP.
    let out = check(
        &conf("", "allow-incoming-icmp false;", false),
        &[],
        &[error(2, 0, 1280)],
    );
    assert_eq!(out.counter("icmpv6_errors_relayed"), 0);
}

#[test]
fn on_a_stick_one_port_carries_both_sides() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("lwaftr.conf"), default_conf()).unwrap();
    let to_b4 = from_internet(ip4(
        plain("1.2.3.4", "178.79.150.233", 17),
        &udp(40000, 80, 20),
    ));
    let from_b4 = from_b4(
        B4_A,
        BR,
        ip4(plain("178.79.150.233", "1.2.3.4", 17), &udp(80, 40000, 20)),
    );
    write(&dir.path().join("in.pcap"), &[to_b4, from_b4]);
    let stats = run_graph(
        dir.path(),
        "apps:\n  src: { type: pcap_source, file: in.pcap }\n  aftr: { type: lwaftr, conf: lwaftr.conf, on_a_stick: true }\n  out: { type: pcap_sink, file: out.pcap }\nlinks: [\"src.output -> aftr.wire\", \"aftr.wire -> out.input\"]\n",
        &[],
    );
    let c = &app(&stats, "aftr")["counters"];
    assert_eq!(
        (c["encapsulated"].as_u64(), c["decapsulated"].as_u64()),
        (Some(1), Some(1))
    );
    let mut seen = tshark_fields(
        &dir.path().join("out.pcap"),
        &["eth.type", "ipv6.dst", "ip.dst"],
    );
    seen.sort();
    assert_eq!(
        seen,
        [
            "0x0800\t\t1.2.3.4".to_string(),
            format!("0x86dd\t{B4_A}\t178.79.150.233"),
        ]
    );
}

/// `stitch lwaftr run` on real interfaces: a host on the internet side finds the function by
/// ARP and pings its external address.
#[test]
fn lwaftr_run_answers_arp_and_ping_on_an_interface() {
    require_root_and_tools(&["ping"]);
    let hosts = TwoHosts::new();
    must(&format!(
        "ip -n {} addr add 10.10.10.1/24 dev {}",
        hosts.ns[0], hosts.inner[0]
    ));
    let dir = tempfile::tempdir().unwrap();
    let c = dir.path().join("lwaftr.conf");
    std::fs::write(&c, default_conf()).unwrap();
    let run = Background(
        std::process::Command::new(env!("CARGO_BIN_EXE_stitch"))
            .args(["lwaftr", "run"])
            .arg(&c)
            .args([
                "--v4",
                &hosts.outer[0],
                "--v6",
                &hosts.outer[1],
                "--duration",
                "8",
            ])
            .args(["--name", &format!("lw{}", std::process::id())])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let t = std::time::Instant::now();
    loop {
        let o = hosts.exec(0, "ping -c 1 -W 1 10.10.10.10");
        if o.status.success() {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(6),
            "no answer from the lwAFTR"
        );
    }
    run.signal(libc::SIGINT);
    let out = run.finish();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("echo_replies") && text.contains("arp_replies"),
        "{text}"
    );
}

#[test]
fn extension_headers_in_front_of_the_tunnelled_packet_are_stepped_over() {
    let inner = ip4(plain("178.79.150.233", "1.2.3.4", 17), &udp(80, 443, 20));
    // A destination options header (8 bytes: next header 4, length 0, PadN) before the IPv4.
    let mut payload = vec![4, 0, 1, 4, 0, 0, 0, 0];
    payload.extend_from_slice(&inner);
    let f = eth(INT_MAC, INT_HOP, 0x86dd, None, &ip6(B4_A, BR, 60, &payload));
    let out = check(&default_conf(), &[], &[f]);
    assert_eq!(out.counter("decapsulated"), 1);
    assert_eq!(out.v4(&["ip.src", "udp.srcport"]), ["178.79.150.233\t80"]);
    // A header that claims to run past the packet is malformed.
    let mut bad = vec![4, 200, 0, 0, 0, 0, 0, 0];
    bad.extend_from_slice(&inner);
    let f = eth(INT_MAC, INT_HOP, 0x86dd, None, &ip6(B4_A, BR, 60, &bad));
    let out = check(&default_conf(), &[], &[f]);
    assert_eq!(out.counter("malformed_drops"), 1);
}

#[test]
fn ingress_and_egress_filters_drop_and_count_and_bad_ones_name_their_line() {
    // External side: only UDP comes in; internal side: nothing to port 9 leaves.
    let c = conf(
        r#"ingress-filter "udp";"#,
        r#"egress-filter "not (ip6 and ip6[40+22:2] = 9)";"#,
        false,
    );
    let udp80 = ip4(plain("1.2.3.4", "178.79.150.233", 17), &udp(40000, 80, 10));
    let udp9 = ip4(plain("1.2.3.4", "178.79.150.15", 17), &udp(40000, 9, 10));
    let tcp = ip4(plain("1.2.3.4", "178.79.150.233", 6), &tcp(40000, 80));
    let out = check(
        &c,
        &[
            from_internet(udp80),
            from_internet(udp9),
            from_internet(tcp),
        ],
        &[],
    );
    assert_eq!(out.v6(&["udp.dstport"]), ["80"]);
    assert_eq!(out.counter("ingress_filter_v4_drops"), 1);
    assert_eq!(out.counter("egress_filter_v6_drops"), 1);

    let err = refused(&conf("", r#"ingress-filter "ip6 and and";"#, false));
    assert!(
        err.contains("bad.conf:line 12: `ingress-filter`: filter `ip6 and and`"),
        "{err}"
    );
}
