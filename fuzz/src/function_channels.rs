//! A direct channel between two functions (seed 001's bypass) driven by functions that write
//! anything: indices, descriptors, handshake words, in any order, while Stitch's side takes
//! its steps. Never a panic, and no pool buffer is ever held by both functions or by neither
//! once accounted.
use std::sync::atomic::Ordering;
use stitch_nf::direct::{test_port, test_ring, Direct, SenderStep};
use stitch_nf::shm::{Consumer, Desc, Producer};

const BUFFERS: u32 = 256;

/// One input: a panic, a hang or a fault is a finding.
pub fn run(data: &[u8]) {
    let (a, held_a) = test_port("a", 1);
    let (b, held_b) = test_port("b", 2);
    {
        let mut h = held_a.lock();
        for i in 0..BUFFERS {
            h.hold(i);
        }
    }
    let d = Direct::new(&a, &b, 16).unwrap();
    let h = d.header();
    let ring = test_ring(&d);
    let mut tx = unsafe { Producer::gated(ring, &h.released.0) };
    let mut rx = Consumer::resuming(ring);
    let (mut sent, mut consumed) = (0u64, 0u64);
    for op in data.chunks(3) {
        let arg = *op.get(1).unwrap_or(&0) as u32 | (*op.get(2).unwrap_or(&0) as u32) << 8;
        match op[0] % 12 {
            0 => {
                if tx.free().unwrap_or(0) > 0 {
                    tx.put(Desc {
                        buffer: arg % (BUFFERS + 8),
                        offset: 0,
                        flags: 0,
                        len: arg,
                        stamp_lo: 0,
                    });
                }
            }
            1 => tx.publish(),
            2 => {
                for _ in 0..(arg % 8).min(rx.available().unwrap_or(0)) {
                    rx.take();
                }
                rx.release();
            }
            // Garbage words from either function.
            3 => h.ring.tail.0.store(arg, Ordering::Release),
            4 => h.ring.head.0.store(arg, Ordering::Release),
            5 => h.sender.0.store(arg % 4, Ordering::Release),
            6 => h.receiver.0.store(arg % 4, Ordering::Release),
            // Stitch's steps.
            7 => {
                sent += arg as u64 % 4;
                match d.sender_step(sent, arg & 0x100 == 0) {
                    SenderStep::Channel | SenderStep::FromNfThenChannel => {
                        if let Some((mut c, n)) = d.engine_reader() {
                            let mut ha = held_a.lock();
                            for _ in 0..n {
                                ha.release(c.take().buffer);
                            }
                            drop(ha);
                            d.engine_read_done(&c);
                        }
                    }
                    _ => {}
                }
            }
            8 => {
                consumed += arg as u64 % 4;
                d.receiver_pull(consumed, arg & 0x100 == 0);
            }
            9 => d.switch_progress(arg as u64, consumed),
            10 => d.end(),
            _ => d.receiver_left(),
        }
        assert!(
            !held_a.lock().shares_any(&held_b.lock()),
            "a buffer held by both"
        );
    }
}
